//! The staging arena: pinned host memory that staged writes copy into before their H2D copy.
//!
//! Why: `set_tensor_async_staged` must copy the caller's bytes before returning (invariant 1)
//! and queue the device write without a host wait; a DMA from pageable memory would make the
//! driver wait. Pinned memory allocated per call would cost more than the copy, so the arena is
//! allocated once and reused across steps (S0/S1).
//!
//! Strategy: a ring of equal chunks (`chunk_bytes` each, at most `max_bytes` in all). A write
//! takes the next aligned region of the current chunk; the H2D copy's ticket is recorded on the
//! chunk. A chunk is reclaimed when the host has observed its last ticket through a wait (every
//! step ends with one, so the current chunk simply rewinds), or when the fence event recorded
//! as the ring moved past it has completed (`cuEventQuery`, no wait). Only when every chunk is
//! still in flight and the arena is at its bound does a write wait — on the oldest fence, a
//! counted host wait. Writes larger than a chunk are split into chunk-sized pieces.
//!
//! Invariant 8: a region is never handed out again while a queued copy may read it (its chunk's
//! last ticket is observed, or a fence recorded after that ticket completed), and the arena
//! never holds more than `max(max_bytes, chunk_bytes)` bytes, however many writes there are.

use crate::tickets::{Driver, TicketStream};

/// Alignment of staged regions (copy engines like aligned sources).
const REGION_ALIGN: usize = 256;

/// Memory a chunk is made of (pinned host memory; plain memory in tests).
pub(crate) trait ChunkMem: Sized {
    fn alloc(len: usize) -> Result<Self, String>;
    fn ptr(&self) -> *mut u8;
}

struct Chunk<D: Driver, M> {
    mem: M,
    used: usize,
    /// Ticket of the last copy that reads this chunk (0: none).
    last_ticket: u64,
    /// An event recorded after `last_ticket` when the ring moved on, and its ticket.
    fence: Option<(D::Event, u64)>,
}

/// A bounded ring of staging chunks.
pub(crate) struct Staging<D: Driver, M: ChunkMem> {
    chunks: Vec<Chunk<D, M>>,
    current: usize,
    chunk_bytes: usize,
    max_bytes: usize,
}

/// A reserved region: where to write the bytes, and the chunk to commit the copy's ticket to.
pub(crate) struct Region {
    pub ptr: *mut u8,
    chunk: usize,
}

impl<D: Driver, M: ChunkMem> Staging<D, M> {
    pub(crate) fn new(chunk_bytes: usize, max_bytes: usize) -> Self {
        Staging {
            chunks: Vec::new(),
            current: 0,
            chunk_bytes: chunk_bytes.max(REGION_ALIGN),
            max_bytes,
        }
    }

    /// The largest region one reservation can hand out.
    pub(crate) fn max_piece(&self) -> usize {
        self.chunk_bytes
    }

    /// Pinned bytes held by regions whose copies are not known to be complete.
    pub(crate) fn bytes_in_use(&self) -> usize {
        self.chunks.iter().map(|c| c.used).sum()
    }

    /// Pinned bytes allocated.
    pub(crate) fn bytes_allocated(&self) -> usize {
        self.chunks.len() * self.chunk_bytes
    }

    /// Frees every region whose copies the host observed complete.
    pub(crate) fn reclaim(&mut self, observed: u64) {
        for c in &mut self.chunks {
            if c.used > 0 && c.last_ticket <= observed {
                c.used = 0;
            }
        }
    }

    /// Reserves `len <= max_piece()` bytes. May record a fence (an enqueue) when the ring moves
    /// on, and wait on the oldest fence (a counted host wait) when the arena is full.
    pub(crate) fn reserve(
        &mut self,
        stream: &TicketStream<D>,
        new_event: &dyn Fn() -> Result<D::Event, String>,
        len: usize,
    ) -> Result<Region, String> {
        if len > self.chunk_bytes {
            return Err(format!(
                "staged piece of {len} bytes exceeds the chunk size {}",
                self.chunk_bytes
            ));
        }
        self.reclaim(stream.tickets().observed);
        if let Some(r) = self.take_from(self.current, len) {
            return Ok(r);
        }
        // The ring moves on: fence the chunk it leaves so it can be reclaimed without a wait.
        self.fence(stream, new_event, self.current)?;
        let n = self.chunks.len();
        for k in 1..=n {
            let i = (self.current + k) % n;
            let done = match &self.chunks[i] {
                c if c.used == 0 => true,
                Chunk {
                    fence: Some((ev, t)),
                    last_ticket,
                    ..
                } if *t >= *last_ticket => stream.query_event(ev, *t).unwrap_or(false),
                _ => false,
            };
            if done {
                self.chunks[i].used = 0;
                self.current = i;
                if let Some(r) = self.take_from(i, len) {
                    return Ok(r);
                }
            }
        }
        if self.chunks.is_empty() || self.bytes_allocated() + self.chunk_bytes <= self.max_bytes {
            self.chunks.push(Chunk {
                mem: M::alloc(self.chunk_bytes)?,
                used: 0,
                last_ticket: 0,
                fence: None,
            });
            self.current = self.chunks.len() - 1;
            return self
                .take_from(self.current, len)
                .ok_or_else(|| "staging chunk too small".to_string());
        }
        // Full: wait for the chunk whose copies were queued first.
        let oldest = (0..self.chunks.len())
            .min_by_key(|&i| self.chunks[i].last_ticket)
            .unwrap_or(0);
        self.fence(stream, new_event, oldest)?;
        if let Some((ev, t)) = &self.chunks[oldest].fence {
            stream
                .wait_event_host(ev, *t)
                .map_err(|e| format!("waiting for staging space failed: {e:?}"))?;
        }
        self.chunks[oldest].used = 0;
        self.current = oldest;
        self.take_from(oldest, len)
            .ok_or_else(|| "staging chunk too small".to_string())
    }

