//! The main process's cache of worker segments: each mapped once, on first sight (checked),
//! and kept while its worker lives; copies out of them into pool slots, and their hand-back
//! to the worker.
//!
//! Invariants:
//! - A segment is mapped only once its header checked ([`super::check_header`]); its fd is
//!   closed as soon as it is mapped.
//! - A segment's state goes back to free only after the copy out of it has finished, so a
//!   worker never overwrites a batch still being read.
//! - A mapping leaves the cache only to the reclaimer, which unmaps it off the GIL once no
//!   copy borrows it; every method that lets go of a borrowed mapping reaps.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::header::{
    bad_header, check_header, read_header, state_word, SegmentKey, DATA_OFFSET, STATE_FREE,
};
use crate::allocation::slots::SlotId;
use crate::error::{Error, Result};
use crate::memory::shm::Mapping;
use crate::pool::fill_and_send::Sending;
use crate::pool::slot::OwnedSlotHold;
use crate::pool::Pool;
use crate::system::cuda::{Event, StreamHandle};
use crate::transfer::copy::{CopyRange, Copying};
use crate::transport::reclaim::Reclaimer;

/// Ranges relative to the data area, made relative to the mapping.
fn shift_to_data(map: &Mapping, ranges: &[CopyRange]) -> Result<Vec<CopyRange>> {
    ranges
        .iter()
        .map(|r| {
            r.src.checked_add(DATA_OFFSET).map(|src| CopyRange { src, ..*r }).ok_or(
                Error::OutOfRange {
                    what: "segment data",
                    offset: r.src,
                    len: r.len,
                    size: map.len() - DATA_OFFSET,
                },
            )
        })
        .collect()
}

/// The main process's mappings of worker segments.
pub struct SegmentCache {
    pool: Arc<Pool>,
    /// Maps and counts the segments, and unmaps the retired ones.
    reclaimer: Arc<Reclaimer>,
    maps: Mutex<HashMap<SegmentKey, Arc<Mapping>>>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache").field("mapped", &self.len()).finish()
    }
}

impl SegmentCache {
    /// An empty cache whose copies go into `pool`'s slots and whose segments `reclaimer` maps
    /// and unmaps (one reclaimer may serve several caches: [`SharedReclaimer`]).
    ///
    /// [`SharedReclaimer`]: crate::transport::reclaim::SharedReclaimer
    pub fn new(pool: Arc<Pool>, reclaimer: Arc<Reclaimer>) -> Self {
        SegmentCache { pool, reclaimer, maps: Mutex::new(HashMap::new()) }
    }

