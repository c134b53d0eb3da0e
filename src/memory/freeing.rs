//! The freeing thread: where a pool's memory is given back, so that no caller ever waits for
//! it. The caller is often a Python thread holding the GIL (the last reference to a pool dies
//! in a Python object's deallocation); unregistering and unmapping a large arena there would
//! freeze every Python thread for as long as that takes (`docs/performance.md`).
//!
//! Boundary: the pool's `teardown` says what a dropped pool hands over and in what order; this
//! module runs it off the caller's thread, and keeps the arena it ends with.
//!
//! (Step 8 of "the life of a slot" in [`crate::pool`].)
//!
//! Memory comes back as fast as pools are made: the thread runs at idle priority, and with the
//! CPU busy it can fall behind a loop that makes and drops loaders; so a thread about to make
//! a pool first runs the jobs still queued itself ([`catch_up`], without the GIL), and the
//! arena a dropped pool ends with is kept a moment ([`shelve`], [`SHELVED_FOR`]) for the next
//! pool of its shape to take ([`take_shelved`]) instead of faulting in a new one.
//!
//! Invariants:
//! - One thread per process, named `pinpool-free`, started by the first job. Jobs are taken in
//!   the order they were queued, each exactly once, by that thread or by a thread about to
//!   make a pool ([`catch_up`]).
//! - [`submit`] never blocks on a job: it queues and returns. Only when no thread can be
//!   started at all (the process is out of resources) does the job run on the caller's thread:
//!   a stall is better than a leak.
//! - At most one arena is kept ([`shelve`]), for at most [`SHELVED_FOR`]: a second one frees
//!   the first, and [`flush`] (hence the exit hook) frees it.
//! - [`flush`] returns true once every job queued before the call has finished, no [`FlushBlocker`]
//!   lives (background work that may still drop the last reference to a pool, such as making an
//!   arena ready) and no arena is kept, or false when its timeout passes first.
//! - At process exit a C `atexit` hook waits (at most [`EXIT_WAIT`]) for the queue to drain.
//!   It is registered when the thread starts, after the CUDA driver was loaded, so it runs
//!   before the driver's own exit handlers: no arena is unregistered from a torn-down driver,
//!   and a clean exit leaves no memfd or registration behind.
//! - A forked child has no freeing thread (threads do not survive `fork`). The queue it
//!   inherits holds its parent's jobs, which name the parent's CUDA context and threads: the
//!   child forgets them (never runs them) and starts afresh with its own.
//! - A job never calls into Python and holds no lock of this module while it runs, so a job
//!   can neither deadlock against the interpreter nor delay [`submit`].

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::memory::arena::Arena;

/// Work handed to the freeing thread.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// The longest the exit hook waits for queued frees before letting the process go (the
/// kernel then takes back whatever is left).
pub const EXIT_WAIT: Duration = Duration::from_secs(10);

/// How many [`Freed`] records [`recent`] keeps.
const KEEP_RECORDS: usize = 64;

/// What one free did, for diagnostics and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct Freed {
    /// Bytes of memory given back.
    pub bytes: usize,
    /// The kernel thread id of the thread that dropped the last reference.
    pub dropped_on: u64,
    /// The kernel thread id of the thread that freed the memory.
    pub freed_on: u64,
    /// How long freeing took, in seconds.
    pub seconds: f64,
}

struct Queue {
    /// The process these jobs belong to (see the fork invariant).
    pid: u32,
    jobs: VecDeque<Job>,
    queued: u64,
    done: u64,
    /// Jobs taken and not finished.
    running: u64,
    started: bool,
    /// Live [`FlushBlocker`]s.
    blockers: usize,
    records: VecDeque<Freed>,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    pid: 0,
    jobs: VecDeque::new(),
    queued: 0,
    done: 0,
    running: 0,
    started: false,
    blockers: 0,
    records: VecDeque::new(),
});
/// Signalled when a job is queued (the thread waits on it) and when one finishes (flushers).
static CHANGED: Condvar = Condvar::new();

/// The queue, as seen by this process: a forked child's inherited queue is reset first.
fn queue() -> MutexGuard<'static, Queue> {
    let mut q = QUEUE.lock().unwrap_or_else(|e| e.into_inner());
    let me = std::process::id();
    if q.pid != me {
        // The parent's jobs must never run here; forgetting them leaks only this process's
        // copy of memory that the parent still owns and frees.
        std::mem::forget(std::mem::take(&mut q.jobs));
        q.pid = me;
        q.queued = 0;
        q.done = 0;
        q.running = 0;
        q.started = false;
        q.blockers = 0;
    }
    q
}

