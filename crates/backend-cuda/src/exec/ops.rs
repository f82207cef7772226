//! Queuing one compute node: validation, resolution to device addresses, kernel launches.
//!
//! Why: the semantics of every op are the CPU oracle's (`lowsync_cpu::kernels`); this module
//! turns each [`ExecNode`] into the launches that reproduce them on the GPU, with the same
//! shape and dtype checks and the same error messages' content, before anything is queued.
//!
//! Strategy: a node's tensors are resolved to device addresses (bounds and alignment checked);
//! a source that overlaps the destination in a way the op does not allow (anything but the
//! in-place first source of an element-wise op, or `SetRows`' target) is first copied to
//! scratch, as the CPU kernels do, so no kernel reads what it already overwrote. Element-wise
//! kernels take a coalesced `Lay`; row kernels one block per row; matmul goes to `matmul`.
//!
//! Invariant: launches of one node are queued in order on the backend's single stream, so a
//! node reads only what earlier nodes wrote; scratch handed to a node is never freed before
//! the launches that use it ran (frees are stream-ordered).

use lowsync_backend::{ExecNode, Result};
use lowsync_graph::{DType, Op, RopeMode};

use crate::exec::launch::{
    dt, float_dst, float_src, grid_for, kernel_err, qt, quant_row_bytes, row_block, rows_grid,
    Args, Dev, Exec, BLOCK,
};
use crate::exec::matmul;
use crate::kernels::Kernel;
use crate::layout::broadcast_strides;

/// The longest row `soft_max_rows` takes: 32 lanes x `SMR_V` (32) values in registers.
const SOFT_MAX_ROWS_MAX: usize = 1024;

