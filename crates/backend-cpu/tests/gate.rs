//! Gate tests on `cpu-async`: work behind a closed gate has not run; a staged write issued
//! while the gate is closed delivers the bytes of the call even if the caller overwrites its
//! buffer at once (invariant 1); opening the gate completes everything in order. The
//! launch-ahead primitives keep stream order: `copy_async` runs between a graph that writes its
//! source and one that reads its destination; a `read_async` sees the work queued before it and
//! not the work queued after it, costs one counted host wait (none on a second `wait`), and may
//! be dropped before it completed. A wait on another stream's event is one queued item whether
//! or not the event completed; an event of another kind is waited by the host at the call.
//! Every gate has a watchdog (`common::Watched`): a test that blocks behind it fails.

mod common;

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{blocks_until_opened, Watched};

use lowsync_backend::{Backend, BufferUsage, Event, ExecGraph, ExecNode, TensorRef};
use lowsync_cpu::CpuAsyncBackend;
use lowsync_graph::{DType, Op};

fn f32_ref(buffer: lowsync_backend::BufferId, byte_offset: usize, n: usize) -> TensorRef {
    TensorRef {
        buffer,
        byte_offset,
        dtype: DType::F32,
        shape: vec![n],
        strides: vec![1],
    }
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn work_behind_a_closed_gate_has_not_run() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    let gate = Watched::close(&b);
    // y = x * 2 behind the gate.
    let g = Arc::new(ExecGraph::new(vec![ExecNode {
        op: Op::Scale { scale: 2.0 },
        name: "y".into(),
        dst: f32_ref(buf, 16, 4),
        srcs: vec![f32_ref(buf, 0, 4)],
    }]));
    b.set_tensor_async_staged(buf, 0, &bytes(&[1.0, 2.0, 3.0, 4.0]))
        .unwrap();
    b.graph_compute_async(&g).unwrap();
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    assert!(
        !ev.is_complete(),
        "the graph must wait behind the closed gate"
    );
    gate.open();
    ev.synchronize().unwrap();
    let mut out = vec![0u8; 16];
    b.get_tensor(buf, 16, &mut out).unwrap();
    assert_eq!(floats(&out), vec![2.0, 4.0, 6.0, 8.0]);
}

#[test]
fn staged_write_may_be_overwritten_after_return() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    let gate = Watched::close(&b);
    let mut host = bytes(&[1.0, 2.0, 3.0, 4.0]);
    b.set_tensor_async_staged(buf, 0, &host).unwrap();
    host.copy_from_slice(&bytes(&[9.0, 9.0, 9.0, 9.0])); // the caller reuses its buffer at once
    gate.open();
    let mut out = vec![0u8; 16];
    b.get_tensor(buf, 0, &mut out).unwrap();
    assert_eq!(floats(&out), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn staged_write_behind_a_gated_graph_is_invisible_to_it_and_visible_to_the_next() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    b.set_tensor(buf, 0, &bytes(&[1.0, 1.0])).unwrap();
    let g = Arc::new(ExecGraph::new(vec![ExecNode {
        op: Op::Scale { scale: 10.0 },
        name: "y".into(),
        dst: f32_ref(buf, 16, 2),
        srcs: vec![f32_ref(buf, 0, 2)],
    }]));
    let gate = Watched::close(&b);
    b.graph_compute_async(&g).unwrap(); // reads x = 1
    b.set_tensor_async_staged(buf, 0, &bytes(&[5.0, 5.0]))
        .unwrap(); // queued after the graph
    let mut first = vec![0u8; 8];
    gate.open();
    b.get_tensor(buf, 16, &mut first).unwrap();
    assert_eq!(floats(&first), vec![10.0, 10.0]);
    b.graph_compute_async(&g).unwrap();
    let mut second = vec![0u8; 8];
    b.get_tensor(buf, 16, &mut second).unwrap();
    assert_eq!(floats(&second), vec![50.0, 50.0]);
}

