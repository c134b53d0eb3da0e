//! The reclaimer: the segments a process maps from its workers, counted, and one background
//! thread that unmaps and closes the ones retired.
//!
//! One pool's segment caches share one reclaimer ([`SharedReclaimer`]), started with the first of
//! them; its counts ([`ReclaimCounts`]) outlive it, so that a pool's `stats()` and `flush()` cover
//! every cache it ever had.
//!
//! Invariants:
//! - A mapping handed to [`Reclaimer::retire`] is dropped (`munmap` + `close`) on the
//!   reclaimer's thread, never on the caller's, which may be a Python thread holding the GIL.
//! - A retired mapping that a copy still borrows (its `Arc` held elsewhere) lingers until no
//!   copy holds it, then goes to the thread: [`Reclaimer::retire_shared`] and
//!   [`Reclaimer::reap`] hand it over, and whoever lets go of a borrowed mapping reaps after.
//! - The thread never calls into Python and never takes a lock a Python thread holds while it
//!   waits, so it cannot deadlock against the interpreter.
//! - `pending == 0` after [`Reclaimer::flush`] (or [`ReclaimCounts::flush`]) for every mapping
//!   retired before the call and no longer borrowed; after [`Reclaimer::shutdown`] every
//!   retired mapping has been dropped and the thread has exited. Retiring after shutdown drops
//!   the mapping on a fresh short-lived thread, so nothing is leaked and the caller still does
//!   not unmap.
//! - Dropping a reclaimer never waits: its lingering mappings are retired, its thread is told
//!   to end once its queue is empty, and the freeing thread ([`crate::memory::freeing`]) joins
//!   it. In a forked child, where that thread does not exist, the drop does nothing.

use std::os::fd::OwnedFd;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::memory::shm::Mapping;

/// Segments mapped, unmapped, and waiting to be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Segments mapped.
    pub mapped: u64,
    /// Segments unmapped by the reclaimer.
    pub unmapped: u64,
    /// Segments retired and not yet unmapped (still borrowed by a copy, or queued).
    pub pending: u64,
}

#[derive(Debug, Default)]
struct Progress {
    mapped: u64,
    queued: u64,
    unmapped: u64,
}

#[derive(Debug, Default)]
struct Counts {
    progress: Mutex<Progress>,
    changed: Condvar,
}

/// The counts of one or more reclaimers (those of one pool's caches), which outlive them.
#[derive(Debug, Clone, Default)]
pub struct ReclaimCounts(Arc<Counts>);

impl ReclaimCounts {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.0.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn drop_one(&self, mapping: Mapping) {
        drop(mapping);
        self.progress().unmapped += 1;
        self.0.changed.notify_all();
    }

    /// Segments mapped and unmapped so far, and those queued for the thread.
    pub fn stats(&self) -> SegmentStats {
        let p = self.progress();
        SegmentStats { mapped: p.mapped, unmapped: p.unmapped, pending: p.queued - p.unmapped }
    }

    /// Waits until every mapping queued so far is unmapped.
    pub fn flush(&self) {
        let mut p = self.progress();
        while p.unmapped < p.queued {
            p = self.0.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The background unmapper.
pub struct Reclaimer {
    tx: Mutex<Option<Sender<Mapping>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    tally: ReclaimCounts,
    /// Retired mappings still borrowed by a copy; handed to the thread once free.
    lingering: Mutex<Vec<Arc<Mapping>>>,
    /// The process that started the thread (see the fork invariant).
    owner: u32,
}

impl std::fmt::Debug for Reclaimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reclaimer").field("stats", &self.stats()).finish()
    }
}

impl Reclaimer {
    /// Starts the thread, with counts of its own.
    pub fn start() -> Result<Self> {
        Self::counted_in(ReclaimCounts::default())
    }

