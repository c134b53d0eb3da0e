//! The pool: one fixed arena, handed out as page-aligned slots of any size and taken back.
//!
//! This module is the pool itself: the arena, the slot table and the fences, checkout and
//! release, and the counters. Its other jobs are modules of their own: the loader's claim
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
//!    the pool makes the rest of its arena in the background, those bytes are free only once
//!    [`SlotTable::admit`] adds them, as their part is faulted in (and registered).
//! 2. **Checked out.** A free entry takes an extent of exactly the bytes asked for (rounded
//!    up to a page), carved by address-ordered first fit ([`crate::allocation::extents`] says
//!    why: batches are mostly consumed in order, so the oldest bytes free first and the next
//!    batch lands there again; a batch kept for long holds only its own bytes, the others flow
//!    around it; nothing is rounded to a power of two). `Free -> CheckedOut`, with a new
//!    generation; the [`SlotId`] (table, index, generation) names this one checkout. Copy
//!    mode: the main process checks it out when a worker's batch arrives, of that batch's size
//!    (Python: `Receiver._claim` in `_main/receiver.py`). Zero-copy: it is checked out as torch
//!    dispatches a batch's indices, before the batch exists, of a size guessed from the
//!    recent batches (Python: `_main/checkouts.py`, `_main/sizing.py`), and its place in the
//!    arena (memfd, offset, length, generation, a nonce) travels to the worker with them; a
//!    batch that does not fit comes through copy mode into a slot of its own size.
//!    When there is no room: a claim waits while room is on its way (fenced slots, parts not
//!    ready yet); when nothing is on its way, every other byte is held by batches someone
//!    keeps (or cut by them into pieces too small), and [`Pool::claim`] says so rather than
//!    wait forever (the loader then uses ordinary memory for that batch, counted, or waits
//!    up to its timeout, as the user chose).
//! 3. **Filled.** Copy mode: [`Pool::copy_in`] copies the batch from the worker's segment
//!    ([`crate::transport::segment`]), every range checked against the segment and the slot.
//!    Zero-copy: the worker writes the batch into its own mapping of the slot; the main
//!    process accepts it only for the slot handed out with those indices (index, generation,
//!    nonce) and only if every array lies inside the slot (Python: `Receiver._adopt`; the
//!    worker's side is `_worker/places.py`).
//! 4. **Delivered.** Tensors viewing the slot (pinned CPU batches), or an asynchronous copy to
//!    the GPU on pinpool's stream, after which the slot is released at once, fenced on that
//!    stream (Python: `_main/delivery.py`).
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

pub mod claim;
pub mod fill_and_send;
pub mod grants;
pub mod slot;
pub mod stats;
mod teardown;
mod threads;

pub use claim::{Claim, ClaimRules};
pub use fill_and_send::validate_ranges;
pub use stats::{Counters, Stats};

