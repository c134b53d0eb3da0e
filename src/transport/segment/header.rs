//! A segment's header: its layout (the table in [`super`]), how a worker writes it, and how
//! the main process checks a segment it is handed before it trusts a byte of it.
//!
//! Invariants:
//! - [`check_header`] is a pure function of the header bytes: it accepts exactly a header with
//!   the magic, a capacity that fits the file and the nonce expected (property-tested over
//!   arbitrary bytes).
//! - [`check_segment_fd`] checks the seals before the size, and the size before it reads the
//!   header: a file that could shrink, or a short one, is refused before it is read.

use std::os::fd::BorrowedFd;
use std::sync::atomic::AtomicU32;

use crate::error::{Error, Result};
use crate::memory::shm::{check_sealed, Mapping};

/// Identifies a segment: the worker that made it (a random per-process key) and its number.
pub type SegmentKey = (u64, u32);

/// Where batch data starts in a segment.
pub const DATA_OFFSET: usize = 4096;
/// Bytes of the header (the rest of the first page is unused).
pub const HEADER_LEN: usize = 64;
pub(super) const MAGIC: [u8; 8] = *b"PINPSEG1";
/// Where the state word lies in the header: the one field that changes after creation.
pub(super) const STATE_AT: usize = 8;
pub(super) const CAPACITY_AT: usize = 16;
pub(super) const NONCE_AT: usize = 24;
pub(super) const STATE_FREE: u32 = 0;
pub(super) const STATE_BUSY: u32 = 1;

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
    /// The segment says it has `total_len <= DATA_OFFSET` bytes: no data area at all.
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

pub(super) fn state_word(map: &Mapping) -> &AtomicU32 {
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
pub(super) fn read_header(map: &Mapping) -> [u8; HEADER_LEN] {
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
pub(super) fn bad_header(key: SegmentKey, total_len: usize, nonce: u64, bad: BadHeader) -> Error {
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
/// from what the segment says; [`super::SegmentCache::insert`] checks all of it again once mapped.
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
