//! `Cpy` (dtype conversion, contiguous copies of strided views) and `Concat`.

use lowsync_graph::{DType, Op};

use super::harness::*;

#[test]
fn cpy_converts_between_float_dtypes() {
    let dts = [DType::F32, DType::F16, DType::BF16];
    for (i, &from) in dts.iter().enumerate() {
        for &to in &dts {
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(100 + i as u64);
            let x = mem.rand(&mut rng, from, &[3, 17]);
            let dst = mem.zeros(to, &[3, 17]);
            run(&mem, Op::Cpy, &dst, &[&x]).unwrap();
            assert_close(&mem.read(&dst), &mem.read(&x), tol_of(&[from, to]));
            if from == to || to == DType::F32 {
                assert_eq!(mem.read(&dst), mem.read(&x), "{from} -> {to} is exact");
            }
        }
    }
}

#[test]
fn cpy_of_a_transposed_view_makes_a_contiguous_copy() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(104);
    let base = mem.rand(&mut rng, DType::F16, &[2, 3, 4]);
    let x = view(&base, &[4, 2, 3], &[1, 12, 4], 0); // permute (2, 0, 1)
    let dst = mem.zeros(DType::F32, &[4, 2, 3]);
    run(&mem, Op::Cpy, &dst, &[&x]).unwrap();
    assert_eq!(mem.read(&dst), mem.read(&x));
}

#[test]
fn cpy_of_i32_is_exact() {
    let mut mem = TestMem::new();
    let vals: Vec<i32> = (0..20).map(|i| i * 1_000_003 - 7).collect();
    let base = mem.ints(&[4, 5], &vals);
    let x = transpose(&base, 0, 1);
    let dst = mem.zeros(DType::I32, &[5, 4]);
    run(&mem, Op::Cpy, &dst, &[&x]).unwrap();
    assert_eq!(mem.read_i32(&dst), mem.read_i32(&x));
}

#[test]
fn cpy_between_int_and_float_is_an_error() {
    let mut mem = TestMem::new();
    let x = mem.ints(&[3], &[1, 2, 3]);
    let dst = mem.zeros(DType::F32, &[3]);
    kernel_msg(run(&mem, Op::Cpy, &dst, &[&x]));
    let x = mem.tensor(DType::F32, &[3], &[1., 2., 3.]);
    let dst = mem.zeros(DType::I32, &[3]);
    kernel_msg(run(&mem, Op::Cpy, &dst, &[&x]));
}

fn ref_concat(a: &[f64], sa: &[usize], b: &[f64], sb: &[usize], axis: usize) -> Vec<f64> {
    let mut sd = sa.to_vec();
    sd[axis] += sb[axis];
    (0..sd.iter().product())
        .map(|i| {
            let mut idx = unravel(&sd, i);
            if idx[axis] < sa[axis] {
                a[broadcast_index(sa, &idx)]
            } else {
                idx[axis] -= sa[axis];
                b[broadcast_index(sb, &idx)]
            }
        })
        .collect()
}

#[test]
fn concat_along_every_axis_matches_reference() {
    for dt in [DType::F32, DType::BF16] {
        for axis in 0..3 {
            let mut mem = TestMem::new();
            let mut rng = TestRng::new(110 + axis as u64);
            let sa = [2, 3, 4];
            let mut sb = sa;
            sb[axis] = 5;
            let a = mem.rand(&mut rng, dt, &sa);
            let b = mem.rand(&mut rng, dt, &sb);
            let mut sd = sa;
            sd[axis] += 5;
            let dst = mem.zeros(dt, &sd);
            run(&mem, Op::Concat { axis }, &dst, &[&a, &b]).unwrap();
            assert_eq!(
                mem.read(&dst),
                ref_concat(&mem.read(&a), &sa, &mem.read(&b), &sb, axis)
            );
        }
    }
}

#[test]
fn concat_of_strided_and_i32_inputs() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(115);
    let base = mem.rand(&mut rng, DType::F32, &[3, 2]);
    let a = transpose(&base, 0, 1); // [2, 3]
    let b = mem.rand(&mut rng, DType::F32, &[2, 1]);
    let dst = mem.zeros(DType::F32, &[2, 4]);
    run(&mem, Op::Concat { axis: 1 }, &dst, &[&a, &b]).unwrap();
    assert_eq!(
        mem.read(&dst),
        ref_concat(&mem.read(&a), &[2, 3], &mem.read(&b), &[2, 1], 1)
    );

    let a = mem.ints(&[2], &[1, 2]);
    let b = mem.ints(&[3], &[3, 4, i32::MIN]);
    let dst = mem.zeros(DType::I32, &[5]);
    run(&mem, Op::Concat { axis: 0 }, &dst, &[&a, &b]).unwrap();
    assert_eq!(mem.read_i32(&dst), vec![1, 2, 3, 4, i32::MIN]);
}