impl Exec<'_> {
    /// Runs one node.
    pub(crate) fn run(&mut self, node: &ExecNode) -> Result<()> {
        node.op
            .check_arity(node.srcs.len())
            .map_err(|m| kernel_err(node, m))?;
        let dst = self.resolve(&node.dst)?;
        let mut srcs = node
            .srcs
            .iter()
            .map(|t| self.resolve(t))
            .collect::<Result<Vec<_>>>()?;
        let private: Vec<usize> = (0..node.srcs.len())
            .filter(|&i| node.src_needs_private_copy(i))
            .collect();
        let plan = match node.op {
            Op::MulMat => Some(matmul::plan(
                node,
                &dst,
                &srcs[0],
                &srcs[1],
                self.inner.cfg.mmv_max_m,
            )?),
            _ => None,
        };
        let mut sizes: Vec<usize> = private
            .iter()
            .map(|&i| node.srcs[i].byte_extent())
            .collect();
        if let Some(p) = &plan {
            sizes.extend(p.scratch_sizes());
        }
        let regions = self.scratch(node, &sizes)?;
        for (k, &i) in private.iter().enumerate() {
            let len = node.srcs[i].byte_extent();
            // SAFETY: both ranges are checked device memory of this context (a resolved
            // tensor's extent and a scratch region of that size).
            unsafe { self.inner.stream.memcpy_dtod(regions[k], srcs[i].ptr, len) }
                .map_err(|e| kernel_err(node, format!("private copy failed: {e:?}")))?;
            srcs[i].ptr = regions[k];
        }
        let op_regions = &regions[private.len()..];
        match node.op {
            Op::Add | Op::Mul | Op::SwiGlu | Op::Scale { .. } | Op::Silu | Op::Gelu => {
                self.elementwise(node, &dst, &srcs)
            }
            Op::Cpy => self.cpy(node, &dst, &srcs[0]),
            Op::Concat { axis } => self.concat(node, &dst, &srcs[0], &srcs[1], axis),
            Op::GetRows => self.get_rows(node, &dst, &srcs[0], &srcs[1]),
            Op::SetRows => self.set_rows(node, &dst, &srcs[0], &srcs[1], &srcs[2]),
            Op::RmsNorm { eps } => self.rms_norm(node, &dst, &srcs[0], eps),
            Op::SoftMax { scale } => self.soft_max(node, &dst, &srcs[0], srcs.get(1), scale),
            Op::Rope {
                mode,
                n_dims,
                theta_base,
            } => self.rope(node, &dst, &srcs[0], &srcs[1], mode, n_dims, theta_base),
            Op::Argmax => self.argmax(node, &dst, &srcs[0]),
            Op::MulMat => match plan {
                Some(p) => matmul::run(self, node, &p, &dst, &srcs[0], &srcs[1], op_regions),
                None => Err(kernel_err(node, "no matmul plan")),
            },
            Op::MulMatId => self.mul_mat_id(node, &dst, &srcs[0], &srcs[1], &srcs[2], &srcs[3]),
            Op::Penalize => self.penalize(node, &dst, &srcs[0], &srcs[1], &srcs[2]),
            Op::Sample => self.sample(node, &dst, &srcs[0], &srcs[1], &srcs[2]),
            Op::Input | Op::Weight | Op::Persistent | Op::View => Err(kernel_err(
                node,
                "has no kernel (leaves and views are not executed)",
            )),
        }
    }

    fn elementwise(&self, node: &ExecNode, dst: &Dev, s: &[Dev]) -> Result<()> {
        float_dst(node, dst)?;
        if let Some(bad) = s.iter().find(|x| !x.dtype.is_float()) {
            return Err(kernel_err(
                node,
                format!("sources must be float tensors, got {}", bad.dtype),
            ));
        }
        let a = &s[0];
        same_shape(node, "first source", a, dst)?;
        let n = dst.numel();
        let (code, binary) = match node.op {
            Op::Scale { .. } => (0, false),
            Op::Silu => (1, false),
            Op::Gelu => (2, false),
            Op::Add => (10, true),
            Op::Mul => (11, true),
            _ => (12, true),
        };
        if !binary {
            let scale = match node.op {
                Op::Scale { scale } => scale,
                _ => 1.0,
            };
            if n == 0 {
                return Ok(());
            }
            let l = self.lay(node, &dst.shape, &[&dst.strides, &a.strides])?;
            let args = Args::new()
                .arg(code)
                .arg(n as i64)
                .arg(l)
                .arg(dst.ptr)
                .arg(dt(dst.dtype))
                .arg(a.ptr)
                .arg(dt(a.dtype))
                .arg(scale);
            return self.launch(node, Kernel::EwUnary, grid_for(n), BLOCK, args);
        }
        let b = &s[1];
        let b_strides = if node.op == Op::SwiGlu {
            same_shape(node, "up", b, dst)?;
            b.strides.clone()
        } else {
            broadcast_strides(&b.shape, &b.strides, &dst.shape).ok_or_else(|| {
                kernel_err(
                    node,
                    format!("cannot broadcast {:?} onto {:?}", b.shape, dst.shape),
                )
            })?
        };
        if n == 0 {
            return Ok(());
        }
        let l = self.lay(node, &dst.shape, &[&dst.strides, &a.strides, &b_strides])?;
        let args = Args::new()
            .arg(code)
            .arg(n as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(a.ptr)
            .arg(dt(a.dtype))
            .arg(b.ptr)
            .arg(dt(b.dtype));
        self.launch(node, Kernel::EwBinary, grid_for(n), BLOCK, args)
    }

    fn cpy(&self, node: &ExecNode, dst: &Dev, src: &Dev) -> Result<()> {
        same_shape(node, "source", src, dst)?;
        check_kinds(node, src.dtype, dst.dtype)?;
        self.copy(node, src, dst)
    }

    fn concat(&self, node: &ExecNode, dst: &Dev, a: &Dev, b: &Dev, axis: usize) -> Result<()> {
        let (sa, sb, sd) = (&a.shape, &b.shape, &dst.shape);
        let ok = sa.len() == sb.len()
            && sd.len() == sa.len()
            && axis < sa.len()
            && (0..sa.len()).all(|i| {
                if i == axis {
                    sd[i] == sa[i] + sb[i]
                } else {
                    sa[i] == sb[i] && sd[i] == sa[i]
                }
            });
        if !ok {
            return Err(kernel_err(
                node,
                format!("cannot concatenate {sa:?} and {sb:?} along axis {axis} into {sd:?}"),
            ));
        }
        check_kinds(node, a.dtype, dst.dtype)?;
        check_kinds(node, b.dtype, dst.dtype)?;
        self.copy(node, a, &dst.slice_axis(axis, 0, sa[axis]))?;
        self.copy(node, b, &dst.slice_axis(axis, sa[axis], sb[axis]))
    }

    fn get_rows(&self, node: &ExecNode, dst: &Dev, table: &Dev, ids: &Dev) -> Result<()> {
        float_dst(node, dst)?;
        let quant = qt(table.dtype);
        if quant.is_none() {
            float_src(node, "table", table)?;
        }
        let want: Vec<usize> = ids
            .shape
            .iter()
            .copied()
            .chain(table.shape.get(1).copied())
            .collect();
        if table.rank() != 2 || dst.shape != want {
            return Err(kernel_err(
                node,
                format!(
                    "table {:?} and ids {:?} need a result of shape ids.shape + [d], got {:?}",
                    table.shape, ids.shape, dst.shape
                ),
            ));
        }
        if ids.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("ids must be i32, got {}", ids.dtype),
            ));
        }
        let (n_table, d) = (table.shape[0], table.shape[1]);
        let rows = ids.numel();
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let (_, dst_lead) = dst.leading();
        let l = self.lay(node, &ids.shape, &[&dst_lead, &ids.strides])?;
        let tag = self.tag(node);
        if let Some(code) = quant {
            // Rows of a block table are whole blocks with contiguous values (the graph keeps
            // them so); the kernel takes the row stride in bytes.
            let rs = if n_table > 1 { table.strides[0] } else { 0 };
            let row_bytes = quant_row_bytes(table.dtype, rs);
            let (Some(row_bytes), 1) = (row_bytes, table.strides[1]) else {
                return Err(kernel_err(
                    node,
                    format!(
                        "a {} table needs rows of whole blocks with contiguous values, got strides {:?}",
                        table.dtype, table.strides
                    ),
                ));
            };
            let args = Args::new()
                .arg(rows as i64)
                .arg(d as i64)
                .arg(l)
                .arg(dst.ptr)
                .arg(dt(dst.dtype))
                .arg(dst.last_stride() as i64)
                .arg(table.ptr)
                .arg(code)
                .arg(row_bytes as i64)
                .arg(n_table as i64)
                .arg(ids.ptr)
                .arg(self.inner.err_word.dev())
                .arg(tag);
            return self.launch(
                node,
                Kernel::GetRowsQ(code),
                grid_for(rows * d / 16),
                BLOCK,
                args,
            );
        }
        let args = Args::new()
            .arg(rows as i64)
            .arg(d as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(table.ptr)
            .arg(dt(table.dtype))
            .arg(table.strides[0] as i64)
            .arg(table.strides[1] as i64)
            .arg(n_table as i64)
            .arg(ids.ptr)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(node, Kernel::GetRows, grid_for(rows * d), BLOCK, args)
    }

    fn set_rows(
        &self,
        node: &ExecNode,
        dst: &Dev,
        target: &Dev,
        src: &Dev,
        idx: &Dev,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "src", src)?;
        let (sd, ss, si) = (&dst.shape, &src.shape, &idx.shape);
        if sd.len() != 2
            || ss.len() != 2
            || ss[1] != sd[1]
            || si[..] != [ss[0]]
            || &target.shape != sd
        {
            return Err(kernel_err(
                node,
                format!(
                    "expects dst [n, d], src [m, d], indices [m]; got {sd:?} (target {:?}), {ss:?}, {si:?}",
                    target.shape
                ),
            ));
        }
        if idx.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("indices must be i32, got {}", idx.dtype),
            ));
        }
        let (n, d, m) = (sd[0], sd[1], ss[0]);
        if m == 0 || d == 0 {
            return Ok(());
        }
        let tag = self.tag(node);
        let args = Args::new()
            .arg(m as i64)
            .arg(d as i64)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.strides[0] as i64)
            .arg(dst.strides[1] as i64)
            .arg(n as i64)
            .arg(src.ptr)
            .arg(dt(src.dtype))
            .arg(src.strides[0] as i64)
            .arg(src.strides[1] as i64)
            .arg(idx.ptr)
            .arg(idx.strides[0] as i64)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(
            node,
            Kernel::SetRows,
            rows_grid(m),
            row_block(d.max(m)),
            args,
        )
    }

    fn rms_norm(&self, node: &ExecNode, dst: &Dev, x: &Dev, eps: f32) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        let (len, rows) = (x.last_len(), x.numel() / x.last_len().max(1));
        if len == 0 || rows == 0 {
            return Ok(());
        }
        let ((lead, xs), (_, ds)) = (x.leading(), dst.leading());
        let l = self.lay(node, &lead, &[&ds, &xs])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64)
            .arg(eps);
        self.launch(node, Kernel::RmsNorm, rows_grid(rows), row_block(len), args)
    }

    fn soft_max(
        &self,
        node: &ExecNode,
        dst: &Dev,
        x: &Dev,
        mask: Option<&Dev>,
        scale: f32,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        let mask_strides = match mask {
            None => None,
            Some(m) => {
                float_src(node, "mask", m)?;
                Some(
                    broadcast_strides(&m.shape, &m.strides, &x.shape).ok_or_else(|| {
                        kernel_err(
                            node,
                            format!("mask {:?} does not broadcast onto {:?}", m.shape, x.shape),
                        )
                    })?,
                )
            }
        };
        let (len, rows) = (x.last_len(), x.numel() / x.last_len().max(1));
        if len == 0 || rows == 0 {
            return Ok(());
        }
        let ((lead, xs), (_, ds)) = (x.leading(), dst.leading());
        let r = lead.len();
        let ms: Vec<usize> = mask_strides
            .as_ref()
            .map(|m| m[..r].to_vec())
            .unwrap_or_else(|| vec![0; r]);
        let m_cs = mask_strides
            .as_ref()
            .and_then(|m| m.last().copied())
            .unwrap_or(0);
        let l = self.lay(node, &lead, &[&ds, &xs, &ms])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.last_stride() as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64)
            .arg(mask.map(|m| m.ptr).unwrap_or(0))
            .arg(mask.map(|m| dt(m.dtype)).unwrap_or(0))
            .arg(m_cs as i64)
            .arg(mask.is_some() as i32)
            .arg(scale);
        if len <= SOFT_MAX_ROWS_MAX {
            // A warp per row, 8 rows per block (norm.cu `soft_max_rows`).
            let grid = rows.div_ceil(8).clamp(1, 65_535) as u32;
            return self.launch(node, Kernel::SoftMaxRows, grid, 256, args);
        }
        self.launch(node, Kernel::SoftMax, rows_grid(rows), row_block(len), args)
    }

    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        node: &ExecNode,
        dst: &Dev,
        x: &Dev,
        pos: &Dev,
        mode: RopeMode,
        n_dims: usize,
        theta_base: f32,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "x", x)?;
        same_shape(node, "x", x, dst)?;
        if x.rank() != 3 || pos.dtype != DType::I32 || pos.shape[..] != [x.shape[0]] {
            return Err(kernel_err(
                node,
                format!(
                    "expects x [T, H, D] and i32 positions [T]; got {:?} and {} {:?}",
                    x.shape, pos.dtype, pos.shape
                ),
            ));
        }
        let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
        if n_dims == 0 || n_dims % 2 == 1 || n_dims > d {
            return Err(kernel_err(
                node,
                format!("n_dims {n_dims} must be even, > 0 and <= head_dim {d}"),
            ));
        }
        let total = t * h * (n_dims / 2 + (d - n_dims));
        if total == 0 {
            return Ok(());
        }
        let args = rope_args(dst, x, pos, mode, n_dims, theta_base);
        self.launch(node, Kernel::Rope, grid_for(total), BLOCK, args)
    }

    fn argmax(&self, node: &ExecNode, dst: &Dev, x: &Dev) -> Result<()> {
        float_src(node, "x", x)?;
        if dst.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("result must be i32, got {}", dst.dtype),
            ));
        }
        let (lead, xs) = x.leading();
        if x.rank() == 0 || dst.shape != lead {
            return Err(kernel_err(
                node,
                format!(
                    "x {:?} needs a result of shape {lead:?}, got {:?}",
                    x.shape, dst.shape
                ),
            ));
        }
        let (len, rows) = (x.last_len(), lead.iter().product::<usize>());
        if rows == 0 {
            return Ok(());
        }
        if len == 0 {
            return Err(kernel_err(
                node,
                format!("argmax of an empty last axis ({:?})", x.shape),
            ));
        }
        // The result is an i32 index, and the kernel's lanes exchange indices as 32-bit words.
        if len > i32::MAX as usize {
            return Err(kernel_err(
                node,
                format!("argmax over {len} values: at most 2^31 - 1 per row"),
            ));
        }
        let l = self.lay(node, &lead, &[&dst.strides, &xs])?;
        let args = Args::new()
            .arg(rows as i64)
            .arg(len as i64)
            .arg(l)
            .arg(dst.ptr)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.last_stride() as i64);
        // A long row (logits over a vocabulary) is one block's work: the widest block the
        // kernel's shared arrays hold keeps each thread's serial part short.
        let block = if len >= 8192 { 1024 } else { 256 };
        self.launch(node, Kernel::Argmax, rows_grid(rows), block, args)
    }

    /// `Op::Penalize` (kernels/sample.cu `penalize`): the shape and dtype checks of the CPU
    /// kernel, then one block per row.
    fn penalize(
        &self,
        node: &ExecNode,
        dst: &Dev,
        logits: &Dev,
        hist: &Dev,
        params: &Dev,
    ) -> Result<()> {
        if logits.rank() != 2 {
            return Err(kernel_err(
                node,
                format!("logits must be [R, V], got {:?}", logits.shape),
            ));
        }
        let (rows, v) = (logits.shape[0], logits.shape[1]);
        expect(node, "logits", logits, DType::F32, &[rows, v])?;
        expect(node, "result", dst, DType::F32, &[rows, v])?;
        if hist.rank() != 2 {
            return Err(kernel_err(
                node,
                format!("hist must be [R, N], got {:?}", hist.shape),
            ));
        }
        let n = hist.shape[1];
        expect(node, "hist", hist, DType::I32, &[rows, n])?;
        expect(node, "params", params, DType::F32, &[rows, 3])?;
        if rows == 0 || v == 0 {
            return Ok(());
        }
        let args = Args::new()
            .arg(rows as i64)
            .arg(v as i64)
            .arg(n as i64)
            .arg(dst.ptr)
            .arg(dst.strides[0] as i64)
            .arg(dst.strides[1] as i64)
            .arg(logits.ptr)
            .arg(logits.strides[0] as i64)
            .arg(logits.strides[1] as i64)
            .arg(hist.ptr)
            .arg(hist.strides[0] as i64)
            .arg(hist.strides[1] as i64)
            .arg(params.ptr)
            .arg(params.strides[0] as i64)
            .arg(params.strides[1] as i64);
        self.launch(
            node,
            Kernel::Penalize,
            rows_grid(rows),
            sample_block(v),
            args,
        )
    }

    /// `Op::Sample` (kernels/sample.cu `sample`): the checks of the CPU kernel, then one block
    /// per row.
    fn sample(
        &self,
        node: &ExecNode,
        dst: &Dev,
        logits: &Dev,
        params: &Dev,
        key: &Dev,
    ) -> Result<()> {
        if logits.rank() != 2 || logits.shape[1] == 0 {
            return Err(kernel_err(
                node,
                format!("logits must be [R, V] with V > 0, got {:?}", logits.shape),
            ));
        }
        let (rows, v) = (logits.shape[0], logits.shape[1]);
        expect(node, "logits", logits, DType::F32, &[rows, v])?;
        expect(node, "result", dst, DType::I32, &[rows])?;
        expect(node, "params", params, DType::F32, &[rows, 4])?;
        expect(node, "key", key, DType::I32, &[rows, 2])?;
        // The token is an i32 and the noise is counted by a u32 index.
        if v > i32::MAX as usize {
            return Err(kernel_err(
                node,
                format!("sampling over {v} values: at most 2^31 - 1 per row"),
            ));
        }
        if rows == 0 {
            return Ok(());
        }
        let args = Args::new()
            .arg(rows as i64)
            .arg(v as i64)
            .arg(dst.ptr)
            .arg(dst.strides[0] as i64)
            .arg(logits.ptr)
            .arg(logits.strides[0] as i64)
            .arg(logits.strides[1] as i64)
            .arg(params.ptr)
            .arg(params.strides[0] as i64)
            .arg(params.strides[1] as i64)
            .arg(key.ptr)
            .arg(key.strides[0] as i64)
            .arg(key.strides[1] as i64);
        self.launch(node, Kernel::Sample, rows_grid(rows), sample_block(v), args)
    }

    fn mul_mat_id(
        &self,
        node: &ExecNode,
        dst: &Dev,
        experts: &Dev,
        x: &Dev,
        ids: &Dev,
        w: &Dev,
    ) -> Result<()> {
        float_dst(node, dst)?;
        float_src(node, "experts", experts)?;
        float_src(node, "x", x)?;
        float_src(node, "weights", w)?;
        let (se, sx, si, sw) = (&experts.shape, &x.shape, &ids.shape, &w.shape);
        let ok = se.len() == 3
            && sx.len() == 2
            && sx[1] == se[1]
            && si.len() == 2
            && si[0] == sx[0]
            && sw == si
            && dst.shape[..] == [sx[0], se[2]];
        if !ok {
            return Err(kernel_err(
                node,
                format!(
                    "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; \
                     got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
                    dst.shape
                ),
            ));
        }
        if ids.dtype != DType::I32 {
            return Err(kernel_err(
                node,
                format!("ids must be i32, got {}", ids.dtype),
            ));
        }
        let (n_exp, k, n) = (se[0], se[1], se[2]);
        let (t, slots) = (si[0], si[1]);
        if dst.numel() == 0 {
            return Ok(());
        }
        let tag = self.tag(node);
        let args = Args::new()
            .arg(t as i64)
            .arg(n as i64)
            .arg(k as i64)
            .arg(slots as i64)
            .arg(n_exp as i64)
            .arg(dst.ptr)
            .arg(dt(dst.dtype))
            .arg(dst.strides[0] as i64)
            .arg(dst.strides[1] as i64)
            .arg(experts.ptr)
            .arg(dt(experts.dtype))
            .arg(experts.strides[0] as i64)
            .arg(experts.strides[1] as i64)
            .arg(experts.strides[2] as i64)
            .arg(x.ptr)
            .arg(dt(x.dtype))
            .arg(x.strides[0] as i64)
            .arg(x.strides[1] as i64)
            .arg(ids.ptr)
            .arg(ids.strides[0] as i64)
            .arg(ids.strides[1] as i64)
            .arg(w.ptr)
            .arg(dt(w.dtype))
            .arg(w.strides[0] as i64)
            .arg(w.strides[1] as i64)
            .arg(self.inner.err_word.dev())
            .arg(tag);
        self.launch(node, Kernel::MulMatId, grid_for(t * n), BLOCK, args)
    }
}

