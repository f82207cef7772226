//! Planning one compute node as dispatches: shape checks, kernel variant, bindings, push
//! constants and workgroup counts.
//!
//! Why: kernels index memory with 32-bit element offsets and strides and trust them; every
//! check that keeps a dispatch in bounds happens here, on the host, before anything is
//! recorded, and a bad node becomes `Error::Kernel` (the CPU oracle's wording where it has
//! one) instead of a device fault.
//!
//! Strategy: each source and the destination arrive resolved to a `VkBuffer` and a byte
//! offset ([`Res`]). A tensor is bound as exactly the bytes it spans (start aligned down to the
//! device's storage offset alignment, end up to a 4-byte word), so the hazard tracker and the
//! synchronization validation layer see the same ranges; the remaining element offset and the
//! element strides go in push constants. Element-wise views are coalesced (size-1 axes
//! dropped, contiguous neighbours merged) and padded to rank 4; row kernels take up to three
//! leading axes. `Concat` is two copies into slices of its destination.
//!
//! Invariants: every element index a kernel can form lies inside its binding; every count a
//! kernel divides by is at least 1; dispatch sizes respect `maxComputeWorkGroupCount`.

use ash::vk;
use bytemuck::{Pod, Zeroable};
use lowsync_backend::{Error, ExecNode, Result};
use lowsync_graph::{DType, Op, RopeMode};

use crate::pipelines::Bind;

/// A tensor resolved to device memory.
#[derive(Clone, Debug)]
pub(crate) struct Res {
    pub buffer: vk::Buffer,
    /// Size of the `VkBuffer`.
    pub buffer_size: u64,
    /// Byte offset of element `[0, .., 0]`.
    pub base: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl Res {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes from `base` to one past the furthest element (0 when empty).
    pub(crate) fn byte_extent(&self) -> u64 {
        if self.numel() == 0 {
            return 0;
        }
        let last: usize = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum();
        ((last + 1) * self.dtype.size_bytes()) as u64
    }

    fn rank(&self) -> usize {
        self.shape.len()
    }

    /// `self[.., start..start + len, ..]` along `axis`.
    fn slice_axis(&self, axis: usize, start: usize, len: usize) -> Res {
        let mut r = self.clone();
        r.base += (start * self.strides[axis] * self.dtype.size_bytes()) as u64;
        r.shape[axis] = len;
        r
    }

    /// The view broadcast (numpy rules) to `shape`; `None` when it does not broadcast.
    fn broadcast_to(&self, shape: &[usize]) -> Option<Vec<usize>> {
        if shape.len() < self.rank() {
            return None;
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (ax, &want) in shape.iter().enumerate().skip(lead) {
            let (d, s) = (self.shape[ax - lead], self.strides[ax - lead]);
            strides[ax] = if d == want {
                s
            } else if d == 1 {
                0
            } else {
                return None;
            };
        }
        Some(strides)
    }
}

/// Push constants: eight `uvec4`s (128 bytes, the guaranteed minimum), named as the kernels
/// name them; each kernel's header says what its fields hold.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub(crate) struct Push {
    pub shape: [u32; 4],
    pub d_str: [u32; 4],
    pub a_str: [u32; 4],
    pub b_str: [u32; 4],
    pub offs: [u32; 4],
    pub op: [u32; 4],
    pub prm: [u32; 4],
    pub pad: [u32; 4],
}

/// One dispatch to record.
#[derive(Clone, Debug)]
pub(crate) struct Dispatch {
    /// Kernel variant name (`kernel.slot_dtype...`, as `build.rs` names it).
    pub kernel: String,
    pub binds: Vec<Bind>,
    pub push: Push,
    pub groups: [u32; 3],
}

/// What a planner needs to know about the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// `minStorageBufferOffsetAlignment` (a power of two).
    pub offset_align: u64,
    pub max_range: u64,
    pub max_groups: [u32; 3],
    pub has_f64: bool,
}

/// An index-checking kernel's error slot: the status binding and the tag naming this node.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Status {
    pub bind: Bind,
    pub tag: u32,
}

pub(crate) fn kernel_err(node: &ExecNode, msg: impl Into<String>) -> Error {
    node.kernel_error(msg)
}

fn dt(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I32 => "i32",
    }
}

