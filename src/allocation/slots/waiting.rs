//! Waiting for room: an epoch that changes whenever bytes or an entry become free, a wait
//! that sleeps only while it has not, and closing the table, which wakes every waiter.
//!
//! Invariant: no wake-up is missed. Every change that frees something bumps the epoch under
//! the table's lock ([`SlotTable::freed`]), and [`SlotTable::wait`] re-checks the epoch its
//! caller saw under that lock before it sleeps; every wait is bounded by a timeout anyway.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Inner, SlotTable};

impl SlotTable {
    /// Something became free: a new epoch, and waiters woken (under the lock they re-check
    /// the epoch under).
    pub(super) fn freed(&self, _inner: &Inner) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.wake.notify_all();
        }
    }

    /// A number that changes whenever bytes or an entry become free: read it before a try,
    /// and pass it to [`SlotTable::wait`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Sleeps until something was freed since `seen` (an [`SlotTable::epoch`]), the table is
    /// closed, or `timeout` passes.
    pub fn wait(&self, seen: u64, timeout: Duration) {
        let mut guard = self.lock();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        if self.epoch.load(Ordering::SeqCst) == seen && !self.is_closed() {
            let _ = self.wake.wait_for(&mut guard, timeout);
        }
        drop(guard);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes every waiter; afterwards [`SlotTable::is_closed`] is true.
    pub fn close(&self) {
        let inner = self.lock();
        self.closed.store(true, Ordering::SeqCst);
        self.freed(&inner);
    }

    /// Whether [`SlotTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}
