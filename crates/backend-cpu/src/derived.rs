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
    /// Whether the range lies in a read-only file mapping (looked up once, on first use).
    file: OnceLock<bool>,
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
        file: OnceLock::new(),
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
    let (a, end) = (start as usize, start as usize + len);
    if !is_file_mapping(start, len) {
        return 0;
    }
    let (lo, hi) = (a.next_multiple_of(PAGE), end / PAGE * PAGE);
    // SAFETY: `[lo, hi)` lies inside the read-only file mapping just checked, which the
    // caller's buffer keeps mapped.
    unsafe { drop_pages(lo, hi) }
}

/// The smallest page size Linux runs with: with larger pages, fewer whole pages fit.
const PAGE: usize = 4096;

/// The most memory one fault in a file mapping may map: the page cache holds a file in large
/// folios, and a fault maps a whole PMD-sized one (2 MiB) where it can.
const FAULT_SPAN: usize = 2 << 20;

/// After a kernel read rows of a read-only range in place (`rows`: each row's first byte and
/// length; a gather of embedding rows), drops the file pages mapped around them, where the
/// range is a read-only file mapping. Returns the bytes released.
///
/// Why: a token embedding that no product reads is never packed, so its rows are read from the
/// file mapping, and each read maps the whole folio around the row. A 128-token prompt mapped
/// 24 of the 25.5 MB of the small Q8_0 model's embedding, which stayed resident for the
/// session's life (the packed weights' own file pages are released). Released, a row costs a
/// minor fault the next time it is read, and the pages stay in the page cache.
///
/// Strategy: the 2 MiB spans that hold a row, merged into runs and clipped to the range's
/// pages, are released with `MADV_DONTNEED`; rows outside the range of the first row are
/// ignored. Anything but a registered read-only file mapping releases nothing. Where a whole
/// folio was mapped with one entry, releasing part of it unmaps all of it, so a neighbour's
/// pages in the same 2 MiB may need one more fault (a minor one: they stay in the page cache).
pub(crate) fn release_rows_read(rows: &[(usize, usize)]) -> usize {
    let Some(&(a, len)) = rows.first() else {
        return 0;
    };
    let Some(range) = read_only_at(a as *const u8, len.max(1)) else {
        return 0;
    };
    let (start, end) = (range.start, range.start + range.len);
    if !*range
        .file
        .get_or_init(|| is_file_mapping(start as *const u8, range.len))
    {
        return 0;
    }
    let mut spans: Vec<usize> = rows
        .iter()
        .filter(|&&(a, len)| start <= a && a + len <= end && len > 0)
        .flat_map(|&(a, len)| a / FAULT_SPAN..=(a + len - 1) / FAULT_SPAN)
        .collect();
    spans.sort_unstable();
    spans.dedup();
    // The pages holding the range's first and last bytes lie in its mapping (mappings are
    // whole pages), so the clip rounds outward.
    let (lo, hi) = (start / PAGE * PAGE, end.next_multiple_of(PAGE));
    let mut released = 0;
    let mut i = 0;
    while i < spans.len() {
        let mut j = i;
        while j + 1 < spans.len() && spans[j + 1] == spans[j] + 1 {
            j += 1;
        }
        let (from, to) = (
            lo.max(spans[i] * FAULT_SPAN),
            hi.min((spans[j] + 1) * FAULT_SPAN),
        );
        if from < to {
            // SAFETY: `[from, to)` lies in the pages of a registered read-only range that
            // lies in one read-only file mapping (checked above), kept mapped by its buffer
            // while registered.
            released += unsafe { drop_pages(from, to) };
        }
        i = j + 1;
    }
    released
}

