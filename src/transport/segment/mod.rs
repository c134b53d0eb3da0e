//! Batch segments: the shared memory a worker process collates a batch into, reused across
//! batches, and the main process's cache of their mappings.
//!
//! (Step 3 of "the life of a slot" in [`crate::pool`], copy mode: where a batch comes from.)
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
//! | 32     | zero up to [`HEADER_LEN`]                      |
//!
//! Integers are native-endian: both processes run on the same machine.
//!
//! Invariants:
//! - A worker writes a segment's data only after winning `free -> in flight` on its state
//!   word; the main process sets it back to free (release ordering) only after it has finished
//!   copying the data out, so a worker never overwrites a batch still being read.
//! - The main process trusts nothing in a segment: the mapping is never longer than the file,
//!   the header's magic, capacity and nonce are checked when a segment is first mapped (so a
//!   recycled fd number can never pass off another segment as this one; [`check_header`], a
//!   pure function of the header bytes, property-tested over arbitrary bytes), and every
//!   range is checked against the capacity before a copy ([`crate::pool::fill_and_send`]).
//! - The main process closes a segment's fd as soon as it is mapped; a mapping leaves the
//!   cache only to the cache's reclaimer ([`crate::transport::reclaim`]), which unmaps it off
//!   the GIL once no copy borrows it. Every method that lets go of a borrowed mapping reaps.
//! - The cache holds its pool and its reclaimer; the pool knows nothing of segments.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::allocation::slots::SlotId;
use crate::error::{Error, Result};
use crate::memory::shm::{check_sealed, page_size, round_up, Mapping};
use crate::pool::slot::OwnedSlotPin;
use crate::pool::Pool;
use crate::system::cuda::{Event, StreamHandle};
use crate::system::random::random_u64;
use crate::transfer::copy::{CopyDone, CopyRange};
use crate::transport::reclaim::Reclaimer;

/// Where batch data starts in a segment.
pub const DATA_OFFSET: usize = 4096;
/// Bytes of the header (the rest of the first page is unused).
pub const HEADER_LEN: usize = 64;
const MAGIC: [u8; 8] = *b"PINPSEG1";
/// Where the state word lies in the header: the one field that changes after creation.
const STATE_AT: usize = 8;
const CAPACITY_AT: usize = 16;
const NONCE_AT: usize = 24;
const STATE_FREE: u32 = 0;
const STATE_BUSY: u32 = 1;

/// The header a worker writes at the start of a new segment of `capacity` data bytes (state
/// free, unused bytes zero).
pub fn encode_header(capacity: usize, nonce: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..MAGIC.len()].copy_from_slice(&MAGIC);
    h[STATE_AT..STATE_AT + 4].copy_from_slice(&STATE_FREE.to_ne_bytes());
    h[CAPACITY_AT..CAPACITY_AT + 8].copy_from_slice(&(capacity as u64).to_ne_bytes());
    h[NONCE_AT..NONCE_AT + 8].copy_from_slice(&nonce.to_ne_bytes());
    h
}

/// Why [`check_header`] refused a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadHeader {
    /// Fewer than [`HEADER_LEN`] bytes.
    Short { len: usize },
    /// The segment claims `total_len <= DATA_OFFSET` bytes: no data area at all.
    NoDataArea { total_len: usize },
    /// Wrong magic, a capacity other than `total_len - DATA_OFFSET`, or the wrong nonce; the
    /// capacity and nonce found, for the error message.
    Mismatch { capacity: u64, nonce: u64 },
}

/// Checks the header bytes of a segment that its sender says is `total_len` bytes long
/// (header page included) and carries `nonce`; returns the capacity (data bytes).
///
/// Accepted exactly when `header` is at least [`HEADER_LEN`] bytes, `total_len >
/// DATA_OFFSET`, and the magic, capacity and nonce fields are those
/// [`encode_header`]`(total_len - DATA_OFFSET, nonce)` writes. The state word and the unused
/// bytes are not looked at (the state changes while the segment lives). Pure: it never reads
/// beyond `header`, and never panics.
pub fn check_header(
    header: &[u8],
    total_len: usize,
    nonce: u64,
) -> std::result::Result<usize, BadHeader> {
    let Some(header) = header.get(..HEADER_LEN) else {
        return Err(BadHeader::Short { len: header.len() });
    };
    let Some(expected) = total_len.checked_sub(DATA_OFFSET).filter(|&c| c > 0) else {
        return Err(BadHeader::NoDataArea { total_len });
    };
    let field = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&header[at..at + 8]);
        u64::from_ne_bytes(b)
    };
    let (capacity, found) = (field(CAPACITY_AT), field(NONCE_AT));
    if header[..MAGIC.len()] != MAGIC || capacity != expected as u64 || found != nonce {
        return Err(BadHeader::Mismatch { capacity, nonce: found });
    }
    Ok(expected)
}

