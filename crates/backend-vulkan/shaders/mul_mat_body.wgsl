// The body of the tiled MulMat (`mul_mat.wgsl`, `mul_mat8.wgsl`, and `mul_mat_qt.wgsl`,
// `mul_mat_qt8.wgsl` over block weights): dst[.., m, n] = sum_k a[.., m, k] * b[.., k, n] with
// f32 accumulation. A workgroup computes a 64x64 tile, TILE_T x TILE_T outputs per invocation
// (the including kernel's constant: 4 over 256 invocations, or 8 over 64), stepping k by 16
// through workgroup memory. A's tile is loaded here, along whichever axis is contiguous in
// memory (`prm.x`); B's tile, Bs (16 k x 64 columns, element (kb, c) at word c % 4 of
// Bs[kb * 16 + c / 4]), by the including kernel's `fetch_b_tile` (into a `BTile` of
// registers) and `put_b_tile` (into `Bs`). Batch axes (two, after padding) map to operand
// batches by division (GQA broadcast). Each step's tile loads are issued a step ahead, four
// written out together (`a_tile_val4`) before any is stored: on the H200 a load in a loop
// that stores it before the next iteration waits for each load in turn.
//
// Why 8x8: a 4x4 invocation reads two vec4s of workgroup memory per 16 multiply-adds (on an
// NVIDIA multiprocessor, three quarters of the time the multiply-adds take); 8x8 reads four per
// 64, with a quarter of the invocations per tile (docs/tuning.md, `LOWSYNC_VK_TILE`). An
// invocation's rows (and columns) are runs of four, TILE_SIDE * 4 apart, so the invocations
// of a subgroup that read distinct vec4s read contiguous bytes.
//
// Split over k (`LOWSYNC_VK_SPLIT_K`, `prm.z` nonzero): each workgroup sums one range of k into
// a split's partials, which `split_sum.wgsl` adds in split order.
//
// Invariant: the sums run over k in the same order whatever TILE_T, so both give the same
// bits.

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
    // x: 1 when a's k axis is contiguous, y: 1 when b's k axis is contiguous; z: k per split
    // (0: unsplit), w: elements between two splits' partials
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

// Invocations along each side of the tile; invocations; fours of tile elements (of A's 1,024,
// and of B's where the including kernel spreads it the same way) each invocation loads per k
// step; vec4s of each side per invocation; vec4s of outputs per invocation.
const TILE_SIDE: u32 = 64u / TILE_T;
const TILE_WG: u32 = TILE_SIDE * TILE_SIDE;
const TILE_Q: u32 = 256u / TILE_WG;
const TILE_V: u32 = TILE_T / 4u;
const TILE_N: u32 = TILE_T * TILE_V;

// Element (kk, r) at word r % 4 of [kk * 16 + r / 4].
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

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
    As[rk.y * 16u + rk.x / 4u][rk.x % 4u] = v;
}

// Elements flat, flat + TILE_WG, flat + 2 TILE_WG and flat + 3 TILE_WG of A's tile, their
// loads issued together.
fn a_tile_val4(flat: u32, a_base: u32, row0: u32, k0: u32) -> vec4<f32> {
    return vec4<f32>(
        a_tile_val(flat, a_base, row0, k0),
        a_tile_val(flat + TILE_WG, a_base, row0, k0),
        a_tile_val(flat + 2u * TILE_WG, a_base, row0, k0),
        a_tile_val(flat + 3u * TILE_WG, a_base, row0, k0),
    );
}

fn a_tile_put4(flat: u32, v: vec4<f32>) {
    a_tile_put(flat, v.x);
    a_tile_put(flat + TILE_WG, v.y);
    a_tile_put(flat + 2u * TILE_WG, v.z);
    a_tile_put(flat + 3u * TILE_WG, v.w);
}

// Row (or column) i of an invocation's TILE_T, for the invocation at `t` along that side: runs
// of four, TILE_SIDE * 4 apart.
fn tile_at(t: u32, i: u32) -> u32 {
    return (i / 4u) * TILE_SIDE * 4u + t * 4u + i % 4u;
}

