//! The slot table: every checkout's state and extent, and the arena's free bytes.
//!
//! A slot is one checkout of a piece of the arena: an extent of exactly the bytes asked for
//! (rounded up to a page), carved from the arena by [`crate::allocation::extents`]. The table
//! has a fixed number of entries (the most slots that can be out or fenced at once); an entry
//! names its slot's extent while it is checked out or fenced, and nothing while free.
//!
//! (See "the life of a slot" in [`crate::pool`] for where each transition is made.)
//!
//! This module holds the entries and their transitions; `waiting` is waiting for room and
//! closing, `figures` what the table reports ([`Counts`], [`Bytes`], defined here), `pieces`
//! a batch checked out as several slots where no free range holds it whole.
//!
//! Invariants:
//! - Every entry is in exactly one state: `Free`, `CheckedOut` or `Fenced`, held in one atomic
//!   word together with the entry's generation. Every transition is made under the table's
//!   lock, which also guards the extent map and the counts; readers of one word
//!   ([`SlotTable::is_live`], [`SlotTable::state`]) need no lock.
//! - An entry that is `CheckedOut` or `Fenced` owns its extent's bytes: they are in no free
//!   range, so no two live extents overlap. The bytes go back to the extent map exactly when
//!   the entry becomes `Free`: at a release without a fence, or at
//!   [`SlotTable::complete_fence`], which the pool calls once the slot's fence has completed.
//!   No byte is handed out again before its fence has completed.
//! - A checkout moves `Free -> CheckedOut` and bumps the generation; the [`SlotId`] it returns
//!   (table id + index + generation) names that one checkout; another table refuses it. Every
//!   later transition compares the whole word, so a second release, or a release through a
//!   stale checkout, is refused with [`Error::SlotReleased`] and frees no byte twice.
//!   `Fenced -> CheckedOut` happens only through [`SlotTable::unfence`], when a fence recorded
//!   at release time could not be recorded.
//! - Bytes that are not ready yet (the arena's parts still being faulted in and pinned in the
//!   background) are in no free range until [`SlotTable::admit`] adds them, once.
//! - Waiting never misses a wake-up: every change that frees bytes or an entry bumps an epoch
//!   under the lock, and [`SlotTable::wait`] sleeps only while the epoch is the one its caller
//!   saw, re-checked under that lock; every wait is bounded by a timeout anyway.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

// parking_lot's lock spins briefly before it sleeps: the table's critical sections are a few
// dozen instructions, and several threads (the pin thread, the consumer, copy threads that
// release) take it at once.
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::allocation::extents::ExtentMap;
use crate::error::{Error, Result};
use crate::memory::shm::page_size;

mod figures;
mod pieces;
mod waiting;

/// Names one checkout of one slot of one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    /// The table (pool) that issued it: a checkout is refused by every other table.
    pub table: u32,
    /// The table entry it holds.
    pub index: u32,
    /// Which checkout of that entry this is.
    pub generation: u32,
}

/// A table entry's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Holds nothing; ready to name the next checkout.
    Free,
    /// Held by a user.
    CheckedOut,
    /// Released, but GPU work recorded on its fence may still read its extent.
    Fenced,
}

const FREE: u64 = 0;
const OUT: u64 = 1;
const FENCED: u64 = 2;

fn word(generation: u32, state: u64) -> u64 {
    (u64::from(generation) << 2) | state
}

fn split(w: u64) -> (u32, State) {
    let state = match w & 3 {
        FREE => State::Free,
        OUT => State::CheckedOut,
        _ => State::Fenced,
    };
    ((w >> 2) as u32, state)
}

/// How many slots are in each state, counted in slots of the table's default size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// How many more checkouts of the default size would succeed now.
    pub free: usize,
    /// Held by users.
    pub checked_out: usize,
    /// Waiting for their fence.
    pub fenced: usize,
    /// Default-size slots' worth of bytes not ready yet.
    pub preparing: usize,
}

/// The arena's bytes by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bytes {
    /// The whole arena.
    pub arena: usize,
    /// In free ranges.
    pub free: usize,
    /// The longest free range: the largest slot a checkout could get now.
    pub largest_free: usize,
    /// How many free ranges there are.
    pub holes: usize,
    /// In checked-out slots.
    pub checked_out: usize,
    /// In fenced slots.
    pub fenced: usize,
    /// Not ready yet.
    pub preparing: usize,
    /// The largest slot the arena can ever hold (its longest part).
    pub largest_part: usize,
}

