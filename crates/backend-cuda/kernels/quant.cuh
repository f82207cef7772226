// GGUF block (quantized) weights: the one place that knows each block type's bytes.
//
// Why: every kernel that reads a quantized weight (the `quant` module's row gather, matrix-vector
// product and dequantization for cuBLAS) needs the same per-type unpacking; keeping it in one
// function per type means a layout fact is written once, and the emulation test checks it
// bit for bit against gguf-py's `gguf.quants.dequantize` (emu/quant_cases.txt).
//
// Strategy: a block of QB values (32 or 256) is decoded in chunks of 16 consecutive values:
// `dq16<QT>(block, c, v)` writes values 16c .. 16c+15 of the block to v. Every type's scales
// are constant over such a chunk (the K types scale per 16 or 32 values), so a chunk needs one
// scale and its quant bits. The arithmetic is gguf-py's, operation for operation, with every
// product rounded on its own (`__fmul_rn`: NVRTC would otherwise contract `d * q - m` into an
// FMA) so the values are bit-identical to the reference on the device as in the emulation.
// Blocks are only 2-byte aligned (18, 22, 110 ... bytes), so fields are read as bytes and
// 16-bit words.
//
// Codes: the dtype codes of the block types continue common.cuh's (`qt` in src/exec/quant.rs).

#define DT_Q4_0 4
#define DT_Q4_1 5
#define DT_Q5_0 6
#define DT_Q5_1 7
#define DT_Q8_0 8
#define DT_Q2_K 9
#define DT_Q3_K 10
#define DT_Q4_K 11
#define DT_Q5_K 12
#define DT_Q6_K 13
#define DT_IQ4_NL 14
#define DT_IQ4_XS 15

typedef unsigned char u8;

// Values and bytes per block.
__device__ __forceinline__ int q_block_size(int qt) { return qt >= DT_Q2_K && qt != DT_IQ4_NL ? 256 : 32; }
__device__ __forceinline__ int q_block_bytes(int qt) {
    switch (qt) {
        case DT_Q4_0: return 18;
        case DT_Q4_1: return 20;
        case DT_Q5_0: return 22;
        case DT_Q5_1: return 24;
        case DT_Q8_0: return 34;
        case DT_Q2_K: return 84;
        case DT_Q3_K: return 110;
        case DT_Q4_K: return 144;
        case DT_Q5_K: return 176;
        case DT_Q6_K: return 210;
        case DT_IQ4_NL: return 18;
        case DT_IQ4_XS: return 136;
        default: return 1;  // not a block type: the host never passes one
    }
}

__device__ __forceinline__ float q_f16(const u8* p) { return h2f(*(const u16*)p); }
__device__ __forceinline__ float q_mul(float a, float b) { return __fmul_rn(a, b); }

// IQ4_NL's and IQ4_XS's 16 levels (-127, -104, ... 113), packed as signed bytes in two
// words so the lookup stays in registers.
__device__ __forceinline__ float iq4_level(int i) {
    const u64 w = i < 8 ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
    return (float)(signed char)(u8)(w >> (8 * (i & 7)));
}

// Q4_K / Q5_K: scale and min (6 bits each) of sub-block j (32 values) from scale bytes
// y = s[j & 3], z = s[(j & 3) + 4] and x = s[(j & 3) + 8] of the 12 (x unused where j < 4).
__device__ __forceinline__ void k4_sm(u32 y, u32 z, u32 x, bool low, int* sc, int* mn) {
    *sc = (int)(low ? y & 63u : (x & 0xFu) | ((y >> 6) << 4));
    *mn = (int)(low ? z & 63u : (x >> 4) | ((z >> 6) << 4));
}

// The same from the 12 scale bytes at s.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int* sc, int* mn) {
    if (j < 4) {
        k4_sm(s[j], s[j + 4], 0u, true, sc, mn);
    } else {
        k4_sm(s[j - 4], s[j], s[j + 4], false, sc, mn);
    }
}

