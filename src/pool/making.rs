//! Making a pool: the arena sized from its config (or a shelved one of the same shape taken
//! again), the slot table over it, the fence tracker and copy threads, and the thread that
//! makes the rest of a partial arena ready as checkouts ask for it.
//!
//! (Step 1 of "the life of a slot" in [`crate::pool`].)
//!
//! Invariants:
//! - The slot size, the arena size and the slot count are checked before any memory is taken.
//! - The pools dropped before give their memory back first ([`freeing::catch_up`], bounded by
//!   [`CATCH_UP_AT_MOST`]): a loop that makes and drops loaders does not pile up arenas.
//! - A background pool returns with `ready_first` bytes ready (by default at least
//!   [`READY_FIRST`] and one largest slot); the rest is made ready as checkouts ask for it.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::threads::{self, fault_threads};
use super::{Counters, Pool, PoolConfig};
use crate::allocation::slots::{Layout, SlotTable};
use crate::error::{Error, Result};
use crate::memory::arena::{Arena, Backend};
use crate::memory::freeing;
use crate::memory::shm::{page_size, round_up};
use crate::transfer::copy::{Copier, MAX_COPY_THREADS};
use crate::transfer::fence::{CudaFences, FenceTracker, Fences};

impl Pool {
    /// Allocates the arena and starts the background threads.
    pub fn new(config: &PoolConfig) -> Result<Arc<Self>> {
        let slot_bytes = Self::checked_slot_bytes(config)?;
        let arena_len = Self::arena_len(config, slot_bytes)?;
        // Before any memory is taken.
        SlotTable::check_len(config.num_slots)?;
        // The pools dropped before give their memory back first (the freeing thread may lag
        // behind a loop that makes loaders), and one of this shape gives its arena.
        threads::wait_for_pools_let_go(LET_GO_AT_MOST);
        freeing::catch_up(CATCH_UP_AT_MOST);
        let (device, backend) = (config.device, config.backend);
        let kept =
            freeing::take_shelved(|a| a.reusable_for(arena_len, slot_bytes, device, backend));
        let ready_first = config.ready_first.unwrap_or(slot_bytes.max(READY_FIRST));
        let arena = if let Some(arena) = kept {
            // Made whole, as asked; or at least its first bytes, as a new one would be.
            let wanted = if config.background { ready_first } else { usize::MAX };
            while arena.ready_len() < wanted
                && arena.prepare_next(fault_threads(), usize::MAX)?.is_some()
            {}
            arena.taken_again()
        } else if config.background {
            freeing::evict_shelved();
            Arena::new_partial(
                arena_len,
                slot_bytes,
                config.device,
                config.backend,
                fault_threads(),
                ready_first,
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
        let copier = Copier::new(copy_threads)?;
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
            wanted_ready: AtomicUsize::new(0),
            preparer: OnceLock::new(),
        });
        threads::start_retiring(&pool)?;
        Ok(pool)
    }
}

/// The longest a pool being made waits for the freeing thread to finish a free it has begun
/// (a dropped pool's fences, say), before it makes its arena anyway.
const CATCH_UP_AT_MOST: Duration = Duration::from_secs(1);
/// The longest a new pool waits for a dropped one's prepare thread to end its step (at idle
/// priority beside busy cores it can take far longer): about what a new arena's first
/// bytes cost to make ready.
const LET_GO_AT_MOST: Duration = Duration::from_millis(10);

/// A background pool makes at least this much of its arena (and at least one part, so the
/// largest slot) ready before it returns: small arenas are made whole, and a big one has room
/// for the first batches (torch itself pins each of them as it comes); a pool dropped soon
/// never faults the rest in.
pub(super) const READY_FIRST: usize = 16 << 20;
