//! The launcher of the fused matrix-vector products (gemv.cu): products of one activation with
//! their epilogues, and decode's one-row kernels with the norm prologue.
//!
//! Why: decode is memory bound on its weights; the products that share an activation (q/k/v,
//! gate/up) read it once, and their epilogues (Add, SwiGlu, the Rope and KV-cache row of q/k/v)
//! finish in the registers of the unit that computed the value, saving a launch and a round
//! trip each.
//!
//! Strategy: the segments go to the kernel as one [`FgSet`] (by value, field for field the
//! struct of gemv.cu). Several rows take `fused_gemv` / `fused_gemv8`; one aligned row takes
//! the decode kernels — one unit per warp, or streamed over a grid of `stream_blocks` per
//! multiprocessor (`CudaConfig::gemv_stream`), through a dtype's own entry point where one
//! applies (`gemv_split`) — with the norm computed in the prologue when that fits one wave.
//! When the row-pair kernel turns out not to apply, the group runs as its parts, in node order.
//! Quantized weights (one row) take `fused_gemv1_q`, each segment with its block type and row
//! stride in bytes; where it does not apply at launch time the group's nodes run unfused.
//!
//! Invariant: results dead after the group (`safety::Dead`) are the only ones not written;
//! sums run in fixed orders, so streamed and unstreamed results are the same bytes.

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::{DType, Op};

use crate::config::{CudaConfig, TypedQ, MAX_Q_WARPS};
use crate::exec::launch::{dt, kernel_err, qt, quant_row_bytes, Args, Dev, Exec};
use crate::exec::matmul::{self, moving};
use crate::fusion::group::{add_other, has_tails, Nodes, NormPro, Seg, MAX_SEGS};
use crate::fusion::norm_mul::launch_norm_mul;
use crate::fusion::safety::Dead;
use crate::kernels::Kernel;
use crate::layout::broadcast_strides;

/// Threads of a fused matrix-vector block (the kernels' launch bounds assume 128).
const GEMV_THREADS: usize = 128;

/// Resident `fused_gemv1` blocks per multiprocessor (104 registers per thread on sm_90; its
/// streamed entry points `fused_gemv1_s16` and kin, 80) ...
const GEMV1_BLOCKS_PER_SM: usize = 2;

/// ... and `fused_gemv1_pair` blocks (at most 88 registers, `__maxnreg__`).
const GEMV1_PAIR_BLOCKS_PER_SM: usize = 2;

/// One product of `fused_gemv[8]` (`struct FgSeg` in gemv.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FgSeg {
    n: i64,
    w: u64,
    w_rs: i64,
    out: u64,
    o_rs: i64,
    o_cs: i64,
    add: u64,
    add_dt: i64,
    a_rs: i64,
    a_cs: i64,
    sum: u64,
    sum_dt: i64,
    s_rs: i64,
    s_cs: i64,
    wout: i64,
    wsum: i64,
    r: u64,
    r_dt: i64,
    hd: i64,
    n_dims: i64,
    l2theta: f64,
    pos: u64,
    c: u64,
    c_dt: i64,
    c_rs: i64,
    c_cs: i64,
    c_n: i64,
    idx: u64,
    tag: i64,
    /// The weight's block type (`qt`; its `w_rs` then counts bytes) for `fused_gemv1_q`, else 0.
    qt: i64,
}

impl FgSeg {
    /// A product of `n` outputs into `out` (written when `wout`) from weight rows at `w`,
    /// `w_rs` apart (bytes, block type `code`, for quantized weights; else elements, code 0).
    fn product(n: usize, w: u64, w_rs: usize, code: i32, out: &Dev, wout: bool) -> Self {
        FgSeg {
            n: n as i64,
            w,
            w_rs: w_rs as i64,
            qt: code as i64,
            out: out.ptr,
            o_rs: out.strides[0] as i64,
            o_cs: out.strides[1] as i64,
            wout: wout as i64,
            ..FgSeg::default()
        }
    }
}