fn state_word(map: &Mapping) -> &AtomicU32 {
    // SAFETY: every segment mapping is at least DATA_OFFSET (> 12) bytes, offset 8 is 4-byte
    // aligned in a page-aligned mapping, and the word is only ever accessed atomically, by
    // every process that maps the segment.
    unsafe { &*map.as_ptr().add(STATE_AT).cast::<AtomicU32>() }
}

/// A copy of the header of a mapped segment, for [`check_header`], read once, with volatile
/// loads: the bytes live in memory a worker process can write at any moment (a buggy one even
/// while we read), so they are copied out before they are looked at, and the compiler may
/// neither re-read nor assume them. The state word is left zero, not read: the worker changes
/// it (atomically) while the segment lives.
fn read_header(map: &Mapping) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    let base = map.as_ptr();
    for (i, byte) in h.iter_mut().enumerate() {
        if (STATE_AT..STATE_AT + 4).contains(&i) {
            continue;
        }
        // SAFETY: `i < HEADER_LEN`, inside a mapping of at least DATA_OFFSET (> HEADER_LEN)
        // bytes that lives as long as `map`; a byte read has no alignment requirement.
        *byte = unsafe { std::ptr::read_volatile(base.add(i)) };
    }
    h
}

/// The error for a header [`check_header`] refused.
fn bad_header(key: SegmentKey, total_len: usize, nonce: u64, bad: BadHeader) -> Error {
    Error::Invalid(match bad {
        BadHeader::Mismatch { capacity, nonce: found } => format!(
            "segment {key:?} has a bad header (magic, capacity {capacity} for {total_len} \
             bytes, or nonce {found:#x} where {nonce:#x} was expected)"
        ),
        other => format!("segment {key:?} has a bad header ({other:?})"),
    })
}

/// Checks, without mapping it, that `fd` is a segment of `total_len` bytes carrying `nonce`:
/// sealed against shrinking, that long, and with the header [`check_header`] accepts. Returns
/// its capacity. For a receiver that must know a segment is real before it sizes anything
/// from the segment's claims; [`SegmentCache::insert`] checks all of it again once mapped.
pub fn check_segment_fd(
    key: SegmentKey,
    fd: BorrowedFd<'_>,
    total_len: usize,
    nonce: u64,
) -> Result<usize> {
    check_sealed(fd)?;
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat", e))?;
    let file_len = usize::try_from(st.st_size).unwrap_or(0);
    if file_len != total_len {
        return Err(Error::OutOfRange {
            what: "segment file",
            offset: 0,
            len: total_len,
            size: file_len,
        });
    }
    let mut header = [0u8; HEADER_LEN];
    let got = rustix::io::pread(fd, &mut header, 0).map_err(|e| Error::os("pread", e))?;
    check_header(&header[..got], total_len, nonce)
        .map_err(|bad| bad_header(key, total_len, nonce, bad))
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
        let header = encode_header(capacity, nonce);
        // SAFETY: the header lies inside the fresh mapping (total > DATA_OFFSET > HEADER_LEN),
        // which no one else has seen yet.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.as_ptr(), HEADER_LEN) };
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

    /// Drops this process's page tables for the segment (see [`Mapping::drop_page_tables`]):
    /// a worker that has written its last batch of an epoch pays for them now rather than
    /// when it exits, inside the main process's join. Its batches are untouched (the memfd
    /// holds them; the main process reads through its own mapping) and a later write just
    /// faults the pages back in.
    pub fn drop_page_tables(&self) -> Result<()> {
        self.map.drop_page_tables()
    }
}

/// Identifies a segment: the worker that made it (a random per-process key) and its number.
pub type SegmentKey = (u64, u32);

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

    /// As [`SegmentCache::copy_to_slot`] into the slot `pin` holds, but on one of the pool's
    /// copy threads ([`Pool::copy_in_background`]): returns at once, once every range is
    /// checked. The segment is handed back to its worker on that thread, right after the copy
    /// (do not [`SegmentCache::release`] it too).
    pub fn copy_to_slot_then_release(
        &self,
        key: SegmentKey,
        pin: OwnedSlotPin,
        ranges: &[CopyRange],
    ) -> Result<Arc<CopyDone>> {
        if !Arc::ptr_eq(pin.slot().pool(), &self.pool) {
            return Err(Error::Invalid("this slot belongs to another pool".into()));
        }
        let map = self.get(key)?;
        let shifted = shift_to_data(&map, ranges)?;
        let id = pin.slot().id();
        let reclaimer = Arc::clone(&self.reclaimer);
        // SAFETY: a pin keeps its slot out of the pool until it is dropped (a release
        // meanwhile waits for it: `crate::pool::slot`).
        unsafe {
            self.pool.copy_in_background(id, pin, map, shifted, move |map| {
                // Back to its worker; and unmapped now if it was retired during the copy.
                state_word(&map).store(STATE_FREE, Ordering::Release);
                drop(map);
                reclaimer.reap();
            })
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
        self.reclaimer.retire_shared(map);
    }
}

impl Drop for SegmentCache {
    fn drop(&mut self) {
        self.retire_all(None);
        self.reclaimer.reap();
    }
}

#[cfg(test)]
mod tests;
