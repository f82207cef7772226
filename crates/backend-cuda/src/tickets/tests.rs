//! The ticket logic against a recording fake driver: no GPU needed.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Launch,
    HtoD(usize),
    DtoH(usize),
    DtoD(usize),
    Peer(usize),
    Memset(usize),
    MallocAsync(usize),
    FreeAsync,
    EventRecord(u32),
    StreamWaitEvent(u32),
    WaitValue32(u32),
    GraphLaunch,
    BeginCapture,
    EndCapture,
    RawStream,
    StreamSynchronize,
    EventSynchronize(u32),
    EventQuery(u32),
}

#[derive(Default)]
struct Fake {
    calls: Mutex<Vec<Call>>,
    /// The parameter block of every one-parameter launch (the batches).
    batches: Mutex<Vec<BatchParams>>,
    fail_next_wait: AtomicBool,
    fail_enqueues: AtomicBool,
}

impl Fake {
    fn push(&self, c: Call) -> Result<(), String> {
        self.calls.lock().push(c);
        if self.fail_enqueues.load(Ordering::SeqCst) {
            return Err("enqueue failed".into());
        }
        Ok(())
    }
    fn wait(&self, c: Call) -> Result<(), String> {
        self.calls.lock().push(c);
        if self.fail_next_wait.swap(false, Ordering::SeqCst) {
            return Err("CUDA_ERROR_LAUNCH_FAILED".into());
        }
        Ok(())
    }
}

impl Driver for Fake {
    type Error = String;
    type Event = u32;
    type Function = ();
    type GraphExec = ();
    type RawStream = usize;
    type Context = ();

    unsafe fn launch(
        &self,
        _f: (),
        _dims: LaunchDims,
        params: &mut [*mut c_void],
    ) -> Result<(), String> {
        if let [p] = params {
            // SAFETY: the only one-parameter launch in these tests is a batch's.
            self.batches
                .lock()
                .push(unsafe { (*p as *const BatchParams).read() });
        }
        self.push(Call::Launch)
    }
    unsafe fn memcpy_htod(&self, _dst: u64, _src: *const u8, len: usize) -> Result<(), String> {
        self.push(Call::HtoD(len))
    }
    unsafe fn memcpy_dtoh(&self, _dst: *mut u8, _src: u64, len: usize) -> Result<(), String> {
        self.push(Call::DtoH(len))
    }
    unsafe fn memcpy_dtod(&self, _dst: u64, _src: u64, len: usize) -> Result<(), String> {
        self.push(Call::DtoD(len))
    }
    unsafe fn memcpy_peer(
        &self,
        _dst: u64,
        _dc: (),
        _src: u64,
        _sc: (),
        len: usize,
    ) -> Result<(), String> {
        self.push(Call::Peer(len))
    }
    unsafe fn memset_d8(&self, _dst: u64, _v: u8, len: usize) -> Result<(), String> {
        self.push(Call::Memset(len))
    }
    unsafe fn malloc_async(&self, len: usize) -> Result<u64, String> {
        self.push(Call::MallocAsync(len)).map(|_| 0x1000)
    }
    unsafe fn free_async(&self, _ptr: u64) -> Result<(), String> {
        self.push(Call::FreeAsync)
    }
    fn event_record(&self, ev: &u32) -> Result<(), String> {
        self.push(Call::EventRecord(*ev))
    }
    fn stream_wait_event(&self, ev: &u32) -> Result<(), String> {
        self.push(Call::StreamWaitEvent(*ev))
    }
    unsafe fn stream_wait_value32(&self, _addr: u64, value: u32) -> Result<(), String> {
        self.push(Call::WaitValue32(value))
    }
    fn graph_launch(&self, _exec: &()) -> Result<(), String> {
        self.push(Call::GraphLaunch)
    }
    fn begin_capture(&self) -> Result<(), String> {
        self.push(Call::BeginCapture)
    }
    fn end_capture(&self) -> Result<(), String> {
        self.push(Call::EndCapture)
    }
    fn raw_stream(&self) -> usize {
        self.calls.lock().push(Call::RawStream);
        7
    }
    fn stream_synchronize(&self) -> Result<(), String> {
        self.wait(Call::StreamSynchronize)
    }
    fn event_synchronize(&self, ev: &u32) -> Result<(), String> {
        self.wait(Call::EventSynchronize(*ev))
    }
    fn event_query(&self, ev: &u32) -> Result<bool, String> {
        self.calls.lock().push(Call::EventQuery(*ev));
        Ok(false)
    }
}