/// The products of one launch (`struct FgSet` in gemv.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FgSet {
    nseg: i64,
    seg: [FgSeg; MAX_SEGS],
    pair: i64,
    sw: u64,
    sw_dt: i64,
    sw_rs: i64,
    sw_cs: i64,
    wnorm: i64,
    err: u64,
    /// Decode's head: the word taking the largest argmax key of the products, or 0.
    amax: u64,
    /// With `amax`: the i32 the launch writes the index to itself (the u32 8 bytes past the
    /// word is the blocks' ticket), or 0 (`argmax_take` follows).
    take: u64,
}

/// The final norm that decode's head on a quantized weight takes as its prologue
/// (`Kind::HeadArgmax` with a norm): its `RmsNorm` and `Mul` nodes, and whether their results
/// must be written (something reads them after the head).
pub(crate) struct HeadNorm<'a> {
    pub(crate) norm: &'a ExecNode,
    pub(crate) mul: &'a ExecNode,
    pub(crate) write: bool,
}

impl HeadNorm<'_> {
    /// The norm as its own launch (`norm_mul`), writing both results, for a head that does not
    /// take it as a prologue.
    pub(crate) fn launch_alone(&self, exec: &Exec<'_>) -> Result<()> {
        launch_norm_mul(exec, self.norm, self.mul)
    }
}

/// The norm prologue's arguments of `fused_gemv1` (its product with the weight row is the
/// kernel's activation `a`).
struct NormArgs {
    x: u64,
    eps: f32,
    nd: u64,
    dtn: i32,
    w: u64,
    dtw: i32,
}

/// The norm prologue's six kernel arguments after `args` (zeros without a prologue).
fn norm_tail(args: Args, pro: Option<&NormArgs>) -> Args {
    match pro {
        Some(p) => args
            .arg(p.x)
            .arg(p.eps)
            .arg(p.nd)
            .arg(p.dtn)
            .arg(p.w)
            .arg(p.dtw),
        None => args
            .arg(0u64)
            .arg(0f32)
            .arg(0u64)
            .arg(0i32)
            .arg(0u64)
            .arg(0i32),
    }
}

fn norm_args(exec: &Exec<'_>, norm: &ExecNode, mul: &ExecNode) -> Result<NormArgs> {
    let Op::RmsNorm { eps } = norm.op else {
        return Err(kernel_err(norm, "fused as a norm but is not one"));
    };
    let nd = exec.resolve(&norm.dst)?;
    let w = exec.resolve(&mul.srcs[1])?;
    Ok(NormArgs {
        x: exec.resolve(&norm.srcs[0])?.ptr,
        eps,
        nd: nd.ptr,
        dtn: dt(nd.dtype),
        w: w.ptr,
        dtw: dt(w.dtype),
    })
}

