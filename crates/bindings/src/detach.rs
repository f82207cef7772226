//! The one place the bindings release the GIL.
//!
//! Every call into Rust that may take time runs through [`run`]: the GIL is released, and an
//! interrupt hook polls Python's signal handlers (at most every 50 ms) from inside the backends'
//! waits and kernel loops. On Ctrl-C the backend drains its queue and returns `Interrupted`;
//! this helper then raises the `KeyboardInterrupt` Python produced, and the context stays
//! usable.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use lowsync_backend::interrupt;
use pyo3::prelude::*;

const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Runs `f` without the GIL, interruptible by Ctrl-C; `conv` maps its error to a Python one.
pub fn run<T: Send, E: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, E> + Send,
    conv: impl FnOnce(E) -> PyErr,
) -> PyResult<T> {
    let (result, pending) = py.detach(move || {
        let last = Cell::new(Instant::now());
        let pending: RefCell<Option<PyErr>> = RefCell::new(None);
        let hook = || {
            if pending.borrow().is_some() {
                return true;
            }
            if last.get().elapsed() < SIGNAL_POLL {
                return false;
            }
            last.set(Instant::now());
            match Python::attach(|py| py.check_signals()) {
                Ok(()) => false,
                Err(e) => {
                    *pending.borrow_mut() = Some(e);
                    true
                }
            }
        };
        let r = interrupt::with_hook(&hook, f);
        (r, pending.into_inner())
    });
    match (result, pending) {
        (Ok(v), None) => Ok(v),
        // The signal handler raised: that exception wins (usually KeyboardInterrupt).
        (_, Some(e)) => Err(e),
        (Err(e), None) => Err(conv(e)),
    }
}
