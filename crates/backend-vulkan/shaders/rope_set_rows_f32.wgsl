// `rope_set_rows` with the angle in f32, for devices without shaderFloat64.

// #include rope_angle_f32.wgsl
// #include rope_main.wgsl
// #include rope_dst_rows.wgsl
