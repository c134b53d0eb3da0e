//! The loader's claim policy: [`Pool::claim`] takes a slot by [`ClaimRules`], waiting only
//! while room is on its way, and otherwise says what to do instead ([`Claim`]).
//!
//! (Step 2 of "the life of a slot" in [`crate::pool`], when there is no room.)
//!
//! Invariants:
//! - A claim never waits for what only the consumer can give back: it waits only while the
//!   fenced slots and the parts of the arena not ready yet, once back and merged with their
//!   free neighbours, would make a range that holds it ([`SlotTable::room_once_back`]: ranges,
//!   not byte counts); otherwise it answers at once [`Claim::Later`] (with
//!   [`ClaimRules::defer`]) or [`Claim::Overflow`] (with [`ClaimRules::overflow`]), or waits up
//!   to its timeout and fails with [`Error::Exhausted`].
//! - A slot taken at once leaves [`ClaimRules::reserve`] bytes free in one range for other
//!   claims; it takes that room too only when enough is on its way to give the reserve back.
//! - The wait is on the slot table's condition variable (a release or a completed fence wakes
//!   it), never a busy poll; every slot it returns went through [`Pool::try_checkout_bytes`],
//!   so every check of a checkout applies.

use std::time::{Duration, Instant};

use super::Pool;
use crate::allocation::slots::SlotId;
#[cfg(doc)]
use crate::allocation::slots::SlotTable;
use crate::error::{Error, Result};

/// How [`Pool::claim`] may take a slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimRules {
    /// Bytes to leave free in one range for other claims: only a claim that leaves this much
    /// takes its slot at once.
    pub reserve: usize,
    /// How long to wait for a slot on its way; `None` waits as long as one is coming.
    pub timeout: Option<Duration>,
    /// Advise [`Claim::Overflow`] when no range, once what is on its way is back, would hold
    /// the slot (the rest is held by batches someone keeps alive: waiting could wait forever).
    pub overflow: bool,
    /// Never wait for what only the consumer can give back: answer [`Claim::Later`] at once
    /// when no range, once what is on its way is back, would hold this slot and the reserve;
    /// or when the timeout has passed.
    pub defer: bool,
}

/// What [`Pool::claim`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A slot, checked out.
    Slot(SlotId),
    /// Come back later (only with [`ClaimRules::defer`]).
    Later,
    /// Put this batch in ordinary memory (only with [`ClaimRules::overflow`]).
    Overflow,
}

/// Bytes a claim made ahead of the consumer (a batch taken ahead in copy mode, a zero-copy
/// grant for a batch other than the one the consumer waits for) leaves free in one range, so
/// that the consumer's next batch finds room whatever was taken ahead of it: the largest batch
/// seen (`largest_seen` bytes) and half as much again (the next may be larger, and by the time
/// it asks, batches after it may hold the rest), in whole pages; at most all of the arena
/// (`arena` bytes) but one such batch, yet never less than one such batch (an arena with room
/// for fewer than two takes nothing ahead: what is taken ahead would hold the room of the batch
/// the consumer waits for); and at most one of the arena's parts (`part` bytes: no range is
/// longer, so more could never be kept and every claim ahead would fail).
pub fn room_kept(largest_seen: usize, arena: usize, part: usize) -> usize {
    let page = crate::memory::shm::page_size();
    let pages = |bytes: usize| bytes.checked_next_multiple_of(page).unwrap_or(usize::MAX);
    let room = pages(largest_seen.saturating_add(largest_seen / 2));
    room.min(arena.saturating_sub(largest_seen)).max(pages(largest_seen)).min(part)
}

impl Pool {
    /// Takes a slot of `bytes` by the DataLoader's rules (see [`Claim`] and [`ClaimRules`]),
    /// waiting on the slot table's condition variable (not polling) while room is on its way.
    ///
    /// Room is on its way while fenced slots or parts of the arena not ready yet, once back
    /// and merged with their free neighbours, would make a range long enough: both come back
    /// by themselves. Otherwise nothing the pool can do makes room: the other bytes are held
    /// by slots someone keeps (or cut into pieces by them), and waiting could wait forever;
    /// then [`ClaimRules::defer`] answers [`Claim::Later`] and [`ClaimRules::overflow`]
    /// [`Claim::Overflow`] at once, and otherwise the claim waits up to its timeout.
    pub fn claim(&self, bytes: usize, rules: &ClaimRules) -> Result<Claim> {
        let start = Instant::now();
        loop {
            let epoch = self.table.epoch();
            if let Some(t) = self.try_checkout_bytes(bytes, rules.reserve)? {
                return Ok(Claim::Slot(t));
            }
            let b = self.table.bytes();
            // Fenced slots come back as the GPU finishes reading them, preparing bytes as the
            // background thread makes them ready: both are worth waiting for, if the range
            // they make with their free neighbours holds this slot (and the reserve).
            let coming = b.fenced + b.preparing;
            let room_once_back = coming > 0 && self.table.room_once_back(bytes, rules.reserve, &[]);
            let left = rules.timeout.map(|t| t.saturating_sub(start.elapsed()));
            let expired = left.is_some_and(|l| l.is_zero());
            if rules.defer && (!room_once_back || expired) {
                return Ok(Claim::Later);
            }
            if rules.overflow && !self.table.room_once_back(bytes, 0, &[]) {
                return Ok(Claim::Overflow);
            }
            if expired {
                return Err(Error::Exhausted {
                    waited_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
                    wanted: bytes,
                    held: self.held(),
                });
            }
            if rules.reserve > 0 && room_once_back {
                // Only the reserve stands in the way, and what is on its way gives it back:
                // take the room now.
                if let Some(t) = self.try_checkout_bytes(bytes, 0)? {
                    return Ok(Claim::Slot(t));
                }
            }
            // Fences are polled by the fence thread every few hundred microseconds at most;
            // a release or a completed fence wakes this wait at once.
            let nap = Duration::from_millis(if coming > 0 { 1 } else { 50 });
            self.table.wait(epoch, left.map_or(nap, |l| l.min(nap)));
        }
    }
}

#[cfg(test)]
mod tests;
