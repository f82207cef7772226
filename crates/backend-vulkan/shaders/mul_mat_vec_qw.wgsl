// Decode mat-vec (`x @ w.T`, one row of x) over a 32-element block type, two rows of w per
// 128-invocation workgroup, each row spread over all of it (`mul_mat_vec_qw_body.wgsl`);
// `LOWSYNC_VK_QV=rows` takes it where `mul_mat_vec_qv` would run.
//
// Invariants (checked by the host): one row of x, contiguous along k, its offset a multiple
// of 4 elements; w starting on an even byte.

// #include mul_mat_vec_qw_body.wgsl
// #include mul_mat_vec_qw_rows.wgsl
// #include mul_mat_vec_out.wgsl
