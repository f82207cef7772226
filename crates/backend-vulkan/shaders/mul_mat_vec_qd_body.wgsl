// The body of `mul_mat_vec_qd*`: `x @ w.T` for one row of f32 x over Q4_0, Q4_1, Q8_0, Q4_K or
// Q6_K blocks as integer dot products: x quantized to 16 bits per block of 32 once per
// workgroup, each 32-element piece of w dotted with it four bytes at a time (`dot4I8Packed`,
// `dot4U8Packed`).
//
// Why: the float bodies decode every weight to f32 (a shift, a mask, an or and a subtract per
// element) before its multiply-add; on an H200 the Q4_0 products ran at a quarter of the
// device's read rate, bound by that arithmetic, not by memory. A 4-byte integer dot product
// takes four elements in one instruction where the device accelerates it (the CUDA backend's
// q16 products do the same with `dp2a`). 16-bit activations keep the products within about
// 1e-5 of the f32 path's (8-bit ones, as llama.cpp's integer paths take, change a small
// model's greedy answer: docs/tuning.md).
//
// Strategy: x's block b gets `dx = amax / 32767` and q_i = round(x_i / dx) (half away from
// zero, within +-32767: the CPU backend's q16), split as q = 256 * h + l with h the signed high
// byte and l the unsigned low byte, kept in workgroup memory as words of four h and of four
// l in element order (`qd_h`, `qd_l`), with dx and dx * sum(q) (`qd_d`, `qd_s`). Four lanes
// of a subgroup quantize a block (eight elements each, the block's amax and sum through two
// shuffles). A weight piece (`q_qd`: its elements as bytes, a scale per 16 elements, an
// offset) adds scale * dx * (256 * sum(w * h) + sum(w * l)) per half and offset * dx * sum(q),
// the integer sums exact; signed weights (`Q_SIGNED`) take l - 128 and add back 128 * sum(w).
// Workgroup x takes rows x * R .. x * R + R - 1 of w (R = `pc.prm.w`), its subgroups one row
// each in turn, a lane taking pieces lane, lane + lanes, ... of the row, two pieces' loads
// issued before either is used; `subgroupAdd` sums a row.
//
// Invariants (checked by the host): one row of x, contiguous along k, its offset a multiple
// of 4 elements; k at most QD_KMAX; w on an even byte (Q4_K on a word); the device has
// subgroup shuffles and the integer dot product feature. A lane adds its pieces in row order
// and the reductions are fixed, so a result does not depend on timing.

// #include mul_mat_vec_head.wgsl

const QD_WG: u32 = 256u;
// 32-element pieces per block.
const QD_PPB: u32 = QK / 32u;
const QD_KMAX: u32 = 8192u;

// x's 16-bit integers as bytes, 16 elements a vec4 of words: high (signed) and low (unsigned).
var<workgroup> qd_h: array<vec4<u32>, 512>;
var<workgroup> qd_l: array<vec4<u32>, 512>;
// Per block of 32: dx, and dx * sum(q).
var<workgroup> qd_d: array<f32, 256>;
var<workgroup> qd_s: array<f32, 256>;

// round(v) half away from zero (WGSL's `round` takes half to even).
fn qd_round(v: vec4<f32>) -> vec4<f32> {
    let t = trunc(v);
    return select(t, t + sign(v), abs(v - t) >= vec4<f32>(0.5));
}

fn qd_ints(v: vec4<f32>, id: f32) -> vec4<i32> {
    return vec4<i32>(clamp(qd_round(v * id), vec4<f32>(-32767.0), vec4<f32>(32767.0)));
}

// Four 8-bit values (the low byte of each lane) as one word, lane i in byte i.
fn qd_pack(v: vec4<u32>) -> u32 {
    let b = v & vec4<u32>(0xffu);
    return b.x | (b.y << 8u) | (b.z << 16u) | (b.w << 24u);
}

fn qd_hsum(v: vec4<i32>) -> i32 {
    return (v.x + v.y) + (v.z + v.w);
}

