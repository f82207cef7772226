//! Graph builders shared by the criterion benches.
//!
//! [`llama_shaped`] builds a decoder-shaped step graph — per layer: RMSNorm, Q/K/V projections,
//! RoPE, KV-cache writes with `set_rows`, GQA attention with a mask, output projection,
//! SwiGLU FFN — with six host-written inputs, the shape of one decode step of a llama model.

use std::sync::Arc;

use lowsync_graph::{DType, Graph, RopeMode, TensorId};

/// Sizes of the synthetic decoder.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_ff: usize,
    pub n_vocab: usize,
    pub n_ctx: usize,
}

impl Shape {
    /// About 400 nodes: 13 layers of a small model.
    pub const BENCH: Shape = Shape {
        n_layers: 13,
        d_model: 64,
        n_heads: 4,
        n_kv_heads: 2,
        d_ff: 128,
        n_vocab: 256,
        n_ctx: 64,
    };
}

fn weight(g: &mut Graph, name: &str, shape: &[usize], seed: usize) -> TensorId {
    let n: usize = shape.iter().product();
    let data: Vec<u8> = (0..n)
        .flat_map(|i| {
            ((((i * 2654435761 + seed * 97) % 1000) as f32 - 500.0) / 25_000.0).to_ne_bytes()
        })
        .collect();
    g.weight(name, shape, DType::F32, Arc::from(data), None)
        .expect("bench weight")
}

/// [`llama_shaped`] with the output head (final norm and output projection) pinned to the
/// backend called `head_backend`: two splits per step, one activation crossing between them.
pub fn llama_shaped_two_splits(s: Shape, head_backend: &str) -> Graph {
    build(s, Some(head_backend))
}

/// One decode step (n_tokens = 1) of a llama-shaped model. Inputs: `tokens`, `pos`, `kv_idx`
/// (`i32 [1]`), `kq_mask` (`f32 [1, n_ctx]`), `out_ids` (`i32 [1]`), `logit_scale` (`f32 [1]`).
/// Output: `next` (`i32 [1]`), the greedy token.
pub fn llama_shaped(s: Shape) -> Graph {
    build(s, None)
}

