//! Host data in and out: blocking and staged writes, writes on the transfer route, blocking
//! and queued reads.
//!
//! Why: S1's staged write is the heart of the one-wait decode step: the host bytes are copied
//! before the call returns (the caller may overwrite them at once), and the device copy runs
//! behind the work already queued, with no host wait. The other host transfers of the
//! contract are built from the same pieces, so they live here together.
//!
//! Strategy: a write goes (a) straight into mapped memory when the buffer is host-writable and
//! the stream is idle by its tickets — no copy on the device at all; or (b) into the staging
//! arena by memcpy, with the copy recorded in the compute stream; or (c) for a
//! `cpy_tensor_async` above the crossover, into staging and then its own submission on the
//! transfer route (`crate::transfer`). Reads copy into the readback arena and land in caller
//! memory at the wait that observes them. Data larger than an arena's biggest region goes in
//! pieces.
//!
//! Invariants: staging is bounded (invariant 8): when the arena is full, what completed is
//! reclaimed and, failing that, the device is waited on (counted); a blocking call is exactly
//! one host wait unless its data exceeds the staging cap (then one more per refill, counted).

use std::sync::atomic::Ordering;

use ash::vk;
use lowsync_backend::{bump, BufferId, Error, Result};
use parking_lot::MutexGuard;

use crate::device::unavailable;
use crate::memory::Region;
use crate::stream::{PendingRead, ReadTarget, State};
use crate::sync::Inner;
use crate::timeline::Retire;

impl Inner {
    /// Queues a read of `src` into a readback region; the bytes land in `target` at the wait
    /// that observes it. With `submit` the open work is submitted at once, so the read
    /// completes without another call. Returns the point to wait for.
    pub(crate) fn queue_read(
        &self,
        src: BufferId,
        offset: usize,
        len: usize,
        submit: bool,
        target: impl FnOnce() -> ReadTarget,
    ) -> Result<Retire> {
        let mut st = self.state.lock();
        Inner::check_span(&st, &self.name, src, offset, len)?;
        bump(&self.stats.d2h_copies, 1);
        bump(&self.stats.d2h_bytes, len as u64);
        if len == 0 {
            return Ok(Retire::default());
        }
        if len as u64 > st.readback.max_region() {
            return Err(Error::Unsupported {
                backend: self.name.clone(),
                what: format!(
                    "asynchronous reads above {} bytes",
                    st.readback.max_region()
                ),
            });
        }
        let vk_src = st.buffers[&src].buffer;
        let mut region = None;
        for attempt in 0..2 {
            let retire = st.open_retire();
            region = st
                .alloc_readback(len as u64, retire, self.device())?
                .map(|r| (r, retire));
            if region.is_some() || attempt == 1 {
                break;
            }
            // The readback arena is full of reads in flight: wait for them (counted) and retry.
            drop(st);
            self.synchronize()?;
            st = self.state.lock();
        }
        let Some((region, retire)) = region else {
            return Err(unavailable("readback arena exhausted"));
        };
        st.record_copy(
            self.device(),
            (vk_src, offset as u64),
            (region.buffer, region.offset),
            len as u64,
        )?;
        st.pending_reads.push(PendingRead {
            retire,
            src: region.ptr,
            out: target(),
            len,
        });
        if submit {
            st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        }
        Ok(st.end_point())
    }

    /// Checks `offset..offset+len` against buffer `id`.
    pub(crate) fn check_span(
        st: &State,
        name: &str,
        id: BufferId,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let b = st
            .buffers
            .get(&id)
            .ok_or_else(|| Error::UnknownBuffer(id.0, name.to_string()))?;
        if offset.checked_add(len).is_none_or(|e| e as u64 > b.size) {
            return Err(Error::OutOfBounds {
                buffer: id.0,
                offset,
                len,
                size: b.size as usize,
            });
        }
        Ok(())
    }

