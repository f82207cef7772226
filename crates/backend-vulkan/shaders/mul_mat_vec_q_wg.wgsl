// Decode mat-vec (`x @ w.T`, one row of x per workgroup z) over GGUF block weights dequantized
// in registers, shared-memory reduction (devices without subgroup arithmetic).

const MT: u32 = 1u;
const X_CONTIGUOUS: bool = false;

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_wg_main.wgsl
// #include mul_mat_vec_out.wgsl
