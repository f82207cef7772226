// Mat-vec over GGUF block weights for several rows of x (small batches, prefill): up to 8 rows
// of x per workgroup z share each dequantized group of w, so w is read and dequantized once
// per 8 rows instead of once per row. Subgroup reduction.

const MT: u32 = 8u;
const X_CONTIGUOUS: bool = true;
const SG_WORKGROUP: u32 = 64u;

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out.wgsl
