//! Kernel modules: CUDA C compiled by NVRTC for the device's architecture on first use.
//!
//! Why: the wheel ships no toolkit and must run on whatever GPU it finds, so kernels are compiled
//! at run time for that GPU (SASS for `sm_XX`, no PTX JIT), once per process, and the binary is
//! kept on disk so the next process skips NVRTC entirely.
//!
//! Strategy: each `kernels/*.cu` file, and each fused family's `src/fusion/*.cu` beside its
//! launcher (with the shared `kernels/common.cuh` prepended), is one module; the modules of
//! `PER_BLOCK_TYPE` are compiled once per GGUF block type, and those of `PARTS` in parts (a
//! few kernels each). The backend loads every module when it opens (`Modules::preload`),
//! compiling the ones no cache holds on several threads at once. The cubin is cached under
//! `$XDG_CACHE_HOME/lowsync/cuda` (or `~/.cache/lowsync/cuda`), keyed by a hash of source,
//! architecture and options; a cache file that fails to load is recompiled and replaced. Cache
//! I/O failures are ignored (the cache is an optimisation).
//!
//! Invariant: modules stay loaded until the backend drops, so function handles never dangle.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock};

use cudarc::driver::{result, sys};
use cudarc::nvrtc::{result as nvres, sys as nvsys};
use parking_lot::Mutex;

use lowsync_graph::DType;

use crate::config::TypedQ;
use crate::driver::CuFunction;

/// Cubins compiled or read by this process, by cache file name (every backend of a device
/// loads them into its own context without NVRTC or disk I/O).
static CUBINS: LazyLock<Mutex<HashMap<String, Arc<Vec<u8>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

const COMMON: &str = include_str!("../kernels/common.cuh");

/// The kernel modules and their sources.
const MODULES: &[(&str, &str)] = &[
    ("elementwise", include_str!("../kernels/elementwise.cu")),
    ("rows", include_str!("../kernels/rows.cu")),
    ("norm", include_str!("../kernels/norm.cu")),
    ("rope", include_str!("../kernels/rope.cu")),
    ("matmul", include_str!("../kernels/matmul.cu")),
    ("sample", include_str!("../kernels/sample.cu")),
    // GGUF block weights: quant.cuh (one decoder per block type) and the kernels that use it.
    (
        "quant",
        concat!(
            include_str!("../kernels/quant.cuh"),
            "\n",
            include_str!("../kernels/quant.cu")
        ),
    ),
    ("fused_norm_mul", include_str!("fusion/norm_mul.cu")),
    // The fused products, with quant.cuh for `fused_gemv1_q` (quantized weights).
    (
        "fused_gemv",
        concat!(
            include_str!("../kernels/quant.cuh"),
            "\n",
            include_str!("fusion/gemv.cu")
        ),
    ),
    ("fused_rope_rows", include_str!("fusion/rope_rows.cu")),
    ("fused_attention", include_str!("fusion/attention.cu")),
];

/// Modules compiled once per GGUF block type, with `-DLOWSYNC_QT=<code>`: quant.cuh's
/// `QUANT_SWITCH` then expands that one type. Why: on a 2-core x86 machine NVRTC took about
/// two minutes for `quant` with all twelve types in one module against about 4 s per type (its
/// time grows faster than the cases), and the types compile side by side.
const PER_BLOCK_TYPE: &[&str] = &["quant"];

/// quant.cuh's block type codes (`DT_Q4_0` ... `DT_IQ4_XS`), as `exec::launch::qt` gives them.
const BLOCK_TYPES: [i32; 12] = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// Modules compiled in parts, with `-DLOWSYNC_PART=<1..=n>`: each part keeps the kernels
/// between `#if LS_PART(part)` and `#endif` (common.cuh), and `Kernel::module` says which part
/// holds a kernel. Why: these two took NVRTC 27 and 25 s whole on a 2-core x86 machine, and
/// their largest parts 12 and 11 s. (`fused_gemv`'s sixth part, the typed entry points on q8
/// records, came later.)
const PARTS: &[(&str, u8)] = &[("fused_attention", 4), ("fused_gemv", 6)];

/// Compile threads at most: NVRTC holds a few hundred MB per large module.
const COMPILE_THREADS: usize = 8;

/// Which build of a module: whole, for one block type (`PER_BLOCK_TYPE`), or one part (`PARTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Variant {
    Whole,
    BlockType(i32),
    Part(u8),
}