fn single() -> SyncElision {
    SyncElision {
        requested: true,
        device_count: 1,
    }
}

fn stream(elision: SyncElision) -> TicketStream<Fake> {
    TicketStream::new(Fake::default(), elision)
}

fn calls(s: &TicketStream<Fake>) -> Vec<Call> {
    s.driver.calls.lock().clone()
}

fn syncs(s: &TicketStream<Fake>) -> usize {
    calls(s)
        .iter()
        .filter(|c| matches!(c, Call::StreamSynchronize))
        .count()
}

type Path = (&'static str, fn(&TicketStream<Fake>));

/// Every enqueue path of the stream, each as a closure.
fn every_enqueue_path() -> Vec<Path> {
    vec![
        ("launch", |s| unsafe {
            let dims = LaunchDims::one_block(32);
            s.launch((), dims, &mut []).unwrap();
        }),
        ("launch_copy", |s| unsafe {
            let dims = LaunchDims::one_block(128);
            s.launch_copy(Counted::D2H(4), (), dims, &mut []).unwrap();
        }),
        ("memcpy_htod", |s| unsafe {
            s.memcpy_htod(0, [0u8; 4].as_ptr(), 4).unwrap();
        }),
        ("memcpy_dtoh", |s| unsafe {
            s.memcpy_dtoh([0u8; 4].as_mut_ptr(), 0, 4).unwrap();
        }),
        ("memcpy_dtod", |s| unsafe {
            s.memcpy_dtod(0, 0, 4).unwrap();
        }),
        ("memcpy_peer", |s| unsafe {
            s.memcpy_peer(0, (), 0, (), 4).unwrap();
        }),
        ("memset_d8", |s| unsafe {
            s.memset_d8(0, 0, 4).unwrap();
        }),
        ("malloc_async", |s| unsafe {
            s.malloc_async(4).unwrap();
        }),
        ("free_async", |s| unsafe {
            s.free_async(0x1000).unwrap();
        }),
        ("record_event", |s| {
            s.record_event(&1).unwrap();
        }),
        ("wait_event", |s| {
            s.wait_event(&1).unwrap();
        }),
        ("wait_value32", |s| unsafe {
            s.wait_value32(0, 1).unwrap();
        }),
        ("graph_launch", |s| {
            s.graph_launch(&()).unwrap();
        }),
        ("lend (cuBLAS handle / raw stream)", |s| {
            s.lend(Counted::Kernel, |raw| assert_eq!(raw.as_raw(), 7))
                .unwrap();
        }),
    ]
}

#[test]
fn every_enqueue_path_bumps_the_ticket_and_makes_the_next_sync_wait() {
    for (name, path) in every_enqueue_path() {
        let s = stream(single());
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 0, "{name}: idle sync must not call the driver");
        let before = s.tickets().submitted;
        path(&s);
        assert_eq!(s.tickets().submitted, before + 1, "{name}: one ticket");
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1, "{name}: a sync after an enqueue waits");
        assert_eq!(s.tickets().observed, s.tickets().submitted);
        s.synchronize().unwrap();
        assert_eq!(syncs(&s), 1, "{name}: and the next one is elided");
        let st = s.stats().snapshot();
        assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (1, 1, 2));
    }
}

#[test]
fn sync_after_no_enqueue_makes_no_driver_call() {
    let s = stream(single());
    for _ in 0..5 {
        s.synchronize().unwrap();
    }
    assert!(calls(&s).is_empty());
    let st = s.stats().snapshot();
    assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (0, 0, 5));
}

#[test]
fn failed_wait_does_not_mark_completion() {
    let s = stream(single());
    unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
    s.driver.fail_next_wait.store(true, Ordering::SeqCst);
    assert!(s.synchronize().is_err());
    assert_eq!(s.tickets().observed, 0, "a failed wait observes nothing");
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 2, "the next sync asks the driver again");
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 2);
}

#[test]
fn failed_event_wait_does_not_mark_completion() {
    let s = stream(single());
    let t = s.record_event(&3).unwrap();
    s.driver.fail_next_wait.store(true, Ordering::SeqCst);
    assert!(s.wait_event_host(&3, t).is_err());
    assert_eq!(s.tickets().observed, 0);
    s.wait_event_host(&3, t).unwrap();
    assert_eq!(s.tickets().observed, t);
}

