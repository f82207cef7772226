//! Counter tests that drive the backends directly (no scheduler): each blocking primitive
//! counts one host wait and one driver sync; an idle synchronize is elided; staged writes never
//! wait; and the counts equal what a test-side wrapper observes around the worker's wait.

use std::sync::Arc;

use lowsync_backend::{Backend, BufferUsage, ExecGraph, StatsSnapshot};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend, NoopBackend};

fn snap(b: &dyn Backend) -> StatsSnapshot {
    b.stats().snapshot()
}

#[test]
fn cpu_async_blocking_write_is_one_host_wait_and_one_driver_sync() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    let before = snap(&b);
    b.set_tensor(buf, 0, &[1u8; 16]).unwrap();
    let d = snap(&b).since(&before);
    assert_eq!(
        (
            d.host_waits,
            d.driver_syncs,
            d.h2d_copies,
            d.h2d_bytes,
            d.submits
        ),
        (1, 1, 1, 16, 1)
    );
    let mut out = [0u8; 16];
    b.get_tensor(buf, 0, &mut out).unwrap();
    let d = snap(&b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.d2h_copies), (2, 2, 1));
    assert_eq!(out, [1u8; 16]);
}

#[test]
fn idle_synchronize_is_elided_not_a_host_wait() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let before = snap(&b);
    b.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = snap(&b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (0, 0, 2));
}

#[test]
fn synchronize_after_enqueue_waits_once_then_elides() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    b.set_tensor_async_staged(buf, 0, &[3u8; 8]).unwrap();
    b.graph_compute_async(&Arc::new(ExecGraph::default()))
        .unwrap();
    let before = snap(&b);
    b.synchronize().unwrap();
    b.synchronize().unwrap();
    let d = snap(&b).since(&before);
    assert_eq!((d.host_waits, d.driver_syncs, d.elided_syncs), (1, 1, 1));
}

#[test]
fn staged_writes_count_no_host_wait() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(1024, BufferUsage::Inputs).unwrap();
    let before = snap(&b);
    for i in 0..100u8 {
        b.set_tensor_async_staged(buf, 0, &[i; 256]).unwrap();
    }
    let d = snap(&b).since(&before);
    assert_eq!(
        (d.host_waits, d.driver_syncs, d.h2d_copies, d.submits),
        (0, 0, 100, 100)
    );
    b.synchronize().unwrap();
    let mut out = [0u8; 4];
    b.get_tensor(buf, 0, &mut out).unwrap();
    assert_eq!(out, [99u8; 4]);
    assert_eq!(
        snap(&b).staging_bytes_in_use,
        0,
        "staging is released once the writes ran"
    );
}

/// A test-side model of the stream: it keeps its own tickets, outside the backend, and predicts
/// for every call whether the host must block. The backend's counters must agree with it over
/// a long mixed sequence — and the waits it predicts really block (checked with the gate).
struct Model {
    submitted: u64,
    observed: u64,
    waits: u64,
    elided: u64,
}

impl Model {
    fn enqueue(&mut self) {
        self.submitted += 1;
    }
    fn sync(&mut self) {
        if self.observed == self.submitted {
            self.elided += 1;
        } else {
            self.waits += 1;
            self.observed = self.submitted;
        }
    }
    fn blocking(&mut self) {
        self.enqueue();
        self.waits += 1;
        self.observed = self.submitted;
    }
}

#[test]
fn counts_match_a_test_side_model_of_the_stream() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    let empty = Arc::new(ExecGraph::default());
    let mut m = Model {
        submitted: 0,
        observed: 0,
        waits: 0,
        elided: 0,
    };
    let before = snap(&b);
    let mut out = [0u8; 8];
    for step in 0..200u32 {
        match step * 7919 % 5 {
            0 => {
                b.set_tensor_async_staged(buf, 0, &[step as u8; 8]).unwrap();
                m.enqueue();
            }
            1 => {
                b.graph_compute_async(&empty).unwrap();
                m.enqueue();
            }
            2 => {
                b.synchronize().unwrap();
                m.sync();
            }
            3 => {
                b.get_tensor(buf, 0, &mut out).unwrap();
                m.blocking();
            }
            _ => {
                b.set_tensor(buf, 8, &[1u8; 8]).unwrap();
                m.blocking();
            }
        }
    }
    let d = snap(&b).since(&before);
    assert_eq!(
        (d.host_waits, d.driver_syncs, d.elided_syncs, d.submits),
        (m.waits, m.waits, m.elided, m.submitted)
    );
}

