// The body of `mul_mat_vec_v` and its flavours (see `mul_mat_vec_v.wgsl`). Which pair of rows a
// subgroup takes and what it stores is the flavour's (`v_rows`, `ld8_w1`, `v_store`): rows r and
// r + 1 of w, each stored through `out_d` (`mul_mat_vec_v_rows.wgsl`), or row r of the gate
// weight and of the up weight, stored as SwiGLU (`mul_mat_vec_v_glu.wgsl`). How x is read and
// the lanes' sums added is the activation's (`x8_a`, `x_sum2`): as bound
// (`mul_mat_vec_x.wgsl`), or through the RmsNorm that feeds the product
// (`mul_mat_vec_x_norm.wgsl`).

// #include mul_mat_vec_head.wgsl

// x . w[row0] and x . w[row1], this lane's part: elements lane * 8 .. + 8, then every
// lanes * 8 further.
fn pair_partial(a_base: u32, w0: u32, w1: u32, lane: u32, lanes: u32) -> vec2<f32> {
    let k_len = pc.shape.z;
    let step = lanes * 8u;
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var t0 = vec4<f32>(0.0);
    var t1 = vec4<f32>(0.0);
    var k = lane * 8u;
    // Four steps a round while they last (eight 16-byte loads of w in flight), then two, then
    // one: steps 0, 2, ... go to s, steps 1, 3, ... to t, in order, whichever loop takes them.
    for (; k + 3u * step < k_len; k += 4u * step) {
        let x0 = x8_a(a_base + k);
        let x1 = x8_a(a_base + k + step);
        let x2 = x8_a(a_base + k + 2u * step);
        let x3 = x8_a(a_base + k + 3u * step);
        let u0 = ld8_b(w0 + k);
        let u1 = ld8_b(w0 + k + step);
        let u2 = ld8_b(w0 + k + 2u * step);
        let u3 = ld8_b(w0 + k + 3u * step);
        let v0 = ld8_w1(w1 + k);
        let v1 = ld8_w1(w1 + k + step);
        let v2 = ld8_w1(w1 + k + 2u * step);
        let v3 = ld8_w1(w1 + k + 3u * step);
        s0 = fma(x0[0], u0[0], fma(x0[1], u0[1], s0));
        s1 = fma(x0[0], v0[0], fma(x0[1], v0[1], s1));
        t0 = fma(x1[0], u1[0], fma(x1[1], u1[1], t0));
        t1 = fma(x1[0], v1[0], fma(x1[1], v1[1], t1));
        s0 = fma(x2[0], u2[0], fma(x2[1], u2[1], s0));
        s1 = fma(x2[0], v2[0], fma(x2[1], v2[1], s1));
        t0 = fma(x3[0], u3[0], fma(x3[1], u3[1], t0));
        t1 = fma(x3[0], v3[0], fma(x3[1], v3[1], t1));
    }
    for (; k + step < k_len; k += 2u * step) {
        let x0 = x8_a(a_base + k);
        let x1 = x8_a(a_base + k + step);
        let u0 = ld8_b(w0 + k);
        let u1 = ld8_b(w0 + k + step);
        let v0 = ld8_w1(w1 + k);
        let v1 = ld8_w1(w1 + k + step);
        s0 = fma(x0[0], u0[0], fma(x0[1], u0[1], s0));
        s1 = fma(x0[0], v0[0], fma(x0[1], v0[1], s1));
        t0 = fma(x1[0], u1[0], fma(x1[1], u1[1], t0));
        t1 = fma(x1[0], v1[0], fma(x1[1], v1[1], t1));
    }
    if k < k_len {
        let x0 = x8_a(a_base + k);
        let u0 = ld8_b(w0 + k);
        let v0 = ld8_w1(w1 + k);
        s0 = fma(x0[0], u0[0], fma(x0[1], u0[1], s0));
        s1 = fma(x0[0], v0[0], fma(x0[1], v0[1], s1));
    }
    let a = s0 + t0;
    let b = s1 + t1;
    return vec2<f32>((a.x + a.y) + (a.z + a.w), (b.x + b.y) + (b.z + b.w));
}

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) lanes: u32,
) {
    let n = pc.shape.y;
    let base = batch_bases(wg.y);
    for (var rw = 2u * sg; rw < ROWS; rw += 2u * nsg) {
        let rows = v_rows(wg.x, rw, n, base.z);
        var p = vec2<f32>(0.0);
        // Uniform in the subgroup, so every lane reaches the add below.
        if rows.w > 0u {
            p = pair_partial(base.y, rows.y, rows.z, lane, lanes);
        }
        let s = x_sum2(p);
        if lane == 0u {
            v_store(base.x, rows, s);
        }
    }
}
