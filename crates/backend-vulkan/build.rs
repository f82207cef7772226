//! Compiles the WGSL compute shaders in `shaders/` to SPIR-V with naga (pure Rust, no system
//! shader compiler), one module per dtype variant.
//!
//! Why: a fresh machine must build the wheel with `pip install .` alone, so no `glslc` may be
//! assumed. WGSL has no preprocessor and naga resolves no specialisation constants for us, so
//! this script is the preprocessor: each kernel template (`shaders/<kernel>.wgsl`) names its
//! storage bindings as slots (`d`, `a`, `b`, ...) and uses accessors (`ld_a(i) -> f32`,
//! `ld4_a(i) -> vec4<f32>` for 4 consecutive elements, `i` even for 16-bit storage,
//! `st_d(i, v)`, `ldi_ids(i) -> i32`, `q_scale`/`q_vals` for GGUF blocks; each
//! `// #include <file>` line pulls in a shared part, recursively); for every dtype combination
//! listed in [`KERNELS`] the script prepends the binding declarations and accessors for those
//! dtypes plus `shaders/common.wgsl`, validates the module with naga, and writes the SPIR-V
//! words. A block type's layout is written once, in its family's file (`shaders/quant_*.wgsl`),
//! which every kernel reading that type includes.
//!
//! Invariants: 16-bit storage (f16, bf16) is read and written as packed `u32` words, so no
//! device feature beyond core Vulkan is needed; 16-bit stores use atomics on the word so two
//! threads writing the two halves never lose an update. Binding `k` of a module is slot `k` of
//! its list, which is the order `src/ops.rs` binds tensors in.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy)]
enum Slot {
    /// A float tensor read through `ld_<name>(i) -> f32`.
    In,
    /// A float tensor read 16 bytes at a time through `ld8_<name>(i) -> mat2x4<f32>`: the 8
    /// consecutive elements from `i` (a multiple of 8; the binding starts on 16 bytes), one
    /// 16-byte load for 16-bit types, two for f32; f32 also has `ld4_<name>(i)` (`i` a
    /// multiple of 4, one load) and `ld_<name>(i)`.
    Vec,
    /// A float tensor written through `st_<name>(i, v)`.
    Out,
    /// An i32 tensor read through `ldi_<name>(i) -> i32`.
    Int,
    /// An i32 tensor written through `sti_<name>(i, v)`.
    IntOut,
    /// 32-bit words read raw (`ldr_<name>`), for exact i32/f32 copies.
    Raw,
    /// 32-bit words written raw (`str_<name>`).
    RawOut,
    /// The error-status words (`array<atomic<u32>>`) of index-checking kernels.
    Status,
    /// f32 words that several workgroups of one dispatch write and read (`array<atomic<u32>>`,
    /// so every access goes to device-coherent memory, never a stale cache line):
    /// `ldc_<name>(i) -> f32`, `stc_<name>(i, v)`, and `<name>_buf` itself for tickets.
    Shared,
    /// Raw GGUF blocks read as bytes out of `u32` words (at most one such slot per kernel, so
    /// its accessors are named for the block, not the slot): constants `QK` (elements per
    /// block), `QB` (bytes per block), `GPB` (16-element groups per block), `Q_MIN` (the type
    /// has a min), and `q_scale(blk, g)` / `q_vals(blk, g)` of group `g` of the block at byte
    /// `blk`, and `q_sub(blk, j)`, its 32-element piece j (contract in
    /// `shaders/quant_common.wgsl`).
    Quant,
    /// A second block binding, `u_buf`, of the `Quant` slot's type (a kernel reading two
    /// weights, such as the gate and up halves of SwiGLU): the same readers, each named with
    /// `_u` appended (`q_quarter_u`); only variants where both slots have one type are built.
    Quant2,
}

const FLOATS: &[&str] = &["f32", "f16", "bf16"];
/// Block types with Vulkan kernels (`src/backend.rs::VK_QUANTS` lists the same).
const QUANTS: &[&str] = &[
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
    "iq4_xs",
];

/// The 32-element block types: their 32-element reader is the whole block (`T_b32`), a
/// super-block type's is sub-block j (`T_s32`); build.rs binds either to `q_sub`.
const QUANTS_32: &[&str] = &["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"];

