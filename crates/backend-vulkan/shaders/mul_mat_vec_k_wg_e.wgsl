// `mul_mat_vec_k_wg` with an element-wise op in its store (`mul_mat_vec_out_e.wgsl`): a decode
// product and the residual add or SwiGLU that consumes it as one dispatch.

// #include mul_mat_vec_k_body.wgsl
// #include mul_mat_vec_wg_main.wgsl
// #include mul_mat_vec_out_e.wgsl
