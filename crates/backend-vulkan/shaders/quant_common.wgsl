// Reading GGUF blocks, prepended (by build.rs) to every kernel with a block-dtype binding,
// before its type family's file (`quant_32.wgsl`, `quant_k.wgsl`, `quant_iq4.wgsl`).
//
// Why: storage buffers are arrays of u32, and blocks are 18, 20, 22, 34, 84, 110, 176, 210 ...
// bytes, so a block (and a field in it) starts at any byte of a word. Every read goes through
// `qw`/`qw4`, which funnel-shift the words holding the wanted bytes and touch no word past
// them (so never one past the tensor's last byte).
//
// The contract of a type T's family file, which is the only place T's layout is written:
//   T_qs(blk, g) -> vec2<f32>: (scale, offset) of the 16-element group g of the block at byte
//     `blk` (every block type's scales and mins are per 16 or 32 elements, so per group);
//   T_qv(blk, g) -> mat4x4<f32>: the group's 16 integer values, column c = elements 4c .. 4c+3;
//   element = scale * value + offset, where the offset is added only when `Q_MIN` (a type
//   with a min) so that `scale * value` is the CPU oracle's product bit for bit
//   (`lowsync-cpu/src/kernels/quant/scalar.rs`: a sub-block scale `d * sc` is rounded to f32
//   before it multiplies the value, a min is subtracted after).
// build.rs binds `q_scale`/`q_vals` to T's pair and sets `QK` (elements per block), `QB`
// (bytes per block), `GPB` (groups per block) and `Q_MIN`.
//
// Kernels where one invocation takes 32 consecutive elements at a time read them through
// `q_sub(blk, j) -> Sub32` (bound by build.rs), the 32-element sub-block j of the block at
// `blk`: a 32-element type's `T_b32(blk)` (j is 0), a super-block type's `T_s32(blk, j)`.
// `T_b32` loads each word of the block once, aligned, and cuts every field out of them with
// fixed shifts: such a block is an even number of bytes and rows hold whole blocks, so a block
// starts either on a word or two bytes into one (`blk & 2`); the reader computes both cases
// from the same words and selects, and loads no word past the one holding the block's last
// byte.

