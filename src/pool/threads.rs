//! The pool's two background threads: `pinpool-prepare` makes the rest of a partly ready
//! arena ready, part by part, as checkouts ask for it, and `pinpool-fences` records the fences
//! of releases and frees the slots behind them as the GPU completes them.
//!
//! (Steps 1 and 6 of "the life of a slot" in [`crate::pool`].)
//!
//! Invariants:
//! - Each holds only a `Weak` reference to the pool between rounds: neither keeps a dropped
//!   pool alive, and each ends once the pool is dropped or stopping (the prepare thread also
//!   once it is closed, or when nobody else holds it).
//! - The prepare thread makes bytes ready only while the ready length is below what checkouts
//!   asked for ([`Pool::want_ready`]): a part no checkout needed is never faulted in or pinned,
//!   and nothing is registered with the driver while no claim waits for it. Between requests
//!   it sleeps; a request, a close or the pool's drop wakes it.
//! - The prepare thread admits a part's bytes to the slot table only once that part is ready
//!   (faulted in and, on CUDA, registered). A part that fails ends it, with its error kept
//!   ([`Pool::prepare_error`]): those bytes are never handed out, and no claim waits for
//!   them ([`SlotTable::give_up_unready`]).
//! - Where the prepare thread drops the pool's last reference, it holds a [`freeing::FlushBlocker`]
//!   until then, so a flush of the freeing thread waits for the release it queues.
//! - The prepare thread holds the pool for one step at a time, of at most [`PREPARE_STEP`]
//!   bytes where parts are not registered whole. A pool made while a dropped one is held only
//!   by its prepare thread waits for that step to end ([`wait_for_pools_let_go`]), so the
//!   dropped pool's arena is kept for it rather than a new one made beside it.
//! - The fence thread naps at most 1 ms while fences are pending; it sleeps longer only after
//!   saying it is idle and looking once more, and a fenced release wakes it then
//!   ([`Pool::release`]). Neither thread calls into Python.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::Pool;
#[cfg(doc)]
use crate::allocation::slots::SlotTable;
use crate::error::{Error, Result};
use crate::memory::freeing;
use crate::transfer::fence::FenceTracker;

/// The most bytes the prepare thread makes ready in one step (where parts are not registered
/// whole): a few milliseconds of faulting in, the longest a pool made meanwhile waits for it.
pub const PREPARE_STEP: usize = 1 << 20;

/// One prepare thread's pool, and whether the thread is inside a step (it may hold the pool).
struct Preparing {
    pool: Weak<Pool>,
    stepping: Arc<AtomicBool>,
}

/// The pools whose prepare thread runs, in this process.
static PREPARING: Mutex<Vec<Preparing>> = Mutex::new(Vec::new());

/// Starts the thread that makes the rest of `pool`'s arena ready, if any of it is not.
pub(super) fn start_preparing(pool: &Arc<Pool>) -> Result<()> {
    if pool.arena.ready_len() < pool.arena.len() {
        let weak = Arc::downgrade(pool);
        let stepping = Arc::new(AtomicBool::new(false));
        let entry = Preparing { pool: weak.clone(), stepping: Arc::clone(&stepping) };
        let mut preparing = PREPARING.lock().unwrap_or_else(|e| e.into_inner());
        preparing.retain(|p| p.pool.strong_count() > 0 || p.stepping.load(Ordering::Acquire));
        let handle = std::thread::Builder::new()
            .name("pinpool-prepare".into())
            .spawn(move || prepare_loop(weak, &stepping))
            .map_err(|e| Error::Invalid(format!("cannot start the prepare thread: {e}")))?;
        let _ = pool.preparer.set(handle.thread().clone());
        preparing.push(entry);
    }
    Ok(())
}

/// Waits, at most `wait`, until no pool is held only by its prepare thread (dropped by
/// everyone else, it goes, its arena with the freeing thread, at the end of the step).
/// Returns whether none is left.
pub(super) fn wait_for_pools_let_go(wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    let let_go: Vec<Arc<AtomicBool>> = PREPARING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|p| p.pool.strong_count() <= 1 && p.stepping.load(Ordering::Acquire))
        .map(|p| Arc::clone(&p.stepping))
        .collect();
    for stepping in let_go {
        while stepping.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    true
}

