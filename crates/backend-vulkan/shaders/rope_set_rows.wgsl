// Rotary embedding of one token's K [1, H, D] written straight into its KV-cache row
// (`Rope -> SetRows` fused, `crate::fusion`): the rotated row is never stored on its own and the
// copy is no dispatch of its own. The angle in f64 (`rope_set_rows_f32.wgsl` for devices
// without shaderFloat64); the values are rope's, rounded once to the cache's dtype as
// `set_rows` rounds them.

// #include rope_angle.wgsl
// #include rope_main.wgsl
// #include rope_dst_rows.wgsl