// Values 16c .. 16c+15 of one block of type QT (c < block size / 16), in order.
template <int QT>
__device__ __forceinline__ void dq16(const u8* b, int c, float* v) {
    if (QT == DT_Q4_0 || QT == DT_Q4_1 || QT == DT_IQ4_NL) {
        // d (f16)[, m (f16)], 16 bytes: value i low nibble of byte i, value 16 + i high nibble.
        const int off = QT == DT_Q4_1 ? 4 : 2;
        const float d = q_f16(b);
        const u8* qs = b + off;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int q = (qs[i] >> (4 * c)) & 0xF;
            if (QT == DT_Q4_0) v[i] = q_mul(d, (float)(q - 8));
            else if (QT == DT_Q4_1) v[i] = q_mul(d, (float)q) + q_f16(b + 2);
            else v[i] = q_mul(d, iq4_level(q));
        }
    } else if (QT == DT_Q5_0 || QT == DT_Q5_1) {
        // d[, m], qh (32 bits: the fifth bit of value i is bit i), 16 bytes of low nibbles.
        const int off = QT == DT_Q5_1 ? 4 : 2;
        const float d = q_f16(b);
        const u32 qh = (u32)(*(const u16*)(b + off)) | ((u32)(*(const u16*)(b + off + 2)) << 16);
        const u8* qs = b + off + 4;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int q = ((qs[i] >> (4 * c)) & 0xF) | (int)(((qh >> (16 * c + i)) & 1u) << 4);
            if (QT == DT_Q5_0) v[i] = q_mul(d, (float)(q - 16));
            else v[i] = q_mul(d, (float)q) + q_f16(b + 2);
        }
    } else if (QT == DT_Q8_0) {
        const float d = q_f16(b);
        const signed char* qs = (const signed char*)(b + 2) + 16 * c;
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = q_mul((float)qs[i], d);
    } else if (QT == DT_Q2_K) {
        // scales[16] (low nibble: scale, high: min, per 16 values), qs[64] (2 bits: value
        // 128h + 32s + l is bits 2s of byte 32h + l), d, dmin.
        const u8 sc = b[c];
        const float dl = q_mul(q_f16(b + 80), (float)(sc & 0xF));
        const float ml = q_mul(q_f16(b + 82), (float)(sc >> 4));
        const int h = c / 8, s = (c / 2) % 4, l0 = (c % 2) * 16;
        const u8* qs = b + 16 + 32 * h + l0;
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = q_mul(dl, (float)((qs[i] >> (2 * s)) & 3)) - ml;
    } else if (QT == DT_Q3_K) {
        // hmask[32] (bit 32h + s... of value v: bit v / 32 of byte v % 32; set: no offset),
        // qs[64] (as Q2_K), scales[12] (16 six-bit scales), d.
        const u8* sc = b + 96;
        const int lo = c < 8 ? (sc[c] & 0xF) : (sc[c - 8] >> 4);
        const int hi = (sc[8 + c % 4] >> (2 * (c / 4))) & 3;
        const float dl = q_mul(q_f16(b + 108), (float)((lo | (hi << 4)) - 32));
        const int h = c / 8, s = (c / 2) % 4, l0 = (c % 2) * 16;
        const u8* qs = b + 32 + 32 * h + l0;
        const u8* hm = b + l0;
        const int bit = c / 2;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int q = ((qs[i] >> (2 * s)) & 3) - (((hm[i] >> bit) & 1) ? 0 : 4);
            v[i] = q_mul(dl, (float)q);
        }
    } else if (QT == DT_Q4_K || QT == DT_Q5_K) {
        // d, dmin, scales[12] (8 six-bit scale/min pairs, per 32 values)[, qh[32] (Q5_K: bit
        // j of byte l is the fifth bit of value 32j + l)], qs[128] (value 64g + 32n + l: nibble
        // n of byte 32g + l).
        const int j = c / 2, l0 = (c % 2) * 16;
        int scv, mnv;
        k4_scale_min(b + 4, j, &scv, &mnv);
        const float d = q_mul(q_f16(b), (float)scv);
        const float m = q_mul(q_f16(b + 2), (float)mnv);
        const u8* qs = b + (QT == DT_Q5_K ? 48 : 16) + 32 * (j / 2) + l0;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            int q = (qs[i] >> (4 * (j % 2))) & 0xF;
            if (QT == DT_Q5_K) q |= ((b[16 + l0 + i] >> j) & 1) << 4;
            v[i] = q_mul(d, (float)q) - m;
        }
    } else if (QT == DT_Q6_K) {
        // ql[128] (value 128h + 64n + l: nibble n of byte 64h + l), qh[64] (value 128h + 32s +
        // l: bits 2s of byte 32h + l), scales[16] (signed, per 16 values), d.
        const float d = q_mul(q_f16(b + 208), (float)(signed char)b[192 + c]);
        const int h = c / 8, w = (c % 8) * 16;  // w: offset inside the half
        const u8* ql = b + 64 * h + w % 64;
        const u8* qh = b + 128 + 32 * h + w % 32;
        const int n = w / 64, s = w / 32;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int q = (((ql[i] >> (4 * n)) & 0xF) | (((qh[i] >> (2 * s)) & 3) << 4)) - 32;
            v[i] = q_mul(d, (float)q);
        }
    } else {  // DT_IQ4_XS
        // d, scales_h (16 bits: 2 high bits per 32 values), scales_l[4] (nibbles), qs[128]
        // (value 32j + 16n + l: nibble n of byte 16j + l).
        const int j = c / 2, n = c % 2;
        const u16 sh = *(const u16*)(b + 2);
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        const float dl = q_mul(q_f16(b), (float)(ls - 32));
        const u8* qs = b + 8 + 16 * j;
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = q_mul(dl, iq4_level((qs[i] >> (4 * n)) & 0xF));
    }
}

// QUANT_SWITCH(qt, body...) expands `body` once per block type with the constant `QTV` bound
// to it (`dq16<QTV>`), as the kernels' `switch (dtb)` over plain types does; no other code
// lists the types.
#define QUANT_CASE(Q, ...) \
    case Q: {              \
        const int QTV = Q; \
        __VA_ARGS__;       \
    } break;
// A module compiled with `-DLOWSYNC_QT=code` holds its kernels for that one block type only
// (kernels.rs compiles the `quant` module once per type, so the types compile in parallel and a
// model's first run waits for the slowest one, not for their sum): the switch then has one case
// and any other code does nothing, as an unknown code does.
#ifdef LOWSYNC_QT
#define QUANT_SWITCH(qt, ...)                \
    switch (qt) {                            \
        QUANT_CASE(LOWSYNC_QT, __VA_ARGS__)  \
        default: break;                      \
    }
