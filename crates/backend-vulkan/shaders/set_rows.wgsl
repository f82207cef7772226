// SetRows: dst[idx[j], :] = src[j, :]. With duplicate indices the last write wins (as
// sequential numpy assignment). Every index is checked before anything is written; the first
// bad one is reported through the status words.
//
// Why: a prompt's KV write is hundreds of rows; one thread per column walking every row in
// turn waits for each row's load before its store (a 512-row "1b" cache write took 217 µs on
// the H200), with a handful of workgroups on the whole GPU.
//
// Strategy: workgroup (column block, z) takes 64 columns of the rows of chunk z (ROWS rows).
// Its threads first check all m indices together (a strided share each): the smallest bad
// position, and whether the indices strictly increase. Strictly increasing indices are
// distinct, so every chunk writes its own rows at once, ROUND rows' loads issued before their
// stores. Otherwise (indices that may repeat) chunk 0 alone writes every row, in order, per
// column, so the last write still wins.
//
// Invariants: nothing is written when any index is bad; only workgroup (0, 0) reports, the
// smallest bad position, so a submit's status names the first bad row. The checks read the
// same indices in every workgroup, so all agree on the mode.

struct Pc {
    // dst rows n, row length d, source rows m, rows per chunk
    shape: vec4<u32>,
    // dst row stride, column stride
    d_str: vec4<u32>,
    // src row stride, column stride
    a_str: vec4<u32>,
    // x: index stride
    b_str: vec4<u32>,
    // d, src, idx offsets
    offs: vec4<u32>,
    // x: error tag
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const ROUND: u32 = 8u;

var<workgroup> first_bad: atomic<u32>;
var<workgroup> unordered: atomic<u32>;

fn index_at(j: u32) -> i32 {
    return ldi_ids(pc.offs.z + j * pc.b_str.x);
}

// Rows [lo, hi) of column `col`, ROUND rows' loads before their stores, rows in order.
fn copy_rows(col: u32, lo: u32, hi: u32) {
    var j = lo;
    for (; j + ROUND <= hi; j += ROUND) {
        var v: array<f32, ROUND>;
        var r: array<u32, ROUND>;
        for (var i = 0u; i < ROUND; i++) {
            r[i] = u32(index_at(j + i));
            v[i] = ld_a(pc.offs.y + (j + i) * pc.a_str.x + col * pc.a_str.y);
        }
        for (var i = 0u; i < ROUND; i++) {
            st_d(pc.offs.x + r[i] * pc.d_str.x + col * pc.d_str.y, v[i]);
        }
    }
    for (; j < hi; j++) {
        let v = ld_a(pc.offs.y + j * pc.a_str.x + col * pc.a_str.y);
        st_d(pc.offs.x + u32(index_at(j)) * pc.d_str.x + col * pc.d_str.y, v);
    }
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let n = pc.shape.x;
    let m = pc.shape.z;
    if li == 0u {
        atomicStore(&first_bad, 0xffffffffu);
        atomicStore(&unordered, 0u);
    }
    workgroupBarrier();
    var bad = 0xffffffffu;
    var up = true;
    for (var j = li; j < m; j += 64u) {
        let id = index_at(j);
        if id < 0 || u32(id) >= n {
            bad = min(bad, j);
        } else if j > 0u && id <= index_at(j - 1u) {
            up = false;
        }
    }
    if bad != 0xffffffffu {
        atomicMin(&first_bad, bad);
    }
    if !up {
        atomicStore(&unordered, 1u);
    }
    workgroupBarrier();
    let fb = atomicLoad(&first_bad);
    let ordered = atomicLoad(&unordered) == 0u;
    if fb != 0xffffffffu {
        if li == 0u && group_id(wg, nwg) == 0u && wg.z == 0u {
            report_bad_index(pc.op.x, fb, index_at(fb));
        }
        return;
    }
    let col = group_id(wg, nwg) * 64u + li;
    if col >= pc.shape.y {
        return;
    }
    if ordered {
        let lo = wg.z * pc.shape.w;
        copy_rows(col, lo, min(m, lo + pc.shape.w));
    } else if wg.z == 0u {
        copy_rows(col, 0u, m);
    }
}
