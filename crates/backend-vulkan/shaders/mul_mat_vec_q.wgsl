// Decode mat-vec (`x @ w.T`, one row of x per workgroup z) over GGUF block weights dequantized
// in registers, subgroup reduction.

const MT: u32 = 1u;
const X_CONTIGUOUS: bool = false;
const SG_WORKGROUP: u32 = 64u;

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out.wgsl
