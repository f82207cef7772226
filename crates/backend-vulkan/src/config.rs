//! The backend's settings: read once from the environment (ARCHITECTURE §8) by [`crate::create`],
//! or built directly by tests and embedders with [`VkConfig::from_env`] and struct updates.
//!
//! Why a struct: environment variables are process-global, so tests that must run both memory
//! paths side by side in one process cannot flip them; they build a `VkConfig` and call
//! [`crate::VulkanBackend::new`] instead. A bad value is an `Error::Env` naming the variable.
//! `VkConfig::default()` is the product's default: every switch off except `record` and `fusion`.

use std::ffi::{c_void, CStr};

use lowsync_backend::{env, Error, Result};

/// A hook over the device-level Vulkan entry points: given a command's name and the address
/// the loader handed out, returns the address the backend should call. Tests use it to count
/// driver calls (`vkQueueSubmit`, `vkWaitSemaphores`, ...) outside lowsync's own counters.
pub type EntryPointHook = fn(name: &CStr, real: *const c_void) -> *const c_void;

/// Settings of one Vulkan backend.
#[derive(Clone, Debug)]
pub struct VkConfig {
    /// Physical device index (`vulkan:N`; `LOWSYNC_VK_DEVICE` for plain `vulkan`).
    pub device_index: usize,
    /// `LOWSYNC_VK_VALIDATION=1`: enable `VK_LAYER_KHRONOS_validation` with synchronization
    /// validation and record its warnings and errors ([`crate::VulkanBackend::validation_messages`]).
    pub validation: bool,
    /// `LOWSYNC_VK_NO_HOST_VISIBLE_VRAM=1`: device buffers are never mapped; every host write
    /// and read goes through a staging copy (the path of a GPU without ReBAR).
    pub no_host_visible_vram: bool,
    /// `LOWSYNC_VK_LEGACY_SUBMITS=1`: ggml's behaviour for the `stock` rows: an empty submit and
    /// a fence wait at every synchronize, and a submit + fence wait per blocking copy.
    pub legacy_submits: bool,
    /// `LOWSYNC_VK_FORCE_TRANSFER_SUBMIT=1`: on a device without a dedicated transfer queue,
    /// copies above the crossover go as their own submissions with their own timeline semaphore.
    pub force_transfer_submit: bool,
    /// `LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX=<bytes>`: copies up to this size go in the compute
    /// stream, larger ones on the transfer route; `None` measures the crossover.
    pub compute_stream_copy_max: Option<u64>,
    /// `LOWSYNC_VK_NO_SUBGROUPS=1`: never use subgroup operations (the shared-memory kernels
    /// run instead, as on a device without subgroup arithmetic).
    pub no_subgroups: bool,
    /// `LOWSYNC_VK_RECORD` (default 1): a cached graph plan is recorded once into its own
    /// command buffer and replayed by every later step; 0 records its commands again into the
    /// stream on every step (the A/B switch).
    pub record: bool,
    /// `LOWSYNC_VK_PROFILE=1`: a timestamp is written after every dispatch of a graph (on a
    /// queue with timestamps), and the device time of each kernel variant is summed
    /// ([`lowsync_backend::Backend::kernel_times`]). Graphs are then recorded into the stream
    /// on every step, as with `record` off, so each submission owns its queries.
    pub profile: bool,
    /// `LOWSYNC_VK_FUSION` (default 1): chains the graph proves safe run as one kernel each
    /// (`crate::fusion`: a decode attention `MulMat(q, K) -> SoftMax -> MulMat(p, V) [-> Cpy]`,
    /// an `RmsNorm -> Mul` by its weight); 0 plans every node on its own (the A/B switch).
    pub fusion: bool,
    /// `LOWSYNC_VK_QV`: the body of the one-row decode mat-vec over block weights
    /// ([`QuantMatVec`]). `None` (the variable unset): chosen by the device, `group` on a
    /// CPU-type device (lavapipe runs `rows`' four times as many workgroups about ten times
    /// slower), `idot` on a GPU that accelerates 4x8-bit integer dot products (18% faster than
    /// `rows` on "1b" Q4_0 on an H100), `rows` on another GPU.
    pub quant_mat_vec: Option<QuantMatVec>,
    /// `LOWSYNC_VK_QD_ROWS` (1 to 1,024): rows of w per workgroup of the integer-dot products
    /// (`idot`), each workgroup quantizing x once for them. `None` (the variable unset): from
    /// the product's rows, 8 to 64 (the A/B switch for that choice).
    pub qd_rows: Option<u32>,
    /// `LOWSYNC_VK_QMM`: the prefill product over block weights ([`QuantMatMul`]). `None`
    /// (the variable unset): chosen by the device's type, `rows` on a CPU-type device, `tiles`
    /// on a GPU.
    pub quant_mat_mul: Option<QuantMatMul>,
    /// `LOWSYNC_VK_TILE` (`4`, `8`): outputs per invocation along each side of the tiled
    /// prefill products' 64x64 tiles (float weights, and block weights under `tiles`): 4 over
    /// 256 invocations (`mul_mat`, `mul_mat_qt`) or 8 over 64 (`mul_mat8`, `mul_mat_qt8`, which
    /// read a quarter as much workgroup memory per multiply-add and give the same bits).
    /// Default 4: 8 has not been timed on a GPU yet.
    pub tile: u32,
    /// `LOWSYNC_VK_SPLIT_K` (`0`, `auto`, `2` to `8`): the tiled prefill products split k over
    /// several workgroups per tile ([`SplitK`]). Default `0`: not yet timed on a GPU.
    pub split_k: SplitK,
    /// `LOWSYNC_VK_NORM_FOLD` (`0`, `1`): a fused RmsNorm whose every reader is a float
    /// one-row product runs inside those products (`mul_mat_vec_vn*`) instead of as a dispatch
    /// of its own. `None` (the variable unset): on a GPU (where the saved dispatch is a wait
    /// saved), off on a CPU-type device (where the products' extra arithmetic is the cost).
    pub norm_fold: Option<bool>,
    /// `LOWSYNC_VK_ATTN_SPLIT` (`0`, `1` or a chunk count `N`): the fused decode attention
    /// runs each query head's valid keys in up to this many workgroups (`attn_split`, the
    /// head's last chunk merging); `1` picks the default of 8 chunks; 0 keeps one workgroup per head
    /// (`attn_dec`). `None` (the variable unset): chosen by the device's type, 0 on a
    /// CPU-type device (lavapipe pays for every workgroup it starts, even an empty one), the
    /// default chunk count on a GPU (more workgroups than heads fill its multiprocessors).
    pub attn_split: Option<u32>,
    /// `LOWSYNC_VK_ATTN_GROUP` (`0`, `1`): the split decode attention takes the query heads of
    /// one KV head (2 to 4 of them, with the head dim times their count at most 256, and one
    /// mask row for all heads) in one workgroup (`attn_split_g`), so each K and V load serves
    /// them all; with the split off, one workgroup per KV head. `None` (the variable unset):
    /// on for a CPU-type device (lavapipe ran "tiny"'s attention in half the time), off on a
    /// GPU (not yet timed on one).
    pub attn_group: Option<bool>,
    /// `LOWSYNC_VK_ATTN_VEC` (`0`, `1`): the per-head decode attention reads K and V 16 bytes at
    /// a time, a thread's keys of a chunk in one round of loads (`attn_split_v`), where the
    /// head dim is a multiple of 8 and the cache rows start on 16 bytes; its chunks take at
    /// least 256 keys (unsplit below that), up to `LOWSYNC_VK_ATTN_SPLIT`'s count (one
    /// workgroup per head with the split off). The grouped kernel, where it is on and takes
    /// the shape, comes first. Default on: on the H200 ("1b" Q4_0, f16 cache) it took the
    /// attention from 16.1 to 11.7-12.5 µs a layer at depth 160 and from 18.6 to 15.1-17.6 at
    /// 480, and a token 5% less; on lavapipe, unsplit, 727-966 µs a call against `attn_dec`'s
    /// 804-1,351.
    pub attn_vec: bool,
    /// `LOWSYNC_VK_ROW_LANES` (`0`, `1`): SoftMax runs one invocation per row (`soft_max_t`)
    /// instead of a workgroup per row. `None` (the variable unset): on for a CPU-type device
    /// (lavapipe runs a workgroup's barriers as switches between its SIMD groups; a 64-token
    /// prompt's attention rows on "small" took a tenth of the time), off on a GPU (a row's
    /// elements walked by one thread).
    pub row_lanes: Option<bool>,
    /// `LOWSYNC_VK_COOPMAT` (`0`, `1`): the prefill products (more than 8 rows of x, float or
    /// block weights) run on cooperative matrices (`mul_mat_cm`, `mul_mat_qcm`: 64x64 tiles,
    /// x and w rounded to f16, f32 accumulation) where the device has them
    /// (`VK_KHR_cooperative_matrix`, 16x16x16 f16 with f32 accumulators, 32-lane subgroups);
    /// elsewhere it changes nothing. Off unless asked for: not yet run on a device that has
    /// them.
    pub coopmat: bool,
    /// Counting or tracing hook over device entry points (tests only).
    pub entry_point_hook: Option<EntryPointHook>,
}