struct Ctx<'a> {
    node: &'a ExecNode,
    lim: Limits,
}

impl Ctx<'_> {
    fn err(&self, msg: impl Into<String>) -> Error {
        kernel_err(self.node, msg)
    }

    fn u32(&self, v: usize, what: &str) -> Result<u32> {
        u32::try_from(v).map_err(|_| self.err(format!("{what} {v} does not fit in 32 bits")))
    }

    fn u4(&self, v: &[usize], what: &str) -> Result<[u32; 4]> {
        let mut out = [0u32; 4];
        for (o, &x) in out.iter_mut().zip(v) {
            *o = self.u32(x, what)?;
        }
        Ok(out)
    }

    /// Binds `r` and returns the binding and the element offset of `[0, .., 0]` inside it.
    fn bind(&self, r: &Res, write: bool) -> Result<(Bind, u32)> {
        let esize = r.dtype.size_bytes() as u64;
        if !r.base.is_multiple_of(esize) {
            return Err(self.err(format!(
                "a {} tensor at byte offset {} is not aligned to its element size",
                r.dtype, r.base
            )));
        }
        let end = r.base + r.byte_extent().max(esize);
        if end > r.buffer_size {
            return Err(self.err(format!(
                "tensor of {} bytes at offset {} lies outside its buffer of {} bytes",
                r.byte_extent(),
                r.base,
                r.buffer_size
            )));
        }
        let start = r.base & !(self.lim.offset_align - 1);
        let end = ((end + 3) & !3).min(r.buffer_size);
        let range = end - start;
        if range > self.lim.max_range {
            return Err(self.err(format!(
                "tensor spans {range} bytes, above this device's maxStorageBufferRange of {}",
                self.lim.max_range
            )));
        }
        let off = self.u32(((r.base - start) / esize) as usize, "element offset")?;
        Ok((
            Bind {
                buffer: r.buffer,
                offset: start,
                range,
                write,
            },
            off,
        ))
    }

    /// Workgroups for `threads` threads in groups of `wg`, spread over x and y.
    fn spread(&self, threads: usize, wg: usize) -> Result<[u32; 3]> {
        let groups = threads.div_ceil(wg).max(1);
        let max_x = self.lim.max_groups[0].max(1) as usize;
        let x = groups.min(max_x);
        let y = groups.div_ceil(x);
        if y > self.lim.max_groups[1] as usize {
            return Err(self.err(format!("{threads} threads exceed the dispatch limits")));
        }
        Ok([x as u32, y as u32, 1])
    }

    fn float(&self, what: &str, d: DType) -> Result<()> {
        if !d.is_float() {
            return Err(self.err(format!("{what} must be a float tensor, got {d}")));
        }
        Ok(())
    }

    fn same_shape(&self, what: &str, a: &Res, d: &Res) -> Result<()> {
        if a.shape != d.shape {
            return Err(self.err(format!(
                "{what} has shape {:?} but the result has {:?}",
                a.shape, d.shape
            )));
        }
        Ok(())
    }
}

/// Drops size-1 axes and merges neighbours that are contiguous in every view.
fn coalesce(shape: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let keep: Vec<usize> = (0..shape.len()).filter(|&i| shape[i] != 1).collect();
    let mut sh: Vec<usize> = Vec::new();
    let mut st: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for &ax in &keep {
        let merge = !sh.is_empty()
            && strides
                .iter()
                .enumerate()
                .all(|(t, s)| st[t].last().copied() == Some(s[ax] * shape[ax]));
        if merge {
            let last = sh.len() - 1;
            sh[last] *= shape[ax];
            for (t, s) in strides.iter().enumerate() {
                let l = st[t].len() - 1;
                st[t][l] = s[ax];
            }
        } else {
            sh.push(shape[ax]);
            for (t, s) in strides.iter().enumerate() {
                st[t].push(s[ax]);
            }
        }
    }
    (sh, st)
}

/// Left-pads to rank `n` (shape 1, stride 0); `None` when the rank is above `n`.
fn pad(shape: &[usize], strides: &[Vec<usize>], n: usize) -> Option<(Vec<usize>, Vec<Vec<usize>>)> {
    if shape.len() > n {
        return None;
    }
    let k = n - shape.len();
    let sh = std::iter::repeat_n(1, k)
        .chain(shape.iter().copied())
        .collect();
    let st = strides
        .iter()
        .map(|s| std::iter::repeat_n(0, k).chain(s.iter().copied()).collect())
        .collect();
    Some((sh, st))
}

