// MulMat, tiled (`mul_mat_body.wgsl`), over a block-dtype w (`mul_mat_tiles_q.wgsl`), 4x4
// outputs per invocation over 256 invocations.

const TILE_T: u32 = 4u;

// #include mul_mat_tiles_q.wgsl