/// How the one-row decode mat-vec over block weights splits a row of w among a subgroup's
/// lanes, where 16-byte loads of x and 256-invocation workgroups apply (elsewhere the group
/// body runs either way). Both run the residual-add, SwiGLU and KV-row stores the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMatVec {
    /// `group`: a 16-element group per lane (`mul_mat_vec_qv`).
    Group,
    /// `block`: 32 consecutive elements per lane, a whole block of Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0 or IQ4_NL or a 32-element sub-block of a super-block, its words loaded once,
    /// aligned (`mul_mat_vec_qb`).
    Block,
    /// `rows`: two rows of w per 128-invocation workgroup, each row spread over all of it, a
    /// lane taking 8 elements (a quarter) of a block at a time (`mul_mat_vec_qw`); the
    /// 32-element types only (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), the super-block types
    /// keep the group body.
    Rows,
    /// `idot`: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K as integer dot products (`mul_mat_vec_qd`): x
    /// quantized to 16 bits per block of 32 once per workgroup, each 32-element piece of w
    /// dotted with it four bytes an instruction, a workgroup's subgroups taking its rows one
    /// each in turn; where the device has the integer dot product feature and subgroup
    /// shuffles and k is at most 8,192. Other types and shapes take what `rows` takes. The
    /// device's default `idot` (a GPU that accelerates the dot products) covers Q4_0, Q4_1
    /// and Q8_0 only: Q4_K and Q6_K take it when it is asked for by name (not yet timed on a
    /// GPU).
    Idot,
}

