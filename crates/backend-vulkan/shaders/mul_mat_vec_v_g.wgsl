// `mul_mat_vec_v` over two weights at once, the gate and up projections that SwiGLU consumes:
// `silu(x @ gate.T) * (x @ up.T)` for one row of x, as one dispatch (see `mul_mat_vec_qw_g.wgsl`
// for why).
//
// Invariants (checked by the host): the two weights have one dtype and row stride; x's offset
// and both weights' offsets and row stride a multiple of 8 elements; k a multiple of 8.

// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x.wgsl
// #include mul_mat_vec_v_glu.wgsl
