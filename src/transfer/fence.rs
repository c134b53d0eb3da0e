//! Fences: what keeps a released slot out of the free list until the GPU work that reads it
//! has finished.
//!
//! (Steps 5 and 6 of "the life of a slot" in [`crate::pool`].)
//!
//! A release does not call the driver: it moves the slot to `Fenced` and queues
//! `(checkout, stream)`. Whoever retires fences next (the pool's fence thread, or a checkout that
//! found no free slot) records **one** fence per stream for everything queued on it, then polls
//! the fences in flight and frees the slots behind every completed one. Recording later than
//! the release is safe: a stream runs in order, so a fence recorded later still comes after all
//! the work queued before the release.
//!
//! Invariants:
//! - A checkout is in exactly one place from its fenced release until its slot is free: the
//!   queue, then one in-flight fence's list. It leaves only through
//!   [`SlotTable::complete_fence`], after that fence has completed. (A checkout whose fence
//!   failed is held instead by the retire that waits for the device for it, and counted in
//!   `moving` until its slot is free.)
//! - A fence that cannot be recorded (or queried) does not free its slots early: the tracker
//!   first waits for the whole device ([`Fences::wait_all`]), then frees them, and counts the
//!   error.
//! - The stream handle of a release must stay valid until its fence is recorded (torch's
//!   streams are never destroyed; a raw handle is the caller's promise). The per-thread default
//!   stream names a different stream on every thread, so its fence is recorded at once, on the
//!   releasing thread ([`FenceTracker::release_fenced_now`]).
//! - The fence logic knows nothing of CUDA: [`CudaFences`] is one implementation, and tests use
//!   [`ManualFences`], whose fences complete when the test says so.
//! - No driver call is made under a lock that a releaser takes: releasers take `queued` (and,
//!   for the per-thread default stream, `in_flight` and the event list) only to push or pop.
//!   Retirers take turns through their own lock (`retiring`; a checkout does not wait for it,
//!   it leaves the retiring to the holder) and record and query fences holding only that
//!   one; the device-wide wait after a failed fence holds none. Checkouts on their way from one
//!   list to the other are counted in `moving`, so [`FenceTracker::pending`] never misses one.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::allocation::slots::{SlotId, SlotTable};
use crate::error::{Error, Result};
use crate::system::cuda::{Device, Event, StreamHandle};

/// Names one recorded fence.
pub type FenceId = usize;

/// Where fences come from.
pub trait Fences: Send + Sync {
    /// Records a fence after the work queued so far on `stream`.
    fn record(&self, stream: StreamHandle) -> Result<FenceId>;
    /// Whether fence `id` has completed.
    fn is_complete(&self, id: FenceId) -> Result<bool>;
    /// Fence `id` is no longer needed; its resources may be reused.
    fn recycle(&self, id: FenceId);
    /// Blocks until all work on the device has finished (the fallback when a fence fails).
    fn wait_all(&self) -> Result<()>;
}

impl<F: Fences + ?Sized> Fences for Arc<F> {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        (**self).record(stream)
    }

    fn is_complete(&self, id: FenceId) -> Result<bool> {
        (**self).is_complete(id)
    }

    fn recycle(&self, id: FenceId) {
        (**self).recycle(id)
    }

    fn wait_all(&self) -> Result<()> {
        (**self).wait_all()
    }
}

/// CUDA events in the device's primary context, reused through a free list.
pub struct CudaFences {
    device: Arc<Device>,
    /// Only to hand out and take back events: the driver is called after it is let go.
    events: Mutex<Slab<Arc<Event>>>,
}

impl CudaFences {
    /// No events yet; they are made on first need and reused afterwards.
    pub fn new(device: &Arc<Device>) -> Self {
        CudaFences { device: Arc::clone(device), events: Mutex::new(Slab::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slab<Arc<Event>>> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Fences for CudaFences {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        let free = {
            let mut events = self.lock();
            events.take_free().map(|id| (id, Arc::clone(events.get(id))))
        };
        let (id, event) = match free {
            Some(found) => found,
            None => {
                let event = Arc::new(self.device.new_event()?);
                (self.lock().insert(Arc::clone(&event)), event)
            }
        };
        if let Err(e) = event.record(stream) {
            self.lock().release(id);
            return Err(e);
        }
        Ok(id)
    }

    fn is_complete(&self, id: FenceId) -> Result<bool> {
        let event = Arc::clone(self.lock().get(id));
        event.is_complete()
    }

    fn recycle(&self, id: FenceId) {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).release(id);
    }

    fn wait_all(&self) -> Result<()> {
        self.device.synchronize()
    }
}

/// Items that keep their index while in use, with a free list of indices to reuse.
struct Slab<T> {
    items: Vec<T>,
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), free: Vec::new() }
    }
}