/// Starts the thread that retires `pool`'s fences, if it has any.
pub(super) fn start_retiring(pool: &Arc<Pool>) -> Result<()> {
    if pool.fences.is_some() {
        let weak = Arc::downgrade(pool);
        let handle = std::thread::Builder::new()
            .name("pinpool-fences".into())
            .spawn(move || retire_loop(weak))
            .map_err(|e| Error::Invalid(format!("cannot start the fence thread: {e}")))?;
        let _ = pool.retirer.set(handle.thread().clone());
    }
    Ok(())
}

/// Makes the arena's parts ready one by one as checkouts ask for them, admitting each part's
/// slots as it is, and sleeps between requests. Stops when every part is ready, the pool is
/// closed or dropped, or a part fails (its error is kept: [`Pool::prepare_error`]; those slots
/// are never handed out).
fn prepare_loop(pool: Weak<Pool>, stepping: &AtomicBool) {
    // Half the fault threads (a quarter of the cores): the workers are running meanwhile.
    // (At the normal priority: a checkout waits for what this makes ready.)
    let threads = fault_threads().div_ceil(2);
    loop {
        // Said before the pool is held, unsaid only once it is let go (and, were that its last
        // reference, its release queued): a pool made meanwhile waits for the step.
        stepping.store(true, Ordering::Release);
        let step = prepare_step(&pool, threads);
        stepping.store(false, Ordering::Release);
        match step {
            Step::Made => {}
            // Woken by a request ([`Pool::want_ready`]), a close or the pool's drop; the
            // timeout is a second look, should a wake-up ever be missed.
            Step::Idle => std::thread::park_timeout(IDLE_LOOK),
            Step::End => return,
        }
    }
}

/// How long the prepare thread sleeps between looks at an idle pool.
const IDLE_LOOK: Duration = Duration::from_millis(200);

/// What one step of [`prepare_loop`] did.
enum Step {
    /// Made bytes ready: look for more at once.
    Made,
    /// Nothing asked for: sleep until woken.
    Idle,
    /// Stop: every byte is ready, the pool is gone, closed or failed.
    End,
}

/// One step of [`prepare_loop`].
fn prepare_step(pool: &Weak<Pool>, threads: usize) -> Step {
    // Declared first, dropped last: if this thread drops the pool's last reference, the
    // release is queued before a flush may stop waiting for it.
    let _blocker = freeing::block_flush();
    let Some(pool) = pool.upgrade() else { return Step::End };
    // Nobody else holds the pool any more: stop, and let it go now.
    if pool.stopping.load(Ordering::Acquire)
        || pool.table.is_closed()
        || Arc::strong_count(&pool) == 1
    {
        return Step::End;
    }
    if pool.arena.ready_len() >= pool.wanted_ready.load(Ordering::Acquire) {
        return Step::Idle;
    }
    match pool.arena.prepare_next(threads, PREPARE_STEP) {
        Ok(Some((offset, len))) => {
            pool.table.admit(offset, len);
            Step::Made
        }
        Ok(None) => Step::End,
        Err(e) => {
            // Kept for `notes`; the rest is given up, so no claim waits for it (they find
            // other room, or go to ordinary memory, as when the arena is full).
            let _ = pool.prepare_error.set(e.to_string());
            pool.table.give_up_unready();
            Step::End
        }
    }
}

/// Frees the slots behind completed fences, napping longer while none complete, until the pool
/// is dropped or stopping.
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

