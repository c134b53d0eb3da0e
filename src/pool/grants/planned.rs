//! Where a fresh worker's first big slots will likely be when no worker of its id came before
//! it: its share of the arena's slot locations, told as likely so it can map them while it
//! collates its first batch.
//!
//! Invariant: only a plan: it names locations, checks nothing out, and a location told as likely
//! need not be the one granted.

use crate::pool::{Pool, SlotLocation};

/// How many slots a fresh worker with no predecessor is told of as likely, its own (its first
/// included): its share of the arena's slot locations.
pub const PLANNED_SLOTS: usize = 4;
/// And how many more, after those: the last locations of the next worker's share, where its batch
/// goes when all of its own are busy.
pub const SPARE_SLOTS: usize = 1;

/// Where a fresh worker's first big slots will be when no worker of its id came before it: worker
/// `worker`'s share of the arena's slot locations of `size` bytes ([`PLANNED_SLOTS`] of them, the
/// `worker`-th ones), then [`SPARE_SLOTS`] of the next worker's, its last; at most `kept` in all
/// (the windows it keeps), none without memfd parts.
pub(super) fn planned(pool: &Pool, worker: usize, size: usize, kept: usize) -> Vec<SlotLocation> {
    let arena = pool.arena();
    let mut locations = Vec::new();
    let mut at = 0;
    while let Some((fd, start, len)) = arena.part_at(at) {
        let inode = arena.part_inode_at(start).unwrap_or(0);
        let mut offset = 0;
        while offset + size <= len {
            locations.push(SlotLocation {
                arena_offset: start + offset,
                offset,
                nbytes: size,
                fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
                part_len: len,
                inode,
            });
            offset += size;
        }
        at = start + len;
    }
    let n = locations.len();
    if n == 0 {
        return Vec::new();
    }
    let told = (PLANNED_SLOTS + SPARE_SLOTS).min(kept).min(n);
    let own = PLANNED_SLOTS.min(told);
    let first = worker * PLANNED_SLOTS;
    let picks = (0..own)
        .map(|i| first + i)
        .chain((0..told - own).map(|i| first + 2 * PLANNED_SLOTS - 1 - i));
    let mut chosen: Vec<usize> = Vec::new();
    for i in picks {
        if !chosen.contains(&(i % n)) {
            chosen.push(i % n); // (with few locations, the spare may be one of its own)
        }
    }
    chosen.into_iter().map(|i| locations[i]).collect()
}
