// Mat-vec (`x @ w.T`) over GGUF block weights dequantized in registers, shared-memory
// reduction (devices without subgroup arithmetic).

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_wg_main.wgsl
