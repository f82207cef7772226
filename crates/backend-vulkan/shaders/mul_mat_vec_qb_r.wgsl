// `mul_mat_vec_qb` storing into a KV-cache row (`mul_mat_vec_out_r.wgsl`): a decode product
// and the `SetRows` that copies it into the cache as one dispatch.

const MT: u32 = 1u;
const SG_WORKGROUP: u32 = 256u;

// #include mul_mat_vec_qb_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out_r.wgsl