#else
#define QUANT_SWITCH(qt, ...)                \
    switch (qt) {                            \
        QUANT_CASE(DT_Q4_0, __VA_ARGS__)     \
        QUANT_CASE(DT_Q4_1, __VA_ARGS__)     \
        QUANT_CASE(DT_Q5_0, __VA_ARGS__)     \
        QUANT_CASE(DT_Q5_1, __VA_ARGS__)     \
        QUANT_CASE(DT_Q8_0, __VA_ARGS__)     \
        QUANT_CASE(DT_Q2_K, __VA_ARGS__)     \
        QUANT_CASE(DT_Q3_K, __VA_ARGS__)     \
        QUANT_CASE(DT_Q4_K, __VA_ARGS__)     \
        QUANT_CASE(DT_Q5_K, __VA_ARGS__)     \
        QUANT_CASE(DT_Q6_K, __VA_ARGS__)     \
        QUANT_CASE(DT_IQ4_NL, __VA_ARGS__)   \
        QUANT_CASE(DT_IQ4_XS, __VA_ARGS__)   \
        default: break;                      \
    }
#endif

// ---------------------------------------------------------------------------------------------
// Integer products for decode: activations as 16-bit integer blocks ("q16"), weights as their
// small integers, two multiply-adds per `__dp2a_lo` / `__dp2a_hi`.
//
// Why: `dq16` costs a byte load and several ALU operations per weight, then an FMA; decode's
// products on quantized weights were bound by those instructions, not by memory. With the
// activation row quantized once per block, a 16-value chunk costs a few 32-bit loads, a few
// bit operations per 4 weights, 8 dp2a and one or two FMAs. 8-bit activations (dp4a) would
// halve the dp2a but move a small model's logits enough to change its greedy answer (the CPU
// backend measured it, docs/tuning.md `LOWSYNC_CPU_QUANT_DOT`); 16 bits keep the products within
// about 1e-5 of the f32 path's.
//
// Strategy: the activation quantization is the CPU backend's (backend-cpu kernels/quant/q16.rs)
// bit for bit: blocks of 32, `d = amax / 32767`, `id = 1 / d` (0 when d is 0), `q = round(x * id)`
// half away from zero, clamped to +-32767, NaN to 0. A block is kept as one 80-byte record
// (`Q16_REC`): its 32 values as i16 (bytes 0..63), d (f32, bytes 64..67) and, per half of 16,
// `d * sum(q)` (bytes 68..75), 16-byte aligned so each half loads as two 16-byte vectors. A weight
// chunk of 16 values is `iq16`: 16 signed bytes w_i (4 ints, value i in byte i % 4 of int i / 4)
// and f32 d, m with value_i = d * w_i + m (m: the type's min, or its offset -8, -16, -4, -32 times
// d; 0 for Q8_0 and the IQ4 types, whose integers are signed already). A chunk's contribution is
// then `d * dx * sum(w_i * q_i) + m * (dx * sum(q_i))`, the integer sum exact (|sum| < 2^27).

// Bytes of one q16 record (32 activation values).
#define Q16_REC 80

// Asks for the 128-byte line holding p to be brought into L2 (no-op in the emulation). L2 is
// the device's point of coherence, so a prefetch before `pdl_entry` can leave nothing stale
// where a later load would find it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}
// 16 bytes at p (2-byte aligned) as 4 words, byte i of the run in byte i % 4 of word i / 4:
// aligned 32-bit loads (every word holds a byte of the run, none past it) shifted by
// `__byte_perm` when p is not 4-byte aligned.
__device__ __forceinline__ void q_ld16(const u8* p, u32 (&w)[4]) {
    const u32* a = (const u32*)((u64)p & ~(u64)3);
    const u32 sh = (u32)((u64)p & 2u);
    const u32 sel = 0x3210u + sh * 0x1111u;  // 0x3210: as is; 0x5432: bytes 2..5 of a pair
    u32 x[5];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = a[i];
    x[4] = a[3 + (sh >> 1)];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __byte_perm(x[i], x[i + 1], sel);
}