impl<T> Slab<T> {
    fn take_free(&mut self) -> Option<usize> {
        self.free.pop()
    }

    fn insert(&mut self, item: T) -> usize {
        self.items.push(item);
        self.items.len() - 1
    }

    fn get(&self, id: usize) -> &T {
        &self.items[id]
    }

    fn release(&mut self, id: usize) {
        if id < self.items.len() && !self.free.contains(&id) {
            self.free.push(id);
        }
    }
}

/// Fences that complete when told to: for tests and benchmarks without a GPU.
#[derive(Default)]
pub struct ManualFences {
    fences: Mutex<Vec<(StreamHandle, bool)>>,
    fail_records: std::sync::atomic::AtomicBool,
    waits: AtomicU64,
}

impl ManualFences {
    /// No fences yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Completes every fence recorded so far on `stream`.
    pub fn complete_stream(&self, stream: StreamHandle) {
        for f in self.fences.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            if f.0 == stream {
                f.1 = true;
            }
        }
    }

    /// Completes every fence recorded so far.
    pub fn complete_all(&self) {
        for f in self.fences.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            f.1 = true;
        }
    }

    /// The streams of the fences recorded so far, and whether each has completed.
    pub fn recorded(&self) -> Vec<(StreamHandle, bool)> {
        self.fences.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes every later `record` fail (a bad stream, a dead context).
    pub fn fail_records(&self, fail: bool) {
        self.fail_records.store(fail, Ordering::Relaxed);
    }

    /// How often `wait_all` was called.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }
}

impl Fences for ManualFences {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        if self.fail_records.load(Ordering::Relaxed) {
            return Err(Error::Invalid(format!("cannot record on stream {stream}")));
        }
        let mut fences = self.fences.lock().unwrap_or_else(|e| e.into_inner());
        fences.push((stream, false));
        Ok(fences.len() - 1)
    }

    fn is_complete(&self, id: FenceId) -> Result<bool> {
        Ok(self.fences.lock().unwrap_or_else(|e| e.into_inner()).get(id).is_none_or(|f| f.1))
    }

    fn recycle(&self, _id: FenceId) {}

    fn wait_all(&self) -> Result<()> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.complete_all();
        Ok(())
    }
}

/// One recorded fence and the slots waiting on it.
struct InFlight {
    fence: FenceId,
    checkouts: Vec<SlotId>,
}

/// The fences of one pool and the checkouts waiting on them.
pub struct FenceTracker {
    fences: Box<dyn Fences>,
    /// Released, fence not recorded yet. Its own lock, so a release never waits on the driver.
    queued: Mutex<Vec<(SlotId, StreamHandle)>>,
    in_flight: Mutex<Vec<InFlight>>,
    /// Held by the one retirer at a time, through its driver calls (the others wait).
    retiring: Mutex<()>,
    /// Checkouts a retirer holds between the lists, or while it waits for the device.
    moving: AtomicUsize,
    errors: AtomicU64,
}

impl FenceTracker {
    /// Tracks the given fences.
    pub fn new(fences: Box<dyn Fences>) -> Self {
        FenceTracker {
            fences,
            queued: Mutex::new(Vec::new()),
            in_flight: Mutex::new(Vec::new()),
            retiring: Mutex::new(()),
            moving: AtomicUsize::new(0),
            errors: AtomicU64::new(0),
        }
    }

    /// Releases `slot` behind a fence on `stream` (recorded by the next retire).
    pub fn release_fenced(
        &self,
        table: &SlotTable,
        slot: SlotId,
        stream: StreamHandle,
    ) -> Result<()> {
        table.release(slot, true)?;
        self.queued.lock().unwrap_or_else(|e| e.into_inner()).push((slot, stream));
        Ok(())
    }

    /// Releases `slot` behind a fence recorded right now, on this thread: for a stream
    /// handle that means something different on every thread (the per-thread default
    /// stream). On error the slot stays checked out.
    pub fn release_fenced_now(
        &self,
        table: &SlotTable,
        slot: SlotId,
        stream: StreamHandle,
    ) -> Result<()> {
        table.release(slot, true)?;
        match self.fences.record(stream) {
            Ok(fence) => {
                let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                in_flight.push(InFlight { fence, checkouts: vec![slot] });
                Ok(())
            }
            Err(e) => {
                table.unfence(slot);
                Err(e)
            }
        }
    }

    /// Records fences for what is queued, then frees every slot whose fence has completed;
    /// returns how many slots it freed. Waits for a retire running on another thread to finish
    /// its fence calls first, so everything released before the call gets its fence.
    pub fn retire_ready(&self, table: &SlotTable) -> usize {
        let turn = self.retiring.lock().unwrap_or_else(|e| e.into_inner());
        self.retire_in_turn(turn, table)
    }

