//! Ordering tests with the test gate (a timeline semaphore the host signals), on both memory
//! paths: work behind a closed gate has not run; a staged write issued behind a gated graph
//! that reads the same tensor is invisible to it and visible to the next one, even when the
//! caller overwrites its bytes at once (invariants 1 and 2); opening the gate runs everything
//! in order. No sleeps, no timing.

mod common;
#[path = "../../backend-cpu/tests/common/mod.rs"]
mod deadline;

use std::sync::Arc;

use lowsync_backend::{Backend, BufferUsage};

#[test]
fn work_behind_a_closed_gate_does_not_run_until_it_opens() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = common::buffer_with(&b, &common::f32_bytes(&[5.0; 8]));
        let y = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
        let gate = b.gate_close().unwrap();
        b.graph_compute_async(&common::copy_graph(x, y, 8)).unwrap();
        let ev = b.event_new().unwrap();
        b.event_record(&ev).unwrap();
        for _ in 0..1000 {
            std::thread::yield_now();
        }
        assert!(!ev.is_complete(), "the graph ran behind a closed gate");
        gate.open();
        ev.synchronize().unwrap();
        assert!(ev.is_complete());
        assert_eq!(common::read_f32(&b, y, 8), vec![5.0; 8]);
        common::assert_clean(&b);
    }
}

#[test]
fn staged_write_behind_a_gated_graph_is_invisible_to_it_and_visible_to_the_next() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let inp = common::buffer_with(&b, &common::f32_bytes(&[1.0; 8]));
        let out1 = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
        let out2 = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        let gate = b.gate_close().unwrap();
        b.graph_compute_async(&common::copy_graph(inp, out1, 8))
            .unwrap();
        let mut host = common::f32_bytes(&[2.0; 8]);
        b.set_tensor_async_staged(inp, 0, &host).unwrap();
        host.fill(0xff); // the caller may overwrite its bytes at once (invariant 1)
        b.graph_compute_async(&common::copy_graph(inp, out2, 8))
            .unwrap();
        let ev = b.event_new().unwrap();
        b.event_record(&ev).unwrap();
        assert!(!ev.is_complete());
        gate.open();
        b.synchronize().unwrap();
        assert_eq!(
            common::read_f32(&b, out1, 8),
            vec![1.0; 8],
            "queued graph saw the write"
        );
        assert_eq!(
            common::read_f32(&b, out2, 8),
            vec![2.0; 8],
            "next graph missed the write"
        );
        common::assert_clean(&b);
    }
}

#[test]
fn writes_and_graphs_behind_a_gate_run_in_order() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let acc = common::buffer_with(&b, &common::f32_bytes(&[0.0; 4]));
        let inc = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
        let tmp = b.alloc_buffer(16, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        let gate = b.gate_close().unwrap();
        for i in 1..=10 {
            b.set_tensor_async_staged(inc, 0, &common::f32_bytes(&[i as f32; 4]))
                .unwrap();
            b.graph_compute_async(&common::add_graph(acc, inc, tmp, 4))
                .unwrap();
            b.graph_compute_async(&common::copy_graph(tmp, acc, 4))
                .unwrap();
        }
        gate.open();
        assert_eq!(common::read_f32(&b, acc, 4), vec![55.0; 4]);
        common::assert_clean(&b);
    }
}

#[test]
fn a_counted_wait_really_blocks_until_the_gate_opens() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let b = Arc::new(b);
    let x = common::buffer_with(&*b, &common::f32_bytes(&[1.0; 8]));
    let y = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
    let gate = b.gate_close().unwrap();
    b.graph_compute_async(&common::copy_graph(x, y, 8)).unwrap();
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    let before = b.stats().snapshot();
    let waiter = {
        let b = b.clone();
        std::thread::spawn(move || b.synchronize())
    };
    for _ in 0..100 {
        std::thread::yield_now();
    }
    assert!(!ev.is_complete());
    assert!(!waiter.is_finished());
    gate.open();
    waiter.join().unwrap().unwrap();
    assert!(ev.is_complete());
    let d = b.stats().snapshot().since(&before);
    assert_eq!((d.host_waits, d.driver_syncs), (1, 1));
    common::assert_clean(&b);
}

#[test]
fn event_synchronize_after_an_observed_wait_is_elided() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let x = common::buffer_with(&b, &common::f32_bytes(&[1.0; 8]));
    let y = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
    b.graph_compute_async(&common::copy_graph(x, y, 8)).unwrap();
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    let before = b.stats().snapshot();
    ev.synchronize().unwrap();
    ev.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = b.stats().snapshot().since(&before);
    assert_eq!((d.host_waits, d.elided_syncs), (1, 2));
    common::assert_clean(&b);
}

