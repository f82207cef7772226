// Decode mat-vec (`x @ w.T`, one row) over float weights, shared-memory reduction.

// #include mul_mat_vec_k_body.wgsl
// #include mul_mat_vec_wg_main.wgsl
// #include mul_mat_vec_out.wgsl
