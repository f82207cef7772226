//! Counter tests (ARCHITECTURE §3): counts follow the stream's tickets on both memory paths —
//! an idle synchronize is elided, staged writes never wait, a blocking write is one wait,
//! nothing ever submits an empty batch, the legacy switch shows ggml's empty submit, and a
//! step queued with its read is one submission.

mod common;

use lowsync_backend::{Backend, BufferUsage, ExecGraph, StatsSnapshot};
use lowsync_vulkan::VkConfig;
use std::sync::Arc;

fn snap(b: &dyn Backend) -> StatsSnapshot {
    b.stats().snapshot()
}

#[test]
fn idle_synchronize_is_elided_not_a_host_wait() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap(); // the no-ReBAR path zero-fills in the stream
        let before = snap(&b);
        b.synchronize().unwrap();
        b.synchronize().unwrap();
        let d = snap(&b).since(&before);
        assert_eq!(
            (d.host_waits, d.driver_syncs, d.elided_syncs, d.submits),
            (0, 0, 2, 0)
        );
        b.free_buffer(buf);
        common::assert_clean(&b);
    }
}

#[test]
fn synchronize_after_work_waits_once_then_elides() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        let before = snap(&b);
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        b.synchronize().unwrap();
        b.synchronize().unwrap();
        let d = snap(&b).since(&before);
        assert_eq!(
            (
                d.host_waits,
                d.driver_syncs,
                d.elided_syncs,
                d.submits,
                d.empty_submits
            ),
            (1, 1, 1, 1, 0)
        );
        common::assert_clean(&b);
    }
}

#[test]
fn staged_writes_count_no_host_wait_and_release_staging() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let buf = b.alloc_buffer(1024, BufferUsage::Inputs).unwrap();
        let staged = !b.is_host_writable(buf);
        b.synchronize().unwrap();
        let before = snap(&b);
        for i in 0..100u8 {
            b.set_tensor_async_staged(buf, 0, &[i; 256]).unwrap();
        }
        let d = snap(&b).since(&before);
        assert_eq!(
            (d.host_waits, d.driver_syncs, d.h2d_copies, d.empty_submits),
            (0, 0, 100, 0)
        );
        if staged {
            // Bytes wait in staging until their copy ran.
            assert_eq!(d.staging_bytes_in_use, 100 * 256);
            assert_eq!(d.submits, 0, "staged copies ride on the next submission");
        } else {
            assert_eq!(
                b.route_stats().direct_writes,
                100,
                "idle stream: plain memcpy"
            );
        }
        b.synchronize().unwrap();
        let mut out = [0u8; 4];
        b.get_tensor(buf, 0, &mut out).unwrap();
        assert_eq!(out, [99u8; 4]);
        assert_eq!(
            snap(&b).staging_bytes_in_use,
            0,
            "staging released once the copies ran"
        );
        common::assert_clean(&b);
    }
}

#[test]
fn staged_write_behind_queued_work_goes_through_staging_without_a_wait() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        let before = snap(&b);
        b.set_tensor_async_staged(x, 0, &common::f32_bytes(&[7.0; 16]))
            .unwrap();
        let d = snap(&b).since(&before);
        assert_eq!((d.host_waits, d.submits, d.h2d_copies), (0, 0, 1));
        assert_eq!(d.staging_bytes_in_use, 64);
        b.synchronize().unwrap();
        assert_eq!(common::read_f32(&b, x, 16), vec![7.0; 16]);
        common::assert_clean(&b);
    }
}

#[test]
fn blocking_write_after_queued_work_is_one_host_wait() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        let before = snap(&b);
        b.set_tensor(x, 0, &common::f32_bytes(&[3.0; 16])).unwrap();
        let d = snap(&b).since(&before);
        assert_eq!(
            (d.host_waits, d.driver_syncs, d.h2d_copies, d.empty_submits),
            (1, 1, 1, 0)
        );
        // Nothing is outstanding after a blocking write.
        let before = snap(&b);
        b.synchronize().unwrap();
        assert_eq!(snap(&b).since(&before).elided_syncs, 1);
        common::assert_clean(&b);
    }
}

