//! The pool: one fixed arena, handed out as page-aligned slots of any size and taken back.
//!
//! Why one long module: [`Pool`] is the one object every user holds, and everything here
//! (checkout and claim, release, copy-in, closing, the hand-over to the release thread) keeps
//! the same invariants over the same table, arena and fences; about 80 of its lines are the
//! note below that other modules point to, and about 250 are its tests.
//!
//! Invariants:
//! - A slot is an extent of the arena: the bytes its checkout asked for, rounded up to a page,
//!   inside one of the arena's parts (each a whole number of `slot_bytes`, the largest slot);
//!   the slot table ([`crate::slots`]) and its extent map ([`crate::extents`]) keep live
//!   extents disjoint.
//! - A slot is written or read through this module only while its ticket is live
//!   ([`SlotTable::is_live`]); every range copied in is checked against the source mapping and
//!   the slot first, so no copy reads or writes outside either.
//! - On a CUDA backend a release with a stream goes through the fence tracker (it only queues:
//!   no driver call on the releasing thread); a background thread (and any checkout that finds
//!   no free slot) records the fences and retires them as they complete. A slot with a pending
//!   fence is never handed out.
//! - The arena outlives every user: tickets are only usable through an `Arc<Pool>`. Dropping
//!   the last one only closes the table and hands what the pool owns to the release thread
//!   ([`crate::release`]), whatever thread drops it: there the pending fences are waited for,
//!   then the threads stopped and the arena freed (or, if a fence has not completed after
//!   30 s, the arena is leaked rather than free memory the GPU may read).
//! - A copy into a slot may run on a copy thread ([`Pool::copy_in_background`]): its job owns
//!   the pool, the source mapping and what keeps the slot out of the pool, and drops them only
//!   after the copy.
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
//! 1. **Made.** [`Pool::new`] makes the arena ([`crate::arena`]) and the slot table
//!    ([`crate::slots`]): a fixed number of entries and the arena's free bytes. When the pool
//!    makes the rest of its arena in the background, those bytes are free only once
//!    [`SlotTable::admit`] adds them, as their part is faulted in (and registered).
//! 2. **Checked out.** A free entry takes an extent of exactly the bytes asked for (rounded
//!    up to a page), carved by address-ordered first fit ([`crate::extents`] says why: batches
//!    are mostly consumed in order, so the oldest bytes free first and the next batch lands
//!    there again; a batch kept for long holds only its own bytes, the others flow around
//!    it; nothing is rounded to a power of two). `Free -> CheckedOut`, with a new generation;
//!    the [`Ticket`] (table, index, generation) names this one checkout. Copy mode: the main
//!    process checks it out when a worker's batch arrives, of that batch's size (Python:
//!    `Receiver._claim` in `_main/receiver.py`). Zero-copy: it is checked out as torch
//!    dispatches a batch's indices, before the batch exists, of a size guessed from the
//!    recent batches (Python: `_main/tickets.py`, `_main/sizing.py`), and its place in the
//!    arena (memfd, offset, length, generation, a nonce) travels to the worker with them; a
//!    batch that does not fit comes through copy mode into a slot of its own size.
//!    When there is no room: a claim waits while room is on its way (fenced slots, parts not
//!    ready yet); when nothing is on its way, every other byte is held by batches someone
//!    keeps (or cut by them into pieces too small), and [`Pool::claim`] says so rather than
//!    wait forever (the loader then uses ordinary memory for that batch, counted, or waits
//!    up to its timeout, as the user chose).
//! 3. **Filled.** Copy mode: [`Pool::copy_in`] copies the batch from the worker's segment
//!    ([`crate::transport::segment`]), every range checked against the segment and the slot. Zero-copy:
//!    the worker writes the batch into its own mapping of the slot; the main process accepts
//!    it only for the slot handed out with those indices (index, generation, nonce) and only
//!    if every array lies inside the slot (Python: `Receiver._adopt`; the worker's side is
//!    `_worker/places.py`).
//! 4. **Delivered.** Tensors viewing the slot (pinned CPU batches), or an asynchronous copy to
//!    the GPU on pinpool's stream, after which the slot is released at once, fenced on that
//!    stream (Python: `_main/delivery.py`).
//! 5. **Released.** When the last view of the batch dies (or on an explicit `release`), the
//!    binding releases the ticket with torch's current stream: `CheckedOut -> Fenced`, and
//!    `(ticket, stream)` is queued ([`crate::fence`]); without CUDA, straight to `Free`. No
//!    driver call on the releasing thread, which may hold the GIL.
//! 6. **Fenced.** The fence thread (or a checkout that finds nothing free) records one event
//!    per stream for everything queued and polls the events; when a slot's event completes,
//!    `Fenced -> Free`, and its bytes go back to the extent map, merged with free neighbours.
//!    No byte is handed out again before then. A fence that fails frees its slots only after
//!    a wait for the whole device.
//! 7. **Reused.** The next checkout bumps the generation again: every ticket of an earlier
//!    checkout (a stale handle, a second release) is refused with `SlotReleased`.
//! 8. **Freed.** When the last reference to the pool goes, the release thread
//!    ([`crate::release`]) waits for the fences still pending, then frees the arena.

use std::mem::ManuallyDrop;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::arena::{Arena, Backend, Residency};
use crate::copy::{Copier, CopyDone, CopyRange, SetWhenDropped, MAX_COPY_THREADS};
use crate::cuda::{Event, StreamHandle};
use crate::error::{Error, Result};
use crate::fence::{CudaFences, FenceTracker, Fences};
use crate::release;
use crate::shm::{check_range, page_size, round_up, Mapping};
use crate::slots::{Bytes, Counts, Layout, SlotTable, Ticket};
use crate::transport::reclaim::Reclaimer;