    /// As [`FenceTracker::retire_ready`], but returns 0 at once while another thread retires
    /// (that one frees what is ready): for a checkout, which must not wait on driver calls.
    pub fn try_retire_ready(&self, table: &SlotTable) -> usize {
        match self.retiring.try_lock() {
            Ok(turn) => self.retire_in_turn(turn, table),
            Err(std::sync::TryLockError::Poisoned(p)) => self.retire_in_turn(p.into_inner(), table),
            Err(std::sync::TryLockError::WouldBlock) => 0,
        }
    }

    fn retire_in_turn(&self, turn: std::sync::MutexGuard<'_, ()>, table: &SlotTable) -> usize {
        let mut failed = Vec::new();
        let mut failures = 0;
        // 1. Record one fence per stream for what is queued (driver calls: no list locked).
        let queued = {
            let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            self.moving.fetch_add(queued.len(), Ordering::SeqCst);
            std::mem::take(&mut *queued)
        };
        let moved = queued.len();
        let mut recorded = Vec::new();
        for (stream, checkouts) in group_by_stream(queued) {
            match self.fences.record(stream) {
                Ok(fence) => recorded.push(InFlight { fence, checkouts }),
                Err(_) => {
                    failures += 1;
                    failed.extend(checkouts);
                }
            }
        }
        // 2. Which fences have completed (driver calls: no list locked). Only this retirer
        // removes entries, so the ones seen here stay until step 3.
        let known: Vec<FenceId> = {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            in_flight.extend(recorded);
            in_flight.iter().map(|f| f.fence).collect()
        };
        self.moving.fetch_sub(moved - failed.len(), Ordering::SeqCst);
        let verdicts: Vec<(FenceId, Result<bool>)> =
            known.into_iter().map(|id| (id, self.fences.is_complete(id))).collect();
        // 3. Free the slots behind completed fences; set aside those of failed ones.
        let mut done = Vec::new();
        {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            in_flight.retain_mut(|f| {
                match verdicts.iter().find(|v| v.0 == f.fence).map(|v| &v.1) {
                    None | Some(Ok(false)) => true,
                    Some(Ok(true)) => {
                        done.push((f.fence, std::mem::take(&mut f.checkouts)));
                        false
                    }
                    Some(Err(_)) => {
                        failures += 1;
                        self.moving.fetch_add(f.checkouts.len(), Ordering::SeqCst);
                        failed.append(&mut f.checkouts);
                        done.push((f.fence, Vec::new()));
                        false
                    }
                }
            });
        }
        let mut freed = 0;
        for (fence, checkouts) in done {
            for t in checkouts {
                freed += usize::from(table.complete_fence(t));
            }
            self.fences.recycle(fence);
        }
        drop(turn);
        if failures > 0 {
            // Outside every lock: a device-wide wait must not hold up other retires (and the
            // checkouts that run them, which have timeouts to keep).
            self.errors.fetch_add(failures, Ordering::Relaxed);
            // If even the wait fails the context is dead: no GPU work can read the slots.
            let _ = self.fences.wait_all();
            freed += failed.iter().map(|&t| usize::from(table.complete_fence(t))).sum::<usize>();
            self.moving.fetch_sub(failed.len(), Ordering::SeqCst);
        }
        freed
    }

    /// How many checkouts wait on a fence (queued or in flight).
    pub fn pending(&self) -> usize {
        let queued = self.queued.lock().unwrap_or_else(|e| e.into_inner()).len();
        let moving = self.moving.load(Ordering::SeqCst);
        let in_flight: usize = self
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|f| f.checkouts.len())
            .sum();
        queued + moving + in_flight
    }

    /// How many fences failed to record or query, each counted once (their slots were freed
    /// after a device wait).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

