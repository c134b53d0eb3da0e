//! A hand-off: a job one thread hands to another and waits for, taking it back if the other
//! has not begun it in time.
//!
//! The PyO3 layer lends it to Python for the main thread's worker shutdowns: run on another
//! thread, where no signal's Python handler runs to cut them short, they are waited for
//! without the GIL and without waking for signals (`threading.Event.wait` runs a handler
//! inside the wait, and its exception ends the wait). A handler whose signal came meanwhile
//! runs once the wait has returned.
//!
//! Invariants: a hand-off goes from waiting to taken once, by whichever comes first of the
//! runner's [`Handoff::take`] and the waiter's taking back, and so is run by one of them at
//! most; it is done only once the one that took it says so ([`Handoff::finish`]); a wait ends
//! when it is done (every waiter is woken), or, for a waiter that may take it back, once the
//! time it gave has passed with nobody having taken it, which it then has. A spurious wake-up
//! ends no wait.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Where a hand-off stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    /// Handed over; nobody has begun it.
    #[default]
    Waiting,
    /// Begun, by the runner or by the waiter that took it back.
    Taken,
    /// Finished.
    Done,
}

/// A job handed from one thread to another, with its waiters.
#[derive(Debug, Default)]
pub struct Handoff {
    stage: Mutex<Stage>,
    changed: Condvar,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// The job is done.
    Done,
    /// Nobody had begun it in time: the waiter has taken it back, to run it itself.
    TakenBack,
}

impl Handoff {
    /// A hand-off that nobody has begun.
    pub fn new() -> Self {
        Self::default()
    }

    /// For the runner: whether it is the one to run the job (nobody had taken it).
    pub fn take(&self) -> bool {
        let mut stage = self.lock();
        if *stage == Stage::Waiting {
            *stage = Stage::Taken;
            true
        } else {
            false
        }
    }

    /// The job is done; every waiter is woken. (Also from an untaken hand-off: nothing is left
    /// to run.)
    pub fn finish(&self) {
        *self.lock() = Stage::Done;
        self.changed.notify_all();
    }

    /// Where the hand-off stands.
    pub fn stage(&self) -> Stage {
        *self.lock()
    }

    /// Waits until the job is done. With `take_back_after`, a job nobody has begun by then is
    /// taken back ([`Waited::TakenBack`]: the caller runs it); a time too large for a deadline
    /// is no limit.
    pub fn wait(&self, take_back_after: Option<Duration>) -> Waited {
        let deadline = take_back_after.and_then(|t| Instant::now().checked_add(t));
        let mut stage = self.lock();
        loop {
            match (*stage, deadline) {
                (Stage::Done, _) => return Waited::Done,
                (Stage::Waiting, Some(deadline)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        *stage = Stage::Taken;
                        return Waited::TakenBack;
                    }
                    stage = self
                        .changed
                        .wait_timeout(stage, deadline - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                _ => stage = self.changed.wait(stage).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }

    // A panic while the lock is held cannot leave the stage half-written: the poison is
    // ignored.
    fn lock(&self) -> MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    const LONG: Duration = Duration::from_secs(60);

    fn spawn_waiter(h: &Arc<Handoff>, after: Option<Duration>) -> thread::JoinHandle<Waited> {
        let h = Arc::clone(h);
        thread::spawn(move || h.wait(after))
    }

    #[test]
    fn the_runner_takes_it_once_and_its_finish_wakes_every_waiter() {
        let h = Arc::new(Handoff::new());
        let waiters: Vec<_> =
            [None, Some(LONG), None, Some(LONG)].into_iter().map(|t| spawn_waiter(&h, t)).collect();
        thread::sleep(Duration::from_millis(20));
        assert!(h.take());
        assert!(!h.take());
        thread::sleep(Duration::from_millis(20));
        assert!(waiters.iter().all(|w| !w.is_finished()));
        h.finish();
        for w in waiters {
            assert_eq!(w.join().unwrap(), Waited::Done);
        }
        assert_eq!(h.stage(), Stage::Done);
        assert!(!h.take());
    }

    #[test]
    fn a_job_nobody_began_in_time_is_taken_back_and_the_runner_then_skips_it() {
        let h = Handoff::new();
        let t0 = Instant::now();
        assert_eq!(h.wait(Some(Duration::from_millis(30))), Waited::TakenBack);
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert_eq!(h.stage(), Stage::Taken);
        assert!(!h.take());
        h.finish(); // (by the waiter, once it has run the job itself)
        assert_eq!(h.wait(Some(Duration::ZERO)), Waited::Done);
    }

    #[test]
    fn a_job_begun_in_time_is_waited_for_past_the_time() {
        let h = Arc::new(Handoff::new());
        assert!(h.take());
        let waiter = spawn_waiter(&h, Some(Duration::from_millis(10)));
        thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished());
        h.finish();
        assert_eq!(waiter.join().unwrap(), Waited::Done);
    }

    #[test]
    fn a_time_too_large_for_a_deadline_is_no_limit() {
        let h = Arc::new(Handoff::new());
        let waiter = spawn_waiter(&h, Some(Duration::MAX));
        thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished());
        assert_eq!(h.stage(), Stage::Waiting);
        h.finish();
        assert_eq!(waiter.join().unwrap(), Waited::Done);
    }
}
