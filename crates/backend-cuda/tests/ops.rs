//! The op suite: every op of `lowsync_graph::Op` with a kernel, in f32/f16/bf16 and with strided
//! sources, on the CUDA backend against the CPU oracle (NMSE per case: 1e-7 f32, 1e-5 f16,
//! 1e-4 bf16; exact for indices and copies). Ignored without a CUDA device (see
//! `common`).

mod common;

use common::{bound, gpu, nmse, Pair, Rng, Twin, FLOATS};
use lowsync_backend::{Backend, Error};
use lowsync_graph::{DType, Op, RopeMode};

fn pair(test: &str) -> Pair {
    Pair::new(gpu(test))
}

/// Runs `op` on both backends and checks the result within the bound of its dtype.
fn check(p: &Pair, case: &str, op: Op, dst: &Twin, srcs: &[&Twin]) {
    p.run(op, dst, srcs)
        .unwrap_or_else(|e| panic!("{case}: CUDA failed: {e}"));
    let (want, got) = p.read(dst);
    let e = nmse(&want, &got);
    let b = bound(dst.cpu.dtype);
    assert!(
        e <= b,
        "{case}: NMSE {e:e} > {b:e}\nwant {:?}\ngot  {:?}",
        &want[..want.len().min(8)],
        &got[..got.len().min(8)]
    );
}

