// Decode mat-vec (`x @ w.T`, one row) over float weights with 16-byte loads and a subgroup
// reduction: the decode projections of a GPU with wide subgroups.
//
// Why: a decode step's device time is its mat-vecs, and a mat-vec is a stream of weight bytes;
// only bytes in flight make bandwidth. `mul_mat_vec_k` loads w 4 elements (8 bytes of f16) per
// lane and step, and each 32-lane subgroup of its 64-lane workgroup walks its 4 rows one after
// another, so a lane has a single 8-byte load of w outstanding at a time.
//
// Strategy: x and w are bound as arrays of 16-byte vectors (`ld8_*`: 8 elements, one load for
// 16-bit weights). Each subgroup computes a pair of w's rows at once (rows 2 sg, 2 sg + 1, then
// 2 (sg + nsg), ... of the workgroup's ROWS), its lanes taking 8 consecutive elements per step
// and two steps per iteration, so a lane has four independent 16-byte loads of w outstanding;
// `subgroupAdd` sums the lanes, with no shared memory and no barrier. 128 invocations: four
// 32-lane subgroups cover the workgroup's 8 rows in one pass; any subgroup size works (a
// subgroup with no pair left idles). An odd last row reads its pair's first row twice and
// stores once.
//
// Invariants (checked by the host): one row of x; k a multiple of 8; x's offset and every row
// of w start on a multiple of 8 elements, and so on 16 bytes of their bindings.

// #include mul_mat_vec_out.wgsl
// #include mul_mat_vec_v_body.wgsl
// #include mul_mat_vec_x.wgsl
// #include mul_mat_vec_v_rows.wgsl