#[test]
fn failed_enqueue_still_counts_as_outstanding_work() {
    let s = stream(single());
    s.driver.fail_enqueues.store(true, Ordering::SeqCst);
    assert!(unsafe { s.memcpy_dtod(0, 0, 8) }.is_err());
    s.driver.fail_enqueues.store(false, Ordering::SeqCst);
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 1);
    assert_eq!(s.stats().snapshot().d2d_copies, 0, "nothing was submitted");
}

#[test]
fn multi_device_never_elides() {
    let s = stream(SyncElision {
        requested: true,
        device_count: 2,
    });
    assert!(!s.elides());
    s.synchronize().unwrap();
    s.synchronize().unwrap();
    let t = s.record_event(&1).unwrap();
    s.synchronize().unwrap();
    s.wait_event_host(&1, t).unwrap();
    assert_eq!(syncs(&s), 3);
    let st = s.stats().snapshot();
    assert_eq!((st.host_waits, st.driver_syncs, st.elided_syncs), (4, 4, 0));
}

#[test]
fn elision_off_makes_every_sync_a_driver_call() {
    let s = stream(SyncElision {
        requested: false,
        device_count: 1,
    });
    for _ in 0..3 {
        s.synchronize().unwrap();
    }
    assert_eq!(syncs(&s), 3);
    assert_eq!(s.stats().snapshot().elided_syncs, 0);
}

#[test]
fn event_wait_observes_only_up_to_its_ticket() {
    let s = stream(single());
    unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
    let t = s.record_event(&9).unwrap();
    unsafe { s.memcpy_htod(0, [1u8].as_ptr(), 1).unwrap() };
    s.wait_event_host(&9, t).unwrap();
    assert_eq!(s.tickets().observed, t);
    assert!(
        s.query_event(&9, t).unwrap(),
        "known complete, no driver call"
    );
    assert!(!calls(&s).contains(&Call::EventQuery(9)));
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 1, "work after the event still needs a wait");
    s.wait_event_host(&9, t).unwrap();
    assert_eq!(
        calls(&s)
            .iter()
            .filter(|c| matches!(c, Call::EventSynchronize(_)))
            .count(),
        1,
        "a covered event wait is elided"
    );
}

#[test]
fn queries_never_advance_observed() {
    let s = stream(single());
    let t = s.record_event(&4).unwrap();
    assert!(!s.query_event(&4, t).unwrap());
    assert_eq!(s.tickets().observed, 0);
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 1);
}

#[test]
fn captured_enqueues_run_nothing_and_the_replay_is_the_submission() {
    let s = stream(single());
    let dims = LaunchDims::one_block(1);
    s.begin_capture().unwrap();
    assert!(s.is_capturing());
    unsafe {
        s.launch((), dims, &mut []).unwrap();
        s.memcpy_dtod(0, 0, 8).unwrap();
        s.launch((), dims, &mut []).unwrap();
    }
    s.lend(Counted::Kernel, |_| ()).unwrap();
    s.end_capture().unwrap();
    assert!(!s.is_capturing());
    let t = s.tickets();
    assert_eq!((t.submitted, t.captured), (0, 4), "recorded, not submitted");
    let st = s.stats().snapshot();
    assert_eq!(
        (
            st.submits,
            st.kernel_launches,
            st.d2d_copies,
            st.graph_captures
        ),
        (0, 0, 0, 1)
    );
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 0, "a capture queues nothing to wait for");
    for _ in 0..3 {
        s.graph_launch(&()).unwrap();
        s.synchronize().unwrap();
    }
    let st = s.stats().snapshot();
    assert_eq!(
        (st.submits, st.graph_launches, st.kernel_launches),
        (3, 3, 0)
    );
    assert_eq!((st.host_waits, syncs(&s)), (3, 3), "one wait per replay");
}

