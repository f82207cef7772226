// B's side of the tiled float MulMat (`mul_mat.wgsl`, `mul_mat8.wgsl`): any strided views;
// B's tiles are loaded along whichever axis is contiguous in memory (`prm.y`) so the loads
// coalesce for `x @ w` and `x @ w.T` alike.

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
    Bs[ck.y * 16u + ck.x / 4u][ck.x % 4u] = v;
}

// This invocation's 4 * TILE_Q elements of B's tile at k0: element (kb, c) = b[k0 + kb, col0 +
// c] (0 past N or K), all loaded before any is used, four written out together (element
// 4j + i of the tile's `flat` li + (4j + i) * TILE_WG, as A's).
alias BTile = array<vec4<f32>, TILE_Q>;

fn fetch_b_tile(li: u32, k0: u32, col0: u32, b_base: u32) -> BTile {
    var t: BTile;
    for (var j = 0u; j < TILE_Q; j++) {
        let f = li + 4u * j * TILE_WG;
        t[j] = vec4<f32>(
            b_tile_val(f, k0, col0, b_base),
            b_tile_val(f + TILE_WG, k0, col0, b_base),
            b_tile_val(f + 2u * TILE_WG, k0, col0, b_base),
            b_tile_val(f + 3u * TILE_WG, k0, col0, b_base),
        );
    }
    return t;
}

fn put_b_tile(li: u32, t: BTile) {
    for (var j = 0u; j < TILE_Q; j++) {
        let f = li + 4u * j * TILE_WG;
        b_tile_put(f, t[j].x);
        b_tile_put(f + TILE_WG, t[j].y);
        b_tile_put(f + 2u * TILE_WG, t[j].z);
        b_tile_put(f + 3u * TILE_WG, t[j].w);
    }
}
