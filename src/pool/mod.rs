//! The pool: one fixed arena, handed out as page-aligned slots of any size and taken back.
//!
//! This module is the pool itself: the arena, the slot table and the fences, where a slot
//! lies, release, and the counters. Its other jobs are modules of their own: making a pool
//! (`making`, from a [`PoolConfig`]), checking a slot out (`checkout`), the loader's claim
//! policy ([`claim`]), copies into slots and sends to the device ([`fill_and_send`]), what
//! `stats()` reports ([`stats`]), the prepare and fence threads (`threads`), and what dropping
//! a pool does (`teardown`). Built on the pool: one checked-out slot held by one owner, with
//! the rules for giving it back ([`slot`]), and the zero-copy grants ([`grants`]). Worker
//! segments are mapped, counted and unmapped by [`crate::transport`], which uses the pool;
//! the pool knows nothing of segments.
//!
//! Layer invariant: this folder uses only [`crate::system`], [`crate::memory`],
//! [`crate::allocation`] and [`crate::transfer`] (and [`crate::error`]), never
//! [`crate::transport`] or the Python layer.
//!
//! Invariants:
//! - A slot is an extent of the arena: the bytes its checkout asked for, rounded up to a page,
//!   inside one of the arena's parts (each a whole number of `slot_bytes`, the largest slot);
//!   the slot table ([`crate::allocation::slots`]) and its extent map
//!   ([`crate::allocation::extents`]) keep live extents disjoint.
//! - A slot is written or read through this module only while its checkout is live
//!   ([`SlotTable::is_live`]); every range copied in is checked against the source mapping and
//!   the slot first, so no copy reads or writes outside either.
//! - On a CUDA backend a release with a stream goes through the fence tracker (it only queues:
//!   no driver call on the releasing thread); a background thread (and any checkout that finds
//!   no free slot) records the fences and retires them as they complete. A slot with a pending
//!   fence is never handed out.
//! - The arena outlives every user: checkouts are only usable through an `Arc<Pool>`. Dropping
//!   the last one only closes the table and hands what the pool owns to the freeing thread
//!   ([`crate::memory::freeing`]), whatever thread drops it: there the pending fences are waited
//!   for, then the threads stopped and the arena freed (or, if a fence has not completed after
//!   30 s, the arena is leaked rather than free memory the GPU may read).
//! - A copy into a slot may run on a copy thread ([`Pool::copy_in_background`]): its job owns
//!   the pool, the source mapping and what keeps the slot out of the pool, and drops them only
//!   after the copy ([`fill_and_send`]).
//! - After [`Pool::close`] no checkout succeeds; slots already out may still be used and
//!   released.
//! - A forked child (a DataLoader worker) may inherit and drop the last reference to its
//!   parent's pool: there the drop does nothing but free plain memory. The threads the pool's
//!   parts would stop and wait for, and the CUDA context they would call, live in the parent.
//! - Only the process that made the pool checks slots out or copies into them. A forked child
//!   holds a private copy of the slot table over the same shared arena: a slot it checked out
//!   could be one the parent holds too, and the copy threads exist only in the parent.
//!
//! # Note: the life of a slot
//!
//! Other modules point here. One slot, from the arena's making to its reuse, in both of the
//! DataLoader's modes (the Python halves are named after "Python:", in `python/pinpool/`):
//!
//! 1. **Made.** [`Pool::new`] makes the arena ([`crate::memory::arena`]) and the slot table
//!    ([`crate::allocation::slots`]): a fixed number of entries and the arena's free bytes. When
//!    the pool makes its arena ready as checkouts need it, the rest is free only once
//!    [`SlotTable::admit`] adds it, as its part is faulted in (and registered) on demand.
//! 2. **Checked out.** A free entry takes an extent of exactly the bytes asked for (rounded
//!    up to a page), carved by address-ordered first fit ([`crate::allocation::extents`] says
//!    why: batches are mostly consumed in order, so the oldest bytes free first and the next
//!    batch lands there again; a batch kept for long holds only its own bytes, the others flow
//!    around it; nothing is rounded to a power of two). `Free -> CheckedOut`, with a new
//!    generation; the [`SlotId`] (table, index, generation) names this one checkout. Copy
//!    mode: the main process checks it out when a worker's batch arrives, of that batch's size
//!    (Python: `LazyPool.claim` in `_main/route/lazy_pool.py`). Zero-copy: the worker that collated
//!    the batch asks for it once it knows the batch's size, and the grants check out a slot
//!    of exactly that size, where that worker's last slots were if one is free ([`grants`],
//!    answered on the grant desk's thread, [`crate::transport::grant_desk`]; Python:
//!    `_worker/desk.py`); the grant, its place in the arena (memfd, offset, length,
//!    generation, a nonce), is the answer. A batch that gets no grant comes through copy mode
//!    into a slot of its own size.
//!    When there is no room: a claim waits while room is on its way (fenced slots, parts not
//!    ready yet); when nothing is on its way, every other byte is held by batches someone
//!    keeps (or cut by them into pieces too small), and [`Pool::claim`] says so rather than
//!    wait forever (the loader then uses ordinary memory for that batch, counted, or waits
//!    up to its timeout, as the user chose).
//! 3. **Filled.** Copy mode: [`Pool::copy_in`] copies the batch from the worker's segment
//!    ([`crate::transport::segment`]), every range checked against the segment and the slot.
//!    Zero-copy: the worker writes the batch into its own mapping of the slot (a window,
//!    [`crate::memory::window`]); the main process accepts it only for the slot granted for
//!    that batch (index, generation, nonce) and only if every array lies inside the slot
//!    (Python: `Intake.adopt` in `_main/route/intake.py`; the worker's side is
//!    `_worker/destination.py` and `_worker/windows.py`).
//! 4. **Delivered.** Tensors viewing the slot (pinned CPU batches), or an asynchronous copy to
//!    the GPU on pinpool's stream, after which the slot is released at once, fenced on that
//!    stream (Python: `_main/route/delivery.py`).
//! 5. **Released.** When the last view of the batch dies (or on an explicit `release`), the
//!    binding releases the checkout with torch's current stream: `CheckedOut -> Fenced`, and
//!    `(checkout, stream)` is queued ([`crate::transfer::fence`]); without CUDA, straight to
//!    `Free`. No driver call on the releasing thread, which may hold the GIL.
//! 6. **Fenced.** The fence thread (or a checkout that finds nothing free) records one event
//!    per stream for everything queued and polls the events; when a slot's event completes,
//!    `Fenced -> Free`, and its bytes go back to the extent map, merged with free neighbours.
//!    No byte is handed out again before then. A fence that fails frees its slots only after
//!    a wait for the whole device.
//! 7. **Reused.** The next checkout bumps the generation again: every checkout of an earlier
//!    checkout (a stale handle, a second release) is refused with `SlotReleased`.
//! 8. **Freed.** When the last reference to the pool goes, the freeing thread
//!    ([`crate::memory::freeing`]) waits for the fences still pending, then frees the arena.

