//! Settings of one CUDA backend: the user-facing switches and the decode path's tuning knobs.
//!
//! Why: a user sets a handful of variables (`LOWSYNC_CUDA_SYNC_ELISION`, `LOWSYNC_CUDA_GRAPHS`,
//! `LOWSYNC_CUDA_FUSION`, `LOWSYNC_CUDA_TIMING`); the decode path also has A/B switches that
//! exist to measure one kernel choice against another. Those live behind one variable,
//! `LOWSYNC_CUDA_TUNE=key=value,...` (docs/tuning.md), so the list of knobs is in one place and
//! the user-facing variables stay few.
//!
//! Strategy: [`CudaConfig::from_env`] reads the user-facing variables through
//! `lowsync_backend::env`, then applies `LOWSYNC_CUDA_TUNE` with [`CudaConfig::with_tune`], a
//! pure function of the string (tested without a device or the environment). [`stream_pad`]
//! resolves the streamed products' shared-memory pad against the device's limits at open.
//!
//! Invariants: unset or empty means the defaults of [`CudaConfig::default`]; a bad value is an
//! `Error::Env` naming the variable (for `LOWSYNC_CUDA_TUNE`, with the key's accepted values or
//! the list of keys), never a silent default.

use lowsync_backend::{env, Error, Result};