// The f16 in the low 16 bits of `h` as f32, on bits: exact, a dozen instructions and two
// branches. `q_f16` (bound by build.rs per kernel) is this or `f16_bits_to_f32`; every block
// reader converts its f16 fields through `q_f16`.
fn f16_on_bits(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if e == 0u {
        // zero or subnormal: m * 2^-24 is exact in f32
        return bitcast<f32>(s | bitcast<u32>(f32(m) * 5.9604644775390625e-8));
    }
    if e == 31u {
        return bitcast<f32>(s | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// Four bytes starting at any byte offset.
fn qw(byte: u32) -> u32 {
    let sh = (byte & 3u) * 8u;
    let w0 = q_buf[byte >> 2u];
    let w1 = q_buf[(byte + 3u) >> 2u];
    return select((w0 >> sh) | (w1 << ((32u - sh) & 31u)), w0, sh == 0u);
}

// Sixteen bytes starting at any byte offset, as four words (5 loads, 4 when aligned).
fn qw4(byte: u32) -> vec4<u32> {
    let i = byte >> 2u;
    let sh = (byte & 3u) * 8u;
    let lo = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let hi = vec4<u32>(lo.yzw, q_buf[(byte + 15u) >> 2u]);
    return select((lo >> vec4<u32>(sh)) | (hi << vec4<u32>((32u - sh) & 31u)), lo, sh == 0u);
}

// The byte at a byte offset.
fn qb(byte: u32) -> u32 {
    return (q_buf[byte >> 2u] >> ((byte & 3u) * 8u)) & 0xffu;
}

// The little-endian f16 at a byte offset, widened exactly.
fn qh(byte: u32) -> f32 {
    return q_f16(qw(byte) & 0xffffu);
}

// The four bytes of word `w` in element order, each shifted right by `sh` and masked.
fn lanes(w: u32, sh: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(w, w >> 8u, w >> 16u, w >> 24u) >> vec4<u32>(sh)) & vec4<u32>(mask);
}

// Bits `first` .. `first + 3` of `x`, one per lane.
fn bit4(x: u32, first: u32) -> vec4<u32> {
    return (vec4<u32>(x) >> (vec4<u32>(first) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
}

// The 16 bytes `w` (shifted and masked as `lanes`) as values minus `bias`.
fn cols(w: vec4<u32>, sh: u32, mask: u32, bias: f32) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(lanes(w.x, sh, mask)) - bias,
        vec4<f32>(lanes(w.y, sh, mask)) - bias,
        vec4<f32>(lanes(w.z, sh, mask)) - bias,
        vec4<f32>(lanes(w.w, sh, mask)) - bias,
    );
}

// 32 consecutive elements of a block: (scale, offset) of elements 0 .. 15 in `sc.xy` and of
// 16 .. 31 in `sc.zw` (the same pair twice where one covers all 32), and the values, `lo`
// elements 0 .. 15 and `hi` 16 .. 31 (column c = elements 4c .. 4c+3 of the half).
struct Sub32 {
    sc: vec4<f32>,
    lo: mat4x4<f32>,
    hi: mat4x4<f32>,
}

// Elements 4j .. 4j + 3 (`lo`) and 16 + 4j .. 16 + 4j + 3 (`hi`) of a 32-element block, quarter
// j of it, with the block's (scale, offset) in `sc`: what `T_q8(blk, j)` of a 32-element type
// returns (bound by build.rs to `q_quarter`), for kernels whose four adjacent invocations
// share a block. In every 32-element layout those eight elements sit in one word of nibbles
// (4-bit types) or two words of bytes (Q8_0), read through `qw`, so a quarter is two or three
// word loads.
struct Quarter {
    sc: vec2<f32>,
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// The four words that start two bytes into the words `lo` (the upper halves of `lo`, joined to
// the lower halves of `hi`, the words after them).
fn q_mid4(lo: vec4<u32>, hi: vec4<u32>) -> vec4<u32> {
    return (lo >> vec4<u32>(16u)) | (hi << vec4<u32>(16u));
}

// The word that starts two bytes into word `lo` (`hi` the word after it).
fn q_mid(lo: u32, hi: u32) -> u32 {
    return (lo >> 16u) | (hi << 16u);
}

// The f16 of a block's first two bytes, the block at byte `blk` starting in word `w`.
fn q_head_f16(w: u32, blk: u32) -> f32 {
    return q_f16(select(w & 0xffffu, w >> 16u, (blk & 2u) != 0u));
}

// (d, m) of a block whose first word of fields is f16 d then f16 m, at byte `blk`, its first
// two words `w0`, `w1`.
fn q_head_dm(w0: u32, w1: u32, blk: u32) -> vec2<f32> {
    let dm = select(w0, q_mid(w0, w1), (blk & 2u) != 0u);
    return vec2<f32>(q_f16(dm & 0xffffu), q_f16(dm >> 16u));
}

// An f16 scale and the 16 bytes after it (Q4_0, IQ4_NL): `w` is the 16 bytes as four words.
struct ScaleWords {
    d: f32,
    w: vec4<u32>,
}

// The 18-byte block at byte `blk` as f16 d and 16 bytes: five aligned loads (the bytes are
// words 1 .. 4 when the block starts two bytes into a word, else cut from words 0 .. 4).
fn q_d16(blk: u32) -> ScaleWords {
    let i = blk >> 2u;
    let a = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let b = vec4<u32>(a.yzw, q_buf[i + 4u]);
    return ScaleWords(q_head_f16(a.x, blk), select(q_mid4(a, b), b, (blk & 2u) != 0u));
}

// The 16 bytes at an even byte `b` as four words: loads from the word holding `b`, cut two
// bytes in where `b` is not on a word (the fifth load is the fourth word again where it is).
fn q_even16(b: u32) -> vec4<u32> {
    let i = b >> 2u;
    let lo = vec4<u32>(q_buf[i], q_buf[i + 1u], q_buf[i + 2u], q_buf[i + 3u]);
    let hi = vec4<u32>(lo.yzw, q_buf[(b + 15u) >> 2u]);
    return select(lo, q_mid4(lo, hi), (b & 2u) != 0u);
}

// The two bytes at an even byte `b`, one load.
fn q_even_u16(b: u32) -> u32 {
    return (q_buf[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu;
}

// Small unsigned integers `v` (below 2^23) as f32 minus `bias`, exactly, with no
// integer-to-float conversion (a quarter-rate instruction on NVIDIA GPUs, one per value):
// `v` or-ed into the mantissa of 2^23 is the float 2^23 + v, and 2^23 + bias is exact too, so
// the difference is `v - bias` with no rounding (the same bits `vec4<f32>(v) - bias` gives).
fn u2f(v: vec4<u32>, bias: f32) -> vec4<f32> {
    return bitcast<vec4<f32>>(v | vec4<u32>(0x4b000000u)) - (8388608.0 + bias);
}

// `cols` through `u2f`: the whole-block readers' form.
fn cols_f(w: vec4<u32>, sh: u32, mask: u32, bias: f32) -> mat4x4<f32> {
    return mat4x4<f32>(
        u2f(lanes(w.x, sh, mask), bias),
        u2f(lanes(w.y, sh, mask), bias),
        u2f(lanes(w.z, sh, mask), bias),
        u2f(lanes(w.w, sh, mask), bias),
    );
}

// A 32-element piece as the integer-dot decode products read it (`T_qd(blk, j)`: piece j of
// the block at byte `blk`, the whole block of a 32-element type; bound by build.rs to `q_qd`
// for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K; `mul_mat_vec_qd_body.wgsl`): `w0` and `w1` hold its
// elements 0 .. 15 and 16 .. 31 as bytes (byte i of the run in byte i % 4 of word i / 4),
// unsigned for Q4_0, Q4_1 and Q4_K, signed for Q8_0 and Q6_K (`Q_SIGNED`); element e is
// `s.x * w_e` (`s.y` for the second half) plus `m`.
struct QdPiece {
    s: vec2<f32>,
    m: f32,
    w0: vec4<u32>,
    w1: vec4<u32>,
}
