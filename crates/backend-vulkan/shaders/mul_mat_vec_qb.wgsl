// Decode mat-vec (`x @ w.T`, one row of x) over GGUF blocks, 32 consecutive elements per lane
// (`mul_mat_vec_qb_body.wgsl`); `LOWSYNC_VK_QV=block` takes it where `mul_mat_vec_qv` would run.
//
// Why: the A/B against `mul_mat_vec_qv` (16-element groups per lane) on the device that
// decides the default.
//
// Strategy: as `mul_mat_vec_qv`: a 256-invocation workgroup of 8 rows, each subgroup taking
// rows in turn (`mul_mat_vec_sg_main.wgsl`) and reducing with `subgroupAdd`.
//
// Invariants (checked by the host): one row of x, contiguous along k, its offset a multiple
// of 4 elements; w starting on an even byte (a super-block type's on a multiple of 4).

const MT: u32 = 1u;
const SG_WORKGROUP: u32 = 256u;

// #include mul_mat_vec_qb_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out.wgsl
