//! Host memory of the CPU backends: 64-byte aligned, zeroed buffers in a table keyed by
//! [`BufferId`], and the bounds-checked address lookup kernels use.
//!
//! Why: `cpu` and `cpu-async` share kernels and buffer code but not buffers; each owns a
//! [`Store`], so a `cpu-async` buffer is not addressable through `cpu` (cross-backend copies
//! really happen).
//!
//! Zeroed memory is asked of the allocator at its own alignment (16 bytes), a little larger,
//! and the 64-byte aligned start is taken inside it: that request takes the allocator's
//! `calloc` path, where a large block is fresh pages that the kernel zeroes on first touch, so
//! a buffer costs resident memory only as far as it is written. (Asking for 64-byte alignment
//! directly makes the standard library allocate and then clear every byte itself, so a KV
//! cache of 8192 rows was resident in full from its creation, whatever a session used.)
//!
//! A weight's buffer may instead alias the weight's own immutable bytes ([`Store::alias`]):
//! a GGUF file's memory map is then read in place, so its pages are the only copy of the
//! weights on the host. Kernels take no alignment for granted (`kernels::view::Strided`: typed
//! fast paths check the address and fall back to unaligned reads; block rows are read as
//! bytes), so an aliased buffer needs only the 4-byte alignment that keeps f32/f16 weights on
//! the fast paths; less aligned bytes are copied as before.
//!
//! Invariants: a buffer's address never changes while it lives (`realloc` replaces it with a new
//! one after the owning stream is idle). An aliased buffer is read-only: every write primitive
//! goes through [`Store::span_write`], which refuses it, and kernels never write weights (only
//! `set_rows` writes into a leaf, and only into a persistent one). So an aliased buffer, and a
//! weight buffer allocated here (written only by its upload, through `span_write`), is
//! registered as weight memory while it lives (`crate::derived`): kernels may keep copies
//! derived from its bytes (packed weights), which go when the buffer is freed or replaced, or
//! (allocated ones) written.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;
use std::sync::Arc;

use lowsync_backend::{BufferId, BufferUsage, Error, Result, TensorRef};
use lowsync_graph::WeightBytes;
use parking_lot::RwLock;

use crate::derived::{is_file_mapping, register_read_only, ReadOnlyGuard};

/// Alignment of every host buffer the backend allocates.
pub const ALIGNMENT: usize = 64;

/// The alignment zeroed memory is requested at: at most the system allocator's own minimum,
/// so that `alloc_zeroed` is its `calloc` (lazily zeroed pages for large blocks).
const ZEROED_ALIGN: usize = 16;

/// The alignment weight bytes need to be aliased rather than copied (f32's, the largest
/// element of a weight dtype).
pub const ALIAS_ALIGNMENT: usize = 4;

/// Weights in a file mapping below this size are copied rather than aliased. The products
/// release a packed weight's file pages (`crate::derived::release_file_pages`), but the page
/// cache holds the file in large folios that a fault maps whole (2 MiB on the kernel this was
/// measured on): reading a norm weight in place every step mapped the released pages of its
/// neighbours back (21.5 MB of the small Q8_0 model's 117). A copy of the small tensors (tens of
/// KiB per model) leaves the released pages untouched.
pub const SMALL_FILE_WEIGHT_BYTES: usize = 64 << 10;

/// One zeroed, aligned allocation, or read-only weight bytes borrowed in place.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    size: usize,
    /// Where the allocation starts, before `ptr` (`ptr` is its first 64-byte aligned byte).
    base: NonNull<u8>,
    /// The aliased bytes, kept alive as long as the buffer (`None`: allocated here).
    aliased: Option<WeightBytes>,
    /// A weight buffer's registration (`crate::derived`), so that kernels may keep copies
    /// derived from it (packed weights) until the buffer is freed, replaced or written.
    weight_range: Option<ReadOnlyGuard>,
}