#[test]
fn a_failed_capture_leaves_the_stream_counting_normally() {
    let s = stream(single());
    s.begin_capture().unwrap();
    s.driver.fail_enqueues.store(true, Ordering::SeqCst);
    assert!(s.end_capture().is_err());
    s.driver.fail_enqueues.store(false, Ordering::SeqCst);
    assert!(!s.is_capturing());
    assert_eq!(s.stats().snapshot().graph_captures, 0);
    unsafe { s.memcpy_dtod(0, 0, 8).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(syncs(&s), 1);
    assert_eq!(s.stats().snapshot().d2d_copies, 1);
}

#[test]
fn enqueues_are_counted_where_they_happen() {
    let s = stream(single());
    unsafe {
        s.memcpy_htod(0, [0u8; 16].as_ptr(), 16).unwrap();
        s.memcpy_dtoh([0u8; 4].as_mut_ptr(), 0, 4).unwrap();
        s.memcpy_dtod(0, 0, 8).unwrap();
        let dims = LaunchDims::one_block(1);
        s.launch((), dims, &mut []).unwrap();
    }
    s.graph_launch(&()).unwrap();
    s.record_event(&1).unwrap();
    let st = s.stats().snapshot();
    assert_eq!((st.h2d_copies, st.h2d_bytes), (1, 16));
    assert_eq!((st.d2h_copies, st.d2h_bytes), (1, 4));
    assert_eq!((st.d2d_copies, st.d2d_bytes), (1, 8));
    assert_eq!(st.kernel_launches, 1);
    assert_eq!(st.graph_launches, 1);
    assert_eq!(
        st.submits, 5,
        "copies, the kernel and the graph; not the event"
    );
}

#[test]
fn a_copy_done_by_a_kernel_counts_as_that_copy_not_as_a_kernel() {
    let s = stream(single());
    let dims = LaunchDims::one_block(128);
    unsafe {
        s.launch_copy(Counted::H2D(512), (), dims, &mut []).unwrap();
        s.launch_copy(Counted::D2D(4), (), dims, &mut []).unwrap();
        s.launch_copy(Counted::D2H(4), (), dims, &mut []).unwrap();
    }
    let st = s.stats().snapshot();
    assert_eq!((st.h2d_copies, st.h2d_bytes), (1, 512));
    assert_eq!((st.d2d_copies, st.d2d_bytes), (1, 4));
    assert_eq!((st.d2h_copies, st.d2h_bytes), (1, 4));
    assert_eq!((st.kernel_launches, st.submits), (0, 3));
    assert!(
        calls(&s).iter().all(|c| matches!(c, Call::Launch)),
        "{:?}",
        calls(&s)
    );
    assert_eq!(s.tickets().submitted, 3);
}

fn batched() -> TicketStream<Fake> {
    let s = stream(single());
    s.enable_batch((), Some(9));
    s
}

#[test]
fn deferred_copies_run_as_one_launch_before_the_next_enqueue() {
    let s = batched();
    assert!(s.defer_htod(0x1000, &[1, 2, 3]).unwrap());
    assert!(s.defer_htod(0x2000, &[7u8; 32]).unwrap());
    assert!(s.defer_dtod(0x3000, 0x1000, 4).unwrap());
    assert!(calls(&s).is_empty(), "nothing reaches the driver yet");
    assert_eq!(s.tickets().submitted, 0);
    let st = s.stats().snapshot();
    assert_eq!(
        (st.h2d_copies, st.h2d_bytes, st.d2d_copies, st.d2d_bytes),
        (2, 35, 1, 4)
    );
    assert_eq!(st.submits, 0, "the launch is the submission");
    s.graph_launch(&()).unwrap();
    assert_eq!(calls(&s), vec![Call::Launch, Call::GraphLaunch]);
    assert_eq!(s.tickets().submitted, 2);
    assert_eq!(s.stats().snapshot().submits, 2);
    let b = s.driver.batches.lock()[0].clone();
    assert_eq!(b.n, 3);
    let items = &b.items[..3];
    assert_eq!(
        items,
        &[
            BatchItem {
                dst: 0x1000,
                src: 0,
                len: 3,
                at: 0
            },
            BatchItem {
                dst: 0x2000,
                src: 0,
                len: 32,
                at: 16
            },
            BatchItem {
                dst: 0x3000,
                src: 0x1000,
                len: 4,
                at: 48
            },
        ]
    );
    assert_eq!(&b.data[..3], &[1, 2, 3]);
    assert_eq!(&b.data[16..48], &[7u8; 32]);
    // The next enqueue finds nothing pending.
    s.graph_launch(&()).unwrap();
    assert_eq!(calls(&s).len(), 3);
}

#[test]
fn every_wait_and_lend_launches_the_pending_batch_first() {
    let s = batched();
    s.defer_htod(0x1000, &[1]).unwrap();
    s.synchronize().unwrap();
    assert_eq!(calls(&s), vec![Call::Launch, Call::StreamSynchronize]);
    assert_eq!(
        s.stats().snapshot().elided_syncs,
        0,
        "the batch is work to wait for"
    );
    s.defer_htod(0x1000, &[1]).unwrap();
    s.wait_event_host(&3, 1).unwrap();
    assert_eq!(calls(&s)[2], Call::Launch);
    s.defer_htod(0x1000, &[1]).unwrap();
    s.lend(Counted::NotASubmit, |_| ()).unwrap();
    assert_eq!(
        calls(&s)[calls(&s).len() - 2..],
        [Call::Launch, Call::RawStream]
    );
    s.defer_htod(0x1000, &[1]).unwrap();
    s.begin_capture().unwrap();
    assert_eq!(
        calls(&s)[calls(&s).len() - 2..],
        [Call::Launch, Call::BeginCapture]
    );
    assert!(
        !s.defer_htod(0x1000, &[1]).unwrap(),
        "nothing is deferred into a capture"
    );
    s.end_capture().unwrap();
}

#[test]
fn a_full_batch_is_launched_and_a_new_one_started() {
    let s = batched();
    for k in 0..BATCH_ITEMS {
        assert!(s.defer_htod(0x1000 * k as u64, &[k as u8; 8]).unwrap());
    }
    assert!(calls(&s).is_empty());
    assert!(s.defer_htod(0x9000, &[9; 8]).unwrap());
    assert_eq!(
        calls(&s),
        vec![Call::Launch],
        "the ninth copy launched the first eight"
    );
    // Data: two copies of 2,000 bytes do not fit one batch's 3,840.
    s.synchronize().unwrap();
    assert!(s.defer_htod(0, &vec![1u8; 2000]).unwrap());
    assert!(s.defer_htod(0, &vec![2u8; 2000]).unwrap());
    let n = calls(&s).iter().filter(|c| **c == Call::Launch).count();
    assert_eq!(n, 3);
    s.synchronize().unwrap();
    let b = s.driver.batches.lock();
    assert_eq!(b.iter().map(|b| b.n).collect::<Vec<_>>(), vec![8, 1, 1, 1]);
}

#[test]
fn a_read_rides_in_the_batch_and_its_wait_is_on_the_read_event() {
    let s = batched();
    let mut out = [0u8; 4];
    let t = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }
        .unwrap()
        .unwrap();
    assert!(s.defer_htod(0x1000, &[1; 8]).unwrap());
    assert!(s.defer_dtod(0x2000, 0x5000, 4).unwrap());
    assert_eq!(
        t, 2,
        "the batch's launch takes ticket 1, its read event ticket 2"
    );
    assert!(calls(&s).is_empty());
    let st = s.stats().snapshot();
    assert_eq!(
        (st.d2h_copies, st.d2h_bytes, st.h2d_copies, st.d2d_copies),
        (1, 4, 1, 1)
    );
    s.graph_launch(&()).unwrap();
    assert_eq!(
        calls(&s),
        vec![Call::Launch, Call::EventRecord(9), Call::GraphLaunch]
    );
    assert_eq!(s.tickets().submitted, 3);
    let b = s.driver.batches.lock()[0].clone();
    assert_eq!(b.n, 3);
    assert_eq!(
        b.items[0],
        BatchItem {
            dst: out.as_mut_ptr() as u64,
            src: 0x5000,
            len: 4,
            at: 0
        }
    );
    // The wait: one host wait on the read event, observing the read's ticket only (the
    // graph after it is still outstanding).
    s.wait_read(t).unwrap();
    assert_eq!(calls(&s)[3], Call::EventSynchronize(9));
    assert_eq!(s.tickets().observed, 2);
    let st = s.stats().snapshot();
    assert_eq!(
        (st.host_waits, st.submits),
        (1, 2),
        "the batch and the graph"
    );
    s.wait_read(t).unwrap();
    assert_eq!(
        s.stats().snapshot().elided_syncs,
        1,
        "a covered read is not waited again"
    );
    s.synchronize().unwrap();
    assert_eq!(calls(&s).last(), Some(&Call::StreamSynchronize));
}