/// What to build.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The largest slot (rounded up to a page): the arena's parts are whole multiples of it,
    /// and a checkout that does not say its size gets this many bytes.
    pub slot_bytes: usize,
    /// The most slots out or fenced at once.
    pub num_slots: usize,
    /// The arena's size, rounded up to a whole number of `slot_bytes`; `None`:
    /// `slot_bytes * num_slots` (equal slots).
    pub arena_bytes: Option<usize>,
    /// CUDA device ordinal, or `None` for no CUDA. (The Python layer's automatic choice,
    /// the rank's own device, is [`crate::device_choice::DeviceRequest::resolve`].)
    pub device: Option<usize>,
    /// Backend, or `None` to choose.
    pub backend: Option<Backend>,
    /// Threads for copies.
    pub copy_threads: usize,
    /// Make only the first slots (at least one, at least 64 MiB) ready before
    /// [`Pool::new`] returns, and the rest on a background thread (checkouts wait for slots not ready yet). The arena then no longer
    /// sits on the critical path of the first batch.
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

/// Counters reported by `pool.stats()`. Shared ([`Pool::counters`]) so that the last figures
/// can still be read once the pool itself is gone.
#[derive(Debug, Default)]
pub struct Counters {
    checkouts: AtomicU64,
    waits: AtomicU64,
    wait_ns: AtomicU64,
    releases: AtomicU64,
    bytes_copied: AtomicU64,
    copies: AtomicU64,
    segments_mapped: AtomicU64,
    /// Written when the pool drops (live values come from the reclaimer and the fences).
    final_unmapped: AtomicU64,
    final_fence_errors: AtomicU64,
    num_slots: AtomicU64,
    arena_bytes: AtomicU64,
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
            segments_mapped: self.segments_mapped.load(Ordering::Relaxed),
            segments_unmapped: self.final_unmapped.load(Ordering::Relaxed),
            pending_unmaps: 0,
            fence_errors: self.final_fence_errors.load(Ordering::Relaxed),
            bytes: {
                let arena = self.arena_bytes.load(Ordering::Relaxed) as usize;
                Bytes { arena, free: arena, largest_free: 0, holes: 0, ..Bytes::default() }
            },
        }
    }
}

/// How [`Pool::claim`] may take a slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimRules {
    /// Bytes to leave free in one range for other claims: only a claim that leaves this much
    /// takes its slot at once.
    pub reserve: usize,
    /// How long to wait for a slot on its way; `None` waits as long as one is coming.
    pub timeout: Option<Duration>,
    /// Advise [`Claim::Overflow`] when no slot is free and none is on its way (every slot is
    /// held by a batch the consumer keeps alive: waiting could wait forever).
    pub overflow: bool,
    /// Never wait for what only the consumer can give back: answer [`Claim::Later`] when the
    /// free and coming bytes would not hold this slot and the reserve, or the timeout has
    /// passed.
    pub defer: bool,
}

/// What [`Pool::claim`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A slot, checked out.
    Slot(Ticket),
    /// Come back later (only with [`ClaimRules::defer`]).
    Later,
    /// Put this batch in ordinary memory (only with [`ClaimRules::overflow`]).
    Overflow,
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
    /// Segments mapped.
    pub segments_mapped: u64,
    /// Segments unmapped by the reclaimer.
    pub segments_unmapped: u64,
    /// Segments waiting for the reclaimer.
    pub pending_unmaps: u64,
    /// Fence queries that failed.
    pub fence_errors: u64,
    /// The arena's bytes by state.
    pub bytes: Bytes,
}

/// The slot pool.
pub struct Pool {
    /// Dropped by hand in `Drop`, and only once no GPU work can still read it.
    arena: ManuallyDrop<Arena>,
    slot_bytes: usize,
    /// The longest part of the arena: no slot is longer.
    largest_part: usize,
    /// Moved to the release thread with the arena (the fences are retired against it).
    table: ManuallyDrop<SlotTable>,
    /// These three own threads (and CUDA events): dropped by hand, in the creating process only.
    fences: ManuallyDrop<Option<FenceTracker>>,
    copier: ManuallyDrop<Copier>,
    reclaimer: ManuallyDrop<Reclaimer>,
    /// The process that made the pool, and the fork count there ([`crate::forks`]).
    owner: u32,
    owner_forks: u64,
    counters: Arc<Counters>,
    retirer: OnceLock<std::thread::Thread>,
    /// Set while the fence thread sleeps with nothing to do: only then does a release wake it.
    retirer_idle: AtomicBool,
    stopping: AtomicBool,
    /// Retired segments still borrowed by a copy; handed to the reclaimer once free.
    lingering: Mutex<Vec<Arc<Mapping>>>,
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
        let arena = if config.background {
            Arena::new_partial(
                arena_len,
                slot_bytes,
                config.device,
                config.backend,
                fault_threads(),
                slot_bytes.max(READY_FIRST),
            )?
        } else {
            Arena::new(arena_len, slot_bytes, config.device, config.backend, fault_threads())?
        };
        let table = Self::table_over(&arena, config.num_slots, slot_bytes)?;
        let fences = arena.device().map(|device| Box::new(CudaFences::new(device)) as _);
        let pool = Self::assemble(arena, slot_bytes, table, fences, config.copy_threads)?;
        if pool.arena.ready_len() < pool.arena.len() {
            let weak = Arc::downgrade(&pool);
            std::thread::Builder::new()
                .name("pinpool-prepare".into())
                .spawn(move || prepare_loop(weak))
                .map_err(|e| Error::Invalid(format!("cannot start the prepare thread: {e}")))?;
        }
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