mod checkout;
pub mod claim;
pub mod fill_and_send;
pub mod grants;
mod making;
pub mod slot;
pub mod stats;
mod teardown;
mod threads;

pub use stats::{Counters, Stats};

use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::allocation::slots::{Bytes, Counts, SlotId, SlotTable};
use crate::error::{Error, Held, Result};
use crate::memory::arena::{Arena, Backend, Residency};
use crate::system::cuda::StreamHandle;
use crate::transfer::copy::Copier;
use crate::transfer::fence::FenceTracker;

/// Where a slot lies in shared memory ([`Pool::slot_location`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLocation {
    /// The slot's offset in the arena.
    pub arena_offset: usize,
    /// Its offset in the memfd (arena part) that holds it.
    pub offset: usize,
    /// Its length.
    pub nbytes: usize,
    /// That memfd's descriptor (owned by the arena).
    pub fd: std::os::fd::RawFd,
    /// That memfd's length.
    pub part_len: usize,
    /// That memfd's inode number.
    pub inode: u64,
}

/// What to build.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The largest slot (rounded up to a page): the arena's parts are whole multiples of it,
    /// and a checkout that does not say its size gets this many bytes.
    pub slot_bytes: usize,
    /// The most slots out or fenced at once.
    pub num_slots: usize,
    /// The arena's size, rounded up to a whole page (and at least `slot_bytes`: the last part
    /// holds the pages past whole slots); `None`: `slot_bytes * num_slots` (equal slots).
    pub arena_bytes: Option<usize>,
    /// CUDA device ordinal, or `None` for no CUDA. (The Python layer's automatic choice,
    /// the rank's own device, is [`crate::memory::device_choice::DeviceRequest::resolve`].)
    pub device: Option<usize>,
    /// Backend, or `None` to choose.
    pub backend: Option<Backend>,
    /// Threads for copies.
    pub copy_threads: usize,
    /// Make only the first bytes (`ready_first`) ready before [`Pool::new`] returns, and the
    /// rest as checkouts need it, on the pool's prepare thread (a checkout that finds no room
    /// asks for more and waits for it). The arena then no longer sits on the critical path
    /// of the first batch, and the parts no batch needs are never faulted in or pinned.
    pub background: bool,
    /// With `background`, the bytes made ready before [`Pool::new`] returns (rounded up to a
    /// page; on `cuda-register` to the whole first part); `None`: at least one largest slot
    /// and at least 16 MiB.
    pub ready_first: Option<usize>,
}

