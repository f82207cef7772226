// The body of `mul_mat_vec_qw*`: `x @ w.T` for one row of f32 x over a 32-element block type,
// QW_ROWS rows of w per workgroup, each row spread over the whole workgroup.
//
// Why: the subgroup bodies (`mul_mat_vec_q_body.wgsl`, `mul_mat_vec_qb_body.wgsl`) give a row
// one subgroup, so on a row of 2,048 elements each lane walks its groups in a loop of a few
// dependent rounds, and x (four bytes an element, against Q4_0's 0.56) is read again for every
// row. Here a row has 128 invocations, so a lane of a 2,048-element row has two pieces, both
// loaded before either is used, and each load of x serves the workgroup's QW_ROWS rows.
//
// Strategy: a row is cut into quarters of blocks (`q_quarter`: 8 elements, 4j .. 4j + 3 and
// 16 + 4j .. 16 + 4j + 3 of block b, one word of nibbles or two of bytes); invocation i takes
// quarters i, i + 128, ... of every row of the workgroup, so a subgroup reads a contiguous run
// of blocks. Quarters go in rounds of four, then two, then one, each round's loads (x as two
// 16-byte vectors per quarter, w per row) written before any product. The subgroups' sums
// (`subgroupAdd`) meet in shared memory, one slot per subgroup and row, and the first QW_ROWS
// invocations add them in subgroup order and store.
//
// Which two rows a workgroup takes and what it stores is the flavour's (`qw_rows`,
// `q_quarter_1`, `qw_store`): rows 2x and 2x + 1 of w, each stored through `out_d`
// (`mul_mat_vec_qw_rows.wgsl`), or row x of the gate weight and of the up weight, stored as
// SwiGLU (`mul_mat_vec_qw_glu.wgsl`).
//
// Invariants (checked by the host): one row of x, contiguous along k, its offset a multiple of
// 4 elements; w starts on an even byte. A lane adds its quarters in row order and the
// reductions are fixed, so a result does not depend on timing (nor on which row shares the
// workgroup). Any subgroup size works.

// #include mul_mat_vec_head.wgsl

const QW_WG: u32 = 128u;
const QW_ROWS: u32 = 2u;

var<workgroup> qw_part: array<f32, 256>;

// x . w over quarter e of a row: the quarter `q` of w, and x's two 16-byte runs `lo`, `hi`.
fn qw_dot(q: Quarter, lo: vec4<f32>, hi: vec4<f32>) -> f32 {
    var t = q.sc.x * (dot(lo, q.lo) + dot(hi, q.hi));
    if Q_MIN {
        let s = lo + hi;
        t += q.sc.y * ((s.x + s.y) + (s.z + s.w));
    }
    return t;
}

// Byte offset of quarter e's block in the row at byte `w`.
fn qw_blk(w: u32, e: u32) -> u32 {
    return w + (e >> 2u) * QB;
}

// Element offset of quarter e's first element in x.
fn qw_x(a: u32, e: u32) -> u32 {
    return a + (e >> 2u) * 32u + (e & 3u) * 4u;
}

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    let rows = qw_rows(wg.x, base.z, n);
    let row0 = rows.x;
    let w0 = rows.y;
    let w1 = rows.z;
    let a = base.y;
    let nq = pc.shape.z / 8u;
    var s0 = 0.0;
    var s1 = 0.0;
    var e = li;
    for (; e + 3u * QW_WG < nq; e += 4u * QW_WG) {
        let e1 = e + QW_WG;
        let e2 = e + 2u * QW_WG;
        let e3 = e + 3u * QW_WG;
        let x0 = qw_x(a, e);
        let x1 = qw_x(a, e1);
        let x2 = qw_x(a, e2);
        let x3 = qw_x(a, e3);
        let a0 = q_quarter(qw_blk(w0, e), e & 3u);
        let a1 = q_quarter(qw_blk(w0, e1), e1 & 3u);
        let a2 = q_quarter(qw_blk(w0, e2), e2 & 3u);
        let a3 = q_quarter(qw_blk(w0, e3), e3 & 3u);
        let b0 = q_quarter_1(qw_blk(w1, e), e & 3u);
        let b1 = q_quarter_1(qw_blk(w1, e1), e1 & 3u);
        let b2 = q_quarter_1(qw_blk(w1, e2), e2 & 3u);
        let b3 = q_quarter_1(qw_blk(w1, e3), e3 & 3u);
        let l0 = ld4_a(x0);
        let h0 = ld4_a(x0 + 16u);
        let l1 = ld4_a(x1);
        let h1 = ld4_a(x1 + 16u);
        let l2 = ld4_a(x2);
        let h2 = ld4_a(x2 + 16u);
        let l3 = ld4_a(x3);
        let h3 = ld4_a(x3 + 16u);
        s0 += qw_dot(a0, l0, h0);
        s1 += qw_dot(b0, l0, h0);
        s0 += qw_dot(a1, l1, h1);
        s1 += qw_dot(b1, l1, h1);
        s0 += qw_dot(a2, l2, h2);
        s1 += qw_dot(b2, l2, h2);
        s0 += qw_dot(a3, l3, h3);
        s1 += qw_dot(b3, l3, h3);
    }
    if e + QW_WG < nq {
        let e1 = e + QW_WG;
        let x0 = qw_x(a, e);
        let x1 = qw_x(a, e1);
        let a0 = q_quarter(qw_blk(w0, e), e & 3u);
        let a1 = q_quarter(qw_blk(w0, e1), e1 & 3u);
        let b0 = q_quarter_1(qw_blk(w1, e), e & 3u);
        let b1 = q_quarter_1(qw_blk(w1, e1), e1 & 3u);
        let l0 = ld4_a(x0);
        let h0 = ld4_a(x0 + 16u);
        let l1 = ld4_a(x1);
        let h1 = ld4_a(x1 + 16u);
        s0 += qw_dot(a0, l0, h0);
        s1 += qw_dot(b0, l0, h0);
        s0 += qw_dot(a1, l1, h1);
        s1 += qw_dot(b1, l1, h1);
        e += 2u * QW_WG;
    }
    if e < nq {
        let x0 = qw_x(a, e);
        let a0 = q_quarter(qw_blk(w0, e), e & 3u);
        let b0 = q_quarter_1(qw_blk(w1, e), e & 3u);
        let l0 = ld4_a(x0);
        let h0 = ld4_a(x0 + 16u);
        s0 += qw_dot(a0, l0, h0);
        s1 += qw_dot(b0, l0, h0);
    }
    let r0 = subgroupAdd(s0);
    let r1 = subgroupAdd(s1);
    if lane == 0u {
        qw_part[sg * QW_ROWS] = r0;
        qw_part[sg * QW_ROWS + 1u] = r1;
    }
    workgroupBarrier();
    qw_store(base.x, row0, n, li, nsg);
}