/// Queues `job` for the freeing thread.
pub fn submit(job: Job) {
    let mut q = queue();
    if !q.started {
        let spawned = std::thread::Builder::new().name("pinpool-free".into()).spawn(run);
        if spawned.is_err() {
            drop(q);
            job();
            return;
        }
        q.started = true;
        register_exit_hook();
    }
    q.jobs.push_back(job);
    q.queued += 1;
    drop(q);
    CHANGED.notify_all();
}

/// Held by background work that may drop the last reference to a pool (and so queue its
/// freeing): [`flush`] waits for it to end.
#[derive(Debug)]
pub struct FlushBlocker(());

/// Keeps [`flush`] waiting until the value is dropped.
pub fn block_flush() -> FlushBlocker {
    queue().blockers += 1;
    FlushBlocker(())
}

impl Drop for FlushBlocker {
    fn drop(&mut self) {
        let mut q = queue();
        q.blockers = q.blockers.saturating_sub(1);
        drop(q);
        CHANGED.notify_all();
    }
}

/// Frees the arena kept, if any, and waits until no [`FlushBlocker`] lives and every job queued by
/// then (that free among them, on the freeing thread) has run, at most `timeout` (forever if
/// `None`). Returns whether that happened.
pub fn flush(timeout: Option<Duration>) -> bool {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        if shelf().kept.is_some() {
            // Freed on the freeing thread too, never on the caller's.
            submit(Box::new(evict_shelved));
        }
        let mut q = queue();
        while q.blockers > 0 || q.done < q.queued {
            q = match deadline {
                None => CHANGED.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    CHANGED.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
        drop(q);
        // (A job that ran meanwhile may have kept its pool's arena.)
        if shelf().kept.is_none() {
            return true;
        }
    }
}

/// Jobs queued but not yet finished.
pub fn pending() -> u64 {
    let q = queue();
    q.queued - q.done
}

/// Runs the jobs still queued on the calling thread (a thread about to make a pool, without
/// the GIL: the memory of the pools dropped before comes back before the new one is taken),
/// and waits, at most `wait`, for any the freeing thread is running. Returns whether none is
/// left.
pub fn catch_up(wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    let mut q = queue();
    loop {
        if let Some(job) = q.jobs.pop_front() {
            q.running += 1;
            drop(q);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            q = queue();
            q.running -= 1;
            q.done += 1;
            CHANGED.notify_all();
            continue;
        }
        if q.running == 0 {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        q = CHANGED.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// How long an arena is kept for the next pool of its shape (see the module's doc).
pub const SHELVED_FOR: Duration = Duration::from_secs(2);

/// The arena kept, when it was kept, and what its free is recorded as.
struct Shelf {
    pid: u32,
    kept: Option<(Arena, Instant, Freed)>,
}

static SHELF: Mutex<Shelf> = Mutex::new(Shelf { pid: 0, kept: None });

fn shelf() -> MutexGuard<'static, Shelf> {
    let mut s = SHELF.lock().unwrap_or_else(|e| e.into_inner());
    let me = std::process::id();
    if s.pid != me {
        // A forked child's copy of its parent's arena: the parent's to free.
        std::mem::forget(s.kept.take());
        s.pid = me;
    }
    s
}

/// Keeps `arena` (whole, with no slot out or fenced) for the next pool of its shape; frees
/// the one kept before, if any. `freed` is recorded when it is freed.
pub fn shelve(arena: Arena, freed: Freed) {
    let old = shelf().kept.replace((arena, Instant::now(), freed));
    CHANGED.notify_all(); // (the freeing thread times the kept arena out)
    if let Some((old, _, record_of)) = old {
        free_kept(old, record_of);
    }
}

/// The arena kept, if `fits` it: the caller makes its pool over it.
pub fn take_shelved(fits: impl Fn(&Arena) -> bool) -> Option<Arena> {
    let mut s = shelf();
    if s.kept.as_ref().is_some_and(|(arena, _, _)| fits(arena)) {
        return s.kept.take().map(|(arena, _, _)| arena);
    }
    None
}

/// Frees the arena kept, if `now(kept_since)` says so.
fn evict(now: impl Fn(Instant) -> bool) {
    let kept = {
        let mut s = shelf();
        match &s.kept {
            Some((_, since, _)) if now(*since) => s.kept.take(),
            _ => None,
        }
    };
    if let Some((arena, _, freed)) = kept {
        free_kept(arena, freed);
    }
}

/// Frees the arena kept (without the shelf's lock: unmapping it takes a while).
pub fn evict_shelved() {
    evict(|_| true);
}

fn free_kept(arena: Arena, mut freed: Freed) {
    let start = Instant::now();
    drop(arena);
    freed.freed_on = crate::system::priority::thread_id();
    freed.seconds += start.elapsed().as_secs_f64();
    record(freed);
}

/// How long until the arena kept times out (None: none is kept).
fn shelf_expires_in() -> Option<Duration> {
    shelf().kept.as_ref().map(|(_, since, _)| SHELVED_FOR.saturating_sub(since.elapsed()))
}

/// Notes what a job freed (kept for [`recent`]).
pub fn record(freed: Freed) {
    let mut q = queue();
    if q.records.len() == KEEP_RECORDS {
        q.records.pop_front();
    }
    q.records.push_back(freed);
}

/// The most recent frees, oldest first.
pub fn recent() -> Vec<Freed> {
    queue().records.iter().cloned().collect()
}

/// The freeing thread's loop: take a job, run it without the lock, count it done; free the
/// arena kept once it has been kept [`SHELVED_FOR`].
fn run() {
    crate::system::priority::become_background();
    loop {
        let job = {
            let mut q = queue();
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    q.running += 1;
                    break Some(job);
                }
                match shelf_expires_in() {
                    None => q = CHANGED.wait(q).unwrap_or_else(|e| e.into_inner()),
                    Some(left) if left.is_zero() => break None,
                    Some(left) => {
                        q = CHANGED.wait_timeout(q, left).unwrap_or_else(|e| e.into_inner()).0;
                    }
                }
            }
        };
        let Some(job) = job else {
            evict(|since| since.elapsed() >= SHELVED_FOR);
            continue;
        };
        // A panicking job must not take the thread (and every later free) with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        let mut q = queue();
        q.running -= 1;
        q.done += 1;
        drop(q);
        CHANGED.notify_all();
    }
}

extern "C" fn drain_at_exit() {
    flush(Some(EXIT_WAIT));
}

fn register_exit_hook() {
    // SAFETY: `drain_at_exit` is a plain `extern "C" fn()` with no preconditions; atexit only
    // stores the pointer. Failure (the table is full) just means no drain at exit.
    unsafe { libc::atexit(drain_at_exit) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::system::priority::thread_id;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn jobs_run_in_order_on_the_freeing_thread() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let me = thread_id();
        for i in 0..5 {
            let seen = Arc::clone(&seen);
            submit(Box::new(move || {
                let name = std::thread::current().name().map(str::to_owned);
                seen.lock().unwrap().push((i, thread_id(), name));
            }));
        }
        assert!(flush(Some(Duration::from_secs(30))));
        let seen = seen.lock().unwrap();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        for (_, tid, name) in seen.iter() {
            assert_ne!(*tid, me, "a job ran on the submitting thread");
            assert_eq!(name.as_deref(), Some("pinpool-free"));
        }
    }

    #[test]
    fn submit_does_not_wait_for_a_slow_job_and_flush_does() {
        let done = Arc::new(AtomicU64::new(0));
        let d = Arc::clone(&done);
        let (open, gate) = std::sync::mpsc::channel::<()>();
        submit(Box::new(move || {
            // The job runs until the test opens the gate (or for 30 s at most).
            let _ = gate.recv_timeout(Duration::from_secs(30));
            d.store(1, Ordering::SeqCst);
        }));
        assert_eq!(done.load(Ordering::SeqCst), 0, "submit waited for the job");
        assert!(!flush(Some(Duration::from_millis(1))), "flush did not wait for the job");
        open.send(()).unwrap();
        assert!(flush(None));
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn flush_waits_for_every_blocker() {
        let h = block_flush();
        assert!(!flush(Some(Duration::from_millis(20))), "flushed past a blocker");
        drop(h);
        assert!(flush(Some(Duration::from_secs(30))));
    }

    #[test]
    fn a_panicking_job_does_not_stop_later_ones() {
        submit(Box::new(|| panic!("a job that fails")));
        let ran = Arc::new(AtomicU64::new(0));
        let r = Arc::clone(&ran);
        submit(Box::new(move || {
            r.store(1, Ordering::SeqCst);
        }));
        assert!(flush(Some(Duration::from_secs(30))));
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