/// One module as loaded: its name and which build of it.
type ModuleId = (&'static str, Variant);

/// A kernel: its module and its `extern "C"` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    EwUnary,
    EwBinary,
    /// One block copying a few bytes between device and pinned host memory (`small_copy`).
    SmallCopy,
    /// Up to eight small copies in one launch, host bytes in its parameters (`copy_batch`).
    CopyBatch,
    CopyStrided,
    Fill,
    GetRows,
    SetRows,
    RmsNorm,
    SoftMax,
    /// `soft_max` for rows of at most `SOFT_MAX_ROWS_MAX` values, one warp per row.
    SoftMaxRows,
    Argmax,
    Rope,
    MulMatId,
    MulMatVecK,
    MulMatVecK4,
    MulMatVecN,
    MulMatVecN8,
    MulMatVec1,
    MulMatVec1Argmax,
    ArgmaxTake,
    RmsNormMul,
    FusedGemv,
    FusedGemv8,
    RopeRows,
    AttnDecode,
    AttnFast,
    AttnFastLong,
    /// Decode attention split over keys: several blocks per head (fusion/attention.cu).
    AttnSplit,
    /// Prefill attention, flash style (fusion/attention.cu).
    AttnPrefill,
    FusedGemv1,
    FusedGemv1Pair,
    /// `fused_gemv1`'s streamed, staged path alone, for f16, bf16 and f32 weights (80
    /// registers: see fusion/gemv.cu).
    FusedGemv1S16,
    FusedGemv1Sb16,
    FusedGemv1S32,
    /// `fused_gemv1_pair`'s two decode paths alone, per weight dtype: gate/up streamed (`gu`)
    /// and q/k/v's row pairs (`rp`; see fusion/gemv.cu).
    FusedGemv1Gu16,
    FusedGemv1Gub16,
    FusedGemv1Gu32,
    FusedGemv1Rp16,
    FusedGemv1Rpb16,
    FusedGemv1Rp32,
    /// Decode's fused products on quantized weights (every pair mode; fusion/gemv.cu).
    FusedGemv1Q,
    /// `fused_gemv1_q` on q16 records for sets of one block type, per type (`TYPED_Q`).
    FusedGemv1Q40,
    FusedGemv1Q41,
    FusedGemv1Q80,
    FusedGemv1Q4K,
    FusedGemv1Q6K,
    /// ... and for sets of Q4_K and Q6_K weights (Q4_K_M's mixed groups).
    FusedGemv1Q4KQ6K,
    /// The same entry points on q8 records (`TYPED_Q8`, `qdot=q8`).
    FusedGemv1Q40Q8,
    FusedGemv1Q41Q8,
    FusedGemv1Q80Q8,
    FusedGemv1Q4KQ8,
    FusedGemv1Q6KQ8,
    FusedGemv1Q4KQ6KQ8,
    /// The sampler's penalties (`Op::Penalize`), one block per row.
    Penalize,
    /// The sampler's draw (`Op::Sample`), one block per row.
    Sample,
    /// `GetRows` of a quantized table (`get_rows_q`). The `quant` module's kernels carry the
    /// block type code of their weights (one module per type).
    GetRowsQ(i32),
    /// Decode's product on a quantized weight, one row of a per pass ...
    MulMatVecQ(i32),
    /// ... and eight (`mul_mat_vec_q8`).
    MulMatVecQ8(i32),
    /// Decode's head on a quantized weight with its argmax folded in.
    MulMatVecQArgmax(i32),
    /// A quantized weight dequantized to f16 rows for cuBLAS (`dequant_rows`).
    DequantRows(i32),
}

impl Kernel {
    /// Every kernel but the `quant` module's (`Kernel::all` adds them, per block type).
    const PLAIN: [Kernel; 56] = [
        Kernel::EwUnary,
        Kernel::SmallCopy,
        Kernel::CopyBatch,
        Kernel::EwBinary,
        Kernel::CopyStrided,
        Kernel::Fill,
        Kernel::GetRows,
        Kernel::SetRows,
        Kernel::RmsNorm,
        Kernel::SoftMax,
        Kernel::SoftMaxRows,
        Kernel::Argmax,
        Kernel::Rope,
        Kernel::MulMatId,
        Kernel::MulMatVecK,
        Kernel::MulMatVecK4,
        Kernel::MulMatVecN,
        Kernel::MulMatVecN8,
        Kernel::MulMatVec1,
        Kernel::MulMatVec1Argmax,
        Kernel::ArgmaxTake,
        Kernel::RmsNormMul,
        Kernel::FusedGemv,
        Kernel::FusedGemv8,
        Kernel::RopeRows,
        Kernel::AttnDecode,
        Kernel::AttnFast,
        Kernel::AttnFastLong,
        Kernel::AttnSplit,
        Kernel::AttnPrefill,
        Kernel::FusedGemv1,
        Kernel::FusedGemv1Pair,
        Kernel::FusedGemv1S16,
        Kernel::FusedGemv1Sb16,
        Kernel::FusedGemv1S32,
        Kernel::FusedGemv1Gu16,
        Kernel::FusedGemv1Gub16,
        Kernel::FusedGemv1Gu32,
        Kernel::FusedGemv1Rp16,
        Kernel::FusedGemv1Rpb16,
        Kernel::FusedGemv1Rp32,
        Kernel::FusedGemv1Q,
        Kernel::FusedGemv1Q40,
        Kernel::FusedGemv1Q41,
        Kernel::FusedGemv1Q80,
        Kernel::FusedGemv1Q4K,
        Kernel::FusedGemv1Q6K,
        Kernel::FusedGemv1Q4KQ6K,
        Kernel::FusedGemv1Q40Q8,
        Kernel::FusedGemv1Q41Q8,
        Kernel::FusedGemv1Q80Q8,
        Kernel::FusedGemv1Q4KQ8,
        Kernel::FusedGemv1Q6KQ8,
        Kernel::FusedGemv1Q4KQ6KQ8,
        Kernel::Penalize,
        Kernel::Sample,
    ];

    /// Every kernel: `PLAIN`, then the `quant` module's for each block type.
    pub(crate) fn all() -> impl Iterator<Item = Kernel> {
        Self::PLAIN
            .into_iter()
            .chain(BLOCK_TYPES.into_iter().flat_map(|q| {
                [
                    Kernel::GetRowsQ(q),
                    Kernel::MulMatVecQ(q),
                    Kernel::MulMatVecQ8(q),
                    Kernel::MulMatVecQArgmax(q),
                    Kernel::DequantRows(q),
                ]
            }))
    }

