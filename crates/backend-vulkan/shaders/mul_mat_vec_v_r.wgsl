// `mul_mat_vec_v` storing into a KV-cache row (`mul_mat_vec_out_r.wgsl`): a decode product
// and the `SetRows` that copies it into the cache as one dispatch.

// #include mul_mat_vec_out_r.wgsl
// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x.wgsl
// #include mul_mat_vec_v_rows.wgsl
