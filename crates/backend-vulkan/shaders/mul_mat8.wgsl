// MulMat, tiled (`mul_mat_body.wgsl`) over float operands, 8x8 outputs per invocation over 64
// invocations (`mul_mat_tiles_f.wgsl`; `LOWSYNC_VK_TILE=8`): the same bits as `mul_mat.wgsl`.

const TILE_T: u32 = 8u;

// #include mul_mat_tiles_f.wgsl
