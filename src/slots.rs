//! The slot table: the state of every slot and the free list.
//!
//! (See "the life of a slot" in [`crate::pool`] for where each transition is made.)
//!
//! Invariants:
//! - Every slot is in exactly one state: `Preparing`, `Free`, `CheckedOut` or `Fenced`, held
//!   in one atomic word together with the slot's generation.
//! - `Preparing` is where a slot starts when its memory is still being faulted in and pinned
//!   in the background ([`SlotTable::with_ready`]); it leaves that state once, to `Free`,
//!   through [`SlotTable::admit`], and never returns to it.
//! - A slot's index is in the free queue exactly when the slot is `Free`; the queue has room
//!   for every slot, so a push never fails.
//! - A checkout moves `Free -> CheckedOut` and bumps the generation; the [`Ticket`] it returns
//!   (table id + index + generation) names that one checkout; another table refuses it. Every later transition compares the whole
//!   word, so a second release, or a release through a stale ticket, is refused with
//!   [`Error::SlotReleased`] and can never put an index in the free queue twice.
//! - `Fenced -> Free` happens only through [`SlotTable::complete_fence`], which the pool calls
//!   once the slot's fence has completed; `Fenced -> CheckedOut` only through
//!   [`SlotTable::unfence`], when a fence recorded at release time could not be recorded.
//! - Waiting never misses a wake-up: a pusher that sees a waiter notifies under the lock the
//!   waiter holds while it re-checks the queue, and every wait is bounded by a timeout anyway.

use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use crate::error::{Error, Result};

/// Names one checkout of one slot of one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The table (pool) that issued it: a ticket is refused by every other table.
    pub table: u32,
    /// The slot's position in the arena.
    pub index: u32,
    /// Which checkout of that slot this is.
    pub generation: u32,
}

/// A slot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Its memory is not ready yet: not in the free list, never handed out.
    Preparing,
    /// In the free list, ready to be checked out.
    Free,
    /// Held by a user.
    CheckedOut,
    /// Released, but GPU work recorded on its fence may still read it.
    Fenced,
}

const FREE: u64 = 0;
const OUT: u64 = 1;
const FENCED: u64 = 2;
const PREPARING: u64 = 3;

fn word(generation: u32, state: u64) -> u64 {
    (u64::from(generation) << 2) | state
}

fn split(w: u64) -> (u32, State) {
    let state = match w & 3 {
        FREE => State::Free,
        OUT => State::CheckedOut,
        FENCED => State::Fenced,
        _ => State::Preparing,
    };
    ((w >> 2) as u32, state)
}

/// How many slots are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Ready to hand out.
    pub free: usize,
    /// Held by users.
    pub checked_out: usize,
    /// Waiting for their fence.
    pub fenced: usize,
    /// Not ready yet (their memory is still being prepared).
    pub preparing: usize,
}

static NEXT_TABLE_ID: AtomicU32 = AtomicU32::new(1);

/// The states of `n` slots and their free list.
pub struct SlotTable {
    id: u32,
    words: Box<[AtomicU64]>,
    free: ArrayQueue<u32>,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    closed: AtomicBool,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable").field("counts", &self.counts()).finish()
    }
}

impl SlotTable {
    /// `n` free slots (n > 0).
    pub fn new(n: usize) -> Result<Self> {
        Self::with_ready(n, n)
    }

    /// `n` slots (n > 0), of which the first `ready` are free and the rest `Preparing` until
    /// [`SlotTable::admit`]ted.
    pub fn with_ready(n: usize, ready: usize) -> Result<Self> {
        Self::check_len(n)?;
        let ready = ready.min(n);
        let free = ArrayQueue::new(n);
        for i in 0..ready {
            // Cannot fail: the queue has room for n entries.
            let _ = free.push(i as u32);
        }
        Ok(SlotTable {
            id: NEXT_TABLE_ID.fetch_add(1, Ordering::Relaxed),
            words: (0..n)
                .map(|i| AtomicU64::new(word(0, if i < ready { FREE } else { PREPARING })))
                .collect(),
            free,
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            closed: AtomicBool::new(false),
        })
    }