    /// A staging region of `len` bytes for work retiring at `retire`, waiting for the device
    /// (counted) when the arena is at its cap and nothing completed can be reclaimed.
    fn staging_region<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        len: u64,
        retire: impl Fn(&State) -> Retire,
    ) -> Result<(MutexGuard<'a, State>, Region)> {
        for attempt in 0..4 {
            let r = retire(&st);
            let State {
                staging, allocator, ..
            } = &mut *st;
            let allocator = allocator
                .as_mut()
                .ok_or_else(|| unavailable("the backend is shutting down"))?;
            if let Some(region) = staging.alloc(len, 16, r, self.device(), allocator)? {
                bump(&self.stats.staging_bytes_in_use, len);
                return Ok((st, region));
            }
            // Bounded staging (invariant 8): reclaim what completed, else wait for the device.
            st.poll(self.device());
            st.reclaim(&self.dev, &self.stats)?;
            if attempt > 0 {
                self.drain(st)?;
                st = self.state.lock();
            }
        }
        Err(unavailable(format!("no staging memory for {len} bytes")))
    }

    /// Queues a write of `data` into `dst` behind all queued work: memcpy into staging now,
    /// copy in the compute stream later. Large data goes in arena-sized pieces.
    pub(crate) fn staged_write(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let mut st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        bump(&self.stats.h2d_copies, 1);
        bump(&self.stats.h2d_bytes, data.len() as u64);
        if data.is_empty() {
            return Ok(());
        }
        let b = &st.buffers[&dst];
        if let (Some(p), false) = (b.write_ptr, st.outstanding()) {
            // The stream is idle by its tickets: nothing queued can read or write these bytes.
            // SAFETY: bounds checked; mapped coherent memory no pending work uses.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(offset), data.len())
            };
            bump(&self.routes.direct_writes, 1);
            return Ok(());
        }
        let vk_dst = b.buffer;
        let piece = st.staging.max_region() as usize;
        for (i, chunk) in data.chunks(piece.max(1)).enumerate() {
            let (g, region) = self.staging_region(st, chunk.len() as u64, State::open_retire)?;
            st = g;
            // SAFETY: a fresh staging region of `chunk.len()` bytes that no pending copy reads.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), region.ptr, chunk.len()) };
            st.record_copy(
                self.device(),
                (region.buffer, region.offset),
                (vk_dst, (offset + i * piece) as u64),
                chunk.len() as u64,
            )?;
        }
        Ok(())
    }

    /// A copy of host bytes on the transfer route: its own submission, after queued compute
    /// work (invariant 2), signalling the transfer timeline the next compute submit waits on.
    fn transfer_write(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let mut st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        if data.len() as u64 > st.staging.max_region() {
            drop(st);
            return self.staged_write(dst, offset, data);
        }
        bump(&self.stats.h2d_copies, 1);
        bump(&self.stats.h2d_bytes, data.len() as u64);
        // Queued compute work that may read `dst` goes first, so this copy can wait on it.
        st.submit_open(&self.dev, &self.stats, vk::Fence::null())?;
        let vk_dst = st.buffers[&dst].buffer;
        let (g, region) = self.staging_region(st, data.len() as u64, |s| Retire {
            compute: 0,
            transfer: s.transfer.as_ref().map_or(0, |t| t.tl.submitted + 1),
        })?;
        st = g;
        // SAFETY: a fresh staging region that no pending copy reads.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), region.ptr, data.len()) };
        let compute_value = st.compute.submitted;
        let mut waits = Vec::new();
        let t_next = st.transfer.as_ref().map_or(0, |t| t.tl.submitted + 1);
        for s in st.signals.iter_mut().filter(|s| s.pending) {
            if !s.signaled.load(Ordering::Acquire) {
                waits.push((s.sem, 1u64));
                s.last_waited = s.last_waited.max(Retire {
                    compute: 0,
                    transfer: t_next,
                });
            }
        }
        if compute_value > 0 {
            waits.push((self.compute_sem, compute_value));
        }
        let Some(t) = st.transfer.as_mut() else {
            return Err(unavailable("no transfer route"));
        };
        let copy = vk::BufferCopy {
            src_offset: region.offset,
            dst_offset: offset as u64,
            size: data.len() as u64,
        };
        t.submit_copy(
            &self.dev.device,
            &self.stats,
            region.buffer,
            vk_dst,
            copy,
            &waits,
        )?;
        bump(&self.routes.transfer_copies, 1);
        bump(&self.routes.transfer_bytes, data.len() as u64);
        Ok(())
    }

    /// A host-computed tensor copied by `cpy_tensor_async`: on the transfer route above the
    /// crossover, else staged in the compute stream (counted per route).
    pub(crate) fn routed_write(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        if self.routing.takes_transfer(data.len() as u64) {
            self.transfer_write(dst, offset, data)
        } else {
            self.staged_write(dst, offset, data)?;
            bump(&self.routes.compute_stream_copies, 1);
            bump(&self.routes.compute_stream_bytes, data.len() as u64);
            Ok(())
        }
    }

    /// Blocking write: ordered after queued work, one host wait (none when the buffer is
    /// host-writable and the stream idle).
    pub(crate) fn set_tensor(&self, dst: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        let st = self.state.lock();
        Self::check_span(&st, &self.name, dst, offset, data.len())?;
        if let Some(p) = st.buffers[&dst].write_ptr {
            bump(&self.stats.h2d_copies, 1);
            bump(&self.stats.h2d_bytes, data.len() as u64);
            // Queued work may read or write these bytes: wait for it first.
            self.drain(st)?;
            let st = self.state.lock();
            // The buffer may have been freed while unlocked.
            Self::check_span(&st, &self.name, dst, offset, data.len())?;
            // SAFETY: bounds checked; the stream is idle, so no device access races this.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(offset), data.len())
            };
            return Ok(());
        }
        drop(st);
        self.staged_write(dst, offset, data)?;
        let st = self.state.lock();
        if self.config.legacy_submits {
            // ggml: one submit carrying the copy and a fence, then a fence wait.
            let mut st = st;
            let fence = st.legacy_fence;
            st.submit_open(&self.dev, &self.stats, fence)?;
            let target = Retire {
                compute: st.compute.submitted,
                transfer: 0,
            };
            drop(st);
            self.fence_wait(fence)?;
            return self.state.lock().complete(&self.dev, &self.stats, target);
        }
        self.drain(st)
    }

    /// Blocking read: ordered after queued work, one host wait (none when the buffer is
    /// host-readable and the stream idle).
    pub(crate) fn get_tensor(&self, src: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let st = self.state.lock();
        Self::check_span(&st, &self.name, src, offset, out.len())?;
        bump(&self.stats.d2h_copies, 1);
        bump(&self.stats.d2h_bytes, out.len() as u64);
        let b = &st.buffers[&src];
        if let (Some(p), true) = (b.write_ptr, b.host_read) {
            self.drain(st)?;
            let st = self.state.lock();
            Self::check_span(&st, &self.name, src, offset, out.len())?;
            // SAFETY: bounds checked; the stream is idle and device writes were made visible
            // to the host by the closing barrier of their submission.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr().add(offset), out.as_mut_ptr(), out.len())
            };
            return Ok(());
        }
        let vk_src = b.buffer;
        let piece = st.readback.max_region() as usize;
        let mut st = st;
        for (i, chunk) in out.chunks_mut(piece.max(1)).enumerate() {
            let retire = st.open_retire();
            let region = st.alloc_readback(chunk.len() as u64, retire, self.device())?;
            let Some(region) = region else {
                return Err(unavailable("readback arena exhausted"));
            };
            st.record_copy(
                self.device(),
                (vk_src, (offset + i * piece) as u64),
                (region.buffer, region.offset),
                chunk.len() as u64,
            )?;
            st.pending_reads.push(PendingRead {
                retire,
                src: region.ptr,
                out: ReadTarget::Raw(chunk.as_mut_ptr()),
                len: chunk.len(),
            });
            if self.config.legacy_submits {
                let fence = st.legacy_fence;
                st.submit_open(&self.dev, &self.stats, fence)?;
                let target = Retire {
                    compute: st.compute.submitted,
                    transfer: 0,
                };
                drop(st);
                self.fence_wait(fence)?;
                self.state.lock().complete(&self.dev, &self.stats, target)?;
            } else {
                self.drain(st)?;
            }
            st = self.state.lock();
        }
        Ok(())
    }
}
