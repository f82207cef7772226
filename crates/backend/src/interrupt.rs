//! Interrupt hook: how a blocking wait learns that the user pressed Ctrl-C.
//!
//! Why: a host wait inside a backend can last seconds; the Python bindings must be able to stop
//! it, drain the queued work and leave the backend usable. Backends know nothing of Python, so
//! the bindings install a per-thread hook and long waits poll it between bounded sleeps.
//!
//! Invariant: the hook is consulted only on the thread that installed it, and only while the
//! closure given to [`with_hook`] runs.

use std::cell::Cell;
use std::time::Duration;

/// How long a blocking wait sleeps between polls of the hook.
pub const POLL_INTERVAL: Duration = Duration::from_millis(25);

thread_local! {
    static HOOK: Cell<Option<*const (dyn Fn() -> bool + 'static)>> = const { Cell::new(None) };
}

/// Runs `f` with `hook` installed on this thread; `hook()` returns true to interrupt.
pub fn with_hook<R>(hook: &dyn Fn() -> bool, f: impl FnOnce() -> R) -> R {
    // SAFETY: the pointer is only dereferenced by `requested` on this thread while `f` runs,
    // and it is removed (by the guard) before `hook` goes out of scope.
    let raw: *const (dyn Fn() -> bool + '_) = hook;
    let raw: *const (dyn Fn() -> bool + 'static) = unsafe { std::mem::transmute(raw) };
    struct Restore(Option<*const (dyn Fn() -> bool + 'static)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            HOOK.with(|h| h.set(self.0));
        }
    }
    let _restore = Restore(HOOK.with(|h| h.replace(Some(raw))));
    f()
}

/// Whether the installed hook (if any) asks to interrupt.
pub fn requested() -> bool {
    HOOK.with(|h| match h.get() {
        // SAFETY: see `with_hook`.
        Some(p) => unsafe { (*p)() },
        None => false,
    })
}