pub(super) fn launch_gemv(
    exec: &mut Exec<'_>,
    nodes: &Nodes<'_>,
    segs: &[Seg],
    swiglu: Option<usize>,
    norm: Option<NormPro>,
) -> Result<()> {
    let first = &nodes[segs[0].mm];
    let a = exec.resolve(&first.srcs[0])?;
    let (m, k) = (a.shape[0], a.shape[1]);
    let wdt = first.srcs[1].dtype;
    let esz = wdt.size_bytes();
    // Quantized weights (every segment's, each of its own block type): `fused_gemv1_q`.
    let quant = wdt.is_quantized();
    // Their kernel reads 16-bit fields: every weight 2-byte aligned (rows are whole blocks,
    // an even number of bytes).
    let mut q_aligned = true;
    let tails = has_tails(segs);
    let dead = Dead::of(nodes, segs, norm);
    let mut set = FgSet {
        nseg: segs.len() as i64,
        pair: if tails { 2 } else { swiglu.is_some() as i64 },
        wnorm: (!dead.norm) as i64,
        err: exec.inner.err_word.dev(),
        ..FgSet::default()
    };
    let mut vec = matmul::aligned(a.ptr, 4, &[moving(m, a.strides[0])], 16);
    let mut units = 0usize;
    for (si, (slot, seg)) in set.seg.iter_mut().zip(segs).enumerate() {
        let skip = dead.products[si];
        let mm = &nodes[seg.mm];
        let w = exec.resolve(&mm.srcs[1])?;
        let out = exec.resolve(&mm.dst)?;
        let n = w.shape[1];
        let (w_rs, code) = if quant {
            let (Some(rs), Some(code)) = (quant_row_bytes(w.dtype, w.strides[1]), qt(w.dtype))
            else {
                return Err(kernel_err(
                    mm,
                    "fused quantized weight without whole-block rows",
                ));
            };
            q_aligned &= w.ptr.is_multiple_of(2);
            (rs, code)
        } else {
            vec &= matmul::aligned(w.ptr, esz, &[moving(n, w.strides[1])], 16);
            (w.strides[1], 0)
        };
        *slot = FgSeg {
            wsum: (!dead.sums[si]) as i64,
            ..FgSeg::product(n, w.ptr, w_rs, code, &out, !skip)
        };
        if let Some(ri) = seg.rope {
            let rope = &nodes[ri];
            let Op::Rope {
                n_dims, theta_base, ..
            } = rope.op
            else {
                return Err(kernel_err(rope, "fused as a rope but is not one"));
            };
            let r = exec.resolve(&rope.dst)?;
            slot.r = r.ptr;
            slot.r_dt = dt(r.dtype) as i64;
            slot.hd = r.shape[2] as i64;
            slot.n_dims = n_dims as i64;
            slot.l2theta = (theta_base as f64).log2();
            slot.pos = exec.resolve(&rope.srcs[1])?.ptr;
        }
        if let Some(wi) = seg.rows {
            let rows = &nodes[wi];
            let c = exec.resolve(&rows.dst)?;
            slot.c = c.ptr;
            slot.c_dt = dt(c.dtype) as i64;
            slot.c_rs = c.strides[0] as i64;
            slot.c_cs = c.strides[1] as i64;
            slot.c_n = c.shape[0] as i64;
            slot.idx = exec.resolve(&rows.srcs[2])?.ptr;
            slot.tag = exec.tag(rows) as i64;
        }
        if let Some(ai) = seg.add {
            let add = &nodes[ai];
            let other = add_other(add, &mm.dst).ok_or_else(|| {
                kernel_err(add, "fused as an epilogue but does not add the product")
            })?;
            let other = exec.resolve(other)?;
            let sum = exec.resolve(&add.dst)?;
            let bs = broadcast_strides(&other.shape, &other.strides, &out.shape)
                .ok_or_else(|| kernel_err(add, "operand does not broadcast"))?;
            slot.add = other.ptr;
            slot.add_dt = dt(other.dtype) as i64;
            slot.a_rs = bs[0] as i64;
            slot.a_cs = bs[1] as i64;
            slot.sum = sum.ptr;
            slot.sum_dt = dt(sum.dtype) as i64;
            slot.s_rs = sum.strides[0] as i64;
            slot.s_cs = sum.strides[1] as i64;
        }
        units = if swiglu.is_some() { n } else { units + n };
    }
    if tails {
        units /= 2;
    }
    if let Some(s) = swiglu {
        let sw = exec.resolve(&nodes[s].dst)?;
        set.sw = sw.ptr;
        set.sw_dt = dt(sw.dtype) as i64;
        set.sw_rs = sw.strides[0] as i64;
        set.sw_cs = sw.strides[1] as i64;
    }
    // Decode: one output unit per warp (or streamed, below), a staged in shared memory when it
    // fits.
    let staged = k * 4 <= matmul::GEMV1_MAX_SHARED;
    let blocks1 = units.div_ceil(matmul::GEMV1_WARPS);
    // Every block computes the norm before its products start; past one wave of blocks that
    // serial prologue costs more than the launch it saves (measured on the H200: gate/up of
    // "1b", 1024 blocks, 26 µs with it against 18.5 + 3.4 without).
    let per_sm = if set.pair != 0 {
        GEMV1_PAIR_BLOCKS_PER_SM
    } else {
        GEMV1_BLOCKS_PER_SM
    };
    // Streamed (`fg1_stream`; not row pairs): a grid of at most `stream_blocks` per
    // multiprocessor whose warps stride over the units, so the prologue always runs once per
    // resident block.
    let stream = exec.inner.cfg.gemv_stream && !tails;
    let stream_grid = exec.inner.sms * exec.inner.cfg.stream_blocks.max(1);
    // With Rope epilogues the prologue is kept past one wave: it costs less than the launches
    // the epilogues save, and a separate norm would leave its row under q's rotation.
    let prologue_fits = stream || blocks1 <= exec.inner.sms * per_sm || tails;
    // The decode kernel computes offsets in 32 bits.
    let narrow = k < i32::MAX as usize && units < i32::MAX as usize;
    let vec = vec && narrow;
    if quant {
        let ok = m == 1 && vec && staged && q_aligned;
        let pro = match norm {
            Some(n) if ok && prologue_fits => Some(norm_args(exec, &nodes[n.norm], &nodes[n.mul])?),
            _ => None,
        };
        return launch_gemv_q(exec, nodes, segs, swiglu, norm, pro, set, ok, units);
    }
    if tails && !(m == 1 && vec && staged) {
        // The row-pair kernel does not apply after all (alignment, a long row): the norm, the
        // products with their Adds, then the Ropes and SetRows — node order, at the group's
        // position — writing every result.
        if let Some(n) = norm {
            launch_norm_mul(exec, &nodes[n.norm], &nodes[n.mul])?;
        }
        let plain: Vec<Seg> = segs.iter().map(|s| Seg::new(s.mm, s.add)).collect();
        launch_gemv(exec, nodes, &plain, swiglu, None)?;
        let mut rest: Vec<usize> = segs
            .iter()
            .flat_map(|s| [s.rope, s.rows].into_iter().flatten())
            .collect();
        rest.sort_unstable();
        for i in rest {
            exec.run(&nodes[i])?;
        }
        return Ok(());
    }
    let pro = match norm {
        Some(n) if m == 1 && vec && staged && prologue_fits => {
            Some(norm_args(exec, &nodes[n.norm], &nodes[n.mul])?)
        }
        Some(n) => {
            // Not the decode kernel's prologue after all (alignment, or more than one wave):
            // the norm runs first, on its own.
            launch_norm_mul(exec, &nodes[n.norm], &nodes[n.mul])?;
            None
        }
        None => None,
    };
    if m == 1 && vec {
        let ahead = segs.iter().all(|s| exec.read_ahead(&nodes[s.mm].srcs[1]));
        let blocks = if stream {
            blocks1.min(stream_grid)
        } else {
            blocks1
        };
        let blocks = blocks.clamp(1, i32::MAX as usize) as u32;
        let args = Args::new()
            .arg(k as i64)
            .arg(a.ptr)
            .arg(set)
            .arg(dt(wdt))
            .arg(staged as i32)
            .arg(ahead as i32)
            .arg(stream as i32);
        let args = norm_tail(args, pro.as_ref());
        // A streamed, staged product without pairs takes its dtype's own entry point (80
        // registers, so that the next kernel's first blocks fit beside its two per
        // multiprocessor), its blocks padded to hold them to that many (`stream_pad`).
        // Staged, a pair mode's decode path takes its own entry point (`gemv_split`): q/k/v's
        // row pairs, or gate/up streamed.
        let split = exec.inner.cfg.gemv_split && staged;
        let (own, shared_kernel) = match (set.pair != 0, stream && staged) {
            (true, _) if split && tails => (Some(Kernel::ROW_PAIRS), Kernel::FusedGemv1Pair),
            (true, true) if split => (Some(Kernel::GATE_UP), Kernel::FusedGemv1Pair),
            (true, _) => (None, Kernel::FusedGemv1Pair),
            (false, true) => (Some(Kernel::STREAMED), Kernel::FusedGemv1),
            (false, false) => (None, Kernel::FusedGemv1),
        };
        let kernel = own
            .and_then(|list| Kernel::for_weights(list, wdt))
            .unwrap_or(shared_kernel);
        let shared = match (staged, Kernel::STREAMED.contains(&kernel)) {
            (false, _) => 0,
            (true, false) => k * 4,
            (true, true) => (k * 4).max(exec.inner.stream_shared),
        };
        return exec.launch_shared(
            first,
            kernel,
            blocks,
            (matmul::GEMV1_WARPS * 32) as u32,
            shared as u32,
            args,
        );
    }
    let g = matmul::mmv_group(k, 16 / esz);
    let blocks = units.div_ceil(GEMV_THREADS / g).clamp(1, i32::MAX as usize) as u32;
    let kernel = if m <= 2 {
        Kernel::FusedGemv
    } else {
        Kernel::FusedGemv8
    };
    let args = Args::new()
        .arg(m as i64)
        .arg(k as i64)
        .arg(a.ptr)
        .arg(a.strides[0] as i64)
        .arg(set)
        .arg(dt(wdt))
        .arg(g as i32)
        .arg(vec as i32);
    exec.launch(first, kernel, blocks, GEMV_THREADS as u32, args)
}

