//! The ops a llama-family decoder needs. Parameters live in the variant; sources in the node.

use crate::DType;

/// Rotary embedding variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// Rotate adjacent pairs (`x[2i]`, `x[2i+1]`); what GGUF llama files expect.
    Normal,
    /// Rotate halves (`x[i]`, `x[i + n_dims/2]`); GPT-NeoX / qwen style.
    Neox,
}

/// An operation. Leaves (`Input`, `Weight`, `Persistent`) have no sources; `View` aliases its
/// source's memory with another layout; every other op computes a new tensor (or, for
/// `SetRows`, writes into a persistent one and aliases it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// Written by the host every step.
    Input,
    /// Constant data uploaded once.
    Weight,
    /// State kept across steps (the KV cache), zero-initialised, never reused by the allocator.
    Persistent,
    /// reshape / permute / transpose / slice: no kernel, another layout over the same memory.
    View,
    /// `table[ids]`: srcs `[table [n, d], ids i32 [...]]`, result `ids.shape + [d]` in f32.
    GetRows,
    /// numpy `a @ b` over the last two axes; batch axes broadcast when equal, 1, or when one
    /// divides the other (GQA: batch index `i / ratio` of the smaller one). Result f32.
    MulMat,
    /// Element-wise `a + b` with numpy broadcasting of `b`; result has `a`'s shape and dtype.
    Add,
    /// Element-wise `a * b`, as `Add`.
    Mul,
    /// `a * scale`.
    Scale { scale: f32 },
    /// `x / sqrt(mean(x^2, last axis) + eps)`.
    RmsNorm { eps: f32 },
    /// Rotary embedding of `x [T, H, D]` at positions `pos i32 [T]` over the first `n_dims` of D.
    Rope {
        mode: RopeMode,
        n_dims: usize,
        theta_base: f32,
    },
    /// `softmax(x * scale + mask)` over the last axis; `mask` optional (second source,
    /// broadcast to `x`); `-inf` masks an entry; a fully masked row gives zeros. A `NaN`
    /// anywhere in a row makes the whole row `NaN` (it propagates, never vanishes).
    SoftMax { scale: f32 },
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (as ggml).
    Gelu,
    /// `silu(gate) * up` with equal shapes.
    SwiGlu,
    /// Contiguous copy, converting to the node's dtype (`cont` / `cast`).
    Cpy,
    /// Concatenate two tensors along `axis`.
    Concat { axis: usize },
    /// Write `src [m, d]` into rows `idx i32 [m]` of persistent `dst [n, d]`; the result aliases
    /// `dst`, so readers of the result see the write.
    SetRows,
    /// Index of the largest element of the last axis, lowest index on ties; i32. A `NaN` ranks
    /// below every number (every backend's kernels agree on this), an all-`NaN` row gives 0.
    Argmax,
    /// Mixture of experts: srcs `[experts [E, k, n], x [T, k], ids i32 [T, K], w [T, K]]`;
    /// `out[t] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])`, result `[T, n]` f32.
    MulMatId,
    /// Sampling penalties over recent tokens: srcs `[logits f32 [R, V], hist i32 [R, N],
    /// params f32 [R, 3]]`, result f32 `[R, V]`, a copy of `logits` in which, for each distinct
    /// id `t` of row `r` of `hist` with `0 <= t < V`, seen `c` times there, with
    /// `(repeat, frequency, presence) = params[r]`:
    /// `x = logits[r, t]; x = if x <= 0 { x * repeat } else { x / repeat };
    /// out[r, t] = x - (c * frequency + presence)` (llama.cpp's penalties sampler).
    /// Ids outside `[0, V)` (e.g. `-1`, an empty slot) are ignored.
    Penalize,
    /// Draws one token per row from `logits`: srcs `[logits f32 [R, V], params f32 [R, 4],
    /// key i32 [R, 2]]`, result i32 `[R]`. `params[r] = (temperature, top_k, top_p, min_p)`,
    /// `key[r] = (seed, counter)` (u32 bits). Every backend follows one algorithm, so the
    /// same inputs give the same token everywhere (see `lowsync_graph::sampling`):
    /// `temperature <= 0` is [`Op::Argmax`]; otherwise the row is truncated by top-k (keep
    /// values >= the k-th largest; `top_k <= 0` or `>= V` keeps all), top-p (the smallest set
    /// of the largest values whose softmax mass is >= top_p; `>= 1` keeps all) and min-p
    /// (keep `x >= max + ln(min_p)`; `<= 0` keeps all), and the token is the Gumbel-max draw
    /// `argmax over kept i of (x_i - max) / temperature - ln(-ln(u_i))` with
    /// `u_i = philox_uniform(seed, counter, i)`. `NaN` logits are never drawn.
    Sample,
}