/// The leading parameters of the `rope` kernel, which `rope_rows` (fusion/rope_rows.cu) shares: shape of x
/// [T, H, D], result r and x with their dtypes and strides, positions, rotated dims, base and
/// mode.
pub(crate) fn rope_args(
    r: &Dev,
    x: &Dev,
    pos: &Dev,
    mode: RopeMode,
    n_dims: usize,
    theta_base: f32,
) -> Args {
    Args::new()
        .arg(x.shape[0] as i64)
        .arg(x.shape[1] as i64)
        .arg(x.shape[2] as i64)
        .arg(r.ptr)
        .arg(dt(r.dtype))
        .arg(r.strides[0] as i64)
        .arg(r.strides[1] as i64)
        .arg(r.strides[2] as i64)
        .arg(x.ptr)
        .arg(dt(x.dtype))
        .arg(x.strides[0] as i64)
        .arg(x.strides[1] as i64)
        .arg(x.strides[2] as i64)
        .arg(pos.ptr)
        .arg(pos.strides[0] as i64)
        .arg(n_dims as i64)
        .arg(theta_base as f64)
        .arg((mode == RopeMode::Neox) as i32)
}

/// Threads per block of the sampler's kernels: a row of logits over a vocabulary is one block's
/// work, and its many passes (bisections) want the widest block; a short row a small one.
fn sample_block(len: usize) -> u32 {
    if len >= 4096 {
        1024
    } else {
        row_block(len)
    }
}

/// An error unless `t` (`what`) is `dtype` of exactly `shape` (the CPU kernels' wording).
fn expect(node: &ExecNode, what: &str, t: &Dev, dtype: DType, shape: &[usize]) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(kernel_err(
            node,
            format!(
                "{what} must be {dtype} {shape:?}, got {} {:?}",
                t.dtype, t.shape
            ),
        ));
    }
    Ok(())
}

fn same_shape(node: &ExecNode, what: &str, src: &Dev, dst: &Dev) -> Result<()> {
    if src.shape != dst.shape {
        return Err(kernel_err(
            node,
            format!(
                "{what} has shape {:?} but the result has {:?}",
                src.shape, dst.shape
            ),
        ));
    }
    Ok(())
}

fn check_kinds(node: &ExecNode, src: DType, dst: DType) -> Result<()> {
    if src.is_float() != dst.is_float() {
        return Err(kernel_err(node, format!("cannot convert {src} to {dst}")));
    }
    Ok(())
}
