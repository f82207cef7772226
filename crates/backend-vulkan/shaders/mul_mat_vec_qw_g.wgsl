// `mul_mat_vec_qw` over two weights at once, the gate and up projections that SwiGLU
// consumes: `silu(x @ gate.T) * (x @ up.T)` for one row of x, as one dispatch.
//
// Why: unfused, the gate product, the up product and SwiGLU are three dispatches (two when the
// up product runs SwiGLU in its store, `mul_mat_vec_qw_e`), each waiting for the one before it;
// here each load of x serves a gate row and its up row, and the step has one product fewer to
// wait for.
//
// Invariants (checked by the host): the two weights have one block type and row stride; one
// row of x, contiguous along k, its offset a multiple of 4 elements; both weights start on an
// even byte.

// #include mul_mat_vec_qw_body.wgsl
// #include mul_mat_vec_qw_glu.wgsl