#[test]
fn waiting_or_polling_a_pending_read_launches_its_batch_first() {
    let s = batched();
    let mut out = [0u8; 4];
    let t = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }
        .unwrap()
        .unwrap();
    assert!(!s.read_done(t).unwrap(), "the fake's events never complete");
    assert_eq!(
        calls(&s),
        vec![Call::Launch, Call::EventRecord(9), Call::EventQuery(9)]
    );
    let t2 = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x6000, 4) }
        .unwrap()
        .unwrap();
    assert_eq!(t2, 4);
    s.wait_read(t2).unwrap();
    assert_eq!(
        calls(&s)[3..],
        [
            Call::Launch,
            Call::EventRecord(9),
            Call::EventSynchronize(9)
        ]
    );
    assert_eq!(s.tickets().observed, 4);
    // Without a read event, reads are not batched.
    let plain = stream(single());
    plain.enable_batch((), None);
    assert_eq!(
        unsafe { plain.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }.unwrap(),
        None
    );
    assert_eq!(plain.stats().snapshot().d2h_copies, 0);
}

#[test]
fn under_launch_ahead_a_read_waits_only_for_its_own_step() {
    // Step k's graph and its read; then, queued ahead, step k+1's graph (which launches the
    // batch holding step k's read) and its own read, left pending; then the wait for token k.
    let s = batched();
    let mut out = [0u8; 8];
    s.graph_launch(&()).unwrap();
    let k = unsafe { s.defer_dtoh(out.as_mut_ptr(), 0x5000, 4) }
        .unwrap()
        .unwrap();
    assert!(
        s.defer_dtod(0x2000, 0x5000, 4).unwrap(),
        "the feed of step k+1"
    );
    s.graph_launch(&()).unwrap();
    let next = unsafe { s.defer_dtoh(out[4..].as_mut_ptr(), 0x5000, 4) }
        .unwrap()
        .unwrap();
    s.wait_read(k).unwrap();
    assert_eq!(
        calls(&s),
        vec![
            Call::GraphLaunch,
            Call::Launch,
            Call::EventRecord(9),
            Call::GraphLaunch,
            Call::EventSynchronize(9)
        ],
        "the read event is not recorded again behind step k+1's graph before the wait"
    );
    assert_eq!(s.tickets().observed, k);
    assert_eq!(s.stats().snapshot().host_waits, 1);
    // Step k+1's read still rides in the batch that the next enqueue (or its wait) launches.
    s.wait_read(next).unwrap();
    assert_eq!(
        calls(&s)[5..],
        [
            Call::Launch,
            Call::EventRecord(9),
            Call::EventSynchronize(9)
        ]
    );
    assert_eq!(s.tickets().observed, next);
}