// Four IQ4 levels: byte i of v (0..15) -> level (signed byte) in byte i of the result. Levels
// 0..7 come from one `__byte_perm` of the table's first 8 bytes, 8..15 from one of its last,
// and bit 3 of each index picks between them.
__device__ __forceinline__ u32 iq4_levels4(u32 v) {
    const u32 x = v & 0x07070707u;
    const u32 sel = (x & 7u) | ((x >> 4) & 0x70u) | ((x >> 8) & 0x700u) | ((x >> 12) & 0x7000u);
    const u32 lo = __byte_perm(0xbfad9881u, 0xf6eaddcfu, sel);
    const u32 hi = __byte_perm(0x26190d01u, 0x71594535u, sel);
    const u32 m = ((v >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~m) | (hi & m);
}

// Bits 0..3 of h to bit 0 of bytes 0..3.
__device__ __forceinline__ u32 q_spread4(u32 h) { return ((h & 0xFu) * 0x00204081u) & 0x01010101u; }

// Whether `iq16<QT>` has an m term (a min or an offset).
__device__ __forceinline__ constexpr bool q_has_m(int qt) {
    return qt != DT_Q8_0 && qt != DT_IQ4_NL && qt != DT_IQ4_XS;
}

// Chunk c (values 16c .. 16c+15) of one block of type QT as integers: value_i = d * w_i + m,
// w_i signed byte i % 4 of w[i / 4]. The same fields as `dq16`; scales and mins rounded as there.
template <int QT>
__device__ __forceinline__ void iq16(const u8* b, int c, u32 (&w)[4], float& d, float& m) {
    u32 q[4];
    if (QT == DT_Q4_0 || QT == DT_Q4_1 || QT == DT_IQ4_NL) {
        d = q_f16(b);
        m = QT == DT_Q4_0 ? q_mul(d, -8.0f) : QT == DT_Q4_1 ? q_f16(b + 2) : 0.0f;
        q_ld16(b + (QT == DT_Q4_1 ? 4 : 2), q);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 n = (q[t] >> (4 * c)) & 0x0F0F0F0Fu;
            w[t] = QT == DT_IQ4_NL ? iq4_levels4(n) : n;
        }
    } else if (QT == DT_Q5_0 || QT == DT_Q5_1) {
        const int off = QT == DT_Q5_1 ? 4 : 2;
        d = q_f16(b);
        m = QT == DT_Q5_0 ? q_mul(d, -16.0f) : q_f16(b + 2);
        const u32 h = ((u32)(*(const u16*)(b + off)) | ((u32)(*(const u16*)(b + off + 2)) << 16)) >> (16 * c);
        q_ld16(b + off + 4, q);
#pragma unroll
        for (int t = 0; t < 4; ++t) w[t] = ((q[t] >> (4 * c)) & 0x0F0F0F0Fu) | (q_spread4(h >> (4 * t)) << 4);
    } else if (QT == DT_Q8_0) {
        d = q_f16(b);
        m = 0.0f;
        q_ld16(b + 2 + 16 * c, w);
    } else if (QT == DT_Q2_K) {
        const u8 sc = b[c];
        d = q_mul(q_f16(b + 80), (float)(sc & 0xF));
        m = -q_mul(q_f16(b + 82), (float)(sc >> 4));
        const int h = c / 8, s = (c / 2) % 4, l0 = (c % 2) * 16;
        q_ld16(b + 16 + 32 * h + l0, q);
#pragma unroll
        for (int t = 0; t < 4; ++t) w[t] = (q[t] >> (2 * s)) & 0x03030303u;
    } else if (QT == DT_Q3_K) {
        // The high bit set means no offset: w = low bits + 4 * high bit, m = -4 d.
        const u8* sc = b + 96;
        const int lo = c < 8 ? (sc[c] & 0xF) : (sc[c - 8] >> 4);
        const int hi = (sc[8 + c % 4] >> (2 * (c / 4))) & 3;
        d = q_mul(q_f16(b + 108), (float)((lo | (hi << 4)) - 32));
        m = q_mul(d, -4.0f);
        const int h = c / 8, s = (c / 2) % 4, l0 = (c % 2) * 16, bit = c / 2;
        u32 hm[4];
        q_ld16(b + 32 + 32 * h + l0, q);
        q_ld16(b + l0, hm);
#pragma unroll
        for (int t = 0; t < 4; ++t) w[t] = ((q[t] >> (2 * s)) & 0x03030303u) | (((hm[t] >> bit) & 0x01010101u) << 2);
    } else if (QT == DT_Q4_K || QT == DT_Q5_K) {
        const int j = c / 2, l0 = (c % 2) * 16;
        int scv, mnv;
        k4_scale_min(b + 4, j, &scv, &mnv);
        d = q_mul(q_f16(b), (float)scv);
        m = -q_mul(q_f16(b + 2), (float)mnv);
        q_ld16(b + (QT == DT_Q5_K ? 48 : 16) + 32 * (j / 2) + l0, q);
        u32 qh[4];
        if (QT == DT_Q5_K) q_ld16(b + 16 + l0, qh);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[t] = (q[t] >> (4 * (j % 2))) & 0x0F0F0F0Fu;
            if (QT == DT_Q5_K) w[t] |= ((qh[t] >> j) & 0x01010101u) << 4;
        }
    } else if (QT == DT_Q6_K) {
        // w = the 6-bit value (0..63), m = -32 d.
        d = q_mul(q_f16(b + 208), (float)(signed char)b[192 + c]);
        m = q_mul(d, -32.0f);
        const int h = c / 8, o = (c % 8) * 16;
        const int n = o / 64, s = o / 32;
        u32 qh[4];
        q_ld16(b + 64 * h + o % 64, q);
        q_ld16(b + 128 + 32 * h + o % 32, qh);
#pragma unroll
        for (int t = 0; t < 4; ++t) w[t] = ((q[t] >> (4 * n)) & 0x0F0F0F0Fu) | (((qh[t] >> (2 * s)) & 0x03030303u) << 4);
    } else {  // DT_IQ4_XS
        const int j = c / 2, n = c % 2;
        const u16 sh = *(const u16*)(b + 2);
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        d = q_mul(q_f16(b), (float)(ls - 32));
        m = 0.0f;
        q_ld16(b + 8 + 16 * j, q);
#pragma unroll
        for (int t = 0; t < 4; ++t) w[t] = iq4_levels4((q[t] >> (4 * n)) & 0x0F0F0F0Fu);
    }
}

