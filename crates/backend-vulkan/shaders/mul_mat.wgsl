// MulMat, tiled (`mul_mat_body.wgsl`) over float operands, 4x4 outputs per invocation over 256
// invocations (`mul_mat_tiles_f.wgsl`).

const TILE_T: u32 = 4u;

// #include mul_mat_tiles_f.wgsl
