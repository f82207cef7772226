// `mul_mat_vec_qb` with an element-wise op in its store (`mul_mat_vec_out_e.wgsl`): a decode
// product and the residual add or SwiGLU that consumes it as one dispatch.

const MT: u32 = 1u;
const SG_WORKGROUP: u32 = 256u;

// #include mul_mat_vec_qb_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out_e.wgsl