@compute @workgroup_size(TILE_SIDE, TILE_SIDE, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let M = pc.shape.x;
    let N = pc.shape.y;
    let K = pc.shape.z;
    let tx = li % TILE_SIDE;
    let ty = li / TILE_SIDE;
    // Split over k (`prm.z`, a multiple of 16, nonzero): workgroup z is batch * splits + s, the
    // workgroup sums k in [s * prm.z, (s + 1) * prm.z) and stores into split s's partials,
    // prm.w elements after split s - 1's (d is the partials buffer, laid out as the planner
    // says in d_str).
    var splits = 1u;
    var kbeg = 0u;
    var kend = K;
    if pc.prm.z != 0u {
        splits = (K + pc.prm.z - 1u) / pc.prm.z;
        kbeg = (wg.z % splits) * pc.prm.z;
        kend = min(K, kbeg + pc.prm.z);
    }
    let bz = wg.z / splits;
    let b0 = bz / pc.shape.w;
    let b1 = bz % pc.shape.w;
    let a_base = pc.offs.y + (b0 / pc.op.x) * pc.a_str.x + (b1 / pc.op.y) * pc.a_str.y;
    let b_base = pc.offs.z + (b0 / pc.op.z) * pc.b_str.x + (b1 / pc.op.w) * pc.b_str.y;
    let row0 = wg.y * 64u;
    let col0 = wg.x * 64u;
    // Row i's columns 4h .. 4h + 3 (of the invocation's TILE_T) in acc[i * TILE_V + h].
    var acc: array<vec4<f32>, TILE_N>;
    for (var i = 0u; i < TILE_N; i++) {
        acc[i] = vec4<f32>();
    }
    // Each step's tiles are fetched into registers a step ahead (A's 64 rows x 16 k, 4 * TILE_Q
    // elements an invocation, element 4j + i at li + (4j + i) * TILE_WG; B's tile by the
    // including kernel's `fetch_b_tile`), so their loads are in flight while the step before
    // multiplies. The fetch past K reads zeros and is never stored.
    var at: array<vec4<f32>, TILE_Q>;
    for (var j = 0u; j < TILE_Q; j++) {
        at[j] = a_tile_val4(li + 4u * j * TILE_WG, a_base, row0, kbeg);
    }
    var bt = fetch_b_tile(li, kbeg, col0, b_base);
    for (var k0 = kbeg; k0 < kend; k0 += 16u) {
        for (var j = 0u; j < TILE_Q; j++) {
            a_tile_put4(li + 4u * j * TILE_WG, at[j]);
        }
        put_b_tile(li, bt);
        workgroupBarrier();
        let k1 = k0 + 16u;
        for (var j = 0u; j < TILE_Q; j++) {
            at[j] = a_tile_val4(li + 4u * j * TILE_WG, a_base, row0, k1);
        }
        bt = fetch_b_tile(li, k1, col0, b_base);
        for (var kk = 0u; kk < 16u; kk++) {
            var av: array<vec4<f32>, TILE_V>;
            var bv: array<vec4<f32>, TILE_V>;
            for (var h = 0u; h < TILE_V; h++) {
                av[h] = As[kk * 16u + h * TILE_SIDE + ty];
                bv[h] = Bs[kk * 16u + h * TILE_SIDE + tx];
            }
            for (var i = 0u; i < TILE_T; i++) {
                let a = av[i / 4u][i % 4u];
                for (var h = 0u; h < TILE_V; h++) {
                    acc[i * TILE_V + h] += a * bv[h];
                }
            }
        }
        workgroupBarrier();
    }
    let split_off = select(0u, (wg.z % splits) * pc.prm.w, pc.prm.z != 0u);
    let d_base = pc.offs.x + split_off + b0 * pc.d_str.x + b1 * pc.d_str.y;
    for (var i = 0u; i < TILE_T; i++) {
        let gr = row0 + tile_at(ty, i);
        for (var j = 0u; j < TILE_T; j++) {
            let gc = col0 + tile_at(tx, j);
            if gr < M && gc < N {
                st_d(d_base + gr * pc.d_str.z + gc * pc.d_str.w, acc[i * TILE_V + j / 4u][j % 4u]);
            }
        }
    }
}
