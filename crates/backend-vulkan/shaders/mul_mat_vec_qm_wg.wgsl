// `mul_mat_vec_qm` (up to 8 rows of x per workgroup z sharing each dequantized group of w)
// with the shared-memory reduction (devices without subgroup arithmetic).

const MT: u32 = 8u;
const X_CONTIGUOUS: bool = true;

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_wg_main.wgsl
// #include mul_mat_vec_out.wgsl