/// Settings of one CUDA backend. [`CudaConfig::from_env`] reads ARCHITECTURE §8's variables and
/// `LOWSYNC_CUDA_TUNE`; tests build one explicitly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Elide a `synchronize` with nothing outstanding (`LOWSYNC_CUDA_SYNC_ELISION`, default
    /// on). Only takes effect when the process sees exactly one CUDA device.
    pub sync_elision: bool,
    /// Size of one pinned staging chunk (the largest piece one staged copy moves).
    pub staging_chunk_bytes: usize,
    /// Bound on the pinned staging arena (invariant 8).
    pub staging_max_bytes: usize,
    /// Bound on the pinned readback buffer of blocking reads; larger reads go to caller memory.
    pub readback_max_bytes: usize,
    /// Rows of a up to which `MulMat` runs the matrix-vector kernels instead of cuBLAS
    /// (tune key `mmv_max_m`; `None`: 8, or 32 when cuBLAS would first convert an f16/bf16 b
    /// to f32, 8 for a quantized b; `Some(0)`: always cuBLAS). A tuning and comparison knob.
    pub mmv_max_m: Option<usize>,
    /// Capture each compute graph into a CUDA graph once per shape bucket and replay it
    /// (`LOWSYNC_CUDA_GRAPHS`, default on).
    pub graphs: bool,
    /// Run fused kernels for the node patterns of `fusion` (`LOWSYNC_CUDA_FUSION`,
    /// default on); off runs one kernel per node, the reference the fused kernels are checked
    /// against.
    pub fusion: bool,
    /// Time each compute graph on the device with a pair of timing events and add the elapsed
    /// time to the `device_ns` counter when a wait observes it (`LOWSYNC_CUDA_TIMING`, default
    /// off: timing events are not free).
    pub timing: bool,
    /// How single-row matrix-vector products read their activation row (a tuning knob for
    /// benches; `Off` sends them to the general matrix-vector kernels).
    pub decode_gemv: DecodeGemv,
    /// Launch kernels with programmatic dependent launch (tune key `pdl`, default on; takes
    /// effect on compute capability 9.0 and newer): a kernel's blocks may start while the one
    /// before it finishes, and wait on the device (`griddepcontrol.wait`) before they touch
    /// its results; decode's matrix-vector kernels load their first weights before that wait.
    pub pdl: bool,
    /// Decode attention takes its short-path kernel `attn_fast` where it applies (tune key
    /// `attn_fast`, default on); off runs the general `attn_decode` — a knob for comparing the
    /// two inside the replayed graph.
    pub attn_fast: bool,
    /// Prefill attention (several query rows per head) runs as one fused kernel,
    /// `attn_prefill`, where its pattern, layouts and the deadness of the scores and p allow
    /// (tune key `attn_prefill`, default on); off runs the unfused chain (cuBLAS products,
    /// softmax, copy) — a knob for A/B runs.
    pub attn_prefill: bool,
    /// Decode attention over a window longer than one round trip of keys runs split over its
    /// keys, `attn_split` (tune key `attn_split`): several blocks per query head, each an online
    /// softmax over a share of the head's valid keys, merged by the head's last block. 1, the
    /// default, takes as many chunks per head as the multiprocessors hold blocks of every head
    /// at once (multiprocessors / heads, at most `ATTN_SPLIT_MAX`); N >= 2 takes at most N; 0
    /// leaves it off (one block per head, `attn_fast_long`). On an H200 after a 512-token
    /// prompt (Q4_0, one process, interleaved) 1 took "tiny"'s token span from 64.7 to 61.0 µs
    /// and left "1b"'s where it was (781.9 against 779.0 µs). The device takes fewer chunks when
    /// fewer keys are valid (one while they fit a round trip), so a short valid part of a long
    /// window keeps a single block per head.
    pub attn_split: usize,
    /// Decode attention (`attn_fast`), launched ahead of its producer (programmatic dependent
    /// launch), rehearses before its wait (tune key `rehearse`, default on): it runs its own
    /// path once on the inputs as they are, with no global stores, so that its instructions
    /// are cached when the wait returns. Off is a knob for measuring what that buys.
    pub rehearse: bool,
    /// The decode attention's rehearsal, where its real pass reuses the rehearsal's listing
    /// of the valid keys, stops after that listing (tune key `rehearse_list`, default on): no
    /// K/V loads or products before the wait, so a rehearsal that starts late (its blocks
    /// find room only as the producer's blocks leave) does not hold back the real pass. On
    /// the H200 ("1b" Q4_0 after a 512-token prompt) the token's span fell from 792.6 to
    /// 764.6 µs; "tiny"'s stayed at 60.5 µs.
    pub rehearse_list: bool,
    /// Decode's gate/up (streamed) and q/k/v (row pairs) take their own entry points per
    /// weight dtype, `fused_gemv1_gu16` and `fused_gemv1_rp16` and kin (tune key `gemv_split`,
    /// default on): each holds one path, which fits in 88 registers without a spill, where
    /// `fused_gemv1_pair` holds both. Off is a knob for measuring what that buys.
    pub gemv_split: bool,
    /// Decode's matrix-vector products without row-pair epilogues run streamed (tune key
    /// `gemv_stream`, default on): a grid of at most `stream_blocks` blocks per multiprocessor
    /// whose warps stride over the output units, keeping their weight loads in flight from one
    /// unit to the next, with the norm prologue folded in; off launches one warp per unit.
    pub gemv_stream: bool,
    /// Resident blocks per multiprocessor of a streamed product's grid (tune key
    /// `gemv_blocks`, default 2).
    pub stream_blocks: usize,
    /// Resident blocks per multiprocessor of decode's products on quantized weights
    /// (`fused_gemv1_q`, tune key `gemv_q_blocks`, default 3). Its blocks take 80 registers a
    /// thread, so three fit on a multiprocessor; those products are bound by instruction issue
    /// at a few warps per scheduler, and a third block adds warps. On the H200 ("1b" after a
    /// 512-token prompt) three against two: Q4_0 1,120-1,136 tokens/s against 1,080-1,085,
    /// Q4_K 1,001 against 915-927, Q6_K 885 against 786-816, Q8_0 964 against 933-938; four
    /// were slower than three (docs/notes/gpu-vs-llama-cpp.md).
    pub q_blocks: usize,
    /// Each warp of `fused_gemv1_q` asks its next unit's weight rows into L2 before its
    /// current unit's products (tune key `gemv_q_prefetch`, default off): a warp otherwise has
    /// one unit's bytes in flight. On the H200 ("1b" Q4_0 after a 512-token prompt) it made
    /// the token's span 2.5% longer (792.6 against 773.1 µs) and left "tiny"'s as it was.
    pub q_prefetch: bool,
    /// Each warp of `fused_gemv1_q` asks its first unit's weight rows into L2 before its
    /// dependency wait, while the previous kernel runs (tune key `gemv_q_ahead`, default on).
    pub q_ahead: bool,
    /// Which of decode's products on quantized weights run a typed entry point of
    /// `fused_gemv1_q` (tune key `gemv_q_typed`, default `2`; q16 and q8 arithmetic): the same
    /// sums bit for bit, without a call and a switch over types and arithmetics per weight
    /// row, in a third of the generic kernel's code (docs/cuda-decode.md). `TypedQ` says for
    /// which block types.
    pub q_typed: TypedQ,
    /// In the typed entry points, each round of a unit's weight loads takes two pieces a lane
    /// of both rows of a pair (gate and up, a row pair of q/k/v) or four of a single row of at
    /// least 4,096 values, all issued before any of their products (tune key
    /// `gemv_q_interleave`, default on): fewer dependent trips to memory per unit. Off takes
    /// each row alone, two pieces a round, as the generic kernel does. The same bits either
    /// way. On the H200: Q4_0 2.5% faster on, Q8_0 and Q6_K about 1% slower (two rounds).
    pub q_interleave: bool,
    /// Decode's products on quantized weights without a norm prologue (o, down) quantize the
    /// activation row straight from global memory: each thread loads its half-blocks' values
    /// into registers and writes their q16 or q8 records, instead of staging the row's floats
    /// in shared memory first and reading them back (tune key `gemv_q_direct`, default on).
    /// The same records bit for bit. Every block quantizes the whole row before its first
    /// product; ncu put about half of a down launch's stall samples there. With `q_warps` 16,
    /// on an H100 ("1b", llama-quantize's files) 3.7-5.8% more tokens/s than neither.
    pub q_direct: bool,
    /// The same for the products with a norm prologue (q/k/v, gate/up; tune key
    /// `gemv_q_direct_norm`, on by default): the norm's sum of squares as before,
    /// then each thread loads its half-blocks of the row and the norm weight again from global
    /// memory, forms their products in registers and writes their records, instead of staging
    /// the products in shared memory and reading them back (f32 row and weight, 16-byte
    /// aligned, at most 2,048 values; others stage). The same records bit for bit. On an H100
    /// ("1b" and "tiny", Q4_0, Q6_K, Q8_0) 0.2-1.4% more tokens/s in each of six timings.
    pub q_direct_norm: bool,
    /// Warps per block of decode's products on quantized weights without a norm prologue (o,
    /// down, the head; tune key `gemv_q_warps`, 1 to 24, or 0: from the launch's units,
    /// default 16). Each block quantizes the whole activation row before its first product,
    /// so with `gemv_q_blocks` blocks of 8 warps a multiprocessor does that `gemv_q_blocks`
    /// times; larger blocks do it once for more warps. The streamed grid keeps the warps a
    /// multiprocessor holds: `gemv_q_blocks * 8 / warps` blocks each (at least one). 0 takes
    /// the units over the multiprocessors, 8 to 24 (`fq_shape` in src/fusion/gemv.rs). The same sums bit for bit
    /// (their order depends only on K). 16 puts "1b"'s o and down (2,048 units) in 128
    /// blocks, one a multiprocessor on an H100 or H200, where blocks of 8 put two on most;
    /// 12 (two on some, one on others) gained a third of what 16 did, and 24 lost 3% on
    /// "tiny" (docs/notes/gpu-vs-llama-cpp.md).
    pub q_warps: usize,
    /// The same for the products with a norm prologue (q/k/v, gate/up; tune key
    /// `gemv_q_warps_norm`, 8 to 24, or 0, default 8). The norm's sum runs over the first 8
    /// warps' threads in every block, so its bits do not depend on this either.
    pub q_warps_norm: usize,
    /// Decode's head on a quantized weight, with its argmax, runs as the other quantized
    /// products do (`fused_gemv1_q` with the argmax folded in; tune key `gemv_q_head`, default
    /// on); off takes `mul_mat_vec_q_argmax`.
    pub q_head: bool,
    /// That head's rows two to a unit where the vocabulary is even (tune key
    /// `gemv_q_head_pairs`, default on): each warp loads both rows of a round before their
    /// products, so its units' trips to memory are half as many. The same sums and the same
    /// argmax. On an H100 after 512 tokens: "1b" Q4_0 +0.3%, "tiny" Q4_0 +1.2%.
    pub q_head_pairs: bool,
    /// That head also takes the final norm as its prologue and the index itself, its grid's
    /// last block reading the argmax word (tune key `gemv_q_head_fold`, default on): two kernel
    /// boundaries of a decode step fewer (the final `norm_mul` and `argmax_take` launches).
    /// Off: the norm and the take run as launches of their own, as on the other heads.
    pub q_head_fold: bool,
    /// Shared memory (KiB) each block of a streamed product asks for at least (tune key
    /// `gemv_pad_kb`; 0 turns it off). `None`, the default, takes the least that keeps
    /// `stream_blocks + 1` of them off one multiprocessor (80 KiB on the H200): the streamed
    /// entry points take 80 registers, so without it a third block would land where the next
    /// kernel's first blocks should start (see `fused_gemv1_s16` in fusion/gemv.cu).
    pub stream_pad_kb: Option<usize>,
    /// Host-to-device writes of at most this many bytes (`set_tensor_async_staged`; a batch
    /// holds up to 3,840 host bytes) and device-to-device copies (`copy_async`) wait in a
    /// batch that runs as one kernel right before the next thing queued on the stream, the
    /// host bytes inside its parameters (`TicketStream::defer_htod`); reads of at most this
    /// many bytes (`read_async`) ride in the batch too, or run as a one-block kernel writing
    /// the pinned slot when it cannot take them (`read_kernel`). No copy engine between two
    /// decode graphs: on the H200 the time between them fell from 16.9 to 6.7 µs with the read
    /// as its own kernel (tune key `copy_kernel`, bytes, default 4096; 0: copy engines).
    /// Outside graph capture only; each copy is counted as the copy it is, and a batch's launch
    /// as one submission.
    pub copy_kernel_max: usize,
    /// `read_async` of at most `copy_kernel_max` bytes rides in the copy batch, or runs as a
    /// one-block kernel (tune key `read_kernel`, default on); off takes a copy engine.
    pub read_kernel: bool,
    /// How decode's products on quantized weights multiply (tune key `qdot`, default `q16`):
    /// the activation row quantized to the CPU backend's 16-bit blocks and integer dot
    /// products (`__dp2a_lo`/`__dp2a_hi`) with the weights' small integers, `q8`: the row in
    /// the CPU backend's 8-bit blocks and `__dp4a`, or `f32`: each weight dequantized to f32
    /// and multiplied by the f32 row. A knob for A/B runs.
    pub qdot: QDot,
    /// Compile-time variants of the kernels' source to build (tune key `kdef`, `+`-separated
    /// names, none by default): each name N becomes NVRTC's `-DLS_KDEF_N` for every module,
    /// so two sessions of one process can run two versions of a kernel side by side
    /// (`variants_tg.py`) without a second wheel. A knob for A/B runs of kernel changes; the
    /// cubins of a variant are cached under their own names.
    pub kdefs: Vec<String>,
}