    /// Every module build some kernel lives in, each once, in order.
    fn module_ids() -> Vec<ModuleId> {
        let mut ids: Vec<ModuleId> = Self::all().map(Kernel::module).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The streamed products' own entry points, whose blocks may ask for more than the
    /// default 48 KB of shared memory (`stream_pad`) ...
    pub(crate) const STREAMED: [Kernel; 3] = [
        Kernel::FusedGemv1S16,
        Kernel::FusedGemv1Sb16,
        Kernel::FusedGemv1S32,
    ];
    /// ... and `fused_gemv1_pair`'s one-path entry points: gate/up streamed ...
    pub(crate) const GATE_UP: [Kernel; 3] = [
        Kernel::FusedGemv1Gu16,
        Kernel::FusedGemv1Gub16,
        Kernel::FusedGemv1Gu32,
    ];
    /// ... and q/k/v's row pairs. Each of these lists is per weight dtype: f16, bf16, f32.
    pub(crate) const ROW_PAIRS: [Kernel; 3] = [
        Kernel::FusedGemv1Rp16,
        Kernel::FusedGemv1Rpb16,
        Kernel::FusedGemv1Rp32,
    ];

    /// `fused_gemv1_q`'s typed entry points, by block type code (quant.cuh's `DT_*`): the types
    /// whose 32-value piece is one run of loads (`iq32`).
    pub(crate) const TYPED_Q: [(i32, Kernel); 5] = [
        (4, Kernel::FusedGemv1Q40),
        (5, Kernel::FusedGemv1Q41),
        (8, Kernel::FusedGemv1Q80),
        (11, Kernel::FusedGemv1Q4K),
        (13, Kernel::FusedGemv1Q6K),
    ];

    /// ... and on q8 records.
    pub(crate) const TYPED_Q8: [(i32, Kernel); 5] = [
        (4, Kernel::FusedGemv1Q40Q8),
        (5, Kernel::FusedGemv1Q41Q8),
        (8, Kernel::FusedGemv1Q80Q8),
        (11, Kernel::FusedGemv1Q4KQ8),
        (13, Kernel::FusedGemv1Q6KQ8),
    ];

    /// The typed entry point for weights of the block type codes `types` (one product's each)
    /// on q16 records, or on q8 records with `q8`, if they have one and `which` admits it: one
    /// type of `TYPED_Q` (Q4_K only with `TypedQ::All`), or Q4_K beside Q6_K (`TypedQ::All`
    /// only).
    pub(crate) fn typed_q(types: &[i64], which: TypedQ, q8: bool) -> Option<Kernel> {
        let (q4_k, q6_k) = (11, 13);
        let first = *types.first()?;
        let all = match which {
            TypedQ::Off => return None,
            TypedQ::NoQ4K => false,
            TypedQ::All => true,
        };
        let (table, mixed) = if q8 {
            (Self::TYPED_Q8, Kernel::FusedGemv1Q4KQ6KQ8)
        } else {
            (Self::TYPED_Q, Kernel::FusedGemv1Q4KQ6K)
        };
        if types.iter().all(|&t| t == first) {
            return table
                .iter()
                .find(|(code, _)| i64::from(*code) == first && (all || first != q4_k))
                .map(|(_, k)| *k);
        }
        (all && types.iter().all(|&t| t == q4_k || t == q6_k)).then_some(mixed)
    }

    /// The kernel of a per-dtype list (`STREAMED`, `GATE_UP`, `ROW_PAIRS`) for weights of
    /// dtype `d`; none for integer weights.
    pub(crate) fn for_weights(list: [Kernel; 3], d: DType) -> Option<Kernel> {
        match d {
            DType::F16 => Some(list[0]),
            DType::BF16 => Some(list[1]),
            DType::F32 => Some(list[2]),
            _ => None,
        }
    }

    /// The module holding this kernel, and which build of it (its block type, or its part:
    /// the `#if LS_PART(n)` around it in the module's source).
    fn module(self) -> ModuleId {
        use Variant::{Part, Whole};
        match self {
            Kernel::EwUnary
            | Kernel::EwBinary
            | Kernel::CopyStrided
            | Kernel::Fill
            | Kernel::SmallCopy
            | Kernel::CopyBatch => ("elementwise", Whole),
            Kernel::GetRows | Kernel::SetRows => ("rows", Whole),
            Kernel::RmsNorm | Kernel::SoftMax | Kernel::SoftMaxRows | Kernel::Argmax => {
                ("norm", Whole)
            }
            Kernel::Rope => ("rope", Whole),
            Kernel::MulMatId
            | Kernel::MulMatVecK
            | Kernel::MulMatVecK4
            | Kernel::MulMatVecN
            | Kernel::MulMatVecN8
            | Kernel::MulMatVec1
            | Kernel::MulMatVec1Argmax
            | Kernel::ArgmaxTake => ("matmul", Whole),
            Kernel::RmsNormMul => ("fused_norm_mul", Whole),
            Kernel::FusedGemv
            | Kernel::FusedGemv8
            | Kernel::FusedGemv1
            | Kernel::FusedGemv1Pair => ("fused_gemv", Part(1)),
            Kernel::FusedGemv1S16
            | Kernel::FusedGemv1Sb16
            | Kernel::FusedGemv1S32
            | Kernel::FusedGemv1Gu16
            | Kernel::FusedGemv1Gub16
            | Kernel::FusedGemv1Gu32
            | Kernel::FusedGemv1Rp16
            | Kernel::FusedGemv1Rpb16
            | Kernel::FusedGemv1Rp32 => ("fused_gemv", Part(2)),
            Kernel::FusedGemv1Q => ("fused_gemv", Part(3)),
            Kernel::FusedGemv1Q40 | Kernel::FusedGemv1Q41 | Kernel::FusedGemv1Q80 => {
                ("fused_gemv", Part(4))
            }
            Kernel::FusedGemv1Q4K | Kernel::FusedGemv1Q6K | Kernel::FusedGemv1Q4KQ6K => {
                ("fused_gemv", Part(5))
            }
            Kernel::FusedGemv1Q40Q8
            | Kernel::FusedGemv1Q41Q8
            | Kernel::FusedGemv1Q80Q8
            | Kernel::FusedGemv1Q4KQ8
            | Kernel::FusedGemv1Q6KQ8
            | Kernel::FusedGemv1Q4KQ6KQ8 => ("fused_gemv", Part(6)),
            Kernel::RopeRows => ("fused_rope_rows", Whole),
            Kernel::AttnFast => ("fused_attention", Part(1)),
            Kernel::AttnFastLong => ("fused_attention", Part(2)),
            Kernel::AttnSplit => ("fused_attention", Part(3)),
            Kernel::AttnDecode | Kernel::AttnPrefill => ("fused_attention", Part(4)),
            Kernel::Penalize | Kernel::Sample => ("sample", Whole),
            Kernel::GetRowsQ(q)
            | Kernel::MulMatVecQ(q)
            | Kernel::MulMatVecQ8(q)
            | Kernel::MulMatVecQArgmax(q)
            | Kernel::DequantRows(q) => ("quant", Variant::BlockType(q)),
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            Kernel::EwUnary => "ew_unary",
            Kernel::EwBinary => "ew_binary",
            Kernel::CopyStrided => "copy_strided",
            Kernel::Fill => "fill",
            Kernel::SmallCopy => "small_copy",
            Kernel::CopyBatch => "copy_batch",
            Kernel::GetRows => "get_rows",
            Kernel::SetRows => "set_rows",
            Kernel::RmsNorm => "rms_norm",
            Kernel::SoftMax => "soft_max",
            Kernel::SoftMaxRows => "soft_max_rows",
            Kernel::Argmax => "argmax",
            Kernel::Rope => "rope",
            Kernel::MulMatId => "mul_mat_id",
            Kernel::MulMatVecK => "mul_mat_vec_k",
            Kernel::MulMatVecK4 => "mul_mat_vec_k4",
            Kernel::MulMatVecN => "mul_mat_vec_n",
            Kernel::MulMatVecN8 => "mul_mat_vec_n8",
            Kernel::MulMatVec1 => "mul_mat_vec_1",
            Kernel::MulMatVec1Argmax => "mul_mat_vec_1_argmax",
            Kernel::ArgmaxTake => "argmax_take",
            Kernel::RmsNormMul => "rms_norm_mul",
            Kernel::FusedGemv => "fused_gemv",
            Kernel::FusedGemv8 => "fused_gemv8",
            Kernel::RopeRows => "rope_rows",
            Kernel::AttnDecode => "attn_decode",
            Kernel::AttnFast => "attn_fast",
            Kernel::AttnFastLong => "attn_fast_long",
            Kernel::AttnSplit => "attn_split",
            Kernel::AttnPrefill => "attn_prefill",
            Kernel::FusedGemv1Gu16 => "fused_gemv1_gu16",
            Kernel::FusedGemv1Gub16 => "fused_gemv1_gub16",
            Kernel::FusedGemv1Gu32 => "fused_gemv1_gu32",
            Kernel::FusedGemv1Rp16 => "fused_gemv1_rp16",
            Kernel::FusedGemv1Rpb16 => "fused_gemv1_rpb16",
            Kernel::FusedGemv1Rp32 => "fused_gemv1_rp32",
            Kernel::FusedGemv1Q => "fused_gemv1_q",
            Kernel::FusedGemv1Q40 => "fused_gemv1_q4_0",
            Kernel::FusedGemv1Q41 => "fused_gemv1_q4_1",
            Kernel::FusedGemv1Q80 => "fused_gemv1_q8_0",
            Kernel::FusedGemv1Q4K => "fused_gemv1_q4_k",
            Kernel::FusedGemv1Q6K => "fused_gemv1_q6_k",
            Kernel::FusedGemv1Q4KQ6K => "fused_gemv1_q4_k_q6_k",
            Kernel::FusedGemv1Q40Q8 => "fused_gemv1_q4_0_q8",
            Kernel::FusedGemv1Q41Q8 => "fused_gemv1_q4_1_q8",
            Kernel::FusedGemv1Q80Q8 => "fused_gemv1_q8_0_q8",
            Kernel::FusedGemv1Q4KQ8 => "fused_gemv1_q4_k_q8",
            Kernel::FusedGemv1Q6KQ8 => "fused_gemv1_q6_k_q8",
            Kernel::FusedGemv1Q4KQ6KQ8 => "fused_gemv1_q4_k_q6_k_q8",
            Kernel::FusedGemv1 => "fused_gemv1",
            Kernel::FusedGemv1Pair => "fused_gemv1_pair",
            Kernel::FusedGemv1S16 => "fused_gemv1_s16",
            Kernel::FusedGemv1Sb16 => "fused_gemv1_sb16",
            Kernel::FusedGemv1S32 => "fused_gemv1_s32",
            Kernel::Penalize => "penalize",
            Kernel::Sample => "sample",
            Kernel::GetRowsQ(_) => "get_rows_q",
            Kernel::MulMatVecQ(_) => "mul_mat_vec_q",
            Kernel::MulMatVecQ8(_) => "mul_mat_vec_q8",
            Kernel::MulMatVecQArgmax(_) => "mul_mat_vec_q_argmax",
            Kernel::DequantRows(_) => "dequant_rows",
        }
    }
}

struct Module(sys::CUmodule);
// SAFETY: an opaque handle of the thread-safe driver API.
unsafe impl Send for Module {}

/// Loaded modules of one context.
pub(crate) struct Modules {
    arch: String,
    max_shared: usize,
    /// `CudaConfig::kdefs`: `-DLS_KDEF_<name>` for every module.
    kdefs: Vec<String>,
    loaded: Mutex<HashMap<ModuleId, Module>>,
    funcs: Mutex<HashMap<Kernel, CuFunction>>,
}

impl Modules {
    /// Modules for a device of compute capability `major.minor` whose blocks may ask for up to
    /// `max_shared` bytes of shared memory (the opt-in limit).
    pub(crate) fn new(major: i32, minor: i32, max_shared: usize) -> Self {
        Modules {
            arch: format!("sm_{major}{minor}"),
            max_shared,
            kdefs: Vec::new(),
            loaded: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
        }
    }