// Quantizes x (k elements from element `a`) into the workgroup's records; every invocation
// takes part (the trip count is uniform), the invocation in slot `slot` (its subgroup's index
// times the subgroup size, plus its lane) eight elements 8t .. 8t + 7 a round, t = round *
// QD_WG + slot. Slots count lanes, not invocation indices, so the four slots of a block are
// lanes of one subgroup (its amax and sum go through xor shuffles 1 and 2) however the device
// maps invocations to subgroups; the workgroup's 256 invocations are whole subgroups.
fn qd_quantize(a: u32, k: u32, slot: u32) {
    let nt = k / 8u;
    for (var t0 = 0u; t0 < nt; t0 += QD_WG) {
        let t = t0 + slot;
        let live = t < nt;
        let e = a + select(0u, 8u * t, live);
        let v0 = ld4_a(e);
        let v1 = ld4_a(e + 4u);
        let m4 = max(abs(v0), abs(v1));
        var amax = max(max(m4.x, m4.y), max(m4.z, m4.w));
        amax = max(amax, subgroupShuffleXor(amax, 1u));
        amax = max(amax, subgroupShuffleXor(amax, 2u));
        let d = amax / 32767.0;
        let id = select(0.0, 1.0 / d, d > 0.0);
        let q0 = qd_ints(v0, id);
        let q1 = qd_ints(v1, id);
        var s = qd_hsum(q0) + qd_hsum(q1);
        s += subgroupShuffleXor(s, 1u);
        s += subgroupShuffleXor(s, 2u);
        if live {
            let w = 2u * t;
            qd_h[w >> 2u][w & 3u] = qd_pack(bitcast<vec4<u32>>(q0 >> vec4<u32>(8u)));
            qd_h[w >> 2u][(w & 3u) + 1u] = qd_pack(bitcast<vec4<u32>>(q1 >> vec4<u32>(8u)));
            qd_l[w >> 2u][w & 3u] = qd_pack(bitcast<vec4<u32>>(q0));
            qd_l[w >> 2u][(w & 3u) + 1u] = qd_pack(bitcast<vec4<u32>>(q1));
            if (t & 3u) == 0u {
                qd_d[t >> 2u] = d;
                qd_s[t >> 2u] = d * f32(s);
            }
        }
    }
}

// sum(w * h) and sum(w * l) over four words of weights against four of x's.
fn qd_i4(w: vec4<u32>, h: vec4<u32>) -> i32 {
    let a = dot4I8Packed(w.x, h.x) + dot4I8Packed(w.y, h.y);
    return a + (dot4I8Packed(w.z, h.z) + dot4I8Packed(w.w, h.w));
}

fn qd_u4(w: vec4<u32>, l: vec4<u32>) -> u32 {
    let a = dot4U8Packed(w.x, l.x) + dot4U8Packed(w.y, l.y);
    return a + (dot4U8Packed(w.z, l.z) + dot4U8Packed(w.w, l.w));
}

// Piece `b` of a row (its elements 32i .. 32i + 31) against block i of x.
fn qd_dot(b: QdPiece, i: u32) -> f32 {
    let h0 = qd_h[2u * i];
    let h1 = qd_h[2u * i + 1u];
    let l0 = qd_l[2u * i];
    let l1 = qd_l[2u * i + 1u];
    var s0: i32;
    var s1: i32;
    if Q_SIGNED {
        // Signed weights: the low bytes go in as l - 128 (signed), and 128 * sum(w) puts the
        // offset back.
        let f = vec4<u32>(0x80808080u);
        let one = vec4<u32>(0x01010101u);
        s0 = 256 * qd_i4(b.w0, h0) + qd_i4(b.w0, l0 ^ f) + 128 * qd_i4(b.w0, one);
        s1 = 256 * qd_i4(b.w1, h1) + qd_i4(b.w1, l1 ^ f) + 128 * qd_i4(b.w1, one);
    } else {
        s0 = 256 * qd_i4(b.w0, h0) + i32(qd_u4(b.w0, l0));
        s1 = 256 * qd_i4(b.w1, h1) + i32(qd_u4(b.w1, l1));
    }
    let dx = qd_d[i];
    var t: f32;
    if QK == 32u {
        t = b.s.x * (dx * f32(s0 + s1));
    } else {
        t = b.s.x * (dx * f32(s0)) + b.s.y * (dx * f32(s1));
    }
    return t + b.m * qd_s[i];
}

// Piece p of the row of w at byte `w`.
fn qd_piece(w: u32, p: u32) -> QdPiece {
    return q_qd(w + (p / QD_PPB) * QB, p % QD_PPB);
}

// This lane's part of x . w for the row of w at byte `w`: pieces lane, lane + lanes, ...
fn qd_row(w: u32, lane: u32, lanes: u32) -> f32 {
    let nb = pc.shape.z / 32u;
    var acc = 0.0;
    var i = lane;
    for (; i + lanes < nb; i += 2u * lanes) {
        let b0 = qd_piece(w, i);
        let b1 = qd_piece(w, i + lanes);
        acc += qd_dot(b0, i);
        acc += qd_dot(b1, i + lanes);
    }
    if i < nb {
        acc += qd_dot(qd_piece(w, i), i);
    }
    return acc;
}

// The start of every `mul_mat_vec_qd*` entry point: x quantized into the workgroup's records
// (then a barrier; `slot` as `qd_quantize` takes it), and (d's batch offset, w's batch offset,
// the workgroup's first row, its end) for batch `wy` and workgroup `wx`.
fn qd_begin(wx: u32, wy: u32, slot: u32) -> vec4<u32> {
    let base = batch_bases(wy);
    qd_quantize(base.y, pc.shape.z, slot);
    workgroupBarrier();
    let r0 = wx * pc.prm.w;
    return vec4<u32>(base.x, base.z, r0, min(pc.shape.y, r0 + pc.prm.w));
}