impl QuantMatVec {
    /// `LOWSYNC_VK_QV`: `group`, `block`, `rows` or `idot`; unset or empty is `None` (the device's
    /// default, [`QuantMatVec::for_device`]), anything else an `Error::Env` naming the
    /// variable.
    pub fn from_env() -> Result<Option<Self>> {
        let names = &["group", "block", "rows", "idot"];
        Ok(
            match env::choice("LOWSYNC_VK_QV", names, "group, block, rows or idot")? {
                Some("group") => Some(QuantMatVec::Group),
                Some("block") => Some(QuantMatVec::Block),
                Some("rows") => Some(QuantMatVec::Rows),
                Some("idot") => Some(QuantMatVec::Idot),
                _ => None,
            },
        )
    }

    /// The body a device runs when none is asked for: `group` on a CPU-type device; on a GPU
    /// `idot` where it runs 4x8-bit integer dot products in hardware (`fast_integer_dot`),
    /// else `rows`.
    pub fn for_device(cpu_type: bool, fast_integer_dot: bool) -> Self {
        if cpu_type {
            QuantMatVec::Group
        } else if fast_integer_dot {
            QuantMatVec::Idot
        } else {
            QuantMatVec::Rows
        }
    }
}

/// How the prefill product over block weights (16 rows of x or more) is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMatMul {
    /// `rows`: an invocation per row of w against 32 rows of x, each group of w decoded once
    /// for all of them (`mul_mat_q`): few, long workgroups, what a CPU-type device runs best.
    Rows,
    /// `tiles`: the float kernel's 64x64 tiles over 256 invocations, a 16-element group of
    /// each of 64 rows of w decoded into workgroup memory per k step (`mul_mat_qt`): enough
    /// workgroups to fill a GPU.
    Tiles,
}

