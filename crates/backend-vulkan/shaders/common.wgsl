// Shared helpers, prepended to every kernel after its binding declarations.
//
// f32 -> 16-bit conversions are done on bits, round-to-nearest-even, exactly as the `half` crate
// the CPU oracle uses, so f16/bf16 results are bit-identical to the CPU where the f32 value is.
// f16 -> f32 needs no rounding (every f16 is an f32): it is one conversion instruction
// (`unpack2x16float`, GLSL.std.450 UnpackHalf2x16). A conversion written on bits took a dozen
// instructions and two branches per value, and the branches cut a kernel's rounds of loads into
// separate basic blocks, one wait each (on the H200 the decode attention over an f16 KV cache
// and every block type's scales paid for it). Block readers convert their scales through
// `q_f16`, which build.rs binds to this or to the form on bits (`quant_common.wgsl`).

// The f16 in the low 16 bits of `h` as f32.
fn f16_bits_to_f32(h: u32) -> f32 {
    return unpack2x16float(h).x;
}

fn f32_to_f16_bits(value: f32) -> u32 {
    let x = bitcast<u32>(value);
    let sign = (x & 0x80000000u) >> 16u;
    let exp = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if exp == 0x7f800000u {
        let nan_bit = select(0u, 0x0200u, man != 0u);
        return sign | 0x7c00u | nan_bit | (man >> 13u);
    }
    let half_exp = i32(exp >> 23u) - 127 + 15;
    if half_exp >= 31 {
        return sign | 0x7c00u;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return sign;
        }
        let man2 = man | 0x00800000u;
        var half_man = man2 >> u32(14 - half_exp);
        let round_bit = 1u << u32(13 - half_exp);
        if (man2 & round_bit) != 0u && (man2 & (3u * round_bit - 1u)) != 0u {
            half_man += 1u;
        }
        return sign | half_man;
    }
    let bits = sign | (u32(half_exp) << 10u) | (man >> 13u);
    let round_bit = 0x00001000u;
    if (man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u {
        return bits + 1u;
    }
    return bits;
}

fn f32_to_bf16_bits(value: f32) -> u32 {
    let x = bitcast<u32>(value);
    if (x & 0x7fffffffu) > 0x7f800000u {
        return (x >> 16u) | 0x0040u;
    }
    let round_bit = 0x00008000u;
    if (x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u {
        return (x >> 16u) + 1u;
    }
    return x >> 16u;
}

fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// Coordinates of row-major index `i` in a 4-D shape (every extent >= 1).
fn coord4(i: u32, shape: vec4<u32>) -> vec4<u32> {
    let c3 = i % shape.w;
    let r = i / shape.w;
    let c2 = r % shape.z;
    let r2 = r / shape.z;
    return vec4<u32>(r2 / shape.y, r2 % shape.y, c2, c3);
}

// Coordinates of row-major index `i` in a 3-D shape (`shape.xyz`, every extent >= 1).
fn coord3(i: u32, shape: vec4<u32>) -> vec3<u32> {
    let c2 = i % shape.z;
    let r = i / shape.z;
    return vec3<u32>(r / shape.y, r % shape.y, c2);
}

fn dot4(c: vec4<u32>, s: vec4<u32>) -> u32 {
    return c.x * s.x + c.y * s.y + c.z * s.z + c.w * s.w;
}

fn dot3(c: vec3<u32>, s: vec4<u32>) -> u32 {
    return c.x * s.x + c.y * s.y + c.z * s.z;
}

// The linear id of this workgroup in a dispatch spread over x and y (x <= 65535).
fn group_id(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.y * nwg.x + wg.x;
}

// SiLU as the element-wise kernel, the fused products and the CPU oracle compute it:
// x / (1 + e^-x), so a large negative x gives -0, not NaN.
fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}
