//! 10,000 staged steps on a small graph, on both memory paths: at most one host wait per
//! step, no empty submission, staging released every step and its arena bounded (invariant
//! 8), descriptor sets reused rather than re-created.

mod common;

use lowsync_backend::{Backend, BufferUsage};

const STEPS: usize = 10_000;

#[test]
fn ten_thousand_staged_steps_stay_bounded_with_one_wait_per_step() {
    for cfg in common::both_paths() {
        let Some(b) = common::open(cfg) else { return };
        let inp = b.alloc_buffer(256, BufferUsage::Inputs).unwrap();
        let bias = common::buffer_with(&b, &common::f32_bytes(&[0.5; 64]));
        let out = b.alloc_buffer(256, BufferUsage::Compute).unwrap();
        let g = common::add_graph(inp, bias, out, 64);
        b.synchronize().unwrap();
        let mut staging_after_warmup = 0;
        let mut sets_after_warmup = 0;
        let mut host = vec![0u8; 256];
        let mut res = [0u8; 4];
        for step in 0..STEPS {
            let before = b.stats().snapshot();
            host.copy_from_slice(&common::f32_bytes(&[step as f32; 64]));
            b.set_tensor_async_staged(inp, 0, &host).unwrap();
            host.fill(0); // overwritten at once; the device still sees the step's value
            b.graph_compute_async(&g).unwrap();
            b.get_tensor(out, 0, &mut res).unwrap();
            let d = b.stats().snapshot().since(&before);
            assert_eq!(
                d.host_waits, 1,
                "step {step}: the blocking read is the one wait"
            );
            assert_eq!(d.empty_submits, 0);
            assert_eq!(
                d.staging_bytes_in_use, 0,
                "step {step}: staging not released"
            );
            assert_eq!(f32::from_le_bytes(res), step as f32 + 0.5);
            if step == 100 {
                staging_after_warmup = b.staging_capacity();
                sets_after_warmup = b.cached_descriptor_sets();
            }
        }
        assert_eq!(
            b.staging_capacity(),
            staging_after_warmup,
            "staging arena grew"
        );
        assert_eq!(
            b.cached_descriptor_sets(),
            sets_after_warmup,
            "descriptor sets re-created"
        );
        common::assert_clean(&b);
    }
}