impl PoolConfig {
    /// A config with `num_slots` slots of `slot_bytes`, no CUDA, host backend.
    pub fn host(slot_bytes: usize, num_slots: usize) -> Self {
        PoolConfig {
            slot_bytes,
            num_slots,
            arena_bytes: None,
            device: None,
            backend: None,
            copy_threads: 4,
            background: false,
            ready_first: None,
        }
    }
}

/// The slot pool.
pub struct Pool {
    /// Dropped by hand in `Drop`, and only once no GPU work can still read it.
    arena: ManuallyDrop<Arena>,
    slot_bytes: usize,
    /// The longest part of the arena: no slot is longer.
    largest_part: usize,
    /// Moved to the freeing thread with the arena (the fences are retired against it).
    table: ManuallyDrop<SlotTable>,
    /// These two own threads (and CUDA events): dropped by hand, in the creating process only.
    fences: ManuallyDrop<Option<FenceTracker>>,
    copier: ManuallyDrop<Copier>,
    /// The process that made the pool, and the fork count there ([`crate::system::forks`]).
    owner: u32,
    owner_forks: u64,
    counters: Arc<Counters>,
    retirer: OnceLock<std::thread::Thread>,
    /// Set while the fence thread sleeps with nothing to do: only then does a release wake it.
    retirer_idle: AtomicBool,
    stopping: AtomicBool,
    /// Why the background preparation of the arena stopped short, if it did.
    prepare_error: OnceLock<String>,
    /// With an arena not ready whole: the ready length checkouts have asked for
    /// ([`Pool::want_ready`]); the prepare thread makes parts ready until the arena reaches it.
    wanted_ready: AtomicUsize,
    /// The prepare thread, woken when a checkout asks for more of the arena ready.
    preparer: OnceLock<std::thread::Thread>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("arena", &self.arena)
            .field("slot_bytes", &self.slot_bytes)
            .field("table", &self.table)
            .finish()
    }
}