    /// The same modules built with the source variants `kdefs` (`CudaConfig::kdefs`).
    pub(crate) fn with_kdefs(mut self, kdefs: &[String]) -> Self {
        self.kdefs = kdefs.to_vec();
        self
    }

    /// Loads every module and resolves every kernel now. Module loading (and, under CUDA's
    /// lazy loading, resolving a function) may synchronize the context, so it must not happen
    /// while work is queued — behind a closed test gate it would never return, and during a
    /// step it would be a hidden host wait. The backend calls this when it opens; the modules
    /// no cache holds are compiled first, side by side (`compile_missing`).
    pub(crate) fn preload(&self) -> Result<(), String> {
        self.compile_missing()?;
        Kernel::all().try_for_each(|k| self.get(k).map(|_| ()))
    }

    /// Compiles every module that neither this process nor the disk cache holds, side by side
    /// (`compile_all`), and keeps the cubins as `load` would. A bare machine's first open then
    /// waits for the slowest module instead of the sum of all of them.
    fn compile_missing(&self) -> Result<(), String> {
        let mut jobs = Vec::new();
        for id in Kernel::module_ids() {
            let unit = self.unit(id)?;
            let held = CUBINS.lock().contains_key(&unit.file)
                || unit.path.as_ref().is_some_and(|p| p.is_file());
            if !held {
                jobs.push(unit);
            }
        }
        if jobs.is_empty() {
            return Ok(());
        }
        tracing::info!(
            arch = %self.arch,
            modules = jobs.len(),
            "compiling CUDA kernels with NVRTC (first use on this GPU; cached afterwards)"
        );
        let start = std::time::Instant::now();
        let compiled = compile_all(&jobs);
        tracing::info!(
            seconds = start.elapsed().as_secs_f64(),
            "CUDA kernels compiled"
        );
        for (u, bin) in jobs.iter().zip(compiled) {
            let bin = bin?;
            if let Some(p) = &u.path {
                store(p, &bin);
            }
            CUBINS.lock().insert(u.file.clone(), Arc::new(bin));
        }
        Ok(())
    }