/// What the lock guards.
struct Inner {
    map: ExtentMap,
    /// Free entries (a stack: the most recently used is reused first).
    spare: Vec<u32>,
    /// Each entry's extent `(offset, len)`, valid while it is checked out or fenced.
    extents: Vec<(usize, usize)>,
    /// Byte ranges not ready yet.
    unready: Vec<(usize, usize)>,
    out: usize,
    fenced: usize,
    out_bytes: usize,
    fenced_bytes: usize,
}

static NEXT_TABLE_ID: AtomicU32 = AtomicU32::new(1);

/// The entries of one pool and the free bytes of its arena.
pub struct SlotTable {
    id: u32,
    words: Box<[AtomicU64]>,
    /// Each entry's extent's offset, readable without the lock by a live checkout's holder
    /// (written before the word becomes `CheckedOut`, with release ordering).
    offsets: Box<[AtomicU64]>,
    lens: Box<[AtomicU64]>,
    /// The size of a checkout that does not say (a "slot" of the equal-slot API).
    default_bytes: usize,
    inner: Mutex<Inner>,
    epoch: AtomicU64,
    waiters: AtomicU64,
    wake: Condvar,
    closed: AtomicBool,
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable").field("counts", &self.counts()).finish()
    }
}

/// How a table's arena is laid out.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Table entries: the most slots out or fenced at once.
    pub entries: usize,
    /// The arena's length (a multiple of `unit`).
    pub arena: usize,
    /// The allocation unit (the page size).
    pub unit: usize,
    /// The size of a checkout that does not say.
    pub default_bytes: usize,
    /// Where the arena's parts start (no slot crosses one).
    pub boundaries: Vec<usize>,
    /// Bytes from the start that are ready now.
    pub ready: usize,
}

/// Where [`SlotTable::try_checkout_bytes_preferring`] may put a slot's extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preference {
    /// At one of the preferred offsets if it fits there, else wherever first fit puts it.
    Prefer,
    /// At one of the preferred offsets or not at all.
    OnlyThere,
}

impl SlotTable {
    /// `n` slots of one page each, all ready (n > 0).
    pub fn new(n: usize) -> Result<Self> {
        Self::with_ready(n, n)
    }

    /// `n` one-page slots (n > 0), of which the first `ready` pages are ready and the rest
    /// not until [`SlotTable::admit`]ted.
    pub fn with_ready(n: usize, ready: usize) -> Result<Self> {
        let unit = page_size();
        let arena = n.checked_mul(unit).ok_or_else(|| Error::Invalid("too many slots".into()))?;
        Self::with_layout(Layout {
            entries: n,
            arena,
            unit,
            default_bytes: unit,
            boundaries: Vec::new(),
            ready: ready.min(n) * unit,
        })
    }