    /// Records that the copy reading `region` has `ticket`.
    pub(crate) fn commit(&mut self, region: &Region, ticket: u64) {
        if let Some(c) = self.chunks.get_mut(region.chunk) {
            c.last_ticket = c.last_ticket.max(ticket);
        }
    }

    fn take_from(&mut self, i: usize, len: usize) -> Option<Region> {
        let c = self.chunks.get_mut(i)?;
        let off = c.used.next_multiple_of(REGION_ALIGN);
        if off + len > self.chunk_bytes {
            return None;
        }
        c.used = off + len.max(1);
        Some(Region {
            // SAFETY (of later writes): `off + len <= chunk_bytes`, the chunk's length.
            ptr: c.mem.ptr().wrapping_add(off),
            chunk: i,
        })
    }

    /// Records a fence after chunk `i`'s last copy, unless one already covers it.
    fn fence(
        &mut self,
        stream: &TicketStream<D>,
        new_event: &dyn Fn() -> Result<D::Event, String>,
        i: usize,
    ) -> Result<(), String> {
        let Some(c) = self.chunks.get_mut(i) else {
            return Ok(());
        };
        if c.used == 0 || c.fence.as_ref().is_some_and(|(_, t)| *t >= c.last_ticket) {
            return Ok(());
        }
        let ev = match c.fence.take() {
            Some((ev, _)) => ev,
            None => new_event()?,
        };
        let t = stream
            .record_event(&ev)
            .map_err(|e| format!("recording a staging fence failed: {e:?}"))?;
        c.fence = Some((ev, t));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The arena's bounds and reuse rules against a fake driver whose events complete when told.

    use super::*;
    use crate::tickets::{LaunchDims, SyncElision};
    use parking_lot::Mutex;
    use std::collections::HashSet;
    use std::ffi::c_void;

    #[derive(Default)]
    struct FakeGpu {
        /// Events that have completed.
        done: Mutex<HashSet<u32>>,
        waits: Mutex<Vec<u32>>,
    }

    impl Driver for FakeGpu {
        type Error = String;
        type Event = u32;
        type Function = ();
        type GraphExec = ();
        type RawStream = ();
        type Context = ();
        unsafe fn launch(&self, _: (), _: LaunchDims, _: &mut [*mut c_void]) -> Result<(), String> {
            Ok(())
        }
        unsafe fn memcpy_htod(&self, _: u64, _: *const u8, _: usize) -> Result<(), String> {
            Ok(())
        }
        unsafe fn memcpy_dtoh(&self, _: *mut u8, _: u64, _: usize) -> Result<(), String> {
            Ok(())
        }
        unsafe fn memcpy_dtod(&self, _: u64, _: u64, _: usize) -> Result<(), String> {
            Ok(())
        }
        unsafe fn memcpy_peer(&self, _: u64, _: (), _: u64, _: (), _: usize) -> Result<(), String> {
            Ok(())
        }
        unsafe fn memset_d8(&self, _: u64, _: u8, _: usize) -> Result<(), String> {
            Ok(())
        }
        unsafe fn malloc_async(&self, _: usize) -> Result<u64, String> {
            Ok(0)
        }
        unsafe fn free_async(&self, _: u64) -> Result<(), String> {
            Ok(())
        }
        fn event_record(&self, ev: &u32) -> Result<(), String> {
            self.done.lock().remove(ev);
            Ok(())
        }
        fn stream_wait_event(&self, _: &u32) -> Result<(), String> {
            Ok(())
        }
        unsafe fn stream_wait_value32(&self, _: u64, _: u32) -> Result<(), String> {
            Ok(())
        }
        fn graph_launch(&self, _: &()) -> Result<(), String> {
            Ok(())
        }
        fn begin_capture(&self) -> Result<(), String> {
            Ok(())
        }
        fn end_capture(&self) -> Result<(), String> {
            Ok(())
        }
        fn raw_stream(&self) {}
        fn stream_synchronize(&self) -> Result<(), String> {
            Ok(())
        }
        fn event_synchronize(&self, ev: &u32) -> Result<(), String> {
            self.waits.lock().push(*ev);
            Ok(())
        }
        fn event_query(&self, ev: &u32) -> Result<bool, String> {
            Ok(self.done.lock().contains(ev))
        }
    }

    struct Mem(Vec<u8>);
    impl ChunkMem for Mem {
        fn alloc(len: usize) -> Result<Self, String> {
            Ok(Mem(vec![0; len]))
        }
        fn ptr(&self) -> *mut u8 {
            self.0.as_ptr().cast_mut()
        }
    }

    fn setup() -> (TicketStream<FakeGpu>, Staging<FakeGpu, Mem>) {
        let s = TicketStream::new(
            FakeGpu::default(),
            SyncElision {
                requested: true,
                device_count: 1,
            },
        );
        (s, Staging::new(1024, 4096))
    }

    fn events() -> impl Fn() -> Result<u32, String> {
        let next = Mutex::new(0u32);
        move || {
            let mut n = next.lock();
            *n += 1;
            Ok(*n)
        }
    }

    /// One staged write: reserve, "copy" (an H2D enqueue), commit.
    fn write(
        s: &TicketStream<FakeGpu>,
        st: &mut Staging<FakeGpu, Mem>,
        ev: &dyn Fn() -> Result<u32, String>,
        len: usize,
    ) {
        let r = st.reserve(s, ev, len).unwrap();
        let t = unsafe { s.memcpy_htod(0, r.ptr, len) }.unwrap();
        st.commit(&r, t);
    }

    #[test]
    fn a_synchronized_step_rewinds_the_current_chunk() {
        let (s, mut st) = setup();
        let ev = events();
        for _ in 0..10_000 {
            write(&s, &mut st, &ev, 100);
            write(&s, &mut st, &ev, 300);
            s.synchronize().unwrap();
            st.reclaim(s.tickets().observed);
            assert_eq!(st.bytes_in_use(), 0);
        }
        assert_eq!(st.bytes_allocated(), 1024, "one chunk serves every step");
        assert!(s.driver().waits.lock().is_empty());
    }

    #[test]
    fn without_waits_the_arena_stays_bounded_and_waits_only_when_full() {
        let (s, mut st) = setup();
        let ev = events();
        for _ in 0..10_000 {
            write(&s, &mut st, &ev, 1000);
        }
        assert!(st.bytes_allocated() <= 4096);
        assert!(st.bytes_in_use() <= 4096);
        let waits = s.stats().snapshot().host_waits;
        assert!(
            waits > 0 && waits < 10_000,
            "waits only when the ring is full"
        );
    }

    #[test]
    fn completed_fences_are_reused_without_a_wait() {
        let (s, mut st) = setup();
        let ev = events();
        for _ in 0..50 {
            write(&s, &mut st, &ev, 1000);
            // The device keeps up: every recorded fence completes.
            let all: Vec<u32> = (1..=64).collect();
            s.driver().done.lock().extend(all);
        }
        assert_eq!(s.stats().snapshot().host_waits, 0);
        assert!(st.bytes_allocated() <= 4096);
    }

    #[test]
    fn a_region_in_flight_is_never_handed_out_again() {
        let (s, mut st) = setup();
        let ev = events();
        let mut live: Vec<(usize, u64)> = Vec::new();
        for _ in 0..200 {
            let r = st.reserve(&s, &ev, 700).unwrap();
            let t = unsafe { s.memcpy_htod(0, r.ptr, 700) }.unwrap();
            st.commit(&r, t);
            // Only a completed wait (observed) may free a region in this test: no fence
            // completes by itself.
            let observed = s.tickets().observed;
            live.retain(|&(_, tk)| tk > observed);
            assert!(
                live.iter().all(|&(p, _)| p != r.ptr as usize),
                "a region was reused while its copy was in flight"
            );
            live.push((r.ptr as usize, t));
        }
        assert!(
            !s.driver().waits.lock().is_empty(),
            "the ring filled and waited"
        );
    }

    #[test]
    fn oversized_pieces_are_refused() {
        let (s, mut st) = setup();
        assert!(st.reserve(&s, &events(), 2048).is_err());
    }
}
