//! `LOWSYNC_CUDA_SYNC_ELISION` (ARCHITECTURE §8), `LOWSYNC_CUDA_MMV_MAX_M`, `LOWSYNC_CUDA_GRAPHS`,
//! `LOWSYNC_CUDA_FUSION`, `LOWSYNC_CUDA_TIMING`, `LOWSYNC_CUDA_PDL`, `LOWSYNC_CUDA_ATTN_FAST`,
//! `LOWSYNC_CUDA_REHEARSE`, `LOWSYNC_CUDA_GEMV_STREAM`, `LOWSYNC_CUDA_GEMV_SPLIT`,
//! `LOWSYNC_CUDA_GEMV_BLOCKS`, `LOWSYNC_CUDA_GEMV_PAD_KB`, `LOWSYNC_CUDA_WEIGHT_EVICT_FIRST`,
//! `LOWSYNC_CUDA_COPY_KERNEL` and `LOWSYNC_CUDA_READ_KERNEL`: a bad value is an error naming
//! the variable. (Its own test binary: it sets process-wide variables; one test, so nothing
//! reads them while they are bad.)

use lowsync_backend::Error;
use lowsync_cuda::CudaConfig;

#[test]
fn sync_elision_variable_is_parsed_and_a_bad_value_is_an_error() {
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

    assert_eq!(CudaConfig::from_env().unwrap().mmv_max_m, None, "unset");
    std::env::set_var("LOWSYNC_CUDA_MMV_MAX_M", "0");
    assert_eq!(CudaConfig::from_env().unwrap().mmv_max_m, Some(0));
    std::env::set_var("LOWSYNC_CUDA_MMV_MAX_M", " 16 ");
    assert_eq!(CudaConfig::from_env().unwrap().mmv_max_m, Some(16));
    std::env::set_var("LOWSYNC_CUDA_MMV_MAX_M", "-1");
    match CudaConfig::from_env() {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_MMV_MAX_M"),
        other => panic!("expected an env error, got {other:?}"),
    }
    std::env::remove_var("LOWSYNC_CUDA_MMV_MAX_M");

    assert_eq!(CudaConfig::from_env().unwrap().stream_blocks, 2, "unset");
    std::env::set_var("LOWSYNC_CUDA_GEMV_BLOCKS", "3");
    assert_eq!(CudaConfig::from_env().unwrap().stream_blocks, 3);
    std::env::set_var("LOWSYNC_CUDA_GEMV_BLOCKS", "1000");
    assert_eq!(CudaConfig::from_env().unwrap().stream_blocks, 32, "capped");
    for bad in ["0", "two"] {
        std::env::set_var("LOWSYNC_CUDA_GEMV_BLOCKS", bad);
        match CudaConfig::from_env() {
            Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_GEMV_BLOCKS"),
            other => panic!("expected an env error for {bad:?}, got {other:?}"),
        }
    }
    std::env::remove_var("LOWSYNC_CUDA_GEMV_BLOCKS");

    assert_eq!(
        CudaConfig::from_env().unwrap().stream_pad_kb,
        None,
        "unset: automatic"
    );
    std::env::set_var("LOWSYNC_CUDA_GEMV_PAD_KB", "0");
    assert_eq!(CudaConfig::from_env().unwrap().stream_pad_kb, Some(0));
    std::env::set_var("LOWSYNC_CUDA_GEMV_PAD_KB", "227");
    assert_eq!(CudaConfig::from_env().unwrap().stream_pad_kb, Some(227));
    for bad in ["228", "80k", "-1"] {
        std::env::set_var("LOWSYNC_CUDA_GEMV_PAD_KB", bad);
        match CudaConfig::from_env() {
            Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_GEMV_PAD_KB"),
            other => panic!("expected an env error for {bad:?}, got {other:?}"),
        }
    }
    std::env::remove_var("LOWSYNC_CUDA_GEMV_PAD_KB");

    assert_eq!(
        CudaConfig::from_env().unwrap().copy_kernel_max,
        4096,
        "unset"
    );
    std::env::set_var("LOWSYNC_CUDA_COPY_KERNEL", "0");
    assert_eq!(CudaConfig::from_env().unwrap().copy_kernel_max, 0);
    std::env::set_var("LOWSYNC_CUDA_COPY_KERNEL", "512");
    assert_eq!(CudaConfig::from_env().unwrap().copy_kernel_max, 512);
    for bad in ["4k", "-1"] {
        std::env::set_var("LOWSYNC_CUDA_COPY_KERNEL", bad);
        match CudaConfig::from_env() {
            Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_CUDA_COPY_KERNEL"),
            other => panic!("expected an env error for {bad:?}, got {other:?}"),
        }
    }
    std::env::remove_var("LOWSYNC_CUDA_COPY_KERNEL");

    for (var, default) in [
        ("LOWSYNC_CUDA_GRAPHS", true),
        ("LOWSYNC_CUDA_FUSION", true),
        ("LOWSYNC_CUDA_TIMING", false),
        ("LOWSYNC_CUDA_PDL", true),
        ("LOWSYNC_CUDA_ATTN_FAST", true),
        ("LOWSYNC_CUDA_REHEARSE", true),
        ("LOWSYNC_CUDA_GEMV_STREAM", true),
        ("LOWSYNC_CUDA_GEMV_SPLIT", true),
        ("LOWSYNC_CUDA_WEIGHT_EVICT_FIRST", false),
        ("LOWSYNC_CUDA_READ_KERNEL", true),
    ] {
        let read = |c: &CudaConfig| match var {
            "LOWSYNC_CUDA_GRAPHS" => c.graphs,
            "LOWSYNC_CUDA_FUSION" => c.fusion,
            "LOWSYNC_CUDA_PDL" => c.pdl,
            "LOWSYNC_CUDA_ATTN_FAST" => c.attn_fast,
            "LOWSYNC_CUDA_REHEARSE" => c.rehearse,
            "LOWSYNC_CUDA_GEMV_STREAM" => c.gemv_stream,
            "LOWSYNC_CUDA_GEMV_SPLIT" => c.gemv_split,
            "LOWSYNC_CUDA_WEIGHT_EVICT_FIRST" => c.weight_evict_first,
            "LOWSYNC_CUDA_READ_KERNEL" => c.read_kernel,
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
}