/// Runs `op` and requires bit-identical values.
fn check_exact(p: &Pair, case: &str, op: Op, dst: &Twin, srcs: &[&Twin]) {
    p.run(op, dst, srcs)
        .unwrap_or_else(|e| panic!("{case}: CUDA failed: {e}"));
    let (want, got) = p.read(dst);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(
            w == g || (w.is_nan() && g.is_nan()),
            "{case}: element {i}: want {w}, got {g}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn elementwise_ops_match_the_oracle_with_broadcasts_and_strides() {
    let p = pair("elementwise");
    let mut rng = Rng::new(1);
    for dt in FLOATS {
        for bdt in FLOATS {
            let a = p.rand(&mut rng, dt, &[4, 33, 17]);
            let row = p.rand(&mut rng, bdt, &[17]);
            let col = p.rand(&mut rng, bdt, &[33, 1]);
            for (name, op) in [("add", Op::Add), ("mul", Op::Mul)] {
                let d = p.zeros(dt, &[4, 33, 17]);
                check(&p, &format!("{name} {dt}+{bdt} row"), op, &d, &[&a, &row]);
                check(&p, &format!("{name} {dt}+{bdt} col"), op, &d, &[&a, &col]);
            }
        }
        let x = p.rand(&mut rng, dt, &[24, 40]);
        let xt = x.transpose(0, 1); // [40, 24], strides (1, 40)
        for (name, op) in [
            ("scale", Op::Scale { scale: -0.37 }),
            ("silu", Op::Silu),
            ("gelu", Op::Gelu),
        ] {
            let d = p.zeros(dt, &[40, 24]);
            check(&p, &format!("{name} {dt} transposed"), op, &d, &[&xt]);
        }
        let g = p.rand(&mut rng, dt, &[7, 130]);
        let u = p.rand(&mut rng, dt, &[7, 130]);
        let d = p.zeros(dt, &[7, 130]);
        check(&p, &format!("swiglu {dt}"), Op::SwiGlu, &d, &[&g, &u]);
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn in_place_elementwise_ops_read_before_they_write() {
    let p = pair("in_place");
    let mut rng = Rng::new(2);
    let a = p.rand(&mut rng, DType::F32, &[1000]);
    let b = p.rand(&mut rng, DType::F32, &[1000]);
    check(&p, "add in place", Op::Add, &a, &[&a.clone(), &b]);
    check(&p, "silu in place", Op::Silu, &a, &[&a.clone()]);
    // An overlapping, shifted source takes the private-copy path (as the oracle).
    let x = p.rand(&mut rng, DType::F32, &[64]);
    let src = x.view(&[32], &[1], 0);
    let dst = x.view(&[32], &[1], 16);
    check(
        &p,
        "shifted overlap",
        Op::Scale { scale: 2.0 },
        &dst,
        &[&src],
    );
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn rms_norm_and_soft_max_match_the_oracle() {
    let p = pair("norms");
    let mut rng = Rng::new(3);
    for dt in FLOATS {
        let x = p.rand(&mut rng, dt, &[5, 7, 300]);
        let d = p.zeros(dt, &[5, 7, 300]);
        check(
            &p,
            &format!("rms_norm {dt}"),
            Op::RmsNorm { eps: 1e-5 },
            &d,
            &[&x],
        );
        let xt = p.rand(&mut rng, dt, &[64, 3]).transpose(0, 1);
        let d = p.zeros(dt, &[3, 64]);
        check(
            &p,
            &format!("rms_norm {dt} strided"),
            Op::RmsNorm { eps: 1e-6 },
            &d,
            &[&xt],
        );

        let x = p.rand(&mut rng, dt, &[2, 4, 9, 37]);
        let mut m: Vec<f32> = (0..9 * 37)
            .map(|i| {
                if (i % 37) > 20 + i / 37 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        m[37..74].iter_mut().for_each(|v| *v = f32::NEG_INFINITY); // a fully masked row
        let mask = p.tensor(dt, &[9, 37], &m);
        let d = p.zeros(dt, &[2, 4, 9, 37]);
        check(
            &p,
            &format!("soft_max {dt} masked"),
            Op::SoftMax { scale: 0.125 },
            &d,
            &[&x, &mask],
        );
        check(
            &p,
            &format!("soft_max {dt}"),
            Op::SoftMax { scale: 1.5 },
            &d,
            &[&x],
        );
        let wide = p.rand(&mut rng, dt, &[3, 5000]);
        let d = p.zeros(DType::F32, &[3, 5000]);
        check(
            &p,
            &format!("soft_max {dt} wide -> f32"),
            Op::SoftMax { scale: 1.0 },
            &d,
            &[&wide],
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn rope_matches_the_oracle_in_both_modes() {
    let p = pair("rope");
    let mut rng = Rng::new(4);
    let pos = p.ints(&[6], &[0, 1, 7, 100, 4000, 32767]);
    for dt in FLOATS {
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            for n_dims in [64, 32] {
                let x = p.rand(&mut rng, dt, &[6, 4, 64]);
                let d = p.zeros(dt, &[6, 4, 64]);
                let op = Op::Rope {
                    mode,
                    n_dims,
                    theta_base: 10000.0,
                };
                check(
                    &p,
                    &format!("rope {dt} {mode:?} n_dims {n_dims}"),
                    op,
                    &d,
                    &[&x, &pos],
                );
            }
        }
        // A strided view: heads of a fused qkv tensor [T, 12, 64], taking heads 4..8.
        let qkv = p.rand(&mut rng, dt, &[6, 12, 64]);
        let k = qkv.view(&[6, 4, 64], &[12 * 64, 64, 1], 4 * 64);
        let d = p.zeros(dt, &[6, 4, 64]);
        let op = Op::Rope {
            mode: RopeMode::Neox,
            n_dims: 64,
            theta_base: 500000.0,
        };
        check(&p, &format!("rope {dt} strided"), op, &d, &[&k, &pos]);
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn argmax_picks_the_lowest_index_of_the_maximum_and_skips_nan() {
    let p = pair("argmax");
    let mut rng = Rng::new(5);
    for dt in FLOATS {
        let mut v = rng.vec(7 * 1000);
        v[1000 + 17] = 5.0; // row 1: a tie at 17 and 900 -> 17
        v[1000 + 900] = 5.0;
        v[2000..3000].iter_mut().for_each(|x| *x = f32::NAN); // row 2: all NaN -> 0
        v[3000 + 5] = f32::NAN; // row 3: NaN never wins
        v[3000 + 6] = 9.0;
        v[4000..5000].iter_mut().for_each(|x| *x = 1.0); // row 4: all equal -> 0
        let x = p.tensor(dt, &[7, 1000], &v);
        let d = p.zeros(DType::I32, &[7]);
        check_exact(&p, &format!("argmax {dt}"), Op::Argmax, &d, &[&x]);
    }
    // A vocabulary-long row takes the 1024-thread block: ties and NaN the same way.
    for dt in FLOATS {
        let mut v = rng.vec(2 * 32000);
        v[31999] = 7.0;
        v[20000] = 7.0; // row 0: tie -> 20000
        v[32000 + 5] = f32::NAN;
        v[32000 + 31000] = 6.0; // row 1 -> 31000
        let x = p.tensor(dt, &[2, 32000], &v);
        let d = p.zeros(DType::I32, &[2]);
        check_exact(&p, &format!("argmax {dt} long"), Op::Argmax, &d, &[&x]);
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn get_rows_and_set_rows_match_the_oracle() {
    let p = pair("rows");
    let mut rng = Rng::new(6);
    for dt in FLOATS {
        let table = p.rand(&mut rng, dt, &[50, 64]);
        let ids = p.ints(&[3, 4], &[0, 49, 7, 7, 1, 2, 3, 48, 10, 20, 30, 40]);
        for out in [DType::F32, dt] {
            let d = p.zeros(out, &[3, 4, 64]);
            check_exact(
                &p,
                &format!("get_rows {dt} -> {out}"),
                Op::GetRows,
                &d,
                &[&table, &ids],
            );
        }
        let target = p.rand(&mut rng, dt, &[20, 16]);
        let src = p.rand(&mut rng, DType::F32, &[5, 16]);
        let idx = p.ints(&[5], &[3, 7, 3, 0, 19]); // duplicates: the last write wins
        check_exact(
            &p,
            &format!("set_rows {dt}"),
            Op::SetRows,
            &target,
            &[&target.clone(), &src, &idx],
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn bad_indices_surface_at_the_next_wait_and_the_backend_stays_usable() {
    let p = pair("bad_index");
    let gpu = &p.gpu;
    let mut rng = Rng::new(7);
    let table = p.rand(&mut rng, DType::F32, &[4, 8]);
    let ids = p.ints(&[2], &[1, 99]);
    let d = p.zeros(DType::F32, &[2, 8]);
    let node = lowsync_backend::ExecNode {
        op: Op::GetRows,
        name: "bad_lookup".into(),
        dst: d.gpu.clone(),
        srcs: vec![table.gpu.clone(), ids.gpu.clone()],
    };
    let g = std::sync::Arc::new(lowsync_backend::ExecGraph::new(vec![node]));
    gpu.graph_compute_async(&g).unwrap();
    match gpu.synchronize() {
        Err(Error::Kernel { op, node, msg }) => {
            assert_eq!((op, node.as_str()), ("get_rows", "bad_lookup"));
            assert!(msg.contains("out of range"), "{msg}");
        }
        other => panic!("expected a kernel error, got {other:?}"),
    }
    // Usable afterwards.
    let good = p.ints(&[2], &[1, 3]);
    check_exact(
        &p,
        "get_rows after an error",
        Op::GetRows,
        &d,
        &[&table, &good],
    );
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn bad_shapes_are_errors_before_anything_is_queued() {
    let p = pair("bad_shapes");
    let mut rng = Rng::new(8);
    let a = p.rand(&mut rng, DType::F32, &[4, 5]);
    let b = p.rand(&mut rng, DType::F32, &[6, 3]);
    let d = p.zeros(DType::F32, &[4, 3]);
    let node = lowsync_backend::ExecNode {
        op: Op::MulMat,
        name: "mm".into(),
        dst: d.gpu.clone(),
        srcs: vec![a.gpu.clone(), b.gpu.clone()],
    };
    let before = p.gpu.stats().snapshot();
    let r = p
        .gpu
        .graph_compute_async(&std::sync::Arc::new(lowsync_backend::ExecGraph::new(vec![
            node,
        ])));
    assert!(
        matches!(r, Err(Error::Kernel { op: "mul_mat", .. })),
        "{r:?}"
    );
    assert_eq!(p.gpu.stats().snapshot().since(&before).submits, 0);
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn cpy_and_concat_convert_and_relayout() {
    let p = pair("copies");
    let mut rng = Rng::new(9);
    for sdt in FLOATS {
        for ddt in FLOATS {
            let x = p.rand(&mut rng, sdt, &[16, 24]).transpose(0, 1);
            let d = p.zeros(ddt, &[24, 16]);
            check_exact(&p, &format!("cpy {sdt} -> {ddt}"), Op::Cpy, &d, &[&x]);
        }
    }
    let i = p
        .ints(&[3, 4], &(0..12).collect::<Vec<_>>())
        .transpose(0, 1);
    let d = p.zeros(DType::I32, &[4, 3]);
    check_exact(&p, "cpy i32", Op::Cpy, &d, &[&i]);
    for dt in FLOATS {
        for axis in 0..3 {
            let mut sa = [2, 3, 4];
            let mut sb = [2, 3, 4];
            sa[axis] = 5;
            sb[axis] = 2;
            let a = p.rand(&mut rng, dt, &sa);
            let b = p.rand(&mut rng, DType::F32, &sb);
            let mut sd = sa;
            sd[axis] = 7;
            let d = p.zeros(dt, &sd);
            check_exact(
                &p,
                &format!("concat {dt} axis {axis}"),
                Op::Concat { axis },
                &d,
                &[&a, &b],
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn mul_mat_matches_the_oracle_for_every_layout() {
    let p = pair("mul_mat");
    let mut rng = Rng::new(10);
    for bdt in FLOATS {
        for adt in [DType::F32, bdt] {
            for m in [1, 7, 64] {
                let a = p.rand(&mut rng, adt, &[m, 128]);
                let w = p.rand(&mut rng, bdt, &[96, 128]); // x @ w.T
                let d = p.zeros(DType::F32, &[m, 96]);
                check(
                    &p,
                    &format!("mul_mat {adt}@{bdt}.T m={m}"),
                    Op::MulMat,
                    &d,
                    &[&a, &w.transpose(0, 1)],
                );
                let w2 = p.rand(&mut rng, bdt, &[128, 96]); // x @ w
                check(
                    &p,
                    &format!("mul_mat {adt}@{bdt} m={m}"),
                    Op::MulMat,
                    &d,
                    &[&a, &w2],
                );
            }
        }
        // Batched attention shapes, and GQA: 8 query heads over 2 kv heads.
        let q = p.rand(&mut rng, DType::F32, &[8, 5, 32]);
        let k = p.rand(&mut rng, bdt, &[2, 11, 32]);
        let d = p.zeros(DType::F32, &[8, 5, 11]);
        check(
            &p,
            &format!("mul_mat gqa q@k.T {bdt}"),
            Op::MulMat,
            &d,
            &[&q, &k.view(&[2, 32, 11], &[11 * 32, 1, 32], 0)],
        );
        let s = p.rand(&mut rng, DType::F32, &[8, 5, 11]);
        let v = p.rand(&mut rng, bdt, &[2, 11, 32]);
        let d = p.zeros(DType::F32, &[8, 5, 32]);
        check(
            &p,
            &format!("mul_mat gqa s@v {bdt}"),
            Op::MulMat,
            &d,
            &[&s, &v],
        );
        // Broadcast batch of size 1, 4-D.
        let a = p.rand(&mut rng, bdt, &[2, 3, 4, 16]);
        let b = p.rand(&mut rng, bdt, &[1, 3, 16, 8]);
        let d = p.zeros(DType::F32, &[2, 3, 4, 8]);
        check(
            &p,
            &format!("mul_mat 4-D broadcast {bdt}"),
            Op::MulMat,
            &d,
            &[&a, &b],
        );
        // Odd strides (every other column) take the copy path; a f16 result the scratch path.
        let wide = p.rand(&mut rng, bdt, &[32, 40]);
        let odd = wide.view(&[32, 20], &[40, 2], 0);
        let a = p.rand(&mut rng, DType::F32, &[6, 32]);
        let d = p.zeros(DType::F16, &[6, 20]);
        check(
            &p,
            &format!("mul_mat odd strides {bdt} -> f16"),
            Op::MulMat,
            &d,
            &[&a, &odd],
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (cargo test: --include-ignored; cargo nextest: --run-ignored all)"]
fn mul_mat_id_matches_the_oracle() {
    let p = pair("mul_mat_id");
    let mut rng = Rng::new(11);
    for dt in FLOATS {
        let experts = p.rand(&mut rng, dt, &[4, 32, 24]);
        let x = p.rand(&mut rng, DType::F32, &[3, 32]);
        let ids = p.ints(&[3, 2], &[0, 3, 2, 2, 1, 0]);
        let w = p.rand(&mut rng, DType::F32, &[3, 2]);
        let d = p.zeros(DType::F32, &[3, 24]);
        check(
            &p,
            &format!("mul_mat_id {dt}"),
            Op::MulMatId,
            &d,
            &[&experts, &x, &ids, &w],
        );
    }
}