    /// What compiling module `id` takes: its full source, NVRTC options and cache file.
    fn unit(&self, (name, variant): ModuleId) -> Result<Unit, String> {
        let src = MODULES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| format!("{COMMON}\n{s}"))
            .ok_or_else(|| format!("no kernel module {name}"))?;
        let parts = PARTS.iter().find(|(n, _)| *n == name).map(|(_, p)| *p);
        let mut options = vec![format!("--gpu-architecture={}", self.arch)];
        let label = match variant {
            Variant::Whole if parts.is_none() && !PER_BLOCK_TYPE.contains(&name) => {
                name.to_string()
            }
            Variant::BlockType(q) if PER_BLOCK_TYPE.contains(&name) => {
                options.push(format!("-DLOWSYNC_QT={q}"));
                format!("{name}-qt{q}")
            }
            Variant::Part(p) if parts.is_some_and(|n| (1..=n).contains(&p)) => {
                options.push(format!("-DLOWSYNC_PART={p}"));
                format!("{name}-part{p}")
            }
            _ => return Err(format!("kernel module {name} asked for as {variant:?}")),
        };
        options.extend(self.kdefs.iter().map(|d| format!("-DLS_KDEF_{d}")));
        let key = fnv1a(&[src.as_bytes(), options.concat().as_bytes()]);
        let file = format!("{label}-{}-{key:016x}.cubin", self.arch);
        let path = cache_dir().map(|d| d.join(&file));
        Ok(Unit {
            label,
            per_type: matches!(variant, Variant::BlockType(_)),
            src,
            options,
            file,
            path,
        })
    }

