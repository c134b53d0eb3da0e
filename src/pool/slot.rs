//! A slot: one checkout ([`SlotId`]) held by one owner (the Python `Slot`), with the rules for
//! giving it back while views of its memory may still be alive.
//!
//! (Step 5 of "the life of a slot" in [`crate::pool`]: how a release is made.)
//!
//! Invariants:
//! - A held slot returns to its pool exactly once: through [`Slot::release`] or, when the
//!   owner dies without releasing, [`Slot::finish`].
//! - While a hold lasts (a buffer export, a copy into the slot, or a copy still running on a
//!   copy thread: [`OwnedSlotHold`]), a release is deferred until the last hold goes, whether the
//!   owner released the slot or died: the slot never re-enters the pool under a live view or
//!   copy.
//! - A release whose fence cannot be recorded waits for the whole device instead, then frees
//!   the slot unfenced: a slot is never reused under a pending GPU read.
//! - Every way in refuses a released slot (`SlotReleased`) and a hold for another pool.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::allocation::slots::SlotId;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::system::cuda::StreamHandle;

/// How a slot is to be given back.
#[derive(Debug, Clone, Copy)]
enum Fence {
    /// Fenced on this stream (none: at once).
    Stream(Option<StreamHandle>),
    /// After the whole device has finished its queued work (the stream could not be known).
    Device,
}

#[derive(Debug, Default)]
struct Use {
    released: bool,
    holds: usize,
    /// A release waiting for the last hold: how to give the slot back then.
    deferred: Option<Fence>,
}

/// One checked-out slot of a pool.
#[derive(Debug)]
pub struct Slot {
    pool: Arc<Pool>,
    id: SlotId,
    state: Mutex<Use>,
}

/// Keeps a slot out of the pool while it lives (see [`Slot::hold`]).
#[derive(Debug)]
pub struct SlotHold<'a>(&'a Slot);

impl Drop for SlotHold<'_> {
    fn drop(&mut self) {
        self.0.unpin();
    }
}

/// A hold that owns its slot: it may outlive the slot's owner (a copy into the slot still
/// running on a copy thread when the last view of the slot dies). See [`Slot::hold_owned`].
#[derive(Debug)]
pub struct OwnedSlotHold(Arc<Slot>);

impl OwnedSlotHold {
    /// The slot held.
    pub fn slot(&self) -> &Slot {
        &self.0
    }
}

impl Drop for OwnedSlotHold {
    fn drop(&mut self) {
        self.0.unpin();
    }
}

impl Slot {
    /// Holds `id`, a live checkout of `pool`.
    pub fn new(pool: Arc<Pool>, id: SlotId) -> Self {
        Slot { pool, id, state: Mutex::new(Use::default()) }
    }

    /// The pool the slot belongs to.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The checkout this slot is.
    pub fn id(&self) -> SlotId {
        self.id
    }

