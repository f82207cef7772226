// Element-wise ops, strided copies and fills. One thread per element (grid-stride loop); the
// host coalesces the shared iteration shape first, so most launches run over 1-2 axes.

#define OP_SCALE 0
#define OP_SILU 1
#define OP_GELU 2
#define OP_ADD 10
#define OP_MUL 11
#define OP_SWIGLU 12

// x / (1 + e^-x): gives -0 instead of NaN for large negative x (as the CPU oracle).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_f(float x) {
    const float k = 0.7978846f;
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

extern "C" __global__ void ew_unary(int op, i64 n, Lay L, void* dst, int dtd, const void* a,
                                    int dta, float scale) {
    pdl_entry();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 o[3];
        lay_offsets(L, i, 2, o);
        float x = ld(a, dta, o[1]);
        float y = op == OP_SCALE ? x * scale : op == OP_SILU ? silu_f(x) : gelu_f(x);
        st(dst, dtd, o[0], y);
    }
}

extern "C" __global__ void ew_binary(int op, i64 n, Lay L, void* dst, int dtd, const void* a,
                                     int dta, const void* b, int dtb) {
    pdl_entry();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 o[3];
        lay_offsets(L, i, 3, o);
        float x = ld(a, dta, o[1]);
        float y = ld(b, dtb, o[2]);
        float r = op == OP_ADD ? x + y : op == OP_MUL ? x * y : silu_f(x) * y;
        st(dst, dtd, o[0], r);
    }
}

// dst = src, converting floats through f32; equal dtypes copy the bits (i32 included).
extern "C" __global__ void copy_strided(i64 n, Lay L, void* dst, int dtd, const void* src,
                                        int dts) {
    pdl_entry();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 o[3];
        lay_offsets(L, i, 2, o);
        if (dtd == dts) {
            if (dtd == DT_F32 || dtd == DT_I32) {
                ((u32*)dst)[o[0]] = ((const u32*)src)[o[1]];
            } else {
                ((u16*)dst)[o[0]] = ((const u16*)src)[o[1]];
            }
        } else {
            st(dst, dtd, o[0], ld(src, dts, o[1]));
        }
    }
}

extern "C" __global__ void fill(i64 n, Lay L, void* dst, int dtd, float value) {
    pdl_entry();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 o[3];
        lay_offsets(L, i, 1, o);
        st(dst, dtd, o[0], value);
    }
}

// `len` bytes from `s` to `d` by the threads of one block, with the widest accesses the three
// values' alignment allows. Either side may be pinned host memory (unified addressing maps it
// at its host pointer) or, in `copy_batch`, the kernel's own parameter block.
__device__ __forceinline__ void block_copy(unsigned char* d, const unsigned char* s, u64 len) {
    const u64 al = (u64)d | (u64)s | len;
    if ((al & 15) == 0) {
        for (u64 i = threadIdx.x; i < len / 16; i += blockDim.x)
            ((uint4*)d)[i] = ((const uint4*)s)[i];
    } else if ((al & 3) == 0) {
        for (u64 i = threadIdx.x; i < len / 4; i += blockDim.x) ((u32*)d)[i] = ((const u32*)s)[i];
    } else {
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
}

// A small copy done by one block instead of a copy engine (tune key `copy_kernel`; a read
// the copy batch cannot take). Launched without dependent launch, so it starts after
// everything queued before it completed; the next kernel's `griddepcontrol.wait` (or a graph
// launch) orders what follows.
extern "C" __global__ void small_copy(u64 dst, u64 src, i64 len) {
    block_copy((unsigned char*)dst, (const unsigned char*)src, (u64)len);
}

// Small copies batched into one launch (`TicketStream::defer_htod` / `defer_dtod` /
// `defer_dtoh`): host bytes ride in the parameter block itself, so a host-to-device copy reads
// no host memory and takes no copy engine. Layout shared with `BatchParams` in tickets.rs (4,048
// bytes: within the 4 KiB of parameters every device takes). The copies run in order, one
// block, a barrier between them: a later copy may read what an earlier one wrote.
#define BATCH_ITEMS 8
#define BATCH_DATA 3840
struct BatchItem {
    u64 dst;
    u64 src;  // 0: the bytes are the batch's own, at `at`
    u32 len;
    u32 at;
};
struct __align__(16) CopyBatch {
    unsigned char data[BATCH_DATA];
    BatchItem items[BATCH_ITEMS];
    u32 n;
    u32 pad;
};

extern "C" __global__ void copy_batch(const __grid_constant__ CopyBatch b) {
    for (u32 k = 0; k < b.n && k < BATCH_ITEMS; ++k) {
        const BatchItem it = b.items[k];
        const unsigned char* s = it.src ? (const unsigned char*)it.src : b.data + it.at;
        block_copy((unsigned char*)it.dst, s, it.len);
        __syncthreads();
    }
}
