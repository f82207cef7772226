// Rotary embedding of x [T, H, D] at positions pos [T], the angle in f64 (`rope_f32.wgsl` is
// the same kernel for devices without shaderFloat64).

// #include rope_angle.wgsl
// #include rope_main.wgsl
// #include rope_dst.wgsl
