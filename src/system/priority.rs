//! Priorities of pinpool's own threads, and which threads are background work.
//!
//! A training process has one thread that matters most: the one that launches GPU work. When
//! pinpool's background threads (faulting the rest of an arena in, unmapping, freeing) and the
//! DataLoader's workers want more cores than the machine has, that thread must still get a
//! core the moment it wakes up. So work that nobody waits for runs at a lower priority (a
//! higher nice value): it takes the cores that are idle and gives way to the others.
//!
//! Copy threads stay at normal priority: a batch waits for its copy, and a lower priority for
//! them cost throughput without making the main thread's worst wake-up any better (the
//! figures: "Copy threads at normal priority" in `docs/performance.md`).
//!
//! Invariants:
//! - Only the calling thread's own priority changes, and only downwards, which needs no
//!   privilege; a failure is ignored (the thread then runs at its normal priority).
//! - Threads a lowered thread starts inherit its priority (Linux: nice is per thread and
//!   copied at `clone`), so helpers spawned by background work run at its priority too; the
//!   background mark ([`is_background`]) is per thread, set by each one for itself.

/// Work nobody waits for: making the rest of an arena ready, unmapping, freeing.
pub const IDLE_NICE: i32 = 10;

thread_local! {
    /// Set on a thread that called [`become_background`].
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the calling thread one of pinpool's background threads: a lower priority, and
/// [`is_background`] true (long work there may pause to let other threads go first).
pub fn become_background() {
    lower_priority(IDLE_NICE);
    BACKGROUND.with(|b| b.set(true));
}

/// Whether the calling thread is one of pinpool's background threads, which no caller
/// waits for (see [`become_background`]).
pub fn is_background() -> bool {
    BACKGROUND.with(|b| b.get())
}

/// The calling thread's kernel thread id.
pub fn thread_id() -> u64 {
    rustix::thread::gettid().as_raw_pid() as u64
}

/// Lowers the calling thread's priority to `nice` (never raises it).
pub fn lower_priority(nice: i32) {
    // PRIO_PROCESS with a thread id reads and sets that one thread's nice value (Linux).
    let me = Some(rustix::thread::gettid());
    if rustix::process::getpriority_process(me).is_ok_and(|current| current < nice) {
        let _ = rustix::process::setpriority_process(me, nice);
    }
}

/// The calling thread's nice value (0 if it cannot be read).
pub fn current_nice() -> i32 {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap_or(0)
}

#[cfg(test)]
mod tests;
