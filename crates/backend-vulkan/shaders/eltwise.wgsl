// Element-wise ops over 4-D strided views (rank padded on the left, broadcast axes stride 0):
// op 0 add, 1 mul, 2 scale, 3 silu, 4 gelu, 5 swiglu (silu(a) * b), 6 copy (convert).
// One thread per destination element; a thread reads its sources before it writes, so an
// in-place op over the same layout is safe.

struct Pc {
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    b_str: vec4<u32>,
    // d, a, b element offsets; element count
    offs: vec4<u32>,
    // op code
    op: vec4<u32>,
    // f32 bits: scale
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

fn tanh_safe(y: f32) -> f32 {
    // never inf/inf: exp overflows to inf and 2 / inf is 0
    let e = exp(2.0 * abs(y));
    return sign(y) * (1.0 - 2.0 / (e + 1.0));
}

fn gelu(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_safe(0.7978846 * (x + 0.044715 * x * x * x)));
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let i = group_id(wg, nwg) * 256u + li;
    if i >= pc.offs.w {
        return;
    }
    let c = coord4(i, pc.shape);
    let x = ld_a(pc.offs.y + dot4(c, pc.a_str));
    var r = x;
    switch pc.op.x {
        case 0u: {
            r = x + ld_b(pc.offs.z + dot4(c, pc.b_str));
        }
        case 1u: {
            r = x * ld_b(pc.offs.z + dot4(c, pc.b_str));
        }
        case 2u: {
            r = x * bitcast<f32>(pc.prm.x);
        }
        case 3u: {
            r = silu(x);
        }
        case 4u: {
            r = gelu(x);
        }
        case 5u: {
            r = silu(x) * ld_b(pc.offs.z + dot4(c, pc.b_str));
        }
        default: {}
    }
    st_d(pc.offs.x + dot4(c, pc.d_str), r);
}