// Bits s .. s + 31 of the 64-bit pair (hi, lo), s in 0..32 (a funnel shift; s = 32 is hi).
__device__ __forceinline__ u32 q_shr64(u32 lo, u32 hi, u32 s) {
    return (u32)((((u64)hi << 32) | lo) >> s);
}

// Piece p (values 32p .. 32p + 31 of the block at b, of type QT: its chunks 2p and 2p + 1) as
// `iq16` gives each chunk: the same integers, d and m. Decode products spend their time
// issuing instructions, not waiting for bytes, so the types whose piece is one run of bytes
// load it once for both chunks:
// - Q4_0 (18-byte blocks, 2-byte aligned) and Q8_0 (34): the block lies in 5 (9) aligned words
//   starting at the word that holds d, each holding a byte of the block; d is that word's low or
//   high half and each quant word one funnel shift of two neighbours.
// - Q4_K (144-byte blocks): with the block 16-byte aligned (every row of a 16-byte aligned
//   weight: 144 is a multiple of 16), the piece's 32 quant bytes are two 16-byte loads and the
//   two chunks share one scale and min. A16: the caller knows the block is aligned (the typed
//   decode products, which the host launches only then), so the test and the fallback below
//   are compiled out (on sm_90 they cost the typed Q4_K kernel a few spilled registers).
// - Q6_K (210-byte blocks): the piece's low and high bits are one 32-byte run each.
// - Q4_1 and IQ4_NL (one piece a block): the 16 quant bytes are one `q_ld16` for both chunks
//   (the low and the high nibbles), d (and Q4_1's m) one load each.
// Every other type, and a Q4_K block that is not 16-byte aligned, takes `iq16` per chunk.
template <int QT, bool A16 = false>
__device__ __forceinline__ void iq32(const u8* b, int p, u32 (&w0)[4], u32 (&w1)[4], float& d0,
                                     float& m0, float& d1, float& m1) {
    if (QT == DT_Q4_0 || QT == DT_Q8_0) {
        constexpr int NW = QT == DT_Q4_0 ? 5 : 9;
        const u32* a = (const u32*)((u64)b & ~(u64)3);
        const u32 s = ((u32)(u64)b & 2u) << 3;  // d's bit offset in the first word: 0 or 16
        u32 x[NW];
#pragma unroll
        for (int i = 0; i < NW; ++i) x[i] = a[i];
        d0 = h2f((u16)(x[0] >> s));
        m0 = QT == DT_Q4_0 ? q_mul(d0, -8.0f) : 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 q = q_shr64(x[t], x[t + 1], s + 16);
            if (QT == DT_Q4_0) {
                w0[t] = q & 0x0F0F0F0Fu;
                w1[t] = (q >> 4) & 0x0F0F0F0Fu;
            } else {
                w0[t] = q;
                w1[t] = q_shr64(x[t + 4], x[t + 5], s + 16);
            }
        }
        d1 = d0;
        m1 = m0;
        return;
    }
    if (QT == DT_Q4_1 || QT == DT_IQ4_NL) {
        u32 q[4];
        d0 = q_f16(b);
        m0 = QT == DT_Q4_1 ? q_f16(b + 2) : 0.0f;
        q_ld16(b + (QT == DT_Q4_1 ? 4 : 2), q);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const u32 lo = q[t] & 0x0F0F0F0Fu, hi = (q[t] >> 4) & 0x0F0F0F0Fu;
            w0[t] = QT == DT_IQ4_NL ? iq4_levels4(lo) : lo;
            w1[t] = QT == DT_IQ4_NL ? iq4_levels4(hi) : hi;
        }
        d1 = d0;
        m1 = m0;
        return;
    }
    if (QT == DT_Q4_K && (A16 || ((u64)b & 15u) == 0)) {
        int scv, mnv;
        k4_scale_min(b + 4, p, &scv, &mnv);
        d0 = q_mul(q_f16(b), (float)scv);
        m0 = -q_mul(q_f16(b + 2), (float)mnv);
        const uint4* q = (const uint4*)(b + 16 + 32 * (p / 2));
        const uint4 lo = q[0], hi = q[1];
        const u32 sh = 4 * (p % 2);
        const u32 a[4] = {lo.x, lo.y, lo.z, lo.w}, c[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            w0[t] = (a[t] >> sh) & 0x0F0F0F0Fu;
            w1[t] = (c[t] >> sh) & 0x0F0F0F0Fu;
        }
        d1 = d0;
        m1 = m0;
        return;
    }
    if (QT == DT_Q6_K) {
        // Both chunks' low bits are one 32-byte run of ql, their high bits one of qh, each in 9
        // aligned words from the word holding its first byte (the block is 2-byte aligned, the
        // runs 32-byte steps into it, so every word holds a byte of the block); the two chunks'
        // int8 scales are one 16-bit load.
        const u32 sh = ((u32)(u64)b & 2u) << 3;
        const u32* ql = (const u32*)(((u64)b & ~(u64)3) + 64 * (p / 4) + 32 * (p % 2));
        const u32* qh = (const u32*)(((u64)b & ~(u64)3) + 128 + 32 * (p / 4));
        u32 x[9], y[9];
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            x[i] = ql[i];
            y[i] = qh[i];
        }
        const u32 sc = *(const u16*)(b + 192 + 2 * p);
        const float dd = q_f16(b + 208);
        d0 = q_mul(dd, (float)(signed char)(sc & 0xFFu));
        m0 = q_mul(d0, -32.0f);
        d1 = q_mul(dd, (float)(signed char)(sc >> 8));
        m1 = q_mul(d1, -32.0f);
        const u32 n = 4 * ((p % 4) / 2), hs = 2 * (p % 4);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const u32 lo = q_shr64(x[t], x[t + 1], sh), hi = q_shr64(y[t], y[t + 1], sh);
            const u32 v = ((lo >> n) & 0x0F0F0F0Fu) | (((hi >> hs) & 0x03030303u) << 4);
            if (t < 4) {
                w0[t] = v;
            } else {
                w1[t - 4] = v;
            }
        }
        return;
    }
    iq16<QT>(b, 2 * p, w0, d0, m0);
    iq16<QT>(b, 2 * p + 1, w1, d1, m1);
}

