//! Whether this is still the process that made something, without a system call on the hot
//! path: a counter that every child of a `fork` bumps as it starts (`pthread_atfork`).
//!
//! Boundary: this module says whether a fork happened; [`crate::memory::forked_child`] says what
//! a forked child sees of shared memory.
//!
//! Invariants:
//! - In a process forked (through libc's `fork`, as Python's `os.fork` and multiprocessing
//!   do) after [`current`] was first called, [`current`] returns a value it never returned in
//!   the parent: a value saved by the parent and compared in the child differs.
//! - The handler only adds to an atomic: it is async-signal-safe, as a fork handler must be.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);
static HANDLER: Once = Once::new();

extern "C" fn in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// How many forks lie between this process and the one that first asked.
pub fn current() -> u64 {
    HANDLER.call_once(|| {
        // SAFETY: `in_child` is an `extern "C"` function with no arguments that lives for the
        // whole program and only touches an atomic; no prepare or parent handler is given.
        // If registering fails (out of memory), forks go uncounted and callers fall back on
        // the process id (see `Pool::check_owner`).
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    FORKS.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests;
