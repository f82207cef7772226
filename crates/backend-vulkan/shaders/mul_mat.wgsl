// MulMat, tiled (`mul_mat_body.wgsl`) over float operands: any strided views; B's tiles are
// loaded along whichever axis is contiguous in memory (`prm.y`) so the loads coalesce for
// `x @ w` and `x @ w.T` alike.

// #include mul_mat_body.wgsl

// Where element `flat` (0 .. 1024) of B's 16x64 tile sits: (column, k) in the tile.
fn b_tile_ck(flat: u32) -> vec2<u32> {
    if pc.prm.y == 1u {
        return vec2<u32>(flat / 16u, flat % 16u);
    }
    return vec2<u32>(flat % 64u, flat / 64u);
}

// Element `flat` of B's tile: b's value, 0 past N or K (as `a_tile_val`).
fn b_tile_val(flat: u32, k0: u32, col0: u32, b_base: u32) -> f32 {
    let ck = b_tile_ck(flat);
    let gc = col0 + ck.x;
    let gkb = k0 + ck.y;
    let ok = gc < pc.shape.y && gkb < pc.shape.z;
    let v = ld_b(select(0u, b_base + gkb * pc.b_str.z + gc * pc.b_str.w, ok));
    return select(0.0, v, ok);
}

fn b_tile_put(flat: u32, v: f32) {
    let ck = b_tile_ck(flat);
    Bs[ck.y * 64u + ck.x] = v;
}

// This invocation's four elements of B's tile at k0: Bs[kb * 64 + c] = b[k0 + kb, col0 + c]
// (0 past N or K), all four loaded before any is used.
alias BTile = vec4<f32>;

fn fetch_b_tile(li: u32, k0: u32, col0: u32, b_base: u32) -> BTile {
    return vec4<f32>(
        b_tile_val(li, k0, col0, b_base),
        b_tile_val(li + 256u, k0, col0, b_base),
        b_tile_val(li + 512u, k0, col0, b_base),
        b_tile_val(li + 768u, k0, col0, b_base),
    );
}

fn put_b_tile(li: u32, t: BTile) {
    b_tile_put(li, t.x);
    b_tile_put(li + 256u, t.y);
    b_tile_put(li + 512u, t.z);
    b_tile_put(li + 768u, t.w);
}
