// `mul_mat_vec_qd` with an element-wise op in its store (`mul_mat_vec_out_e.wgsl`): a decode
// product and the residual add or SwiGLU that consumes it as one dispatch.

// #include mul_mat_vec_qd_body.wgsl
// #include mul_mat_vec_qd_main.wgsl
// #include mul_mat_vec_out_e.wgsl