    /// The kernel's function handle, compiling and loading its module on first use. The
    /// caller has bound the context to this thread.
    pub(crate) fn get(&self, k: Kernel) -> Result<CuFunction, String> {
        if let Some(f) = self.funcs.lock().get(&k) {
            return Ok(*f);
        }
        let mut loaded = self.loaded.lock();
        let id = k.module();
        if let std::collections::hash_map::Entry::Vacant(e) = loaded.entry(id) {
            e.insert(self.load(id)?);
        }
        let module = loaded[&id].0;
        let sym = CString::new(k.symbol()).map_err(|e| e.to_string())?;
        // SAFETY: the module is loaded and stays loaded while `self` lives.
        let f = unsafe { result::module::get_function(module, sym) }
            .map_err(|e| format!("kernel {} not found in module {}: {e:?}", k.symbol(), id.0))?;
        if Kernel::STREAMED.contains(&k) {
            // Streamed blocks ask for more than the default 48 KB of shared memory when padded
            // (`CudaConfig::stream_pad_kb`); this raises their limit to the device's, less the
            // kernel's static shared memory (the driver refuses a limit above that).
            use sys::CUfunction_attribute as F;
            // SAFETY: `f` was just looked up in a loaded module.
            let fixed = unsafe {
                result::function::get_function_attribute(f, F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            }
            .map_err(|e| format!("kernel {}: static shared memory: {e:?}", k.symbol()))?;
            let limit = self.max_shared.saturating_sub(fixed.max(0) as usize);
            // SAFETY: as above.
            unsafe {
                result::function::set_function_attribute(
                    f,
                    F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    i32::try_from(limit).unwrap_or(i32::MAX),
                )
            }
            .map_err(|e| format!("kernel {}: shared memory limit {limit}: {e:?}", k.symbol()))?;
        }
        self.funcs.lock().insert(k, CuFunction(f));
        Ok(CuFunction(f))
    }

    fn load(&self, id: ModuleId) -> Result<Module, String> {
        let Unit {
            label,
            per_type: _,
            src,
            options,
            file,
            path,
        } = self.unit(id)?;
        if let Some(bin) = CUBINS.lock().get(&file).cloned() {
            if let Ok(m) = load_cubin(&bin) {
                return Ok(m);
            }
        }
        if let Some(bin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
            if let Ok(m) = load_cubin(&bin) {
                CUBINS.lock().insert(file, Arc::new(bin));
                return Ok(m);
            }
        }
        let bin = compile(&label, &src, &options)?;
        let m = load_cubin(&bin)?;
        if let Some(p) = path {
            store(&p, &bin);
        }
        CUBINS.lock().insert(file, Arc::new(bin));
        Ok(m)
    }
}

/// A cubin, or why NVRTC made none.
type Compiled = Result<Vec<u8>, String>;

/// Compiles `units` on up to `COMPILE_THREADS` threads (NVRTC compiles separate programs
/// concurrently), each thread taking the next unit, the whole modules first by source length
/// and the per-type ones (a few seconds each) last; the results in `units`' order.
fn compile_all(units: &[Unit]) -> Vec<Compiled> {
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by_key(|&i| (units[i].per_type, std::cmp::Reverse(units[i].src.len())));
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, COMPILE_THREADS)
        .min(units.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    // (unit index, its cubin or NVRTC's error)
    let done: Mutex<Vec<(usize, Compiled)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&i) = order.get(n) else { break };
                let u = &units[i];
                let bin = compile(&u.label, &u.src, &u.options);
                done.lock().push((i, bin));
            });
        }
    });
    let mut done = done.into_inner();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, bin)| bin).collect()
}

/// A module to compile: its name in logs (`quant-qt4` for a per-type one), full source, NVRTC
/// options, cache file name and path.
struct Unit {
    label: String,
    per_type: bool,
    src: String,
    options: Vec<String>,
    file: String,
    path: Option<PathBuf>,
}

impl Drop for Modules {
    fn drop(&mut self) {
        for (_, m) in self.loaded.lock().drain() {
            // SAFETY: loaded by `load_cubin`, unloaded once; the owner bound its context.
            let _ = unsafe { result::module::unload(m.0) };
        }
    }
}

fn load_cubin(bin: &[u8]) -> Result<Module, String> {
    // SAFETY: `bin` is a complete cubin image (from NVRTC or our cache; a corrupt file is
    // rejected by the driver with an error).
    unsafe { result::module::load_data(bin.as_ptr().cast()) }
        .map(Module)
        .map_err(|e| format!("loading a kernel module failed: {e:?}"))
}

/// Compiles one module to a cubin with NVRTC.
fn compile(name: &str, src: &str, options: &[String]) -> Result<Vec<u8>, String> {
    crate::probe::nvrtc()?;
    crate::probe::guarded("compiling CUDA kernels", || {
        let csrc = CString::new(src).map_err(|e| e.to_string())?;
        let cname = CString::new(format!("{name}.cu")).map_err(|e| e.to_string())?;
        let prog = nvres::create_program(&csrc, Some(&cname))
            .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
        // SAFETY: `prog` is live until destroyed below.
        let out = unsafe {
            match nvres::compile_program(prog, options) {
                Ok(()) => cubin(prog),
                Err(e) => {
                    let log = nvres::get_program_log(prog)
                        .map(|l| c_chars_to_string(&l))
                        .unwrap_or_default();
                    Err(format!(
                        "NVRTC could not compile kernel module `{name}` ({e:?}):\n{log}"
                    ))
                }
            }
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { nvres::destroy_program(prog) };
        out
    })
}

/// # Safety
/// `prog` is a successfully compiled, live program.
unsafe fn cubin(prog: nvsys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    nvsys::nvrtcGetCUBINSize(prog, &mut size)
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    let mut buf = vec![0u8; size];
    nvsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast::<c_char>())
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(buf)
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c.to_ne_bytes()[0]) // c_char is i8 or u8, by target
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("lowsync").join("cuda"))
}

