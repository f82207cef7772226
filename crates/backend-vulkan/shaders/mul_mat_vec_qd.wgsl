// Decode mat-vec (`x @ w.T`, one row of x) over Q4_0, Q4_1 or Q8_0 blocks as integer dot
// products (`mul_mat_vec_qd_body.wgsl`); `LOWSYNC_VK_QV=idot` takes it where `mul_mat_vec_qw`
// would run.

// #include mul_mat_vec_qd_body.wgsl
// #include mul_mat_vec_qd_main.wgsl
// #include mul_mat_vec_out.wgsl
