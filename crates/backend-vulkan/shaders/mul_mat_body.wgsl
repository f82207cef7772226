// The body of the tiled MulMat (`mul_mat.wgsl`, and `mul_mat_qt.wgsl` over block weights):
// dst[.., m, n] = sum_k a[.., m, k] * b[.., k, n] with f32 accumulation. A 16x16 workgroup
// computes a 64x64 tile, 4x4 outputs per thread, stepping k by 16 through workgroup memory.
// A's tile is loaded here, along whichever axis is contiguous in memory (`prm.x`); B's tile,
// Bs[kb * 64 + c] (16 k x 64 columns), by the including kernel's `fetch_b_tile` (into a
// `BTile` of registers) and `put_b_tile` (into `Bs`). Batch axes
// (two, after padding) map to operand batches by division (GQA broadcast). Each step's tile
// loads are written out, all issued before any is stored (on the H200 a load in a loop that
// stores it before the next iteration waits for each load in turn), and a step ahead.

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch0, batch1, row, col strides
    d_str: vec4<u32>,
    // batch0, batch1, m, k strides
    a_str: vec4<u32>,
    // batch0, batch1, k, n strides
    b_str: vec4<u32>,
    // d, a, b offsets; batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    // x: 1 when a's k axis is contiguous, y: 1 when b's k axis is contiguous
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

var<workgroup> As: array<f32, 1024>;
var<workgroup> Bs: array<f32, 1024>;

// Where element `flat` (0 .. 1024) of A's 64x16 tile sits: (row, k) in the tile, along
// whichever of a's axes is contiguous so the loads coalesce.
fn a_tile_rk(flat: u32) -> vec2<u32> {
    if pc.prm.x == 0u {
        return vec2<u32>(flat % 64u, flat / 64u);
    }
    return vec2<u32>(flat / 16u, flat % 16u);
}

// Element `flat` of A's tile at (row0, k0): a's value, 0 past M or K (the load then reads
// element 0 of the binding and is discarded, so no branch splits a round of loads).
fn a_tile_val(flat: u32, a_base: u32, row0: u32, k0: u32) -> f32 {
    let rk = a_tile_rk(flat);
    let gr = row0 + rk.x;
    let gk = k0 + rk.y;
    let ok = gr < pc.shape.x && gk < pc.shape.z;
    let v = ld_a(select(0u, a_base + gr * pc.a_str.z + gk * pc.a_str.w, ok));
    return select(0.0, v, ok);
}

fn a_tile_put(flat: u32, v: f32) {
    let rk = a_tile_rk(flat);
    As[rk.y * 64u + rk.x] = v;
}

@compute @workgroup_size(16, 16, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let bz = wg.z;
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let row0 = wg.y * 64u;
    let col0 = wg.x * 64u;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) {
        acc[i] = 0.0;
    }
    // Each step's tiles are fetched into registers a step ahead (As[kk * 64 + r]: 64 rows x 16
    // k, four elements an invocation; B's tile by the including kernel's `fetch_b_tile`), so
    // their loads are in flight while the step before multiplies. The fetch past K reads
    // zeros and is never stored.
    var a0 = a_tile_val(li, a_base, row0, 0u);
    var a1 = a_tile_val(li + 256u, a_base, row0, 0u);
    var a2 = a_tile_val(li + 512u, a_base, row0, 0u);
    var a3 = a_tile_val(li + 768u, a_base, row0, 0u);
    var bt = fetch_b_tile(li, 0u, col0, b_base);
    for (var k0 = 0u; k0 < K; k0 += 16u) {
        a_tile_put(li, a0);
        a_tile_put(li + 256u, a1);
        a_tile_put(li + 512u, a2);
        a_tile_put(li + 768u, a3);
        put_b_tile(li, bt);
        workgroupBarrier();
        let k1 = k0 + 16u;
        a0 = a_tile_val(li, a_base, row0, k1);
        a1 = a_tile_val(li + 256u, a_base, row0, k1);
        a2 = a_tile_val(li + 512u, a_base, row0, k1);
        a3 = a_tile_val(li + 768u, a_base, row0, k1);
        bt = fetch_b_tile(li, k1, col0, b_base);
        for (var kk = 0u; kk < 16u; kk++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                av[i] = As[kk * 64u + lid.y * 4u + i];
                bv[i] = Bs[kk * 64u + lid.x * 4u + i];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += av[i] * bv[j];
                }
            }
        }
        workgroupBarrier();
    }
    let d_base = pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y;
    for (var i = 0u; i < 4u; i++) {
        let gr = row0 + lid.y * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let gc = col0 + lid.x * 4u + j;
            if gr < M && gc < N {
                st_d(d_base + gr * pc.d_str.z + gc * pc.d_str.w, acc[i * 4u + j]);
            }
        }
    }
}