    fn state(&self) -> MutexGuard<'_, Use> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn released_error(&self) -> Error {
        Error::SlotReleased { index: self.id.index as usize }
    }

    /// Whether the slot was released (or waits for its last hold to go).
    pub fn is_released(&self) -> bool {
        self.state().released
    }

    /// The slot's first byte; fails once the slot is released.
    pub fn address(&self) -> Result<*mut u8> {
        if self.is_released() {
            return Err(self.released_error());
        }
        self.pool.slot_ptr(self.id)
    }

    /// Pins the slot for as long as the guard lives (a copy into it). It must belong to
    /// `pool` and not be released.
    pub fn hold(&self, pool: &Arc<Pool>) -> Result<SlotHold<'_>> {
        if !Arc::ptr_eq(&self.pool, pool) {
            return Err(Error::Invalid("this slot belongs to another pool".into()));
        }
        self.pin_held()?;
        Ok(SlotHold(self))
    }

    /// As [`Slot::hold`], for as long as the returned hold lives, wherever it goes.
    pub fn hold_owned(self: &Arc<Self>, pool: &Arc<Pool>) -> Result<OwnedSlotHold> {
        std::mem::forget(self.hold(pool)?); // the hold now belongs to the OwnedSlotHold
        Ok(OwnedSlotHold(Arc::clone(self)))
    }

    /// Pins the slot until a matching [`Slot::unpin`] (a buffer export, whose end the
    /// owner is told of separately). Returns the slot's first byte.
    pub fn pin_held(&self) -> Result<*mut u8> {
        let mut s = self.state();
        if s.released {
            return Err(self.released_error());
        }
        let ptr = self.pool.slot_ptr(self.id)?;
        s.holds += 1;
        Ok(ptr)
    }

    /// Ends one hold; the last one carries out a release deferred meanwhile.
    pub fn unpin(&self) {
        let deferred = {
            let mut s = self.state();
            s.holds = s.holds.saturating_sub(1);
            if s.holds == 0 {
                s.deferred.take()
            } else {
                None
            }
        };
        if let Some(fence) = deferred {
            self.give_back(fence);
        }
    }

    /// Releases the slot, fenced on `stream` (none: at once); with holds held, once the last
    /// one goes. A second release is refused.
    pub fn release(&self, stream: Option<StreamHandle>) -> Result<()> {
        let mut s = self.state();
        if s.released {
            return Err(self.released_error());
        }
        if s.holds > 0 {
            s.released = true;
            s.deferred = Some(Fence::Stream(stream));
            return Ok(());
        }
        self.pool.release(self.id, stream)?;
        s.released = true;
        Ok(())
    }

    /// The owner is going: carries out a deferred release, or releases the slot fenced on
    /// the stream `stream()` names (`Err`: it could not say, so wait for the whole device).
    /// Does nothing for a slot already given back.
    /// With an owned hold still held, the return waits for it (its drop gives the slot back).
    pub fn finish(&self, stream: impl FnOnce() -> std::result::Result<Option<StreamHandle>, ()>) {
        if self.state().released {
            return; // given back, or waiting for its last hold
        }
        // (Asked before the state is locked again: the answer may come from Python.)
        let fence = match stream() {
            Ok(stream) => Fence::Stream(stream),
            Err(()) => Fence::Device,
        };
        {
            let mut s = self.state();
            if s.released {
                return;
            }
            s.released = true;
            if s.holds > 0 {
                s.deferred = Some(fence);
                return;
            }
        }
        self.give_back(fence);
    }

    /// Returns the slot; if its fence cannot be recorded, waits for the device instead.
    fn give_back(&self, fence: Fence) {
        match fence {
            Fence::Stream(stream) => {
                if self.pool.release(self.id, stream).is_err() {
                    self.give_back_after_device_sync();
                }
            }
            Fence::Device => self.give_back_after_device_sync(),
        }
    }

    /// Returns the slot unfenced once every queued GPU operation has finished.
    fn give_back_after_device_sync(&self) {
        if let Some(device) = self.pool.arena().device() {
            let _ = device.synchronize();
        }
        let _ = self.pool.release(self.id, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use crate::transfer::fence::ManualFences;

    fn held(n: usize) -> (Arc<Pool>, Slot) {
        let pool = Pool::new(&PoolConfig::host(4096, n)).unwrap();
        let t = pool.try_checkout().unwrap().unwrap();
        (Arc::clone(&pool), Slot::new(pool, t))
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_release_waits_for_the_last_pin() {
        let (pool, l) = held(1);
        let copy = l.hold(&pool).unwrap();
        l.pin_held().unwrap(); // a buffer export
        l.release(None).unwrap();
        assert!(l.is_released());
        assert_eq!(pool.stats().slots.checked_out, 1, "returned under a live hold");
        drop(copy);
        assert_eq!(pool.stats().slots.checked_out, 1, "returned under a live export");
        l.unpin();
        assert_eq!(pool.stats().slots.free, 1);
        assert_eq!(l.release(None), Err(Error::SlotReleased { index: 0 }));
        assert!(l.pin_held().is_err() && l.address().is_err());
        l.finish(|| panic!("a released slot asked for a stream"));
        assert_eq!(pool.stats().releases, 1, "given back twice");
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn an_owner_that_dies_gives_the_slot_back_once() {
        let (pool, l) = held(2);
        assert!(!l.address().unwrap().is_null());
        l.finish(|| Ok(None));
        assert_eq!(pool.stats().slots.free, 2);
        let (other, l2) = held(1);
        assert!(l2.hold(&pool).is_err(), "held for another pool");
        l2.finish(|| Err(())); // no stream known: a device wait (none here), then unfenced
        assert_eq!(other.stats().slots.free, 1);
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn an_owned_pin_keeps_the_slot_after_its_owner_dies() {
        let fences = Arc::new(ManualFences::new());
        let pool = Pool::with_fences(&PoolConfig::host(4096, 1), Box::new(fences.clone())).unwrap();
        let l = Arc::new(Slot::new(Arc::clone(&pool), pool.try_checkout().unwrap().unwrap()));
        let hold = l.hold_owned(&pool).unwrap();
        let other = Pool::new(&PoolConfig::host(4096, 1)).unwrap();
        assert!(l.hold_owned(&other).is_err(), "held for another pool");
        l.finish(|| Ok(Some(5))); // the owner dies: the return waits for the hold
        assert!(l.is_released());
        assert_eq!(pool.stats().slots.checked_out, 1, "returned under a live copy");
        l.finish(|| panic!("a slot that is going asked for a stream again"));
        drop(hold); // the copy ends: the slot goes back, fenced on the owner's stream
        assert_eq!(pool.stats().slots.fenced, 1);
        pool.retire_fences();
        fences.complete_stream(5);
        pool.retire_fences();
        assert_eq!(pool.stats().slots.free, 1);
        assert_eq!(pool.stats().releases, 1, "given back twice");
        // An owner whose stream cannot be known: after the hold, a device wait (none here).
        let l = Arc::new(Slot::new(Arc::clone(&pool), pool.try_checkout().unwrap().unwrap()));
        let hold = l.hold_owned(&pool).unwrap();
        l.finish(|| Err(()));
        assert_eq!(pool.stats().slots.checked_out, 1);
        drop(hold);
        assert_eq!(pool.stats().slots.free, 1);
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_deferred_release_is_fenced_on_its_stream() {
        let fences = Arc::new(ManualFences::new());
        let pool = Pool::with_fences(&PoolConfig::host(4096, 1), Box::new(fences.clone())).unwrap();
        let l = Slot::new(Arc::clone(&pool), pool.try_checkout().unwrap().unwrap());
        l.pin_held().unwrap();
        l.release(Some(12)).unwrap();
        l.unpin();
        assert_eq!(pool.stats().slots.fenced, 1);
        pool.retire_fences();
        fences.complete_stream(12);
        pool.retire_fences();
        assert_eq!(pool.stats().slots.free, 1);
    }
}