    /// The arena's length: `arena_bytes` rounded up to whole slots, else `num_slots` slots.
    fn arena_len(config: &PoolConfig, slot_bytes: usize) -> Result<usize> {
        let len = match config.arena_bytes {
            Some(0) => return Err(Error::Invalid("arena_bytes must be positive".into())),
            Some(n) => n.checked_next_multiple_of(slot_bytes),
            None => slot_bytes.checked_mul(config.num_slots),
        };
        len.ok_or_else(|| Error::Invalid("the arena's size overflows the address space".into()))
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
        if crate::forks::current() == self.owner_forks {
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
            reclaimer: ManuallyDrop::new(Reclaimer::start()?),
            owner: std::process::id(),
            owner_forks: crate::forks::current(),
            counters: Arc::new(Counters {
                num_slots: AtomicU64::new(n),
                arena_bytes: AtomicU64::new(arena_len as u64),
                ..Counters::default()
            }),
            retirer: OnceLock::new(),
            retirer_idle: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            lingering: Mutex::new(Vec::new()),
            prepare_error: OnceLock::new(),
        });
        if pool.fences.is_some() {
            let weak = Arc::downgrade(&pool);
            let handle = std::thread::Builder::new()
                .name("pinpool-fences".into())
                .spawn(move || retire_loop(weak))
                .map_err(|e| Error::Invalid(format!("cannot start the fence thread: {e}")))?;
            let _ = pool.retirer.set(handle.thread().clone());
        }
        Ok(pool)
    }

    /// Bytes per slot (a multiple of the page size).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
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
    pub fn try_checkout(&self) -> Result<Option<Ticket>> {
        self.try_checkout_bytes(self.slot_bytes, 0)
    }

    /// Takes a slot of `bytes` (rounded up to a page) without waiting, if there is room for
    /// it with `keep` bytes left in one free range afterwards. A size no slot can ever have
    /// is [`Error::BatchTooLarge`].
    pub fn try_checkout_bytes(&self, bytes: usize, keep: usize) -> Result<Option<Ticket>> {
        self.check_owner()?;
        if self.table.is_closed() {
            return Err(Error::Closed);
        }
        self.check_size(bytes)?;
        let mut ticket = self.table.try_checkout_bytes(bytes, keep);
        if ticket.is_none() {
            if let Some(f) = self.fences.as_ref() {
                if f.try_retire_ready(&self.table) > 0 {
                    ticket = self.table.try_checkout_bytes(bytes, keep);
                }
            }
        }
        if let Some(t) = ticket {
            if self.table.is_closed() {
                // Closed while we took it: give it back, so no checkout outlives `close()`.
                let _ = self.table.release(t, false);
                return Err(Error::Closed);
            }
            self.counters.checkouts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(ticket)
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

    /// Takes a slot of `bytes` by the DataLoader's rules (see [`Claim`] and [`ClaimRules`]),
    /// waiting on the slot table's condition variable (not polling) while room is on its way.
    ///
    /// Room is on its way while a fenced slot or a part of the arena not ready yet exists:
    /// both come back by themselves. Without either, nothing the pool can do makes room:
    /// every other byte is held by a slot someone keeps (or the free bytes are cut into
    /// pieces by such slots), and waiting could wait forever; then [`ClaimRules::overflow`]
    /// advises [`Claim::Overflow`], and otherwise the claim waits up to its timeout.
    pub fn claim(&self, bytes: usize, rules: &ClaimRules) -> Result<Claim> {
        let start = Instant::now();
        loop {
            let epoch = self.table.epoch();
            if let Some(t) = self.try_checkout_bytes(bytes, rules.reserve)? {
                return Ok(Claim::Slot(t));
            }
            let (c, b) = (self.slot_counts(), self.table.bytes());
            // Fenced slots come back as the GPU finishes reading them, preparing bytes as the
            // background thread makes them ready: both are worth waiting for.
            let coming = b.fenced + b.preparing;
            let entries_needed = if rules.reserve > 0 { 2 } else { 1 };
            let room_once_back = b.free + coming >= bytes.saturating_add(rules.reserve)
                && self.table.spare_entries() + c.fenced >= entries_needed;
            let left = rules.timeout.map(|t| t.saturating_sub(start.elapsed()));
            let expired = left.is_some_and(|l| l.is_zero());
            if rules.defer && (!room_once_back || expired) {
                return Ok(Claim::Later);
            }
            if coming == 0 && rules.overflow {
                return Ok(Claim::Overflow);
            }
            if expired {
                return Err(Error::Exhausted {
                    waited_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
                    num_slots: self.num_slots(),
                });
            }
            if rules.reserve > 0 && room_once_back {
                // Only the reserve stands in the way, and enough is on its way for the other
                // claims once it arrives: take the room now.
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

    /// Slots of `slot_bytes` that could be checked out right now (a snapshot).
    pub fn free_slots(&self) -> usize {
        self.table.counts().free
    }

    /// Takes a free slot of `slot_bytes`, waiting up to `timeout` (forever with `None`).
    pub fn checkout(&self, timeout: Option<Duration>) -> Result<Ticket> {
        self.checkout_bytes(self.slot_bytes, timeout)
    }

    /// Takes a slot of `bytes`, waiting up to `timeout` (forever with `None`).
    pub fn checkout_bytes(&self, bytes: usize, timeout: Option<Duration>) -> Result<Ticket> {
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
    ) -> Result<Ticket> {
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
                            num_slots: self.num_slots(),
                        });
                    }
                    nap.min(limit - elapsed)
                }
                None => nap,
            };
            self.table.wait(epoch, nap);
        }
    }

    /// Where the slot `ticket` holds lies in the arena, `(offset, len)`, if the ticket is
    /// live.
    pub fn extent(&self, ticket: Ticket) -> Result<(usize, usize)> {
        self.table.extent(ticket).ok_or(Error::SlotReleased { index: ticket.index as usize })
    }

    /// Whether `ticket`'s slot was released and waits for its fence.
    pub fn is_fenced(&self, ticket: Ticket) -> bool {
        ticket.table == self.table.id()
            && self.table.state(ticket.index as usize)
                == Some((crate::slots::State::Fenced, ticket.generation))
    }

    /// The length of the slot `ticket` holds, if the ticket is live.
    pub fn slot_len(&self, ticket: Ticket) -> Result<usize> {
        self.extent(ticket).map(|e| e.1)
    }

    /// The first byte of the slot `ticket` holds, if the ticket is live.
    pub fn slot_ptr(&self, ticket: Ticket) -> Result<*mut u8> {
        let (offset, _) = self.extent(ticket)?;
        // SAFETY: a live ticket's extent lies inside the arena (the slot table carves
        // extents only from `[0, arena.len())`).
        Ok(unsafe { self.arena.base().add(offset) })
    }

    /// Ends the checkout. With a stream (on a fenced pool) the slot returns once the work
    /// queued on that stream so far has finished; otherwise at once.
    pub fn release(&self, ticket: Ticket, stream: Option<StreamHandle>) -> Result<()> {
        match (self.fences.as_ref(), stream) {
            (Some(f), Some(PER_THREAD_DEFAULT_STREAM)) => {
                f.release_fenced_now(&self.table, ticket, PER_THREAD_DEFAULT_STREAM)?;
            }
            (Some(f), Some(stream)) => {
                f.release_fenced(&self.table, ticket, stream)?;
                if self.retirer_idle.swap(false, Ordering::AcqRel) {
                    if let Some(t) = self.retirer.get() {
                        t.unpark();
                    }
                }
            }
            _ => self.table.release(ticket, false)?,
        }
        self.counters.releases.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Frees every fenced slot whose fence has completed; returns how many.
    pub fn retire_fences(&self) -> usize {
        self.fences.as_ref().map_or(0, |f| f.retire_ready(&self.table))
    }

    /// Copies `ranges` from `src` (offsets relative to the mapping) into the slot of `ticket`
    /// (offsets relative to the slot). Every range is checked first: a source range outside
    /// the mapping or a destination outside the slot is an error and nothing is copied.
    pub fn copy_in(&self, ticket: Ticket, src: &Mapping, ranges: &[CopyRange]) -> Result<usize> {
        let dst = self.copy_target(ticket, src, ranges)?;
        // SAFETY: every range was checked against the mapping and the slot just above, and
        // destination ranges are disjoint; the slot is ours while the ticket is live (the
        // caller holds it), and `src` stays mapped for this call (borrowed).
        let n = unsafe { self.copier.copy(src.as_ptr(), dst, ranges) };
        self.counters.bytes_copied.fetch_add(n as u64, Ordering::Relaxed);
        self.counters.copies.fetch_add(1, Ordering::Relaxed);
        Ok(n)
    }

    /// The checks of [`Pool::copy_in`]: the slot's first byte if `ranges` may be copied from
    /// `src` into the slot of `ticket`.
    fn copy_target(&self, ticket: Ticket, src: &Mapping, ranges: &[CopyRange]) -> Result<*mut u8> {
        self.check_owner()?;
        let (offset, len) = self.extent(ticket)?;
        validate_ranges(ranges, src.len(), len)?;
        // SAFETY: as in `slot_ptr`: the extent lies inside the arena.
        Ok(unsafe { self.arena.base().add(offset) })
    }

    /// [`Pool::copy_in`], then a copy of the slot's first `len` bytes to device memory at
    /// `dst` queued on `stream`, and an event recorded after it: returns the event. Only on
    /// a pool whose arena the driver pinned.
    ///
    /// # Safety
    /// `[dst, dst+len)` is memory of the arena's device that stays allocated until the copy
    /// has run and that nothing else writes. The caller releases the slot fenced on `stream`
    /// (or on a stream ordered after it), so it is not reused under the queued copy.
    pub unsafe fn copy_in_and_send(
        &self,
        ticket: Ticket,
        src: &Mapping,
        ranges: &[CopyRange],
        dst: u64,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        self.send_checks(ticket, len)?; // before the copy in: an error copies nothing
        self.copy_in(ticket, src, ranges)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.send(ticket, dst, len, stream) }
    }

    /// Queues a copy of the first `len` bytes of the slot of `ticket` to device memory `dst`
    /// on `stream`, and an event after it (a zero-copy batch, already in its slot).
    ///
    /// # Safety
    /// As [`Pool::copy_in_and_send`]: `dst` is device memory of the pool's device with room
    /// for `len` bytes, live until the copy has run, and the caller keeps the slot checked
    /// out and releases it fenced on `stream` (or later).
    pub unsafe fn send(
        &self,
        ticket: Ticket,
        dst: u64,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        let device = self.send_checks(ticket, len)?;
        let slot = self.slot_ptr(ticket)?;
        // SAFETY: the slot is pinned arena memory, live while the caller holds the ticket and
        // not reused before the fence the caller records on `stream`; `len` fits in it
        // (checked above); the caller vouches for `dst`.
        unsafe { device.send(dst, slot, len, stream) }
    }

    /// The device a copy of `len` bytes from the slot of `ticket` goes to: refused on a pool
    /// the driver did not pin, or for more bytes than the slot holds.
    fn send_checks(&self, ticket: Ticket, len: usize) -> Result<&Arc<crate::cuda::Device>> {
        let Some(device) = self.arena.device() else {
            return Err(Error::Invalid(
                "copies to a device need a pool of pinned memory on that device".into(),
            ));
        };
        let size = self.slot_len(ticket)?;
        if len > size {
            return Err(Error::OutOfRange { what: "slot", offset: 0, len, size });
        }
        Ok(device)
    }

    /// As [`Pool::copy_in`] into the slot of `ticket`, but on one of the copy threads: checks
    /// everything first (an error queues nothing), then returns at once. On the copy thread,
    /// after the copy, `then(&src)` runs, `hold` is dropped and the returned [`CopyDone`] is
    /// set.
    ///
    /// # Safety
    /// `hold` keeps the slot of `ticket` checked out (out of the pool) until it is dropped: a
    /// pin of the slot's lease (`crate::lease::OwnedPin`), whose drop carries out a release
    /// that waited for it.
    pub unsafe fn copy_in_background<H: Send + 'static>(
        self: &Arc<Self>,
        ticket: Ticket,
        hold: H,
        src: Arc<Mapping>,
        ranges: Vec<CopyRange>,
        then: impl FnOnce(&Mapping) + Send + 'static,
    ) -> Result<Arc<CopyDone>> {
        let dst = self.copy_target(ticket, &src, &ranges)? as usize;
        let done = Arc::new(CopyDone::default());
        let set = SetWhenDropped(Arc::clone(&done));
        let pool = Arc::clone(self);
        self.copier.spawn(move || {
            // SAFETY: every range was checked against the mapping and the slot above, and
            // destination ranges are disjoint; the slot stays checked out while `hold` lives
            // (the caller's contract), the mapping while `src` does, and the arena while
            // `pool` does; all three are owned by this job.
            let n = unsafe { pool.copier.copy(src.as_ptr(), dst as *mut u8, &ranges) };
            pool.counters.bytes_copied.fetch_add(n as u64, Ordering::Relaxed);
            pool.counters.copies.fetch_add(1, Ordering::Relaxed);
            then(&src);
            drop(src);
            pool.reap_lingering();
            drop(hold);
            drop(set); // the waiter sees the copy (and a release that waited for it) done
            drop(pool);
        });
        Ok(done)
    }

    /// Copies `ranges` from `src` into caller-owned memory `[dst, dst + dst_len)` (the
    /// overflow path: a batch that gets no slot). Ranges are validated as in `copy_in`.
    ///
    /// # Safety
    /// `[dst, dst + dst_len)` is writable, not aliased by `src`, and not accessed by anyone
    /// else during the call.
    pub unsafe fn copy_out(
        &self,
        src: &Mapping,
        dst: *mut u8,
        dst_len: usize,
        ranges: &[CopyRange],
    ) -> Result<usize> {
        self.check_owner()?;
        validate_ranges(ranges, src.len(), dst_len)?;
        // SAFETY: ranges validated against both sides; the caller vouches for `dst`.
        let n = unsafe { self.copier.copy(src.as_ptr(), dst, ranges) };
        self.counters.bytes_copied.fetch_add(n as u64, Ordering::Relaxed);
        self.counters.copies.fetch_add(1, Ordering::Relaxed);
        Ok(n)
    }

    /// Maps a shared-memory segment received as `fd`, `len` bytes long.
    pub fn map_segment(&self, fd: OwnedFd, len: usize, writable: bool) -> Result<Mapping> {
        let m = Mapping::from_fd(fd, len, writable)?;
        self.counters.segments_mapped.fetch_add(1, Ordering::Relaxed);
        Ok(m)
    }

    /// Hands a segment to the background thread to unmap and close.
    pub fn retire_segment(&self, mapping: Mapping) {
        self.reclaimer.retire(mapping);
    }

    /// Retires a segment that copies may still borrow: it goes to the reclaimer as soon as
    /// no copy holds it (checked here and by [`Pool::reap_lingering`]).
    pub fn retire_shared_segment(&self, mapping: Arc<Mapping>) {
        match Arc::try_unwrap(mapping) {
            Ok(m) => self.reclaimer.retire(m),
            Err(shared) => self.lingering.lock().unwrap_or_else(|e| e.into_inner()).push(shared),
        }
    }

    /// Hands every lingering segment that no copy borrows any more to the reclaimer.
    pub fn reap_lingering(&self) {
        let free: Vec<Mapping> = {
            let mut lingering = self.lingering.lock().unwrap_or_else(|e| e.into_inner());
            let (free, busy): (Vec<_>, Vec<_>) = std::mem::take(&mut *lingering)
                .into_iter()
                .partition(|m| Arc::strong_count(m) == 1);
            *lingering = busy;
            free.into_iter().filter_map(|m| Arc::try_unwrap(m).ok()).collect()
        };
        for m in free {
            self.reclaimer.retire(m);
        }
    }

    /// Waits until every retired segment is unmapped.
    pub fn flush_unmaps(&self) {
        self.reap_lingering();
        self.reclaimer.flush();
    }

    /// Why the background preparation of the arena stopped short (those slots are never
    /// handed out), if it did.
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

    /// The counters, which outlive the pool (see [`Counters::final_stats`]).
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// Slots by state.
    pub fn slot_counts(&self) -> Counts {
        let mut slots = self.table.counts();
        if self.prepare_error.get().is_some() {
            slots.preparing = 0; // they never will be ready
        }
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
            segments_mapped: c.segments_mapped.load(Ordering::Relaxed),
            segments_unmapped: self.reclaimer.unmapped(),
            pending_unmaps: self.reclaimer.pending()
                + self.lingering.lock().unwrap_or_else(|e| e.into_inner()).len() as u64,
            fence_errors: self.fences.as_ref().map_or(0, FenceTracker::errors),
            bytes: self.table.bytes(),
        }
    }

    /// The arena's bytes by state.
    pub fn bytes(&self) -> Bytes {
        self.table.bytes()
    }
}

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, whatever thread that is.
const PER_THREAD_DEFAULT_STREAM: StreamHandle = 2;