/// Decode's products on quantized weights (`fused_gemv1_q`), `set` built by `launch_gemv`, of
/// `units` output units (`launch_fq`), the norm prologue in the
/// kernel (`pro`) or launched first. When the kernel does not apply (`ok` false: more than one
/// row, a misaligned row or weight, a row too long to stage) the group runs as its nodes, in
/// node order, writing every result.
#[allow(clippy::too_many_arguments)]
fn launch_gemv_q(
    exec: &mut Exec<'_>,
    nodes: &Nodes<'_>,
    segs: &[Seg],
    swiglu: Option<usize>,
    norm: Option<NormPro>,
    pro: Option<NormArgs>,
    set: FgSet,
    ok: bool,
    units: usize,
) -> Result<()> {
    if !ok {
        let mut all: Vec<usize> = segs
            .iter()
            .flat_map(|s| [Some(s.mm), s.add, s.rope, s.rows].into_iter().flatten())
            .chain(swiglu)
            .chain(norm.into_iter().flat_map(|n| [n.norm, n.mul]))
            .collect();
        all.sort_unstable();
        for i in all {
            exec.run(&nodes[i])?;
        }
        return Ok(());
    }
    if let (Some(n), None) = (norm, &pro) {
        // Not the kernel's prologue (more than one wave of blocks): the norm on its own first.
        launch_norm_mul(exec, &nodes[n.norm], &nodes[n.mul])?;
    }
    let first = &nodes[segs[0].mm];
    let a = exec.resolve(&first.srcs[0])?;
    let k = a.shape[1];
    launch_fq(exec, first, k, a.ptr, set, pro.as_ref(), units)
}