/// Plans `node` with its resolved destination and sources.
pub(crate) fn plan(
    node: &ExecNode,
    dst: &Res,
    srcs: &[Res],
    status: Option<Status>,
    lim: Limits,
) -> Result<Vec<Dispatch>> {
    let c = Ctx { node, lim };
    if dst.numel() == 0 {
        return Ok(Vec::new());
    }
    match node.op {
        Op::Add | Op::Mul | Op::SwiGlu | Op::Scale { .. } | Op::Silu | Op::Gelu => {
            eltwise(&c, dst, srcs)
        }
        Op::Cpy => copy(&c, dst, &srcs[0]).map(|d| vec![d]),
        Op::Concat { axis } => concat(&c, dst, &srcs[0], &srcs[1], axis),
        Op::RmsNorm { eps } => row_kernel(&c, "rms_norm", dst, &srcs[0], None, eps),
        Op::SoftMax { scale } => row_kernel(&c, "soft_max", dst, &srcs[0], srcs.get(1), scale),
        Op::Argmax => argmax(&c, dst, &srcs[0]),
        Op::Rope {
            mode,
            n_dims,
            theta_base,
        } => rope(&c, dst, &srcs[0], &srcs[1], mode, n_dims, theta_base),
        Op::GetRows => get_rows(&c, dst, &srcs[0], &srcs[1], status),
        Op::SetRows => set_rows(&c, dst, &srcs[1], &srcs[2], status),
        Op::MulMat => mul_mat(&c, dst, &srcs[0], &srcs[1]),
        Op::MulMatId => mul_mat_id(&c, dst, &srcs[0], &srcs[1], &srcs[2], &srcs[3], status),
        Op::Input | Op::Weight | Op::Persistent | Op::View => {
            Err(c.err("has no kernel (leaves and views are not executed)"))
        }
    }
}

/// A 4-D element-wise dispatch of `kernel` over `dst` with sources `a` and `b` (strides
/// already broadcast to `dst`'s shape).
fn elementwise_dispatch(
    c: &Ctx,
    kernel: String,
    dst: &Res,
    a: (&Res, Vec<usize>),
    b: (&Res, Vec<usize>),
    op: u32,
    prm: u32,
) -> Result<Dispatch> {
    let (sh, st) = coalesce(&dst.shape, &[dst.strides.clone(), a.1, b.1]);
    let (sh, st) = pad(&sh, &st, 4).ok_or_else(|| {
        c.err(format!(
            "views of shape {:?} do not reduce to 4 dimensions",
            dst.shape
        ))
    })?;
    let n = dst.numel();
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(a.0, false)?;
    let (bb, ob) = c.bind(b.0, false)?;
    let push = Push {
        shape: c.u4(&sh, "extent")?,
        d_str: c.u4(&st[0], "stride")?,
        a_str: c.u4(&st[1], "stride")?,
        b_str: c.u4(&st[2], "stride")?,
        offs: [od, oa, ob, c.u32(n, "element count")?],
        op: [op, 0, 0, 0],
        prm: [prm, 0, 0, 0],
        pad: [0; 4],
    };
    Ok(Dispatch {
        kernel,
        binds: vec![bd, ba, bb],
        push,
        groups: c.spread(n, 256)?,
    })
}