#[test]
fn blocking_write_on_the_no_rebar_path_is_one_submit_and_one_wait() {
    let Some(b) = common::open(common::config_no_rebar()) else {
        return;
    };
    let x = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
    b.synchronize().unwrap();
    let before = snap(&b);
    b.set_tensor(x, 0, &[1u8; 64]).unwrap();
    let mut out = [0u8; 64];
    b.get_tensor(x, 0, &mut out).unwrap();
    let d = snap(&b).since(&before);
    assert_eq!((d.submits, d.host_waits, d.empty_submits), (2, 2, 0));
    assert_eq!(out, [1u8; 64]);
    common::assert_clean(&b);
}

#[test]
fn a_decode_like_step_is_one_host_wait_one_h2d_copy_and_no_empty_submit() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let inp = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        let w = common::buffer_with(&b, &common::f32_bytes(&[1.0; 16]));
        let out = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let readable = b.is_host_readable(out);
        let g = common::add_graph(inp, w, out, 16);
        b.synchronize().unwrap();
        let before = snap(&b);
        for step in 0..20 {
            // Write the step's input, queue the graph, read the result: the read is the wait.
            b.set_tensor_async_staged(inp, 0, &common::f32_bytes(&[step as f32; 16]))
                .unwrap();
            b.graph_compute_async(&g).unwrap();
            assert_eq!(common::read_f32(&b, out, 16)[0], step as f32 + 1.0);
        }
        let d = snap(&b).since(&before);
        assert_eq!((d.host_waits, d.driver_syncs, d.empty_submits), (20, 20, 0));
        assert_eq!(d.h2d_copies, 20, "one H2D copy per step");
        // Memory the host cannot read directly is read through a copy: a second submission
        // per step (the no-ReBAR path, and device-local memory on discrete GPUs).
        assert_eq!(d.submits, if readable { 20 } else { 40 });
        common::assert_clean(&b);
    }
}

#[test]
fn a_step_queued_with_its_read_is_one_submit_on_both_paths() {
    for cfg in common::both_paths() {
        for record in [true, false] {
            let Some(b) = common::open(VkConfig {
                record,
                ..cfg.clone()
            }) else {
                return;
            };
            let inp = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
            let w = common::buffer_with(&b, &common::f32_bytes(&[1.0; 16]));
            let out = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
            let g = common::add_graph(inp, w, out, 16);
            b.synchronize().unwrap();
            let before = snap(&b);
            let mut pending = None;
            for step in 0..20 {
                // Queue step `step` with its read, then wait for the previous step's read: the
                // device has the next step while the host waits (launch-ahead).
                b.set_tensor_async_staged(inp, 0, &common::f32_bytes(&[step as f32; 16]))
                    .unwrap();
                let next = b.graph_compute_read_async(&g, out, 0, 64).unwrap();
                if let Some((s, mut rb)) = pending.replace((step, next)) {
                    let v = f32::from_le_bytes(rb.wait().unwrap()[..4].try_into().unwrap());
                    assert_eq!(v, s as f32 + 1.0, "step {s}");
                }
            }
            let (s, mut rb) = pending.take().unwrap();
            let v = f32::from_le_bytes(rb.wait().unwrap()[..4].try_into().unwrap());
            assert_eq!(v, s as f32 + 1.0);
            let d = snap(&b).since(&before);
            assert_eq!(
                (d.host_waits, d.empty_submits, d.h2d_copies, d.d2h_copies),
                (20, 0, 20, 20)
            );
            // The read's copy ends the step's own command buffer: one submission per step.
            assert_eq!(d.submits, 20, "{d:?}");
            common::assert_clean(&b);
        }
    }
}

