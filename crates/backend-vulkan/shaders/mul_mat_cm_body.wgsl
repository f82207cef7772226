// The body of the prefill products on cooperative matrices (`LOWSYNC_VK_COOPMAT`):
// dst[.., m, n] = sum_k x[.., m, k] * b[.., k, n] with x f32, its operands rounded to f16 and
// f32 accumulation, on a device with `VK_KHR_cooperative_matrix` (16x16x16, 32-lane
// subgroups). `mul_mat_cm.wgsl` reads float weights, `mul_mat_qcm.wgsl` GGUF block weights.
//
// Why: the tiled product (`mul_mat_body.wgsl`) multiplies in f32 on the shader cores; a GPU's
// matrix units multiply f16 tiles many times faster (on the H200 the f32 tiles ran "1b" F16's
// 128-token prompt at about 3,900 tok/s, an eighth of the f32 cores' peak).
//
// Strategy: a workgroup of 128 invocations (four 32-lane subgroups) computes a 64x64 tile of
// the result, stepping k by 32: all invocations stage x's 64x32 tile (`As`, row-major, f16)
// and w's 32x64 tile (`Bs`, row-major over k, f16; the including kernel's `load_b_tile`),
// zeros past the operands' ends; after a barrier subgroup s multiplies rows 16s .. 16s + 16
// of `As` by the four 16-column slices of `Bs`, two k steps of 16, into four f32
// accumulators. At the end the accumulators go to `Cs` and every invocation stores its share
// of the tile that lies inside the result, at the result's strides.
//
// Invariants (checked by the host): x f32 (any strides), the device's subgroups 32 lanes
// wide (four per workgroup); batch axes as the float tiled product's (GQA by division).

struct Pc {
    // M, N, K, batch extent of axis 1
    shape: vec4<u32>,
    // batch0, batch1, row, col strides
    d_str: vec4<u32>,
    // batch0, batch1, m, k strides
    a_str: vec4<u32>,
    // batch0, batch1, k, n strides (block weights: batch and row strides in bytes)
    b_str: vec4<u32>,
    // d, a, b offsets (block weights: b's in bytes); batch count
    offs: vec4<u32>,
    // batch divisors: a axis 0, a axis 1, b axis 0, b axis 1
    op: vec4<u32>,
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 32u;
const WG: u32 = 128u;

var<workgroup> As: array<f16, 2048>;
var<workgroup> Bs: array<f16, 2048>;
var<workgroup> Cs: array<f32, 4096>;

// x's value at element `flat` (0 .. 2048) of its 64x32 tile at (row0, k0), 0 outside x (the
// load then reads element 0 of the binding and is discarded, so no branch splits a round).
fn a_tile_val(flat: u32, a_base: u32, row0: u32, k0: u32) -> f32 {
    let gr = row0 + flat / TK;
    let gk = k0 + flat % TK;
    let ok = gr < pc.shape.x && gk < pc.shape.z;
    let v = ld_a(select(0u, a_base + gr * pc.a_str.z + gk * pc.a_str.w, ok));
    return select(0.0, v, ok);
}

// x's 64x32 tile at (row0, k0) into `As` [m][k], as f16; zeros outside x. Sixteen elements an
// invocation in two rounds of eight, each round's loads written out before its stores: on the
// H200 a loop that stores each load before the next waits for every load in turn.
fn load_a_tile(li: u32, a_base: u32, row0: u32, k0: u32) {
    for (var e = 0u; e < TM * TK / WG; e += 8u) {
        let f = li + e * WG;
        let v0 = a_tile_val(f, a_base, row0, k0);
        let v1 = a_tile_val(f + WG, a_base, row0, k0);
        let v2 = a_tile_val(f + 2u * WG, a_base, row0, k0);
        let v3 = a_tile_val(f + 3u * WG, a_base, row0, k0);
        let v4 = a_tile_val(f + 4u * WG, a_base, row0, k0);
        let v5 = a_tile_val(f + 5u * WG, a_base, row0, k0);
        let v6 = a_tile_val(f + 6u * WG, a_base, row0, k0);
        let v7 = a_tile_val(f + 7u * WG, a_base, row0, k0);
        As[f] = f16(v0);
        As[f + WG] = f16(v1);
        As[f + 2u * WG] = f16(v2);
        As[f + 3u * WG] = f16(v3);
        As[f + 4u * WG] = f16(v4);
        As[f + 5u * WG] = f16(v5);
        As[f + 6u * WG] = f16(v6);
        As[f + 7u * WG] = f16(v7);
    }
}

@compute @workgroup_size(128, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let b0 = wg.z / pc.shape.w;
    let b1 = wg.z % pc.shape.w;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let row0 = wg.y * TM;
    let col0 = wg.x * TN;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    let arow = sg * 16u * TK;
    for (var k0 = 0u; k0 < K; k0 += TK) {
        load_a_tile(li, a_base, row0, k0);
        load_b_tile(li, b_base, col0, k0);
        workgroupBarrier();
        for (var kh = 0u; kh < TK; kh += 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&As[arow + kh], TK);
            let bk = kh * TN;
            c0 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&Bs[bk], TN), c0);
            c1 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&Bs[bk + 16u], TN), c1);
            c2 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&Bs[bk + 32u], TN), c2);
            c3 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&Bs[bk + 48u], TN), c3);
        }
        // The next step's staging overwrites the tiles just read.
        workgroupBarrier();
    }
    let crow = sg * 16u * TN;
    coopStoreT(c0, &Cs[crow], TN);
    coopStoreT(c1, &Cs[crow + 16u], TN);
    coopStoreT(c2, &Cs[crow + 32u], TN);
    coopStoreT(c3, &Cs[crow + 48u], TN);
    workgroupBarrier();
    let d_base = pc.offs.x + b0 * pc.d_str.x + b1 * pc.d_str.y;
    for (var e = 0u; e < TM * TN / WG; e++) {
        let flat = li + e * WG;
        let r = flat / TN;
        let c = flat % TN;
        let gr = row0 + r;
        let gc = col0 + c;
        if gr < M && gc < N {
            st_d(d_base + gr * pc.d_str.z + gc * pc.d_str.w, Cs[flat]);
        }
    }
}