/// One launch of `fused_gemv1_q` for `node` on the activation row at `a` (K = `k` floats), of
/// `units` output units: a grid of one unit per warp, or when streamed the warps of
/// `q_blocks` blocks of `GEMV1_WARPS` per multiprocessor at most (the kernel's warps stride
/// over the units either way), in blocks of `q_warps` warps (`q_warps_norm` with a norm
/// prologue; `fq_dims`).
#[allow(clippy::too_many_arguments)]
fn launch_fq(
    exec: &Exec<'_>,
    node: &ExecNode,
    k: usize,
    a: u64,
    set: FgSet,
    pro: Option<&NormArgs>,
    units: usize,
) -> Result<()> {
    let (blocks, threads) = fq_dims(&exec.inner.cfg, pro.is_some(), units, exec.inner.sms);
    let args = Args::new().arg(k as i64).arg(a).arg(set);
    // The integer paths quantize the staged row in place (q16: 2.5 bytes a value in its 4,
    // q8: 1.5): the same shared memory every way.
    let qm = exec.inner.cfg.qdot.kernel_mode();
    let kernel = typed_kernel(&set, qm, exec.inner.cfg.q_typed).unwrap_or(Kernel::FusedGemv1Q);
    let args = norm_tail(args, pro).arg(qm).arg(q_prefetch_flags(exec));
    exec.launch_shared(node, kernel, blocks, threads, (k * 4) as u32, args)
}