/// Issue 29.14: an event of another backend (here `cpu-async`) is waited for by the host at the
/// call, through that event's own `synchronize`: one host wait counted on `cpu-async` while
/// the event is pending behind its gate (the call blocks until the gate opens) and also when
/// it already completed unseen, an elided sync there once its host saw it complete — never a
/// count that depends on what had finished, never a thread polling it while the queue stalls.
/// The Vulkan stream itself counts nothing for it.
#[test]
fn an_event_of_another_backend_is_one_host_wait_at_the_call_whatever_its_state() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let other: Arc<dyn Backend> = Arc::new(lowsync_cpu::CpuAsyncBackend::new("cpu-async").unwrap());
    let theirs = other.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    let x = common::buffer_with(&b, &common::f32_bytes(&[4.0; 8]));
    let y = b.alloc_buffer(32, BufferUsage::Compute).unwrap();
    b.synchronize().unwrap();
    let ev = other.event_new().unwrap();
    // (host waits, elided syncs) on cpu-async; (host waits, submits, device waits) on Vulkan.
    let counts = |f: &dyn Fn()| {
        let (o0, b0) = (other.stats().snapshot(), b.stats().snapshot());
        f();
        let (o, v) = (
            other.stats().snapshot().since(&o0),
            b.stats().snapshot().since(&b0),
        );
        (
            (o.host_waits, o.elided_syncs),
            (v.host_waits, v.submits, v.device_waits),
        )
    };
    // Pending behind cpu-async's closed gate: the call returns only once the gate opened.
    let gate = deadline::Watched::close(&*other);
    other.set_tensor_async_staged(theirs, 0, &[7; 16]).unwrap();
    other.event_record(&ev).unwrap();
    let blocked = std::cell::Cell::new(false);
    let c = counts(&|| {
        blocked.set(deadline::blocks_until_opened(&other, &gate, || {
            b.event_wait(&ev).unwrap()
        }));
    });
    assert!(
        blocked.get(),
        "event_wait returned while the other stream was still behind its gate"
    );
    assert_eq!(c, ((1, 0), (0, 0, 0)), "pending");
    assert!(ev.is_complete());
    gate.open();
    // Completed, but not yet seen by cpu-async's host: still one host wait there.
    other.set_tensor_async_staged(theirs, 0, &[8; 16]).unwrap();
    other.event_record(&ev).unwrap();
    deadline::wait_until("cpu-async ran its write", || ev.is_complete());
    assert_eq!(
        counts(&|| b.event_wait(&ev).unwrap()),
        ((1, 0), (0, 0, 0)),
        "complete, unseen"
    );
    // Seen complete by its host: an elided sync there, each time.
    for _ in 0..2 {
        assert_eq!(
            counts(&|| b.event_wait(&ev).unwrap()),
            ((0, 1), (0, 0, 0)),
            "complete, seen"
        );
    }
    // Work queued after the wait runs in order as usual.
    b.graph_compute_async(&common::copy_graph(x, y, 8)).unwrap();
    assert_eq!(common::read_f32(&b, y, 8), vec![4.0; 8]);
    common::assert_clean(&b);
}

#[test]
fn copies_and_reads_keep_stream_order_behind_a_gate() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = common::buffer_with(&b, &common::f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
        let y = b.alloc_buffer(16, BufferUsage::Compute).unwrap();
        let gate = b.gate_close().unwrap();
        let before = b.stats().snapshot();
        // y = x + x; x <- y (a stream-ordered copy); read x; y = x + x; read y.
        b.graph_compute_async(&common::add_graph(x, x, y, 4))
            .unwrap();
        b.copy_async(y, 0, x, 0, 16).unwrap();
        let mut first = b.read_async(x, 0, 16).unwrap();
        b.graph_compute_async(&common::add_graph(x, x, y, 4))
            .unwrap();
        let mut second = b.read_async(y, 0, 16).unwrap();
        let queued = b.stats().snapshot().since(&before);
        assert_eq!(queued.host_waits, 0, "queuing copies and reads never waits");
        assert_eq!((queued.d2d_copies, queued.d2h_copies), (1, 2));
        for _ in 0..100 {
            std::thread::yield_now();
        }
        assert!(!first.is_complete(), "the read ran behind a closed gate");
        gate.open();
        let floats = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        assert_eq!(floats(first.wait().unwrap()), vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!(floats(second.wait().unwrap()), vec![4.0, 8.0, 12.0, 16.0]);
        assert_eq!(floats(second.wait().unwrap()), vec![4.0, 8.0, 12.0, 16.0]);
        assert_eq!(b.stats().snapshot().since(&before).host_waits, 2);
        // A read dropped before it completed is harmless.
        let gate = b.gate_close().unwrap();
        drop(b.read_async(y, 0, 16).unwrap());
        gate.open();
        b.synchronize().unwrap();
        assert_eq!(common::read_f32(&b, y, 4), vec![4.0, 8.0, 12.0, 16.0]);
        assert!(b.copy_async(x, 8, y, 0, 16).is_err(), "out of bounds");
        common::assert_clean(&b);
    }
}