// Pieces in pairs that share their bytes (`q_paired`: Q4_K and Q6_K). Pair q of a block:
// - Q4_K (q < 4): pieces 2q and 2q + 1, the low and the high nibbles of one 32-byte run of
//   qs (byte 16 + 32q); their scales and mins are sub-blocks 2q and 2q + 1 of the 12 bytes.
// - Q6_K (q < 4; h = q / 2, s = q % 2): pieces 4h + s and 4h + s + 2, whose low bits are the
//   low and the high nibbles of one 32-byte run of ql (64h + 32s) and whose high bits are bits
//   2s and 2s + 4 of one 32-byte run of qh (32h).
//
// Why: `iq32` loads a piece's runs for each piece, so every quant byte of these blocks is
// loaded twice by the lanes of a row (Q6_K's also funnel-shifted twice); a lane that takes
// both pieces of a pair loads each run once. The decode products on these types take their
// pieces this way (`fq_dot16`, `fq_rows16`: lane l takes pairs l, l + 32, ... of the row, each
// pair's pieces in order), so their sums run in that order.
__device__ __forceinline__ constexpr bool q_paired(int qt) { return qt == DT_Q4_K || qt == DT_Q6_K; }

// The row's index of piece e (0, 1: the pair's first and second) of pair g of the row.
template <int QT>
__device__ __forceinline__ int q_pair_piece(int g, int e) {
    if (QT == DT_Q6_K) return (g / 4) * 8 + 4 * ((g % 4) / 2) + (g % 2) + 2 * e;
    return 2 * g + e;
}

// Chunks 2a, 2a + 1, 2b, 2b + 1 (a, b: pair q's pieces) of the block at b of type QT
// (`q_paired`) into w[0..3] with their d and m: the integers and scales `iq16` gives each
// chunk. A16: the block starts on 16 bytes (`iq32`'s A16); Q4_K's run is then two 16-byte
// loads, else two `q_ld16`.
template <int QT, bool A16 = false>
__device__ __forceinline__ void iq64(const u8* b, int q, u32 (*w)[4], float* d, float* m) {
    if (QT == DT_Q4_K) {
        float dd[2], mm[2];
        u32 a[4], c[4];
        if (A16 || ((u64)b & 15u) == 0) {
            // The block's first 16 bytes (d, dmin, the 12 scale bytes) in one load, each
            // sub-block's scale bytes (`k4_sm`) taken from its words: sub-block j = 2q + e reads
            // byte j & 3 of words 1, 2 and 3. The same integers, so the same d and m bit for bit.
            const uint4 hd = *(const uint4*)b;
            const uint4* r = (const uint4*)(b + 16 + 32 * q);
            const uint4 lo = r[0], hi = r[1];
            const float d0 = h2f((u16)(hd.x & 0xFFFFu)), dm = h2f((u16)(hd.x >> 16));
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 sh = 16 * (q & 1) + 8 * e;
                int scv, mnv;
                k4_sm((hd.y >> sh) & 0xFFu, (hd.z >> sh) & 0xFFu, (hd.w >> sh) & 0xFFu, q < 2, &scv, &mnv);
                dd[e] = q_mul(d0, (float)scv);
                mm[e] = -q_mul(dm, (float)mnv);
            }
            a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
            c[0] = hi.x, c[1] = hi.y, c[2] = hi.z, c[3] = hi.w;
        } else {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int scv, mnv;
                k4_scale_min(b + 4, 2 * q + e, &scv, &mnv);
                dd[e] = q_mul(q_f16(b), (float)scv);
                mm[e] = -q_mul(q_f16(b + 2), (float)mnv);
            }
            q_ld16(b + 16 + 32 * q, a);
            q_ld16(b + 32 + 32 * q, c);
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            w[0][t] = a[t] & 0x0F0F0F0Fu;
            w[1][t] = c[t] & 0x0F0F0F0Fu;
            w[2][t] = (a[t] >> 4) & 0x0F0F0F0Fu;
            w[3][t] = (c[t] >> 4) & 0x0F0F0F0Fu;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            d[k] = dd[k / 2];
            m[k] = mm[k / 2];
        }
        return;
    }
    // DT_Q6_K: each run in 9 aligned words from the word holding its first byte (as `iq32`).
    const int h = q / 2, s = q % 2;
    const u32 sh = ((u32)(u64)b & 2u) << 3;
    const u32* ql = (const u32*)(((u64)b & ~(u64)3) + 64 * h + 32 * s);
    const u32* qh = (const u32*)(((u64)b & ~(u64)3) + 128 + 32 * h);
    u32 x[9], y[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) {
        x[i] = ql[i];
        y[i] = qh[i];
    }
    const int pa = 4 * h + s;
    const u32 sa = *(const u16*)(b + 192 + 2 * pa), sb = *(const u16*)(b + 192 + 2 * (pa + 2));
    const float dd = q_f16(b + 208);
    const u32 sc[4] = {sa & 0xFFu, sa >> 8, sb & 0xFFu, sb >> 8};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        d[k] = q_mul(dd, (float)(signed char)sc[k]);
        m[k] = q_mul(d[k], -32.0f);
    }
    const u32 hs = 2 * s;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        const u32 lo = q_shr64(x[t], x[t + 1], sh), hi = q_shr64(y[t], y[t + 1], sh);
        w[t / 4][t % 4] = (lo & 0x0F0F0F0Fu) | (((hi >> hs) & 0x03030303u) << 4);
        w[2 + t / 4][t % 4] = ((lo >> 4) & 0x0F0F0F0Fu) | (((hi >> (hs + 4)) & 0x03030303u) << 4);
    }
}