/// Which products run a typed entry point of `fused_gemv1_q` (`CudaConfig::q_typed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypedQ {
    /// None: the generic kernel for every block type (`gemv_q_typed=0`).
    Off,
    /// Segments that all hold Q4_0, all Q8_0 or all Q6_K (`gemv_q_typed=1`): the types whose
    /// typed kernel measured faster on the H200 from the start ("1b" after a 512-token prompt:
    /// Q4_0 6-7%, Q8_0 2%, Q6_K 1.5%; "tiny" Q4_0 10%).
    NoQ4K,
    /// Also all Q4_K, and Q4_K beside Q6_K (Q4_K_M's q/k/v) (`gemv_q_typed=2`, the default):
    /// since those kernels read a piece's bytes without the alignment test and take Q4_K's
    /// pieces in pairs, llama-quantize's "1b" Q4_K_M decodes 12% faster with them than with
    /// the generic kernel (H100; they were 4% slower before).
    All,
}

/// The arithmetic of decode's products on quantized weights (`CudaConfig::qdot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QDot {
    /// 16-bit activation blocks against the weights' integers (dp2a), f32 per 16 values.
    Q16,
    /// 8-bit activation blocks against the weights' integers (dp4a), f32 per 32 values (per
    /// 16 for Q2_K, Q3_K and Q6_K, whose scales do).
    Q8,
    /// Weights dequantized to f32, f32 FMAs.
    F32,
}

