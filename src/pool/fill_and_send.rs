//! Copies into slots and sends to the device: a batch's bytes from a source mapping (a
//! worker's segment) into a slot, on the calling thread or on a copy thread, into memory of
//! the caller's (a batch that got no slot), and from a slot to device memory on a stream.
//!
//! (Steps 3 and 4 of "the life of a slot" in [`crate::pool`].)
//!
//! Invariants:
//! - Nothing is copied before every range is checked ([`validate_ranges`]): each source inside
//!   the source mapping, each destination inside the slot (or the caller's memory), and no two
//!   destinations overlapping. A list that fails copies nothing.
//! - A slot is written only while its checkout is live, and only by the process that made the
//!   pool (a forked child's copies are refused).
//! - A copy on a copy thread ([`Pool::copy_in_background`]) owns the pool, the source mapping
//!   and what keeps the slot out of the pool, and drops them only after the copy; the
//!   caller's `then` receives the source mapping after the copy and before the slot can go
//!   back.
//! - A send to the device is refused on a pool whose arena the driver did not pin, and for
//!   more bytes than the slot holds, before anything is copied in.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::Pool;
use crate::allocation::slots::SlotId;
use crate::error::{Error, Result};
use crate::memory::shm::{check_range, Mapping};
use crate::system::cuda::{Event, StreamHandle};
use crate::transfer::copy::{CopyRange, Copying, SetWhenDropped};

impl Pool {
    /// Copies `ranges` from `src` (offsets relative to the mapping) into the slot `slot`
    /// (offsets relative to the slot). Every range is checked first: a source range outside
    /// the mapping or a destination outside the slot is an error and nothing is copied.
    pub fn copy_in(&self, slot: SlotId, src: &Mapping, ranges: &[CopyRange]) -> Result<usize> {
        let dst = self.copy_target(slot, src, ranges)?;
        // SAFETY: every range was checked against the mapping and the slot just above, and
        // destination ranges are disjoint; the slot is ours while the checkout is live (the
        // caller holds it), and `src` stays mapped for this call (borrowed).
        let n = unsafe { self.copier.copy(src.as_ptr(), dst, ranges) };
        self.counters.bytes_copied.fetch_add(n as u64, Ordering::Relaxed);
        self.counters.copies.fetch_add(1, Ordering::Relaxed);
        Ok(n)
    }

