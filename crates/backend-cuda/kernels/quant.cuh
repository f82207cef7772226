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

// Q4_K / Q5_K: scale and min (6 bits each) of sub-block j (32 values) from the 12 scale bytes.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
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