impl QDot {
    /// The kernels' `qm` argument (`mul_mat_vec_q`, `fused_gemv1_q`): 0 f32, 1 q16, 2 q8.
    pub(crate) fn kernel_mode(self) -> i32 {
        match self {
            QDot::F32 => 0,
            QDot::Q16 => 1,
            QDot::Q8 => 2,
        }
    }

    /// Bytes of one activation record of 32 values in shared memory (`Q16_REC`, `Q8_REC` in
    /// quant.cuh), or `None` on the f32 path.
    pub(crate) fn record_bytes(self) -> Option<usize> {
        match self {
            QDot::F32 => None,
            QDot::Q16 => Some(80),
            QDot::Q8 => Some(48),
        }
    }
}

/// The decode matrix-vector kernel's source of the activation row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeGemv {
    /// Not used: the general `mul_mat_vec_k` kernels run single rows too.
    Off,
    /// Staged once per block in shared memory.
    SharedX,
    /// Read from global memory through the read-only cache.
    GlobalX,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            sync_elision: true,
            staging_chunk_bytes: 4 << 20,
            staging_max_bytes: 64 << 20,
            readback_max_bytes: 64 << 20,
            mmv_max_m: None,
            kdefs: Vec::new(),
            graphs: true,
            fusion: true,
            timing: false,
            decode_gemv: DecodeGemv::SharedX,
            pdl: true,
            attn_fast: true,
            attn_prefill: true,
            attn_split: 1,
            rehearse: true,
            rehearse_list: true,
            gemv_split: true,
            gemv_stream: true,
            stream_blocks: 2,
            q_blocks: 3,
            q_prefetch: false,
            q_ahead: true,
            q_typed: TypedQ::All,
            q_interleave: true,
            q_direct: true,
            q_direct_norm: true,
            q_warps: 16,
            q_warps_norm: 8,
            q_head: true,
            q_head_pairs: true,
            q_head_fold: true,
            stream_pad_kb: None,
            copy_kernel_max: 4096,
            read_kernel: true,
            qdot: QDot::Q16,
        }
    }
}

/// Most key chunks per query head `attn_split` takes (a larger tune value is capped).
pub const ATTN_SPLIT_MAX: usize = 32;

