//! Counter tests that drive the backends directly (no scheduler): each blocking primitive
//! counts one host wait and one driver sync; an idle synchronize is elided; staged writes never
//! wait; and the counts equal what a test-side wrapper observes around the worker's wait.

mod common;

use std::sync::Arc;

use common::{wait_until, Watched};
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
    let gate = Watched::close(&*b);
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    let waiter = {
        let (b, ev) = (b.clone(), ev.clone());
        std::thread::spawn(move || {
            b.synchronize().unwrap();
            // Returning before the gated work ran would be a wait that did not wait.
            ev.is_complete()
        })
    };
    // The wait is counted when it starts: the waiter is inside it now.
    wait_until("the waiter counted its wait", || {
        b.stats().snapshot().host_waits == 1
    });
    assert!(!ev.is_complete());
    gate.open();
    assert!(
        waiter.join().unwrap(),
        "synchronize returned before the work completed"
    );
    assert_eq!(b.stats().snapshot().host_waits, 1);
}

/// The counters that changed in `d`, by name (every other counter stayed put).
fn changed(d: &StatsSnapshot) -> Vec<(&'static str, u64)> {
    d.fields().into_iter().filter(|&(_, v)| v != 0).collect()
}

/// Every `cpu-async` primitive changes exactly the counters ARCHITECTURE §3 assigns to it, by
/// exactly its amount: copies and their bytes, kernels per node, one submission per queued
/// item, one host wait and driver sync per wait, an elided sync where the host had already
/// observed everything, a reserve per buffer, a realloc per growth.
#[test]
fn each_cpu_async_primitive_changes_exactly_its_counters() {
    let b = CpuAsyncBackend::new("cpu-async").unwrap();
    let delta = |f: &mut dyn FnMut()| {
        let before = snap(&b);
        f();
        changed(&snap(&b).since(&before))
    };
    let wait = [("host_waits", 1), ("driver_syncs", 1)];
    let with_wait = |mut v: Vec<(&'static str, u64)>| {
        v.extend(wait);
        v.sort();
        v
    };
    let sorted = |mut v: Vec<(&'static str, u64)>| {
        v.sort();
        v
    };
    let mut buf = None;
    assert_eq!(
        delta(&mut || buf = Some(b.alloc_buffer(256, BufferUsage::Compute).unwrap())),
        [("reserves", 1)]
    );
    let buf = buf.unwrap();
    assert_eq!(
        sorted(delta(&mut || b.set_tensor(buf, 0, &[1u8; 16]).unwrap())),
        with_wait(vec![("submits", 1), ("h2d_copies", 1), ("h2d_bytes", 16)])
    );
    let mut out = [0u8; 64];
    assert_eq!(
        sorted(delta(&mut || b.get_tensor(buf, 0, &mut out[..8]).unwrap())),
        with_wait(vec![("submits", 1), ("d2h_copies", 1), ("d2h_bytes", 8)])
    );
    let src = [2u8; 12];
    assert_eq!(
        sorted(delta(&mut || {
            // SAFETY: `src` outlives the synchronize that ends the write.
            unsafe {
                b.set_tensor_async(buf, 16, src.as_ptr(), src.len())
                    .unwrap()
            };
            b.synchronize().unwrap();
        })),
        with_wait(vec![("submits", 1), ("h2d_copies", 1), ("h2d_bytes", 12)])
    );
    assert_eq!(
        sorted(delta(&mut || {
            // SAFETY: `out` outlives the synchronize that ends the read.
            unsafe { b.get_tensor_async(buf, 0, out.as_mut_ptr(), 20).unwrap() };
            b.synchronize().unwrap();
        })),
        with_wait(vec![("submits", 1), ("d2h_copies", 1), ("d2h_bytes", 20)])
    );
    assert_eq!(&out[16..20], &[2u8; 4]);
    assert_eq!(
        sorted(delta(&mut || {
            b.set_tensor_async_staged(buf, 0, &[3u8; 24]).unwrap();
            b.synchronize().unwrap(); // the staging gauge is back at 0 once the write ran
        })),
        with_wait(vec![("submits", 1), ("h2d_copies", 1), ("h2d_bytes", 24)])
    );
    let f32_ref = |byte_offset| lowsync_backend::TensorRef {
        buffer: buf,
        byte_offset,
        dtype: lowsync_graph::DType::F32,
        shape: vec![4],
        strides: vec![1],
    };
    let node = |dst, src| lowsync_backend::ExecNode {
        op: lowsync_graph::Op::Scale { scale: 2.0 },
        name: "y".into(),
        dst: f32_ref(dst),
        srcs: vec![f32_ref(src)],
    };
    let g = Arc::new(ExecGraph::new(vec![
        node(64, 0),
        node(80, 64),
        node(96, 80),
    ]));
    assert_eq!(
        sorted(delta(&mut || {
            b.graph_compute_async(&g).unwrap();
            b.synchronize().unwrap();
        })),
        with_wait(vec![("submits", 1), ("kernel_launches", 3)])
    );
    assert_eq!(
        sorted(delta(&mut || {
            b.copy_async(buf, 0, buf, 128, 8).unwrap();
            b.synchronize().unwrap();
        })),
        with_wait(vec![("submits", 1), ("d2d_copies", 1), ("d2d_bytes", 8)])
    );
    assert_eq!(
        sorted(delta(&mut || {
            let mut r = b.read_async(buf, 128, 4).unwrap();
            assert_eq!(r.wait().unwrap(), &[3u8; 4]);
        })),
        with_wait(vec![("submits", 1), ("d2h_copies", 1), ("d2h_bytes", 4)])
    );
    // Events: covered by the last wait (elided), then pending (one wait), then covered again.
    let ev = b.event_new().unwrap();
    b.event_record(&ev).unwrap();
    assert_eq!(
        delta(&mut || ev.synchronize().unwrap()),
        [("elided_syncs", 1)]
    );
    b.set_tensor_async_staged(buf, 0, &[4u8; 4]).unwrap();
    b.event_record(&ev).unwrap();
    assert_eq!(delta(&mut || ev.synchronize().unwrap()), wait);
    assert_eq!(
        delta(&mut || ev.synchronize().unwrap()),
        [("elided_syncs", 1)]
    );
    assert_eq!(
        delta(&mut || b.synchronize().unwrap()),
        [("elided_syncs", 1)]
    );
    assert_eq!(
        sorted(delta(&mut || b.realloc_buffer(buf, 512).unwrap())),
        sorted(vec![("elided_syncs", 1), ("reallocs", 1)]),
        "nothing outstanding: the realloc's synchronize is elided"
    );
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
