//! The validation canary: a known hazard, recorded on purpose through a test-only path that
//! bypasses the hazard tracker, must be reported by synchronization validation. If this test
//! fails, a clean run of the other suites proves nothing.

mod common;

use lowsync_backend::{Backend, BufferUsage};

#[test]
fn validation_layer_reports_an_unsynchronized_write_after_write() {
    let Some(b) = common::open(common::config()) else {
        return;
    };
    let buf = b.alloc_buffer(64, BufferUsage::Compute).unwrap();
    common::assert_clean(&b);
    b.debug_record_unsynchronized_writes(buf).unwrap();
    let msgs = b.validation_messages();
    assert!(
        msgs.iter()
            .any(|m| m.contains("SYNC-HAZARD-WRITE-AFTER-WRITE")),
        "expected a SYNC-HAZARD-WRITE-AFTER-WRITE report, got: {msgs:#?}"
    );
}
