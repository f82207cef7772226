//! CUDA graph replay: counts per step, bit-identical results with replay on and off, capture
//! again after memory moved, device timing. Ignored without a device.

mod common;

use std::sync::Arc;

use common::{gpu_with, Rng};
use lowsync_backend::{Backend, BufferId, BufferUsage, ExecGraph, ExecNode, TensorRef};
use lowsync_cuda::{CudaBackend, CudaConfig};
use lowsync_graph::{DType, Op};

fn cfg(graphs: bool) -> CudaConfig {
    CudaConfig {
        graphs,
        ..CudaConfig::default()
    }
}

fn t(buf: BufferId, off: usize, dtype: DType, shape: &[usize]) -> TensorRef {
    TensorRef {
        buffer: buf,
        byte_offset: off,
        dtype,
        shape: shape.to_vec(),
        strides: lowsync_graph::contiguous_strides(shape),
    }
}

fn node(op: Op, name: &str, dst: TensorRef, srcs: Vec<TensorRef>) -> ExecNode {
    ExecNode {
        op,
        name: name.into(),
        dst,
        srcs,
    }
}

/// A decode-shaped graph over one buffer: x [1, 64] (input at 0), weight w [96, 64] f16,
/// rms_norm -> mul -> matmul (matrix-vector path) -> softmax -> argmax. Returns the graph, the
/// buffer, the logits' and the token's offsets.
struct Decode {
    g: Arc<ExecGraph>,
    buf: BufferId,
    probs: TensorRef,
    tok_at: usize,
}

const D: usize = 64;
const V: usize = 96;

fn decode_graph(b: &CudaBackend, rng: &mut Rng) -> Decode {
    let buf = b.alloc_buffer(64 << 10, BufferUsage::Compute).unwrap();
    let x = t(buf, 0, DType::F32, &[1, D]);
    let nw = t(buf, 1024, DType::F32, &[D]);
    let w = t(buf, 2048, DType::F16, &[V, D]);
    let h = t(buf, 16384, DType::F32, &[1, D]);
    let hn = t(buf, 17408, DType::F32, &[1, D]);
    let logits = t(buf, 18432, DType::F32, &[1, V]);
    let probs = t(buf, 19456, DType::F32, &[1, V]);
    let tok_at = 20480;
    let tok = t(buf, tok_at, DType::I32, &[1]);
    let mut wt = w.clone(); // w.T: [D, V] view
    wt.shape = vec![D, V];
    wt.strides = vec![1, D];
    let nwb: Vec<u8> = rng.vec(D).iter().flat_map(|v| v.to_ne_bytes()).collect();
    b.set_tensor(buf, 1024, &nwb).unwrap();
    let wb = common::encode(DType::F16, &rng.vec(V * D));
    b.set_tensor(buf, 2048, &wb).unwrap();
    let g = Arc::new(ExecGraph::new(vec![
        node(Op::RmsNorm { eps: 1e-5 }, "norm", h.clone(), vec![x]),
        node(Op::Mul, "normw", hn.clone(), vec![h, nw]),
        node(Op::MulMat, "logits", logits.clone(), vec![hn, wt]),
        node(
            Op::SoftMax { scale: 0.5 },
            "probs",
            probs.clone(),
            vec![logits],
        ),
        node(Op::Argmax, "tok", tok, vec![probs.clone()]),
    ]));
    Decode {
        g,
        buf,
        probs,
        tok_at,
    }
}

