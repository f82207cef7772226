// MulMat, tiled (`mul_mat_body.wgsl`), over a block-dtype w (`mul_mat_tiles_q.wgsl`), 8x8
// outputs per invocation over 64 invocations (`LOWSYNC_VK_TILE=8`): the same bits as
// `mul_mat_qt.wgsl`.

const TILE_T: u32 = 8u;

// #include mul_mat_tiles_q.wgsl
