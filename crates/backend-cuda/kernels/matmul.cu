// Mixture of experts: out[t, n] = sum_j w[t, j] * (x[t] @ experts[ids[t, j]])[n]. One thread
// per output element; slots in order, k in order. Dense matmul goes through cuBLAS instead.

extern "C" __global__ void mul_mat_id(i64 T, i64 N, i64 K, i64 slots, i64 n_exp, void* dst,
                                      int dtd, i64 d_rs, i64 d_cs, const void* ex, int dte,
                                      i64 e_s0, i64 e_s1, i64 e_s2, const void* x, int dtx,
                                      i64 x_rs, i64 x_cs, const int* ids, i64 i_rs, i64 i_cs,
                                      const void* w, int dtw, i64 w_rs, i64 w_cs, u32* err,
                                      u32 tag) {
    i64 n_out = T * N;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n_out;
         i += (i64)gridDim.x * blockDim.x) {
        i64 t = i / N, n = i % N;
        float acc = 0.0f;
        for (i64 j = 0; j < slots; ++j) {
            int e = ids[t * i_rs + j * i_cs];
            if (e < 0 || (i64)e >= n_exp) {
                report(err, tag);
                continue;
            }
            float y = 0.0f;
            for (i64 k = 0; k < K; ++k) {
                y += ld(x, dtx, t * x_rs + k * x_cs) * ld(ex, dte, (i64)e * e_s0 + k * e_s1 + n * e_s2);
            }
            acc += ld(w, dtw, t * w_rs + j * w_cs) * y;
        }
        st(dst, dtd, t * d_rs + n * d_cs, acc);
    }
}
