//! The graph builder.
//!
//! Why: every backend and the scheduler read one IR, so shape and dtype mistakes must be caught
//! once, here, when a node is built — with the op and the shapes in the message — and never
//! reach a kernel.
//!
//! Strategy: tensors live in one arena in creation order, which is a topological order (a
//! node's sources exist before it). Views record their root (the tensor that owns the memory)
//! and a strided layout over it. Leaves are inputs (host-written per step), weights (data held
//! here until a backend uploads it) and persistent tensors (state such as the KV cache).
//!
//! Invariants: node and leaf counts depend only on the calls made, never on data (S2); every
//! layout of a view stays inside its root; every tensor's bytes and strides fit in `isize::MAX`
//! ([`tensor_bytes`]), so no size computed from a graph wraps around (a wrapped size would let a
//! kernel read outside its buffer).
//!
//! Block (quantized) dtypes are weights only: a quantized leaf is made by [`Graph::weight`]
//! with its last axis a positive whole number of blocks, every view of it keeps rows whole
//! ([`quant_layout_ok`]: transposes, reshapes of leading axes, row slices), and it is read
//! only as the right operand of `mul_mat` (blocks along the reduction axis: `x @ w.T`), the
//! table of `get_rows` and the experts of `mul_mat_id`. It is never an input, state, output,
//! or the source of `cpy`/`concat`.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::layout::{broadcast_shapes, quant_block_axis, quant_layout_ok, tensor_bytes, Layout};
use crate::{DType, Op, RopeMode, WeightBytes};

/// Index of a tensor in its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

impl TensorId {
    /// The arena index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One tensor of the graph.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: Option<String>,
    pub dtype: DType,
    pub layout: Layout,
    pub op: Op,
    pub srcs: Vec<TensorId>,
    /// The tensor that owns the memory (itself unless `op.aliases_src()`).
    pub root: TensorId,
}

impl TensorInfo {
    /// Shape in numpy order.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    /// Bytes of the tensor's elements packed (whole blocks for a block dtype; saturating at
    /// `usize::MAX` for a layout no builder admits).
    pub fn nbytes(&self) -> usize {
        self.dtype
            .checked_bytes(self.layout.numel())
            .unwrap_or(usize::MAX)
    }
}

/// Data of a weight and the backend the user pinned it to.
#[derive(Clone, Debug)]
pub struct WeightData {
    /// The bytes (owned or borrowed; never copied again by the graph).
    pub bytes: WeightBytes,
    /// The backend the weight is pinned to, if any.
    pub backend: Option<String>,
}

/// A compute graph under construction (and, once outputs are marked, ready to compile).
#[derive(Clone, Debug, Default)]
pub struct Graph {
    tensors: Vec<TensorInfo>,
    weights: Vec<(TensorId, WeightData)>,
    outputs: Vec<(String, TensorId)>,
    names: HashSet<String>,
    pins: Vec<(TensorId, String)>,
}

fn shape_err(op: &'static str, msg: String) -> Error {
    Error::Shape { op, msg }
}

fn dtype_err(op: &'static str, msg: String) -> Error {
    Error::DType { op, msg }
}

/// The bytes of a tensor of `shape` and `dtype`, or the error of `op` saying why it cannot
/// exist (rows of a block dtype that are not whole blocks, or too large to address).
fn checked_bytes(op: &'static str, what: &str, shape: &[usize], dtype: DType) -> Result<usize> {
    if dtype.is_quantized() {
        let bs = dtype.block_size();
        match shape.last() {
            Some(&k) if k > 0 && k.is_multiple_of(bs) => {}
            _ => {
                return Err(shape_err(
                    op,
                    format!(
                        "{what} of shape {shape:?} ({dtype}): a {dtype} tensor needs a last axis \
                         that is a positive multiple of its block size {bs}"
                    ),
                ))
            }
        }
    }
    tensor_bytes(shape, dtype).ok_or_else(|| {
        shape_err(
            op,
            format!(
                "{what} of shape {shape:?} ({dtype}) is too large to address (more than {} bytes)",
                isize::MAX
            ),
        )
    })
}

