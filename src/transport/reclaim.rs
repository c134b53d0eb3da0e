//! The reclaimer: one background thread that unmaps and closes retired shared-memory mappings.
//!
//! Invariants:
//! - A mapping handed to [`Reclaimer::retire`] is dropped (`munmap` + `close`) on the
//!   reclaimer's thread, never on the caller's, which may be a Python thread holding the GIL.
//! - The thread never calls into Python and never takes a lock a Python thread holds while it
//!   waits, so it cannot deadlock against the interpreter.
//! - `pending() == 0` after [`Reclaimer::flush`]; after [`Reclaimer::shutdown`] every retired
//!   mapping has been dropped and the thread has exited. Retiring after shutdown drops the
//!   mapping on a fresh short-lived thread, so nothing is leaked and the caller still does not
//!   unmap.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::shm::Mapping;

#[derive(Default)]
struct Progress {
    queued: u64,
    unmapped: u64,
}

struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Shared {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn drop_one(&self, mapping: Mapping) {
        drop(mapping);
        self.progress().unmapped += 1;
        self.changed.notify_all();
    }
}

/// The background unmapper.
pub struct Reclaimer {
    tx: Mutex<Option<Sender<Mapping>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Reclaimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reclaimer").field("pending", &self.pending()).finish()
    }
}

impl Reclaimer {
    /// Starts the thread.
    pub fn start() -> Result<Self> {
        let (tx, rx) = channel::<Mapping>();
        let shared =
            Arc::new(Shared { progress: Mutex::new(Progress::default()), changed: Condvar::new() });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("pinpool-reclaim".into())
            .spawn(move || {
                crate::background::become_background();
                for mapping in rx {
                    worker.drop_one(mapping);
                }
            })
            .map_err(|e| Error::Invalid(format!("cannot start the reclaimer thread: {e}")))?;
        Ok(Reclaimer { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)), shared })
    }

    /// Hands `mapping` to the background thread to be unmapped and closed.
    pub fn retire(&self, mapping: Mapping) {
        self.shared.progress().queued += 1;
        let rejected = match &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(mapping).err().map(|e| e.0),
            None => Some(mapping),
        };
        if let Some(mapping) = rejected {
            let shared = Arc::clone(&self.shared);
            // If no thread can be started at all the process is out of resources; the closure,
            // and the mapping with it, is then dropped here, which is still better than a leak.
            let spawned =
                std::thread::Builder::new().name("pinpool-reclaim-late".into()).spawn(move || {
                    crate::background::become_background();
                    shared.drop_one(mapping)
                });
            if spawned.is_err() {
                self.shared.progress().unmapped += 1;
            }
        }
    }

    /// Mappings retired but not yet unmapped.
    pub fn pending(&self) -> u64 {
        let p = self.shared.progress();
        p.queued - p.unmapped
    }

    /// Mappings unmapped so far.
    pub fn unmapped(&self) -> u64 {
        self.shared.progress().unmapped
    }

    /// Waits until every mapping retired so far is unmapped.
    pub fn flush(&self) {
        let mut p = self.shared.progress();
        while p.unmapped < p.queued {
            p = self.shared.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Unmaps what is queued and stops the thread.
    pub fn shutdown(&self) {
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        self.flush();
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.shutdown();
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
}