/// Threads that fault a new arena in: half the cores, rounded up. With every core (the
/// H200's 16), faulting the arena in at the first batch took every CPU the workers did not:
/// every thread of the machine woke up 4 to 8 ms late then, a sleeper in another process as
/// late as the training process's own. With half, the worst wake-up in the first batch fell
/// to 0.6 to 1.1 ms, and the time to the first batch stayed the same (0.94x to 1.02x torch's,
/// `benchmarks/results/h200-gil-free-views/stall/`).
fn fault_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get()).div_ceil(2)
}

/// Checks copy ranges: sources inside `src_len`, destinations inside `dst_len`, destinations
/// pairwise disjoint.
pub fn validate_ranges(ranges: &[CopyRange], src_len: usize, dst_len: usize) -> Result<()> {
    let mut dst: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
    for r in ranges {
        check_range("source", r.src, r.len, src_len)?;
        if r.dst.checked_add(r.len).is_none_or(|end| end > dst_len) {
            return Err(Error::BatchTooLarge {
                needed: r.dst.saturating_add(r.len),
                slot_bytes: dst_len,
            });
        }
        if r.len > 0 {
            dst.push((r.dst, r.dst + r.len));
        }
    }
    dst.sort_unstable();
    if let Some(w) = dst.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(Error::Invalid(format!(
            "destination ranges overlap: [{}, {}) and [{}, {})",
            w[0].0, w[0].1, w[1].0, w[1].1
        )));
    }
    Ok(())
}

