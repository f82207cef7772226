//! Selecting `cuda` where it cannot run: a clear error, never a panic. On a machine without the
//! NVIDIA driver (CI) `create` is `Unavailable` and no device is listed; on a GPU machine the
//! same calls succeed. Bad names and ordinals are errors everywhere. With
//! `LOWSYNC_REQUIRE_CUDA=1` (the GPU machine's setting) a missing device is a failure here,
//! whether or not the ignored device tests were asked for.

use lowsync_backend::Error;

/// Whether a missing device must fail (`LOWSYNC_REQUIRE_CUDA=1`).
fn required() -> bool {
    std::env::var("LOWSYNC_REQUIRE_CUDA").is_ok_and(|v| v.trim() == "1")
}

#[test]
fn cuda_without_a_driver_or_device_is_a_clear_unavailable_error() {
    let devices = lowsync_cuda::available_devices();
    match lowsync_cuda::create("cuda") {
        Err(Error::Unavailable { backend, reason }) => {
            assert!(
                !required(),
                "LOWSYNC_REQUIRE_CUDA=1 but {backend} unavailable: {reason}"
            );
            assert_eq!(backend, "CUDA");
            assert!(
                devices.is_empty(),
                "devices {devices:?} listed, but: {reason}"
            );
            assert!(!reason.is_empty());
            let shown = Error::Unavailable { backend, reason }.to_string();
            assert!(shown.starts_with("CUDA unavailable: "), "{shown}");
            eprintln!("as expected here: {shown}");
        }
        Err(other) => panic!("expected Unavailable, got {other}"),
        Ok(b) => {
            assert!(
                !devices.is_empty(),
                "created {} but no device listed",
                b.name()
            );
            assert_eq!(b.name(), "cuda");
        }
    }
}

#[test]
fn listing_devices_never_panics_and_names_them_cuda_n() {
    for (i, d) in lowsync_cuda::available_devices().iter().enumerate() {
        assert_eq!(d, &format!("cuda:{i}"));
    }
}

#[test]
fn a_device_that_is_not_there_is_unavailable() {
    match lowsync_cuda::create("cuda:4096") {
        Err(Error::Unavailable { reason, .. }) => assert!(!reason.is_empty()),
        other => panic!(
            "expected Unavailable, got {:?}",
            other.map(|b| b.name().to_string())
        ),
    }
}

#[test]
fn malformed_names_are_unknown_backends() {
    for bad in ["cuda:", "cuda:x", "cuda-1", "cudax"] {
        assert!(
            matches!(lowsync_cuda::create(bad), Err(Error::UnknownBackend(_))),
            "{bad}"
        );
    }
}
