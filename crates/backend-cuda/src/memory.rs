//! Device buffers and pinned host memory.
//!
//! Why: the scheduler allocates its arenas once per shape bucket and frees or reallocates them
//! rarely, but a re-reserve must not pay `cuMemFree`'s implicit device synchronisation or the
//! allocator's latency again. Pinned memory is what makes host-to-device copies asynchronous.
//!
//! Strategy: device buffers are plain `cuMemAlloc` allocations (never managed memory) in a table
//! keyed by [`BufferId`]; a freed buffer goes to a pool and is reused by a later allocation of a
//! similar size (its zeroing memset is queued on the stream, so it is ordered after any work
//! still reading the old contents). Pinned host memory is allocated with flags 0 — not
//! write-combined, so the host can also read it at full speed — or with `DEVICEMAP` for words
//! the device polls or writes (the test gate, the kernel error word). Scratch for nodes
//! (private copies of sources, matmul conversions) is one stream-ordered allocation, grown by
//! freeing and re-allocating it on the stream, so no work still using the old block loses it.
//!
//! Invariant: a buffer's device address never changes while it is in the table; memory is
//! returned to the driver only when the backend drops, after its stream is idle.

use std::collections::HashMap;

use cudarc::driver::{result, sys};
use lowsync_backend::{BufferId, Error, Result, TensorRef};
use parking_lot::{Mutex, RwLock};

use crate::driver::CuDriver;
use crate::tickets::TicketStream;

/// Alignment of every device buffer (and of the scheduler's offsets within them).
pub(crate) const ALIGNMENT: usize = 256;

/// One device allocation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevAlloc {
    pub ptr: u64,
    pub capacity: usize,
}

/// A live buffer: an allocation and the size the caller asked for (the bounds checked).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevBuf {
    pub alloc: DevAlloc,
    pub size: usize,
    /// Allocated for weights and never written by a kernel so far: only stream-ordered copies
    /// write it, so a kernel may read it before `griddepcontrol.wait` (see `CudaConfig::pdl`).
    /// Cleared for good when a graph with a node writing the buffer runs.
    pub weights: bool,
}

/// The device buffers of one backend, and the pool of freed allocations.
pub(crate) struct Buffers {
    owner: String,
    live: RwLock<HashMap<BufferId, DevBuf>>,
    pool: Mutex<Vec<DevAlloc>>,
}

impl Buffers {
    pub(crate) fn new(owner: &str) -> Self {
        Buffers {
            owner: owner.to_string(),
            live: RwLock::new(HashMap::new()),
            pool: Mutex::new(Vec::new()),
        }
    }