// SAFETY: the buffer is plain memory; concurrent access is ordered by the owning stream.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// A zeroed buffer, or an error naming the size when the host cannot provide it (never an
    /// abort: an oversized model or cache must leave the session usable — invariant 14).
    fn new(owner: &str, size: usize) -> Result<Self> {
        let oom = || Error::OutOfMemory {
            device: "host".into(),
            what: format!("a buffer of backend `{owner}`"),
            bytes: size,
        };
        let layout = zeroed_layout(size).ok_or_else(oom)?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let base = NonNull::new(raw).ok_or_else(oom)?;
        let skip = raw.align_offset(ALIGNMENT);
        debug_assert!(skip <= ALIGNMENT - ZEROED_ALIGN);
        // SAFETY: `skip` is less than the ALIGNMENT bytes the layout adds to `size`.
        let ptr = unsafe { base.add(skip) };
        Ok(HostBuffer {
            ptr,
            size,
            base,
            aliased: None,
            weight_range: None,
        })
    }

    /// A read-only buffer over `bytes`, or `None` when they are empty or not aligned to
    /// [`ALIAS_ALIGNMENT`].
    fn alias(bytes: &WeightBytes) -> Option<Self> {
        let b = bytes.as_bytes();
        if b.is_empty() || !(b.as_ptr() as usize).is_multiple_of(ALIAS_ALIGNMENT) {
            return None;
        }
        let ptr = NonNull::from(b).cast();
        Some(HostBuffer {
            ptr,
            size: b.len(),
            base: ptr,
            aliased: Some(bytes.clone()),
            weight_range: Some(register_read_only(b.as_ptr(), b.len())),
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Start address.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Whether the buffer reads borrowed weight bytes in place (and is read-only).
    pub fn is_alias(&self) -> bool {
        self.aliased.is_some()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.aliased.is_some() {
            // Not ours: dropping the handle releases the bytes.
            return;
        }
        let layout = zeroed_layout(self.size).expect("buffer layout");
        // SAFETY: allocated in `new` at `base` with this layout.
        unsafe { dealloc(self.base.as_ptr(), layout) }
    }
}

/// The layout a buffer of `size` bytes is allocated with: at [`ZEROED_ALIGN`], with room to
/// start at the next multiple of [`ALIGNMENT`]; `None` past the allocation limit.
fn zeroed_layout(size: usize) -> Option<Layout> {
    let padded = size.max(ALIGNMENT).checked_add(ALIGNMENT)?;
    Layout::from_size_align(padded, ZEROED_ALIGN).ok()
}

/// Hashes a [`BufferId`] (a process-unique counter) with one multiplication by a 64-bit odd
/// constant, whose high bits (where the table takes its control bytes) depend on every bit of
/// the id. Every tensor a kernel resolves looks its buffer up here (several per node, about two
/// thousand per decode step), where the standard SipHash is several times the cost of this.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached for `BufferId` (a `u64`); any other key still hashes every byte.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The buffer table's map.
type Table = HashMap<BufferId, Arc<HostBuffer>, BuildHasherDefault<IdHasher>>;

/// The buffers of one backend.
#[derive(Default)]
pub struct Store {
    owner: String,
    bufs: RwLock<Table>,
}

impl Store {
    /// An empty store for the backend called `owner` (used in error messages).
    pub fn new(owner: &str) -> Self {
        Store {
            owner: owner.to_string(),
            bufs: RwLock::new(Table::default()),
        }
    }

    /// Allocates a zeroed buffer.
    pub fn alloc(&self, size: usize) -> Result<BufferId> {
        self.alloc_for(size, BufferUsage::Compute)
    }

    /// Allocates a zeroed buffer for `usage`: a weight buffer is registered as weight memory
    /// (`crate::derived`), whose derived copies every write through [`Store::span_write`] drops.
    pub fn alloc_for(&self, size: usize, usage: BufferUsage) -> Result<BufferId> {
        let mut buf = HostBuffer::new(&self.owner, size)?;
        if usage == BufferUsage::Weights {
            buf.weight_range = Some(register_read_only(buf.ptr.as_ptr(), size));
        }
        let id = BufferId::fresh();
        self.bufs.write().insert(id, Arc::new(buf));
        Ok(id)
    }

    /// A read-only buffer reading `bytes` in place, or `None` when they cannot be aliased
    /// (empty or misaligned: the caller copies them into an allocated buffer), or are small
    /// weights in a file mapping ([`SMALL_FILE_WEIGHT_BYTES`]).
    pub fn alias(&self, bytes: &WeightBytes) -> Option<BufferId> {
        if bytes.len() < SMALL_FILE_WEIGHT_BYTES && is_file_mapping(bytes.as_ptr(), bytes.len()) {
            return None;
        }
        let buf = HostBuffer::alias(bytes)?;
        let id = BufferId::fresh();
        self.bufs.write().insert(id, Arc::new(buf));
        Some(id)
    }

    /// Replaces a buffer by a zeroed one of another size.
    pub fn realloc(&self, id: BufferId, size: usize) -> Result<()> {
        let mut bufs = self.bufs.write();
        let slot = bufs.get_mut(&id).ok_or_else(|| self.unknown(id))?;
        *slot = Arc::new(HostBuffer::new(&self.owner, size)?);
        Ok(())
    }

    /// Frees a buffer (a no-op for unknown ids).
    pub fn free(&self, id: BufferId) {
        self.bufs.write().remove(&id);
    }

    /// The buffer behind `id`.
    pub fn get(&self, id: BufferId) -> Result<Arc<HostBuffer>> {
        self.bufs
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| self.unknown(id))
    }

    fn unknown(&self, id: BufferId) -> Error {
        Error::UnknownBuffer(id.0, self.owner.clone())
    }

    /// Address of `len` bytes at `offset` of `id`, bounds-checked.
    pub fn span(&self, id: BufferId, offset: usize, len: usize) -> Result<*mut u8> {
        let b = self.get(id)?;
        check_span(&b, id, offset, len)?;
        // SAFETY: in bounds, checked above.
        Ok(unsafe { b.ptr.as_ptr().add(offset) })
    }

    /// As [`Store::span`], for a write: refuses a buffer that aliases weight bytes (they may
    /// be a read-only memory map, and other graphs read them).
    pub fn span_write(&self, id: BufferId, offset: usize, len: usize) -> Result<*mut u8> {
        let b = self.get(id)?;
        if let Some(range) = &b.weight_range {
            range.invalidate();
        }
        if b.is_alias() {
            return Err(Error::Unsupported {
                backend: self.owner.clone(),
                what: format!(
                    "writing buffer {}: it reads a weight's bytes in place (read-only)",
                    id.0
                ),
            });
        }
        self.span(id, offset, len)
    }
}

fn check_span(b: &HostBuffer, id: BufferId, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > b.size) {
        return Err(Error::OutOfBounds {
            buffer: id.0,
            offset,
            len,
            size: b.size,
        });
    }
    Ok(())
}