#[test]
fn empty_graphs_submit_nothing() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let before = snap(&b);
    b.graph_compute_async(&Arc::new(ExecGraph::default()))
        .unwrap();
    b.synchronize().unwrap();
    let d = snap(&b).since(&before);
    assert_eq!(
        (d.submits, d.empty_submits, d.host_waits, d.elided_syncs),
        (0, 0, 0, 1)
    );
    common::assert_clean(&b);
}

#[test]
fn legacy_mode_shows_the_empty_submit_and_fence_wait_at_synchronize() {
    for no_rebar in [false, true] {
        let cfg = VkConfig {
            legacy_submits: true,
            no_host_visible_vram: no_rebar,
            ..common::config()
        };
        let Some(b) = common::open(cfg) else { return };
        assert!(!b.caps().sync_elision);
        let x = b.alloc_buffer(64, BufferUsage::Inputs).unwrap();
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.synchronize().unwrap();
        let before = snap(&b);
        b.synchronize().unwrap(); // idle: still an empty submit and a fence wait
        let d = snap(&b).since(&before);
        assert_eq!(
            (d.submits, d.empty_submits, d.host_waits, d.elided_syncs),
            (1, 1, 1, 0)
        );
        let before = snap(&b);
        b.set_tensor(x, 0, &[0u8; 64]).unwrap();
        let d = snap(&b).since(&before);
        if no_rebar {
            // ggml: one submit carrying the copy and a fence, one fence wait.
            assert_eq!((d.submits, d.empty_submits, d.host_waits), (1, 0, 1));
        } else {
            assert_eq!((d.submits, d.host_waits), (0, 0), "mapped memory: a memcpy");
        }
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        let before = snap(&b);
        b.synchronize().unwrap();
        let d = snap(&b).since(&before);
        assert_eq!((d.submits, d.empty_submits, d.host_waits), (1, 1, 1));
        common::assert_clean(&b);
    }
}

#[test]
fn out_of_bounds_and_unknown_buffers_are_errors_not_crashes() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let buf = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    assert!(b.set_tensor(buf, 8, &[0u8; 16]).is_err());
    assert!(b.set_tensor_async_staged(buf, 8, &[0u8; 16]).is_err());
    let mut out = [0u8; 32];
    assert!(b.get_tensor(buf, 0, &mut out).is_err());
    b.free_buffer(buf);
    assert!(b.set_tensor(buf, 0, &[0u8; 4]).is_err());
    let buf = b.alloc_buffer(16, BufferUsage::Inputs).unwrap();
    b.set_tensor(buf, 0, &[5u8; 16]).unwrap();
    common::assert_clean(&b);
}

#[test]
fn realloc_and_free_keep_the_backend_usable() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        b.free_buffer(y); // queued work still uses it: destroyed after it completes
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        b.realloc_buffer(x, 256).unwrap();
        assert_eq!(b.buffer_size(x).unwrap(), 256);
        b.set_tensor(x, 0, &common::f32_bytes(&[2.0; 64])).unwrap();
        b.graph_compute_async(&common::copy_graph(x, y, 16))
            .unwrap();
        assert_eq!(common::read_f32(&b, y, 16), vec![2.0; 16]);
        assert_eq!(snap(&b).reallocs, 1);
        common::assert_clean(&b);
    }
}

#[test]
fn a_replayed_graph_follows_a_reallocated_buffer() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let x = common::buffer_with(&b, &common::f32_bytes(&[1.0; 16]));
        let y = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
        let g = common::copy_graph(x, y, 16);
        b.graph_compute_async(&g).unwrap();
        assert_eq!(common::read_f32(&b, y, 16), vec![1.0; 16]);
        b.realloc_buffer(x, 128).unwrap();
        b.set_tensor(x, 0, &common::f32_bytes(&[9.0; 16])).unwrap();
        b.graph_compute_async(&g).unwrap(); // same graph object: its plan must be rebuilt
        assert_eq!(common::read_f32(&b, y, 16), vec![9.0; 16]);
        common::assert_clean(&b);
    }
}