#[test]
fn copies_a_batch_cannot_take_are_left_to_the_caller() {
    let off = stream(single());
    assert!(
        !off.defer_htod(0x1000, &[1]).unwrap(),
        "batching not enabled"
    );
    let s = batched();
    assert!(!s.defer_htod(0x1000, &vec![0u8; BATCH_DATA + 1]).unwrap());
    assert!(!s.defer_htod(0x1000, &[]).unwrap());
    assert!(!s.defer_dtod(0x1000, 0, 4).unwrap(), "a null source");
    assert!(calls(&s).is_empty());
    assert_eq!(s.stats().snapshot().h2d_copies, 0);
}

#[test]
fn lend_hands_out_the_stream_only_inside_the_call() {
    let s = stream(single());
    let got = s.lend(Counted::NotASubmit, |raw| raw.as_raw()).unwrap();
    assert_eq!(got, 7);
    assert_eq!(s.tickets().submitted, 1);
    assert_eq!(s.stats().snapshot().submits, 0);
}

/// Issue 29.14: a stream told to wait on another stream's event is a device wait — counted
/// once per call, whatever the event's state (the fake's events never complete; a real one may
/// have), never a submission or a host wait; inside a capture it is recorded, not counted.
#[test]
fn a_wait_on_another_streams_event_is_one_device_wait() {
    let s = stream(single());
    for n in 1..=3 {
        s.wait_event(&5).unwrap();
        let st = s.stats().snapshot();
        assert_eq!(
            (st.device_waits, st.submits, st.host_waits),
            (n, 0, 0),
            "call {n}"
        );
    }
    assert_eq!(
        calls(&s),
        vec![Call::StreamWaitEvent(5); 3],
        "one driver call each, no query first"
    );
    s.record_event(&1).unwrap();
    assert_eq!(s.stats().snapshot().device_waits, 3, "a record is no wait");
    s.begin_capture().unwrap();
    s.wait_event(&5).unwrap();
    s.end_capture().unwrap();
    assert_eq!(s.stats().snapshot().device_waits, 3, "captured, not run");
}