    /// Starts the thread, counting into `tally` (shared with other reclaimers).
    pub fn counted_in(tally: ReclaimCounts) -> Result<Self> {
        let (tx, rx) = channel::<Mapping>();
        let worker = tally.clone();
        let thread = std::thread::Builder::new()
            .name("pinpool-reclaim".into())
            .spawn(move || {
                crate::system::priority::become_background();
                for mapping in rx {
                    worker.drop_one(mapping);
                }
            })
            .map_err(|e| Error::Invalid(format!("cannot start the reclaimer thread: {e}")))?;
        Ok(Reclaimer {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            tally,
            lingering: Mutex::new(Vec::new()),
            owner: std::process::id(),
        })
    }

    /// Maps a shared-memory segment received as `fd`, `len` bytes long, and counts it.
    pub fn map(&self, fd: OwnedFd, len: usize, writable: bool) -> Result<Mapping> {
        let m = Mapping::from_fd(fd, len, writable)?;
        self.tally.progress().mapped += 1;
        Ok(m)
    }

    /// Hands `mapping` to the background thread to be unmapped and closed.
    pub fn retire(&self, mapping: Mapping) {
        self.tally.progress().queued += 1;
        let rejected = match &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(mapping).err().map(|e| e.0),
            None => Some(mapping),
        };
        if let Some(mapping) = rejected {
            let tally = self.tally.clone();
            // If no thread can be started at all the process is out of resources; the closure,
            // and the mapping with it, is then dropped here, which is still better than a leak.
            let spawned =
                std::thread::Builder::new().name("pinpool-reclaim-late".into()).spawn(move || {
                    crate::system::priority::become_background();
                    tally.drop_one(mapping)
                });
            if spawned.is_err() {
                self.tally.progress().unmapped += 1;
            }
        }
    }

    /// Retires a mapping that copies may still borrow: it goes to the thread as soon as no
    /// copy holds it (checked here and by [`Reclaimer::reap`]).
    pub fn retire_shared(&self, mapping: Arc<Mapping>) {
        match Arc::try_unwrap(mapping) {
            Ok(m) => self.retire(m),
            Err(shared) => self.lingering().push(shared),
        }
    }

    /// Hands every lingering mapping that no copy borrows any more to the thread.
    pub fn reap(&self) {
        let free: Vec<Mapping> = {
            let mut lingering = self.lingering();
            let (free, busy): (Vec<_>, Vec<_>) = std::mem::take(&mut *lingering)
                .into_iter()
                .partition(|m| Arc::strong_count(m) == 1);
            *lingering = busy;
            free.into_iter().filter_map(|m| Arc::try_unwrap(m).ok()).collect()
        };
        for m in free {
            self.retire(m);
        }
    }

    fn lingering(&self) -> MutexGuard<'_, Vec<Arc<Mapping>>> {
        self.lingering.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mappings retired but not yet unmapped (still borrowed, or queued).
    pub fn pending(&self) -> u64 {
        self.stats().pending
    }

    /// Mappings unmapped so far.
    pub fn unmapped(&self) -> u64 {
        self.stats().unmapped
    }

    /// Segments mapped, unmapped and pending, in the counts this reclaimer shares.
    pub fn stats(&self) -> SegmentStats {
        let lingering = self.lingering().len() as u64;
        let stats = self.tally.stats();
        SegmentStats { pending: stats.pending + lingering, ..stats }
    }

    /// The counts this reclaimer adds to.
    pub fn tally(&self) -> &ReclaimCounts {
        &self.tally
    }

    /// Waits until every mapping retired so far and no longer borrowed is unmapped.
    pub fn flush(&self) {
        self.reap();
        self.tally.flush();
    }