#[test]
fn opening_the_gate_completes_everything_in_order() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    let gate = Watched::close(&b);
    for i in 0..10u8 {
        b.set_tensor_async_staged(buf, 0, &[i; 4]).unwrap();
    }
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    assert!(!ev.is_complete());
    gate.open();
    b.synchronize().unwrap();
    assert!(ev.is_complete());
    let mut out = [0u8; 4];
    b.get_tensor(buf, 0, &mut out).unwrap();
    assert_eq!(out, [9u8; 4], "the last write wins: items ran in order");
}

#[test]
fn another_stream_waits_on_an_event_device_side() {
    let a = CpuAsyncBackend::new("cpu-async").unwrap();
    let b: Arc<dyn Backend> = Arc::new(CpuAsyncBackend::new("cpu-async-2").unwrap());
    let gate = Watched::close(&a);
    let ev = a.event_new().unwrap();
    a.event_record(&ev).unwrap();
    let buf = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    let before = b.stats().snapshot();
    b.event_wait(&ev).unwrap(); // no host wait: the stream waits
    b.set_tensor_async_staged(buf, 0, &[7u8; 4]).unwrap();
    assert_eq!(b.stats().snapshot().since(&before).host_waits, 0);
    // b's queue must stay behind a's gate: a wait for it returns only once the gate opened.
    let blocked = blocks_until_opened(&b, &gate, || b.synchronize().unwrap());
    gate.open();
    assert!(
        blocked,
        "b's stream ran past its wait on a's event while a was gated"
    );
    assert!(ev.is_complete());
}

/// Issue 29.14: the wait on another stream's event is queued (one device wait — not a
/// submission, not a host wait) whether the event is still pending or long complete, so counts
/// never depend on timing; the
/// wait captures the event's ticket at the call (a later re-record does not delay it); events
/// of this stream, of `cpu` and never-recorded ones are ordered without an item.
#[test]
fn a_wait_on_another_streams_event_is_one_device_wait_whether_or_not_it_completed() {
    let a = CpuAsyncBackend::new("cpu-async").unwrap();
    let b = CpuAsyncBackend::new("cpu-async-2").unwrap();
    let buf = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    let ev = a.event_new().unwrap();
    let counts = |b: &CpuAsyncBackend, f: &dyn Fn()| {
        let (before_a, before_b) = (a.stats().snapshot(), b.stats().snapshot());
        f();
        let (da, db) = (
            a.stats().snapshot().since(&before_a),
            b.stats().snapshot().since(&before_b),
        );
        (
            db.device_waits,
            db.submits,
            db.host_waits + da.host_waits,
            da.submits + da.device_waits,
        )
    };
    assert_eq!(
        counts(&b, &|| b.event_wait(&ev).unwrap()),
        (0, 0, 0, 0),
        "never recorded: complete"
    );
    // Pending: behind a's closed gate.
    let gate = Watched::close(&a);
    a.event_record(&ev).unwrap();
    assert_eq!(counts(&b, &|| b.event_wait(&ev).unwrap()), (1, 0, 0, 0));
    // Re-recorded behind more gated work: b's wait still ends at the first record.
    a.set_tensor_async_staged(a.alloc_buffer(4, BufferUsage::Inputs).unwrap(), 0, &[1; 4])
        .unwrap();
    a.event_record(&ev).unwrap();
    let late = Watched::close(&a);
    a.event_record(&ev).unwrap();
    b.set_tensor_async_staged(buf, 0, &[7u8; 4]).unwrap();
    let ev_b = b.event_new().unwrap();
    b.event_record(&ev_b).unwrap();
    assert!(!ev_b.is_complete(), "b waits for a's gate");
    gate.open();
    ev_b.synchronize().unwrap();
    assert!(!ev.is_complete(), "a is still behind its second gate");
    late.open();
    a.synchronize().unwrap();
    // Complete, and observed by a's host: the same single device wait, never a shortcut.
    assert!(ev.is_complete());
    for _ in 0..3 {
        assert_eq!(counts(&b, &|| b.event_wait(&ev).unwrap()), (1, 0, 0, 0));
    }
    // Own events and the synchronous host's are ordered by the stream: nothing queued.
    let own = b.event_new().unwrap();
    b.event_record(&own).unwrap();
    let host = lowsync_cpu::CpuBackend::new().event_new().unwrap();
    assert_eq!(counts(&b, &|| b.event_wait(&own).unwrap()), (0, 0, 0, 0));
    assert_eq!(counts(&b, &|| b.event_wait(&host).unwrap()), (0, 0, 0, 0));
    b.synchronize().unwrap();
}