fn eltwise(c: &Ctx, dst: &Res, s: &[Res]) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    for x in s {
        c.float("sources", x.dtype)?;
    }
    let a = &s[0];
    c.same_shape("first source", a, dst)?;
    let (code, scale) = match c.node.op {
        Op::Add => (0, 0.0),
        Op::Mul => (1, 0.0),
        Op::Scale { scale } => (2, scale),
        Op::Silu => (3, 0.0),
        Op::Gelu => (4, 0.0),
        Op::SwiGlu => (5, 0.0),
        _ => return Err(c.err("is not element-wise")),
    };
    let b = match c.node.op {
        Op::Add | Op::Mul => {
            let b = &s[1];
            let st = b.broadcast_to(&dst.shape).ok_or_else(|| {
                c.err(format!(
                    "cannot broadcast {:?} onto {:?}",
                    b.shape, dst.shape
                ))
            })?;
            (b, st)
        }
        Op::SwiGlu => {
            c.same_shape("up", &s[1], dst)?;
            (&s[1], s[1].strides.clone())
        }
        _ => (a, a.strides.clone()),
    };
    let kernel = format!(
        "eltwise.d_{}.a_{}.b_{}",
        dt(dst.dtype),
        dt(a.dtype),
        dt(b.0.dtype)
    );
    let d = elementwise_dispatch(
        c,
        kernel,
        dst,
        (a, a.strides.clone()),
        b,
        code,
        scale.to_bits(),
    )?;
    Ok(vec![d])
}

fn copy(c: &Ctx, dst: &Res, src: &Res) -> Result<Dispatch> {
    c.same_shape("source", src, dst)?;
    if src.dtype.is_float() != dst.dtype.is_float() {
        return Err(c.err(format!("cannot convert {} to {}", src.dtype, dst.dtype)));
    }
    let kernel = if dst.dtype == DType::I32 {
        "copy_raw.d_u32.a_u32".to_string()
    } else {
        format!(
            "eltwise.d_{}.a_{}.b_{}",
            dt(dst.dtype),
            dt(src.dtype),
            dt(src.dtype)
        )
    };
    let (d, s) = (dst.clone(), src.clone());
    let mut disp = elementwise_dispatch(
        c,
        kernel,
        &d,
        (&s, s.strides.clone()),
        (&s, s.strides.clone()),
        6,
        0,
    )?;
    if dst.dtype == DType::I32 {
        // copy_raw has two bindings.
        disp.binds.truncate(2);
    }
    Ok(disp)
}

fn concat(c: &Ctx, dst: &Res, a: &Res, b: &Res, axis: usize) -> Result<Vec<Dispatch>> {
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
        return Err(c.err(format!(
            "cannot concatenate {sa:?} and {sb:?} along axis {axis} into {sd:?}"
        )));
    }
    let mut out = Vec::new();
    for (src, start) in [(a, 0), (b, sa[axis])] {
        if src.numel() > 0 {
            out.push(copy(c, &dst.slice_axis(axis, start, src.shape[axis]), src)?);
        }
    }
    Ok(out)
}

/// Rows of a view (all axes but the last) coalesced to at most three, for several views.
fn rows3(c: &Ctx, lead: &[usize], strides: &[Vec<usize>]) -> Result<([u32; 4], Vec<[u32; 4]>)> {
    let (sh, st) = coalesce(lead, strides);
    let (sh, st) = pad(&sh, &st, 3).ok_or_else(|| {
        c.err(format!(
            "leading axes {lead:?} do not reduce to 3 dimensions"
        ))
    })?;
    let shape = c.u4(&sh, "extent")?;
    let st = st
        .iter()
        .map(|s| c.u4(s, "stride"))
        .collect::<Result<Vec<_>>>()?;
    Ok((shape, st))
}