/// Refuses a block dtype where only plain ones may go.
fn plain(op: &'static str, what: &str, dtype: DType) -> Result<()> {
    if dtype.is_quantized() {
        return Err(dtype_err(
            op,
            format!(
                "{what} cannot be {dtype}: quantized tensors are weights, read by mul_mat (as \
                 `x @ w.T`), get_rows and mul_mat_id"
            ),
        ));
    }
    Ok(())
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// All tensors in topological (creation) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor.
    pub fn tensor(&self, id: TensorId) -> &TensorInfo {
        &self.tensors[id.index()]
    }

    /// Weights with their data.
    pub fn weights(&self) -> &[(TensorId, WeightData)] {
        &self.weights
    }

    /// Named outputs in the order they were marked.
    pub fn outputs(&self) -> &[(String, TensorId)] {
        &self.outputs
    }

    /// Leaves (inputs, weights, persistent tensors).
    pub fn n_leafs(&self) -> usize {
        self.tensors.iter().filter(|t| t.op.is_leaf()).count()
    }

    /// Non-leaf tensors, views included (as ggml counts them).
    pub fn n_nodes(&self) -> usize {
        self.tensors.len() - self.n_leafs()
    }

    /// Inputs, in creation order.
    pub fn inputs(&self) -> impl Iterator<Item = (TensorId, &TensorInfo)> {
        self.tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.op == Op::Input)
            .map(|(i, t)| (TensorId(i as u32), t))
    }

    fn check(&self, id: TensorId) -> Result<&TensorInfo> {
        self.tensors.get(id.index()).ok_or(Error::BadTensor(id.0))
    }

    fn claim_name(&mut self, name: &str) -> Result<()> {
        if !self.names.insert(name.to_string()) {
            return Err(Error::DuplicateName(name.to_string()));
        }
        Ok(())
    }

    fn push(&mut self, mut info: TensorInfo) -> TensorId {
        let id = TensorId(self.tensors.len() as u32);
        if !info.op.aliases_src() {
            info.root = id;
        }
        self.tensors.push(info);
        id
    }

    fn push_new(
        &mut self,
        op: Op,
        srcs: Vec<TensorId>,
        dtype: DType,
        shape: &[usize],
    ) -> Result<TensorId> {
        checked_bytes(op.name(), "the result", shape, dtype)?;
        Ok(self.push(TensorInfo {
            name: None,
            dtype,
            layout: Layout::contiguous(shape),
            op,
            srcs,
            root: TensorId(0),
        }))
    }

    fn leaf(&mut self, op: Op, name: &str, shape: &[usize], dtype: DType) -> Result<TensorId> {
        checked_bytes(op.name(), &format!("`{name}`"), shape, dtype)?;
        self.claim_name(name)?;
        Ok(self.push(TensorInfo {
            name: Some(name.to_string()),
            dtype,
            layout: Layout::contiguous(shape),
            op,
            srcs: vec![],
            root: TensorId(0),
        }))
    }

    /// A tensor the host writes every step.
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<TensorId> {
        plain("input", &format!("input `{name}`"), dtype)?;
        self.leaf(Op::Input, name, shape, dtype)
    }

    /// A constant tensor, optionally pinned to a backend by name. For a block dtype `shape` is
    /// the logical shape (elements) and `bytes` the raw blocks, row after row. The bytes are
    /// held, not copied (a `Vec` or `Arc<[u8]>` is taken as is; see [`WeightBytes`]).
    pub fn weight(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        bytes: impl Into<WeightBytes>,
        backend: Option<String>,
    ) -> Result<TensorId> {
        let bytes = bytes.into();
        let want = checked_bytes("weight", &format!("`{name}`"), shape, dtype)?;
        if bytes.len() != want {
            return Err(Error::WeightSize {
                name: name.to_string(),
                shape: shape.to_vec(),
                dtype,
                got: bytes.len(),
                want,
            });
        }
        let id = self.leaf(Op::Weight, name, shape, dtype)?;
        if let Some(b) = &backend {
            self.pins.push((id, b.clone()));
        }
        self.weights.push((id, WeightData { bytes, backend }));
        Ok(id)
    }

    /// State kept across steps (zero-initialised), e.g. a KV cache written with `set_rows`.
    pub fn persistent(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<TensorId> {
        plain("persistent", &format!("persistent `{name}`"), dtype)?;
        self.leaf(Op::Persistent, name, shape, dtype)
    }

    /// Pins a weight or persistent tensor to the backend called `backend`.
    pub fn pin(&mut self, id: TensorId, backend: &str) -> Result<()> {
        let t = self.check(id)?;
        if !matches!(t.op, Op::Weight | Op::Persistent) {
            return Err(shape_err(
                "pin",
                format!(
                    "only weights and persistent tensors can be pinned, not a {}",
                    t.op.name()
                ),
            ));
        }
        self.pins.retain(|(i, _)| *i != id);
        self.pins.push((id, backend.to_string()));
        Ok(())
    }

    /// The backend a leaf was pinned to, if any.
    pub fn pinned_backend(&self, id: TensorId) -> Option<&str> {
        self.pins
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, b)| b.as_str())
    }

    /// Marks a tensor as a named output the host can read after a step.
    pub fn output(&mut self, name: &str, id: TensorId) -> Result<()> {
        plain("output", &format!("output `{name}`"), self.check(id)?.dtype)?;
        self.claim_name(name)?;
        self.outputs.push((name.to_string(), id));
        Ok(())
    }

    /// Names a tensor (for debugging and error messages).
    pub fn set_name(&mut self, id: TensorId, name: &str) -> Result<()> {
        self.check(id)?;
        self.tensors[id.index()].name = Some(name.to_string());
        Ok(())
    }

    fn view(&mut self, op: &'static str, src: TensorId, layout: Layout) -> Result<TensorId> {
        let s = &self.tensors[src.index()];
        if s.dtype.is_quantized() {
            let row_len = self.tensors[s.root.index()]
                .layout
                .shape
                .last()
                .copied()
                .unwrap_or(0);
            if !quant_layout_ok(&layout, row_len) {
                return Err(shape_err(
                    op,
                    format!(
                        "a view of a {} tensor must keep its rows of {row_len} elements whole \
                         (blocks cannot be split): {:?} -> shape {:?}, strides {:?}",
                        s.dtype, s.layout.shape, layout.shape, layout.strides
                    ),
                ));
            }
        }
        let info = TensorInfo {
            name: None,
            dtype: s.dtype,
            layout,
            op: Op::View,
            srcs: vec![src],
            root: s.root,
        };
        Ok(self.push(info))
    }

    // ---- views -----------------------------------------------------------------------------

    /// Same elements, another shape. The source must be contiguous.
    pub fn reshape(&mut self, a: TensorId, shape: &[usize]) -> Result<TensorId> {
        let t = self.check(a)?;
        // Checked before the count is compared: a product that wraps (2 elements reshaped to
        // [2^63 + 1, 2]) would otherwise pass, and a kernel would index far past the buffer.
        checked_bytes("reshape", "the result", shape, t.dtype)?;
        if shape.iter().product::<usize>() != t.layout.numel() {
            return Err(shape_err(
                "reshape",
                format!(
                    "cannot reshape {:?} into {:?}: element counts differ",
                    t.shape(),
                    shape
                ),
            ));
        }
        if !t.layout.is_contiguous() {
            return Err(shape_err(
                "reshape",
                format!(
                    "source of shape {:?} is not contiguous; use cont first",
                    t.shape()
                ),
            ));
        }
        let mut layout = Layout::contiguous(shape);
        layout.offset = t.layout.offset;
        self.view("reshape", a, layout)
    }

    /// Reorders axes: result axis `i` is source axis `axes[i]`.
    pub fn permute(&mut self, a: TensorId, axes: &[usize]) -> Result<TensorId> {
        let t = self.check(a)?;
        let n = t.shape().len();
        let mut seen = vec![false; n];
        if axes.len() != n
            || axes
                .iter()
                .any(|&x| x >= n || std::mem::replace(&mut seen[x], true))
        {
            return Err(shape_err(
                "permute",
                format!(
                    "axes {axes:?} are not a permutation of the {n} axes of {:?}",
                    t.shape()
                ),
            ));
        }
        let layout = Layout {
            shape: axes.iter().map(|&i| t.layout.shape[i]).collect(),
            strides: axes.iter().map(|&i| t.layout.strides[i]).collect(),
            offset: t.layout.offset,
        };
        self.view("permute", a, layout)
    }

    /// Swaps two axes.
    pub fn transpose(&mut self, a: TensorId, ax0: usize, ax1: usize) -> Result<TensorId> {
        let n = self.check(a)?.shape().len();
        if ax0 >= n || ax1 >= n {
            return Err(shape_err(
                "transpose",
                format!("axes ({ax0}, {ax1}) out of range for {n} axes"),
            ));
        }
        let mut axes: Vec<usize> = (0..n).collect();
        axes.swap(ax0, ax1);
        self.permute(a, &axes)
    }

    /// `a[..., start:stop, ...]` along one axis.
    pub fn slice(
        &mut self,
        a: TensorId,
        axis: usize,
        start: usize,
        stop: usize,
    ) -> Result<TensorId> {
        let t = self.check(a)?;
        if axis >= t.shape().len() || start > stop || stop > t.shape()[axis] {
            return Err(shape_err(
                "slice",
                format!(
                    "slice {start}:{stop} of axis {axis} is out of range for {:?}",
                    t.shape()
                ),
            ));
        }
        let mut layout = t.layout.clone();
        layout.offset += start * layout.strides[axis];
        layout.shape[axis] = stop - start;
        self.view("slice", a, layout)
    }

    // ---- compute ops -----------------------------------------------------------------------

    fn float(&self, op: &'static str, id: TensorId, what: &str) -> Result<&TensorInfo> {
        let t = self.check(id)?;
        if !t.dtype.is_float() {
            return Err(dtype_err(
                op,
                format!("{what} must be a float tensor, got {}", t.dtype),
            ));
        }
        Ok(t)
    }

    /// A float tensor, or a block-dtype one whose blocks run along axis `block_axis` (counted
    /// from the end: 1 is the last axis), the only way kernels read quantized data.
    fn float_or_quant(
        &self,
        op: &'static str,
        id: TensorId,
        what: &str,
        block_axis: usize,
    ) -> Result<&TensorInfo> {
        let t = self.check(id)?;
        if !t.dtype.is_quantized() {
            return self.float(op, id, what);
        }
        let row_len = self.tensors[t.root.index()]
            .layout
            .shape
            .last()
            .copied()
            .unwrap_or(0);
        let rank = t.layout.shape.len();
        let axis = quant_block_axis(&t.layout, row_len);
        if rank < block_axis || axis != Some(rank - block_axis) {
            let want = if block_axis == 1 {
                "its rows (blocks along the last axis)"
            } else {
                "blocks along axis -2 (a transposed weight, as in `x @ w.T`)"
            };
            return Err(dtype_err(
                op,
                format!(
                    "{what} of dtype {} and shape {:?} must be read with {want}",
                    t.dtype,
                    t.shape()
                ),
            ));
        }
        Ok(t)
    }

    fn int(&self, op: &'static str, id: TensorId, what: &str) -> Result<&TensorInfo> {
        let t = self.check(id)?;
        if t.dtype != DType::I32 {
            return Err(dtype_err(
                op,
                format!("{what} must be i32, got {}", t.dtype),
            ));
        }
        Ok(t)
    }

    /// The shape of `id`, which must have dtype `want`.
    fn exact(&self, op: &'static str, id: TensorId, what: &str, want: DType) -> Result<Vec<usize>> {
        let t = self.check(id)?;
        if t.dtype != want {
            return Err(dtype_err(
                op,
                format!("{what} must be {want}, got {}", t.dtype),
            ));
        }
        Ok(t.shape().to_vec())
    }

    /// Rows of `table [n, d]` at `ids` (i32, any shape): result `ids.shape + [d]`, f32.
    pub fn get_rows(&mut self, table: TensorId, ids: TensorId) -> Result<TensorId> {
        let t = self.float_or_quant("get_rows", table, "table", 1)?;
        if t.shape().len() != 2 {
            return Err(shape_err(
                "get_rows",
                format!("table must be 2-D [n, d], got {:?}", t.shape()),
            ));
        }
        let d = t.shape()[1];
        let mut shape = self.int("get_rows", ids, "ids")?.shape().to_vec();
        shape.push(d);
        self.push_new(Op::GetRows, vec![table, ids], DType::F32, &shape)
    }

    /// numpy `a @ b` (see [`Op::MulMat`]); result f32.
    pub fn mul_mat(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        let sa = self.float("mul_mat", a, "a")?.shape().to_vec();
        let sb = self.float_or_quant("mul_mat", b, "b", 2)?.shape().to_vec();
        if sa.len() < 2 || sb.len() < 2 {
            return Err(shape_err(
                "mul_mat",
                format!("needs at least 2-D operands, got {sa:?} @ {sb:?}"),
            ));
        }
        let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
        let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
        if k != k2 {
            return Err(shape_err(
                "mul_mat",
                format!("inner dimensions differ: {sa:?} @ {sb:?}"),
            ));
        }
        let batch = mul_mat_batch(&sa[..sa.len() - 2], &sb[..sb.len() - 2]).ok_or_else(|| {
            shape_err(
                "mul_mat",
                format!("batch axes of {sa:?} @ {sb:?} neither match nor divide each other"),
            )
        })?;
        let mut shape = batch;
        shape.extend([m, n]);
        self.push_new(Op::MulMat, vec![a, b], DType::F32, &shape)
    }

    fn binary(&mut self, op: Op, a: TensorId, b: TensorId) -> Result<TensorId> {
        let name = op.name();
        let ta = self.float(name, a, "a")?;
        let (sa, dt) = (ta.shape().to_vec(), ta.dtype);
        let sb = self.float(name, b, "b")?.shape().to_vec();
        match broadcast_shapes(&sa, &sb) {
            Some(s) if s == sa => self.push_new(op, vec![a, b], dt, &sa),
            _ => Err(shape_err(
                name,
                format!("cannot broadcast {sb:?} onto {sa:?}"),
            )),
        }
    }

    /// `a + b`, `b` broadcast onto `a`.
    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Add, a, b)
    }

    /// `a * b`, `b` broadcast onto `a`.
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(Op::Mul, a, b)
    }

    fn unary(&mut self, op: Op, a: TensorId) -> Result<TensorId> {
        let t = self.float(op.name(), a, "x")?;
        let (s, dt) = (t.shape().to_vec(), t.dtype);
        self.push_new(op, vec![a], dt, &s)
    }

    /// `a * scale`.
    pub fn scale(&mut self, a: TensorId, scale: f32) -> Result<TensorId> {
        self.unary(Op::Scale { scale }, a)
    }

    /// RMS norm over the last axis.
    pub fn rms_norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        if self.check(a)?.shape().is_empty() {
            return Err(shape_err("rms_norm", "needs at least one axis".into()));
        }
        self.unary(Op::RmsNorm { eps }, a)
    }

    /// `x * sigmoid(x)`.
    pub fn silu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Silu, a)
    }

    /// GELU (tanh approximation).
    pub fn gelu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Gelu, a)
    }

    /// `silu(gate) * up`.
    pub fn swiglu(&mut self, gate: TensorId, up: TensorId) -> Result<TensorId> {
        let tg = self.float("swiglu", gate, "gate")?;
        let (sg, dt) = (tg.shape().to_vec(), tg.dtype);
        let su = self.float("swiglu", up, "up")?.shape().to_vec();
        if sg != su {
            return Err(shape_err(
                "swiglu",
                format!("gate {sg:?} and up {su:?} differ"),
            ));
        }
        self.push_new(Op::SwiGlu, vec![gate, up], dt, &sg)
    }

    /// Rotary embedding of `x [T, H, D]` at `pos i32 [T]`.
    pub fn rope(
        &mut self,
        x: TensorId,
        pos: TensorId,
        mode: RopeMode,
        n_dims: usize,
        theta_base: f32,
    ) -> Result<TensorId> {
        let tx = self.float("rope", x, "x")?;
        let (sx, dt) = (tx.shape().to_vec(), tx.dtype);
        let sp = self.int("rope", pos, "positions")?.shape().to_vec();
        if sx.len() != 3 {
            return Err(shape_err(
                "rope",
                format!("x must be [tokens, heads, head_dim], got {sx:?}"),
            ));
        }
        if sp != [sx[0]] {
            return Err(shape_err(
                "rope",
                format!("positions {sp:?} must be [{}] for x {sx:?}", sx[0]),
            ));
        }
        // A base <= 0 (or NaN) makes every frequency NaN: refuse it here, where the call that
        // made it is known, instead of producing NaN activations at run time.
        if !(theta_base.is_finite() && theta_base > 0.0) {
            return Err(shape_err(
                "rope",
                format!("theta_base must be a finite number > 0, got {theta_base}"),
            ));
        }
        if n_dims == 0 || n_dims % 2 == 1 || n_dims > sx[2] {
            return Err(shape_err(
                "rope",
                format!(
                    "n_dims {n_dims} must be even, > 0 and <= head_dim {}",
                    sx[2]
                ),
            ));
        }
        let op = Op::Rope {
            mode,
            n_dims,
            theta_base,
        };
        self.push_new(op, vec![x, pos], dt, &sx)
    }

    /// `softmax(x * scale + mask)` over the last axis; `mask` broadcast onto `x`.
    pub fn soft_max(
        &mut self,
        x: TensorId,
        mask: Option<TensorId>,
        scale: f32,
    ) -> Result<TensorId> {
        let tx = self.float("soft_max", x, "x")?;
        let (sx, dt) = (tx.shape().to_vec(), tx.dtype);
        if sx.is_empty() {
            return Err(shape_err("soft_max", "needs at least one axis".into()));
        }
        let mut srcs = vec![x];
        if let Some(m) = mask {
            let sm = self.float("soft_max", m, "mask")?.shape().to_vec();
            if broadcast_shapes(&sx, &sm).as_deref() != Some(&sx[..]) {
                return Err(shape_err(
                    "soft_max",
                    format!("mask {sm:?} does not broadcast onto {sx:?}"),
                ));
            }
            srcs.push(m);
        }
        self.push_new(Op::SoftMax { scale }, srcs, dt, &sx)
    }

    /// Contiguous copy converted to `dtype` (`cont` when the dtype is unchanged).
    pub fn cpy(&mut self, a: TensorId, dtype: DType) -> Result<TensorId> {
        let t = self.check(a)?;
        plain("cpy", "the source", t.dtype)?;
        plain("cpy", "the result", dtype)?;
        if t.dtype.is_float() != dtype.is_float() {
            return Err(dtype_err(
                "cpy",
                format!("cannot convert {} to {dtype}", t.dtype),
            ));
        }
        let s = t.shape().to_vec();
        self.push_new(Op::Cpy, vec![a], dtype, &s)
    }

    /// Contiguous copy with the same dtype.
    pub fn cont(&mut self, a: TensorId) -> Result<TensorId> {
        let dt = self.check(a)?.dtype;
        self.cpy(a, dt)
    }

    /// Concatenation along `axis`.
    pub fn concat(&mut self, a: TensorId, b: TensorId, axis: usize) -> Result<TensorId> {
        let ta = self.check(a)?;
        let (sa, da) = (ta.shape().to_vec(), ta.dtype);
        let tb = self.check(b)?;
        let (sb, db) = (tb.shape().to_vec(), tb.dtype);
        if da != db {
            return Err(dtype_err("concat", format!("dtypes differ: {da} and {db}")));
        }
        plain("concat", "a", da)?;
        let ok = sa.len() == sb.len()
            && axis < sa.len()
            && sa
                .iter()
                .zip(&sb)
                .enumerate()
                .all(|(i, (x, y))| i == axis || x == y);
        if !ok {
            return Err(shape_err(
                "concat",
                format!("cannot concatenate {sa:?} and {sb:?} along axis {axis}"),
            ));
        }
        let mut s = sa;
        s[axis] = s[axis].checked_add(sb[axis]).ok_or_else(|| {
            shape_err(
                "concat",
                format!("axis {axis} of {s:?} and {sb:?} together overflows"),
            )
        })?;
        self.push_new(Op::Concat { axis }, vec![a, b], da, &s)
    }

    /// Writes `src [m, d]` into rows `idx [m]` of the persistent `dst [n, d]`; the result
    /// aliases `dst`.
    pub fn set_rows(&mut self, dst: TensorId, src: TensorId, idx: TensorId) -> Result<TensorId> {
        let td = self.float("set_rows", dst, "dst")?.clone();
        let ss = self.float("set_rows", src, "src")?.shape().to_vec();
        let si = self.int("set_rows", idx, "indices")?.shape().to_vec();
        if self.tensors[td.root.index()].op != Op::Persistent {
            return Err(shape_err(
                "set_rows",
                "dst must be a persistent tensor (or a view of one)".into(),
            ));
        }
        let sd = td.shape();
        if sd.len() != 2 || ss.len() != 2 || ss[1] != sd[1] || si != [ss[0]] {
            return Err(shape_err(
                "set_rows",
                format!("expects dst [n, d], src [m, d], indices [m]; got {sd:?}, {ss:?}, {si:?}"),
            ));
        }
        Ok(self.push(TensorInfo {
            name: None,
            dtype: td.dtype,
            layout: td.layout.clone(),
            op: Op::SetRows,
            srcs: vec![dst, src, idx],
            root: td.root,
        }))
    }

    /// Index of the maximum over the last axis (lowest index on ties; the first `NaN`, as
    /// numpy, when the row has one), i32.
    pub fn argmax(&mut self, a: TensorId) -> Result<TensorId> {
        let s = self.float("argmax", a, "x")?.shape().to_vec();
        if s.is_empty() || s[s.len() - 1] == 0 {
            return Err(shape_err(
                "argmax",
                format!("needs a non-empty last axis, got {s:?}"),
            ));
        }
        self.push_new(Op::Argmax, vec![a], DType::I32, &s[..s.len() - 1])
    }

    /// Sampling penalties over recent tokens (see [`Op::Penalize`]): `logits` f32 `[R, V]`,
    /// `hist` i32 `[R, N]` (ids; outside `[0, V)` is an empty slot), `params` f32 `[R, 3]`
    /// (repeat, frequency, presence); result f32 `[R, V]`.
    pub fn penalize(
        &mut self,
        logits: TensorId,
        hist: TensorId,
        params: TensorId,
    ) -> Result<TensorId> {
        let sl = self.exact("penalize", logits, "logits", DType::F32)?;
        let sh = self.exact("penalize", hist, "hist", DType::I32)?;
        let sp = self.exact("penalize", params, "params", DType::F32)?;
        let ok = sl.len() == 2 && sh.len() == 2 && sh[0] == sl[0] && sp == [sl[0], 3];
        if !ok {
            return Err(shape_err(
                "penalize",
                format!(
                    "expects logits [R, V], hist [R, N], params [R, 3]; got {sl:?}, {sh:?}, {sp:?}"
                ),
            ));
        }
        self.push_new(Op::Penalize, vec![logits, hist, params], DType::F32, &sl)
    }

    /// One token per row drawn on the device (see [`Op::Sample`]): `logits` f32 `[R, V]`,
    /// `params` f32 `[R, 4]` (temperature, top_k, top_p, min_p), `key` i32 `[R, 2]` (seed,
    /// counter); result i32 `[R]`.
    pub fn sample(
        &mut self,
        logits: TensorId,
        params: TensorId,
        key: TensorId,
    ) -> Result<TensorId> {
        let sl = self.exact("sample", logits, "logits", DType::F32)?;
        let sp = self.exact("sample", params, "params", DType::F32)?;
        let sk = self.exact("sample", key, "key", DType::I32)?;
        let ok = sl.len() == 2 && sl[1] > 0 && sp == [sl[0], 4] && sk == [sl[0], 2];
        if !ok {
            return Err(shape_err(
                "sample",
                format!(
                    "expects logits [R, V] (V > 0), params [R, 4], key [R, 2]; got {sl:?}, {sp:?}, {sk:?}"
                ),
            ));
        }
        self.push_new(Op::Sample, vec![logits, params, key], DType::I32, &sl[..1])
    }

    /// MoE expert matmul with weighted sum (see [`Op::MulMatId`]).
    pub fn mul_mat_id(
        &mut self,
        experts: TensorId,
        x: TensorId,
        ids: TensorId,
        weights: TensorId,
    ) -> Result<TensorId> {
        let se = self
            .float_or_quant("mul_mat_id", experts, "experts", 2)?
            .shape()
            .to_vec();
        let sx = self.float("mul_mat_id", x, "x")?.shape().to_vec();
        let si = self.int("mul_mat_id", ids, "ids")?.shape().to_vec();
        let sw = self
            .float("mul_mat_id", weights, "weights")?
            .shape()
            .to_vec();
        let ok = se.len() == 3
            && sx.len() == 2
            && sx[1] == se[1]
            && si.len() == 2
            && si[0] == sx[0]
            && sw == si;
        if !ok {
            return Err(shape_err(
                "mul_mat_id",
                format!(
                    "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K]; got {se:?}, {sx:?}, {si:?}, {sw:?}"
                ),
            ));
        }
        let shape = [sx[0], se[2]];
        self.push_new(
            Op::MulMatId,
            vec![experts, x, ids, weights],
            DType::F32,
            &shape,
        )
    }
}

/// Broadcast batch axes for mul_mat: equal, 1, or one dividing the other (GQA).
pub fn mul_mat_batch(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let db = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            match (da, db) {
                _ if da == db => Some(da),
                (1, _) => Some(db),
                (_, 1) => Some(da),
                // GQA: one count divides the other; the smaller side is indexed by i / ratio.
                _ if da > 0 && db > 0 && da.max(db) % da.min(db) == 0 => Some(da.max(db)),
                _ => None,
            }
        })
        .collect()
}