// acc plus chunk (w, d, m) times half `half` (0, 1) of q16 record `rec` (`Q16_REC` bytes,
// 16-byte aligned): the integer sum in k order, then d * dx times it and m times the half's
// `dx * sum(q)`.
template <int QT>
__device__ __forceinline__ float q16_fma(const u32 (&w)[4], float d, float m, const u8* rec, int half, float acc) {
    const uint4* x = (const uint4*)(rec + 32 * half);
    const uint4 x0 = x[0], x1 = x[1];
    int s = __dp2a_lo((int)x0.x, (int)w[0], 0);
    s = __dp2a_hi((int)x0.y, (int)w[0], s);
    s = __dp2a_lo((int)x0.z, (int)w[1], s);
    s = __dp2a_hi((int)x0.w, (int)w[1], s);
    s = __dp2a_lo((int)x1.x, (int)w[2], s);
    s = __dp2a_hi((int)x1.y, (int)w[2], s);
    s = __dp2a_lo((int)x1.z, (int)w[3], s);
    s = __dp2a_hi((int)x1.w, (int)w[3], s);
    const float* f = (const float*)(rec + 64);
    acc = fmaf(q_mul(d, f[0]), (float)s, acc);
    if (q_has_m(QT)) acc = fmaf(m, f[1 + half], acc);
    return acc;
}

// Quantizes half-block h (16 values v) of a row into its record `rec` (`Q16_REC` bytes):
// called by the two threads of a block's halves, lanes 2i and 2i + 1 of one warp (h even in
// the even lane), every lane of the warp taking part (`live` false: a lane past the row, which
// stores nothing).
__device__ __forceinline__ void q16_half(const float (&v)[16], u8* rec, int h, bool live) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));  // NaN skipped, as f32::max
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    if (!live) return;
    const float d = __fdiv_rn(amax, 32767.0f);
    const float id = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    int sum = 0;
    u32 p[8];
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
        int q2[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float r = roundf(__fmul_rn(v[i + e], id));
            q2[e] = r != r ? 0 : (int)fminf(fmaxf(r, -32767.0f), 32767.0f);
            sum += q2[e];
        }
        p[i / 2] = ((u32)q2[0] & 0xFFFFu) | ((u32)q2[1] << 16);
    }
    uint4* qv = (uint4*)(rec + 32 * (h & 1));
    qv[0] = make_uint4(p[0], p[1], p[2], p[3]);
    qv[1] = make_uint4(p[4], p[5], p[6], p[7]);
    float* f = (float*)(rec + 64);
    if ((h & 1) == 0) f[0] = d;
    f[1 + (h & 1)] = __fmul_rn(d, (float)sum);  // |sum| < 2^20: exact
}

// ---------------------------------------------------------------------------------------------
// Integer products on 8-bit activations ("q8", `LOWSYNC_CUDA_TUNE=qdot=q8`): as q16 above with
// the row in 8-bit blocks, four multiply-adds per `__dp4a`.
//
// Why: the q16 products still spend 8 dp2a and two 16-byte shared-memory loads of the row per
// 16 weights; with 8-bit activations a 32-value block is 8 dp4a and two 16-byte loads, and the
// types whose scale spans 32 values (all but Q2_K, Q3_K and Q6_K) take their f32 work once per
// block. The cost is precision: a value moves by up to d / 2 = amax / 254 of its block (NMSE of
// a dot product about 1e-5 on random data, against 1e-10 for q16), which is why q16 stays the
// default (docs/tuning.md `qdot`).
//
// Strategy: the activation quantization is the CPU backend's 8-bit one (backend-cpu
// kernels/quant/q8.rs, its scalar `quantize_block`) value for value: blocks of 32, `d = amax /
// 127`, `id = 1 / d` (0 when d is 0), `q = round(x * id)` half away from zero, clamped to +-127,
// NaN to 0 (the values in natural order, not that file's packed order). A block is one 48-byte
// record (`Q8_REC`, 16-byte aligned): its 32 values as i8 (bytes 0..31), d (f32, bytes 32..35),
// `d * sum(q)` of the block (36..39) and of each half of 16 (40..47). The weights are `iq16`'s
// integers (every type's fit a signed byte: 0..63 or -127..127), so `__dp4a` takes them as they
// are; a 32-value piece (chunks 2p and 2p + 1 of a block, `q8_piece`) costs 8 dp4a and, where
// both chunks share d and m, two FMAs. Integer sums are exact (|sum| <= 32 * 127 * 127).