    /// Unmaps what is queued and stops the thread.
    pub fn shutdown(&self) {
        self.reap();
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        self.tally.flush();
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        let thread = self.thread.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if std::process::id() != self.owner {
            // A forked child's copy: the thread lives only in the parent, so joining it here
            // would hang. The child's copies of the queued mappings go when it exits.
            std::mem::forget(thread);
            std::mem::forget(self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take());
            return;
        }
        // Nothing borrows a mapping once its reclaimer goes (a copy that borrows one holds the
        // reclaimer too); one that is still shared is dropped by its other holder.
        for m in std::mem::take(&mut *self.lingering()) {
            if let Ok(m) = Arc::try_unwrap(m) {
                self.retire(m);
            }
        }
        // The thread ends once it has unmapped everything queued; joining it may wait for
        // that, which the freeing thread does, not the caller.
        drop(self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(thread) = thread {
            crate::memory::freeing::submit(Box::new(move || {
                let _ = thread.join();
            }));
        }
    }
}

/// The reclaimer one pool's segment caches share: started with the first of them, ended
/// (on the freeing thread) after the last, and started again for a later one, all counting
/// into one [`ReclaimCounts`].
#[derive(Debug, Default)]
pub struct SharedReclaimer {
    current: Mutex<Weak<Reclaimer>>,
    tally: ReclaimCounts,
}

impl SharedReclaimer {
    /// The reclaimer for a new cache: the current one, or a new one if none lives.
    pub fn get(&self) -> Result<Arc<Reclaimer>> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = current.upgrade() {
            return Ok(r);
        }
        let r = Arc::new(Reclaimer::counted_in(self.tally.clone())?);
        *current = Arc::downgrade(&r);
        Ok(r)
    }

    fn live(&self) -> Option<Arc<Reclaimer>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).upgrade()
    }

    /// Segments mapped, unmapped and pending, over every reclaimer this one started.
    pub fn stats(&self) -> SegmentStats {
        self.live().map_or_else(|| self.tally.stats(), |r| r.stats())
    }

    /// Waits until every segment retired so far and no longer borrowed is unmapped.
    pub fn flush(&self) {
        match self.live() {
            Some(r) => r.flush(),
            None => self.tally.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    // Miri: memfd_create, fcntl seals and MAP_SHARED mappings are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn unmaps_on_its_own_thread() {
        let r = Reclaimer::start().unwrap();
        for _ in 0..5 {
            r.retire(Mapping::memfd("pinpool-test", 1 << 16).unwrap());
        }
        r.flush();
        assert_eq!(r.unmapped(), 5);
        assert_eq!(r.pending(), 0);
        r.shutdown();
        r.retire(Mapping::memfd("pinpool-test", 1 << 16).unwrap());
        r.flush();
        assert_eq!(r.unmapped(), 6, "retiring after shutdown still unmaps");
    }

    #[test]
    // Miri: memfd_create and MAP_SHARED mappings are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_borrowed_mapping_lingers_until_reaped() {
        let r = Reclaimer::start().unwrap();
        let shared = Arc::new(Mapping::memfd("pinpool-test", 1 << 16).unwrap());
        let copy = Arc::clone(&shared);
        r.retire_shared(shared);
        r.flush();
        assert_eq!((r.unmapped(), r.pending()), (0, 1), "unmapped while a copy held it");
        drop(copy);
        r.flush();
        assert_eq!((r.unmapped(), r.pending()), (1, 0));
    }

    #[test]
    // Miri: memfd_create and MAP_SHARED mappings are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_pools_counts_outlive_its_reclaimers() {
        let shared = SharedReclaimer::default();
        let first = shared.get().unwrap();
        assert!(Arc::ptr_eq(&first, &shared.get().unwrap()), "one reclaimer at a time");
        first.retire(Mapping::memfd("pinpool-test", 1 << 16).unwrap());
        drop(first); // its thread is joined on the freeing thread
        shared.flush();
        assert_eq!(shared.stats(), SegmentStats { mapped: 0, unmapped: 1, pending: 0 });
        let second = shared.get().unwrap();
        second.retire(Mapping::memfd("pinpool-test", 1 << 16).unwrap());
        shared.flush();
        assert_eq!(shared.stats().unmapped, 2, "the second reclaimer counts on");
        assert!(crate::memory::freeing::flush(Some(std::time::Duration::from_secs(30))));
    }
}