/// `MADV_DONTNEED` over the page-aligned `[lo, hi)`; returns the bytes released (0 on failure
/// or off Linux).
///
/// # Safety
/// `[lo, hi)` lies in a read-only file mapping of this process: dropping its resident pages
/// changes no byte anyone reads (a later read refaults them from the file).
unsafe fn drop_pages(lo: usize, hi: usize) -> usize {
    #[cfg(target_os = "linux")]
    {
        if hi <= lo {
            return 0;
        }
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_DONTNEED: i32 = 4;
        // SAFETY: the caller's contract: a read-only file mapping, so only resident pages go.
        let rc = unsafe { madvise(lo as *mut std::ffi::c_void, hi - lo, MADV_DONTNEED) };
        if rc == 0 {
            hi - lo
        } else {
            0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (lo, hi);
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

    /// Resident pages of `[lo, hi)` in this process (`/proc/self/pagemap`'s present bit).
    #[cfg(target_os = "linux")]
    fn resident_pages(lo: usize, hi: usize) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        (lo / PAGE..hi.div_ceil(PAGE))
            .filter(|&p| {
                let mut e = [0u8; 8];
                f.seek(SeekFrom::Start(p as u64 * 8)).expect("seek");
                f.read_exact(&mut e).expect("read");
                u64::from_le_bytes(e) >> 63 == 1
            })
            .count()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn rows_read_from_a_file_mapping_are_released_and_read_again() {
        use std::io::Write;
        extern "C" {
            fn mmap(
                a: *mut std::ffi::c_void,
                l: usize,
                p: i32,
                f: i32,
                fd: i32,
                o: i64,
            ) -> *mut std::ffi::c_void;
            fn munmap(a: *mut std::ffi::c_void, l: usize) -> i32;
        }
        use std::os::fd::AsRawFd;
        const MB: usize = 1 << 20;
        let len = 8 * MB;
        let path = std::env::temp_dir().join(format!("lowsync-rows-{}.bin", std::process::id()));
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&bytes)
            .unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a fresh private read-only mapping of the whole file (PROT_READ 1,
        // MAP_PRIVATE 2), unmapped below.
        let base = unsafe { mmap(std::ptr::null_mut(), len, 1, 2, file.as_raw_fd(), 0) };
        assert_ne!(base as isize, -1, "mmap failed");
        let base = base as usize;
        // A "table" of 1 MiB rows from byte 1 MiB + 100 to 7 MiB + 100, registered read-only.
        let (t0, t_len) = (base + MB + 100, 6 * MB);
        let guard = register_read_only(t0 as *const u8, t_len);
        // SAFETY: inside the mapping, which lives until `munmap`.
        let read = |a: usize, n: usize| unsafe {
            std::slice::from_raw_parts(a as *const u8, n)
                .iter()
                .map(|&b| u64::from(b))
                .sum::<u64>()
        };
        let rows = [(t0 + 10, 4000), (t0 + 5 * MB, 3000)];
        let sums: Vec<u64> = rows.iter().map(|&(a, n)| read(a, n)).collect();
        assert!(resident_pages(t0, t0 + t_len) >= 2);
        let released = release_rows_read(&rows);
        assert!(released >= 2 * PAGE, "{released}");
        assert_eq!(resident_pages(t0, t0 + t_len), 0);
        // Bytes outside every registered range are never released. (The first page's mapping
        // may have gone with the rows': a fault can map a 2 MiB folio with one entry, and
        // releasing part of it unmaps all of it; the pages stay in the page cache.)
        assert_eq!(
            release_rows_read(&[(base, 1)]),
            0,
            "not in a registered range"
        );
        // The rows read the same bytes again.
        let again: Vec<u64> = rows.iter().map(|&(a, n)| read(a, n)).collect();
        assert_eq!(sums, again);
        drop(guard);
        // SAFETY: the mapping made above; nothing reads it any more.
        unsafe { munmap(base as *mut std::ffi::c_void, len) };
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn rows_of_anonymous_memory_are_never_released() {
        let bytes = vec![3u8; 1 << 16];
        let _g = register_read_only(bytes.as_ptr(), bytes.len());
        assert_eq!(release_rows_read(&[(bytes.as_ptr() as usize, 100)]), 0);
        assert!(bytes.iter().all(|&b| b == 3));
    }

    #[test]
    fn anonymous_memory_is_never_released() {
        let bytes = vec![1u8; 1 << 16];
        assert_eq!(release_file_pages(bytes.as_ptr(), bytes.len()), 0);
        assert!(bytes.iter().all(|&b| b == 1));
    }
}