/// One step: a staged input, the graph, a blocking 4-byte read of the token. Returns the token
/// and the probabilities' bits.
fn step(b: &CudaBackend, d: &Decode, x: &[f32]) -> (i32, Vec<u32>) {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
    b.set_tensor_async_staged(d.buf, 0, &bytes).unwrap();
    b.graph_compute_async(&d.g).unwrap();
    let mut tok = [0u8; 4];
    b.get_tensor(d.buf, d.tok_at, &mut tok).unwrap();
    let mut p = vec![0u8; V * 4];
    b.get_tensor(d.buf, d.probs.byte_offset, &mut p).unwrap();
    let bits = p
        .chunks(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (i32::from_ne_bytes(tok), bits)
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn replay_is_one_graph_launch_per_step_after_one_eager_run_and_one_capture() {
    let b = gpu_with("graphs_counts", cfg(true));
    let mut rng = Rng::new(1);
    let d = decode_graph(&b, &mut rng);
    let xs: Vec<Vec<f32>> = (0..8).map(|_| rng.vec(D)).collect();
    for (i, x) in xs.iter().enumerate() {
        let before = b.stats().snapshot();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
        b.set_tensor_async_staged(d.buf, 0, &bytes).unwrap();
        b.graph_compute_async(&d.g).unwrap();
        let mut tok = [0u8; 4];
        b.get_tensor(d.buf, d.tok_at, &mut tok).unwrap();
        let s = b.stats().snapshot().since(&before);
        assert_eq!(s.host_waits, 1, "step {i}: {s:?}");
        assert_eq!(
            (s.h2d_copies, s.d2h_copies, s.d2h_bytes),
            (1, 1, 4),
            "step {i}"
        );
        match i {
            0 => {
                assert_eq!((s.graph_captures, s.graph_launches), (0, 0), "eager first");
                // 5 nodes: norm, mul and product in one launch, then softmax and argmax.
                assert_eq!(s.kernel_launches, 3, "step 0: {s:?}");
            }
            _ => {
                assert_eq!(s.kernel_launches, 0, "step {i}: replayed, no eager kernel");
                assert_eq!(s.graph_launches, 1, "step {i}");
                assert_eq!(
                    s.graph_captures,
                    u64::from(i == 1),
                    "step {i}: captured once"
                );
                assert_eq!(s.submits, 3, "step {i}: upload, graph, readback");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn replay_on_and_off_give_bit_identical_results_with_inputs_changing_every_step() {
    let on = gpu_with("graphs_bits_on", cfg(true));
    let off = gpu_with("graphs_bits_off", cfg(false));
    let (mut r1, mut r2) = (Rng::new(5), Rng::new(5));
    let (d_on, d_off) = (decode_graph(&on, &mut r1), decode_graph(&off, &mut r2));
    let mut rng = Rng::new(9);
    for i in 0..20 {
        let x = rng.vec(D);
        let (t_on, p_on) = step(&on, &d_on, &x);
        let (t_off, p_off) = step(&off, &d_off, &x);
        assert_eq!(t_on, t_off, "step {i}");
        assert_eq!(p_on, p_off, "step {i}: probabilities differ bitwise");
    }
    let s_on = on.stats().snapshot();
    let s_off = off.stats().snapshot();
    assert_eq!(s_on.graph_captures, 1);
    assert_eq!(s_on.graph_launches, 19, "every step after the eager first");
    assert_eq!(s_off.graph_launches, 0);
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn a_reallocated_buffer_is_captured_again() {
    let b = gpu_with("graphs_realloc", cfg(true));
    let off = gpu_with("graphs_realloc_ref", cfg(false));
    let mut r1 = Rng::new(3);
    let mut r2 = Rng::new(3);
    let d = decode_graph(&b, &mut r1);
    let d_ref = decode_graph(&off, &mut r2);
    let mut rng = Rng::new(4);
    for _ in 0..3 {
        let x = rng.vec(D);
        assert_eq!(step(&b, &d, &x), step(&off, &d_ref, &x));
    }
    assert_eq!(b.stats().snapshot().graph_captures, 1);
    // Moving the buffer invalidates the captured addresses: re-upload its constant part (a
    // re-allocation zeroes it), then one eager run and a new capture.
    let mut keep = vec![0u8; 16384];
    b.get_tensor(d.buf, 0, &mut keep).unwrap();
    b.realloc_buffer(d.buf, 128 << 10).unwrap();
    b.set_tensor(d.buf, 0, &keep).unwrap();
    for _ in 0..3 {
        let x = rng.vec(D);
        assert_eq!(step(&b, &d, &x), step(&off, &d_ref, &x));
    }
    assert_eq!(b.stats().snapshot().graph_captures, 2);
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn timing_adds_device_time_once_a_wait_observed_the_graph() {
    let c = CudaConfig {
        timing: true,
        ..CudaConfig::default()
    };
    let b = gpu_with("graphs_timing", c);
    let mut rng = Rng::new(2);
    let d = decode_graph(&b, &mut rng);
    for _ in 0..4 {
        let x = rng.vec(D);
        step(&b, &d, &x);
    }
    let s = b.stats().snapshot();
    assert!(s.device_ns > 0, "{s:?}");
    assert_eq!(s.graph_launches, 3);
    // Timing events are ordering work, not submissions: 3 per replayed step as before.
    let before = b.stats().snapshot();
    step(&b, &d, &rng.vec(D));
    let s = b.stats().snapshot().since(&before);
    assert_eq!(
        (s.submits, s.host_waits),
        (4, 2),
        "upload, graph, two reads: {s:?}"
    );
}
