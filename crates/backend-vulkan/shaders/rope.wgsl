// Rotary embedding of x [T, H, D] at positions pos [T]. One thread per rotated pair, plus one
// per copied dim >= n_dims. The angle pos * theta^(-2i/n_dims) is formed and reduced to
// [-pi, pi] in f64 (the CPU oracle computes it in f64), then sin/cos run in f32.
// `rope_f32.wgsl` is the same kernel for devices without shaderFloat64.

struct Pc {
    // T, H, D, n_dims
    shape: vec4<u32>,
    d_str: vec4<u32>,
    a_str: vec4<u32>,
    // x: position stride
    b_str: vec4<u32>,
    // d, a, pos offsets; thread count
    offs: vec4<u32>,
    // mode (0 normal, 1 neox), n_dims / 2, threads per row
    op: vec4<u32>,
    // f32 bits: ratio theta^(-2/n_dims) as hi + lo, theta
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const TWO_PI: f64 = 6.283185307179586lf;
const PI: f64 = 3.141592653589793lf;

fn angle(p: i32, i: u32) -> f32 {
    let ratio = f64(bitcast<f32>(pc.prm.x)) + f64(bitcast<f32>(pc.prm.y));
    var f = 1.0lf;
    var base = ratio;
    var e = i;
    while e > 0u {
        if (e & 1u) == 1u {
            f *= base;
        }
        base *= base;
        e >>= 1u;
    }
    let a = f64(p) * f;
    var r = a - floor(a / TWO_PI) * TWO_PI;
    if r > PI {
        r -= TWO_PI;
    }
    return f32(r);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let gi = group_id(wg, nwg) * 256u + li;
    if gi >= pc.offs.w {
        return;
    }
    let per = pc.op.z;
    let row = gi / per;
    let j = gi % per;
    let t = row / pc.shape.y;
    let h = row % pc.shape.y;
    let a0 = pc.offs.y + t * pc.a_str.x + h * pc.a_str.y;
    let d0 = pc.offs.x + t * pc.d_str.x + h * pc.d_str.y;
    let half = pc.op.y;
    if j < half {
        var ia = 2u * j;
        var ib = 2u * j + 1u;
        if pc.op.x == 1u {
            ia = j;
            ib = j + half;
        }
        let p = ldi_pos(pc.offs.z + t * pc.b_str.x);
        let th = angle(p, j);
        let c = cos(th);
        let s = sin(th);
        let a = ld_a(a0 + ia * pc.a_str.z);
        let b = ld_a(a0 + ib * pc.a_str.z);
        st_d(d0 + ia * pc.d_str.z, a * c - b * s);
        st_d(d0 + ib * pc.d_str.z, a * s + b * c);
    } else {
        let jj = pc.shape.w + (j - half);
        st_d(d0 + jj * pc.d_str.z, ld_a(a0 + jj * pc.a_str.z));
    }
}
