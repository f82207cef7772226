// The body of the prefill product over GGUF block weights (`mul_mat_q.wgsl`, and
// `mul_mat_q_s.wgsl`, which shares x through the subgroup): dst[.., m, n] = sum_k x[.., m, k] *
// w[.., n, k] with f32 x (any strides) and w stored as raw GGUF blocks (binding `b`, whole
// blocks along k).
//
// Why: the multi-row mat-vec (`mul_mat_vec_qm`) reads and dequantizes every weight group once
// per 8 rows of x, so a prefill of m rows decodes the whole weight m / 8 times. Here each
// weight group is decoded once per `RB` (32) rows of x.
//
// Strategy: one invocation per row of w and workgroup y per run of `RB` rows of x (64 rows of
// w per workgroup, batches in z). The invocation walks k in groups of 16: it decodes its row's
// group through the type's own `q_scale` / `q_vals` (the layout is written once, in its family
// file) into four vec4 registers, then adds the group's dot product with each of its `RB` x
// rows to that row's accumulator (`mul_mat_rows.wgsl`'s walk; `add_group`, which the including
// kernel defines: how x reaches the invocations is what the two kernels differ in). No workgroup memory and no
// barrier: lavapipe compiles a kernel with a large workgroup array and a barrier slowly
// (seconds to minutes per variant on a cold shader cache), these in under a second.
//
// Invariants: k is a whole number of blocks (so of 16) and every row of w starts on a block;
// an element's sum runs over k in one order (groups in order, 4 x 4 products within a group)
// whatever the workgroup it falls in, so a result does not depend on where the tile edges
// fall. Rows of w past N read row N - 1 and store nothing. A weight element is `scale * q (+
// offset)` as the family's contract states it. Offsets and strides of d and x count elements,
// every offset and stride of w counts bytes (the host converts whole rows of blocks), as in the
// mat-vecs.

// Four consecutive values along k of x from element `i` (the branch is uniform).
fn x4(i: u32) -> vec4<f32> {
    if pc.prm.x == 1u {
        return ld4_a(i);
    }
    let s = pc.a_str.w;
    return vec4<f32>(ld_a(i), ld_a(i + s), ld_a(i + 2u * s), ld_a(i + 3u * s));
}

// #include mul_mat_rows.wgsl

// Group k0 / 16 of the row whose blocks start at byte `w_row`, decoded (`left` is 16: k is a
// whole number of blocks).
fn load_group(w_row: u32, k0: u32, left: u32) {
    let gi = k0 / 16u;
    let blk = w_row + (gi / GPB) * QB;
    let sc = q_scale(blk, gi % GPB);
    let v = q_vals(blk, gi % GPB);
    let off = select(0.0, sc.y, Q_MIN);
    wq[0] = sc.x * v[0] + off;
    wq[1] = sc.x * v[1] + off;
    wq[2] = sc.x * v[2] + off;
    wq[3] = sc.x * v[3] + off;
}
