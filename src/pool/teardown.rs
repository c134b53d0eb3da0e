//! Dropping a pool: the last reference only closes the slot table and hands what the pool
//! owns ([`Remains`]) to the freeing thread ([`crate::memory::freeing`]), which waits for the
//! pending fences, stops the pool's threads and frees the arena, or keeps it a moment for the
//! next pool of its shape ([`crate::memory::freeing::shelve`]).
//!
//! Boundary: this module says what a dropped pool hands over and in what order;
//! [`crate::memory::freeing`] runs it off the caller's thread.
//!
//! (Step 8 of "the life of a slot" in [`crate::pool`].)
//!
//! Invariants:
//! - Whatever thread drops the last reference (often a Python thread holding the GIL), the
//!   drop neither waits nor calls the driver: it queues one job and returns.
//! - The arena is freed only once no GPU work can still read it: after every pending fence
//!   has completed, or, if one has not after [`DROP_FENCE_WAIT`], never (it is leaked, which
//!   is safe where freeing it would not be).
//! - The copy threads and the fence thread are stopped before the arena goes, and the
//!   counters' last figures are written first ([`super::Counters::final_stats`]).
//! - A forked child that drops its copy of a pool frees nothing but plain memory: the threads
//!   the parts would stop and wait for, and the CUDA context they would call, live in the
//!   parent.
//! - Each `ManuallyDrop` field of the pool is taken exactly once, here.

use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Counters, Pool};
use crate::allocation::slots::SlotTable;
use crate::memory::arena::Arena;
use crate::memory::freeing;
use crate::transfer::copy::Copier;
use crate::transfer::fence::FenceTracker;

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
        self.wake_preparer();
        // SAFETY: each field is taken exactly once, here, in the process that made it, and
        // never touched again: this is the pool's drop, and `ManuallyDrop` fields are not
        // dropped a second time.
        let remains = unsafe {
            Remains {
                arena: ManuallyDrop::take(&mut self.arena),
                table: ManuallyDrop::take(&mut self.table),
                fences: ManuallyDrop::take(&mut self.fences),
                copier: ManuallyDrop::take(&mut self.copier),
                counters: Arc::clone(&self.counters),
                dropped_on: crate::system::priority::thread_id(),
            }
        };
        freeing::submit(Box::new(move || remains.free()));
    }
}

/// What a dropped pool leaves for the freeing thread to free.
struct Remains {
    arena: Arena,
    table: SlotTable,
    fences: Option<FenceTracker>,
    copier: Copier,
    counters: Arc<Counters>,
    dropped_on: u64,
}

impl Remains {
    /// Waits for pending fences, stops the pool's threads, frees the arena.
    fn free(self) {
        let start = Instant::now();
        let Remains { arena, table, fences, copier, counters, dropped_on } = self;
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
        counters
            .final_fence_errors
            .store(fences.as_ref().map_or(0, FenceTracker::errors), Ordering::Relaxed);
        drop(fences);
        drop(copier);
        let bytes = arena.len();
        let mut freed = freeing::Freed {
            bytes: if fenced_forever { 0 } else { bytes },
            dropped_on,
            freed_on: crate::system::priority::thread_id(),
            seconds: 0.0,
        };
        // Out of every slot's hands (no part is being made ready: that holds the pool): kept a
        // moment for the next pool of its shape.
        let unused = table.counts().checked_out == 0;
        drop(table);
        if fenced_forever {
            std::mem::forget(arena);
        } else if unused && arena.backend() != crate::memory::arena::Backend::CudaHostAlloc {
            freed.seconds = start.elapsed().as_secs_f64();
            freeing::shelve(arena, freed);
            return;
        } else {
            drop(arena);
        }
        freed.seconds = start.elapsed().as_secs_f64();
        freeing::record(freed);
    }
}

/// How long dropping a pool waits for pending fences before leaking the arena instead.
const DROP_FENCE_WAIT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use crate::transfer::fence::ManualFences;

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_background_pool_dropped_while_preparing_is_freed() {
        let config = PoolConfig { background: true, ..PoolConfig::host(4 << 20, 29) };
        drop(Pool::new(&config).unwrap());
        assert!(freeing::flush(Some(Duration::from_secs(30))));
        // (Dropped on whichever thread let it go last: this one, or the thread still making
        // the arena ready. The size is this test's alone.)
        let bytes = 29 * (4 << 20);
        assert!(freeing::recent().iter().any(|r| r.bytes == bytes));
    }

    /// The release record of the pool of `bytes` bytes dropped on this thread, once freed.
    fn freed_record(bytes: usize) -> Option<freeing::Freed> {
        let me = crate::system::priority::thread_id();
        freeing::recent().into_iter().rev().find(|r| r.dropped_on == me && r.bytes == bytes)
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn the_last_reference_is_freed_off_the_dropping_thread() {
        let bytes = 4096 * 37; // a size no other test uses, to find this pool's record
        let pool = Pool::new(&PoolConfig::host(4096, 37)).unwrap();
        let other = Arc::clone(&pool);
        let holder = std::thread::spawn(move || other.num_slots());
        assert_eq!(holder.join().unwrap(), 37);
        drop(pool);
        // Kept a moment for a pool of its shape, then freed by the freeing thread (or by
        // another test's pool, made meanwhile, that frees the kept arena): never here.
        let deadline = Instant::now() + Duration::from_secs(30);
        let record = loop {
            if let Some(r) = freed_record(bytes) {
                break r;
            }
            assert!(Instant::now() < deadline, "the arena was never freed");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_ne!(
            record.freed_on,
            crate::system::priority::thread_id(),
            "freed on the dropping thread"
        );
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
        // The fence completes only when the test says so below: a drop that waited would hang.
        assert!(start.elapsed() < Duration::from_secs(5), "the drop waited for the fence");
        // The freeing thread records the fence (it may first finish other tests' jobs).
        let deadline = Instant::now() + Duration::from_secs(30);
        while fences.recorded().is_empty() {
            assert!(Instant::now() < deadline, "the fence was never recorded");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(freed_record(bytes).is_none(), "freed while a fence was pending");
        fences.complete_stream(9);
        assert!(freeing::flush(Some(Duration::from_secs(30))));
        assert!(freed_record(bytes).is_some(), "never freed after its fence completed");
    }
}
