// Rotary embedding of x [T, H, D] at positions pos [T], the angle in f32: the kernel for
// devices without shaderFloat64.

// #include rope_angle_f32.wgsl
// #include rope_main.wgsl
// #include rope_dst.wgsl
