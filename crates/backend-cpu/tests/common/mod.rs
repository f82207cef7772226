//! Deadlines for the tests' waits, so that a broken ordering or counting primitive fails a
//! test instead of hanging it: `wait_until` polls a condition for at most [`DEADLINE`], and
//! [`Watched`] is a test gate that a watchdog opens after [`DEADLINE`] (releasing whatever
//! blocked behind it) and then reports as a failure; [`blocks_until_opened`] runs a step that
//! must wait behind a gate and tells whether it did.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lowsync_backend::{Backend, Gate};

/// The longest a test waits for something that must happen (far above any correct run).
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Returns once `cond` holds; panics naming `what` when it did not within [`DEADLINE`].
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: not reached within {DEADLINE:?}"
        );
        std::thread::yield_now();
    }
}

/// How long [`blocks_until_opened`] keeps the gate closed once the step is in its wait. A
/// correct step passes whatever this is (it cannot return before the gate opens); it only
/// gives a wait that returns without waiting the time to show it.
pub const HOLD: Duration = Duration::from_millis(20);

/// Runs `step`, which must block on a host wait of `b` (counted when the wait starts) behind
/// the closed `gate`; a helper thread opens the gate [`HOLD`] after `b` counted that wait, or
/// once `step` returned without it. Returns whether `step` blocked: false when it returned
/// while the gate was still closed (a wait that did not happen or did not wait).
pub fn blocks_until_opened(b: &Arc<dyn Backend>, gate: &Watched, step: impl FnOnce()) -> bool {
    let waits0 = b.stats().snapshot().host_waits;
    let returned = Arc::new(AtomicBool::new(false));
    let opener = {
        let (b, gate, returned) = (b.clone(), gate.gate(), returned.clone());
        std::thread::spawn(move || {
            wait_until("a host wait behind the gate, or the step's return", || {
                b.stats().snapshot().host_waits > waits0 || returned.load(Ordering::Acquire)
            });
            if !returned.load(Ordering::Acquire) {
                std::thread::sleep(HOLD);
            }
            let blocked = !returned.load(Ordering::Acquire);
            gate.open();
            blocked
        })
    };
    step();
    returned.store(true, Ordering::Release);
    opener.join().expect("the opener thread")
}

/// A closed test gate with a watchdog: if the test has not opened it within [`DEADLINE`] (the
/// test thread blocked on work behind it, which must never happen), the watchdog opens it so
/// the test goes on, and [`Watched::open`] then fails the test.
pub struct Watched {
    gate: Arc<dyn Gate>,
    stop: Option<Sender<()>>,
    watchdog: Option<JoinHandle<bool>>,
}

impl Watched {
    /// Closes a gate on `b`'s stream.
    pub fn close(b: &dyn Backend) -> Watched {
        let gate = b.gate_close().expect("the backend has a test gate");
        let (stop, rx) = channel::<()>();
        let g = gate.clone();
        let watchdog = std::thread::spawn(move || match rx.recv_timeout(DEADLINE) {
            Err(RecvTimeoutError::Timeout) => {
                g.open();
                true
            }
            _ => false,
        });
        Watched {
            gate,
            stop: Some(stop),
            watchdog: Some(watchdog),
        }
    }

    /// The gate itself, for a helper thread that opens it.
    pub fn gate(&self) -> Arc<dyn Gate> {
        self.gate.clone()
    }

    /// Opens the gate; panics if the watchdog had to open it first.
    pub fn open(mut self) {
        let forced = self.finish();
        assert!(
            !forced,
            "the gate was still closed after {DEADLINE:?}, so the test blocked on work queued \
             behind it; the watchdog opened it"
        );
    }

    fn finish(&mut self) -> bool {
        self.gate.open();
        drop(self.stop.take());
        self.watchdog
            .take()
            .is_some_and(|w| w.join().expect("the watchdog never panics"))
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // A test that failed before opening the gate: release the stream, report nothing more.
        self.finish();
    }
}