#[test]
fn a_counted_wait_really_blocks_until_the_gate_opens() {
    let b = Arc::new(CpuAsyncBackend::new("cpu-async").unwrap());
    let gate = b.gate_close().unwrap();
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    let waiter = {
        let b = b.clone();
        std::thread::spawn(move || {
            b.synchronize().unwrap();
            b.stats().snapshot().host_waits
        })
    };
    // The waiter cannot finish while the gate is closed.
    for _ in 0..100 {
        std::thread::yield_now();
    }
    assert!(!ev.is_complete());
    assert!(!waiter.is_finished());
    gate.open();
    assert_eq!(waiter.join().unwrap(), 1);
    assert!(ev.is_complete());
}

#[test]
fn cpu_never_waits_and_elides_every_synchronize() {
    let b = CpuBackend::new();
    let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    let before = snap(&b);
    b.set_tensor(buf, 0, &[1u8; 8]).unwrap();
    b.graph_compute_async(&Arc::new(ExecGraph::default()))
        .unwrap();
    b.synchronize().unwrap();
    let d = snap(&b).since(&before);
    assert_eq!(
        (d.host_waits, d.driver_syncs, d.elided_syncs, d.h2d_copies),
        (0, 0, 1, 1)
    );
}

#[test]
fn noop_counts_like_cpu_async() {
    let a = CpuAsyncBackend::new("cpu-async").unwrap();
    let n = NoopBackend::new();
    for b in [&a as &dyn Backend, &n as &dyn Backend] {
        let buf = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        b.set_tensor_async_staged(buf, 0, &[1u8; 8]).unwrap();
        b.graph_compute_async(&Arc::new(ExecGraph::default()))
            .unwrap();
        b.synchronize().unwrap();
        b.synchronize().unwrap();
        b.set_tensor(buf, 0, &[1u8; 8]).unwrap();
        let mut out = [0u8; 8];
        b.get_tensor(buf, 0, &mut out).unwrap();
        // The launch-ahead pattern: copy, read, more work, then the read's wait (twice).
        b.copy_async(buf, 0, buf, 32, 8).unwrap();
        let mut r = b.read_async(buf, 32, 8).unwrap();
        b.graph_compute_async(&Arc::new(ExecGraph::default()))
            .unwrap();
        r.wait().unwrap();
        r.wait().unwrap();
        b.synchronize().unwrap();
        let mut r = b.read_async(buf, 32, 8).unwrap();
        b.synchronize().unwrap();
        r.wait().unwrap();
    }
    let (sa, sn) = (snap(&a), snap(&n));
    let key = |s: &StatsSnapshot| {
        (
            s.host_waits,
            s.driver_syncs,
            s.elided_syncs,
            s.submits,
            s.h2d_copies,
            (s.d2h_copies, s.d2d_copies, s.d2d_bytes),
        )
    };
    assert_eq!(key(&sa), key(&sn));
    assert_eq!((sa.host_waits, sa.elided_syncs), (6, 2));
}

#[test]
fn out_of_bounds_write_is_an_error_not_a_crash() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let buf = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    assert!(b.set_tensor(buf, 8, &[0u8; 16]).is_err());
    assert!(b.set_tensor_async_staged(buf, 8, &[0u8; 16]).is_err());
    b.set_tensor(buf, 0, &[5u8; 16]).unwrap();
}

#[test]
fn an_allocation_the_host_cannot_give_is_an_error_not_an_abort() {
    for b in [
        &CpuBackend::new() as &dyn Backend,
        &CpuAsyncBackend::new("cpu-async").unwrap(),
    ] {
        let err = b
            .alloc_buffer(1 << 62, BufferUsage::Persistent)
            .unwrap_err();
        assert!(err.to_string().contains("out of host memory"), "{err}");
        assert!(
            b.alloc_buffer(64, BufferUsage::Compute).is_ok(),
            "the backend stays usable"
        );
    }
}
