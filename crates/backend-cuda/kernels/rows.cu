// Row gathers and scatters. Indices are checked on the device: a bad one is reported through
// the error word (the host names the node after its next wait) and its row is skipped.

// dst[r, :] = table[ids[r], :]. `L` iterates the ids' shape: st[0] = dst row strides (its
// leading axes), st[1] = ids strides. One thread per element.
extern "C" __global__ void get_rows(i64 rows, i64 d, Lay L, void* dst, int dtd, i64 dst_cs,
                                    const void* table, int dtt, i64 t_rs, i64 t_cs, i64 n_table,
                                    const int* ids, u32* err, u32 tag) {
    pdl_entry();
    i64 n = rows * d;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / d, c = i % d;
        i64 o[3];
        lay_offsets(L, r, 2, o);
        int id = ids[o[1]];
        if (id < 0 || (i64)id >= n_table) {
            report(err, tag);
            continue;
        }
        st(dst, dtd, o[0] + c * dst_cs, ld(table, dtt, (i64)id * t_rs + c * t_cs));
    }
}

// dst[idx[j], :] = src[j, :]. One block per source row; with duplicate indices the last row
// wins (sequential numpy assignment): a row skips itself if a later one has the same index.
extern "C" __global__ void set_rows(i64 m, i64 d, void* dst, int dtd, i64 d_rs, i64 d_cs,
                                    i64 n_dst, const void* src, int dts, i64 s_rs, i64 s_cs,
                                    const int* idx, i64 idx_st, u32* err, u32 tag) {
    pdl_entry();
    for (i64 j = blockIdx.x; j < m; j += gridDim.x) {
        int row = idx[j * idx_st];
        int later = 0;
        for (i64 k = j + 1 + threadIdx.x; k < m; k += blockDim.x) {
            if (idx[k * idx_st] == row) later = 1;
        }
        if (__syncthreads_or(later)) continue;
        if (row < 0 || (i64)row >= n_dst) {
            if (threadIdx.x == 0) report(err, tag);
            continue;
        }
        for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
            st(dst, dtd, (i64)row * d_rs + c * d_cs, ld(src, dts, j * s_rs + c * s_cs));
        }
    }
}