impl Op {
    /// The op's name in error messages and stats.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Weight => "weight",
            Op::Persistent => "persistent",
            Op::View => "view",
            Op::GetRows => "get_rows",
            Op::MulMat => "mul_mat",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Scale { .. } => "scale",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope { .. } => "rope",
            Op::SoftMax { .. } => "soft_max",
            Op::Silu => "silu",
            Op::Gelu => "gelu",
            Op::SwiGlu => "swiglu",
            Op::Cpy => "cpy",
            Op::Concat { .. } => "concat",
            Op::SetRows => "set_rows",
            Op::Argmax => "argmax",
            Op::MulMatId => "mul_mat_id",
            Op::Penalize => "penalize",
            Op::Sample => "sample",
        }
    }

    /// The op called `name` (as [`Op::name`] spells it), with placeholder parameters: for
    /// questions that do not depend on them, such as [`Op::accepts`].
    pub fn from_name(name: &str) -> Option<Op> {
        const ALL: [Op; 22] = [
            Op::Input,
            Op::Weight,
            Op::Persistent,
            Op::View,
            Op::GetRows,
            Op::MulMat,
            Op::Add,
            Op::Mul,
            Op::Scale { scale: 1.0 },
            Op::RmsNorm { eps: 1e-5 },
            Op::Rope {
                mode: RopeMode::Normal,
                n_dims: 2,
                theta_base: 10000.0,
            },
            Op::SoftMax { scale: 1.0 },
            Op::Silu,
            Op::Gelu,
            Op::SwiGlu,
            Op::Cpy,
            Op::Concat { axis: 0 },
            Op::SetRows,
            Op::Argmax,
            Op::MulMatId,
            Op::Penalize,
            Op::Sample,
        ];
        ALL.into_iter().find(|op| op.name() == name)
    }

    /// How many sources the op takes; `None` for leaves and views (no kernel runs them).
    pub fn src_count(&self) -> Option<std::ops::RangeInclusive<usize>> {
        Some(match self {
            Op::Input | Op::Weight | Op::Persistent | Op::View => return None,
            Op::Scale { .. } | Op::Silu | Op::Gelu | Op::RmsNorm { .. } | Op::Cpy | Op::Argmax => {
                1..=1
            }
            Op::SoftMax { .. } => 1..=2,
            Op::Add
            | Op::Mul
            | Op::SwiGlu
            | Op::Rope { .. }
            | Op::Concat { .. }
            | Op::GetRows
            | Op::MulMat => 2..=2,
            Op::SetRows | Op::Penalize | Op::Sample => 3..=3,
            Op::MulMatId => 4..=4,
        })
    }

    /// Checks that a node of this op has `n_srcs` sources; the message says what was expected.
    ///
    /// Every backend's executor calls this before it resolves a node's tensors, so a malformed
    /// graph is one error with one wording on every backend.
    pub fn check_arity(&self, n_srcs: usize) -> std::result::Result<(), String> {
        let Some(want) = self.src_count() else {
            return Err("has no kernel (leaves and views are not executed)".into());
        };
        if want.contains(&n_srcs) {
            Ok(())
        } else {
            Err(format!(
                "expects {}..={} sources, got {n_srcs}",
                want.start(),
                want.end()
            ))
        }
    }

    /// Whether the op is defined for a result of dtype `dst` over sources of dtypes `srcs`:
    /// the rule of the reference (CPU) kernels, which every backend starts from.
    ///
    /// A backend's `supports_op` is this rule, narrowed where its kernels cover less (Vulkan's
    /// products write f32 only). Leaves and views accept anything; a wrong source count is
    /// refused here, so backends need no arity checks of their own in `supports_op`.
    ///
    /// A block (quantized) dtype is accepted only as the weight of `MulMat` (`b`), the table
    /// of `GetRows` and the experts of `MulMatId`: kernels dequantize those as they read them.
    pub fn accepts(&self, dst: DType, srcs: &[DType]) -> bool {
        let floats = |ds: &[DType]| ds.iter().all(|d| d.is_float());
        let weight = |d: DType| d.is_float() || d.is_quantized();
        let Some(want) = self.src_count() else {
            return true;
        };
        if !want.contains(&srcs.len()) {
            return false;
        }
        match self {
            Op::GetRows => dst.is_float() && weight(srcs[0]) && srcs[1] == DType::I32,
            Op::MulMat => dst.is_float() && srcs[0].is_float() && weight(srcs[1]),
            Op::SetRows => dst.is_float() && floats(&srcs[..2]) && srcs[2] == DType::I32,
            Op::Rope { .. } => dst.is_float() && srcs[0].is_float() && srcs[1] == DType::I32,
            Op::Argmax => dst == DType::I32 && floats(srcs),
            Op::MulMatId => {
                dst.is_float()
                    && weight(srcs[0])
                    && srcs[1].is_float()
                    && srcs[2] == DType::I32
                    && srcs[3].is_float()
            }
            Op::Cpy | Op::Concat { .. } => {
                !dst.is_quantized()
                    && srcs
                        .iter()
                        .all(|s| !s.is_quantized() && s.is_float() == dst.is_float())
            }
            Op::Penalize => {
                dst == DType::F32
                    && srcs[0] == DType::F32
                    && srcs[1] == DType::I32
                    && srcs[2] == DType::F32
            }
            Op::Sample => {
                dst == DType::I32
                    && srcs[0] == DType::F32
                    && srcs[1] == DType::F32
                    && srcs[2] == DType::I32
            }
            _ => dst.is_float() && floats(srcs),
        }
    }

    /// Leaves own memory that outlives a step or is written by the host.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input | Op::Weight | Op::Persistent)
    }

    /// Ops that run no kernel and allocate nothing (they alias their source).
    pub fn is_view(&self) -> bool {
        matches!(self, Op::View)
    }

    /// Ops whose result aliases a source instead of owning fresh memory.
    pub fn aliases_src(&self) -> bool {
        matches!(self, Op::View | Op::SetRows)
    }

    /// Ops that may write their result over their first source when it dies here
    /// (element-wise, same layout).
    pub fn can_inplace(&self) -> bool {
        matches!(
            self,
            Op::Add | Op::Mul | Op::Scale { .. } | Op::Silu | Op::Gelu | Op::SwiGlu
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_refuses_a_wrong_source_count_and_non_float_data() {
        assert!(Op::Add.accepts(DType::F32, &[DType::F32, DType::F16]));
        assert!(!Op::Add.accepts(DType::F32, &[DType::F32]));
        assert!(!Op::Add.accepts(DType::F32, &[DType::F32, DType::I32]));
        assert!(Op::GetRows.accepts(DType::F32, &[DType::F16, DType::I32]));
        assert!(!Op::GetRows.accepts(DType::F32, &[DType::F16, DType::F32]));
        assert!(Op::Argmax.accepts(DType::I32, &[DType::F32]));
        assert!(!Op::Argmax.accepts(DType::F32, &[DType::F32]));
        assert!(!Op::Argmax.accepts(DType::I32, &[DType::F32, DType::F32]));
        assert!(Op::Cpy.accepts(DType::I32, &[DType::I32]));
        assert!(!Op::Cpy.accepts(DType::F32, &[DType::I32]));
        assert!(Op::SoftMax { scale: 1.0 }.accepts(DType::F32, &[DType::F32]));
        assert!(Op::SoftMax { scale: 1.0 }.accepts(DType::F32, &[DType::F32, DType::F32]));
        assert!(Op::View.accepts(DType::I32, &[DType::F32]));
    }

    #[test]
    fn quantized_sources_are_accepted_only_as_weights() {
        use DType::{F32, I32, Q4_0, Q6_K};
        assert!(Op::MulMat.accepts(F32, &[F32, Q4_0]));
        assert!(!Op::MulMat.accepts(F32, &[Q4_0, F32]));
        assert!(!Op::MulMat.accepts(Q4_0, &[F32, F32]));
        assert!(Op::GetRows.accepts(F32, &[Q6_K, I32]));
        assert!(Op::MulMatId.accepts(F32, &[Q4_0, F32, I32, F32]));
        assert!(!Op::MulMatId.accepts(F32, &[F32, Q4_0, I32, F32]));
        assert!(!Op::Add.accepts(F32, &[F32, Q4_0]));
        assert!(!Op::Cpy.accepts(F32, &[Q4_0]));
        assert!(!Op::Cpy.accepts(Q4_0, &[I32]));
        assert!(!Op::Concat { axis: 0 }.accepts(Q4_0, &[Q4_0, Q4_0]));
        assert!(Op::Weight.accepts(Q4_0, &[]));
    }

    #[test]
    fn ops_are_found_by_name() {
        assert_eq!(Op::from_name("mul_mat"), Some(Op::MulMat));
        assert!(matches!(Op::from_name("rope"), Some(Op::Rope { .. })));
        assert_eq!(Op::from_name("matmul"), None);
    }

    #[test]
    fn check_arity_names_what_was_expected() {
        assert!(Op::SetRows.check_arity(3).is_ok());
        let msg = Op::SetRows.check_arity(2).unwrap_err();
        assert_eq!(msg, "expects 3..=3 sources, got 2");
        assert!(Op::Input.check_arity(0).unwrap_err().contains("no kernel"));
    }
}