/// Makes the arena's parts ready one by one, admitting each part's slots as it is. Stops when
/// every part is ready, the pool is closed or dropped, or a part fails (its error is kept:
/// [`Pool::prepare_error`]; those slots are never handed out).
fn prepare_loop(pool: Weak<Pool>) {
    crate::background::become_background();
    let mut pinned = false;
    // Half the fault threads (a quarter of the cores): the workers are starting meanwhile.
    let threads = fault_threads().div_ceil(2);
    loop {
        // Declared first, dropped last: if this thread drops the pool's last reference, the
        // release is queued before a flush may stop waiting for it.
        let _hold = release::hold();
        let Some(pool) = pool.upgrade() else { return };
        // Nobody else holds the pool any more: stop, and let it go now.
        if pool.stopping.load(Ordering::Acquire)
            || pool.table.is_closed()
            || Arc::strong_count(&pool) == 1
        {
            return;
        }
        if !pinned {
            // Near the arena's memory, like the threads it starts to fault it in.
            pool.arena.placement().pin_calling_thread();
            pinned = true;
        }
        match pool.arena.prepare_next(threads) {
            Ok(Some((offset, len))) => {
                pool.table.admit(offset, len);
            }
            Ok(None) => return,
            Err(e) => {
                let _ = pool.prepare_error.set(e.to_string());
                return;
            }
        }
    }
}

