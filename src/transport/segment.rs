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

/// A random 64-bit number from the kernel.
fn random_u64() -> Result<u64> {
    let mut buf = [0u8; 8];
    let flags = rustix::rand::GetRandomFlags::empty();
    match rustix::rand::getrandom(&mut buf, flags) {
        Ok(8) => Ok(u64::from_ne_bytes(buf)),
        Ok(_) => Err(Error::Invalid("getrandom returned fewer than 8 bytes".into())),
        Err(e) => Err(Error::os("getrandom", e)),
    }
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
mod tests {
    use super::*;
    use crate::pool::slot::Slot;
    use crate::pool::PoolConfig;
    use proptest::prelude::*;

    /// A cache over `pool` with a reclaimer of its own.
    fn cache_over(pool: &Arc<Pool>) -> SegmentCache {
        SegmentCache::new(Arc::clone(pool), Arc::new(Reclaimer::start().unwrap()))
    }

    fn dup(seg: &WorkerSegment) -> OwnedFd {
        seg.fd().unwrap().try_clone_to_owned().unwrap()
    }

    /// What `check_header` must answer, written independently of it: accepted exactly when the
    /// header is whole, the segment has a data area, and the magic, capacity and nonce fields
    /// are the bytes `encode_header` writes for that segment.
    fn oracle(header: &[u8], total_len: usize, nonce: u64) -> Option<usize> {
        let capacity = total_len.checked_sub(DATA_OFFSET).filter(|&c| c > 0)?;
        let want = encode_header(capacity, nonce);
        let fields = [0..8, CAPACITY_AT..CAPACITY_AT + 8, NONCE_AT..NONCE_AT + 8];
        (header.len() >= HEADER_LEN && fields.iter().all(|f| header[f.clone()] == want[f.clone()]))
            .then_some(capacity)
    }

    /// Checks one answer of `check_header`: against the oracle, and, on acceptance, that the
    /// capacity it returns fits in the segment the header names.
    fn check_against_oracle(
        header: &[u8],
        total_len: usize,
        nonce: u64,
    ) -> std::result::Result<(), TestCaseError> {
        let got = check_header(header, total_len, nonce);
        prop_assert_eq!(got.ok(), oracle(header, total_len, nonce));
        if let Ok(capacity) = got {
            prop_assert!(header.len() >= HEADER_LEN);
            prop_assert!(capacity > 0);
            prop_assert_eq!(capacity.checked_add(DATA_OFFSET), Some(total_len));
        } else if header.len() < HEADER_LEN {
            prop_assert_eq!(got, Err(BadHeader::Short { len: header.len() }));
        }
        Ok(())
    }

    /// Segment lengths: none or tiny, ordinary, and near the top of the address space.
    fn total_len() -> impl Strategy<Value = usize> {
        prop_oneof![
            0..=DATA_OFFSET + 1,
            DATA_OFFSET..DATA_OFFSET + (1 << 20),
            any::<usize>(),
            (usize::MAX - 2 * DATA_OFFSET)..=usize::MAX,
        ]
    }

    /// A claimed capacity relative to `total_len`: `kind` picks exact, off by `delta`, the
    /// whole file (header included), a huge value, or anything.
    fn claimed_capacity(total_len: usize, kind: u8, delta: i64, any: u64) -> u64 {
        let exact = total_len.wrapping_sub(DATA_OFFSET) as u64;
        match kind % 6 {
            0 | 1 => exact,
            2 => exact.wrapping_add_signed(delta),
            3 => total_len as u64,
            4 => u64::MAX - (any % 4096),
            _ => any,
        }
    }

    proptest! {
        #![proptest_config(crate::proptest_config(2048))]

        /// Any bytes, any claimed length, any nonce: no panic, and nothing accepted that the
        /// oracle refuses (random bytes are all but always refused).
        #[test]
        fn header_parser_takes_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            total_len in total_len(),
            nonce in any::<u64>(),
        ) {
            check_against_oracle(&bytes, total_len, nonce)?;
            // The same bytes behind a valid magic: then mostly capacity and nonce decide.
            let mut magic = bytes.clone();
            let n = magic.len().min(MAGIC.len());
            magic[..n].copy_from_slice(&MAGIC[..n]);
            check_against_oracle(&magic, total_len, nonce)?;
        }

        /// Whole headers with arbitrary fields: a corrupted magic, any state, a capacity that
        /// is exact, off by a little, huge or arbitrary, the right or a wrong nonce, any
        /// padding, trailing bytes. Accepted exactly when the oracle says so.
        #[test]
        fn header_parser_checks_every_field(
            total_len in total_len(),
            (cap_kind, delta, cap_any) in (any::<u8>(), -8192i64..8192, any::<u64>()),
            (magic_at, magic_xor) in (0..16usize, any::<u8>()),
            state in any::<u32>(),
            (nonce, nonce_xor) in (any::<u64>(), prop_oneof![Just(0u64), Just(1u64), any::<u64>()]),
            padding in proptest::collection::vec(any::<u8>(), HEADER_LEN - 32),
            tail in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut h = encode_header(0, nonce ^ nonce_xor).to_vec();
            // magic_at >= 8: the magic stays intact.
            if let Some(b) = h.get_mut(..MAGIC.len()).and_then(|m| m.get_mut(magic_at)) {
                *b ^= magic_xor;
            }
            h[STATE_AT..STATE_AT + 4].copy_from_slice(&state.to_ne_bytes());
            let capacity = claimed_capacity(total_len, cap_kind, delta, cap_any);
            h[CAPACITY_AT..CAPACITY_AT + 8].copy_from_slice(&capacity.to_ne_bytes());
            h[32..].copy_from_slice(&padding);
            h.extend_from_slice(&tail);
            check_against_oracle(&h, total_len, nonce)?;
            // Any prefix shorter than a whole header is refused, never read past.
            let cut = (cap_any as usize) % HEADER_LEN;
            prop_assert_eq!(check_header(&h[..cut], total_len, nonce), Err(BadHeader::Short { len: cut }));
        }

        /// What a worker writes is what the main process accepts, for any capacity and nonce,
        /// whatever the state word says; one flipped bit in a checked field, another nonce or
        /// another length is refused.
        #[test]
        fn header_round_trip(
            capacity in prop_oneof![1..(1usize << 40), 1..=usize::MAX - DATA_OFFSET],
            nonce in any::<u64>(),
            state in any::<u32>(),
            bit in 0..(24 * 8usize),
            wrong_nonce in 1..=u64::MAX,
            wrong_len in prop_oneof![Just(0usize), 1..DATA_OFFSET + 1, any::<usize>()],
        ) {
            let total_len = capacity + DATA_OFFSET;
            let mut h = encode_header(capacity, nonce);
            prop_assert_eq!(check_header(&h, total_len, nonce), Ok(capacity));
            h[STATE_AT..STATE_AT + 4].copy_from_slice(&state.to_ne_bytes());
            prop_assert_eq!(check_header(&h, total_len, nonce), Ok(capacity));
            prop_assert!(check_header(&h, total_len, nonce ^ wrong_nonce).is_err());
            if wrong_len != total_len {
                prop_assert!(check_header(&h, wrong_len, nonce).is_err());
            }
            // Bits of the magic (bytes 0..8), the capacity and the nonce (16..32).
            let byte = if bit < 64 { bit / 8 } else { 16 + (bit - 64) / 8 };
            h[byte] ^= 1 << (bit % 8);
            prop_assert!(check_header(&h, total_len, nonce).is_err());
        }
    }

    #[test]
    fn header_parser_edge_cases() {
        let h = encode_header(4096, 7);
        assert_eq!(check_header(&h, DATA_OFFSET + 4096, 7), Ok(4096));
        assert_eq!(check_header(&[], usize::MAX, 0), Err(BadHeader::Short { len: 0 }));
        assert_eq!(
            check_header(&h[..63], DATA_OFFSET + 4096, 7),
            Err(BadHeader::Short { len: 63 })
        );
        for total_len in [0, 1, DATA_OFFSET - 1, DATA_OFFSET] {
            assert_eq!(check_header(&h, total_len, 7), Err(BadHeader::NoDataArea { total_len }));
        }
        // A capacity of zero never passes, even when it matches (no data area).
        assert!(check_header(&encode_header(0, 7), DATA_OFFSET, 7).is_err());
        // A header claiming the largest possible segment is accepted only for that length.
        let max = usize::MAX - DATA_OFFSET;
        assert_eq!(check_header(&encode_header(max, 1), usize::MAX, 1), Ok(max));
        assert!(check_header(&encode_header(max, 1), usize::MAX - 1, 1).is_err());
        assert!(matches!(
            check_header(&encode_header(u64::MAX as usize, 1), DATA_OFFSET + 1, 1),
            Err(BadHeader::Mismatch { capacity: u64::MAX, nonce: 1 })
        ));
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn worker_to_slot_round_trip() {
        let pool = Pool::new(&PoolConfig::host(1 << 16, 2)).unwrap();
        let cache = cache_over(&pool);
        let seg = WorkerSegment::create(10_000).unwrap();
        assert_eq!(read_header(&seg.map), encode_header(seg.capacity(), seg.nonce()));
        assert_eq!(check_header(&read_header(&seg.map), seg.total_len(), seg.nonce()), Ok(12_288));
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
        cache.reclaimer().flush();
        assert_eq!(cache.reclaimer().stats().unmapped, 1);
    }

    /// Resident pages of this process's mapping that starts at `addr` (`/proc/self/smaps`).
    fn resident_kib(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        assert!(lines.next().is_some(), "no mapping at {addr:#x}");
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    // Miri: madvise and /proc are outside what Miri runs.
    #[cfg_attr(miri, ignore)]
    fn dropped_page_tables_keep_the_batch_for_the_reader_and_the_writer() {
        let pool = Pool::new(&PoolConfig::host(1 << 20, 1)).unwrap();
        let cache = cache_over(&pool);
        let seg = WorkerSegment::create(1 << 20).unwrap();
        assert!(seg.try_claim());
        // SAFETY: test writes inside the segment's data area.
        unsafe { std::ptr::write_bytes(seg.data_ptr(), 0x5A, 1 << 20) };
        cache.insert((3, 0), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
        let before = resident_kib(seg.map.as_ptr() as usize);
        seg.drop_page_tables().unwrap();
        let after = resident_kib(seg.map.as_ptr() as usize);
        assert!(before >= 1024 && after < before / 8, "{before} KiB -> {after} KiB mapped");
        assert!(seg.in_flight(), "the state word is kept");
        // The reader's copy sees the batch.
        let t = pool.checkout(None).unwrap();
        let n =
            cache.copy_to_slot((3, 0), t, &[CopyRange { src: 0, dst: 0, len: 1 << 20 }]).unwrap();
        assert_eq!(n, 1 << 20);
        // SAFETY: reading inside the slot we hold.
        let slot = unsafe { std::slice::from_raw_parts(pool.slot_ptr(t).unwrap(), 1 << 20) };
        assert!(slot.iter().all(|&b| b == 0x5A));
        // And so does the writer, through its own pointer, faulting the pages back in.
        // SAFETY: reading inside the segment's data area.
        let own = unsafe { std::slice::from_raw_parts(seg.data_ptr(), 1 << 20) };
        assert!(own.iter().all(|&b| b == 0x5A));
        cache.release((3, 0)).unwrap();
        assert!(seg.try_claim());
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_background_copy_hands_the_segment_back_and_outlives_the_slots_owner() {
        let pool = Pool::new(&PoolConfig::host(1 << 20, 2)).unwrap();
        let cache = cache_over(&pool);
        let seg = WorkerSegment::create(600_000).unwrap();
        assert!(seg.try_claim());
        // SAFETY: test writes inside the segment's data area.
        unsafe {
            for i in 0..600_000 {
                *seg.data_ptr().add(i) = (i % 251) as u8;
            }
        }
        cache.insert((3, 0), dup(&seg), seg.total_len(), seg.nonce()).unwrap();
        for round in 0..20 {
            let slot = Arc::new(Slot::new(Arc::clone(&pool), pool.checkout(None).unwrap()));
            let pin = slot.pin_owned(&pool).unwrap();
            let range = [CopyRange { src: 0, dst: 8, len: 600_000 }];
            let done = cache.copy_to_slot_then_release((3, 0), pin, &range).unwrap();
            if round % 2 == 1 {
                // The owner dies at once (its batch dropped unread): the slot must stay out
                // of the pool until the copy is over, then come back exactly once.
                slot.finish(|| Ok(None));
                done.wait();
                assert_eq!(pool.stats().slots.free, 2, "round {round}");
                assert!(seg.try_claim(), "the segment was not handed back");
                continue;
            }
            done.wait();
            assert!(done.is_done());
            let ptr = slot.address().unwrap();
            // SAFETY: reading inside the slot the lease holds, after the copy is done.
            let got = unsafe { std::slice::from_raw_parts(ptr.add(8), 600_000) };
            assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "round {round}");
            assert!(seg.try_claim(), "the segment was not handed back");
            slot.release(None).unwrap();
            assert_eq!(pool.stats().slots.free, 2);
        }
        assert_eq!(pool.stats().releases, 20, "a slot given back twice, or not at all");
        // A bad range is refused before anything runs; the pin goes with the error.
        let slot = Arc::new(Slot::new(Arc::clone(&pool), pool.checkout(None).unwrap()));
        let past_end = [CopyRange { src: 0, dst: (1 << 20) - 4, len: 8 }];
        let pin = slot.pin_owned(&pool).unwrap();
        assert!(cache.copy_to_slot_then_release((3, 0), pin, &past_end).is_err());
        let pin = slot.pin_owned(&pool).unwrap();
        assert!(cache.copy_to_slot_then_release((8, 8), pin, &[]).is_err(), "unknown segment");
        slot.release(None).unwrap();
        assert_eq!(pool.stats().slots.free, 2, "a refused copy kept its pin");
    }

    #[test]
    // Miri: a pool maps its arena with mmap (a PROT_NONE reservation), which Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn corrupt_requests_are_errors() {
        let pool = Pool::new(&PoolConfig::host(1 << 16, 1)).unwrap();
        let cache = cache_over(&pool);
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
        let tally = cache.reclaimer().tally().clone();
        drop(cache);
        tally.flush();
        let s = tally.stats();
        assert_eq!(s.mapped, s.unmapped);
    }
}