/// RmsNorm and SoftMax: one workgroup per row of the last axis.
fn row_kernel(
    c: &Ctx,
    kernel: &str,
    dst: &Res,
    x: &Res,
    mask: Option<&Res>,
    prm: f32,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("x", x.dtype)?;
    c.same_shape("x", x, dst)?;
    let r = x.rank();
    if r == 0 {
        return Err(c.err("needs at least one axis"));
    }
    let len = x.shape[r - 1];
    if len == 0 {
        return Ok(Vec::new());
    }
    let m = match mask {
        None => None,
        Some(m) => {
            c.float("mask", m.dtype)?;
            let st = m.broadcast_to(&x.shape).ok_or_else(|| {
                c.err(format!(
                    "mask {:?} does not broadcast onto {:?}",
                    m.shape, x.shape
                ))
            })?;
            Some((m, st))
        }
    };
    let lead = &x.shape[..r - 1];
    let mut strides = vec![dst.strides[..r - 1].to_vec(), x.strides[..r - 1].to_vec()];
    if let Some((_, st)) = &m {
        strides.push(st[..r - 1].to_vec());
    }
    let (mut shape, st) = rows3(c, lead, &strides)?;
    shape[3] = c.u32(len, "row length")?;
    let rows: usize = lead.iter().product();
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let mut d_str = st[0];
    d_str[3] = c.u32(dst.strides[r - 1], "stride")?;
    let mut a_str = st[1];
    a_str[3] = c.u32(x.strides[r - 1], "stride")?;
    let mut push = Push {
        shape,
        d_str,
        a_str,
        prm: [prm.to_bits(), 0, 0, 0],
        ..Push::default()
    };
    let name;
    let mut binds = vec![bd, ba];
    if kernel == "soft_max" {
        let (mres, mst) = match &m {
            Some((mres, full)) => {
                let mut s = st[2];
                s[3] = c.u32(full[r - 1], "stride")?;
                (*mres, s)
            }
            None => (x, [0; 4]),
        };
        let (bm, om) = c.bind(mres, false)?;
        binds.push(bm);
        push.b_str = mst;
        push.offs = [od, oa, om, c.u32(rows, "row count")?];
        push.op = [u32::from(m.is_some()), 0, 0, 0];
        name = format!(
            "soft_max.d_{}.a_{}.m_{}",
            dt(dst.dtype),
            dt(x.dtype),
            dt(mres.dtype)
        );
    } else {
        push.offs = [od, oa, c.u32(rows, "row count")?, 0];
        name = format!("{kernel}.d_{}.a_{}", dt(dst.dtype), dt(x.dtype));
    }
    Ok(vec![Dispatch {
        kernel: name,
        binds,
        push,
        groups: c.spread(rows, 1)?,
    }])
}

fn argmax(c: &Ctx, dst: &Res, x: &Res) -> Result<Vec<Dispatch>> {
    c.float("x", x.dtype)?;
    if dst.dtype != DType::I32 {
        return Err(c.err(format!("result must be i32, got {}", dst.dtype)));
    }
    let r = x.rank();
    let want = &x.shape[..r.saturating_sub(1)];
    if r == 0 || dst.shape != want {
        return Err(c.err(format!(
            "x {:?} needs a result of shape {want:?}, got {:?}",
            x.shape, dst.shape
        )));
    }
    let len = x.shape[r - 1];
    let rows: usize = want.iter().product();
    if rows == 0 {
        return Ok(Vec::new());
    }
    if len == 0 {
        return Err(c.err(format!("argmax of an empty last axis ({:?})", x.shape)));
    }
    let (mut shape, st) = rows3(c, want, &[dst.strides.clone(), x.strides[..r - 1].to_vec()])?;
    shape[3] = c.u32(len, "row length")?;
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let mut a_str = st[1];
    a_str[3] = c.u32(x.strides[r - 1], "stride")?;
    Ok(vec![Dispatch {
        kernel: format!("argmax.d_i32.a_{}", dt(x.dtype)),
        binds: vec![bd, ba],
        push: Push {
            shape,
            d_str: st[0],
            a_str,
            offs: [od, oa, c.u32(rows, "row count")?, 0],
            ..Push::default()
        },
        groups: c.spread(rows, 1)?,
    }])
}

