// The rotary embedding's destination: d [T, H, D] by its strides.

fn row_base(t: u32, h: u32, gi: u32) -> vec2<u32> {
    return vec2<u32>(pc.offs.x + t * pc.d_str.x + h * pc.d_str.y, 1u);
}
