//! `GetRows` and `SetRows`: gathers and scatters, dtype conversion, bad indices.

use lowsync_backend::Error;
use lowsync_graph::{DType, Op};

use super::harness::*;

#[test]
fn get_rows_gathers_rows_for_any_ids_shape() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(90 + i as u64);
        let table = mem.rand(&mut rng, dt, &[7, 5]);
        let ids_v = [6, 0, 3, 3, 1, 6];
        let ids = mem.ints(&[2, 3], &ids_v);
        let dst = mem.zeros(DType::F32, &[2, 3, 5]);
        run(&mem, Op::GetRows, &dst, &[&table, &ids]).unwrap();
        let t = mem.read(&table);
        let want: Vec<f64> = ids_v
            .iter()
            .flat_map(|&r| t[r as usize * 5..][..5].to_vec())
            .collect();
        // Widening to f32 is exact.
        assert_eq!(mem.read(&dst), want);
    }
}

#[test]
fn get_rows_reads_a_strided_table() {
    let mut mem = TestMem::new();
    let mut rng = TestRng::new(93);
    let base = mem.rand(&mut rng, DType::F32, &[4, 6]);
    let table = transpose(&base, 0, 1); // [6, 4]
    let ids = mem.ints(&[3], &[5, 0, 2]);
    let dst = mem.zeros(DType::F32, &[3, 4]);
    run(&mem, Op::GetRows, &dst, &[&table, &ids]).unwrap();
    let t = mem.read(&table);
    let want: Vec<f64> = [5, 0, 2]
        .iter()
        .flat_map(|&r| t[r * 4..][..4].to_vec())
        .collect();
    assert_eq!(mem.read(&dst), want);
}

#[test]
fn get_rows_out_of_range_id_is_an_error() {
    for bad in [7, -1, i32::MAX] {
        let mut mem = TestMem::new();
        let table = mem.zeros(DType::F16, &[7, 5]);
        let ids = mem.ints(&[3], &[0, bad, 2]);
        let dst = mem.zeros(DType::F32, &[3, 5]);
        let msg = kernel_msg(run(&mem, Op::GetRows, &dst, &[&table, &ids]));
        assert!(msg.contains(&bad.to_string()) && msg.contains('7'), "{msg}");
    }
}

#[test]
fn set_rows_writes_rows_in_place_and_converts_to_the_cache_dtype() {
    for (i, dt) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let mut mem = TestMem::new();
        let mut rng = TestRng::new(95 + i as u64);
        let cache_init = rng.vec(6 * 4);
        let cache = mem.tensor(dt, &[6, 4], &cache_init);
        let before = mem.read(&cache);
        let src = mem.rand(&mut rng, DType::F32, &[2, 4]);
        let idx = mem.ints(&[2], &[4, 1]);
        // The result aliases the cache: same buffer, same layout.
        run(&mem, Op::SetRows, &cache, &[&cache, &src, &idx]).unwrap();
        let got = mem.read(&cache);
        let s = mem.read(&src);
        let mut want = before.clone();
        want[16..20].copy_from_slice(&s[0..4]);
        want[4..8].copy_from_slice(&s[4..8]);
        assert_close(&got, &want, tol(dt));
        for r in [0, 2, 3, 5] {
            assert_eq!(
                &got[r * 4..r * 4 + 4],
                &before[r * 4..r * 4 + 4],
                "row {r} untouched"
            );
        }
    }
}

#[test]
fn set_rows_into_a_view_of_the_cache_uses_the_result_layout() {
    // The cache is [8, 4]; the node writes rows 2.. of it through a sliced view.
    let mut mem = TestMem::new();
    let cache = mem.zeros(DType::F32, &[8, 4]);
    let window = view(&cache, &[6, 4], &[4, 1], 8);
    let src = mem.tensor(DType::F32, &[1, 4], &[1., 2., 3., 4.]);
    let idx = mem.ints(&[1], &[3]);
    run(&mem, Op::SetRows, &window, &[&window, &src, &idx]).unwrap();
    let got = mem.read(&cache);
    assert_eq!(&got[20..24], &[1., 2., 3., 4.]);
    assert_eq!(got.iter().filter(|&&v| v != 0.0).count(), 4);
}

#[test]
fn set_rows_out_of_range_index_is_an_error_and_writes_nothing() {
    for bad in [6, -3] {
        let mut mem = TestMem::new();
        let cache = mem.zeros(DType::F16, &[6, 4]);
        let src = mem.tensor(DType::F32, &[2, 4], &[1.0; 8]);
        let idx = mem.ints(&[2], &[0, bad]);
        let msg = kernel_msg(run(&mem, Op::SetRows, &cache, &[&cache, &src, &idx]));
        assert!(msg.contains(&bad.to_string()) && msg.contains('6'), "{msg}");
        assert!(
            mem.read(&cache).iter().all(|&v| v == 0.0),
            "nothing written"
        );
    }
}

#[test]
fn a_view_whose_extent_wraps_is_refused_before_any_read() {
    // A 2-element table seen as [2^63 + 1, 2]: unchecked, its byte extent wraps to 8 bytes,
    // passes the bounds check, and get_rows reads row 2^30 far outside the buffer.
    let mut mem = TestMem::new();
    let table = mem.tensor(DType::F32, &[2], &[1., 2.]);
    let huge = view(&table, &[(1usize << 63) + 1, 2], &[2, 1], 0);
    let ids = mem.ints(&[1], &[1 << 30]);
    let dst = mem.zeros(DType::F32, &[1, 2]);
    let e = run(&mem, Op::GetRows, &dst, &[&huge, &ids]).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
    assert_eq!(mem.read(&dst), vec![0.0; 2], "nothing was written");
}
