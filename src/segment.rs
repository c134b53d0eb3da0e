//! Batch segments: the shared memory a worker process collates a batch into, reused across
//! batches, and the main process's cache of their mappings.
//!
//! Layout of a segment (one sealed memfd): a 64-byte header at offset 0, then the batch data
//! from [`DATA_OFFSET`] (one page) to the end.
//!
//! | offset | field                                         |
//! | ------ | --------------------------------------------- |
//! | 0      | magic `b"PINPSEG1"`                            |
//! | 8      | state, `u32`: 0 = free for the worker, 1 = in flight |
//! | 16     | capacity, `u64`: bytes from `DATA_OFFSET`     |
//! | 24     | nonce, `u64`: random, names this segment among all others |
//!
//! Invariants:
//! - A worker writes a segment's data only after winning `free -> in flight` on its state
//!   word; the main process sets it back to free (release ordering) only after it has finished
//!   copying the data out, so a worker never overwrites a batch still being read.
//! - The main process trusts nothing in a segment: the mapping is never longer than the file,
//!   the header's magic, capacity and nonce are checked when a segment is first mapped (so a
//!   recycled fd number can never pass off another segment as this one), and every
//!   range is checked against the capacity before a copy (see `pool.rs`).
//! - The main process closes a segment's fd as soon as it is mapped; a mapping leaves the
//!   cache only to the reclaimer thread, which unmaps it off the GIL.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::copy::CopyRange;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::shm::{page_size, round_up, Mapping};
use crate::slots::Ticket;

/// Where batch data starts in a segment.
pub const DATA_OFFSET: usize = 4096;
const MAGIC: [u8; 8] = *b"PINPSEG1";
const STATE_FREE: u32 = 0;
const STATE_BUSY: u32 = 1;

fn state_word(map: &Mapping) -> &AtomicU32 {
    // SAFETY: every segment mapping is at least DATA_OFFSET (> 12) bytes, offset 8 is 4-byte
    // aligned in a page-aligned mapping, and the word is only ever accessed atomically, by
    // every process that maps the segment.
    unsafe { &*map.as_ptr().add(8).cast::<AtomicU32>() }
}

fn read_header_u64(map: &Mapping, offset: usize) -> u64 {
    debug_assert!(offset + 8 <= 64);
    // SAFETY: offset + 8 <= 64 lies inside the header page of a mapping of at least
    // DATA_OFFSET bytes; an unaligned read tolerates any alignment.
    unsafe { map.as_ptr().add(offset).cast::<u64>().read_unaligned() }
}

/// A random 64-bit number from the kernel.
fn random_u64() -> Result<u64> {
    let mut buf = [0u8; 8];
    // SAFETY: `buf` is a valid writable buffer of 8 bytes.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != 8 {
        return Err(Error::last_os("getrandom"));
    }
    Ok(u64::from_ne_bytes(buf))
}

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

/// A worker's segment: creates and writes it.
#[derive(Debug)]
pub struct WorkerSegment {
    map: Mapping,
    capacity: usize,
    nonce: u64,
}

impl WorkerSegment {
    /// A new segment able to hold `capacity` data bytes (rounded up to a page), pre-faulted.
    pub fn create(capacity: usize) -> Result<Self> {
        let capacity = round_up(capacity.max(1), page_size())
            .ok_or_else(|| Error::Invalid("segment capacity too large".into()))?;
        let total = capacity
            .checked_add(DATA_OFFSET)
            .ok_or_else(|| Error::Invalid("segment capacity too large".into()))?;
        let map = Mapping::memfd("pinpool-segment", total)?;
        map.populate(1)?;
        let nonce = random_u64()?;
        // SAFETY: the header lies inside the fresh mapping, which no one else has seen yet.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), map.as_ptr(), MAGIC.len());
            map.as_ptr().add(16).cast::<u64>().write_unaligned(capacity as u64);
            map.as_ptr().add(24).cast::<u64>().write_unaligned(nonce);
        }
        Ok(WorkerSegment { map, capacity, nonce })
    }

    /// The random number in the header that the receiver checks.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// Data bytes available.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Total length of the memfd (header + data).
    pub fn total_len(&self) -> usize {
        self.map.len()
    }

    /// The memfd.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.map.fd()
    }

    /// The first data byte.
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET < total length.
        unsafe { self.map.as_ptr().add(DATA_OFFSET) }
    }

    /// Claims the segment for writing a new batch; false while the last one is in flight.
    pub fn try_claim(&self) -> bool {
        state_word(&self.map)
            .compare_exchange(STATE_FREE, STATE_BUSY, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Marks the segment free again without sending it (the batch was abandoned).
    pub fn unclaim(&self) {
        state_word(&self.map).store(STATE_FREE, Ordering::Release);
    }

    /// Whether the main process still holds the last batch.
    pub fn in_flight(&self) -> bool {
        state_word(&self.map).load(Ordering::Acquire) == STATE_BUSY
    }
}

/// Identifies a segment: the worker that made it (a random per-process key) and its number.
pub type SegmentKey = (u64, u32);

/// The main process's mappings of worker segments.
pub struct SegmentCache {
    pool: Arc<Pool>,
    maps: Mutex<HashMap<SegmentKey, Arc<Mapping>>>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache").field("mapped", &self.len()).finish()
    }
}

impl SegmentCache {
    /// An empty cache whose copies go into `pool`'s slots.
    pub fn new(pool: Arc<Pool>) -> Self {
        SegmentCache { pool, maps: Mutex::new(HashMap::new()) }
    }