/// The block types of the integer-dot decode products (`mul_mat_vec_qd*`): their reader
/// `T_qd` is bound to `q_qd`.
const QUANTS_QD: &[&str] = &["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"];

/// The split decode attentions' bindings: `attn_dec`'s, then the partials and tickets.
const ATTN_SPLIT_SLOTS: &[(&str, Slot, &[&str])] = &[
    ("d", Slot::Out, FLOATS),
    ("a", Slot::In, &["f32"]),
    ("k", Slot::In, FLOATS),
    ("v", Slot::In, FLOATS),
    ("m", Slot::In, &["f32"]),
    ("p", Slot::Shared, &["f32"]),
];

/// `attn_split`'s bindings with K and V read 16 bytes at a time (`attn_split_v`).
const ATTN_SPLIT_V_SLOTS: &[(&str, Slot, &[&str])] = &[
    ("d", Slot::Out, FLOATS),
    ("a", Slot::In, &["f32"]),
    ("k", Slot::Vec, FLOATS),
    ("v", Slot::Vec, FLOATS),
    ("m", Slot::In, &["f32"]),
    ("p", Slot::Shared, &["f32"]),
];

/// (kernel template, slots: name, kind, dtypes to generate).
type Spec = (
    &'static str,
    &'static [(&'static str, Slot, &'static [&'static str])],
);