/// The variable holding the decode path's tuning knobs.
pub(crate) const TUNE_VAR: &str = "LOWSYNC_CUDA_TUNE";

/// The largest shared memory a block may ask for on any CUDA device to date (sm_90, sm_100:
/// 227 KiB); a larger `gemv_pad_kb` is an error.
const MAX_PAD_KB: u64 = 227;

/// Most blocks per multiprocessor a streamed grid takes (larger `gemv_blocks` are capped).
const MAX_STREAM_BLOCKS: u64 = 32;

/// Most warps per block of `fused_gemv1_q` (`FQ1_MAX_WARPS` in src/fusion/gemv.cu).
pub(crate) const MAX_Q_WARPS: u64 = 24;

/// What `LOWSYNC_CUDA_TUNE` takes, for an unknown key or an item without `=`.
const TUNE_KEYS: &str = "comma-separated key=value items with keys pdl, attn_fast, attn_prefill, \
     attn_split, rehearse, rehearse_list, gemv_stream, gemv_split, gemv_blocks, gemv_q_blocks, \
     gemv_q_prefetch, gemv_q_ahead, gemv_q_head, gemv_q_head_pairs, gemv_q_head_fold, \
     gemv_q_typed, \
     gemv_q_interleave, gemv_q_direct, gemv_q_direct_norm, gemv_q_warps, gemv_q_warps_norm, gemv_pad_kb, copy_kernel, \
     read_kernel, mmv_max_m, qdot, kdef (see docs/tuning.md)";