fn rope(
    c: &Ctx,
    dst: &Res,
    x: &Res,
    pos: &Res,
    mode: RopeMode,
    n_dims: usize,
    theta_base: f32,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("x", x.dtype)?;
    c.same_shape("x", x, dst)?;
    if x.rank() != 3 || pos.dtype != DType::I32 || pos.shape != [x.shape[0]] {
        return Err(c.err(format!(
            "expects x [T, H, D] and i32 positions [T]; got {:?} and {} {:?}",
            x.shape, pos.dtype, pos.shape
        )));
    }
    let (t, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
    if n_dims == 0 || n_dims % 2 == 1 || n_dims > d {
        return Err(c.err(format!(
            "n_dims {n_dims} must be even, > 0 and <= head_dim {d}"
        )));
    }
    let half = n_dims / 2;
    let per = half + (d - n_dims);
    let threads = t * h * per;
    let ratio = (theta_base as f64).powf(-2.0 / n_dims as f64);
    let hi = ratio as f32;
    let lo = (ratio - hi as f64) as f32;
    let (bd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(x, false)?;
    let (bp, op) = c.bind(pos, false)?;
    let kernel = if c.lim.has_f64 { "rope" } else { "rope_f32" };
    Ok(vec![Dispatch {
        kernel: format!("{kernel}.d_{}.a_{}.pos_i32", dt(dst.dtype), dt(x.dtype)),
        binds: vec![bd, ba, bp],
        push: Push {
            shape: c.u4(&[t, h.max(1), d, n_dims], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(&x.strides, "stride")?,
            b_str: c.u4(&pos.strides, "stride")?,
            offs: [od, oa, op, c.u32(threads, "thread count")?],
            op: [
                u32::from(mode == RopeMode::Neox),
                c.u32(half, "n_dims")?,
                c.u32(per.max(1), "row threads")?,
                0,
            ],
            prm: [hi.to_bits(), lo.to_bits(), theta_base.to_bits(), 0],
            pad: [0; 4],
        },
        groups: c.spread(threads, 256)?,
    }])
}

fn need_status(c: &Ctx, status: Option<Status>) -> Result<Status> {
    status.ok_or_else(|| c.err("index-checking kernel planned without a status slot"))
}

fn get_rows(
    c: &Ctx,
    dst: &Res,
    table: &Res,
    ids: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("table", table.dtype)?;
    let want: Vec<usize> = ids
        .shape
        .iter()
        .copied()
        .chain(table.shape.get(1).copied())
        .collect();
    if table.rank() != 2 || dst.shape != want {
        return Err(c.err(format!(
            "table {:?} and ids {:?} need a result of shape ids.shape + [d], got {:?}",
            table.shape, ids.shape, dst.shape
        )));
    }
    if ids.dtype != DType::I32 {
        return Err(c.err(format!("ids must be i32, got {}", ids.dtype)));
    }
    let (n, d) = (table.shape[0], table.shape[1]);
    let n_ids = ids.numel();
    if d == 0 || n_ids == 0 {
        return Ok(Vec::new());
    }
    let s = need_status(c, status)?;
    let r = ids.rank();
    let (mut shape, sts) = rows3(
        c,
        &ids.shape,
        &[dst.strides[..r].to_vec(), ids.strides.clone()],
    )?;
    shape[3] = c.u32(d, "row length")?;
    let mut d_str = sts[0];
    d_str[3] = c.u32(dst.strides[r], "stride")?;
    let (bd, od) = c.bind(dst, true)?;
    let (bt, ot) = c.bind(table, false)?;
    let (bi, oi) = c.bind(ids, false)?;
    Ok(vec![Dispatch {
        kernel: format!(
            "get_rows.d_{}.a_{}.ids_i32.status_u32",
            dt(dst.dtype),
            dt(table.dtype)
        ),
        binds: vec![bd, bt, bi, s.bind],
        push: Push {
            shape,
            d_str,
            a_str: c.u4(&[table.strides[0], table.strides[1], n, 0], "stride")?,
            b_str: sts[1],
            offs: [od, ot, oi, c.u32(n_ids * d, "element count")?],
            op: [s.tag, 0, 0, 0],
            ..Push::default()
        },
        groups: c.spread(n_ids * d, 256)?,
    }])
}

fn set_rows(
    c: &Ctx,
    dst: &Res,
    src: &Res,
    idx: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    c.float("result", dst.dtype)?;
    c.float("src", src.dtype)?;
    let (sd, ss, si) = (&dst.shape, &src.shape, &idx.shape);
    if sd.len() != 2 || ss.len() != 2 || ss[1] != sd[1] || si[..] != [ss[0]] {
        return Err(c.err(format!(
            "expects dst [n, d], src [m, d], indices [m]; got {sd:?}, {ss:?}, {si:?}"
        )));
    }
    if idx.dtype != DType::I32 {
        return Err(c.err(format!("indices must be i32, got {}", idx.dtype)));
    }
    let (n, d, m) = (sd[0], sd[1], ss[0]);
    if m == 0 || d == 0 {
        return Ok(Vec::new());
    }
    let s = need_status(c, status)?;
    let (bd, od) = c.bind(dst, true)?;
    let (bs, os) = c.bind(src, false)?;
    let (bi, oi) = c.bind(idx, false)?;
    Ok(vec![Dispatch {
        kernel: format!(
            "set_rows.d_{}.a_{}.ids_i32.status_u32",
            dt(dst.dtype),
            dt(src.dtype)
        ),
        binds: vec![bd, bs, bi, s.bind],
        push: Push {
            shape: c.u4(&[n, d, m, 0], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(&src.strides, "stride")?,
            b_str: c.u4(&idx.strides, "stride")?,
            offs: [od, os, oi, 0],
            op: [s.tag, 0, 0, 0],
            ..Push::default()
        },
        groups: c.spread(d, 64)?,
    }])
}

/// Rows up to which `MulMat` uses the matrix-vector kernel.
const MAT_VEC_MAX_M: usize = 8;

fn mul_mat(c: &Ctx, dst: &Res, a: &Res, b: &Res) -> Result<Vec<Dispatch>> {
    if dst.dtype != DType::F32 {
        return Err(c.err(format!("result must be f32, got {}", dst.dtype)));
    }
    c.float("a", a.dtype)?;
    c.float("b", b.dtype)?;
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        return Err(c.err(format!(
            "needs at least 2-D operands, got {:?} @ {:?}",
            a.shape, b.shape
        )));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    let nb = ra.max(rb) - 2;
    let bdim = |s: &[usize], i: usize| {
        let own = s.len() - 2;
        if i + own >= nb {
            s[i + own - nb]
        } else {
            1
        }
    };
    let bstride = |r: &Res, i: usize| {
        let own = r.rank() - 2;
        if i + own >= nb {
            r.strides[i + own - nb]
        } else {
            0
        }
    };
    let mut want = Vec::with_capacity(nb + 2);
    let mut ok = true;
    for i in 0..nb {
        let (da, db) = (bdim(&a.shape, i), bdim(&b.shape, i));
        let (lo, hi) = (da.min(db), da.max(db));
        ok &= lo == hi || hi.checked_rem(lo) == Some(0) || (lo == 0 && hi == 1);
        want.push(if lo == 0 { 0 } else { hi });
    }
    want.extend([m, n]);
    if k != k2 || !ok || dst.shape != want {
        return Err(c.err(format!(
            "cannot multiply {:?} @ {:?} into {:?}",
            a.shape, b.shape, dst.shape
        )));
    }
    // Batch axes of extent 1 in the result index nothing; at most two may remain.
    let axes: Vec<usize> = (0..nb).filter(|&i| want[i] != 1).collect();
    if axes.len() > 2 {
        return Err(c.err(format!(
            "more than two batch axes ({:?}) are not supported on Vulkan",
            &want[..nb]
        )));
    }
    let mut bd = [1usize; 2];
    let mut sd = [0usize; 2];
    let mut sa = [0usize; 2];
    let mut sb = [0usize; 2];
    let mut div = [1usize; 4];
    for (slot, &i) in (2 - axes.len()..2).zip(&axes) {
        let (da, db) = (bdim(&a.shape, i), bdim(&b.shape, i));
        bd[slot] = want[i];
        sd[slot] = dst.strides[i];
        sa[slot] = bstride(a, i);
        sb[slot] = bstride(b, i);
        div[slot] = want[i] / da.max(1);
        div[2 + slot] = want[i] / db.max(1);
    }
    let batches = bd[0] * bd[1];
    let (a_sm, a_sk) = (a.strides[ra - 2], a.strides[ra - 1]);
    let (b_sk, b_sn) = (b.strides[rb - 2], b.strides[rb - 1]);
    let (d_sm, d_sn) = (dst.strides[dst.rank() - 2], dst.strides[dst.rank() - 1]);
    let (bdd, od) = c.bind(dst, true)?;
    let (ba, oa) = c.bind(a, false)?;
    let (bb, ob) = c.bind(b, false)?;
    let push = Push {
        shape: c.u4(&[m, n, k, bd[1]], "extent")?,
        d_str: c.u4(&[sd[0], sd[1], d_sm, d_sn], "stride")?,
        a_str: c.u4(&[sa[0], sa[1], a_sm, a_sk], "stride")?,
        b_str: c.u4(&[sb[0], sb[1], b_sk, b_sn], "stride")?,
        offs: [od, oa, ob, c.u32(batches, "batch count")?],
        op: c.u4(&div, "batch ratio")?,
        prm: [
            u32::from(a_sk == 1 || k == 1),
            u32::from(b_sk == 1 || k == 1),
            0,
            0,
        ],
        pad: [0; 4],
    };
    let max = c.lim.max_groups;
    let suffix = format!("d_f32.a_{}.b_{}", dt(a.dtype), dt(b.dtype));
    if batches > max[1] as usize || batches > max[2] as usize {
        return Err(c.err(format!("{batches} batches exceed the dispatch limits")));
    }
    if m <= MAT_VEC_MAX_M {
        let ksplit = b_sk == 1 || k == 1;
        let gx = if ksplit {
            n.div_ceil(8)
        } else {
            n.div_ceil(256)
        };
        if gx <= max[0] as usize {
            let mut push = push;
            push.prm[2] = u32::from(ksplit);
            return Ok(vec![Dispatch {
                kernel: format!("mul_mat_vec.{suffix}"),
                binds: vec![bdd, ba, bb],
                push,
                groups: [gx as u32, batches as u32, 1],
            }]);
        }
    }
    let (gx, gy) = (n.div_ceil(64), m.div_ceil(64));
    if gx > max[0] as usize || gy > max[1] as usize {
        return Err(c.err(format!("a {m}x{n} product exceeds the dispatch limits")));
    }
    Ok(vec![Dispatch {
        kernel: format!("mul_mat.{suffix}"),
        binds: vec![bdd, ba, bb],
        push,
        groups: [gx as u32, gy as u32, batches as u32],
    }])
}

fn mul_mat_id(
    c: &Ctx,
    dst: &Res,
    experts: &Res,
    x: &Res,
    ids: &Res,
    w: &Res,
    status: Option<Status>,
) -> Result<Vec<Dispatch>> {
    if dst.dtype != DType::F32 {
        return Err(c.err(format!("result must be f32, got {}", dst.dtype)));
    }
    c.float("experts", experts.dtype)?;
    c.float("x", x.dtype)?;
    c.float("weights", w.dtype)?;
    let (se, sx, si, sw) = (&experts.shape, &x.shape, &ids.shape, &w.shape);
    let ok = se.len() == 3
        && sx.len() == 2
        && sx[1] == se[1]
        && si.len() == 2
        && si[0] == sx[0]
        && sw == si
        && dst.shape == [sx[0], se[2]];
    if !ok {
        return Err(c.err(format!(
            "expects experts [E, k, n], x [T, k], ids [T, K], weights [T, K], result [T, n]; \
             got {se:?}, {sx:?}, {si:?}, {sw:?}, {:?}",
            dst.shape
        )));
    }
    if ids.dtype != DType::I32 {
        return Err(c.err(format!("ids must be i32, got {}", ids.dtype)));
    }
    let (n_exp, k, n) = (se[0], se[1], se[2]);
    let (t, slots) = (si[0], si[1]);
    let s = need_status(c, status)?;
    let threads = t * n;
    let (bd, od) = c.bind(dst, true)?;
    let (be, oe) = c.bind(experts, false)?;
    let (bx, ox) = c.bind(x, false)?;
    // An empty ids/weights view still needs a binding; its kernel loop runs zero times.
    let (bi, oi) = c.bind(ids, false)?;
    let (bw, ow) = c.bind(w, false)?;
    Ok(vec![Dispatch {
        kernel: format!(
            "mul_mat_id.d_f32.a_{}.b_{}.ids_i32.w_{}.status_u32",
            dt(experts.dtype),
            dt(x.dtype),
            dt(w.dtype)
        ),
        binds: vec![bd, be, bx, bi, bw, s.bind],
        push: Push {
            shape: c.u4(&[t, n, k, slots], "extent")?,
            d_str: c.u4(&dst.strides, "stride")?,
            a_str: c.u4(
                &[
                    experts.strides[0],
                    experts.strides[1],
                    experts.strides[2],
                    n_exp,
                ],
                "stride",
            )?,
            b_str: c.u4(&x.strides, "stride")?,
            offs: [od, oe, ox, oi],
            op: c.u4(
                &[ids.strides[0], ids.strides[1], w.strides[0], w.strides[1]],
                "stride",
            )?,
            prm: [ow, s.tag, c.u32(threads, "thread count")?, 0],
            pad: [0; 4],
        },
        groups: c.spread(threads, 64)?,
    }])
}
