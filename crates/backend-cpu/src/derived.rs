//! Read-only memory ranges, and the copies kernels derive from them (packed weights).
//!
//! Why: a product over AVX-512 runs faster over a repacked copy of its weight, made once and
//! reused for every step. A copy like that is only correct while the bytes it came from do not
//! change, and it must not outlive them: a freed buffer's address can be reused by another
//! tensor. Buffers that alias weight bytes ([`crate::memory::Store::alias`]) are read-only for
//! their whole life, so a copy derived from them never goes stale while they live.
//!
//! Strategy: every read-only buffer registers its byte range here for as long as it lives (a
//! [`ReadOnlyGuard`] it holds); a kernel finds the range holding a view
//! ([`read_only_at`]) and asks it for the derived copy under a key that names the view (address,
//! strides, shape, dtype: [`DerivedKey`]), which is made on first use and kept in the range.
//! Dropping the guard (the buffer is freed or reallocated) removes the range and its copies.
//!
//! Invariants: a range is registered only over bytes that nothing writes while it is
//! registered, or that are written only after [`ReadOnlyGuard::invalidate`] (a weight buffer
//! the backend allocated, written by its upload); a derived copy is reachable only through its
//! range, so it goes when the range goes or is invalidated (a kernel that still runs on it holds
//! its own reference until it returns).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use lowsync_graph::DType;
use parking_lot::{Mutex, RwLock};

/// What a derived copy was made from: a view of a read-only range, and the kind of copy.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DerivedKey {
    /// The view's first byte.
    pub addr: usize,
    /// The view's shape and strides (elements), and dtype.
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub dtype: DType,
    /// Which kind of copy (e.g. "packed").
    pub kind: &'static str,
}

/// A copy being made or made: several threads asking at once make it once.
type Slot = Arc<OnceLock<Arc<dyn Any + Send + Sync>>>;

/// One registered read-only range.
pub(crate) struct ReadOnly {
    start: usize,
    len: usize,
    derived: Mutex<Vec<(DerivedKey, Slot)>>,
}

impl ReadOnly {
    /// The copy under `key`, made by `make` on first use. `make` runs outside every lock (it may
    /// fork onto the rayon pool); a second caller with the same key waits for the first.
    pub(crate) fn derived<T: Any + Send + Sync>(
        &self,
        key: DerivedKey,
        make: impl FnOnce() -> T,
    ) -> Option<Arc<T>> {
        let slot = {
            let mut d = self.derived.lock();
            match d.iter().find(|(k, _)| *k == key) {
                Some((_, s)) => s.clone(),
                None => {
                    let s = Slot::default();
                    d.push((key, s.clone()));
                    s
                }
            }
        };
        let v = slot.get_or_init(|| Arc::new(make()) as Arc<dyn Any + Send + Sync>);
        v.clone().downcast::<T>().ok()
    }

    /// A copy already made whose key `pick` accepts, if any (never makes one).
    pub(crate) fn find_derived<T: Any + Send + Sync>(
        &self,
        pick: impl Fn(&DerivedKey) -> bool,
    ) -> Option<Arc<T>> {
        let d = self.derived.lock();
        d.iter()
            .filter(|(k, _)| pick(k))
            .find_map(|(_, s)| s.get()?.clone().downcast::<T>().ok())
    }

    /// Copies derived from this range.
    #[cfg(test)]
    pub(crate) fn derived_count(&self) -> usize {
        self.derived.lock().len()
    }

    /// The range's first byte and length.
    #[cfg(test)]
    pub(crate) fn span(&self) -> (usize, usize) {
        (self.start, self.len)
    }
}

/// Registered ranges by (first byte, registration number).
type Ranges = BTreeMap<(usize, u64), Arc<ReadOnly>>;

fn ranges() -> &'static RwLock<Ranges> {
    static RANGES: OnceLock<RwLock<Ranges>> = OnceLock::new();
    RANGES.get_or_init(|| RwLock::new(Ranges::new()))
}

/// Keeps a range registered; dropping it removes the range and its derived copies.
pub(crate) struct ReadOnlyGuard {
    key: (usize, u64),
}

impl ReadOnlyGuard {
    /// Drops the range's derived copies: its bytes are about to be written (a weight buffer's
    /// upload, `crate::memory::Store::span_write`). The writer is ordered after every kernel
    /// that read them (the stream's order), so no product runs over a stale copy.
    pub(crate) fn invalidate(&self) {
        if let Some(r) = ranges().read().get(&self.key) {
            r.derived.lock().clear();
        }
    }
}

impl Drop for ReadOnlyGuard {
    fn drop(&mut self) {
        ranges().write().remove(&self.key);
    }
}

/// Registers `len` bytes at `start` as read-only until the guard drops.
///
/// The caller promises that nothing writes those bytes while the guard lives.
pub(crate) fn register_read_only(start: *const u8, len: usize) -> ReadOnlyGuard {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let key = (start as usize, NEXT.fetch_add(1, Ordering::Relaxed));
    let r = Arc::new(ReadOnly {
        start: start as usize,
        len,
        derived: Mutex::new(Vec::new()),
    });
    ranges().write().insert(key, r);
    ReadOnlyGuard { key }
}

