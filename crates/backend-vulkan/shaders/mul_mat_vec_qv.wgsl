// Decode mat-vec (`x @ w.T`, one row of x) over GGUF block weights dequantized in registers,
// with x read 16 bytes at a time, subgroup reduction.
//
// Why: per 16-element group of w, `mul_mat_vec_q` reads x with 16 scalar loads (its x binding
// is an array of f32), more load instructions than the group's weight words take; and on a
// 32-lane GPU its 64-invocation workgroup is two subgroups walking four rows each, too few
// subgroups per multiprocessor to keep the weight loads in flight.
//
// Strategy: x is bound as an array of 16-byte vectors (`ld4_a` is one load), and the
// workgroup has 256 invocations, so eight 32-lane subgroups take one of its 8 rows each (any
// subgroup size works: `mul_mat_vec_sg_main.wgsl` deals rows to subgroups in turn).
//
// Invariants (checked by the host): one row of x, contiguous along k, its offset a multiple
// of 4 elements (16 bytes of its binding).

const MT: u32 = 1u;
const X_CONTIGUOUS: bool = true;
const SG_WORKGROUP: u32 = 256u;

// #include mul_mat_vec_q_body.wgsl
// #include mul_mat_vec_sg_main.wgsl
// #include mul_mat_vec_out.wgsl
