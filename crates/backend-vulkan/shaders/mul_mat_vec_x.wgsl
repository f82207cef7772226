// x as bound: how the float decode mat-vec body (`mul_mat_vec_v_body.wgsl`) reads the
// activations of a product that reads them as they are.

fn x8_a(i: u32) -> mat2x4<f32> {
    return ld8_a(i);
}

// A subgroup's two row sums.
fn x_sum2(p: vec2<f32>) -> vec2<f32> {
    return subgroupAdd(p);
}