/// An event of another kind of backend: `cpu-async`'s worker cannot wait on it, so the host
/// waits at the call, through the event's own `synchronize` (where its backend counts it),
/// once per call, whether or not it completed; nothing is queued.
#[test]
fn an_event_of_another_kind_is_waited_by_the_host_at_the_call() {
    struct Foreign {
        complete: AtomicBool,
        waits: AtomicU64,
        on: std::sync::Mutex<Vec<std::thread::ThreadId>>,
    }
    impl Event for Foreign {
        fn is_complete(&self) -> bool {
            self.complete.load(Ordering::Acquire)
        }
        fn synchronize(&self) -> lowsync_backend::Result<()> {
            self.waits.fetch_add(1, Ordering::AcqRel);
            self.on.lock().unwrap().push(std::thread::current().id());
            self.complete.store(true, Ordering::Release);
            Ok(())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let foreign = Arc::new(Foreign {
        complete: AtomicBool::new(false),
        waits: AtomicU64::new(0),
        on: std::sync::Mutex::new(Vec::new()),
    });
    let ev: Arc<dyn Event> = foreign.clone();
    let before = b.stats().snapshot();
    b.event_wait(&ev).unwrap(); // pending
    b.event_wait(&ev).unwrap(); // complete now
    let d = b.stats().snapshot().since(&before);
    assert_eq!(
        (d.submits, d.device_waits, d.host_waits),
        (0, 0, 0),
        "nothing queued on cpu-async"
    );
    assert_eq!(
        foreign.waits.load(Ordering::Acquire),
        2,
        "one host wait per call"
    );
    let here = std::thread::current().id();
    assert_eq!(
        *foreign.on.lock().unwrap(),
        vec![here, here],
        "on the calling thread"
    );
}

/// `buf[dst..] = buf[src..] * 2` over 4 floats.
fn double(buf: lowsync_backend::BufferId, src: usize, dst: usize) -> Arc<ExecGraph> {
    Arc::new(ExecGraph::new(vec![ExecNode {
        op: Op::Scale { scale: 2.0 },
        name: "y".into(),
        dst: f32_ref(buf, dst, 4),
        srcs: vec![f32_ref(buf, src, 4)],
    }]))
}

#[test]
fn a_copy_and_reads_keep_stream_order_behind_a_gate() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    b.set_tensor(buf, 0, &bytes(&[1.0, 2.0, 3.0, 4.0])).unwrap();
    let gate = Watched::close(&b);
    let before = b.stats().snapshot();
    // y = 2x; x <- y (on the stream); read x; y = 2x; read y.
    b.graph_compute_async(&double(buf, 0, 16)).unwrap();
    b.copy_async(buf, 16, buf, 0, 16).unwrap();
    let mut first = b.read_async(buf, 0, 16).unwrap();
    b.graph_compute_async(&double(buf, 0, 16)).unwrap();
    let mut second = b.read_async(buf, 16, 16).unwrap();
    let queued = b.stats().snapshot().since(&before);
    assert_eq!(queued.host_waits, 0, "queuing copies and reads never waits");
    assert_eq!((queued.d2d_copies, queued.d2d_bytes), (1, 16));
    assert_eq!((queued.d2h_copies, queued.d2h_bytes), (2, 32));
    assert!(!first.is_complete(), "the read ran behind a closed gate");
    gate.open();
    assert_eq!(floats(first.wait().unwrap()), vec![2.0, 4.0, 6.0, 8.0]);
    assert_eq!(floats(second.wait().unwrap()), vec![4.0, 8.0, 12.0, 16.0]);
    assert_eq!(floats(second.wait().unwrap()), vec![4.0, 8.0, 12.0, 16.0]);
    let d = b.stats().snapshot().since(&before);
    assert_eq!(
        d.host_waits, 2,
        "one wait per read, none for a second wait on one"
    );
    b.synchronize().unwrap();
    assert_eq!(
        b.stats().snapshot().since(&before).host_waits,
        2,
        "sync was elided"
    );
}

#[test]
fn a_read_dropped_before_it_completed_is_harmless() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    b.set_tensor(buf, 0, &bytes(&[1.0; 4])).unwrap();
    let gate = Watched::close(&b);
    let early = b.read_async(buf, 0, 16).unwrap();
    drop(early);
    gate.open();
    b.synchronize().unwrap();
    let mut later = b.read_async(buf, 0, 16).unwrap();
    assert_eq!(floats(later.wait().unwrap()), vec![1.0; 4]);
}

