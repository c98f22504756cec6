//! SIGTERM/SIGINT as a request to stop cleanly: training saves and exits after the current
//! iteration (Megatron's `--exit-signal-handler`), so a preempted job keeps its progress; the
//! server finishes the requests in flight.

use std::sync::atomic::{AtomicBool, Ordering};

static EXIT_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn request_exit(_signal: libc::c_int) {
    EXIT_REQUESTED.store(true, Ordering::SeqCst);
}

/// Installs the handler for SIGTERM (and SIGINT, so Ctrl-C also saves).
pub fn install_exit_handler() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            request_exit as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            request_exit as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

pub fn exit_requested() -> bool {
    EXIT_REQUESTED.load(Ordering::SeqCst)
}