fn retire_loop(pool: Weak<Pool>) {
    const MIN_NAP: Duration = Duration::from_micros(20);
    const MAX_NAP: Duration = Duration::from_millis(1);
    let mut nap = MIN_NAP;
    loop {
        let idle = {
            let Some(pool) = pool.upgrade() else { return };
            if pool.stopping.load(Ordering::Acquire) {
                return;
            }
            let retired = pool.retire_fences();
            nap = if retired > 0 { MIN_NAP } else { (nap * 2).min(MAX_NAP) };
            let pending = || pool.fences.as_ref().map_or(0, FenceTracker::pending);
            // Announce the idle sleep first, then look again, so no release slips between.
            pool.retirer_idle.store(pending() == 0, Ordering::SeqCst);
            pool.retirer_idle.load(Ordering::SeqCst) && pending() == 0
        };
        if idle {
            nap = MIN_NAP;
            std::thread::park_timeout(Duration::from_millis(50));
        } else {
            std::thread::park_timeout(nap);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A forked child's copy: its threads and CUDA context exist only in the parent, so
            // waiting for or calling them here would hang or fail. The child's copy of the
            // arena, the threads' stacks and the fds go when the child exits.
            return;
        }
        self.stopping.store(true, Ordering::Release);
        self.table.close();
        let lingering =
            std::mem::take(&mut *self.lingering.lock().unwrap_or_else(|e| e.into_inner()));
        // SAFETY: each field is taken exactly once, here, in the process that made it, and
        // never touched again: this is the pool's drop, and `ManuallyDrop` fields are not
        // dropped a second time.
        let remains = unsafe {
            Remains {
                arena: ManuallyDrop::take(&mut self.arena),
                table: ManuallyDrop::take(&mut self.table),
                fences: ManuallyDrop::take(&mut self.fences),
                copier: ManuallyDrop::take(&mut self.copier),
                reclaimer: ManuallyDrop::take(&mut self.reclaimer),
                lingering,
                counters: Arc::clone(&self.counters),
                dropped_on: crate::background::thread_id(),
            }
        };
        release::submit(Box::new(move || remains.free()));
    }
}

/// What a dropped pool leaves for the release thread to free.
struct Remains {
    arena: Arena,
    table: SlotTable,
    fences: Option<FenceTracker>,
    copier: Copier,
    reclaimer: Reclaimer,
    lingering: Vec<Arc<Mapping>>,
    counters: Arc<Counters>,
    dropped_on: u64,
}

