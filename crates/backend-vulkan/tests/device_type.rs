//! `device_type` reports the physical device kind from an instance alone. This machine's
//! Vulkan is Mesa lavapipe, a CPU device; with `LOWSYNC_REQUIRE_VULKAN=1` it must say so.

use lowsync_backend::Error;

#[test]
fn lavapipe_is_a_cpu_device_and_bad_names_are_errors() {
    assert!(matches!(
        lowsync_vulkan::device_type("cuda"),
        Err(Error::UnknownBackend(_))
    ));
    assert!(matches!(
        lowsync_vulkan::device_type("vulkan:x"),
        Err(Error::UnknownBackend(_))
    ));
    if std::env::var("LOWSYNC_REQUIRE_VULKAN").as_deref() != Ok("1") {
        // Without a required device the call must still answer, never panic.
        let _ = lowsync_vulkan::device_type("vulkan");
        return;
    }
    assert_eq!(lowsync_vulkan::device_type("vulkan").unwrap(), "cpu");
    assert_eq!(lowsync_vulkan::device_type("vulkan:0").unwrap(), "cpu");
    assert!(matches!(
        lowsync_vulkan::device_type("vulkan:99"),
        Err(Error::Unavailable { .. })
    ));
}
