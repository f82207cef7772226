// Mat-vec (`x @ w.T`) over GGUF block weights dequantized in registers, subgroup reduction.

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
