//! The CUDA backend's variables: the user-facing `LOWSYNC_CUDA_SYNC_ELISION` (ARCHITECTURE §8),
//! `LOWSYNC_CUDA_GRAPHS`, `LOWSYNC_CUDA_FUSION` and `LOWSYNC_CUDA_TIMING`, and the decode
//! path's tuning knobs in `LOWSYNC_CUDA_TUNE=key=value,...` (docs/tuning.md): a bad value is an
//! error naming the variable. The tuning string's parser is a pure function
//! (`CudaConfig::with_tune`), tested here without the environment; the environment is read by
//! one test of its own, since it sets process-wide variables (nothing else reads them while
//! they are bad). No GPU needed.

use lowsync_backend::Error;
use lowsync_cuda::{CudaConfig, TypedQ};

fn tuned(spec: &str) -> lowsync_backend::Result<CudaConfig> {
    CudaConfig::default().with_tune(spec)
}

/// The error of `spec`, which must be an `Env` error for `LOWSYNC_CUDA_TUNE` with the whole
/// value: its `expected` text.
fn tune_error(spec: &str) -> &'static str {
    match tuned(spec) {
        Err(Error::Env {
            var,
            value,
            expected,
        }) => {
            assert_eq!(var, "LOWSYNC_CUDA_TUNE", "{spec}");
            assert_eq!(value, spec, "the variable's value");
            expected
        }
        other => panic!("{spec}: expected an env error, got {other:?}"),
    }
}

#[test]
fn tune_keys_set_their_knobs_with_todays_ranges_and_defaults() {
    let d = CudaConfig::default();
    assert_eq!(tuned("").unwrap(), d, "empty: the defaults");
    let defaults = (
        d.pdl,
        d.attn_fast,
        d.attn_prefill,
        d.rehearse,
        d.gemv_stream,
        d.gemv_split,
        d.read_kernel,
    );
    assert_eq!(defaults, (true, true, true, true, true, true, true));
    assert_eq!(
        (
            d.stream_blocks,
            d.stream_pad_kb,
            d.copy_kernel_max,
            d.mmv_max_m
        ),
        (2, None, 4096, None)
    );
    assert_eq!(d.q_blocks, 3);
    assert!(!d.q_prefetch && d.q_ahead && d.q_head && d.q_interleave && d.rehearse_list);
    assert!(d.q_direct);
    assert_eq!((d.q_warps, d.q_warps_norm), (16, 8));
    assert_eq!(tuned("gemv_q_warps=0").unwrap().q_warps, 0);
    assert_eq!(tuned("gemv_q_warps_norm=0").unwrap().q_warps_norm, 0);
    assert!(tune_error("gemv_q_warps_norm=4").contains("gemv_q_warps_norm"));
    assert_eq!(tuned("gemv_q_warps=8").unwrap().q_warps, 8);
    assert!(tune_error("gemv_q_warps=32").contains("gemv_q_warps"));
    assert_eq!(d.attn_split, 1);
    assert_eq!(d.q_typed, TypedQ::All);
    for (v, want) in [("0", TypedQ::Off), ("1", TypedQ::NoQ4K), ("2", TypedQ::All)] {
        assert_eq!(tuned(&format!("gemv_q_typed={v}")).unwrap().q_typed, want);
    }
    assert!(tuned("gemv_q_typed=3").is_err());
    assert_eq!(tuned("gemv_q_blocks=2").unwrap().q_blocks, 2);

    type Read = fn(&CudaConfig) -> bool;
    let flags: [(&str, Read); 15] = [
        ("pdl", |c| c.pdl),
        ("attn_fast", |c| c.attn_fast),
        ("attn_prefill", |c| c.attn_prefill),
        ("rehearse", |c| c.rehearse),
        ("gemv_stream", |c| c.gemv_stream),
        ("gemv_split", |c| c.gemv_split),
        ("read_kernel", |c| c.read_kernel),
        ("gemv_q_head", |c| c.q_head),
        ("gemv_q_head_fold", |c| c.q_head_fold),
        ("gemv_q_head_pairs", |c| c.q_head_pairs),
        ("gemv_q_ahead", |c| c.q_ahead),
        ("gemv_q_interleave", |c| c.q_interleave),
        ("gemv_q_direct", |c| c.q_direct),
        ("gemv_q_direct_norm", |c| c.q_direct_norm),
        ("rehearse_list", |c| c.rehearse_list),
    ];
    for (key, read) in flags {
        assert!(!read(&tuned(&format!("{key}=0")).unwrap()), "{key}=0");
        assert!(read(&tuned(&format!("{key}=1")).unwrap()), "{key}=1");
        let back = tuned(&format!("{key}=0,{key}=1")).unwrap();
        assert_eq!(
            back, d,
            "{key} touches only its own knob; the last item wins"
        );
        assert!(tune_error(&format!("{key}=yes")).contains(key));
    }

    // Off by default (the flags above are on by default).
    assert!(tuned("gemv_q_prefetch=1").unwrap().q_prefetch);
    assert_eq!(tuned("gemv_q_prefetch=1,gemv_q_prefetch=0").unwrap(), d);
    assert!(tune_error("gemv_q_prefetch=yes").contains("gemv_q_prefetch"));
    assert_eq!(tuned("gemv_blocks=3").unwrap().stream_blocks, 3);
    assert_eq!(
        tuned("gemv_blocks=1000").unwrap().stream_blocks,
        32,
        "capped"
    );
    assert_eq!(tuned("gemv_pad_kb=0").unwrap().stream_pad_kb, Some(0));
    assert_eq!(tuned("gemv_pad_kb=227").unwrap().stream_pad_kb, Some(227));
    assert_eq!(tuned("copy_kernel=0").unwrap().copy_kernel_max, 0);
    assert_eq!(tuned("copy_kernel=512").unwrap().copy_kernel_max, 512);
    assert_eq!(tuned("mmv_max_m=0").unwrap().mmv_max_m, Some(0));
    assert_eq!(tuned("mmv_max_m= 16 ").unwrap().mmv_max_m, Some(16));

    let c = tuned(" pdl=0 , gemv_blocks=4,,mmv_max_m=8,").unwrap();
    assert_eq!(
        c,
        CudaConfig {
            pdl: false,
            stream_blocks: 4,
            mmv_max_m: Some(8),
            ..CudaConfig::default()
        },
        "several items, spaces and empty items"
    );
}

