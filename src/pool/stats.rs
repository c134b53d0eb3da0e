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

use crate::allocation::slots::{Bytes, Counts};

/// Counters reported by `pool.stats()`. Shared ([`super::Pool::counters`]) so that the last figures
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
