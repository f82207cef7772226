// Decode mat-vec (`x @ w.T`, one row) over float weights, subgroup reduction.

const SG_WORKGROUP: u32 = 64u;

// #include mul_mat_vec_k_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out.wgsl
