// MulMat over GGUF block weights, tiled (prefill): dst[.., m, n] = sum_k x[.., m, k] * w[.., n, k]
// with f32 x (any strides) and w stored as raw GGUF blocks (binding `b`, whole blocks along k).
//
// Why: the multi-row mat-vec (`mul_mat_vec_qm`) reads and dequantizes every weight group once
// per 8 rows of x, so a prefill of m rows decodes the whole weight m / 8 times. Here a
// workgroup owns a BM x BN tile of the result and each weight value it needs is decoded once
// for all BM rows of x.
//
// Strategy: a 16 x 8 workgroup (128 invocations, which every Vulkan device allows) steps k by
// BK = 32 (one block of a 32-element type, one sub-block of a super-block type). Each step,
// every invocation decodes one 16-element group of one of the BN rows of w through the type's
// own `q_scale` / `q_vals` (the layout is written once, in its family file) into workgroup
// memory as f32, and copies the same 16 values of one of the BM rows of x beside them: the
// same work in every invocation, no branch between decoding and copying (a CPU-type device
// runs both sides of such a branch). After a barrier each invocation accumulates its 8 x 4
// register tile (rows `lid.y + 8 r`, columns `lid.x + 16 c`, one vec4 per row, so
// neighbouring invocations read neighbouring words of the w tile and store neighbouring
// columns) from the two tiles in f32. Batch axes (two, after padding) come in workgroup z and
// map to operand batches by division, as in `mul_mat.wgsl`.
//
// Invariants: k is a whole number of blocks (so of BK) and every row of w starts on a block;
// rows and columns past the result's edges are loaded as zeros and never stored, so a result
// does not depend on where the tile edges fall. A weight element is `scale * q (+ offset)` as
// the family's contract states it. Offsets and strides of d and x count elements, every offset
// and stride of w counts bytes (the host converts whole rows of blocks), as in the mat-vecs.

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch strides 0/1, stride between rows of the result, between result columns
    d_str: vec4<u32>,
    // batch strides 0/1, stride between rows of x, along k
    a_str: vec4<u32>,
    // batch strides 0/1 (bytes), -, stride between rows of w (bytes)
    b_str: vec4<u32>,
    // d, a offsets (elements), b offset (bytes); batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    // x: x is contiguous along k
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

// Rows of x, rows of w and k per tile (`QUANT_TILE` in `src/ops/matmul.rs` is BM = BN; the
// loads below assume 64).
const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 32u;

// xs[kk * BM + r]: BK values of BM rows of x; ws[kk * BN + c]: BK values of BN rows of w.
var<workgroup> xs: array<f32, 2048>;
var<workgroup> ws: array<f32, 2048>;

// Four consecutive values along k of x from element `i` (the branch is uniform).
fn x4(i: u32) -> vec4<f32> {
    if pc.prm.x == 1u {
        return ld4_a(i);
    }
    let s = pc.a_str.w;
    return vec4<f32>(ld_a(i), ld_a(i + s), ld_a(i + 2u * s), ld_a(i + 3u * s));
}

// Four consecutive values along k of a row of the w tile, from `ws[at]`.
fn put_w(at: u32, v: vec4<f32>) {
    ws[at] = v.x;
    ws[at + BN] = v.y;
    ws[at + 2u * BN] = v.z;
    ws[at + 3u * BN] = v.w;
}

// Four consecutive values along k of a row of the x tile, from `xs[at]`.
fn put_x(at: u32, v: vec4<f32>) {
    xs[at] = v.x;
    xs[at + BM] = v.y;
    xs[at + 2u * BM] = v.z;
    xs[at + 3u * BM] = v.w;
}

@compute @workgroup_size(16, 8, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let b0 = wg.z / pc.shape.w;
    let b1 = wg.z % pc.shape.w;
    let d_base = pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;

    // This invocation's share of each step's loads: group `half` (16 values) of the step's BK
    // values of row `lr` of the w tile, decoded, and the same 16 values of row `lr` of x.
    let lr = li % 64u;
    let half = li / 64u;
    let w_ok = col0 + lr < N;
    let x_ok = row0 + lr < M;
    let w_row = b_base + (col0 + lr) * pc.b_str.w;
    let x_row = a_base + (row0 + lr) * pc.a_str.z;
    let xs_at = half * 16u * BM + lr;
    let ws_at = half * 16u * BN + lr;

    // acc[r]: result row `lid.y + 8 r`, columns `lid.x + 16 c` in component c.
    var acc = array<vec4<f32>, 8>();
    for (var k0 = 0u; k0 < K; k0 += BK) {
        let kk = k0 + half * 16u;
        var sc = vec2<f32>(0.0);
        var v = mat4x4<f32>();
        if w_ok {
            let gi = kk / 16u;
            let blk = w_row + (gi / GPB) * QB;
            sc = q_scale(blk, gi % GPB);
            v = q_vals(blk, gi % GPB);
        }
        let off = select(0.0, sc.y, Q_MIN);
        put_w(ws_at, sc.x * v[0] + off);
        put_w(ws_at + 4u * BN, sc.x * v[1] + off);
        put_w(ws_at + 8u * BN, sc.x * v[2] + off);
        put_w(ws_at + 12u * BN, sc.x * v[3] + off);
        let i = x_row + kk * pc.a_str.w;
        let s = 4u * pc.a_str.w;
        var x0 = vec4<f32>(0.0);
        var x1 = vec4<f32>(0.0);
        var x2 = vec4<f32>(0.0);
        var x3 = vec4<f32>(0.0);
        if x_ok {
            x0 = x4(i);
            x1 = x4(i + s);
            x2 = x4(i + 2u * s);
            x3 = x4(i + 3u * s);
        }
        put_x(xs_at, x0);
        put_x(xs_at + 4u * BM, x1);
        put_x(xs_at + 8u * BM, x2);
        put_x(xs_at + 12u * BM, x3);
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let xr = k * BM + lid.y;
            let wr = k * BN + lid.x;
            let w = vec4<f32>(ws[wr], ws[wr + 16u], ws[wr + 32u], ws[wr + 48u]);
            acc[0] += xs[xr] * w;
            acc[1] += xs[xr + 8u] * w;
            acc[2] += xs[xr + 16u] * w;
            acc[3] += xs[xr + 24u] * w;
            acc[4] += xs[xr + 32u] * w;
            acc[5] += xs[xr + 40u] * w;
            acc[6] += xs[xr + 48u] * w;
            acc[7] += xs[xr + 56u] * w;
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 8u; r++) {
        let gr = row0 + lid.y + 8u * r;
        let a = acc[r];
        for (var c = 0u; c < 4u; c++) {
            let gc = col0 + lid.x + 16u * c;
            if gr < M && gc < N {
                st_d(d_base + gr * pc.d_str.z + gc * pc.d_str.w, a[c]);
            }
        }
    }
}