    /// The pool whose slots copies go into.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The reclaimer that maps, counts and unmaps this cache's segments.
    pub fn reclaimer(&self) -> &Arc<Reclaimer> {
        &self.reclaimer
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, HashMap<SegmentKey, Arc<Mapping>>> {
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Segments currently mapped.
    pub fn len(&self) -> usize {
        self.maps().len()
    }

    /// Whether no segment is mapped.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is mapped.
    pub fn contains(&self, key: SegmentKey) -> bool {
        self.maps().contains_key(&key)
    }

    /// Maps the segment `key` from `fd` (`total_len` bytes) and checks its header against
    /// `nonce`. A segment already known under `key` is replaced (the old one is retired).
    pub fn insert(&self, key: SegmentKey, fd: OwnedFd, total_len: usize, nonce: u64) -> Result<()> {
        if total_len <= DATA_OFFSET {
            return Err(Error::Invalid(format!("segment of {total_len} bytes has no data area")));
        }
        // Only a memfd sealed against shrinking is mapped (checked by `Mapping::from_fd`):
        // otherwise its sender could truncate it under our mapping and turn a read into SIGBUS.
        let mut map = self.reclaimer.map(fd, total_len, true)?;
        map.close_fd();
        // The mapping is at least DATA_OFFSET bytes long (checked above).
        if let Err(bad) = check_header(&read_header(&map), total_len, nonce) {
            self.reclaimer.retire(map);
            return Err(bad_header(key, total_len, nonce, bad));
        }
        let old = self.maps().insert(key, Arc::new(map));
        if let Some(old) = old {
            self.retire_arc(old);
        }
        Ok(())
    }

    /// Copies `ranges` (source offsets relative to the segment's data area) into the slot of
    /// `slot`. Every range is validated; the segment stays in flight.
    pub fn copy_to_slot(
        &self,
        key: SegmentKey,
        slot: SlotId,
        ranges: &[CopyRange],
    ) -> Result<usize> {
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        let result = self.pool.copy_in(slot, &map, &shifted);
        drop(map);
        self.reclaimer.reap();
        result
    }

    /// As [`SegmentCache::copy_to_slot`], then the slot's first `len` bytes queued for a copy
    /// to device memory at `dst` on `stream` ([`Pool::copy_in_and_send`]); returns the event
    /// recorded after it.
    ///
    /// # Safety
    /// As [`Pool::copy_in_and_send`].
    pub unsafe fn copy_to_device(
        &self,
        key: SegmentKey,
        slot: SlotId,
        ranges: &[CopyRange],
        dst: u64,
        len: usize,
        stream: StreamHandle,
    ) -> Result<Event> {
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        // SAFETY: forwarded from the caller.
        let result = unsafe { self.pool.copy_in_and_send(slot, &map, &shifted, dst, len, stream) };
        drop(map);
        self.reclaimer.reap();
        result
    }

    /// As [`SegmentCache::copy_to_slot`] into the slot `hold` holds, but on one of the pool's
    /// copy threads ([`Pool::copy_in_background`]): returns at once, once every range is
    /// checked. The segment is handed back to its worker on that thread, right after the copy
    /// (do not [`SegmentCache::hand_back`] it too).
    pub fn copy_to_slot_then_hand_back(
        &self,
        key: SegmentKey,
        hold: OwnedSlotHold,
        ranges: &[CopyRange],
    ) -> Result<Arc<Copying>> {
        let (map, shifted) = self.for_copy_thread(key, &hold, ranges)?;
        let id = hold.slot().id();
        // SAFETY: a hold keeps its slot out of the pool until it is dropped (a release
        // meanwhile waits for it: `crate::pool::slot`).
        unsafe { self.pool.copy_in_background(id, hold, map, shifted, self.hand_back_after()) }
    }

    /// As [`SegmentCache::copy_to_slot_then_hand_back`], and then, on that copy thread, a copy of
    /// the slot's first `len` bytes to device memory at `dst` on `stream`
    /// ([`Pool::copy_in_and_send_in_background`]): returns at once, once every range and the
    /// send are checked, with the copy's [`Copying`] and where the send's event lands.
    ///
    /// # Safety
    /// As [`SegmentCache::copy_to_device`]: `[dst, dst+len)` is device memory of the pool's
    /// device that stays allocated until the copy to it is queued (`keep`, dropped on the
    /// copy thread after that, may be what keeps it) and then until it has run; the caller
    /// releases the slot fenced on `stream` (the release waits for `hold`: it is recorded
    /// after the send).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_to_device_then_hand_back<K: Send + 'static>(
        &self,
        key: SegmentKey,
        hold: OwnedSlotHold,
        ranges: &[CopyRange],
        dst: u64,
        len: usize,
        stream: StreamHandle,
        keep: K,
    ) -> Result<(Arc<Copying>, Arc<Sending>)> {
        let (map, shifted) = self.for_copy_thread(key, &hold, ranges)?;
        let id = hold.slot().id();
        // SAFETY: the hold keeps its slot out of the pool until it is dropped, after the send;
        // the caller vouches for `dst`.
        unsafe {
            self.pool.copy_in_and_send_in_background(
                id,
                (hold, keep),
                map,
                shifted,
                dst,
                len,
                stream,
                self.hand_back_after(),
            )
        }
    }

    /// Copies `ranges` (source offsets relative to the data area) into caller-owned memory.
    ///
    /// # Safety
    /// As [`Pool::copy_out`]: `[dst, dst + dst_len)` is writable and exclusively ours.
    pub unsafe fn copy_to_memory(
        &self,
        key: SegmentKey,
        dst: *mut u8,
        dst_len: usize,
        ranges: &[CopyRange],
    ) -> Result<usize> {
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        // SAFETY: forwarded from the caller.
        let result = unsafe { self.pool.copy_out(&map, dst, dst_len, &shifted) };
        drop(map);
        self.reclaimer.reap();
        result
    }

    /// Hands the segment back to its worker for the next batch.
    pub fn hand_back(&self, key: SegmentKey) -> Result<()> {
        let map = self.get(key)?;
        state_word(&map).store(STATE_FREE, Ordering::Release);
        Ok(())
    }

    /// Forgets the segment and unmaps it on the reclaimer thread.
    pub fn retire(&self, key: SegmentKey) -> bool {
        let removed = self.maps().remove(&key);
        match removed {
            Some(map) => {
                self.retire_arc(map);
                true
            }
            None => false,
        }
    }

    /// Retires every segment of worker `worker` (all of them with `None`); returns how many.
    pub fn retire_all(&self, worker: Option<u64>) -> usize {
        let victims: Vec<Arc<Mapping>> = {
            let mut maps = self.maps();
            let keys: Vec<SegmentKey> =
                maps.keys().filter(|k| worker.is_none_or(|w| k.0 == w)).copied().collect();
            keys.iter().filter_map(|k| maps.remove(k)).collect()
        };
        let n = victims.len();
        for map in victims {
            self.retire_arc(map);
        }
        n
    }

    /// The segment's mapping and `ranges` shifted into its data area, for a copy on a copy
    /// thread into the slot `hold` holds, checked first (the slot is this pool's, the segment
    /// is known, every range lies in its data area).
    fn for_copy_thread(
        &self,
        key: SegmentKey,
        hold: &OwnedSlotHold,
        ranges: &[CopyRange],
    ) -> Result<(Arc<Mapping>, Vec<CopyRange>)> {
        if !Arc::ptr_eq(hold.slot().pool(), &self.pool) {
            return Err(Error::Invalid("this slot belongs to another pool".into()));
        }
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        Ok((map, shifted))
    }

    /// What a copy thread does with a segment's mapping after the copy: hands the segment back
    /// to its worker, and unmaps it then if it was retired meanwhile.
    fn hand_back_after(&self) -> impl FnOnce(Arc<Mapping>) + Send + 'static {
        let reclaimer = Arc::clone(&self.reclaimer);
        move |map: Arc<Mapping>| {
            state_word(&map).store(STATE_FREE, Ordering::Release);
            drop(map);
            reclaimer.reap();
        }
    }

    fn get(&self, key: SegmentKey) -> Result<Arc<Mapping>> {
        self.maps().get(&key).cloned().ok_or_else(|| {
            Error::Invalid(format!("segment {key:?} is unknown to this process (never received)"))
        })
    }

    fn retire_arc(&self, map: Arc<Mapping>) {
        self.reclaimer.retire_shared(map);
    }
}

impl Drop for SegmentCache {
    fn drop(&mut self) {
        self.retire_all(None);
        self.reclaimer.reap();
    }
}