    /// A pooled allocation of at least `size` bytes and at most twice that (plus one
    /// alignment unit), best fit; `None` when the pool has none.
    pub(crate) fn take_pooled(&self, size: usize) -> Option<DevAlloc> {
        let mut pool = self.pool.lock();
        let limit = size.saturating_mul(2).saturating_add(ALIGNMENT);
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, a)| a.capacity >= size && a.capacity <= limit)
            .min_by_key(|(_, a)| a.capacity)
            .map(|(i, _)| i)?;
        Some(pool.swap_remove(best))
    }

    /// Allocates `size` bytes from the driver (the caller bound the context).
    pub(crate) fn alloc_new(&self, size: usize) -> std::result::Result<DevAlloc, String> {
        let capacity = size.max(1).next_multiple_of(ALIGNMENT);
        // SAFETY: a plain allocation; freed by `release_all`.
        unsafe { result::malloc_sync(capacity) }
            .map(|ptr| DevAlloc { ptr, capacity })
            .map_err(|e| {
                let (free, total) = result::mem_get_info().unwrap_or((0, 0));
                format!(
                    "cannot allocate {capacity} bytes of device memory ({e:?}; {free} of {total} \
                     bytes free)"
                )
            })
    }

    /// Frees every pooled allocation (after an out-of-memory error, with the stream idle).
    pub(crate) fn drain_pool(&self) {
        for a in self.pool.lock().drain(..) {
            // SAFETY: pooled allocations are not referenced by queued work (the caller
            // synchronized) and are freed once.
            let _ = unsafe { result::free_sync(a.ptr) };
        }
    }

    pub(crate) fn insert(&self, id: BufferId, buf: DevBuf) {
        self.live.write().insert(id, buf);
    }

    /// Removes a buffer and puts its allocation in the pool.
    pub(crate) fn remove_to_pool(&self, id: BufferId) -> Option<DevBuf> {
        let b = self.live.write().remove(&id)?;
        self.pool.lock().push(b.alloc);
        Some(b)
    }

    /// Whether kernels may read buffer `id` before waiting for the kernels queued before them
    /// (`DevBuf::weights`).
    pub(crate) fn is_weights(&self, id: BufferId) -> bool {
        self.live.read().get(&id).is_some_and(|b| b.weights)
    }

    /// Clears `DevBuf::weights` of every buffer in `written` (buffers some node writes). Runs
    /// for every eagerly queued graph, where no node writes weights: a scan under the read
    /// lock, the write lock only when a flag has to go.
    pub(crate) fn note_written(&self, written: impl Iterator<Item = BufferId>) {
        let hit: Vec<BufferId> = {
            let live = self.live.read();
            written
                .filter(|id| live.get(id).is_some_and(|b| b.weights))
                .collect()
        };
        if hit.is_empty() {
            return;
        }
        let mut live = self.live.write();
        for id in hit {
            if let Some(b) = live.get_mut(&id) {
                b.weights = false;
            }
        }
    }

    pub(crate) fn get(&self, id: BufferId) -> Result<DevBuf> {
        self.live
            .read()
            .get(&id)
            .copied()
            .ok_or_else(|| Error::UnknownBuffer(id.0, self.owner.clone()))
    }

    /// The device address of `len` bytes at `offset` of buffer `id`, bounds checked.
    pub(crate) fn span(&self, id: BufferId, offset: usize, len: usize) -> Result<u64> {
        let b = self.get(id)?;
        if offset.checked_add(len).is_none_or(|end| end > b.size) {
            return Err(Error::OutOfBounds {
                buffer: id.0,
                offset,
                len,
                size: b.size,
            });
        }
        Ok(b.alloc.ptr + offset as u64)
    }

    /// The device address of element `[0, ..]` of `t`, checked against its buffer and aligned
    /// for its dtype.
    pub(crate) fn tensor(&self, t: &TensorRef) -> Result<u64> {
        let p = self.span(t.buffer, t.byte_offset, t.byte_extent())?;
        if !t.byte_offset.is_multiple_of(t.dtype.size_bytes()) {
            return Err(Error::Unsupported {
                backend: self.owner.clone(),
                what: format!(
                    "a {} tensor at byte offset {} (not a multiple of its element size)",
                    t.dtype, t.byte_offset
                ),
            });
        }
        Ok(p)
    }

    /// Frees everything (backend drop, stream idle).
    pub(crate) fn release_all(&self) {
        for (_, b) in self.live.write().drain() {
            // SAFETY: the stream is idle; each allocation is freed once.
            let _ = unsafe { result::free_sync(b.alloc.ptr) };
        }
        self.drain_pool();
    }
}

/// Page-locked host memory.
pub(crate) struct Pinned {
    ptr: *mut u8,
    len: usize,
    dev: u64,
}