/// Threads that fault a new arena in: half the cores, rounded up. With every core, faulting
/// the arena in at the first batch takes every CPU the workers do not, and every thread of
/// the machine, the training thread included, wakes up late then; half leaves it a core and
/// does not delay the first batch (the figures: "The arena's fault threads" in
/// `docs/performance.md`).
pub(super) fn fault_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get()).div_ceil(2)
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::pool::making::READY_FIRST;
    use crate::pool::PoolConfig;
    use crate::transfer::fence::ManualFences;

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
    fn a_pool_ready_first_less_than_a_slot_hands_out_whole_slots_once_the_rest_is_ready() {
        let (n, page) = (4, crate::memory::shm::page_size());
        let config =
            PoolConfig { background: true, ready_first: Some(1), ..PoolConfig::host(8 << 20, n) };
        let pool = Pool::new(&config).unwrap();
        let ready = pool.arena().ready_len();
        assert!(ready >= page && ready < pool.arena().len(), "made ready at once: {ready}");
        // A small batch fits what is ready; a whole slot waits for the rest of its part.
        let small = pool.try_checkout_bytes(page, 0).unwrap().expect("the first page is not ready");
        let mut slots: Vec<_> =
            (0..n - 1).map(|_| pool.checkout(Some(Duration::from_secs(30))).unwrap()).collect();
        assert!(slots.iter().all(|&s| pool.slot_len(s).unwrap() >= 8 << 20));
        pool.release(small, None).unwrap();
        slots.push(pool.checkout(Some(Duration::from_secs(30))).unwrap());
        assert_eq!(pool.arena().ready_len(), pool.arena().len());
        assert!(pool.prepare_error().is_none());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_pool_dropped_while_its_arena_is_made_ready_is_let_go_before_a_new_one_is_made() {
        // Dropped at any moment of its preparation (mid-step or between steps), the pool is
        // gone once the wait returns: its prepare thread holds it no longer than its step.
        for round in 0..8 {
            let config = PoolConfig {
                background: true,
                ready_first: Some(1),
                ..PoolConfig::host(PREPARE_STEP, 48)
            };
            let pool = Pool::new(&config).unwrap();
            let weak = Arc::downgrade(&pool);
            if round % 2 == 1 {
                // Once the prepare thread is at work (asked for more than a step).
                pool.want_ready(8 * PREPARE_STEP);
                let deadline = Instant::now() + Duration::from_secs(30);
                while pool.arena().ready_len() < 2 * PREPARE_STEP {
                    assert!(Instant::now() < deadline, "the prepare thread never began");
                    std::thread::yield_now();
                }
            }
            drop(pool);
            assert!(wait_for_pools_let_go(Duration::from_secs(30)), "round {round}");
            assert!(weak.upgrade().is_none(), "round {round}: still held after the wait");
        }
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_background_pool_makes_ready_only_what_checkouts_ask_for() {
        let slot = 4 << 20;
        let config =
            PoolConfig { background: true, ready_first: Some(slot), ..PoolConfig::host(slot, 16) };
        let pool = Pool::new(&config).unwrap();
        let first = pool.arena().ready_len();
        assert!(first >= slot && first < pool.arena().len(), "ready at once: {first}");
        // Nobody asks: nothing more is made ready, however long one waits.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(pool.arena().ready_len(), first);
        // Three slots ask for the bytes they need, and get them, with the room of one more
        // slot ahead of the last; the rest stays unready.
        let held: Vec<_> =
            (0..3).map(|_| pool.checkout(Some(Duration::from_secs(30))).unwrap()).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while pool.arena().ready_len() < 4 * slot {
            assert!(Instant::now() < deadline, "the room ahead never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(100));
        let after = pool.arena().ready_len();
        assert!(after < pool.arena().len(), "made ready whole: {after}");
        assert!(after <= 4 * slot + PREPARE_STEP, "{after} ready for four slots asked");
        // A checkout that does not wait asks too: the bytes come for the next one.
        let mut got = pool.try_checkout_bytes(2 * slot, 0).unwrap();
        while got.is_none() {
            assert!(Instant::now() < deadline, "the bytes asked for never came");
            std::thread::sleep(Duration::from_millis(1));
            got = pool.try_checkout_bytes(2 * slot, 0).unwrap();
        }
        assert!(pool.arena().ready_len() >= 5 * slot);
        for t in held.into_iter().chain(got) {
            pool.release(t, None).unwrap();
        }
        assert!(pool.prepare_error().is_none());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_closed_pool_reports_nothing_preparing() {
        // Closing stops the preparation: what was not ready then never will be, and counts
        // as free, as in the stats of a pool that is gone.
        let config = PoolConfig { background: true, ..PoolConfig::host(8 << 20, 64) };
        let pool = Pool::new(&config).unwrap();
        pool.close();
        let stats = pool.stats();
        assert_eq!((stats.slots.preparing, stats.bytes.preparing), (0, 0), "{stats:?}");
        assert_eq!((stats.slots.free, stats.bytes.free), (64, pool.arena().len()), "{stats:?}");
        assert_eq!(pool.bytes().preparing, 0);
    }
}
