//! What `pool.stats()` reports: [`Stats`], a snapshot of the slots, the arena's bytes and
//! the counters, and [`Counters`], which outlive the pool.
//!
//! (Segments are counted where they are mapped: [`crate::transport::reclaim`]. The Python
//! binding reports both in one dict.)
//!
//! Invariants:
//! - Each count only grows, by a relaxed atomic add on the path it counts: a snapshot is not
//!   one instant's state, but no count in it ever goes back.
//! - Once the pool is gone, [`Counters::final_stats`] reports every slot free and nothing
//!   pending, with the counts as the pool left them; the fence errors are written by the
//!   freeing thread before it frees the arena.
//! - Slots and bytes that will never be ready are not reported as preparing: where the
//!   background preparation failed they are left out (never usable), and in a closed pool
//!   (closing stops the preparation) they count as free, as every slot of a pool that is gone
//!   does ([`Counters::final_stats`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Pool;
use crate::allocation::slots::{Bytes, Counts};
use crate::transfer::fence::FenceTracker;

/// Counters reported by `pool.stats()`. Shared ([`Pool::counters`]) so that the last figures
/// can still be read once the pool itself is gone.
#[derive(Debug, Default)]
pub struct Counters {
    pub(super) checkouts: AtomicU64,
    pub(super) waits: AtomicU64,
    pub(super) wait_ns: AtomicU64,
    pub(super) releases: AtomicU64,
    pub(super) bytes_copied: AtomicU64,
    pub(super) copies: AtomicU64,
    /// Written when the pool drops (the live value comes from the fences).
    pub(super) final_fence_errors: AtomicU64,
    pub(super) num_slots: AtomicU64,
    pub(super) arena_bytes: AtomicU64,
}

impl Counters {
    /// The stats of a pool that no longer exists: every slot is free, nothing is pending.
    pub fn final_stats(&self) -> Stats {
        let n = self.num_slots.load(Ordering::Relaxed) as usize;
        Stats {
            slots: Counts { free: n, checked_out: 0, fenced: 0, preparing: 0 },
            checkouts: self.checkouts.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            wait_ns: self.wait_ns.load(Ordering::Relaxed),
            releases: self.releases.load(Ordering::Relaxed),
            bytes_copied: self.bytes_copied.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            fence_errors: self.final_fence_errors.load(Ordering::Relaxed),
            bytes: {
                let arena = self.arena_bytes.load(Ordering::Relaxed) as usize;
                Bytes { arena, free: arena, largest_free: 0, holes: 0, ..Bytes::default() }
            },
        }
    }
}

/// A snapshot of the pool's state and counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Slots by state.
    pub slots: Counts,
    /// Successful checkouts.
    pub checkouts: u64,
    /// Checkouts that had to wait.
    pub waits: u64,
    /// Total time spent waiting, in nanoseconds.
    pub wait_ns: u64,
    /// Releases.
    pub releases: u64,
    /// Bytes copied into slots.
    pub bytes_copied: u64,
    /// Copy operations.
    pub copies: u64,
    /// Fence queries that failed.
    pub fence_errors: u64,
    /// The arena's bytes by state.
    pub bytes: Bytes,
}

impl Pool {
    /// The counters, which outlive the pool (see [`Counters::final_stats`]).
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// Slots by state.
    pub fn slot_counts(&self) -> Counts {
        let mut slots = self.table.counts();
        self.settle_preparing(&mut slots.free, &mut slots.preparing);
        slots
    }

    /// Counters and slot states.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            slots: self.slot_counts(),
            checkouts: c.checkouts.load(Ordering::Relaxed),
            waits: c.waits.load(Ordering::Relaxed),
            wait_ns: c.wait_ns.load(Ordering::Relaxed),
            releases: c.releases.load(Ordering::Relaxed),
            bytes_copied: c.bytes_copied.load(Ordering::Relaxed),
            copies: c.copies.load(Ordering::Relaxed),
            fence_errors: self.fences.as_ref().map_or(0, FenceTracker::errors),
            bytes: self.bytes(),
        }
    }

    /// The arena's bytes by state.
    pub fn bytes(&self) -> Bytes {
        let mut bytes = self.table.bytes();
        self.settle_preparing(&mut bytes.free, &mut bytes.preparing);
        bytes
    }

    /// What is still being made ready (slots or bytes) as the stats report it: free once the
    /// pool is closed, as when it is gone; nothing once making it ready has failed, as it
    /// never will be.
    fn settle_preparing(&self, free: &mut usize, preparing: &mut usize) {
        if self.table.is_closed() {
            *free += std::mem::take(preparing);
        } else if self.prepare_error.get().is_some() {
            *preparing = 0;
        }
    }
}
