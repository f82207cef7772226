// The rotary angle pos * theta^(-2i/n_dims), formed and reduced to [-pi, pi] in f64 (the CPU
// oracle computes it in f64); sin/cos then run in f32.

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

