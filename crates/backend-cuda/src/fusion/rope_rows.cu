// Fused Rope -> SetRows (+ the plain SetRows of the V row): decode's KV-cache write.
// The host side (patterns, preconditions, launch): src/fusion/rope_rows.rs.
// Like every fused kernel it writes each tensor its nodes would have written (unless the host
// proved a result dead), in the nodes' order within the thread that owns an element, so later
// readers see what the unfused chain would have left; arithmetic is f32 in fixed summation
// orders that depend only on the shapes (no float atomics), so results are deterministic run to
// run. One NVRTC module, compiled with kernels/common.cuh in front of it.

// ---------------------------------------------------------------------------------------------
// Rope followed by the SetRows of its result into a cache, and optionally a second, plain
// SetRows (decode's V row). Rotary embedding of x [T, H, D] at positions pos [T] into r (the
// Rope's result, contiguous on the host's word), as the rope kernel: one work item per
// (t, h, pair) or copied dim past n_dims, angles in f64. Each element written to r is read
// back (rounded to r's dtype, as SetRows would read it) and stored into row idx[t] of cache c,
// column h * D + d. Work items past the rope's are the plain copy c2[idx2[j], :] = s2[j, :].
// SetRows' rules hold for both: a row whose index a later row repeats is skipped (the last
// write wins), a bad index is reported with the node's tag and its row skipped.

extern "C" __global__ void rope_rows(
    i64 T, i64 H, i64 D, void* r, int dtr, i64 r_st0, i64 r_st1, i64 r_st2, const void* x,
    int dtx, i64 x_st0, i64 x_st1, i64 x_st2, const int* pos, i64 pos_st, i64 n_dims,
    double theta_base, int neox, void* c, int dtc, i64 c_rs, i64 c_cs, i64 c_n, const int* idx,
    i64 idx_st, u32 tag, i64 m2, i64 d2, void* c2, int dtc2, i64 c2_rs, i64 c2_cs, i64 c2_n,
    const void* s2, int dts2, i64 s2_rs, i64 s2_cs, const int* idx2, i64 idx2_st, u32 tag2,
    u32* err) {
    pdl_entry();
    const i64 half = n_dims / 2;
    const i64 per_row = half + (D - n_dims);
    const i64 n1 = T * H * per_row;
    const i64 n = n1 + m2 * d2;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        if (i >= n1) {
            const i64 jj = (i - n1) / d2, cc = (i - n1) % d2;
            const int row = idx2[jj * idx2_st];
            bool later = false;
            for (i64 q = jj + 1; q < m2; ++q) later |= idx2[q * idx2_st] == row;
            if (later) continue;
            if (row < 0 || (i64)row >= c2_n) {
                report(err, tag2);
                continue;
            }
            st(c2, dtc2, (i64)row * c2_rs + cc * c2_cs, ld(s2, dts2, jj * s2_rs + cc * s2_cs));
            continue;
        }
        const i64 k = i % per_row;
        const i64 th = i / per_row;
        const i64 h = th % H, t = th / H;
        const i64 xb = t * x_st0 + h * x_st1, rb = t * r_st0 + h * r_st1;
        // The dims this item writes and their values.
        i64 ca, cb = -1;
        float va, vb = 0.0f;
        if (k >= half) {
            ca = n_dims + (k - half);
            va = ld(x, dtx, xb + ca * x_st2);
        } else {
            double freq = pow(theta_base, -2.0 * (double)k / (double)n_dims);
            double ang = (double)pos[t * pos_st] * freq;
            double sd, cd;
            sincos(ang, &sd, &cd);
            float sn = (float)sd, cs = (float)cd;
            ca = neox ? k : 2 * k;
            cb = neox ? k + half : 2 * k + 1;
            float a = ld(x, dtx, xb + ca * x_st2), b = ld(x, dtx, xb + cb * x_st2);
            va = a * cs - b * sn;
            vb = a * sn + b * cs;
        }
        st(r, dtr, rb + ca * r_st2, va);
        if (cb >= 0) st(r, dtr, rb + cb * r_st2, vb);
        const int row = idx[t * idx_st];
        bool later = false;
        for (i64 q = t + 1; q < T; ++q) later |= idx[q * idx_st] == row;
        if (later) continue;
        if (row < 0 || (i64)row >= c_n) {
            report(err, tag);
            continue;
        }
        const i64 cr = (i64)row * c_rs + h * D * c_cs;
        st(c, dtc, cr + ca * c_cs, ld(r, dtr, rb + ca * r_st2));
        if (cb >= 0) st(c, dtc, cr + cb * c_cs, ld(r, dtr, rb + cb * r_st2));
    }
}