use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::allocation::slots::{Layout, Preference, SlotId, SlotTable};
use crate::error::{Error, Held, Result};
use crate::memory::arena::{Arena, Backend, Residency};
use crate::memory::freeing;
use crate::memory::shm::{page_size, round_up};
use crate::system::cuda::StreamHandle;
use crate::transfer::copy::{Copier, MAX_COPY_THREADS};
use crate::transfer::fence::{CudaFences, FenceTracker, Fences};

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
    /// Make only the first slots (at least one, at least 16 MiB) ready before [`Pool::new`]
    /// returns, and the rest on a background thread (checkouts wait for slots not ready yet).
    /// The arena then no longer sits on the critical path of the first batch.
    pub background: bool,
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
    /// Allocates the arena and starts the background threads.
    pub fn new(config: &PoolConfig) -> Result<Arc<Self>> {
        let slot_bytes = Self::checked_slot_bytes(config)?;
        let arena_len = Self::arena_len(config, slot_bytes)?;
        SlotTable::check_len(config.num_slots)?; // before any memory is taken
                                                 // The pools dropped before give their memory
                                                 // back first (the freeing thread may lag behind
                                                 // a loop that makes loaders), and one of this
                                                 // shape gives its arena.
        freeing::catch_up(CATCH_UP_AT_MOST);
        let (device, backend) = (config.device, config.backend);
        let kept =
            freeing::take_shelved(|a| a.reusable_for(arena_len, slot_bytes, device, backend));
        let arena = if let Some(arena) = kept {
            if !config.background {
                while arena.prepare_next(fault_threads())?.is_some() {} // (whole, as asked)
            }
            arena.taken_again()
        } else if config.background {
            freeing::evict_shelved();
            Arena::new_partial(
                arena_len,
                slot_bytes,
                config.device,
                config.backend,
                fault_threads(),
                slot_bytes.max(READY_FIRST),
            )?
        } else {
            freeing::evict_shelved();
            Arena::new(arena_len, slot_bytes, config.device, config.backend, fault_threads())?
        };
        let table = Self::table_over(&arena, config.num_slots, slot_bytes)?;
        let fences = arena.device().map(|device| Box::new(CudaFences::new(device)) as _);
        let pool = Self::assemble(arena, slot_bytes, table, fences, config.copy_threads)?;
        threads::start_preparing(&pool)?;
        Ok(pool)
    }

    /// A host pool whose releases with a stream are fenced by `fences` (tests, benchmarks).
    pub fn with_fences(config: &PoolConfig, fences: Box<dyn Fences>) -> Result<Arc<Self>> {
        let slot_bytes = Self::checked_slot_bytes(config)?;
        let arena_len = Self::arena_len(config, slot_bytes)?;
        SlotTable::check_len(config.num_slots)?;
        let arena = Arena::new(arena_len, slot_bytes, None, Some(Backend::Host), fault_threads())?;
        let table = Self::table_over(&arena, config.num_slots, slot_bytes)?;
        Self::assemble(arena, slot_bytes, table, Some(fences), config.copy_threads)
    }

    /// The arena's length: `arena_bytes` rounded up to a whole page (at least one slot), else
    /// `num_slots` slots.
    fn arena_len(config: &PoolConfig, slot_bytes: usize) -> Result<usize> {
        let overflows =
            |what: String| Error::Invalid(format!("{what} overflows the address space"));
        match config.arena_bytes {
            Some(0) => Err(Error::Invalid("arena_bytes must be positive".into())),
            Some(n) => n
                .checked_next_multiple_of(page_size())
                .map(|n| n.max(slot_bytes))
                .ok_or_else(|| overflows(format!("arena_bytes={n}"))),
            None => slot_bytes.checked_mul(config.num_slots).ok_or_else(|| {
                overflows(format!("slot_bytes={slot_bytes} x num_slots={}", config.num_slots))
            }),
        }
    }

    /// The slot table over `arena`: `entries` slots at most, of any size up to the longest
    /// part, `slot_bytes` by default; only the bytes ready now are free.
    fn table_over(arena: &Arena, entries: usize, slot_bytes: usize) -> Result<SlotTable> {
        SlotTable::with_layout(Layout {
            entries,
            arena: arena.len(),
            unit: page_size(),
            default_bytes: slot_bytes,
            boundaries: arena.part_starts(),
            ready: arena.ready_len(),
        })
    }

    /// Checks everything in `config` that can be checked before memory is taken; returns the
    /// slot size rounded up to a page.
    fn checked_slot_bytes(config: &PoolConfig) -> Result<usize> {
        if config.slot_bytes == 0 {
            return Err(Error::Invalid("slot_bytes must be positive".into()));
        }
        if !(1..=MAX_COPY_THREADS).contains(&config.copy_threads) {
            return Err(Error::Invalid(format!(
                "copy_threads must be from 1 to {MAX_COPY_THREADS}, not {}",
                config.copy_threads
            )));
        }
        round_up(config.slot_bytes, page_size())
            .ok_or_else(|| Error::Invalid("slot_bytes too large".into()))
    }

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

    fn assemble(
        arena: Arena,
        slot_bytes: usize,
        table: SlotTable,
        fences: Option<Box<dyn Fences>>,
        copy_threads: usize,
    ) -> Result<Arc<Self>> {
        let n = table.len() as u64;
        let largest_part = table.bytes().largest_part;
        let arena_len = arena.len();
        // Copy threads run on the CPUs of the arena's NUMA node, when it was placed on one.
        let copier = Copier::on_cpus(copy_threads, arena.placement().thread_cpus())?;
        let pool = Arc::new(Pool {
            arena: ManuallyDrop::new(arena),
            slot_bytes,
            largest_part,
            table: ManuallyDrop::new(table),
            fences: ManuallyDrop::new(fences.map(FenceTracker::new)),
            copier: ManuallyDrop::new(copier),
            owner: std::process::id(),
            owner_forks: crate::system::forks::current(),
            counters: Arc::new(Counters {
                num_slots: AtomicU64::new(n),
                arena_bytes: AtomicU64::new(arena_len as u64),
                ..Counters::default()
            }),
            retirer: OnceLock::new(),
            retirer_idle: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            prepare_error: OnceLock::new(),
        });
        threads::start_retiring(&pool)?;
        Ok(pool)
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

    /// As [`Pool::try_checkout_bytes`], but the slot starts at the first arena offset of
    /// `prefer` where a slot of `bytes` can start now (free, a whole number of pages, inside
    /// one part, `keep` honoured: [`crate::allocation::extents::ExtentMap::alloc_preferring`]),
    /// else (with [`Preference::Prefer`]; [`Preference::OnlyThere`]: None) wherever first fit puts it. A zero-copy worker that keeps
    /// the extents of its last batches mapped asks for them again. (With `prefer`, a preferred
    /// extent free now is taken as it is; only where none is are the fences that have
    /// completed retired first, since their bytes are free only once retired: this runs on the
    /// consumer's thread once a batch, and retiring queries the driver for every fence in
    /// flight.)
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
        }
        Ok(slot)
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
    }

    /// Whether [`Pool::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.table.is_closed()
    }
}

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, whatever thread that is.
const PER_THREAD_DEFAULT_STREAM: StreamHandle = 2;

/// Threads that fault a new arena in: half the cores, rounded up. With every core, faulting
/// the arena in at the first batch takes every CPU the workers do not, and every thread of
/// the machine, the training thread included, wakes up late then; half leaves it a core and
/// does not delay the first batch (the figures: "The arena's fault threads" in
/// `docs/performance.md`).
fn fault_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get()).div_ceil(2)
}

/// The longest a pool being made waits for the freeing thread to finish a free it has begun
/// (a dropped pool's fences, say), before it makes its arena anyway.
const CATCH_UP_AT_MOST: Duration = Duration::from_secs(1);

/// A background pool makes at least this much of its arena (and at least one part, so the
/// largest slot) ready before it returns: small arenas are made whole, and a big one has room
/// for the first batches (torch itself pins each of them as it comes); a pool dropped soon
/// never faults the rest in.
const READY_FIRST: usize = 16 << 20;

#[cfg(test)]
mod tests;
