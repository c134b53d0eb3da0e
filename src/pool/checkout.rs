//! Checking a slot out: of any size up to the largest part, preferring a given extent, with
//! room kept for the head batch, waiting for room or not; or a batch as several slots.
//!
//! (Step 2 of "the life of a slot" in [`crate::pool`].)
//!
//! Invariants:
//! - Only the process that made the pool checks out ([`Pool::check_owner`] first), and never
//!   after [`Pool::close`].
//! - A size larger than the largest part is refused at once
//!   ([`crate::error::Error::BatchTooLarge`]), never waited for; a wait is bounded by its timeout,
//!   and by the table's close.
//! - A checkout that finds no free slot first retires the fences that have completed; one that
//!   still finds no room asks for that much more of the arena ready ([`Pool::want_ready`]),
//!   and one that gets a slot asks for the room of one more like it past its end.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Pool;
use crate::allocation::slots::{Preference, SlotId};
use crate::error::{Error, Result};
use crate::transfer::fence::FenceTracker;

impl Pool {
    /// Takes a free slot of `slot_bytes` without waiting.
    pub fn try_checkout(&self) -> Result<Option<SlotId>> {
        self.try_checkout_bytes(self.slot_bytes, 0)
    }

    /// Takes a slot of `bytes` (rounded up to a page) without waiting, if there is room for
    /// it with `keep` bytes left in one free range afterwards. A size no slot can ever have
    /// is [`Error::BatchTooLarge`].
    pub fn try_checkout_bytes(&self, bytes: usize, keep: usize) -> Result<Option<SlotId>> {
        self.try_checkout_bytes_preferring(bytes, keep, &[], Preference::Prefer)
    }

    /// As [`Pool::try_checkout_bytes`], but the slot starts at the first arena offset of `prefer`
    /// where a slot of `bytes` can start now (free, a whole number of pages, inside one part,
    /// `keep` honoured: [`crate::allocation::extents::ExtentMap::alloc_preferring`]), else (with
    /// [`Preference::Prefer`]; [`Preference::OnlyThere`]: None) wherever first fit puts it. A
    /// zero-copy worker that keeps the extents of its last batches mapped asks for them again.
    /// (With `prefer`, a preferred extent free now is taken as it is; only where none is are the
    /// fences that have completed retired first, since their bytes are free only once retired: this
    /// runs on the consumer's thread once a batch, and retiring queries the driver for every fence
    /// in flight.)
    pub fn try_checkout_bytes_preferring(
        &self,
        bytes: usize,
        keep: usize,
        prefer: &[usize],
        preference: Preference,
    ) -> Result<Option<SlotId>> {
        self.check_owner()?;
        if self.table.is_closed() {
            return Err(Error::Closed);
        }
        self.check_size(bytes)?;
        let mut slot = None;
        if !prefer.is_empty() {
            slot = self.table.try_checkout_bytes_preferring(
                bytes,
                keep,
                prefer,
                Preference::OnlyThere,
            );
            if slot.is_none() {
                // A preferred extent whose fence has completed is free only once retired:
                // retire what is ready first, or first fit would hand out other bytes.
                if let Some(f) = self.fences.as_ref() {
                    f.try_retire_ready(&self.table);
                }
            }
        }
        if slot.is_none() {
            slot = self.table.try_checkout_bytes_preferring(bytes, keep, prefer, preference);
        }
        if slot.is_none() {
            if let Some(f) = self.fences.as_ref() {
                if f.try_retire_ready(&self.table) > 0 {
                    slot =
                        self.table.try_checkout_bytes_preferring(bytes, keep, prefer, preference);
                }
            }
        }
        if let Some(t) = slot {
            if self.table.is_closed() {
                // Closed while we took it: give it back, so no checkout outlives `close()`.
                let _ = self.table.release(t, false);
                return Err(Error::Closed);
            }
            self.counters.checkouts.fetch_add(1, Ordering::Relaxed);
            self.keep_room_ahead(t);
        } else if preference != Preference::OnlyThere {
            // No room: the part of the arena not ready yet is made ready for it (a waiting
            // checkout gets it once it is; one that does not wait leaves it for the next).
            self.want_ready(bytes.saturating_add(keep));
        }
        Ok(slot)
    }