/// Writes the cache file atomically (temp file + rename); errors are ignored.
fn store(path: &PathBuf, bin: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bin).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// FNV-1a over several byte strings: a stable cache key (std's hasher is not stable).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_names_a_module_and_symbol_that_exist() {
        for k in Kernel::all() {
            let (name, _) = k.module();
            let (_, src) = MODULES
                .iter()
                .find(|(n, _)| *n == name)
                .expect("module exists");
            let call = format!(" {}(", k.symbol());
            assert!(
                src.lines()
                    .any(|l| l.contains("__global__ void") && l.contains(&call)),
                "a __global__ kernel `{}` in {name}",
                k.symbol(),
            );
        }
    }

    #[test]
    fn per_type_and_parted_modules_are_asked_for_in_every_build_and_others_whole() {
        let modules = Modules::new(9, 0, 0);
        let ids = Kernel::module_ids();
        for (name, _) in MODULES {
            let builds: Vec<Variant> = ids
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| *v)
                .collect();
            let parts = PARTS.iter().find(|(n, _)| n == name).map(|(_, p)| *p);
            let want: Vec<Variant> = if PER_BLOCK_TYPE.contains(name) {
                BLOCK_TYPES.map(Variant::BlockType).to_vec()
            } else if let Some(n) = parts {
                (1..=n).map(Variant::Part).collect()
            } else {
                vec![Variant::Whole]
            };
            assert_eq!(builds, want, "{name}");
        }
        // A build's unit names it in the options and the cache file; the builds' keys differ,
        // and a module asked for the wrong way is an error, not a panic.
        let q4_0 = modules.unit(("quant", Variant::BlockType(4))).unwrap();
        let q8_0 = modules.unit(("quant", Variant::BlockType(8))).unwrap();
        assert_eq!(q4_0.options, ["--gpu-architecture=sm_90", "-DLOWSYNC_QT=4"]);
        assert!(q4_0.file.starts_with("quant-qt4-sm_90-"), "{}", q4_0.file);
        assert_ne!(q4_0.file, q8_0.file.replace("qt8", "qt4"));
        let part = modules.unit(("fused_gemv", Variant::Part(3))).unwrap();
        assert_eq!(
            part.options,
            ["--gpu-architecture=sm_90", "-DLOWSYNC_PART=3"]
        );
        assert!(
            part.file.starts_with("fused_gemv-part3-sm_90-"),
            "{}",
            part.file
        );
        let plain = modules.unit(("norm", Variant::Whole)).unwrap();
        assert_eq!(plain.options, ["--gpu-architecture=sm_90"]);
        assert!(plain.file.starts_with("norm-sm_90-"), "{}", plain.file);
        for bad in [
            ("quant", Variant::Whole),
            ("norm", Variant::BlockType(4)),
            ("norm", Variant::Part(1)),
            ("fused_gemv", Variant::Whole),
            ("fused_gemv", Variant::Part(0)),
            ("fused_gemv", Variant::Part(7)),
            ("nope", Variant::Whole),
        ] {
            assert!(modules.unit(bad).is_err(), "{bad:?}");
        }
    }

    /// Kernel source variants (`CudaConfig::kdefs`) reach every module as `-DLS_KDEF_<name>`
    /// after the build's own options, and give each build a cache file of its own.
    #[test]
    fn kernel_source_variants_build_every_module_under_names_of_its_own() {
        let plain = Modules::new(9, 0, 0);
        let kd = Modules::new(9, 0, 0).with_kdefs(&["QLD_NC".to_string(), "B2".to_string()]);
        let q = ("quant", Variant::BlockType(8));
        assert_eq!(
            kd.unit(q).unwrap().options,
            [
                "--gpu-architecture=sm_90",
                "-DLOWSYNC_QT=8",
                "-DLS_KDEF_QLD_NC",
                "-DLS_KDEF_B2"
            ]
        );
        for id in Kernel::module_ids() {
            let (a, b) = (plain.unit(id).unwrap(), kd.unit(id).unwrap());
            assert_eq!(b.options[..a.options.len()], a.options[..], "{id:?}");
            assert_ne!(a.file, b.file, "{id:?}");
            assert_eq!(a.label, b.label, "{id:?}");
        }
    }

    /// `preload`'s compile step compiles nothing that this process already holds, and a
    /// module it cannot compile is an error naming why, never a panic (here: no libnvrtc, or
    /// NVRTC refusing an architecture that does not exist). `sm_01` keeps these entries apart
    /// from any real device's.
    #[test]
    fn compile_missing_skips_held_modules_and_reports_what_it_cannot_compile() {
        let held = Modules::new(0, 1, 0);
        let ids = Kernel::module_ids();
        for &id in &ids {
            let u = held.unit(id).unwrap();
            CUBINS.lock().insert(u.file, Arc::new(vec![0u8; 4]));
        }
        assert_eq!(held.compile_missing(), Ok(()));
        let last = *ids.last().unwrap();
        let file = held.unit(last).unwrap().file;
        CUBINS.lock().remove(&file);
        let err = held.compile_missing().unwrap_err();
        assert!(
            err.contains("libnvrtc") || err.contains("NVRTC could not compile"),
            "{err}"
        );
        for id in ids {
            CUBINS.lock().remove(&held.unit(id).unwrap().file);
        }
    }

    /// The part `Kernel::module` names for a kernel is the `#if LS_PART(n)` its definition sits
    /// in, and a parted module defines no kernel outside its parts (it would be in every part).
    #[test]
    fn each_parted_kernel_sits_in_the_part_it_is_asked_for_from() {
        for (name, _) in PARTS {
            let src = MODULES.iter().find(|(n, _)| n == name).unwrap().1;
            let mut part: Option<u8> = None;
            let mut found = HashMap::new();
            for line in src.lines() {
                if let Some(n) = line.strip_prefix("#if LS_PART(") {
                    part = Some(n.trim_end_matches(')').parse().unwrap());
                } else if line == "#endif" {
                    part = None;
                } else if line.starts_with("extern \"C\" __global__ void") {
                    let sym = line
                        .split('(')
                        .find_map(|w| w.rsplit(' ').next().filter(|s| !s.starts_with("__")))
                        .unwrap();
                    let p = part.unwrap_or_else(|| panic!("{name}: `{sym}` outside any part"));
                    found.insert(sym.to_string(), p);
                }
            }
            for k in Kernel::all().filter(|k| k.module().0 == *name) {
                let Variant::Part(p) = k.module().1 else {
                    panic!("{k:?}: a parted module's kernel without a part")
                };
                assert_eq!(found.get(k.symbol()), Some(&p), "{k:?}");
            }
        }
    }

    /// Compiles every module for sm_90 where libnvrtc is installed (the GPU machine; here with
    /// the `nvidia-cuda-nvrtc` wheel on LD_LIBRARY_PATH), so a CUDA C error shows up as a
    /// failing unit test with NVRTC's log instead of at a backend's first open. Ignored
    /// (reported as skipped, with the reason) unless asked for; asked for without libnvrtc, it
    /// fails. The per-type modules compile once per block type, as `preload` compiles them.
    #[test]
    #[ignore = "needs libnvrtc (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
    fn every_module_compiles_with_nvrtc_where_it_is_installed() {
        if let Err(why) = crate::probe::nvrtc() {
            panic!("the NVRTC compile test needs libnvrtc, and it does not load here: {why}");
        }
        let modules = Modules::new(9, 0, 0);
        let ids = Kernel::module_ids();
        let units: Vec<Unit> = ids
            .into_iter()
            .map(|id| modules.unit(id).unwrap())
            .collect();
        let start = std::time::Instant::now();
        let bins = compile_all(&units);
        eprintln!(
            "{} modules compiled in {:.1} s",
            units.len(),
            start.elapsed().as_secs_f64()
        );
        assert_eq!(bins.len(), units.len());
        for (u, bin) in units.iter().zip(bins) {
            let bin = bin.unwrap_or_else(|e| panic!("{e}"));
            assert!(!bin.is_empty(), "{}: empty cubin", u.label);
        }
    }

    #[test]
    fn typed_entry_points_take_one_type_or_q4_k_beside_q6_k() {
        let (q4_0, q4_1, q8_0, q4_k, q6_k, q5_k) = (4, 5, 8, 11, 13, 12);
        for which in [TypedQ::NoQ4K, TypedQ::All] {
            assert_eq!(
                Kernel::typed_q(&[q4_0, q4_0, q4_0], which, false),
                Some(Kernel::FusedGemv1Q40)
            );
            assert_eq!(
                Kernel::typed_q(&[q8_0], which, false),
                Some(Kernel::FusedGemv1Q80)
            );
            assert_eq!(
                Kernel::typed_q(&[q4_1, q4_1], which, false),
                Some(Kernel::FusedGemv1Q41)
            );
            assert_eq!(
                Kernel::typed_q(&[q6_k, q6_k], which, false),
                Some(Kernel::FusedGemv1Q6K)
            );
            assert_eq!(Kernel::typed_q(&[q5_k], which, false), None);
            assert_eq!(Kernel::typed_q(&[q4_k, q5_k], which, false), None);
            assert_eq!(Kernel::typed_q(&[q4_0, q8_0], which, false), None);
            assert_eq!(Kernel::typed_q(&[], which, false), None);
        }
        // Q4_K's kernels only where every typed kernel is asked for.
        assert_eq!(
            Kernel::typed_q(&[q4_k, q4_k, q6_k], TypedQ::All, false),
            Some(Kernel::FusedGemv1Q4KQ6K)
        );
        assert_eq!(
            Kernel::typed_q(&[q4_k], TypedQ::All, false),
            Some(Kernel::FusedGemv1Q4K)
        );
        assert_eq!(
            Kernel::typed_q(&[q4_k, q4_k, q6_k], TypedQ::NoQ4K, false),
            None
        );
        assert_eq!(Kernel::typed_q(&[q4_k], TypedQ::NoQ4K, false), None);
        for types in [&[q4_0][..], &[q8_0], &[q6_k], &[q4_k], &[q4_k, q6_k]] {
            assert_eq!(
                Kernel::typed_q(types, TypedQ::Off, false),
                None,
                "{types:?}"
            );
            assert_eq!(Kernel::typed_q(types, TypedQ::Off, true), None, "{types:?}");
        }
        // On q8 records: the `_q8` entry points, type for type.
        let pairs = Kernel::TYPED_Q.iter().zip(Kernel::TYPED_Q8);
        for (&(code, k16), (code8, k8)) in pairs {
            assert_eq!(code, code8);
            assert_eq!(
                Kernel::typed_q(&[code.into()], TypedQ::All, false),
                Some(k16)
            );
            assert_eq!(Kernel::typed_q(&[code.into()], TypedQ::All, true), Some(k8));
            assert_eq!(k8.symbol(), format!("{}_q8", k16.symbol()));
        }
        assert_eq!(
            Kernel::typed_q(&[q4_k, q6_k], TypedQ::All, true),
            Some(Kernel::FusedGemv1Q4KQ6KQ8)
        );
        assert_eq!(Kernel::typed_q(&[q4_k], TypedQ::NoQ4K, true), None);
    }

    #[test]
    fn cache_keys_are_stable_and_separate_parts() {
        // FNV-1a-64 of "ab\xffc\xff" (each part ends with 0xff), computed outside this code:
        // the cache key of a kernel must not change between builds.
        assert_eq!(fnv1a(&[b"ab", b"c"]), 0x20ba_9b30_25a8_b421);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