// Bytes of one q8 record (32 activation values).
#define Q8_REC 48

// Whether chunks 2p and 2p + 1 of a block of type QT share iq16's d and m (the type scales 32
// values or more at once).
__device__ __forceinline__ constexpr bool q_pair_scaled(int qt) {
    return qt != DT_Q2_K && qt != DT_Q3_K && qt != DT_Q6_K;
}

// Sum of the products of the 16 signed bytes of w and x, in k order from s.
__device__ __forceinline__ int q8_dot16(const u32 (&w)[4], const uint4& x, int s) {
    s = __dp4a((int)x.x, (int)w[0], s);
    s = __dp4a((int)x.y, (int)w[1], s);
    s = __dp4a((int)x.z, (int)w[2], s);
    return __dp4a((int)x.w, (int)w[3], s);
}

// One q8 record in registers: the two halves' values and (d, d * sum, d * sum of half 0, of
// half 1), three 16-byte loads from a 16-byte aligned record.
struct Q8x {
    uint4 lo, hi;
    float4 f;
};
__device__ __forceinline__ Q8x q8_load(const u8* rec) {
    const uint4* x = (const uint4*)rec;
    Q8x r;
    r.lo = x[0];
    r.hi = x[1];
    r.f = *(const float4*)(rec + 32);
    return r;
}

// The products of a piece already decoded (`iq32`'s or `iq64`'s two chunks (w0, d0, m0) and
// (w1, d1, m1)) with record x: `q8_piece` after its loads.
template <int QT>
__device__ __forceinline__ float q8_fma(const u32 (&w0)[4], const u32 (&w1)[4], float d0, float m0, float d1,
                                        float m1, const Q8x& x, float acc) {
    if (q_pair_scaled(QT)) {
        const int s = q8_dot16(w1, x.hi, q8_dot16(w0, x.lo, 0));
        acc = fmaf(q_mul(d0, x.f.x), (float)s, acc);
        if (q_has_m(QT)) acc = fmaf(m0, x.f.y, acc);
    } else {
        const int s0 = q8_dot16(w0, x.lo, 0), s1 = q8_dot16(w1, x.hi, 0);
        acc = fmaf(q_mul(d0, x.f.x), (float)s0, acc);
        if (q_has_m(QT)) acc = fmaf(m0, x.f.z, acc);
        acc = fmaf(q_mul(d1, x.f.x), (float)s1, acc);
        if (q_has_m(QT)) acc = fmaf(m1, x.f.w, acc);
    }
    return acc;
}

// acc plus the 32-value piece p of a weight row (chunks 2p, 2p + 1 of the block at blk, of type
// QT; p is the piece's index inside the block) times q8 record x (`q8_load`): one integer sum
// and d * dx, m * (dx * sum(q)) where the chunks share d and m, else each half's two terms in
// turn.
template <int QT>
__device__ __forceinline__ float q8_piece(const u8* blk, int p, const Q8x& x, float acc) {
    u32 w0[4], w1[4];
    float d0, m0, d1, m1;
    iq32<QT>(blk, p, w0, w1, d0, m0, d1, m1);
    return q8_fma<QT>(w0, w1, d0, m0, d1, m1, x, acc);
}

// Quantizes half-block h (16 values v) of a row into its q8 record `rec` (`Q8_REC` bytes):
// called as `q16_half` is, by lanes 2i and 2i + 1 of one warp for a block's halves, every lane
// of the warp taking part (`live` false: a lane past the row, which stores nothing; the row
// holds whole blocks, so both lanes of a pair are live or neither is).
__device__ __forceinline__ void q8_half(const float (&v)[16], u8* rec, int h, bool live) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));  // NaN skipped, as f32::max
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    int sum = 0;
    u32 p[4];
#pragma unroll
    for (int i = 0; i < 16; i += 4) {
        u32 word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float r = roundf(__fmul_rn(v[i + e], id));
            const int q = r != r ? 0 : (int)fminf(fmaxf(r, -127.0f), 127.0f);
            sum += q;
            word |= ((u32)q & 0xFFu) << (8 * e);
        }
        p[i / 4] = word;
    }
    const int total = sum + (int)__shfl_xor_sync(0xffffffffu, (u32)sum, 1);
    if (!live) return;
    ((uint4*)rec)[h & 1] = make_uint4(p[0], p[1], p[2], p[3]);
    float* f = (float*)(rec + 32);
    if ((h & 1) == 0) {
        f[0] = d;
        f[1] = __fmul_rn(d, (float)total);  // |total| <= 32 * 127: exact
    }
    f[2 + (h & 1)] = __fmul_rn(d, (float)sum);
}
