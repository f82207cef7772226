// Rotary embedding of x [T, H, D] at positions pos [T]. One thread per (t, h, pair); dims at or
// beyond n_dims are copied by the same threads. Angles, cos and sin are computed in f64 and
// rounded to f32, like the CPU oracle; the rotation itself is f32.

extern "C" __global__ void rope(i64 T, i64 H, i64 D, void* dst, int dtd, i64 d_st0, i64 d_st1,
                                i64 d_st2, const void* x, int dtx, i64 x_st0, i64 x_st1,
                                i64 x_st2, const int* pos, i64 pos_st, i64 n_dims,
                                double theta_base, int neox) {
    pdl_entry();
    i64 half = n_dims / 2;
    i64 rest = D - n_dims;
    i64 per_row = half + rest;
    i64 n = T * H * per_row;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 k = i % per_row;
        i64 th = i / per_row;
        i64 h = th % H, t = th / H;
        i64 xb = t * x_st0 + h * x_st1, db = t * d_st0 + h * d_st1;
        if (k >= half) {
            i64 c = n_dims + (k - half);
            st(dst, dtd, db + c * d_st2, ld(x, dtx, xb + c * x_st2));
            continue;
        }
        double freq = pow(theta_base, -2.0 * (double)k / (double)n_dims);
        double ang = (double)pos[t * pos_st] * freq;
        double sd, cd;
        sincos(ang, &sd, &cd);
        float s = (float)sd, c = (float)cd;
        i64 ia = neox ? k : 2 * k;
        i64 ib = neox ? k + half : 2 * k + 1;
        float a = ld(x, dtx, xb + ia * x_st2), b = ld(x, dtx, xb + ib * x_st2);
        st(dst, dtd, db + ia * d_st2, a * c - b * s);
        st(dst, dtd, db + ib * d_st2, a * s + b * c);
    }
}