const KERNELS: &[Spec] = &[
    (
        "eltwise",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "copy_raw",
        &[("d", Slot::RawOut, &["u32"]), ("a", Slot::Raw, &["u32"])],
    ),
    (
        "rms_norm",
        &[("d", Slot::Out, FLOATS), ("a", Slot::In, FLOATS)],
    ),
    (
        "rms_norm_mul",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("w", Slot::In, FLOATS),
        ],
    ),
    // One invocation per row (`LOWSYNC_VK_ROW_LANES`).
    (
        "rms_norm_t",
        &[("d", Slot::Out, FLOATS), ("a", Slot::In, FLOATS)],
    ),
    (
        "rms_norm_mul_t",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("w", Slot::In, FLOATS),
        ],
    ),
    (
        "soft_max",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("m", Slot::In, FLOATS),
        ],
    ),
    // One invocation per row (`LOWSYNC_VK_ROW_LANES`).
    (
        "soft_max_t",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("m", Slot::In, FLOATS),
        ],
    ),
    (
        "attn_dec",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("k", Slot::In, FLOATS),
            ("v", Slot::In, FLOATS),
            ("m", Slot::In, &["f32"]),
        ],
    ),
    // `attn_dec` split over keys: chunks' partial softmaxes, merged by a head's last chunk.
    ("attn_split", ATTN_SPLIT_SLOTS),
    // `attn_split` with the query heads of one KV head in one workgroup.
    ("attn_split_g", ATTN_SPLIT_SLOTS),
    // `attn_split` with 16-byte K and V loads and a round of several keys a thread.
    ("attn_split_v", ATTN_SPLIT_V_SLOTS),
    (
        "rope",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("pos", Slot::Int, &["i32"]),
        ],
    ),
    (
        "rope_f32",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("pos", Slot::Int, &["i32"]),
        ],
    ),
    // `Rope -> SetRows` of one token: the rotated K row written into its KV-cache row.
    (
        "rope_set_rows",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("pos", Slot::Int, &["i32"]),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "rope_set_rows_f32",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("pos", Slot::Int, &["i32"]),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "argmax",
        &[("d", Slot::IntOut, &["i32"]), ("a", Slot::In, FLOATS)],
    ),
    (
        "get_rows",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "set_rows",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat8",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    // The sum of a split-k product's partials.
    (
        "split_sum",
        &[("d", Slot::Out, &["f32"]), ("a", Slot::In, &["f32"])],
    ),
    (
        "mul_mat_vec",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_k",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_v",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_v_g",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("u", Slot::Vec, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_k_wg",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_q",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_qv",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_qb",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_qw",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_32),
        ],
    ),
    (
        "mul_mat_vec_qd",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_QD),
        ],
    ),
    (
        "mul_mat_vec_qd_g",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_QD),
            ("u", Slot::Quant2, QUANTS_QD),
        ],
    ),
    // The gate and up products with SwiGLU in one dispatch (b the gate weight, u the up).
    (
        "mul_mat_vec_qw_g",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_32),
            ("u", Slot::Quant2, QUANTS_32),
        ],
    ),
    (
        "mul_mat_vec_q_wg",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_qm",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_qm_wg",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    // The product over block weights for prefill (`mul_mat_q_body.wgsl`): each weight group
    // decoded once per 32 rows of x; `_s` shares x through the subgroup.
    (
        "mul_mat_q",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    // The float prefill product with one invocation per column, x shared through the subgroup
    // (`mul_mat_s.wgsl`, `LOWSYNC_VK_ROW_LANES`).
    (
        "mul_mat_s",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_s1",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_q_s",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    // The prefill products on cooperative matrices (`mul_mat_cm_body.wgsl`,
    // `LOWSYNC_VK_COOPMAT`).
    (
        "mul_mat_cm",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_qcm",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_qt",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    (
        "mul_mat_qt8",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
        ],
    ),
    // The decode mat-vecs with an element-wise op in their store (`mul_mat_vec_out_e.wgsl`):
    // f32 activations, results and epilogue operands only, as the fusion takes them.
    (
        "mul_mat_vec_k_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_k_wg_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_v_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_q_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_qv_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_qb_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_qd_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_QD),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_qw_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_32),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_q_wg_e",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("e", Slot::In, &["f32"]),
        ],
    ),
    // The decode mat-vecs storing into a KV-cache row of any float dtype
    // (`mul_mat_vec_out_r.wgsl`).
    (
        "mul_mat_vec_k_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_k_wg_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_v_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_q_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_qv_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_qb_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_qd_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_QD),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_qw_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Quant, QUANTS_32),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_vec_q_wg_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "get_rows_q",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_id",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("w", Slot::In, FLOATS),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "penalize",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("hist", Slot::Int, &["i32"]),
            ("par", Slot::In, &["f32"]),
        ],
    ),
    (
        "sample",
        &[
            ("d", Slot::IntOut, &["i32"]),
            ("a", Slot::In, &["f32"]),
            ("par", Slot::In, &["f32"]),
            ("key", Slot::Int, &["i32"]),
        ],
    ),
    // The decode products reading x through the RmsNorm that feeds them
    // (`mul_mat_vec_x_norm.wgsl`): binding n is the norm's weight.
    (
        "mul_mat_vec_vn",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("n", Slot::Vec, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_vn_r",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
            ("n", Slot::Vec, &["f32"]),
        ],
    ),
    (
        "mul_mat_vec_vn_g",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::Vec, &["f32"]),
            ("b", Slot::Vec, FLOATS),
            ("u", Slot::Vec, FLOATS),
            ("n", Slot::Vec, &["f32"]),
        ],
    ),
];