    /// Takes the bytes `[0, cuts.last())` as consecutive slots cut only at `cuts` (strictly
    /// increasing from 0), without waiting: `(start, slot)` for each piece, or None (nothing
    /// taken) when the free ranges cannot hold them
    /// ([`crate::allocation::slots::SlotTable::try_checkout_split`]). For the batch the
    /// consumer waits for when no one range holds it; the fences that have completed are
    /// retired first.
    pub fn try_checkout_split(&self, cuts: &[usize]) -> Result<Option<Vec<(usize, SlotId)>>> {
        self.check_owner()?;
        if self.table.is_closed() {
            return Err(Error::Closed);
        }
        if let Some(f) = self.fences.as_ref() {
            f.try_retire_ready(&self.table);
        }
        let Some(pieces) = self.table.try_checkout_split(cuts)? else {
            self.want_ready(cuts.last().copied().unwrap_or(0));
            return Ok(None);
        };
        if self.table.is_closed() {
            // Closed while we took them: give them back, so no checkout outlives `close()`.
            for (_, slot) in pieces {
                let _ = self.table.release(slot, false);
            }
            return Err(Error::Closed);
        }
        self.counters.checkouts.fetch_add(pieces.len() as u64, Ordering::Relaxed);
        Ok(Some(pieces))
    }

    /// Where the arena is not ready whole: asks for the room of one more slot like `slot` to
    /// be ready past its end, so that the next batch of its size (first fit puts it next) does
    /// not wait for that room to be faulted in. Batches that stay small, low in the arena,
    /// ask for nothing more.
    fn keep_room_ahead(&self, slot: SlotId) {
        if self.arena.ready_len() >= self.arena.len() {
            return;
        }
        if let Some((at, len)) = self.table.extent(slot) {
            self.want_ready_up_to(at.saturating_add(len.saturating_mul(2)));
        }
    }

    /// Fails unless a slot of `bytes` fits in one of the arena's parts.
    fn check_size(&self, bytes: usize) -> Result<()> {
        let largest = self.largest_slot();
        if bytes > largest {
            return Err(Error::BatchTooLarge { needed: bytes, slot_bytes: largest });
        }
        Ok(())
    }

    /// The largest slot the arena can ever hold (its longest part).
    pub fn largest_slot(&self) -> usize {
        self.largest_part
    }

    /// Slots of `slot_bytes` that could be checked out right now (a snapshot).
    pub fn free_slots(&self) -> usize {
        self.table.counts().free
    }

    /// Takes a free slot of `slot_bytes`, waiting up to `timeout` (forever with `None`).
    pub fn checkout(&self, timeout: Option<Duration>) -> Result<SlotId> {
        self.checkout_bytes(self.slot_bytes, timeout)
    }

    /// Takes a slot of `bytes`, waiting up to `timeout` (forever with `None`).
    pub fn checkout_bytes(&self, bytes: usize, timeout: Option<Duration>) -> Result<SlotId> {
        if let Some(t) = self.try_checkout_bytes(bytes, 0)? {
            return Ok(t);
        }
        let start = Instant::now();
        self.counters.waits.fetch_add(1, Ordering::Relaxed);
        let result = self.wait_for_slot(bytes, start, timeout);
        let waited = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.counters.wait_ns.fetch_add(waited, Ordering::Relaxed);
        result
    }

    fn wait_for_slot(
        &self,
        bytes: usize,
        start: Instant,
        timeout: Option<Duration>,
    ) -> Result<SlotId> {
        loop {
            let epoch = self.table.epoch();
            if let Some(t) = self.try_checkout_bytes(bytes, 0)? {
                return Ok(t);
            }
            let nap = match self.fences.as_ref().map(FenceTracker::pending) {
                Some(n) if n > 0 => Duration::from_micros(100),
                _ => Duration::from_millis(50),
            };
            let nap = match timeout {
                Some(limit) => {
                    let elapsed = start.elapsed();
                    if elapsed >= limit {
                        return Err(Error::Exhausted {
                            waited_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                            wanted: bytes,
                            held: self.held(),
                        });
                    }
                    nap.min(limit - elapsed)
                }
                None => nap,
            };
            self.table.wait(epoch, nap);
        }
    }
}