impl Remains {
    /// Waits for pending fences, stops the pool's threads, frees the arena.
    fn free(self) {
        let start = Instant::now();
        let Remains { arena, table, fences, copier, reclaimer, lingering, counters, dropped_on } =
            self;
        // GPU work may still read fenced slots: keep the arena until it has finished. A fence
        // that never completes (a hung stream) would make this wait forever; after a bound we
        // leak the arena instead, which is safe, where freeing it would not be.
        let deadline = Instant::now() + DROP_FENCE_WAIT;
        let mut fenced_forever = false;
        if let Some(f) = fences.as_ref() {
            while f.pending() > 0 {
                if Instant::now() > deadline {
                    fenced_forever = true;
                    break;
                }
                if f.retire_ready(&table) == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        for m in lingering {
            // Nothing can borrow a segment once the pool itself is gone: a copy holds the pool.
            if let Ok(m) = Arc::try_unwrap(m) {
                reclaimer.retire(m);
            }
        }
        reclaimer.shutdown();
        counters.final_unmapped.store(reclaimer.unmapped(), Ordering::Relaxed);
        counters
            .final_fence_errors
            .store(fences.as_ref().map_or(0, FenceTracker::errors), Ordering::Relaxed);
        drop(fences);
        drop(copier);
        drop(reclaimer);
        let bytes = arena.len();
        if fenced_forever {
            std::mem::forget(arena);
        } else {
            drop(arena);
        }
        drop(table);
        release::record(release::Freed {
            bytes: if fenced_forever { 0 } else { bytes },
            dropped_on,
            freed_on: crate::background::thread_id(),
            seconds: start.elapsed().as_secs_f64(),
        });
    }
}

/// A background pool makes at least this much of its arena (and at least one part, so the
/// largest slot) ready before it returns: small arenas are made whole, and a big one has room
/// for the first batches (torch itself pins each of them as it comes); a pool dropped soon
/// never faults the rest in.
const READY_FIRST: usize = 16 << 20;

/// How long dropping a pool waits for pending fences before leaking the arena instead.
const DROP_FENCE_WAIT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::ManualFences;
    use proptest::prelude::*;

    /// Offsets: mostly small (so that ranges meet the bounds exactly, and each other, often),
    /// sometimes next to `usize::MAX`.
    fn offset() -> impl Strategy<Value = usize> {
        prop_oneof![10 => 0..48usize, 10 => 0..300usize, 1 => (usize::MAX - 600)..=usize::MAX]
    }

    /// Lengths: mostly short (so that lists fit and overlap often), sometimes huge.
    fn length() -> impl Strategy<Value = usize> {
        prop_oneof![
            10 => 0..8usize,
            6 => 0..64usize,
            3 => 0..600usize,
            1 => (usize::MAX - 600)..=usize::MAX,
        ]
    }

    proptest! {
        #![proptest_config(crate::proptest_config(1024))]

        /// `validate_ranges` accepts exactly the lists a brute-force check accepts: every
        /// source inside `src_len`, every destination inside `dst_len`, without overflow, and
        /// no two non-empty destinations overlapping. It never panics.
        #[test]
        fn range_validation_matches_brute_force(
            ranges in proptest::collection::vec((offset(), offset(), length()), 0..6),
            src_len in prop_oneof![0..64usize, 256..1024usize],
            dst_len in prop_oneof![0..64usize, 256..1024usize],
        ) {
            let ranges: Vec<CopyRange> =
                ranges.into_iter().map(|(src, dst, len)| CopyRange { src, dst, len }).collect();
            let inside = |off: usize, len: usize, size: usize| {
                off.checked_add(len).is_some_and(|end| end <= size)
            };
            let in_bounds = ranges
                .iter()
                .all(|r| inside(r.src, r.len, src_len) && inside(r.dst, r.len, dst_len));
            // Only asked once every range is in bounds, so the ends cannot overflow.
            let disjoint = || ranges.iter().enumerate().all(|(i, a)| {
                ranges[i + 1..].iter().all(|b| {
                    a.len == 0 || b.len == 0 || a.dst + a.len <= b.dst || b.dst + b.len <= a.dst
                })
            });
            let got = validate_ranges(&ranges, src_len, dst_len);
            prop_assert_eq!(got.is_ok(), in_bounds && disjoint(), "{:?}: {:?}", ranges, got);
        }
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn slots_are_page_aligned_and_disjoint() {
        let pool = Pool::new(&PoolConfig::host(1000, 3)).unwrap();
        assert_eq!(pool.slot_bytes() % page_size(), 0);
        let a = pool.checkout(None).unwrap();
        let b = pool.checkout(None).unwrap();
        let (pa, pb) = (pool.slot_ptr(a).unwrap() as usize, pool.slot_ptr(b).unwrap() as usize);
        assert_eq!(pa % page_size(), 0);
        assert!(pa.abs_diff(pb) >= pool.slot_bytes());
        pool.release(a, None).unwrap();
        assert!(pool.slot_ptr(a).is_err(), "a released ticket has no memory");
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn checkout_times_out_with_exhausted() {
        let pool = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
        let _held = pool.checkout(None).unwrap();
        let t0 = Instant::now();
        let err = pool.checkout(Some(Duration::from_millis(30))).unwrap_err();
        assert!(matches!(err, Error::Exhausted { num_slots: 1, .. }), "{err}");
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert_eq!(pool.stats().waits, 1);
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn close_wakes_waiters_and_refuses_checkouts() {
        let pool = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
        let held = pool.checkout(None).unwrap();
        let p2 = Arc::clone(&pool);
        let waiter = std::thread::spawn(move || p2.checkout(None));
        std::thread::sleep(Duration::from_millis(20));
        pool.close();
        assert_eq!(waiter.join().unwrap(), Err(Error::Closed));
        // A slot still out can be released after close.
        pool.release(held, None).unwrap();
        assert_eq!(pool.try_checkout(), Err(Error::Closed));
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn fenced_release_is_retired_by_the_background_thread() {
        let fences = Arc::new(ManualFences::new());
        let pool = Pool::with_fences(&PoolConfig::host(4096, 1), Box::new(fences.clone())).unwrap();
        let t = pool.checkout(None).unwrap();
        pool.release(t, Some(5)).unwrap();
        assert_eq!(pool.try_checkout().unwrap(), None);
        assert_eq!(pool.stats().slots.fenced, 1);
        fences.complete_stream(5);
        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.stats().slots.free == 0 {
            assert!(Instant::now() < deadline, "the fence thread never retired the slot");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(pool.try_checkout().unwrap().is_some());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_background_pool_hands_out_every_slot_once_ready() {
        let n = 24;
        let config = PoolConfig { background: true, ..PoolConfig::host(8 << 20, n) };
        let pool = Pool::new(&config).unwrap();
        let c = pool.stats().slots;
        assert!(c.free >= READY_FIRST / (8 << 20), "the first slots are not ready: {c:?}");
        assert_eq!(c.free + c.preparing, n);
        let mut seen: Vec<u32> =
            (0..n).map(|_| pool.checkout(Some(Duration::from_secs(30))).unwrap().index).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
        assert_eq!(pool.stats().slots.preparing, 0);
        assert_eq!(pool.arena().ready_len(), pool.arena().len());
        assert!(pool.prepare_error().is_none());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_background_pool_dropped_while_preparing_is_freed() {
        let config = PoolConfig { background: true, ..PoolConfig::host(4 << 20, 29) };
        drop(Pool::new(&config).unwrap());
        assert!(release::flush(Some(Duration::from_secs(30))));
        assert!(freed_record(29 * (4 << 20)).is_some());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn claims_follow_the_loaders_rules() {
        let fences = Arc::new(ManualFences::new());
        let pool = Pool::with_fences(&PoolConfig::host(4096, 2), Box::new(fences.clone())).unwrap();
        let quick = Some(Duration::from_millis(30));
        let ahead = ClaimRules { reserve: 4096, timeout: quick, overflow: false, defer: true };
        let own = ClaimRules { reserve: 0, timeout: quick, overflow: true, defer: false };
        let strict = ClaimRules { reserve: 0, timeout: quick, overflow: false, defer: false };
        // Two free: ahead takes one, then leaves the last one to the consumer.
        let Claim::Slot(a) = pool.claim(4096, &ahead).unwrap() else { panic!("no slot") };
        assert_eq!(pool.claim(4096, &ahead).unwrap(), Claim::Later);
        let Claim::Slot(b) = pool.claim(4096, &own).unwrap() else { panic!("no slot") };
        // Every slot held by the consumer, none on its way: later, overflow, or a timeout.
        assert_eq!(pool.claim(4096, &ahead).unwrap(), Claim::Later);
        assert_eq!(pool.claim(4096, &own).unwrap(), Claim::Overflow);
        assert!(matches!(pool.claim(4096, &strict), Err(Error::Exhausted { .. })));
        // A slot on its way behind a fence: waited for, not overflowed, and a completed
        // fence wakes the waiter.
        pool.release(a, Some(11)).unwrap();
        let waiter = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let rules = ClaimRules { timeout: Some(Duration::from_secs(30)), ..own };
                pool.claim(4096, &rules)
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "did not wait for the fenced slot");
        pool.retire_fences();
        fences.complete_stream(11);
        let Ok(Claim::Slot(c)) = waiter.join().unwrap() else { panic!("no slot after the fence") };
        assert_eq!(c.index, a.index);
        pool.release(b, None).unwrap();
        pool.release(c, None).unwrap();
    }

    /// The release record of the pool of `bytes` bytes dropped on this thread, once freed.
    fn freed_record(bytes: usize) -> Option<release::Freed> {
        let me = crate::background::thread_id();
        release::recent().into_iter().rev().find(|r| r.dropped_on == me && r.bytes == bytes)
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn the_last_reference_is_freed_on_the_release_thread() {
        let bytes = 4096 * 37; // a size no other test uses, to find this pool's record
        let pool = Pool::new(&PoolConfig::host(4096, 37)).unwrap();
        let other = Arc::clone(&pool);
        let holder = std::thread::spawn(move || other.num_slots());
        assert_eq!(holder.join().unwrap(), 37);
        drop(pool);
        assert!(release::flush(Some(Duration::from_secs(30))));
        let record = freed_record(bytes).expect("the arena was never freed");
        assert_ne!(record.freed_on, crate::background::thread_id(), "freed on the dropping thread");
        let name = std::fs::read_to_string(format!("/proc/self/task/{}/comm", record.freed_on));
        assert_eq!(name.unwrap().trim(), "pinpool-release");
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn dropping_with_a_pending_fence_returns_at_once_and_frees_after_the_fence() {
        let bytes = 4096 * 3;
        let fences = Arc::new(ManualFences::new());
        let pool = Pool::with_fences(&PoolConfig::host(4096, 3), Box::new(fences.clone())).unwrap();
        let t = pool.checkout(None).unwrap();
        pool.release(t, Some(9)).unwrap();
        let start = Instant::now();
        drop(pool);
        assert!(start.elapsed() < Duration::from_millis(100), "the drop waited for the fence");
        // The release thread records the fence (it may first finish other tests' jobs).
        let deadline = Instant::now() + Duration::from_secs(30);
        while fences.recorded().is_empty() {
            assert!(Instant::now() < deadline, "the fence was never recorded");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(freed_record(bytes).is_none(), "freed while a fence was pending");
        fences.complete_stream(9);
        assert!(release::flush(Some(Duration::from_secs(30))));
        assert!(freed_record(bytes).is_some(), "never freed after its fence completed");
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn copy_in_validates_every_range() {
        let pool = Pool::new(&PoolConfig::host(8192, 1)).unwrap();
        let src = Mapping::memfd("pinpool-test", 4096).unwrap();
        let t = pool.checkout(None).unwrap();
        let ok = [CopyRange { src: 0, dst: 8192 - 4096, len: 4096 }];
        assert_eq!(pool.copy_in(t, &src, &ok).unwrap(), 4096);
        let src_oob = [CopyRange { src: 1, dst: 0, len: 4096 }];
        assert!(matches!(pool.copy_in(t, &src, &src_oob), Err(Error::OutOfRange { .. })));
        let dst_oob = [CopyRange { src: 0, dst: 8000, len: 4096 }];
        assert!(matches!(pool.copy_in(t, &src, &dst_oob), Err(Error::BatchTooLarge { .. })));
        let overlap =
            [CopyRange { src: 0, dst: 0, len: 100 }, CopyRange { src: 0, dst: 50, len: 100 }];
        assert!(matches!(pool.copy_in(t, &src, &overlap), Err(Error::Invalid(_))));
        let huge = [CopyRange { src: usize::MAX, dst: 0, len: 2 }];
        assert!(pool.copy_in(t, &src, &huge).is_err());
        pool.release(t, None).unwrap();
        assert!(matches!(pool.copy_in(t, &src, &ok), Err(Error::SlotReleased { .. })));
    }
}