/// Resolves tensors to addresses for kernels.
pub trait Mem {
    /// Address of element `[0, .., 0]` of `t`, after checking that every element lies inside
    /// its buffer.
    fn ptr(&self, t: &TensorRef) -> Result<*mut u8>;
}

impl Mem for Store {
    fn ptr(&self, t: &TensorRef) -> Result<*mut u8> {
        self.span(t.buffer, t.byte_offset, t.byte_extent())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable_to_the_end() {
        let store = Store::new("cpu");
        for size in [0, 1, 15, 63, 64, 65, 4096, 1 << 20, (8 << 20) + 3] {
            let id = store.alloc(size).unwrap();
            let b = store.get(id).unwrap();
            assert_eq!(b.size(), size);
            assert_eq!(b.ptr().as_ptr() as usize % ALIGNMENT, 0, "size {size}");
            if size > 0 {
                let p = store.span_write(id, 0, size).unwrap();
                // SAFETY: `size` bytes at `p` belong to the buffer.
                let bytes = unsafe { std::slice::from_raw_parts_mut(p, size) };
                assert!(bytes.iter().all(|&x| x == 0), "size {size}");
                bytes.fill(0xAB);
            }
            store.realloc(id, size + 100).unwrap();
            let p = store.span(id, 0, size + 100).unwrap();
            // SAFETY: the reallocated buffer has `size + 100` bytes.
            assert!(unsafe { std::slice::from_raw_parts(p, size + 100) }
                .iter()
                .all(|&x| x == 0));
            store.free(id);
        }
    }

    #[test]
    fn an_oversized_buffer_is_an_out_of_memory_error() {
        let store = Store::new("cpu");
        assert!(matches!(
            store.alloc(usize::MAX - 8),
            Err(Error::OutOfMemory { .. })
        ));
    }

    /// This process's resident anonymous memory in KiB.
    #[cfg(target_os = "linux")]
    fn rss_anon_kib() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// A large buffer costs resident memory only where it is written (a KV cache of many rows
    /// of which a session uses a few): 256 MiB allocated, 8 MiB written, well under 64 MiB
    /// more resident (other threads of the test process allocate little meanwhile).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_is_resident_only_where_written() {
        const SIZE: usize = 256 << 20;
        const WRITTEN: usize = 8 << 20;
        let store = Store::new("cpu");
        let before = rss_anon_kib();
        let id = store.alloc(SIZE).unwrap();
        let p = store.span_write(id, SIZE / 2, WRITTEN).unwrap();
        // SAFETY: WRITTEN bytes from the middle of the buffer belong to it.
        unsafe { std::ptr::write_bytes(p, 1, WRITTEN) };
        let grown = rss_anon_kib().saturating_sub(before);
        assert!(
            (WRITTEN / 1024 / 2..(64 << 10)).contains(&grown),
            "a {SIZE}-byte buffer with {WRITTEN} bytes written grew RSS by {grown} KiB"
        );
        store.free(id);
    }
}