    /// Fails unless a table can have `n` slots.
    pub fn check_len(n: usize) -> Result<()> {
        if n == 0 || n > u32::MAX as usize {
            return Err(Error::Invalid(format!("num_slots must be in 1..=2^32-1, got {n}")));
        }
        Ok(())
    }

    /// Makes a `Preparing` slot free (its memory is ready). Returns false, changing nothing,
    /// if the slot does not exist or is not `Preparing`.
    pub fn admit(&self, index: usize) -> bool {
        let Some(cell) = self.words.get(index) else { return false };
        let admitted = cell
            .compare_exchange(
                word(0, PREPARING),
                word(0, FREE),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if admitted {
            self.push_free(index as u32);
        }
        admitted
    }

    /// How many slots are in the free queue (a snapshot; O(1)).
    pub fn free_len(&self) -> usize {
        self.free.len()
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// This table's id, carried by every ticket it issues.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Always false: a table has at least one slot.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Takes a free slot, if there is one. Never blocks.
    pub fn try_checkout(&self) -> Option<Ticket> {
        loop {
            let index = self.free.pop()?;
            let cell = &self.words[index as usize];
            let current = cell.load(Ordering::Acquire);
            let (generation, state) = split(current);
            if state != State::Free {
                // Unreachable while the invariants hold; skip rather than hand it out.
                debug_assert!(false, "slot {index} in the free list while {state:?}");
                continue;
            }
            let next = generation.wrapping_add(1);
            if cell
                .compare_exchange(current, word(next, OUT), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(Ticket { table: self.id, index, generation: next });
            }
        }
    }

    /// The current state and generation of slot `index`.
    pub fn state(&self, index: usize) -> Option<(State, u32)> {
        self.words.get(index).map(|w| {
            let (g, s) = split(w.load(Ordering::Acquire));
            (s, g)
        })
    }

    /// Whether `ticket` names the slot's current, unreleased checkout.
    pub fn is_live(&self, ticket: Ticket) -> bool {
        ticket.table == self.id
            && self.state(ticket.index as usize) == Some((State::CheckedOut, ticket.generation))
    }

    /// Ends the checkout `ticket`. With `fenced`, the slot waits in `Fenced` until
    /// [`SlotTable::complete_fence`]; otherwise it is free at once.
    pub fn release(&self, ticket: Ticket, fenced: bool) -> Result<()> {
        let cell = self.cell(ticket)?;
        let target = if fenced { FENCED } else { FREE };
        cell.compare_exchange(
            word(ticket.generation, OUT),
            word(ticket.generation, target),
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .map_err(|_| Error::SlotReleased { index: ticket.index as usize })?;
        if !fenced {
            self.push_free(ticket.index);
        }
        Ok(())
    }

    /// Frees a fenced slot once its fence has completed. Returns false if `ticket` is not
    /// the slot's current fenced checkout (already completed, or stale).
    pub fn complete_fence(&self, ticket: Ticket) -> bool {
        let Ok(cell) = self.cell(ticket) else { return false };
        let done = cell
            .compare_exchange(
                word(ticket.generation, FENCED),
                word(ticket.generation, FREE),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if done {
            self.push_free(ticket.index);
        }
        done
    }

    /// Undoes a fenced [`SlotTable::release`] whose fence could not be recorded: the slot is
    /// checked out again under the same ticket.
    pub fn unfence(&self, ticket: Ticket) {
        if let Ok(cell) = self.cell(ticket) {
            let _ = cell.compare_exchange(
                word(ticket.generation, FENCED),
                word(ticket.generation, OUT),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    fn cell(&self, ticket: Ticket) -> Result<&AtomicU64> {
        self.words
            .get(ticket.index as usize)
            .filter(|_| ticket.table == self.id)
            .ok_or(Error::SlotReleased { index: ticket.index as usize })
    }

    fn push_free(&self, index: u32) {
        // Cannot fail: an index is pushed only on a transition into Free (see invariants).
        let _ = self.free.push(index);
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::Relaxed) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_one();
        }
    }

    /// Sleeps until a slot may have become free, the table is closed, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.waiters.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.free.is_empty() && !self.is_closed() {
            let _ = self.wake.wait_timeout(guard, timeout);
        }
        self.waiters.fetch_sub(1, Ordering::Relaxed);
    }

    /// Wakes every waiter; afterwards [`SlotTable::is_closed`] is true.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }

    /// Whether [`SlotTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// How many slots are in each state (a snapshot; exact when nothing moves).
    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for w in self.words.iter() {
            match split(w.load(Ordering::Acquire)).1 {
                State::Free => c.free += 1,
                State::CheckedOut => c.checked_out += 1,
                State::Fenced => c.fenced += 1,
                State::Preparing => c.preparing += 1,
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preparing_slots_are_handed_out_only_once_admitted() {
        let t = SlotTable::with_ready(3, 1).unwrap();
        assert_eq!(t.counts(), Counts { free: 1, checked_out: 0, fenced: 0, preparing: 2 });
        let a = t.try_checkout().unwrap();
        assert_eq!(a.index, 0);
        assert!(t.try_checkout().is_none(), "a preparing slot was handed out");
        assert!(t.admit(2));
        assert!(!t.admit(2), "admitted twice");
        assert!(!t.admit(0), "a checked-out slot was admitted");
        assert!(!t.admit(7), "a slot that does not exist was admitted");
        assert_eq!(t.try_checkout().unwrap().index, 2);
        assert!(t.try_checkout().is_none());
        assert!(t.admit(1));
        assert_eq!(t.try_checkout().unwrap().index, 1);
        assert_eq!(t.counts(), Counts { free: 0, checked_out: 3, fenced: 0, preparing: 0 });
    }

    #[test]
    fn checkout_release_cycle() {
        let t = SlotTable::new(2).unwrap();
        let a = t.try_checkout().unwrap();
        let b = t.try_checkout().unwrap();
        assert_ne!(a.index, b.index);
        assert!(t.try_checkout().is_none());
        t.release(a, false).unwrap();
        assert_eq!(t.release(a, false), Err(Error::SlotReleased { index: a.index as usize }));
        let c = t.try_checkout().unwrap();
        assert_eq!(c.index, a.index);
        assert_ne!(c.generation, a.generation);
        // The stale ticket cannot release the new checkout.
        assert!(t.release(a, false).is_err());
        assert!(t.is_live(c));
        assert_eq!(t.counts(), Counts { free: 0, checked_out: 2, fenced: 0, preparing: 0 });
    }

    #[test]
    fn fenced_slots_are_not_handed_out() {
        let t = SlotTable::new(1).unwrap();
        let a = t.try_checkout().unwrap();
        t.release(a, true).unwrap();
        assert!(t.try_checkout().is_none());
        assert_eq!(t.counts().fenced, 1);
        assert!(t.release(a, true).is_err(), "second release of a fenced slot");
        assert!(t.complete_fence(a));
        assert!(!t.complete_fence(a), "a fence completes once");
        assert!(t.try_checkout().is_some());
    }

    #[test]
    fn bad_index_is_refused() {
        let t = SlotTable::new(1).unwrap();
        let bogus = Ticket { table: t.id(), index: 9, generation: 1 };
        assert!(t.release(bogus, false).is_err());
        assert!(!t.complete_fence(bogus));
        let other = SlotTable::new(1).unwrap();
        let foreign = other.try_checkout().unwrap();
        assert!(t.release(foreign, false).is_err(), "a ticket of another table is refused");
        assert!(!t.is_live(foreign));
        assert!(other.is_live(foreign));
        assert!(SlotTable::new(0).is_err());
    }
}