    /// The pool whose slots copies go into.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
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
        // A worker segment must be sealed against shrinking: otherwise its sender could
        // truncate it under our mapping and turn a read into SIGBUS.
        // SAFETY: F_GET_SEALS on a valid fd has no memory-safety preconditions.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::Invalid(format!(
                "segment {key:?} is not a sealed memfd (it could shrink under the mapping)"
            )));
        }
        let mut map = self.pool.map_segment(fd, total_len, true)?;
        map.close_fd();
        // SAFETY: the mapping is at least DATA_OFFSET bytes long (checked above).
        let magic = unsafe { std::slice::from_raw_parts(map.as_ptr(), MAGIC.len()) };
        let capacity = read_header_u64(&map, 16);
        let found = read_header_u64(&map, 24);
        if magic != MAGIC || capacity != (total_len - DATA_OFFSET) as u64 || found != nonce {
            self.pool.retire_segment(map);
            return Err(Error::Invalid(format!(
                "segment {key:?} has a bad header (magic, capacity {capacity} for {total_len} \
                 bytes, or nonce {found:#x} where {nonce:#x} was expected)"
            )));
        }
        let old = self.maps().insert(key, Arc::new(map));
        if let Some(old) = old {
            self.retire_arc(old);
        }
        Ok(())
    }

    /// Copies `ranges` (source offsets relative to the segment's data area) into the slot of
    /// `ticket`. Every range is validated; the segment stays in flight.
    pub fn copy_to_slot(
        &self,
        key: SegmentKey,
        ticket: Ticket,
        ranges: &[CopyRange],
    ) -> Result<usize> {
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        let result = self.pool.copy_in(ticket, &map, &shifted);
        drop(map);
        self.pool.reap_lingering();
        result
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
        self.pool.reap_lingering();
        result
    }

    /// Returns the segment to its worker for the next batch.
    pub fn release(&self, key: SegmentKey) -> Result<()> {
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

    fn get(&self, key: SegmentKey) -> Result<Arc<Mapping>> {
        self.maps().get(&key).cloned().ok_or_else(|| {
            Error::Invalid(format!("segment {key:?} is unknown to this process (never received)"))
        })
    }

    fn retire_arc(&self, map: Arc<Mapping>) {
        self.pool.retire_shared_segment(map);
    }
}

impl Drop for SegmentCache {
    fn drop(&mut self) {
        self.retire_all(None);
        self.pool.reap_lingering();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    fn dup(seg: &WorkerSegment) -> OwnedFd {
        seg.fd().unwrap().try_clone_to_owned().unwrap()
    }

    #[test]
    fn worker_to_slot_round_trip() {
        let pool = Pool::new(&PoolConfig::host(1 << 16, 2)).unwrap();
        let cache = SegmentCache::new(Arc::clone(&pool));
        let seg = WorkerSegment::create(10_000).unwrap();
        assert!(seg.try_claim());
        assert!(!seg.try_claim(), "a segment in flight cannot be claimed again");
        // SAFETY: test writes inside the segment's data area.
        unsafe { std::ptr::write_bytes(seg.data_ptr(), 0xAB, 10_000) };
        cache.insert((7, 0), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
        let t = pool.checkout(None).unwrap();
        let n =
            cache.copy_to_slot((7, 0), t, &[CopyRange { src: 0, dst: 64, len: 10_000 }]).unwrap();
        assert_eq!(n, 10_000);
        // SAFETY: reading inside the slot we hold.
        let slot = unsafe { std::slice::from_raw_parts(pool.slot_ptr(t).unwrap(), 10_064) };
        assert!(slot[64..].iter().all(|&b| b == 0xAB));
        cache.release((7, 0)).unwrap();
        assert!(seg.try_claim(), "released by the main process, the worker may reuse it");
        assert!(cache.retire((7, 0)));
        pool.flush_unmaps();
        assert_eq!(pool.stats().segments_unmapped, 1);
    }

    #[test]
    fn corrupt_requests_are_errors() {
        let pool = Pool::new(&PoolConfig::host(1 << 16, 1)).unwrap();
        let cache = SegmentCache::new(Arc::clone(&pool));
        let seg = WorkerSegment::create(4096).unwrap();
        // Claiming a longer file than exists.
        assert!(cache.insert((1, 1), dup(&seg), seg.total_len() + 4096, seg.nonce()).is_err());
        // The right file under the wrong nonce.
        assert!(cache.insert((1, 4), dup(&seg), seg.total_len(), seg.nonce() ^ 1).is_err());
        // A plain memfd without our header.
        let plain = Mapping::memfd("pinpool-test", 3 * 4096).unwrap();
        let fd = plain.fd().unwrap().try_clone_to_owned().unwrap();
        assert!(cache.insert((1, 2), fd, plain.len(), 0).is_err());
        cache.insert((1, 3), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
        let t = pool.checkout(None).unwrap();
        let past_end = [CopyRange { src: 4000, dst: 0, len: 200 }];
        assert!(cache.copy_to_slot((1, 3), t, &past_end).is_err());
        let wrap = [CopyRange { src: usize::MAX - 10, dst: 0, len: 20 }];
        assert!(cache.copy_to_slot((1, 3), t, &wrap).is_err());
        assert!(cache.copy_to_slot((9, 9), t, &[]).is_err(), "unknown segment");
        drop(cache);
        pool.flush_unmaps();
        let s = pool.stats();
        assert_eq!(s.segments_mapped, s.segments_unmapped);
    }
}