impl Pool {
    /// Fails unless this is the process that made the pool (see the module's invariants).
    fn check_owner(&self) -> Result<()> {
        // The fork count first: no system call. (A process id check alone would cost one per
        // checkout.)
        if crate::system::forks::current() == self.owner_forks {
            return Ok(());
        }
        let me = std::process::id();
        if me == self.owner {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "this pool belongs to process {}; process {me} (a forked child) cannot check out \
             or fill its slots: its copy of the slot table is stale, so a slot it took could be \
             one the owner is using",
            self.owner
        )))
    }

    /// Bytes per slot (a multiple of the page size).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether a slot of `bytes` leaving `keep` bytes free in one range could be checked out
    /// once the fenced slots, the bytes not ready yet and the slots of `also` are back
    /// ([`SlotTable::room_once_back`]).
    pub fn room_once_back(&self, bytes: usize, keep: usize, also: &[SlotId]) -> bool {
        self.table.room_once_back(bytes, keep, also)
    }

    /// A number that changes whenever bytes or an entry become free.
    pub fn epoch(&self) -> u64 {
        self.table.epoch()
    }

    /// What holds the arena now (for [`Error::Exhausted`]).
    pub fn held(&self) -> Held {
        let (c, b) = (self.table.counts(), self.table.bytes());
        Held {
            checked_out: c.checked_out,
            checked_out_bytes: b.checked_out,
            fenced: c.fenced,
            fenced_bytes: b.fenced,
            largest_free: b.largest_free,
            arena: b.arena,
            entries: self.table.len(),
        }
    }

    /// The slot table's id (every checkout of this pool carries it).
    pub fn table_id(&self) -> u32 {
        self.table.id()
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.table.len()
    }

    /// How the arena was obtained.
    pub fn backend(&self) -> Backend {
        self.arena.backend()
    }

    /// Whether the arena is pinned, locked or pageable.
    pub fn residency(&self) -> Residency {
        self.arena.residency()
    }

    /// The arena (for its memfd, device, notes).
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Threads used for copies.
    pub fn copy_threads(&self) -> usize {
        self.copier.threads()
    }

    /// Where the slot `slot` lies in the arena, `(offset, len)`, if the checkout is
    /// live.
    pub fn extent(&self, slot: SlotId) -> Result<(usize, usize)> {
        self.table.extent(slot).ok_or(Error::SlotReleased { index: slot.index as usize })
    }

    /// Where the slot `slot` lies in shared memory, for a worker process to write
    /// into it; None for a stale checkout or an arena without memfds (`cuda-hostalloc`).
    pub fn slot_location(&self, slot: SlotId) -> Option<SlotLocation> {
        let (at, nbytes) = self.extent(slot).ok()?;
        let (fd, start, part_len) = self.arena.part_at(at)?;
        let inode = self.arena.part_inode_at(at)?; // (read once: no system call per batch)
        Some(SlotLocation {
            arena_offset: at,
            offset: at - start,
            nbytes,
            fd: fd.as_raw_fd(),
            part_len,
            inode,
        })
    }

    /// Whether the slot `slot` was released and waits for its fence.
    pub fn is_fenced(&self, slot: SlotId) -> bool {
        slot.table == self.table.id()
            && self.table.state(slot.index as usize)
                == Some((crate::allocation::slots::State::Fenced, slot.generation))
    }

    /// The length of the slot `slot`, if the checkout is live.
    pub fn slot_len(&self, slot: SlotId) -> Result<usize> {
        self.extent(slot).map(|e| e.1)
    }

    /// The first byte of the slot `slot`, if the checkout is live.
    pub fn slot_ptr(&self, slot: SlotId) -> Result<*mut u8> {
        let (offset, _) = self.extent(slot)?;
        // SAFETY: a live checkout's extent lies inside the arena (the slot table carves
        // extents only from `[0, arena.len())`).
        Ok(unsafe { self.arena.base().add(offset) })
    }

    /// Ends the checkout. With a stream (on a fenced pool) the slot returns once the work
    /// queued on that stream so far has finished; otherwise at once.
    pub fn release(&self, slot: SlotId, stream: Option<StreamHandle>) -> Result<()> {
        match (self.fences.as_ref(), stream) {
            (Some(f), Some(PER_THREAD_DEFAULT_STREAM)) => {
                f.release_fenced_now(&self.table, slot, PER_THREAD_DEFAULT_STREAM)?;
            }
            (Some(f), Some(stream)) => {
                f.release_fenced(&self.table, slot, stream)?;
                if self.retirer_idle.swap(false, Ordering::AcqRel) {
                    if let Some(t) = self.retirer.get() {
                        t.unpark();
                    }
                }
            }
            _ => self.table.release(slot, false)?,
        }
        self.counters.releases.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Frees every fenced slot whose fence has completed; returns how many.
    pub fn retire_fences(&self) -> usize {
        self.fences.as_ref().map_or(0, |f| f.retire_ready(&self.table))
    }

    /// Why making the rest of the arena ready in the background failed (the bytes not made
    /// ready are never handed out), if it did.
    pub fn prepare_error(&self) -> Option<&str> {
        self.prepare_error.get().map(String::as_str)
    }

    /// Stops all further checkouts and wakes every waiter.
    pub fn close(&self) {
        self.table.close();
        self.wake_preparer(); // (it ends: nothing more is made ready)
    }

    /// Asks for `bytes` more of the arena ready than is now (a checkout found no room, and part
    /// of the arena is not ready yet): the prepare thread makes parts ready until it is.
    pub(super) fn want_ready(&self, bytes: usize) {
        self.want_ready_up_to(self.arena.ready_len().saturating_add(bytes));
    }

    /// Asks for the arena to be ready up to `end` bytes from its start (nothing where it is
    /// already, or where the arena is ready whole).
    pub(super) fn want_ready_up_to(&self, end: usize) {
        let target = end.min(self.arena.len());
        if target <= self.arena.ready_len() {
            return;
        }
        if self.wanted_ready.fetch_max(target, Ordering::AcqRel) < target {
            self.wake_preparer();
        }
    }

    fn wake_preparer(&self) {
        if let Some(t) = self.preparer.get() {
            t.unpark();
        }
    }

    /// Whether [`Pool::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.table.is_closed()
    }
}

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, whatever thread that is.
const PER_THREAD_DEFAULT_STREAM: StreamHandle = 2;

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

#[cfg(test)]
mod tests;