/// The grid and the threads per block of a `fused_gemv1_q` launch under `cfg`, with or without
/// a norm prologue (`norm`), of `units` output units, on `sms` multiprocessors.
fn fq_dims(cfg: &CudaConfig, norm: bool, units: usize, sms: usize) -> (u32, u32) {
    // The norm prologue's sums take the first `GEMV1_WARPS` warps of a block.
    let (warps, least) = if norm {
        (cfg.q_warps_norm, matmul::GEMV1_WARPS)
    } else {
        (cfg.q_warps, 1)
    };
    fq_shape(units, warps, least, sms).grid(cfg.gemv_stream, cfg.q_blocks)
}

/// The units of a `fused_gemv1_q` launch, the multiprocessors and the warps of its blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
struct FqShape {
    units: usize,
    sms: usize,
    warps: usize,
}

/// The shape of a `fused_gemv1_q` launch of `units` output units, in blocks of `warps` warps
/// (`least` to `MAX_Q_WARPS`), or with `warps` 0 the units over the multiprocessors (`sms`),
/// 8 to `MAX_Q_WARPS` warps: a multiprocessor then quantizes the row once for as many of its
/// units as it can.
fn fq_shape(units: usize, warps: usize, least: usize, sms: usize) -> FqShape {
    let max = MAX_Q_WARPS as usize;
    let warps = match warps {
        0 => units.div_ceil(sms.max(1)).clamp(matmul::GEMV1_WARPS, max),
        w => w.clamp(least.min(max), max),
    };
    FqShape { units, sms, warps }
}

impl FqShape {
    /// The grid and the threads per block: one unit per warp, or `stream`ed, as many warps per
    /// multiprocessor as `q_blocks` blocks of `GEMV1_WARPS` hold (at least one block).
    fn grid(self, stream: bool, q_blocks: usize) -> (u32, u32) {
        let own = self.units.div_ceil(self.warps);
        let blocks = if stream {
            let per_sm = (q_blocks.max(1) * matmul::GEMV1_WARPS / self.warps).max(1);
            own.min(self.sms.saturating_mul(per_sm))
        } else {
            own
        };
        (
            blocks.clamp(1, i32::MAX as usize) as u32,
            (self.warps * 32) as u32,
        )
    }
}

/// `fused_gemv1_q`'s typed entry point for `set` (`CudaConfig::q_typed`): where the segments'
/// block types have one (`Kernel::typed_q`) and the arithmetic is an integer one (`qm` 1, q16,
/// or 2, q8; f32 has no typed body). The typed kernels read a Q4_K piece as two 16-byte loads
/// without testing its alignment, so a set with a Q4_K weight whose rows do not all start on
/// 16 bytes (its address or its row stride) keeps the generic kernel, which tests each block.
fn typed_kernel(set: &FgSet, qm: i32, which: TypedQ) -> Option<Kernel> {
    let segs = set.seg.get(..usize::try_from(set.nseg).ok()?)?;
    if qm != 1 && qm != 2 {
        return None;
    }
    let q4_k = qt(DType::Q4_K).map(i64::from);
    let misaligned =
        |g: &FgSeg| Some(g.qt) == q4_k && (!g.w.is_multiple_of(16) || g.w_rs % 16 != 0);
    if segs.iter().any(misaligned) {
        return None;
    }
    let mut types = [0i64; MAX_SEGS];
    for (t, g) in types.iter_mut().zip(segs) {
        *t = g.qt;
    }
    Kernel::typed_q(&types[..segs.len()], which, qm == 2)
}

/// `fused_gemv1_q`'s `pf` argument: bit 0 `CudaConfig::q_prefetch`, bit 1 `q_ahead` off, bit 2
/// `q_interleave` off, bit 3 `q_direct`, bit 4 `q_direct_norm`.
fn q_prefetch_flags(exec: &Exec<'_>) -> i32 {
    let cfg = &exec.inner.cfg;
    cfg.q_prefetch as i32
        | ((!cfg.q_ahead) as i32) << 1
        | ((!cfg.q_interleave) as i32) << 2
        | (cfg.q_direct as i32) << 3
        | (cfg.q_direct_norm as i32) << 4
}