impl QuantMatMul {
    /// `LOWSYNC_VK_QMM`: `rows` or `tiles`; unset or empty is `None` (the device's default,
    /// [`QuantMatMul::for_device`]), anything else an `Error::Env` naming the variable.
    pub fn from_env() -> Result<Option<Self>> {
        Ok(
            match env::choice("LOWSYNC_VK_QMM", &["rows", "tiles"], "rows or tiles")? {
                Some("rows") => Some(QuantMatMul::Rows),
                Some("tiles") => Some(QuantMatMul::Tiles),
                _ => None,
            },
        )
    }

    /// The layout a device runs when none is asked for: `rows` on a CPU-type device, `tiles`
    /// on a GPU.
    pub fn for_device(cpu_type: bool) -> Self {
        if cpu_type {
            QuantMatMul::Rows
        } else {
            QuantMatMul::Tiles
        }
    }
}

/// Whether the tiled prefill products (`mul_mat`, `mul_mat8`, and `mul_mat_qt`, `mul_mat_qt8`
/// over block weights) split k over several workgroups per tile: each sums a range of k into
/// a partials buffer, and `split_sum` adds the ranges in order into the result. Why: a
/// 128-token prompt's 2048-row products are 64 tiles, which leave half of a GPU of 132
/// multiprocessors idle and each tile's workgroup walking all of k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitK {
    /// `0`: never.
    Off,
    /// `auto`: a product whose tiles are at most half the device's multiprocessors (where the
    /// device reports the count: NVIDIA's SMs, AMD's compute units) and whose k is at least 1,024
    /// splits into as many parts (up to 8) as make its workgroups about fill them.
    Auto,
    /// `2` to `8`: every tiled product splits into this many parts (fewer where k is short).
    Fixed(u32),
}

/// The most parts `LOWSYNC_VK_SPLIT_K` splits a product's k into.
pub const SPLIT_K_MAX: u32 = 8;

impl SplitK {
    /// `LOWSYNC_VK_SPLIT_K`: `0`, `auto` or a part count from 2 to 8; unset or empty is `Off`,
    /// anything else an `Error::Env` naming the variable.
    pub fn from_env() -> Result<Self> {
        const VAR: &str = "LOWSYNC_VK_SPLIT_K";
        let bad = |value: String| Error::Env {
            var: VAR,
            value,
            expected: "0, auto or a part count from 2 to 8",
        };
        match std::env::var(VAR) {
            Err(_) => Ok(SplitK::Off),
            Ok(v) => match v.trim() {
                "" | "0" => Ok(SplitK::Off),
                "auto" => Ok(SplitK::Auto),
                t => match t.parse::<u32>() {
                    Ok(n) if (2..=SPLIT_K_MAX).contains(&n) => Ok(SplitK::Fixed(n)),
                    _ => Err(bad(v)),
                },
            },
        }
    }
}