/// The registered range that holds all of `[start, start + len)`, if any.
pub(crate) fn read_only_at(start: *const u8, len: usize) -> Option<Arc<ReadOnly>> {
    let (a, end) = (start as usize, (start as usize).checked_add(len)?);
    let rs = ranges().read();
    // Ranges start at or before `a`, nearest first; registered ranges rarely overlap (the
    // same weight aliased by two contexts), so the first that starts before is nearly always
    // the one.
    rs.range(..=(a, u64::MAX))
        .rev()
        .take(8)
        .map(|(_, r)| r)
        .find(|r| r.start + r.len >= end)
        .cloned()
}

/// Drops the pages of `[start, start + len)` from this process's resident memory where they
/// are a read-only file mapping (they refault from the file if read again); anonymous memory
/// and writable mappings are left alone. Only whole pages inside the span are released.
/// Returns the bytes released.
pub(crate) fn release_file_pages(start: *const u8, len: usize) -> usize {
    #[cfg(target_os = "linux")]
    {
        let (a, end) = (start as usize, start as usize + len);
        if !is_file_mapping(start, len) {
            return 0;
        }
        // The smallest page size Linux runs with: with larger pages, fewer whole pages fit.
        let page = 4096usize;
        let (lo, hi) = (a.next_multiple_of(page), end / page * page);
        if hi <= lo {
            return 0;
        }
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_DONTNEED: i32 = 4;
        // SAFETY: `[lo, hi)` lies inside a read-only file mapping that the caller's buffer
        // keeps mapped; MADV_DONTNEED on such a mapping drops resident pages only (a later
        // read refaults them from the file), so no byte anyone reads changes.
        let rc = unsafe { madvise(lo as *mut std::ffi::c_void, hi - lo, MADV_DONTNEED) };
        if rc == 0 {
            return hi - lo;
        }
        0
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (start, len);
        0
    }
}

/// Whether `[start, start + len)` lies in one mapping of this process that maps a file (an
/// inode) and is not writable (`/proc/self/maps`); false where that cannot be read.
pub(crate) fn is_file_mapping(start: *const u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        let (a, end) = (start as usize, start as usize + len);
        file_mapping_holds(a, end)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (start, len);
        false
    }
}

#[cfg(target_os = "linux")]
fn file_mapping_holds(a: usize, end: usize) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    maps.lines().any(|line| {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_off), Some(_dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return false;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            return false;
        };
        lo <= a && end <= hi && perms.starts_with('r') && !perms.contains('w') && inode != "0"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(addr: usize) -> DerivedKey {
        DerivedKey {
            addr,
            shape: vec![32, 4],
            strides: vec![1, 32],
            dtype: DType::Q4_0,
            kind: "test",
        }
    }

    #[test]
    fn a_derived_copy_is_made_once_and_goes_with_its_range() {
        let bytes = vec![7u8; 256];
        let guard = register_read_only(bytes.as_ptr(), bytes.len());
        let r = read_only_at(bytes[16..].as_ptr(), 64).expect("registered");
        let mut made = 0;
        for _ in 0..3 {
            let v = r.derived(key(r.span().0 + 16), || {
                made += 1;
                vec![1u8; 4]
            });
            assert_eq!(v.as_deref().map(Vec::len), Some(4));
        }
        assert_eq!(made, 1);
        assert_eq!(r.derived_count(), 1);
        let weak = Arc::downgrade(&r);
        drop(r);
        drop(guard);
        assert!(
            weak.upgrade().is_none(),
            "the range and its copies are gone"
        );
        assert!(read_only_at(bytes.as_ptr(), 16).is_none());
    }

    #[test]
    fn invalidating_a_range_drops_its_copies() {
        let bytes = [3u8; 64];
        let guard = register_read_only(bytes.as_ptr(), bytes.len());
        let r = read_only_at(bytes.as_ptr(), 64).expect("registered");
        let _ = r.derived(key(r.span().0), || 1u32);
        assert_eq!(r.derived_count(), 1);
        guard.invalidate();
        assert_eq!(r.derived_count(), 0);
    }

    #[test]
    fn a_span_past_the_range_is_not_read_only() {
        let bytes = [0u8; 128];
        let _g = register_read_only(bytes.as_ptr(), 64);
        assert!(read_only_at(bytes.as_ptr(), 64).is_some());
        assert!(read_only_at(bytes[32..].as_ptr(), 64).is_none());
    }

    #[test]
    fn anonymous_memory_is_never_released() {
        let bytes = vec![1u8; 1 << 16];
        assert_eq!(release_file_pages(bytes.as_ptr(), bytes.len()), 0);
        assert!(bytes.iter().all(|&b| b == 1));
    }
}