fn build(s: Shape, head_backend: Option<&str>) -> Graph {
    let mut g = Graph::new();
    let hd = s.d_model / s.n_heads;
    let kv_d = s.n_kv_heads * hd;
    let tokens = g.input("tokens", &[1], DType::I32).unwrap();
    let pos = g.input("pos", &[1], DType::I32).unwrap();
    let kv_idx = g.input("kv_idx", &[1], DType::I32).unwrap();
    let mask = g.input("kq_mask", &[1, s.n_ctx], DType::F32).unwrap();
    let out_ids = g.input("out_ids", &[1], DType::I32).unwrap();
    let logit_scale = g.input("logit_scale", &[1], DType::F32).unwrap();
    let embd = weight(&mut g, "tok_embd", &[s.n_vocab, s.d_model], 1);
    let mut x = g.get_rows(embd, tokens).unwrap();
    for l in 0..s.n_layers {
        let w = |g: &mut Graph, n: &str, shape: &[usize]| {
            weight(g, &format!("blk.{l}.{n}"), shape, l * 16 + n.len())
        };
        let norm_w = w(&mut g, "attn_norm", &[s.d_model]);
        let wq = w(&mut g, "wq", &[s.d_model, s.d_model]);
        let wk = w(&mut g, "wk", &[s.d_model, kv_d]);
        let wv = w(&mut g, "wv", &[s.d_model, kv_d]);
        let wo = w(&mut g, "wo", &[s.d_model, s.d_model]);
        let ffn_norm = w(&mut g, "ffn_norm", &[s.d_model]);
        let wg = w(&mut g, "w_gate", &[s.d_model, s.d_ff]);
        let wu = w(&mut g, "w_up", &[s.d_model, s.d_ff]);
        let wd = w(&mut g, "w_down", &[s.d_ff, s.d_model]);
        let k_cache = g
            .persistent(&format!("blk.{l}.k_cache"), &[s.n_ctx, kv_d], DType::F32)
            .unwrap();
        let v_cache = g
            .persistent(&format!("blk.{l}.v_cache"), &[s.n_ctx, kv_d], DType::F32)
            .unwrap();

        let h = g.rms_norm(x, 1e-5).unwrap();
        let h = g.mul(h, norm_w).unwrap();
        let q = g.mul_mat(h, wq).unwrap();
        let k = g.mul_mat(h, wk).unwrap();
        let v = g.mul_mat(h, wv).unwrap();
        let q = g.reshape(q, &[1, s.n_heads, hd]).unwrap();
        let k = g.reshape(k, &[1, s.n_kv_heads, hd]).unwrap();
        let q = g.rope(q, pos, RopeMode::Normal, hd, 10_000.0).unwrap();
        let k = g.rope(k, pos, RopeMode::Normal, hd, 10_000.0).unwrap();
        let k = g.reshape(k, &[1, kv_d]).unwrap();
        let kc = g.set_rows(k_cache, k, kv_idx).unwrap();
        let vc = g.set_rows(v_cache, v, kv_idx).unwrap();
        let kc = g.reshape(kc, &[s.n_ctx, s.n_kv_heads, hd]).unwrap();
        let vc = g.reshape(vc, &[s.n_ctx, s.n_kv_heads, hd]).unwrap();
        let kt = g.permute(kc, &[1, 2, 0]).unwrap(); // [kv_heads, hd, n_ctx]
        let vt = g.permute(vc, &[1, 0, 2]).unwrap(); // [kv_heads, n_ctx, hd]
        let qh = g.permute(q, &[1, 0, 2]).unwrap(); // [heads, 1, hd]
        let kq = g.mul_mat(qh, kt).unwrap(); // [heads, 1, n_ctx]
        let kq = g
            .soft_max(kq, Some(mask), 1.0 / (hd as f32).sqrt())
            .unwrap();
        let o = g.mul_mat(kq, vt).unwrap(); // [heads, 1, hd]
        let o = g.permute(o, &[1, 0, 2]).unwrap();
        let o = g.cont(o).unwrap();
        let o = g.reshape(o, &[1, s.d_model]).unwrap();
        let o = g.mul_mat(o, wo).unwrap();
        let x1 = g.add(o, x).unwrap();
        let h = g.rms_norm(x1, 1e-5).unwrap();
        let h = g.mul(h, ffn_norm).unwrap();
        let gate = g.mul_mat(h, wg).unwrap();
        let up = g.mul_mat(h, wu).unwrap();
        let f = g.swiglu(gate, up).unwrap();
        let f = g.mul_mat(f, wd).unwrap();
        x = g.add(f, x1).unwrap();
    }
    let out_norm = weight(&mut g, "output_norm", &[s.d_model], 7);
    let w_out = weight(&mut g, "output", &[s.d_model, s.n_vocab], 9);
    if let Some(b) = head_backend {
        g.pin(out_norm, b).unwrap();
        g.pin(w_out, b).unwrap();
    }
    let x = g.get_rows(x, out_ids).unwrap();
    let x = g.rms_norm(x, 1e-5).unwrap();
    let x = g.mul(x, out_norm).unwrap();
    let logits = g.mul_mat(x, w_out).unwrap();
    let logits = g.mul(logits, logit_scale).unwrap();
    let next = g.argmax(logits).unwrap();
    g.output("next", next).unwrap();
    g
}

/// Writes the six inputs of step `n` (position `n`, a causal mask over `n + 1` cells).
pub fn write_step_inputs(plan: &mut lowsync_scheduler::Plan, s: Shape, n: usize, token: i32) {
    let i32b = |v: i32| v.to_ne_bytes();
    plan.set_input("tokens", &i32b(token)).unwrap();
    plan.set_input("pos", &i32b(n as i32)).unwrap();
    plan.set_input("kv_idx", &i32b((n % s.n_ctx) as i32))
        .unwrap();
    plan.set_input("out_ids", &i32b(0)).unwrap();
    plan.set_input("logit_scale", &1.0f32.to_ne_bytes())
        .unwrap();
    let mask = plan.input_bytes_mut("kq_mask").unwrap();
    for (c, chunk) in mask.chunks_exact_mut(4).enumerate() {
        let v = if c <= n % s.n_ctx {
            0.0f32
        } else {
            f32::NEG_INFINITY
        };
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
}
