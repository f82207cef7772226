// `mul_mat_vec_v_r` (the product into a KV-cache row) reading x through the RmsNorm that feeds
// it (`mul_mat_vec_x_norm.wgsl`).

// #include mul_mat_vec_out_r.wgsl
// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x_norm.wgsl
// #include mul_mat_vec_v_rows.wgsl