fn main() {
    // Read at run time: a build-script binary cached in a shared target dir may have been
    // compiled for a clone at another path.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("shaders");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", dir.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let common = read(&dir.join("common.wgsl"));
    let mut table = String::from("/// (variant name, SPIR-V bytes) of every compiled kernel.\n");
    table.push_str("pub(crate) static SPIRV: &[(&str, &[u8])] = &[\n");
    let mut failures = Vec::new();
    for (kernel, slots) in KERNELS {
        let quant_slots = slots
            .iter()
            .filter(|(_, kind, _)| matches!(kind, Slot::Quant))
            .count();
        assert!(quant_slots <= 1, "{kernel}: more than one block-dtype slot");
        let body = includes(&dir, &read(&dir.join(format!("{kernel}.wgsl"))));
        let (enables, rest): (Vec<&str>, Vec<&str>) =
            body.lines().partition(|l| l.starts_with("enable "));
        let enables: String = enables.iter().map(|l| format!("{l}\n")).collect();
        let rest: String = rest.iter().map(|l| format!("{l}\n")).collect();
        println!(
            "cargo:rerun-if-changed={}",
            dir.join(format!("{kernel}.wgsl")).display()
        );
        for combo in combinations(slots) {
            if !one_weight_type(slots, &combo) {
                continue;
            }
            let name = variant_name(kernel, slots, &combo);
            // WGSL's `enable` directives open the module: the kernel's, then everything else.
            let mut src: String = enables.clone();
            for (k, ((slot, kind, _), dt)) in slots.iter().zip(&combo).enumerate() {
                src.push_str(&binding(&dir, k, slot, *kind, dt));
            }
            if quant_slots == 1 {
                src.push_str(scale_conversion(kernel));
            }
            src.push_str(&common);
            src.push_str(&rest);
            match compile(&src) {
                Ok(words) => {
                    let file = out.join(format!("{name}.spv"));
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    std::fs::write(&file, bytes).expect("write spv");
                    let _ = writeln!(
                        table,
                        "    ({name:?}, include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{name}.spv\"))),"
                    );
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
    }
    table.push_str("];\n");
    if !failures.is_empty() {
        panic!("shader compilation failed:\n{}", failures.join("\n"));
    }
    std::fs::write(out.join("shaders.rs"), table).expect("write shaders.rs");
}

/// Replaces each `// #include <file>` line of a template by that file of `shaders/`, itself
/// expanded (a kernel's body includes its shared head; an include cycle is a build error).
fn includes(dir: &Path, body: &str) -> String {
    expand(dir, body, 0)
}

fn expand(dir: &Path, body: &str, depth: usize) -> String {
    assert!(depth < 8, "`// #include` nested deeper than 8 (a cycle?)");
    let mut out = String::new();
    for line in body.lines() {
        match line.trim().strip_prefix("// #include ") {
            Some(file) => {
                let path = dir.join(file.trim());
                println!("cargo:rerun-if-changed={}", path.display());
                out.push_str(&expand(dir, &read(&path), depth + 1));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn combinations(slots: &[(&str, Slot, &[&'static str])]) -> Vec<Vec<&'static str>> {
    let mut out: Vec<Vec<&'static str>> = vec![Vec::new()];
    for (_, _, dts) in slots {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                dts.iter().map(move |d| {
                    let mut v = prefix.clone();
                    v.push(*d);
                    v
                })
            })
            .collect();
    }
    out
}

/// `kernel.slot_dtype.slot_dtype...`, the key `src/pipelines.rs` looks variants up by.
fn variant_name(kernel: &str, slots: &[(&str, Slot, &[&str])], combo: &[&str]) -> String {
    let mut s = kernel.to_string();
    for ((slot, _, _), dt) in slots.iter().zip(combo) {
        let _ = write!(s, ".{slot}_{dt}");
    }
    s
}

/// The declaration of binding `k` and its accessors.
fn binding(dir: &Path, k: usize, n: &str, kind: Slot, dt: &str) -> String {
    let decl = |access: &str, elem: &str| {
        format!("@group(0) @binding({k}) var<storage, {access}> {n}_buf: array<{elem}>;\n")
    };
    match (kind, dt) {
        (Slot::Vec, "f32") => {
            decl("read", "vec4<f32>")
                + &format!(
                    "fn ld8_{n}(i: u32) -> mat2x4<f32> {{ let v = i >> 2u; return mat2x4<f32>({n}_buf[v], {n}_buf[v + 1u]); }}\n"
                )
                + &format!("fn ld4_{n}(i: u32) -> vec4<f32> {{ return {n}_buf[i >> 2u]; }}\n")
                + &format!("fn ld_{n}(i: u32) -> f32 {{ return {n}_buf[i >> 2u][i & 3u]; }}\n")
        }
        (Slot::Vec, "f16") => {
            decl("read", "vec4<u32>")
                + &format!(
                    "fn ld8_{n}(i: u32) -> mat2x4<f32> {{ let w = {n}_buf[i >> 3u]; return mat2x4<f32>(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)), vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w))); }}\n"
                )
        }
        (Slot::Vec, "bf16") => {
            decl("read", "vec4<u32>")
                + &format!(
                    "fn ld8_{n}(i: u32) -> mat2x4<f32> {{ let w = {n}_buf[i >> 3u]; return mat2x4<f32>(bitcast<vec4<f32>>(vec4<u32>(w.x << 16u, w.x & 0xffff0000u, w.y << 16u, w.y & 0xffff0000u)), bitcast<vec4<f32>>(vec4<u32>(w.z << 16u, w.z & 0xffff0000u, w.w << 16u, w.w & 0xffff0000u))); }}\n"
                )
        }
        (Slot::In, "f32") => {
            decl("read", "f32")
                + &format!("fn ld_{n}(i: u32) -> f32 {{ return {n}_buf[i]; }}\n")
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ return vec4<f32>({n}_buf[i], {n}_buf[i + 1u], {n}_buf[i + 2u], {n}_buf[i + 3u]); }}\n"
                )
        }
        (Slot::In, "f16") => {
            decl("read", "u32")
                + &format!(
                    "fn ld_{n}(i: u32) -> f32 {{ return f16_bits_to_f32({n}_buf[i >> 1u] >> ((i & 1u) * 16u)); }}\n"
                )
                // `i` even: two whole words; f16 -> f32 is exact, so this equals `ld_` x4.
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ let w = i >> 1u; return vec4<f32>(unpack2x16float({n}_buf[w]), unpack2x16float({n}_buf[w + 1u])); }}\n"
                )
        }
        (Slot::In, "bf16") => {
            decl("read", "u32")
                + &format!(
                    "fn ld_{n}(i: u32) -> f32 {{ return bitcast<f32>((({n}_buf[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu) << 16u); }}\n"
                )
                // `i` even: two whole words.
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ let w0 = {n}_buf[i >> 1u]; let w1 = {n}_buf[(i >> 1u) + 1u]; return bitcast<vec4<f32>>(vec4<u32>(w0 << 16u, w0 & 0xffff0000u, w1 << 16u, w1 & 0xffff0000u)); }}\n"
                )
        }
        (Slot::Out, "f32") => decl("read_write", "f32")
            + &format!("fn st_{n}(i: u32, v: f32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Out, half) => {
            let conv = if half == "f16" {
                "f32_to_f16_bits"
            } else {
                "f32_to_bf16_bits"
            };
            decl("read_write", "atomic<u32>")
                + &format!(
                    "fn st_{n}(i: u32, v: f32) {{\n\
                     \x20   let sh = (i & 1u) * 16u;\n\
                     \x20   atomicAnd(&{n}_buf[i >> 1u], ~(0xffffu << sh));\n\
                     \x20   atomicOr(&{n}_buf[i >> 1u], {conv}(v) << sh);\n\
                     }}\n"
                )
        }
        (Slot::Int, _) => decl("read", "i32")
            + &format!("fn ldi_{n}(i: u32) -> i32 {{ return {n}_buf[i]; }}\n"),
        (Slot::IntOut, _) => decl("read_write", "i32")
            + &format!("fn sti_{n}(i: u32, v: i32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Raw, _) => decl("read", "u32")
            + &format!("fn ldr_{n}(i: u32) -> u32 {{ return {n}_buf[i]; }}\n"),
        (Slot::RawOut, _) => decl("read_write", "u32")
            + &format!("fn str_{n}(i: u32, v: u32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Shared, _) => {
            decl("read_write", "atomic<u32>")
                + &format!(
                    "fn ldc_{n}(i: u32) -> f32 {{ return bitcast<f32>(atomicLoad(&{n}_buf[i])); }}\n\
                     fn stc_{n}(i: u32, v: f32) {{ atomicStore(&{n}_buf[i], bitcast<u32>(v)); }}\n"
                )
        }
        (Slot::Status, _) => {
            decl("read_write", "atomic<u32>")
                + "// Records the first index error of a submit: [count, tag, position, value].\n\
                   fn report_bad_index(tag: u32, pos: u32, value: i32) {\n\
                   \x20   let old = atomicAdd(&status_buf[0], 1u);\n\
                   \x20   if old == 0u {\n\
                   \x20       atomicStore(&status_buf[1], tag);\n\
                   \x20       atomicStore(&status_buf[2], pos);\n\
                   \x20       atomicStore(&status_buf[3], bitcast<u32>(value));\n\
                   \x20   }\n\
                   }\n"
        }
        (Slot::Quant, q) => {
            format!("@group(0) @binding({k}) var<storage, read> q_buf: array<u32>;\n") + &quant(dir, q)
        }
        (Slot::Quant2, q) => {
            format!("@group(0) @binding({k}) var<storage, read> u_buf: array<u32>;\n")
                + &second_reader(&quant(dir, q))
        }
        (Slot::In, other) => panic!("unknown input dtype {other}"),
        (Slot::Vec, other) => panic!("unknown vector input dtype {other}"),
    }
}

/// The accessors of the block-dtype binding `q_buf` (see [`Slot::Quant`]): the block
/// reading helpers, the type's family file (where its layout is written, once) and the
/// aliases that pick the type's pair out of the family.
fn quant(dir: &Path, q: &str) -> String {
    let (family, has_min) = match q {
        "q4_0" | "q5_0" | "q8_0" => ("quant_32", false),
        "q4_1" | "q5_1" => ("quant_32", true),
        "q3_k" | "q6_k" => ("quant_k", false),
        "q2_k" | "q4_k" | "q5_k" => ("quant_k", true),
        "iq4_nl" | "iq4_xs" => ("quant_iq4", false),
        other => panic!("unknown block dtype {other}"),
    };
    let (qk, qb) = block_facts(q);
    format!(
        "const QK: u32 = {qk}u;\n\
         const QB: u32 = {qb}u;\n\
         const GPB: u32 = {gpb}u;\n\
         const Q_MIN: bool = {has_min};\n\
         {common}\n\
         {family}\n\
         fn q_scale(blk: u32, g: u32) -> vec2<f32> {{ return {q}_qs(blk, g); }}\n\
         fn q_vals(blk: u32, g: u32) -> mat4x4<f32> {{ return {q}_qv(blk, g); }}\n\
         {whole}{qd}",
        gpb = qk / 16,
        whole = if QUANTS_32.contains(&q) {
            format!(
                "fn q_sub(blk: u32, j: u32) -> Sub32 {{ return {q}_b32(blk); }}\n\
                 fn q_quarter(blk: u32, j: u32) -> Quarter {{ return {q}_q8(blk, j); }}\n"
            )
        } else {
            format!("fn q_sub(blk: u32, j: u32) -> Sub32 {{ return {q}_s32(blk, j); }}\n")
        },
        qd = if QUANTS_QD.contains(&q) {
            format!(
                "const Q_SIGNED: bool = {};\n\
                 fn q_qd(blk: u32, j: u32) -> QdPiece {{ return {q}_qd(blk, j); }}\n",
                matches!(q, "q8_0" | "q6_k")
            )
        } else {
            String::new()
        },
        common = read(&dir.join("quant_common.wgsl")),
        family = read(&dir.join(format!("{family}.wgsl"))),
    )
}

/// Whether a combination gives slot `u` (a kernel's second weight, if it has one) the dtype of
/// slot `b` (its first).
fn one_weight_type(slots: &[(&str, Slot, &[&str])], combo: &[&str]) -> bool {
    let of = |name: &str| slots.iter().zip(combo).find(|((n, _, _), _)| *n == name);
    match (of("b"), of("u")) {
        (Some((_, b)), Some((_, u))) => b == u,
        _ => true,
    }
}

/// The block readers of [`quant`] reading `u_buf` instead of `q_buf`: every function the text
/// defines renamed with `_u` appended (at every use too), its constants and structs left out
/// (the first copy declares them). WGSL cannot pass a storage binding to a function, so a
/// second binding needs its own copy of the readers; generating it keeps each layout written
/// once.
fn second_reader(text: &str) -> String {
    let mut kept = String::new();
    let mut in_struct = false;
    for line in text.lines() {
        if in_struct {
            in_struct = !line.starts_with('}');
            continue;
        }
        if line.starts_with("struct ") {
            in_struct = true;
            continue;
        }
        if !line.starts_with("const ") {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let names: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("fn "))
        .filter_map(|l| l.split('(').next())
        .map(str::trim)
        .collect();
    let mut out = String::with_capacity(kept.len() + 1024);
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word == "q_buf" {
            out.push_str("u_buf");
        } else {
            out.push_str(word);
            if names.contains(word.as_str()) {
                out.push_str("_u");
            }
        }
        word.clear();
    };
    for ch in kept.chars() {
        if ch.is_ascii_alphanumeric() || ch == '_' {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// `q_f16`, how a kernel's block readers turn an f16 scale into f32: one instruction
/// (`f16_bits_to_f32`, `unpack2x16float`), except in the prefill kernel `mul_mat_q`, whose 32
/// accumulators live across it and which lavapipe ran 45% slower that way ("tiny" Q4_0,
/// 64-token prompt: 428 against 294 ms); there the conversion written on bits
/// (`f16_on_bits`), which gives the same values. The H200 runs the prefill at the same speed
/// either way.
fn scale_conversion(kernel: &str) -> &'static str {
    if kernel == "mul_mat_q" || kernel == "mul_mat_q_s" {
        "fn q_f16(h: u32) -> f32 { return f16_on_bits(h); }\n"
    } else {
        "fn q_f16(h: u32) -> f32 { return f16_bits_to_f32(h); }\n"
    }
}

/// (elements, bytes) per block: GGUF's sizes, as `lowsync_graph::DType` states them.
fn block_facts(q: &str) -> (u32, u32) {
    match q {
        "q4_0" | "iq4_nl" => (32, 18),
        "q4_1" => (32, 20),
        "q5_0" => (32, 22),
        "q5_1" => (32, 24),
        "q8_0" => (32, 34),
        "q2_k" => (256, 84),
        "q3_k" => (256, 110),
        "q4_k" => (256, 144),
        "q5_k" => (256, 176),
        "q6_k" => (256, 210),
        "iq4_xs" => (256, 136),
        other => panic!("unknown block dtype {other}"),
    }
}

fn compile(src: &str) -> Result<Vec<u32>, String> {
    use naga::back::spv;
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = Validator::new(
        ValidationFlags::all(),
        // SUBGROUP: only `mul_mat_vec_k`, `mul_mat_vec_v`, `mul_mat_vec_q`, `mul_mat_vec_qv`,
        // `mul_mat_vec_qb`, `mul_mat_vec_qw`, `mul_mat_vec_qm` and their `_e`, `_r` and `_g`
        // flavours, and the decode attention (`attn_dec`, `attn_split`, `attn_split_g`,
        // `attn_split_v`), use subgroup operations, and the host picks them only on a device
        // whose compute stage has subgroup arithmetic; `mul_mat_q_s`, `mul_mat_s`,
        // `mul_mat_s1` and the integer-dot products `mul_mat_vec_qd*` only where it also has
        // shuffles (the last, too, only where the device enabled its integer dot product
        // feature: naga writes `dot4I8Packed` as OpSDot, SPV_KHR_integer_dot_product). SHADER_FLOAT16 and COOPERATIVE_MATRIX: only the cooperative-matrix products
        // (`mul_mat_cm`, `mul_mat_qcm`: f16 tiles), picked only where the device enabled
        // what their SPIR-V declares (`device::coopmat_support`). SHADER_FLOAT16_IN_FLOAT32 is
        // `unpack2x16float` (GLSL.std.450 UnpackHalf2x16, core SPIR-V for Vulkan).
        Capabilities::IMMEDIATES
            | Capabilities::FLOAT64
            | Capabilities::SUBGROUP
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | Capabilities::SHADER_FLOAT16
            | Capabilities::COOPERATIVE_MATRIX,
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(src))?;
    let options = spv::Options {
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        // Host code validates every extent before a dispatch; kernels index in bounds.
        bounds_check_policies: naga::proc::BoundsCheckPolicies::default(),
        force_loop_bounding: false,
        // f16 lives in workgroup memory and registers only, never in a shader's inputs or
        // outputs (a capability some GPUs lack).
        use_storage_input_output_16: false,
        emit_int_div_checks: false,
        // WGSL zero-fills workgroup memory; naga's default does it by one invocation storing
        // every workgroup variable in turn, then a barrier, at the start of every workgroup.
        // No kernel here reads workgroup memory it has not written in that dispatch (each
        // writes its reduction slots, tiles and atomics first, the atomics by an explicit
        // store before a barrier), so the fill is left out.
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        ..Default::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| format!("{e}"))
}
