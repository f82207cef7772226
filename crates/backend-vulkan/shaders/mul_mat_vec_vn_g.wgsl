// `mul_mat_vec_v_g` (the gate and up products with SwiGLU) reading x through the RmsNorm that
// feeds them (`mul_mat_vec_x_norm.wgsl`).

// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x_norm.wgsl
// #include mul_mat_vec_v_glu.wgsl