#[test]
fn out_of_bounds_copies_and_reads_are_errors_and_the_stream_stays_usable() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    assert!(b.copy_async(buf, 60, buf, 0, 16).is_err());
    assert!(b.copy_async(buf, 0, buf, 56, 16).is_err());
    assert!(b.read_async(buf, 56, 16).is_err());
    b.set_tensor(buf, 0, &bytes(&[3.0; 4])).unwrap();
    b.copy_async(buf, 0, buf, 32, 16).unwrap();
    let mut r = b.read_async(buf, 32, 16).unwrap();
    assert_eq!(floats(r.wait().unwrap()), vec![3.0; 4]);
}

/// Two `cpu-async` streams stand in for two GPUs: `cpy_tensor_async` between them is queued
/// with no host wait, copies only after the work queued on the source (a write behind the
/// source's closed gate), and the source's later work waits for the copy (its next write lands
/// only after the destination copied the old bytes). Counts: one device-to-device copy and one
/// device wait on the destination, one device wait on the source, no host wait on either.
#[test]
fn a_copy_between_two_streams_waits_on_the_devices_not_the_host() {
    let a = CpuAsyncBackend::new("cpu-async:0").unwrap();
    let b = CpuAsyncBackend::new("cpu-async:1").unwrap();
    let src = a.alloc_buffer(16, BufferUsage::Compute).unwrap();
    let dst = b.alloc_buffer(16, BufferUsage::Compute).unwrap();
    let gate = Watched::close(&a);
    a.set_tensor_async_staged(src, 0, &bytes(&[1.0, 2.0, 3.0, 4.0]))
        .unwrap();
    let (a0, b0) = (a.stats().snapshot(), b.stats().snapshot());
    assert!(b.cpy_tensor_async(&a, src, 0, dst, 0, 16).unwrap());
    // Queued after the copy on the source: must not reach the copy's bytes.
    a.set_tensor_async_staged(src, 0, &bytes(&[9.0, 9.0, 9.0, 9.0]))
        .unwrap();
    let (a1, b1) = (a.stats().snapshot(), b.stats().snapshot());
    assert_eq!(b1.d2d_copies - b0.d2d_copies, 1);
    assert_eq!(b1.device_waits - b0.device_waits, 1);
    assert_eq!(a1.device_waits - a0.device_waits, 1);
    assert_eq!(
        (a1.host_waits, b1.host_waits),
        (a0.host_waits, b0.host_waits)
    );
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    assert!(
        !ev.is_complete(),
        "the copy must wait for the source's gate"
    );
    gate.open();
    let mut out = vec![0u8; 16];
    b.get_tensor(dst, 0, &mut out).unwrap();
    assert_eq!(floats(&out), vec![1.0, 2.0, 3.0, 4.0]);
    a.get_tensor(src, 0, &mut out).unwrap();
    assert_eq!(floats(&out), vec![9.0, 9.0, 9.0, 9.0]);
}

#[test]
fn a_copy_between_two_streams_checks_both_ranges() {
    let a = CpuAsyncBackend::new("cpu-async:0").unwrap();
    let b = CpuAsyncBackend::new("cpu-async:1").unwrap();
    let src = a.alloc_buffer(16, BufferUsage::Compute).unwrap();
    let dst = b.alloc_buffer(8, BufferUsage::Compute).unwrap();
    assert!(b.cpy_tensor_async(&a, src, 8, dst, 0, 16).is_err());
    assert!(b.cpy_tensor_async(&a, src, 0, dst, 0, 16).is_err());
    assert!(b.cpy_tensor_async(&a, src, 0, dst, 0, 8).unwrap());
    b.synchronize().unwrap();
}