#[test]
fn a_bad_tune_key_or_value_is_an_error_naming_the_variable() {
    for bad in ["gemv_blocks=0", "gemv_blocks=two"] {
        assert!(tune_error(bad).contains("positive integer"), "{bad}");
    }
    for bad in ["gemv_pad_kb=228", "gemv_pad_kb=80k", "gemv_pad_kb=-1"] {
        assert!(tune_error(bad).contains("at most 227"), "{bad}");
    }
    for bad in ["copy_kernel=4k", "copy_kernel=-1"] {
        assert!(tune_error(bad).contains("bytes"), "{bad}");
    }
    assert!(tune_error("mmv_max_m=-1").contains("rows"));
    // Unknown keys — the dropped evict-first switch among them — and items without `=` list
    // every accepted key.
    for bad in [
        "weight_evict_first=1",
        "pdl=1,evict_first=0",
        "PDL=0",
        "pdl",
    ] {
        let expected = tune_error(bad);
        for key in [
            "pdl",
            "attn_fast",
            "attn_prefill",
            "rehearse",
            "gemv_stream",
            "gemv_split",
            "gemv_blocks",
            "gemv_q_blocks",
            "gemv_q_prefetch",
            "gemv_q_head",
            "gemv_q_head_pairs",
            "gemv_q_head_fold",
            "gemv_q_ahead",
            "gemv_q_typed",
            "gemv_q_interleave",
            "gemv_q_direct",
            "gemv_q_direct_norm",
            "gemv_q_warps",
            "gemv_q_warps_norm",
            "rehearse_list",
            "gemv_pad_kb",
            "copy_kernel",
            "read_kernel",
            "mmv_max_m",
        ] {
            assert!(expected.contains(key), "{bad}: {expected} lacks {key}");
        }
    }
}

#[test]
fn variables_are_read_and_a_bad_value_is_an_error_naming_the_variable() {
    std::env::set_var("LOWSYNC_CUDA_SYNC_ELISION", "0");
    assert!(!CudaConfig::from_env().unwrap().sync_elision);
    std::env::set_var("LOWSYNC_CUDA_SYNC_ELISION", "1");
    assert!(CudaConfig::from_env().unwrap().sync_elision);
    std::env::remove_var("LOWSYNC_CUDA_SYNC_ELISION");
    assert!(
        CudaConfig::from_env().unwrap().sync_elision,
        "on by default"
    );
    std::env::set_var("LOWSYNC_CUDA_SYNC_ELISION", "yes");
    match CudaConfig::from_env() {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_SYNC_ELISION"),
        other => panic!("expected an env error, got {other:?}"),
    }
    match lowsync_cuda::create("cuda") {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_SYNC_ELISION"),
        other => panic!(
            "create must report the bad variable first, got {:?}",
            other.map(|_| ())
        ),
    }
    std::env::remove_var("LOWSYNC_CUDA_SYNC_ELISION");

    for (var, default) in [
        ("LOWSYNC_CUDA_GRAPHS", true),
        ("LOWSYNC_CUDA_FUSION", true),
        ("LOWSYNC_CUDA_TIMING", false),
    ] {
        let read = |c: &CudaConfig| match var {
            "LOWSYNC_CUDA_GRAPHS" => c.graphs,
            "LOWSYNC_CUDA_FUSION" => c.fusion,
            _ => c.timing,
        };
        assert_eq!(
            read(&CudaConfig::from_env().unwrap()),
            default,
            "{var} default"
        );
        std::env::set_var(var, "0");
        assert!(!read(&CudaConfig::from_env().unwrap()), "{var}=0");
        std::env::set_var(var, "1");
        assert!(read(&CudaConfig::from_env().unwrap()), "{var}=1");
        std::env::set_var(var, "sometimes");
        match CudaConfig::from_env() {
            Err(Error::Env { var: v, .. }) => assert_eq!(v, var),
            other => panic!("expected an env error for {var}, got {other:?}"),
        }
        std::env::remove_var(var);
    }

    assert_eq!(CudaConfig::from_env().unwrap(), CudaConfig::default());
    std::env::set_var("LOWSYNC_CUDA_TUNE", "pdl=0,gemv_blocks=3");
    let c = CudaConfig::from_env().unwrap();
    assert!(!c.pdl && c.stream_blocks == 3 && c.rehearse, "{c:?}");
    std::env::set_var("LOWSYNC_CUDA_TUNE", "gemv_blocks=0");
    match CudaConfig::from_env() {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_TUNE"),
        other => panic!("expected an env error, got {other:?}"),
    }
    match lowsync_cuda::create("cuda") {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_TUNE"),
        other => panic!(
            "create must report the bad variable, got {:?}",
            other.map(|_| ())
        ),
    }
    std::env::remove_var("LOWSYNC_CUDA_TUNE");
}
