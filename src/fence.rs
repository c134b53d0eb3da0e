//! Fences: what keeps a released slot out of the free list until the GPU work that reads it
//! has finished.
//!
//! Invariants:
//! - Each slot has one fence ([`Fences`] is indexed by slot); it is recorded only while the
//!   slot is `Fenced` by the release that recorded it, and polled only for tickets in the
//!   pending list, which a ticket enters *after* its fence was recorded. So a fence left over
//!   from an earlier checkout can never free a slot early.
//! - A ticket leaves the pending list exactly when [`SlotTable::complete_fence`] is called for
//!   it; a fence whose query fails (a dead context) counts as complete, and is counted.
//! - The fence logic knows nothing of CUDA: [`CudaFences`] is one implementation, and tests use
//!   [`ManualFences`], whose fences complete when the test says so.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::cuda::{Device, Event, StreamHandle};
use crate::error::Result;
use crate::slots::{SlotTable, Ticket};

/// One fence per slot.
pub trait Fences: Send + Sync {
    /// Records slot `index`'s fence after the work queued so far on `stream`.
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()>;
    /// Whether slot `index`'s last recorded fence has completed.
    fn is_complete(&self, index: usize) -> Result<bool>;
}

impl<F: Fences + ?Sized> Fences for Arc<F> {
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()> {
        (**self).record(index, stream)
    }

    fn is_complete(&self, index: usize) -> Result<bool> {
        (**self).is_complete(index)
    }
}

/// CUDA events, one per slot, in the device's primary context.
pub struct CudaFences {
    events: Vec<Event>,
}

impl CudaFences {
    /// Creates `n` events.
    pub fn new(device: &Arc<Device>, n: usize) -> Result<Self> {
        let events = (0..n).map(|_| device.new_event()).collect::<Result<Vec<_>>>()?;
        Ok(CudaFences { events })
    }
}

impl Fences for CudaFences {
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()> {
        self.events[index].record(stream)
    }

    fn is_complete(&self, index: usize) -> Result<bool> {
        self.events[index].is_complete()
    }
}

/// Fences that complete when told to: for tests and benchmarks without a GPU.
pub struct ManualFences {
    done: Vec<AtomicBool>,
    recorded_on: Vec<AtomicU64>,
}

impl ManualFences {
    /// `n` fences.
    pub fn new(n: usize) -> Self {
        ManualFences {
            done: (0..n).map(|_| AtomicBool::new(true)).collect(),
            recorded_on: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Completes slot `index`'s fence.
    pub fn complete(&self, index: usize) {
        self.done[index].store(true, Ordering::Release);
    }

    /// The stream slot `index`'s fence was last recorded on.
    pub fn stream_of(&self, index: usize) -> StreamHandle {
        self.recorded_on[index].load(Ordering::Acquire) as StreamHandle
    }
}

impl Fences for ManualFences {
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()> {
        self.recorded_on[index].store(stream as u64, Ordering::Release);
        self.done[index].store(false, Ordering::Release);
        Ok(())
    }

    fn is_complete(&self, index: usize) -> Result<bool> {
        Ok(self.done[index].load(Ordering::Acquire))
    }
}

/// The fences of one pool and the tickets waiting on them.
pub struct FenceTracker {
    fences: Box<dyn Fences>,
    pending: Mutex<Vec<Ticket>>,
    errors: AtomicU64,
}

impl FenceTracker {
    /// Tracks the given fences.
    pub fn new(fences: Box<dyn Fences>) -> Self {
        FenceTracker { fences, pending: Mutex::new(Vec::new()), errors: AtomicU64::new(0) }
    }

    /// Releases `ticket` behind a fence on `stream`. On error the slot stays checked out.
    pub fn release_fenced(
        &self,
        table: &SlotTable,
        ticket: Ticket,
        stream: StreamHandle,
    ) -> Result<()> {
        table.release(ticket, true)?;
        if let Err(e) = self.fences.record(ticket.index as usize, stream) {
            table.unfence(ticket);
            return Err(e);
        }
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).push(ticket);
        Ok(())
    }

    /// Frees every pending slot whose fence has completed; returns how many.
    pub fn retire_ready(&self, table: &SlotTable) -> usize {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let before = pending.len();
        pending.retain(|&ticket| {
            let done = match self.fences.is_complete(ticket.index as usize) {
                Ok(done) => done,
                Err(_) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    true
                }
            };
            if done {
                table.complete_fence(ticket);
            }
            !done
        });
        before - pending.len()
    }

    /// How many tickets wait on their fence.
    pub fn pending(&self) -> usize {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// How many fence queries failed (and were treated as complete).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(n: usize) -> (SlotTable, FenceTracker, Arc<ManualFences>) {
        let manual = Arc::new(ManualFences::new(n));
        let tracker = FenceTracker::new(Box::new(Arc::clone(&manual)));
        (SlotTable::new(n).unwrap(), tracker, manual)
    }

    #[test]
    fn slot_returns_only_after_its_fence() {
        let (table, tracker, manual) = setup(1);
        let t = table.try_checkout().unwrap();
        tracker.release_fenced(&table, t, 77).unwrap();
        assert_eq!(manual.stream_of(0), 77);
        assert_eq!(tracker.retire_ready(&table), 0);
        assert!(table.try_checkout().is_none());
        manual.complete(0);
        assert_eq!(tracker.retire_ready(&table), 1);
        assert_eq!(tracker.pending(), 0);
        assert!(table.try_checkout().is_some());
    }

    #[test]
    fn double_fenced_release_does_not_touch_the_pending_fence() {
        let (table, tracker, manual) = setup(1);
        let t = table.try_checkout().unwrap();
        tracker.release_fenced(&table, t, 1).unwrap();
        assert!(tracker.release_fenced(&table, t, 2).is_err());
        assert_eq!(manual.stream_of(0), 1, "the refused release must not re-record the fence");
        assert_eq!(tracker.pending(), 1);
    }
}