/// Decode's head on a quantized weight with its argmax folded in, as `fused_gemv1_q` (one
/// segment, `FgSet::amax` the argmax word `key`): the streamed products' grid, staging and
/// next-row prefetch instead of `mul_mat_vec_q_argmax`'s segments through shared memory (on
/// the H200 that kernel read "1b"'s 37 MB Q4_0 head at 0.7 TB/s). Returns false, having
/// launched nothing, where the kernel does not apply (a's row not 16-byte aligned or too long
/// to stage, an odd weight address, rows that are not whole blocks, a non-f32 result): the
/// caller takes `mul_mat_vec_q_argmax`. The logits are written as that kernel writes them.
/// `a`, `w` and `out` are `mm`'s operands and result, resolved by the caller. With `norm`, a
/// is that norm's product, computed in the kernel's prologue (block 0 writes it, and the norm,
/// where `norm.write`), and the launch takes the index into `take` itself (`FgSet::take`).
pub(crate) fn launch_head_q(
    exec: &Exec<'_>,
    mm: &ExecNode,
    [a, w, out]: [&Dev; 3],
    key: u64,
    norm: Option<(&HeadNorm<'_>, u64)>,
) -> Result<bool> {
    let (k, n) = (a.shape[1], w.shape[1]);
    let (Some(w_rs), Some(code)) = (quant_row_bytes(w.dtype, w.strides[1]), qt(w.dtype)) else {
        return Ok(false);
    };
    let fits = a.dtype == DType::F32
        && out.dtype == DType::F32
        && a.shape[0] == 1
        && matmul::aligned(a.ptr, 4, &[moving(1, a.strides[0])], 16)
        && w.ptr.is_multiple_of(2)
        && k > 0
        && k * 4 <= matmul::GEMV1_MAX_SHARED
        && n > 0
        && n < i32::MAX as usize;
    if !fits {
        return Ok(false);
    }
    let pro = match norm {
        Some((n, _)) => Some(norm_args(exec, n.norm, n.mul)?),
        None => None,
    };
    let mut set = FgSet {
        nseg: 1,
        err: exec.inner.err_word.dev(),
        amax: key,
        take: norm.map_or(0, |(_, take)| take),
        wnorm: norm.is_some_and(|(n, _)| n.write) as i64,
        ..FgSet::default()
    };
    set.seg[0] = FgSeg::product(n, w.ptr, w_rs, code, out, true);
    // `q_head_pairs`: units of two adjacent rows (the row-pair mode without a Rope or a cache
    // row, which stores both products), where the rows pair up.
    let units = if exec.inner.cfg.q_head_pairs && n.is_multiple_of(2) {
        set.pair = 2;
        n / 2
    } else {
        n
    };
    launch_fq(exec, mm, k, a.ptr, set, pro.as_ref(), units)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(segs: &[(i64, u64, i64)]) -> FgSet {
        let mut s = FgSet {
            nseg: segs.len() as i64,
            ..FgSet::default()
        };
        for (g, &(qt, w, w_rs)) in s.seg.iter_mut().zip(segs) {
            *g = FgSeg {
                qt,
                w,
                w_rs,
                ..FgSeg::default()
            };
        }
        s
    }

    #[test]
    fn larger_blocks_keep_the_warps_a_multiprocessor_holds() {
        let grid = |units, warps, stream| fq_shape(units, warps, 1, 132).grid(stream, 3);
        // "1b"'s down: 2,048 units, 132 multiprocessors.
        assert_eq!(grid(2048, 8, true), (256, 256));
        assert_eq!(
            grid(2048, 16, true),
            (128, 512),
            "one block a multiprocessor"
        );
        assert_eq!(
            grid(2048, 24, true),
            (86, 768),
            "one wave: 2,048 / 24 units"
        );
        assert_eq!(
            grid(32768, 24, true),
            (132, 768),
            "one block a multiprocessor"
        );
        assert_eq!(grid(32768, 12, true), (264, 384));
        assert_eq!(grid(32768, 16, true), (132, 512), "32 warps do not fit");
        assert_eq!(grid(32768, 8, true), (396, 256));
        assert_eq!(grid(32768, 8, false), (4096, 256), "one unit a warp");
        assert_eq!(grid(32768, 24, false), (1366, 768));
        assert_eq!(grid(0, 24, true), (1, 768), "at least one block");
        assert_eq!(grid(80, 99, true), (4, 768), "warps capped");
    }

    #[test]
    fn every_warps_setting_launches_whole_warps_within_the_kernels_bounds() {
        // `fused_gemv1_q`'s bounds: FQ1_MAX_WARPS (24) warps, and with a norm prologue at
        // least the 8 whose threads take the norm's sums.
        for stream in [true, false] {
            for w in 0..=MAX_Q_WARPS as usize {
                for wn in [0, 8, 12, 16, 24] {
                    let cfg = CudaConfig {
                        q_warps: w,
                        q_warps_norm: wn,
                        gemv_stream: stream,
                        ..CudaConfig::default()
                    };
                    for units in [0, 1, 7, 2048, 32000] {
                        for norm in [false, true] {
                            let (blocks, threads) = fq_dims(&cfg, norm, units, 132);
                            let at_least = if norm { 256 } else { 32 };
                            assert!(blocks >= 1, "{w} {wn} {units} {norm}");
                            assert!(threads % 32 == 0 && (at_least..=768).contains(&threads));
                            if w != 0 && !norm {
                                assert_eq!(threads as usize, 32 * w);
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(
            fq_dims(&CudaConfig::default(), false, 2048, 132),
            (128, 512)
        );
        assert_eq!(fq_dims(&CudaConfig::default(), true, 8192, 132), (396, 256));
    }

    #[test]
    fn warps_from_the_units_fill_each_multiprocessor_once() {
        let warps = |units, least| fq_shape(units, 0, least, 132).warps;
        assert_eq!(warps(2048, 1), 16, "o and down of \"1b\"");
        assert_eq!(warps(1536, 8), 12, "1,536 row pairs: q/k/v of \"1b\"");
        assert_eq!(warps(8192, 8), 24, "gate/up, capped");
        assert_eq!(warps(32, 1), 8, "few units: blocks of 8");
        assert_eq!(
            fq_shape(2048, 4, 8, 132).warps,
            8,
            "a norm prologue takes 8 at least"
        );
        assert_eq!(fq_shape(2048, 4, 1, 132).warps, 4);
    }

    #[test]
    fn q4_k_rows_off_16_bytes_keep_the_generic_kernel() {
        let (q4_0, q4_k, q6_k) = (4, 11, 13);
        let aligned = set(&[(q4_k, 0x1000, 1152), (q4_k, 0x9000, 1152)]);
        assert_eq!(
            typed_kernel(&aligned, 1, TypedQ::All),
            Some(Kernel::FusedGemv1Q4K)
        );
        assert_eq!(
            typed_kernel(&aligned, 2, TypedQ::All),
            Some(Kernel::FusedGemv1Q4KQ8),
            "q8 arithmetic"
        );
        assert_eq!(
            typed_kernel(&aligned, 0, TypedQ::All),
            None,
            "f32 arithmetic"
        );
        let cases = [
            (set(&[(q4_k, 0x1008, 1152), (q4_k, 0x9000, 1152)]), None),
            (set(&[(q4_k, 0x1000, 1152), (q4_k, 0x9000, 1160)]), None),
            (set(&[(q6_k, 0x1002, 1680), (q4_k, 0x9004, 1152)]), None),
            // Q6_K beside aligned Q4_K: only Q4_K's rows must start on 16 bytes.
            (
                set(&[(q4_k, 0x1000, 1152), (q6_k, 0x9002, 1680)]),
                Some(Kernel::FusedGemv1Q4KQ6K),
            ),
        ];
        for (s, want) in cases {
            assert_eq!(typed_kernel(&s, 1, TypedQ::All), want, "{:?}", &s.seg[..2]);
        }
        // Other types' rows need no alignment (their loads are 4-byte words).
        let q6 = set(&[(q6_k, 0x1002, 1682)]);
        assert_eq!(
            typed_kernel(&q6, 1, TypedQ::All),
            Some(Kernel::FusedGemv1Q6K)
        );
        let q40 = set(&[(q4_0, 0x1002, 1154)]);
        assert_eq!(
            typed_kernel(&q40, 1, TypedQ::NoQ4K),
            Some(Kernel::FusedGemv1Q40)
        );
    }
}