impl CudaConfig {
    /// The defaults with the user-facing variables (`LOWSYNC_CUDA_SYNC_ELISION`,
    /// `LOWSYNC_CUDA_GRAPHS`, `LOWSYNC_CUDA_FUSION`, `LOWSYNC_CUDA_TIMING`) and then
    /// `LOWSYNC_CUDA_TUNE` applied; a bad value is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        let cfg = CudaConfig {
            sync_elision: env::flag("LOWSYNC_CUDA_SYNC_ELISION", true)?,
            graphs: env::flag("LOWSYNC_CUDA_GRAPHS", true)?,
            fusion: env::flag("LOWSYNC_CUDA_FUSION", true)?,
            timing: env::flag("LOWSYNC_CUDA_TIMING", false)?,
            ..CudaConfig::default()
        };
        match std::env::var(TUNE_VAR) {
            Ok(spec) => cfg.with_tune(&spec),
            Err(_) => Ok(cfg),
        }
    }

    /// `self` with the tuning knobs of `spec` (the value of `LOWSYNC_CUDA_TUNE`) applied:
    /// comma-separated `key=value` items, whitespace around each ignored, empty items skipped,
    /// a later item of a key overriding an earlier one. Keys: `pdl`, `attn_fast`,
    /// `attn_prefill`, `rehearse`, `gemv_stream`, `gemv_split`, `gemv_q_prefetch`,
    /// `gemv_q_ahead`, `gemv_q_head`, `gemv_q_head_pairs`, `gemv_q_head_fold`,
    /// `gemv_q_interleave`, `gemv_q_direct`,
    /// `gemv_q_direct_norm`, `rehearse_list`, `read_kernel` (0 or 1); `gemv_q_typed` (0, 1 or
    /// 2); `gemv_q_warps` (0 to 24) and `gemv_q_warps_norm` (0 or 8 to 24);
    /// `attn_split` (0, 1 or a chunk count, capped at 32); `gemv_blocks` and `gemv_q_blocks` (1
    /// or more, capped at 32); `gemv_pad_kb` (0 to 227); `copy_kernel`
    /// (bytes); `mmv_max_m` (rows); `qdot` (`q16`, `q8` or `f32`); `kdef` (`+`-separated
    /// macro names, see `CudaConfig::kdefs`). An unknown key, an item without
    /// `=` or a bad value is an `Error::Env` for `LOWSYNC_CUDA_TUNE`.
    pub fn with_tune(mut self, spec: &str) -> Result<Self> {
        let bad = |expected: &'static str| Error::Env {
            var: TUNE_VAR,
            value: spec.to_string(),
            expected,
        };
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                return Err(bad(TUNE_KEYS));
            };
            let value = value.trim();
            let flag = |expected| match value {
                "0" => Ok(false),
                "1" => Ok(true),
                _ => Err(bad(expected)),
            };
            let unsigned = |expected| value.parse::<u64>().map_err(|_| bad(expected));
            let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
            // Blocks per multiprocessor: positive, capped at `MAX_STREAM_BLOCKS`.
            let per_sm = |expected| match unsigned(expected)? {
                0 => Err(bad(expected)),
                v => Ok(size(v.min(MAX_STREAM_BLOCKS))),
            };
            match key.trim() {
                "pdl" => self.pdl = flag("pdl=0 or pdl=1")?,
                "attn_fast" => self.attn_fast = flag("attn_fast=0 or attn_fast=1")?,
                "attn_prefill" => self.attn_prefill = flag("attn_prefill=0 or attn_prefill=1")?,
                "rehearse" => self.rehearse = flag("rehearse=0 or rehearse=1")?,
                "gemv_stream" => self.gemv_stream = flag("gemv_stream=0 or gemv_stream=1")?,
                "gemv_split" => self.gemv_split = flag("gemv_split=0 or gemv_split=1")?,
                "read_kernel" => self.read_kernel = flag("read_kernel=0 or read_kernel=1")?,
                "gemv_q_prefetch" => {
                    self.q_prefetch = flag("gemv_q_prefetch=0 or gemv_q_prefetch=1")?
                }
                "gemv_q_head" => self.q_head = flag("gemv_q_head=0 or gemv_q_head=1")?,
                "gemv_q_head_pairs" => {
                    self.q_head_pairs = flag("gemv_q_head_pairs=0 or gemv_q_head_pairs=1")?
                }
                "gemv_q_head_fold" => {
                    self.q_head_fold = flag("gemv_q_head_fold=0 or gemv_q_head_fold=1")?
                }
                "gemv_q_typed" => {
                    self.q_typed = match value {
                        "0" => TypedQ::Off,
                        "1" => TypedQ::NoQ4K,
                        "2" => TypedQ::All,
                        _ => return Err(bad("gemv_q_typed=0, 1 or 2")),
                    }
                }
                "gemv_q_direct" => self.q_direct = flag("gemv_q_direct=0 or gemv_q_direct=1")?,
                "gemv_q_direct_norm" => {
                    self.q_direct_norm = flag("gemv_q_direct_norm=0 or gemv_q_direct_norm=1")?
                }
                "gemv_q_warps" => {
                    let expected =
                        "gemv_q_warps=N, N warps per block from 1 to 24 (0: from the units)";
                    match unsigned(expected)? {
                        v @ 0..=MAX_Q_WARPS => self.q_warps = size(v),
                        _ => return Err(bad(expected)),
                    }
                }
                "gemv_q_warps_norm" => {
                    let expected =
                        "gemv_q_warps_norm=N, N warps per block from 8 to 24 (0: from the units)";
                    match unsigned(expected)? {
                        v @ (0 | 8..=MAX_Q_WARPS) => self.q_warps_norm = size(v),
                        _ => return Err(bad(expected)),
                    }
                }
                "gemv_q_interleave" => {
                    self.q_interleave = flag("gemv_q_interleave=0 or gemv_q_interleave=1")?
                }
                "gemv_q_ahead" => self.q_ahead = flag("gemv_q_ahead=0 or gemv_q_ahead=1")?,
                "rehearse_list" => self.rehearse_list = flag("rehearse_list=0 or rehearse_list=1")?,
                "attn_split" => {
                    let expected = "attn_split=N: 0 off, 1 chunks from the multiprocessors, \
                         N >= 2 at most N chunks per head";
                    self.attn_split = size(unsigned(expected)?.min(ATTN_SPLIT_MAX as u64));
                }
                "gemv_blocks" => {
                    self.stream_blocks =
                        per_sm("gemv_blocks=N, N a positive integer (blocks per multiprocessor)")?
                }
                "gemv_q_blocks" => {
                    self.q_blocks =
                        per_sm("gemv_q_blocks=N, N a positive integer (blocks per multiprocessor)")?
                }
                "gemv_pad_kb" => {
                    let expected = "gemv_pad_kb=N, N KiB of shared memory per block, at most 227";
                    match unsigned(expected)? {
                        v if v > MAX_PAD_KB => return Err(bad(expected)),
                        v => self.stream_pad_kb = Some(size(v)),
                    }
                }
                "copy_kernel" => {
                    self.copy_kernel_max = size(unsigned("copy_kernel=N, N bytes (0: off)")?)
                }
                "mmv_max_m" => {
                    self.mmv_max_m = Some(size(unsigned("mmv_max_m=N, N rows (0: cuBLAS)")?))
                }
                "qdot" => {
                    self.qdot = match value {
                        "q16" => QDot::Q16,
                        "q8" => QDot::Q8,
                        "f32" => QDot::F32,
                        _ => return Err(bad("qdot=q16, qdot=q8 or qdot=f32")),
                    }
                }
                "kdef" => {
                    let expected = "kdef=NAME+NAME..., names of [A-Z0-9_], 1 to 32 characters, \
                         starting with a letter (empty: none)";
                    let names = value.split('+').map(str::trim).filter(|n| !n.is_empty());
                    let ok = |n: &str| {
                        n.len() <= 32
                            && n.starts_with(|c: char| c.is_ascii_uppercase())
                            && n.chars()
                                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                    };
                    let mut kdefs = Vec::new();
                    for n in names {
                        if !ok(n) {
                            return Err(bad(expected));
                        }
                        kdefs.push(n.to_string());
                    }
                    self.kdefs = kdefs;
                }
                _ => return Err(bad(TUNE_KEYS)),
            }
        }
        Ok(self)
    }
}

