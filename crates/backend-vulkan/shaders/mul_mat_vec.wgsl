// MulMat for few rows (M <= 8, decode): every element of b is loaded once and multiplied into
// all M rows. Two layouts, chosen by `prm.z` (uniform, so barriers stay in uniform flow):
// - k-split (b's k axis contiguous, `x @ w.T`): 32 lanes share one output column, each summing
//   a strided part of k, then a tree reduction; a workgroup covers 8 columns.
// - column (otherwise, e.g. `p @ v`): one thread per output column walks all of k; adjacent
//   threads read adjacent columns of b.

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    b_str: vec4<u32>,
    // d, a, b offsets; batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    // z: 1 for k-split
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

var<workgroup> red: array<f32, 2048>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let bz = wg.y;
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let d_base = pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y;
    var acc: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        acc[i] = 0.0;
    }
    if pc.prm.z == 1u {
        let g = li / 32u;
        let lane = li % 32u;
        let col = wg.x * 8u + g;
        if col < N {
            for (var k = lane; k < K; k += 32u) {
                let bv = ld_b(b_base + k * pc.b_str.z + col * pc.b_str.w);
                for (var m = 0u; m < M; m++) {
                    acc[m] += ld_a(a_base + m * pc.a_str.z + k * pc.a_str.w) * bv;
                }
            }
        }
        for (var m = 0u; m < 8u; m++) {
            red[li * 8u + m] = acc[m];
        }
        workgroupBarrier();
        for (var w = 16u; w > 0u; w >>= 1u) {
            if lane < w {
                for (var m = 0u; m < 8u; m++) {
                    red[li * 8u + m] += red[(li + w) * 8u + m];
                }
            }
            workgroupBarrier();
        }
        if lane == 0u && col < N {
            for (var m = 0u; m < M; m++) {
                st_d(d_base + m * pc.d_str.z + col * pc.d_str.w, red[li * 8u + m]);
            }
        }
    } else {
        let col = wg.x * 256u + li;
        if col < N {
            for (var k = 0u; k < K; k++) {
                let bv = ld_b(b_base + k * pc.b_str.z + col * pc.b_str.w);
                for (var m = 0u; m < M; m++) {
                    acc[m] += ld_a(a_base + m * pc.a_str.z + k * pc.a_str.w) * bv;
                }
            }
            for (var m = 0u; m < M; m++) {
                st_d(d_base + m * pc.d_str.z + col * pc.d_str.w, acc[m]);
            }
        }
    }
}
