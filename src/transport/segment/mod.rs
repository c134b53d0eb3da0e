//! Batch segments: the shared memory a worker process collates a batch into, reused across
//! batches, and the main process's cache of their mappings.
//!
//! This module is the worker's side ([`WorkerSegment`]); `header` is the header's layout and
//! its checks, `cache` the main process's mappings ([`SegmentCache`]).
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

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::memory::shm::{page_size, round_up, Mapping};
use crate::system::random::random_u64;

mod cache;
mod header;

pub use cache::SegmentCache;
pub use header::{
    check_header, check_segment_fd, encode_header, BadHeader, SegmentKey, DATA_OFFSET, HEADER_LEN,
};

use header::{state_word, STATE_BUSY, STATE_FREE};

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

    /// Begins a new batch in the segment (it is in flight from now on); false while the
    /// last one is.
    pub fn try_begin(&self) -> bool {
        state_word(&self.map)
            .compare_exchange(STATE_FREE, STATE_BUSY, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Marks the segment free again without sending it (the batch was abandoned).
    pub fn abandon(&self) {
        state_word(&self.map).store(STATE_FREE, Ordering::Release);
    }

    /// Whether the main process still holds the last batch.
    pub fn in_flight(&self) -> bool {
        state_word(&self.map).load(Ordering::Acquire) == STATE_BUSY
    }
}

#[cfg(test)]
mod tests;