impl VkConfig {
    /// The settings the environment asks for (device index from `LOWSYNC_VK_DEVICE`).
    pub fn from_env() -> Result<Self> {
        Ok(VkConfig {
            device_index: env::unsigned("LOWSYNC_VK_DEVICE")?.unwrap_or(0) as usize,
            validation: env::flag("LOWSYNC_VK_VALIDATION", false)?,
            no_host_visible_vram: env::flag("LOWSYNC_VK_NO_HOST_VISIBLE_VRAM", false)?,
            legacy_submits: env::flag("LOWSYNC_VK_LEGACY_SUBMITS", false)?,
            force_transfer_submit: env::flag("LOWSYNC_VK_FORCE_TRANSFER_SUBMIT", false)?,
            compute_stream_copy_max: env::unsigned("LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX")?,
            no_subgroups: env::flag("LOWSYNC_VK_NO_SUBGROUPS", false)?,
            record: env::flag("LOWSYNC_VK_RECORD", true)?,
            profile: env::flag("LOWSYNC_VK_PROFILE", false)?,
            fusion: env::flag("LOWSYNC_VK_FUSION", true)?,
            quant_mat_vec: QuantMatVec::from_env()?,
            qd_rows: qd_rows_from_env()?,
            quant_mat_mul: QuantMatMul::from_env()?,
            tile: match env::choice("LOWSYNC_VK_TILE", &["4", "8"], "4 or 8")? {
                Some("8") => 8,
                _ => 4,
            },
            split_k: SplitK::from_env()?,
            attn_group: device_default_flag("LOWSYNC_VK_ATTN_GROUP")?,
            attn_vec: env::flag("LOWSYNC_VK_ATTN_VEC", true)?,
            row_lanes: device_default_flag("LOWSYNC_VK_ROW_LANES")?,
            coopmat: env::flag("LOWSYNC_VK_COOPMAT", false)?,
            norm_fold: device_default_flag("LOWSYNC_VK_NORM_FOLD")?,
            attn_split: attn_split_from_env()?,
            entry_point_hook: None,
        })
    }
}

impl Default for VkConfig {
    fn default() -> Self {
        VkConfig {
            device_index: 0,
            validation: false,
            no_host_visible_vram: false,
            legacy_submits: false,
            force_transfer_submit: false,
            compute_stream_copy_max: None,
            no_subgroups: false,
            record: true,
            profile: false,
            fusion: true,
            quant_mat_vec: None,
            qd_rows: None,
            quant_mat_mul: None,
            tile: 4,
            split_k: SplitK::Off,
            norm_fold: None,
            attn_group: None,
            attn_vec: true,
            row_lanes: None,
            coopmat: false,
            attn_split: None,
            entry_point_hook: None,
        }
    }
}

/// The most chunks a head's keys are split into where `LOWSYNC_VK_ATTN_SPLIT=1`: a few
/// workgroups per head, so that 32 heads fill a GPU of a hundred-odd multiprocessors.
pub const ATTN_SPLIT_DEFAULT_CHUNKS: u32 = 8;
/// The largest chunk count `LOWSYNC_VK_ATTN_SPLIT` takes.
pub const ATTN_SPLIT_MAX_CHUNKS: u32 = 64;
/// A `0`/`1` switch whose default depends on the device's type: `None` where unset.
fn device_default_flag(var: &'static str) -> Result<Option<bool>> {
    Ok(env::choice(var, &["0", "1"], "0 or 1")?.map(|v| v == "1"))
}

/// The most rows of w `LOWSYNC_VK_QD_ROWS` gives a workgroup of the integer-dot products.
pub const QD_ROWS_MAX: u32 = 1024;

fn qd_rows_from_env() -> Result<Option<u32>> {
    const VAR: &str = "LOWSYNC_VK_QD_ROWS";
    match env::unsigned(VAR)? {
        None => Ok(None),
        Some(n) if (1..=u64::from(QD_ROWS_MAX)).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(Error::Env {
            var: VAR,
            value: n.to_string(),
            expected: "a row count from 1 to 1024",
        }),
    }
}

fn attn_split_from_env() -> Result<Option<u32>> {
    const VAR: &str = "LOWSYNC_VK_ATTN_SPLIT";
    let bad = |value: String| Error::Env {
        var: VAR,
        value,
        expected: "0, 1 or a chunk count from 2 to 64",
    };
    match std::env::var(VAR) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if n <= ATTN_SPLIT_MAX_CHUNKS => Ok(Some(n)),
            _ => Err(bad(v)),
        },
    }
}