    /// The checks of [`Pool::copy_in`]: the slot's first byte if `ranges` may be copied from
    /// `src` into the slot `slot`.
    fn copy_target(&self, slot: SlotId, src: &Mapping, ranges: &[CopyRange]) -> Result<*mut u8> {
        self.check_owner()?;
        let (offset, len) = self.extent(slot)?;
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
        slot: SlotId,
        src: &Mapping,
        ranges: &[CopyRange],
        dst: u64,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        self.send_checks(slot, len)?; // before the copy in: an error copies nothing
        self.copy_in(slot, src, ranges)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.send(slot, dst, len, stream) }
    }

    /// Queues a copy of the first `len` bytes of the slot `slot` to device memory `dst`
    /// on `stream`, and an event after it (a zero-copy batch, already in its slot).
    ///
    /// # Safety
    /// As [`Pool::copy_in_and_send`]: `dst` is device memory of the pool's device with room
    /// for `len` bytes, live until the copy has run, and the caller keeps the slot checked
    /// out and releases it fenced on `stream` (or later).
    pub unsafe fn send(
        &self,
        slot: SlotId,
        dst: u64,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        let device = self.send_checks(slot, len)?;
        let first_byte = self.slot_ptr(slot)?;
        // SAFETY: the slot is pinned arena memory, live while the caller holds the checkout and
        // not reused before the fence the caller records on `stream`; `len` fits in it
        // (checked above); the caller vouches for `dst`.
        unsafe { device.send(dst, first_byte, len, stream) }
    }

    /// The device a copy of `len` bytes from the slot `slot` goes to: refused on a pool
    /// the driver did not pin, or for more bytes than the slot holds.
    fn send_checks(&self, slot: SlotId, len: usize) -> Result<&Arc<crate::system::cuda::Device>> {
        let Some(device) = self.arena.device() else {
            return Err(Error::Invalid(
                "copies to a device need a pool of pinned memory on that device".into(),
            ));
        };
        let size = self.slot_len(slot)?;
        if len > size {
            return Err(Error::OutOfRange { what: "slot", offset: 0, len, size });
        }
        Ok(device)
    }

    /// As [`Pool::copy_in`] into the slot `slot`, but on one of the copy threads: checks
    /// everything first (an error queues nothing), then returns at once. On the copy thread,
    /// after the copy, `then(src)` runs with the source (the caller's from then on: to hand
    /// back to its sender, and to unmap if it was retired during the copy), `hold` is dropped
    /// and the returned [`Copying`] is set.
    ///
    /// # Safety
    /// `hold` keeps the slot `slot` checked out (out of the pool) until it is dropped: a
    /// hold of the slot (`crate::pool::slot::OwnedSlotHold`), whose drop carries out a release
    /// that waited for it.
    pub unsafe fn copy_in_background<H: Send + 'static>(
        self: &Arc<Self>,
        slot: SlotId,
        hold: H,
        src: Arc<Mapping>,
        ranges: Vec<CopyRange>,
        then: impl FnOnce(Arc<Mapping>) + Send + 'static,
    ) -> Result<Arc<Copying>> {
        let dst = self.copy_target(slot, &src, &ranges)? as usize;
        let done = Arc::new(Copying::default());
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
            then(src);
            drop(hold);
            drop(set); // the waiter sees the copy (and a release that waited for it) done
            drop(pool);
        });
        Ok(done)
    }

    /// [`Pool::copy_in_background`], then, on the same copy thread and before `hold` is
    /// dropped, a copy of the slot's first `len` bytes to device memory at `dst` queued on
    /// `stream`, as [`Pool::copy_in_and_send`] does: its event (or its error) lands in the
    /// returned [`Sending`] before the [`Copying`] is set. A release of the slot fenced on
    /// `stream` that waits for `hold` is recorded after that copy is queued. Only on a pool
    /// whose arena the driver pinned, for at most the slot's bytes (checked first: an error
    /// queues nothing).
    ///
    /// # Safety
    /// As [`Pool::copy_in_background`] for `hold`, and as [`Pool::send`] for `dst`, which
    /// stays allocated until the copy to it has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_in_and_send_in_background<H: Send + 'static>(
        self: &Arc<Self>,
        slot: SlotId,
        hold: H,
        src: Arc<Mapping>,
        ranges: Vec<CopyRange>,
        dst: u64,
        len: usize,
        stream: StreamHandle,
        then: impl FnOnce(Arc<Mapping>) + Send + 'static,
    ) -> Result<(Arc<Copying>, Arc<Sending>)> {
        self.send_checks(slot, len)?;
        let sending = Arc::new(Sending::default());
        let result = Arc::clone(&sending);
        let pool = Arc::clone(self);
        let then_send = move |src| {
            then(src);
            // SAFETY: the slot is held until this closure has returned (`hold` is dropped
            // after it), its bytes are copied in; the caller vouches for `dst`.
            result.set(unsafe { pool.send(slot, dst, len, stream) });
        };
        // SAFETY: forwarded from the caller.
        let done = unsafe { self.copy_in_background(slot, hold, src, ranges, then_send) }?;
        Ok((done, sending))
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::pool::PoolConfig;

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

/// The outcome of a copy to the device queued on a copy thread
/// ([`Pool::copy_in_and_send_in_background`]): set once, before that copy's [`Copying`] is
/// set, and taken once.
#[derive(Default)]
pub struct Sending(Mutex<Option<Result<Event>>>);

impl Sending {
    fn set(&self, sent: Result<Event>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(sent);
    }

    /// The copy's event, or the error queuing it met; None before it is set (or once taken).
    pub fn take(&self) -> Option<Result<Event>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}