    /// A table over an arena laid out as `layout` says.
    pub fn with_layout(layout: Layout) -> Result<Self> {
        let n = layout.entries;
        Self::check_len(n)?;
        let unit = layout.unit;
        let mut map = ExtentMap::new(layout.arena, unit, &layout.boundaries)?;
        let ready = layout.ready.min(layout.arena) / unit * unit;
        if ready > 0 {
            map.free(0, ready)?;
        }
        let unready =
            if ready < layout.arena { vec![(ready, layout.arena - ready)] } else { Vec::new() };
        let default_bytes = map
            .round(layout.default_bytes)
            .ok_or_else(|| Error::Invalid("slot size too large".into()))?;
        Ok(SlotTable {
            id: NEXT_TABLE_ID.fetch_add(1, Ordering::Relaxed),
            words: (0..n).map(|_| AtomicU64::new(word(0, FREE))).collect(),
            offsets: (0..n).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..n).map(|_| AtomicU64::new(0)).collect(),
            default_bytes,
            inner: Mutex::new(Inner {
                map,
                spare: (0..n as u32).rev().collect(),
                extents: vec![(0, 0); n],
                unready,
                out: 0,
                fenced: 0,
                out_bytes: 0,
                fenced_bytes: 0,
            }),
            epoch: AtomicU64::new(0),
            waiters: AtomicU64::new(0),
            wake: Condvar::new(),
            closed: AtomicBool::new(false),
        })
    }

    /// Fails unless a table can have `n` entries.
    pub fn check_len(n: usize) -> Result<()> {
        if n == 0 || n > u32::MAX as usize {
            return Err(Error::Invalid(format!("num_slots must be in 1..=2^32-1, got {n}")));
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Makes `[offset, offset + len)` (bytes not ready until now) free. Returns false,
    /// changing nothing, unless that range lies inside what is not ready yet.
    pub fn admit(&self, offset: usize, len: usize) -> bool {
        let mut inner = self.lock();
        let Some(end) = offset.checked_add(len).filter(|_| len > 0) else { return false };
        let Some(i) = inner.unready.iter().position(|&(o, l)| o <= offset && end <= o + l) else {
            return false;
        };
        if inner.map.free(offset, len).is_err() {
            return false; // (not whole units)
        }
        let (o, l) = inner.unready.remove(i);
        if o < offset {
            inner.unready.push((o, offset - o));
        }
        if end < o + l {
            inner.unready.push((end, o + l - end));
        }
        self.freed(&inner);
        true
    }

    /// Gives up on the bytes not ready yet (making them ready failed): they are no longer on
    /// their way, so no checkout waits for them ([`SlotTable::room_once_back`]); waiters are
    /// woken to decide again. Returns how many bytes were given up.
    pub fn give_up_unready(&self) -> usize {
        let mut inner = self.lock();
        let given_up = inner.unready.iter().map(|r| r.1).sum();
        inner.unready.clear();
        self.freed(&inner);
        given_up
    }

    /// Number of entries: the most slots out or fenced at once.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Always false: a table has at least one entry.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// This table's id, carried by every checkout it issues.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The size of a checkout that does not say how many bytes it needs.
    pub fn default_bytes(&self) -> usize {
        self.default_bytes
    }

    /// Takes a slot of the default size, if there is room now. Never blocks.
    pub fn try_checkout(&self) -> Option<SlotId> {
        self.try_checkout_bytes(self.default_bytes, 0)
    }

    /// Takes a slot of `bytes` (rounded up to a page), if an entry is free and a free range
    /// holds it with `keep` bytes left in one range afterwards; with `keep`, one free entry
    /// is left too. Never blocks.
    pub fn try_checkout_bytes(&self, bytes: usize, keep: usize) -> Option<SlotId> {
        self.try_checkout_bytes_preferring(bytes, keep, &[], Preference::Prefer)
    }

    /// As [`SlotTable::try_checkout_bytes`], but the slot's extent starts at the first arena offset
    /// of `prefer` where it can ([`ExtentMap::alloc_preferring`]: a free, whole-page place inside
    /// one part, `keep` honoured), else (with [`Preference::Prefer`]) wherever first fit puts it.
    /// Never blocks.
    pub fn try_checkout_bytes_preferring(
        &self,
        bytes: usize,
        keep: usize,
        prefer: &[usize],
        preference: Preference,
    ) -> Option<SlotId> {
        let mut inner = self.lock();
        if keep > 0 && inner.spare.len() < 2 {
            return None; // the last entry is kept with the bytes
        }
        inner.spare.last()?;
        let (offset, len) = match preference {
            Preference::OnlyThere => inner.map.alloc_at(bytes, keep, prefer)?,
            Preference::Prefer => inner.map.alloc_preferring(bytes, keep, prefer)?,
        };
        Some(self.check_out(&mut inner, offset, len))
    }

    /// Makes the last spare entry the checkout of the extent `(offset, len)`, which the caller
    /// has just taken from the map (under the same lock) and for which an entry is spare.
    fn check_out(&self, inner: &mut Inner, offset: usize, len: usize) -> SlotId {
        let index = inner.spare.pop().expect("an entry is spare (checked by the caller)");
        let cell = &self.words[index as usize];
        let (generation, state) = split(cell.load(Ordering::Acquire));
        debug_assert_eq!(state, State::Free, "entry {index} spare while {state:?}");
        let next = generation.wrapping_add(1);
        inner.extents[index as usize] = (offset, len);
        inner.out += 1;
        inner.out_bytes += len;
        self.offsets[index as usize].store(offset as u64, Ordering::Relaxed);
        self.lens[index as usize].store(len as u64, Ordering::Relaxed);
        cell.store(word(next, OUT), Ordering::Release);
        SlotId { table: self.id, index, generation: next }
    }

    /// The current state and generation of entry `index`.
    pub fn state(&self, index: usize) -> Option<(State, u32)> {
        self.words.get(index).map(|w| {
            let (g, s) = split(w.load(Ordering::Acquire));
            (s, g)
        })
    }

    /// Whether `slot` names the entry's current, unreleased checkout.
    pub fn is_live(&self, slot: SlotId) -> bool {
        slot.table == self.id
            && self.state(slot.index as usize) == Some((State::CheckedOut, slot.generation))
    }

    /// The extent `(offset, len)` of a live checkout's slot.
    pub fn extent(&self, slot: SlotId) -> Option<(usize, usize)> {
        if !self.is_live(slot) {
            return None;
        }
        let i = slot.index as usize;
        // (Stored before the word that made the checkout live, which `is_live` acquired.)
        let extent = (
            self.offsets[i].load(Ordering::Relaxed) as usize,
            self.lens[i].load(Ordering::Relaxed) as usize,
        );
        // Still the same checkout: the entry cannot have been reused in between.
        self.is_live(slot).then_some(extent)
    }

    /// Ends the checkout `slot`. With `fenced`, the slot waits in `Fenced` (its bytes
    /// held) until [`SlotTable::complete_fence`]; otherwise its bytes are free at once.
    pub fn release(&self, slot: SlotId, fenced: bool) -> Result<()> {
        let cell = self.cell(slot)?;
        let mut inner = self.lock();
        if cell.load(Ordering::Acquire) != word(slot.generation, OUT) {
            return Err(Error::SlotReleased { index: slot.index as usize });
        }
        let (_, len) = inner.extents[slot.index as usize];
        inner.out -= 1;
        inner.out_bytes -= len;
        if fenced {
            cell.store(word(slot.generation, FENCED), Ordering::Release);
            inner.fenced += 1;
            inner.fenced_bytes += len;
        } else {
            self.give_back(&mut inner, slot);
        }
        Ok(())
    }

    /// Frees a fenced slot's entry and bytes once its fence has completed. Returns false if
    /// `slot` is not the entry's current fenced checkout (already completed, or stale).
    pub fn complete_fence(&self, slot: SlotId) -> bool {
        let Ok(cell) = self.cell(slot) else { return false };
        let mut inner = self.lock();
        if cell.load(Ordering::Acquire) != word(slot.generation, FENCED) {
            return false;
        }
        let (_, len) = inner.extents[slot.index as usize];
        inner.fenced -= 1;
        inner.fenced_bytes -= len;
        self.give_back(&mut inner, slot);
        true
    }

    /// Returns an entry and its bytes (it was checked out or fenced; counts already moved).
    fn give_back(&self, inner: &mut Inner, slot: SlotId) {
        let i = slot.index as usize;
        let (offset, len) = std::mem::take(&mut inner.extents[i]);
        self.words[i].store(word(slot.generation, FREE), Ordering::Release);
        // Cannot fail: the entry owned exactly these bytes (see the invariants).
        let freed = inner.map.free(offset, len);
        debug_assert!(freed.is_ok(), "{freed:?}");
        inner.spare.push(slot.index);
        self.freed(inner);
    }

    /// Undoes a fenced [`SlotTable::release`] whose fence could not be recorded: the slot is
    /// checked out again under the same checkout.
    pub fn unfence(&self, slot: SlotId) {
        let Ok(cell) = self.cell(slot) else { return };
        let mut inner = self.lock();
        if cell.load(Ordering::Acquire) == word(slot.generation, FENCED) {
            let (_, len) = inner.extents[slot.index as usize];
            inner.fenced -= 1;
            inner.fenced_bytes -= len;
            inner.out += 1;
            inner.out_bytes += len;
            cell.store(word(slot.generation, OUT), Ordering::Release);
        }
    }

    fn cell(&self, slot: SlotId) -> Result<&AtomicU64> {
        self.words
            .get(slot.index as usize)
            .filter(|_| slot.table == self.id)
            .ok_or(Error::SlotReleased { index: slot.index as usize })
    }
}

#[cfg(test)]
mod tests;