// SAFETY: plain memory; access is ordered by the owning stream and its tickets.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `len` bytes with flags 0 (cached, not write-combined): staging and readback.
    pub(crate) fn staging(len: usize) -> std::result::Result<Self, String> {
        Self::alloc(len, 0)
    }

    /// `len` bytes the device can address (`DEVICEMAP`): words the device polls or writes.
    pub(crate) fn mapped(len: usize) -> std::result::Result<Self, String> {
        Self::alloc(len, sys::CU_MEMHOSTALLOC_DEVICEMAP)
    }

    fn alloc(len: usize, flags: u32) -> std::result::Result<Self, String> {
        let len = len.max(64);
        // SAFETY: an allocation freed in `Drop`; the caller bound the context.
        let ptr = unsafe { result::malloc_host(len, flags) }
            .map_err(|e| format!("cannot allocate {len} bytes of pinned host memory: {e:?}"))?
            .cast::<u8>();
        // SAFETY: zeroing memory just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        let mut dev = 0u64;
        if flags & sys::CU_MEMHOSTALLOC_DEVICEMAP != 0 {
            // SAFETY: `ptr` is mapped pinned memory.
            let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) };
            if let Err(e) = r.result() {
                // SAFETY: allocated above.
                let _ = unsafe { result::free_host(ptr.cast()) };
                return Err(format!("cannot map pinned memory for the device: {e:?}"));
            }
        }
        Ok(Pinned { ptr, len, dev })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The device address of a `mapped` allocation (0 otherwise).
    pub(crate) fn dev(&self) -> u64 {
        self.dev
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`, freed once; owners drop pinned memory only when no
        // queued copy reads it (the backend synchronizes before dropping).
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The argmax key of decode's head (`mul_mat_vec_1_argmax` folds its blocks' keys into it,
/// `argmax_take` reads it and sets it back to 0): one device word, allocated and zeroed once at
/// open, so the head never asks for scratch (whose growth would bump the memory generation and
/// re-capture graphs).
pub(crate) struct HeadWork {
    ptr: u64,
}

// SAFETY: a device address; kernels on the owning stream use it, one head at a time.
unsafe impl Send for HeadWork {}
unsafe impl Sync for HeadWork {}

impl HeadWork {
    /// The zeroed word (the caller bound the context; nothing is queued yet).
    pub(crate) fn new() -> std::result::Result<Self, String> {
        // SAFETY: a plain allocation, freed in `Drop`.
        let ptr = unsafe { result::malloc_sync(ALIGNMENT) }
            .map_err(|e| format!("cannot allocate {ALIGNMENT} bytes of device memory: {e:?}"))?;
        let work = HeadWork { ptr };
        // SAFETY: the allocation above, whole.
        unsafe { result::memset_d8_sync(ptr, 0, ALIGNMENT) }
            .map_err(|e| format!("cannot zero device memory: {e:?}"))?;
        Ok(work)
    }

    /// The key word (u64).
    pub(crate) fn key(&self) -> u64 {
        self.ptr
    }
}

impl Drop for HeadWork {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once; the backend drops it with its stream idle
        // and its context bound.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Floats of one partials slot of `attn_split` (`AF_PW` in fusion/attention.cu: the chunk's max
/// and sum, then up to `ATT_MAXD` = 256 dims, padded to 16 bytes).
pub(crate) const ATTN_SPLIT_SLOT_FLOATS: usize = 260;

/// The tickets and partials of `attn_split` (decode attention split over keys): a zeroed
/// ticket word per query head and a slot of [`ATTN_SPLIT_SLOT_FLOATS`] per block, allocated
/// once at open like [`HeadWork`], so the split never asks for scratch (whose growth would bump
/// the memory generation and re-capture graphs). Every attention launch of the stream shares
/// them: launches run one after another, and the kernel leaves every ticket at 0.
pub(crate) struct AttnSplitWork {
    ptr: u64,
    slots: usize,
}

// SAFETY: a device address; kernels on the owning stream use it, one launch at a time.
unsafe impl Send for AttnSplitWork {}
unsafe impl Sync for AttnSplitWork {}

impl AttnSplitWork {
    /// Room for `slots` blocks (and as many ticket words), tickets zeroed (the caller bound the
    /// context; nothing is queued yet).
    pub(crate) fn new(slots: usize) -> std::result::Result<Self, String> {
        let bytes = Self::partials_offset(slots) + slots * ATTN_SPLIT_SLOT_FLOATS * 4;
        // SAFETY: a plain allocation, freed in `Drop`.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| format!("cannot allocate {bytes} bytes of device memory: {e:?}"))?;
        let work = AttnSplitWork { ptr, slots };
        // SAFETY: the allocation above, whole.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }
            .map_err(|e| format!("cannot zero device memory: {e:?}"))?;
        Ok(work)
    }

    fn partials_offset(slots: usize) -> usize {
        (slots * 4).next_multiple_of(ALIGNMENT)
    }

    /// Blocks a launch may use (partial slots; ticket words).
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// The ticket words (u32, one per query head).
    pub(crate) fn tickets(&self) -> u64 {
        self.ptr
    }

    /// The partials (f32 slots of [`ATTN_SPLIT_SLOT_FLOATS`]).
    pub(crate) fn partials(&self) -> u64 {
        self.ptr + Self::partials_offset(self.slots) as u64
    }
}

impl Drop for AttnSplitWork {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once; the backend drops it with its stream idle
        // and its context bound.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// The backend's scratch memory: one stream-ordered allocation.
#[derive(Default)]
pub(crate) struct Scratch {
    ptr: u64,
    cap: usize,
    /// Times the block moved (captured graphs hold its address).
    moves: u64,
}

impl Scratch {
    /// At least `need` bytes; growing frees the old block on the stream (after the work that
    /// uses it) and allocates a new one.
    pub(crate) fn ensure(
        &mut self,
        stream: &TicketStream<CuDriver>,
        need: usize,
    ) -> std::result::Result<u64, String> {
        if need <= self.cap && self.ptr != 0 {
            return Ok(self.ptr);
        }
        if stream.is_capturing() {
            // An allocation would be recorded into the graph; the eager run that precedes
            // every capture sizes the block, so this only happens for a graph that cannot be
            // captured — it falls back to eager launches.
            return Err(format!(
                "scratch would grow to {need} bytes during a graph capture"
            ));
        }
        self.moves += 1;
        let new_cap = need.next_power_of_two().max(1 << 20);
        if self.ptr != 0 {
            // SAFETY: allocated by `malloc_async` on this stream; later work gets the new block.
            unsafe { stream.free_async(self.ptr) }.map_err(|e| format!("cuMemFreeAsync: {e:?}"))?;
            self.ptr = 0;
            self.cap = 0;
        }
        // SAFETY: used only by work queued after this call.
        self.ptr = unsafe { stream.malloc_async(new_cap) }
            .map_err(|e| format!("cannot allocate {new_cap} bytes of scratch: {e:?}"))?;
        self.cap = new_cap;
        Ok(self.ptr)
    }

    /// How many times the block moved (a captured graph is stale after a move).
    pub(crate) fn moves(&self) -> u64 {
        self.moves
    }

    /// Frees the block (backend drop).
    pub(crate) fn release(&mut self, stream: &TicketStream<CuDriver>) {
        if self.ptr != 0 {
            // SAFETY: as in `ensure`.
            let _ = unsafe { stream.free_async(self.ptr) };
            self.ptr = 0;
            self.cap = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(ptr: u64, weights: bool) -> DevBuf {
        DevBuf {
            alloc: DevAlloc {
                ptr,
                capacity: ALIGNMENT,
            },
            size: 64,
            weights,
        }
    }

    #[test]
    fn a_weights_buffer_a_graph_writes_loses_its_read_ahead_for_good() {
        let bufs = Buffers::new("cuda:test");
        let (w, other, act) = (BufferId(1), BufferId(2), BufferId(3));
        bufs.insert(w, buf(0x1000, true));
        bufs.insert(other, buf(0x2000, true));
        bufs.insert(act, buf(0x3000, false));
        assert!(bufs.is_weights(w) && bufs.is_weights(other));
        assert!(
            !bufs.is_weights(act),
            "compute buffers are never read ahead"
        );
        assert!(!bufs.is_weights(BufferId(99)), "an unknown buffer is not");
        bufs.note_written([act, w].into_iter());
        assert!(!bufs.is_weights(w), "written by a node");
        assert!(bufs.is_weights(other), "untouched");
        bufs.note_written(std::iter::empty());
        assert!(!bufs.is_weights(w), "stays cleared");
    }
}
