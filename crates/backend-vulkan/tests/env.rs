//! Environment handling of `create` (ARCHITECTURE §8): bad values are `Error::Env` naming the
//! variable, bad names are `UnknownBackend`, and `available_devices` never panics. Alone in
//! this test binary because it sets process-wide variables.

mod common;

use lowsync_backend::Error;
use lowsync_vulkan::{QuantMatMul, QuantMatVec, SplitK};

#[test]
fn bad_values_and_names_are_clear_errors() {
    std::env::set_var("LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX", "lots");
    match lowsync_vulkan::create("vulkan") {
        Err(Error::Env { var, .. }) => assert_eq!(var, "LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX"),
        Err(e) => panic!("expected an env error, got {e}"),
        Ok(_) => panic!("expected an env error, got a backend"),
    }
    std::env::remove_var("LOWSYNC_VK_COMPUTE_STREAM_COPY_MAX");
    std::env::set_var("LOWSYNC_VK_LEGACY_SUBMITS", "yes");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_LEGACY_SUBMITS",
            ..
        })
    ));
    std::env::remove_var("LOWSYNC_VK_LEGACY_SUBMITS");
    std::env::set_var("LOWSYNC_VK_RECORD", "off");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_RECORD",
            ..
        })
    ));
    std::env::set_var("LOWSYNC_VK_RECORD", "0");
    assert!(!lowsync_vulkan::VkConfig::from_env().unwrap().record);
    std::env::remove_var("LOWSYNC_VK_RECORD");
    assert!(
        lowsync_vulkan::VkConfig::from_env().unwrap().record,
        "on by default"
    );
    assert!(lowsync_vulkan::VkConfig::default().record, "on by default");
    std::env::set_var("LOWSYNC_VK_COOPMAT", "maybe");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_COOPMAT",
            ..
        })
    ));
    std::env::set_var("LOWSYNC_VK_COOPMAT", "1");
    assert!(lowsync_vulkan::VkConfig::from_env().unwrap().coopmat);
    std::env::remove_var("LOWSYNC_VK_COOPMAT");
    assert!(
        !lowsync_vulkan::VkConfig::from_env().unwrap().coopmat,
        "off unless asked for"
    );
    std::env::set_var("LOWSYNC_VK_ATTN_VEC", "yes");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_ATTN_VEC",
            ..
        })
    ));
    std::env::set_var("LOWSYNC_VK_ATTN_VEC", "0");
    assert!(!lowsync_vulkan::VkConfig::from_env().unwrap().attn_vec);
    std::env::remove_var("LOWSYNC_VK_ATTN_VEC");
    assert!(
        lowsync_vulkan::VkConfig::from_env().unwrap().attn_vec,
        "on unless turned off"
    );
    std::env::set_var("LOWSYNC_VK_QV", "blocks");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_QV",
            ..
        })
    ));
    for (value, body) in [
        ("block", Some(QuantMatVec::Block)),
        ("group", Some(QuantMatVec::Group)),
        ("rows", Some(QuantMatVec::Rows)),
        ("idot", Some(QuantMatVec::Idot)),
        ("", None),
    ] {
        std::env::set_var("LOWSYNC_VK_QV", value);
        assert_eq!(
            lowsync_vulkan::VkConfig::from_env().unwrap().quant_mat_vec,
            body,
            "{value:?}"
        );
    }
    std::env::remove_var("LOWSYNC_VK_QV");
    for bad in ["0", "1025", "eight"] {
        std::env::set_var("LOWSYNC_VK_QD_ROWS", bad);
        assert!(
            matches!(
                lowsync_vulkan::create("vulkan"),
                Err(Error::Env {
                    var: "LOWSYNC_VK_QD_ROWS",
                    ..
                })
            ),
            "{bad}"
        );
    }
    std::env::set_var("LOWSYNC_VK_QD_ROWS", "24");
    assert_eq!(
        lowsync_vulkan::VkConfig::from_env().unwrap().qd_rows,
        Some(24)
    );
    std::env::remove_var("LOWSYNC_VK_QD_ROWS");
    assert_eq!(lowsync_vulkan::VkConfig::from_env().unwrap().qd_rows, None);
    assert_eq!(
        lowsync_vulkan::VkConfig::default().quant_mat_vec,
        None,
        "the device's default"
    );
    assert_eq!(QuantMatVec::for_device(true, false), QuantMatVec::Group);
    assert_eq!(QuantMatVec::for_device(true, true), QuantMatVec::Group);
    assert_eq!(QuantMatVec::for_device(false, false), QuantMatVec::Rows);
    assert_eq!(QuantMatVec::for_device(false, true), QuantMatVec::Idot);
    std::env::set_var("LOWSYNC_VK_QMM", "tile");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env {
            var: "LOWSYNC_VK_QMM",
            ..
        })
    ));
    for (value, layout) in [
        ("rows", Some(QuantMatMul::Rows)),
        ("tiles", Some(QuantMatMul::Tiles)),
        ("", None),
    ] {
        std::env::set_var("LOWSYNC_VK_QMM", value);
        assert_eq!(
            lowsync_vulkan::VkConfig::from_env().unwrap().quant_mat_mul,
            layout,
            "{value:?}"
        );
    }
    std::env::remove_var("LOWSYNC_VK_QMM");
    for bad in ["16", "eight", "0"] {
        std::env::set_var("LOWSYNC_VK_TILE", bad);
        assert!(
            matches!(
                lowsync_vulkan::create("vulkan"),
                Err(Error::Env {
                    var: "LOWSYNC_VK_TILE",
                    ..
                })
            ),
            "{bad}"
        );
    }
    for (value, tile) in [("4", 4), ("8", 8), ("", 4)] {
        std::env::set_var("LOWSYNC_VK_TILE", value);
        assert_eq!(
            lowsync_vulkan::VkConfig::from_env().unwrap().tile,
            tile,
            "{value:?}"
        );
    }
    std::env::remove_var("LOWSYNC_VK_TILE");
    assert_eq!(lowsync_vulkan::VkConfig::default().tile, 4);
    for bad in ["1", "9", "half", "-2"] {
        std::env::set_var("LOWSYNC_VK_SPLIT_K", bad);
        assert!(
            matches!(
                lowsync_vulkan::create("vulkan"),
                Err(Error::Env {
                    var: "LOWSYNC_VK_SPLIT_K",
                    ..
                })
            ),
            "{bad}"
        );
    }
    for (value, split) in [
        ("0", SplitK::Off),
        ("", SplitK::Off),
        ("auto", SplitK::Auto),
        ("2", SplitK::Fixed(2)),
        ("8", SplitK::Fixed(8)),
    ] {
        std::env::set_var("LOWSYNC_VK_SPLIT_K", value);
        assert_eq!(
            lowsync_vulkan::VkConfig::from_env().unwrap().split_k,
            split,
            "{value:?}"
        );
    }
    std::env::remove_var("LOWSYNC_VK_SPLIT_K");
    assert_eq!(lowsync_vulkan::VkConfig::default().split_k, SplitK::Off);
    device_default_switch("LOWSYNC_VK_NORM_FOLD", |c| c.norm_fold);
    device_default_switch("LOWSYNC_VK_ATTN_GROUP", |c| c.attn_group);
    device_default_switch("LOWSYNC_VK_ROW_LANES", |c| c.row_lanes);
    assert_eq!(lowsync_vulkan::VkConfig::default().quant_mat_mul, None);
    assert_eq!(QuantMatMul::for_device(true), QuantMatMul::Rows);
    assert_eq!(QuantMatMul::for_device(false), QuantMatMul::Tiles);
    for bad in ["vulkan:x", "vulkan:", "vulkanx", "cuda:0"] {
        assert!(
            matches!(lowsync_vulkan::create(bad), Err(Error::UnknownBackend(_))),
            "{bad}"
        );
    }
    let devices = lowsync_vulkan::available_devices();
    if devices.is_empty() {
        let required = std::env::var("LOWSYNC_REQUIRE_VULKAN").is_ok_and(|v| v.trim() == "1");
        assert!(
            !required,
            "LOWSYNC_REQUIRE_VULKAN=1 and no Vulkan device is available"
        );
        eprintln!("skipping: no Vulkan device");
        return;
    }
    assert_eq!(devices[0], "vulkan:0");
    let n = devices.len();
    match lowsync_vulkan::create(&format!("vulkan:{n}")) {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("no Vulkan device"), "{reason}")
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("device {n} should not exist"),
    }
    std::env::set_var("LOWSYNC_VK_DEVICE", "0");
    let b = lowsync_vulkan::create("vulkan").expect("device 0");
    assert_eq!(b.name(), "vulkan");
    std::env::remove_var("LOWSYNC_VK_DEVICE");
}

/// A `0`/`1` switch whose default follows the device type: a bad value is an error naming it,
/// `1`/`0` set it, empty leaves it to the device. Leaves the variable unset.
fn device_default_switch(var: &'static str, get: fn(&lowsync_vulkan::VkConfig) -> Option<bool>) {
    std::env::set_var(var, "yes");
    assert!(matches!(
        lowsync_vulkan::create("vulkan"),
        Err(Error::Env { var: v, .. }) if v == var
    ));
    for (value, want) in [("1", Some(true)), ("0", Some(false)), ("", None)] {
        std::env::set_var(var, value);
        assert_eq!(
            get(&lowsync_vulkan::VkConfig::from_env().unwrap()),
            want,
            "{var}={value:?}"
        );
    }
    std::env::remove_var(var);
}
