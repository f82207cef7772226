// `mul_mat_vec_v` reading x through the RmsNorm that feeds it (`mul_mat_vec_x_norm.wgsl`).

// #include mul_mat_vec_out.wgsl
// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x_norm.wgsl
// #include mul_mat_vec_v_rows.wgsl