fn group_by_stream(queued: Vec<(SlotId, StreamHandle)>) -> Vec<(StreamHandle, Vec<SlotId>)> {
    let mut groups: Vec<(StreamHandle, Vec<SlotId>)> = Vec::new();
    for (slot, stream) in queued {
        match groups.iter_mut().find(|g| g.0 == stream) {
            Some(g) => g.1.push(slot),
            None => groups.push((stream, vec![slot])),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(n: usize) -> (SlotTable, FenceTracker, Arc<ManualFences>) {
        let manual = Arc::new(ManualFences::new());
        let tracker = FenceTracker::new(Box::new(Arc::clone(&manual)));
        (SlotTable::new(n).unwrap(), tracker, manual)
    }

    /// Fences whose `record` hangs in the driver until the test opens the gate; each entry
    /// into `record` is announced on `entered`.
    struct Gated {
        manual: ManualFences,
        entered: std::sync::mpsc::SyncSender<()>,
        gate: Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl Fences for Gated {
        fn record(&self, stream: StreamHandle) -> Result<FenceId> {
            let _ = self.entered.try_send(());
            let _ = self.gate.lock().unwrap().recv();
            self.manual.record(stream)
        }
        fn is_complete(&self, id: FenceId) -> Result<bool> {
            self.manual.is_complete(id)
        }
        fn recycle(&self, id: FenceId) {
            self.manual.recycle(id)
        }
        fn wait_all(&self) -> Result<()> {
            self.manual.wait_all()
        }
    }

    #[test]
    fn releases_and_pending_do_not_wait_for_a_retire_in_the_driver() {
        use std::sync::mpsc::{channel, sync_channel};
        use std::time::Duration;
        let (entered_tx, entered) = sync_channel(4);
        let (open, gate) = channel();
        let gated =
            Gated { manual: ManualFences::new(), entered: entered_tx, gate: Mutex::new(gate) };
        let table = Arc::new(SlotTable::new(3).unwrap());
        let tracker = Arc::new(FenceTracker::new(Box::new(gated)));
        let (a, b) = (table.try_checkout().unwrap(), table.try_checkout().unwrap());
        tracker.release_fenced(&table, a, 1).unwrap();
        let retirer = {
            let (table, tracker) = (Arc::clone(&table), Arc::clone(&tracker));
            std::thread::spawn(move || tracker.retire_ready(&table))
        };
        entered
            .recv_timeout(Duration::from_secs(30))
            .expect("the retirer never reached the driver");
        // The retirer now hangs in `record` until the gate opens; the calls below must not.
        let (done_tx, done) = channel();
        {
            let (table, tracker) = (Arc::clone(&table), Arc::clone(&tracker));
            std::thread::spawn(move || {
                tracker.release_fenced(&table, b, 2).unwrap();
                let _ = done_tx.send((tracker.pending(), tracker.try_retire_ready(&table)));
            });
        }
        let got = done.recv_timeout(Duration::from_secs(30));
        open.send(()).unwrap();
        open.send(()).unwrap();
        let (pending, retired) =
            got.expect("a release waited for the retire hanging in the driver");
        assert_eq!(pending, 2, "a checkout on its way to a fence was not counted");
        assert_eq!(retired, 0, "a second retirer did not step aside");
        retirer.join().unwrap();
        assert_eq!(tracker.pending(), 2);
    }

    #[test]
    fn slot_returns_only_after_its_fence() {
        let (table, tracker, manual) = setup(1);
        let t = table.try_checkout().unwrap();
        tracker.release_fenced(&table, t, 77).unwrap();
        assert!(manual.recorded().is_empty(), "a release does not touch the driver");
        assert_eq!(tracker.retire_ready(&table), 0);
        assert_eq!(manual.recorded(), vec![(77, false)]);
        assert!(table.try_checkout().is_none());
        manual.complete_stream(77);
        assert_eq!(tracker.retire_ready(&table), 1);
        assert_eq!(tracker.pending(), 0);
        assert!(table.try_checkout().is_some());
    }

    #[test]
    fn one_fence_per_stream_per_round() {
        let (table, tracker, manual) = setup(4);
        let ts: Vec<_> = (0..4).map(|_| table.try_checkout().unwrap()).collect();
        for (i, &t) in ts.iter().enumerate() {
            tracker.release_fenced(&table, t, 10 + i % 2).unwrap();
        }
        assert_eq!(tracker.retire_ready(&table), 0);
        assert_eq!(manual.recorded().len(), 2);
        manual.complete_stream(11);
        assert_eq!(tracker.retire_ready(&table), 2);
        assert_eq!(tracker.pending(), 2);
    }

    #[test]
    fn double_fenced_release_is_refused() {
        let (table, tracker, _manual) = setup(1);
        let t = table.try_checkout().unwrap();
        tracker.release_fenced(&table, t, 1).unwrap();
        assert!(tracker.release_fenced(&table, t, 2).is_err());
        assert_eq!(tracker.pending(), 1);
    }

    #[test]
    fn a_fence_that_cannot_be_recorded_waits_for_the_device() {
        let (table, tracker, manual) = setup(1);
        let t = table.try_checkout().unwrap();
        tracker.release_fenced(&table, t, 5).unwrap();
        manual.fail_records(true);
        assert_eq!(tracker.retire_ready(&table), 1);
        assert_eq!(manual.waits(), 1);
        assert_eq!(tracker.errors(), 1);
    }
}
