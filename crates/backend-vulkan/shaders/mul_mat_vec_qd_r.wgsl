// `mul_mat_vec_qd` storing into a KV-cache row (`mul_mat_vec_out_r.wgsl`): a decode product
// and the `SetRows` that copies it into the cache as one dispatch.

// #include mul_mat_vec_qd_body.wgsl
// #include mul_mat_vec_qd_main.wgsl
// #include mul_mat_vec_out_r.wgsl