/// A device's shared memory limits, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedLimits {
    /// Per multiprocessor (228 KiB on the H200).
    pub(crate) per_sm: usize,
    /// The most one block may ask for (opt-in; 227 KiB).
    pub(crate) per_block: usize,
    /// Taken by the system for each resident block (1 KiB).
    pub(crate) reserved: usize,
}

/// Bytes of shared memory each block of a streamed product asks for at least, so that its
/// `blocks` per multiprocessor fit and one more does not: the streamed entry points take 80
/// registers, so the register file alone would let a third block onto a multiprocessor, and a
/// grid of two per multiprocessor would then land unevenly and take the room the next kernel's
/// first blocks start in. `pad_kb` is `CudaConfig::stream_pad_kb`: `None` computes it (the
/// least that excludes one more block, rounded up to 8 KiB: 80 KiB on the H200, leaving 66 KiB
/// beside two blocks for the next kernel), `Some(0)` turns it off, `Some(n)` asks for n KiB,
/// capped at what a block may have less 1 KiB (the kernels' own static shared memory, 128
/// bytes, counts against the same limit). 0 where no pad holds exactly `blocks`.
pub(crate) fn stream_pad(pad_kb: Option<usize>, blocks: usize, lim: SharedLimits) -> usize {
    if let Some(kb) = pad_kb {
        return (kb << 10).min(lim.per_block.saturating_sub(1 << 10));
    }
    let blocks = blocks.max(1);
    let least = (lim.per_sm / (blocks + 1) + 1).saturating_sub(lim.reserved);
    let pad = least.div_ceil(8 << 10) * (8 << 10);
    if pad + (1 << 10) > lim.per_block || blocks * (pad + lim.reserved) > lim.per_sm {
        return 0;
    }
    pad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuned(spec: &str) -> Result<CudaConfig> {
        CudaConfig::default().with_tune(spec)
    }

    #[test]
    fn an_empty_tune_keeps_every_default() {
        for spec in ["", " ", ",", " , ,"] {
            assert_eq!(tuned(spec).unwrap(), CudaConfig::default(), "{spec:?}");
        }
    }

    #[test]
    fn every_tune_key_sets_its_field() {
        let c = tuned(
            "pdl=0, attn_fast=0,attn_prefill=0,rehearse=0,gemv_stream=0,gemv_split=0,read_kernel=0,\
             gemv_blocks=3,gemv_pad_kb=96,copy_kernel=512,mmv_max_m=16,qdot=f32,attn_split=0,gemv_q_blocks=5,gemv_q_prefetch=1,gemv_q_head=0,rehearse_list=0,\
             gemv_q_ahead=0,gemv_q_typed=0,gemv_q_interleave=0,gemv_q_direct=0,gemv_q_warps=24,gemv_q_warps_norm=0,\
             gemv_q_direct_norm=0,gemv_q_head_pairs=0,gemv_q_head_fold=0",
        )
        .unwrap();
        let want = CudaConfig {
            pdl: false,
            attn_fast: false,
            attn_prefill: false,
            rehearse: false,
            gemv_stream: false,
            gemv_split: false,
            read_kernel: false,
            stream_blocks: 3,
            q_blocks: 5,
            q_prefetch: true,
            q_ahead: false,
            q_head: false,
            q_head_pairs: false,
            q_head_fold: false,
            q_typed: TypedQ::Off,
            q_interleave: false,
            q_direct: false,
            q_direct_norm: false,
            q_warps: 24,
            q_warps_norm: 0,
            rehearse_list: false,
            stream_pad_kb: Some(96),
            copy_kernel_max: 512,
            mmv_max_m: Some(16),
            qdot: QDot::F32,
            attn_split: 0,
            ..CudaConfig::default()
        };
        assert_eq!(c, want);
        assert_eq!(tuned("qdot=q8").unwrap().qdot, QDot::Q8);
        assert_eq!(tuned("qdot=q16").unwrap().qdot, QDot::Q16);
        assert_eq!(tuned("attn_split=6").unwrap().attn_split, 6);
        assert_eq!(tuned("attn_split=500").unwrap().attn_split, 32, "capped");
        assert_eq!(
            tuned("gemv_blocks=1000").unwrap().stream_blocks,
            32,
            "capped"
        );
        assert_eq!(
            tuned("kdef=QLD_NC+Q8_W64").unwrap().kdefs,
            ["QLD_NC", "Q8_W64"]
        );
        assert!(
            tuned("kdef=A1,kdef=").unwrap().kdefs.is_empty(),
            "empty: none"
        );
        assert!(tuned("pdl=0,pdl=1").unwrap().pdl, "the last item wins");
        assert_eq!(tuned(" copy_kernel = 0 ").unwrap().copy_kernel_max, 0);
    }

    #[test]
    fn a_bad_tune_item_names_the_variable_and_what_it_takes() {
        for (spec, names) in [
            ("pdl=2", "pdl=0 or pdl=1"),
            ("gemv_blocks=0", "positive integer"),
            ("gemv_blocks=two", "positive integer"),
            ("gemv_q_blocks=0", "positive integer"),
            (
                "gemv_q_prefetch=2",
                "gemv_q_prefetch=0 or gemv_q_prefetch=1",
            ),
            ("gemv_q_head=x", "gemv_q_head=0 or gemv_q_head=1"),
            (
                "gemv_q_head_fold=2",
                "gemv_q_head_fold=0 or gemv_q_head_fold=1",
            ),
            ("gemv_q_ahead=x", "gemv_q_ahead=0 or gemv_q_ahead=1"),
            ("gemv_q_typed=3", "gemv_q_typed=0, 1 or 2"),
            ("gemv_q_warps=25", "from 1 to 24"),
            ("gemv_q_warps_norm=7", "from 8 to 24"),
            ("gemv_q_warps_norm=25", "from 8 to 24"),
            (
                "gemv_q_interleave=x",
                "gemv_q_interleave=0 or gemv_q_interleave=1",
            ),
            ("rehearse_list=2", "rehearse_list=0 or rehearse_list=1"),
            ("gemv_pad_kb=228", "at most 227"),
            ("gemv_pad_kb=-1", "at most 227"),
            ("copy_kernel=4k", "bytes"),
            ("mmv_max_m=-1", "rows"),
            ("qdot=q4", "qdot=q16, qdot=q8 or qdot=f32"),
            ("attn_split=auto", "N >= 2 at most N chunks"),
            ("pdl=1,evict_first=1", "gemv_blocks"),
            ("weight_evict_first=1", "qdot"),
            ("pdl", "key=value"),
            ("kdef=qld", "names of [A-Z0-9_]"),
            ("kdef=1AB", "starting with a letter"),
            ("kdef=A-B", "names of [A-Z0-9_]"),
            ("kdef=A B", "names of [A-Z0-9_]"),
        ] {
            match tuned(spec) {
                Err(Error::Env {
                    var,
                    value,
                    expected,
                }) => {
                    assert_eq!(var, TUNE_VAR, "{spec}");
                    assert_eq!(value, spec);
                    assert!(expected.contains(names), "{spec}: {expected}");
                }
                other => panic!("{spec}: expected an env error, got {other:?}"),
            }
        }
    }

    const H200: SharedLimits = SharedLimits {
        per_sm: 228 << 10,
        per_block: 227 << 10,
        reserved: 1 << 10,
    };

    #[test]
    fn stream_pad_holds_the_streamed_grid_to_its_blocks_per_multiprocessor() {
        assert_eq!(
            stream_pad(None, 2, H200),
            80 << 10,
            "the H200, two per multiprocessor"
        );
        for blocks in 1..=8 {
            let pad = stream_pad(None, blocks, H200);
            if pad == 0 {
                continue;
            }
            let fit = H200.per_sm / (pad + H200.reserved);
            assert_eq!(fit, blocks, "{blocks} per multiprocessor: pad {pad}");
            assert_eq!(pad % (8 << 10), 0);
        }
        // An A100 (164 KiB per multiprocessor, 163 per block).
        let a100 = SharedLimits {
            per_sm: 164 << 10,
            per_block: 163 << 10,
            reserved: 1 << 10,
        };
        assert_eq!(stream_pad(None, 2, a100), 56 << 10);
        assert_eq!(a100.per_sm / ((56 << 10) + a100.reserved), 2);
        // Asked for: off, as given, capped at what a block may have.
        assert_eq!(stream_pad(Some(0), 2, H200), 0);
        assert_eq!(stream_pad(Some(96), 2, H200), 96 << 10);
        assert_eq!(stream_pad(Some(227), 2, a100), 162 << 10);
        assert_eq!(stream_pad(Some(227), 2, H200), 226 << 10);
        // Nothing fits exactly: no pad rather than a launch the device refuses.
        let tiny = SharedLimits {
            per_sm: 48 << 10,
            per_block: 48 << 10,
            reserved: 1 << 10,
        };
        assert_eq!(stream_pad(None, 8, tiny), 0);
    }
}
