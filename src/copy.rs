//! Copying lists of byte ranges with a fixed set of threads of our own.
//!
//! Invariants:
//! - The copier never decides what is safe to copy: callers validate every range against the
//!   memory it names first (see `pool.rs`), then call the `unsafe` [`Copier::copy`].
//! - Work runs on the copier's own threads, never on a Python thread's intra-op pool, so
//!   torch's `set_num_threads(1)` in its pin thread does not throttle us.
//! - Small copies run on the calling thread: a thread hand-off costs more than it saves.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Copy `len` bytes from `src` (offset in the source) to `dst` (offset in the destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRange {
    /// Offset in the source.
    pub src: usize,
    /// Offset in the destination.
    pub dst: usize,
    /// Byte count.
    pub len: usize,
}

/// Below this many bytes in all, copy on the calling thread.
const PARALLEL_MIN: usize = 1 << 20;
/// No chunk handed to a thread is smaller than this.
const CHUNK_MIN: usize = 256 << 10;

/// A fixed pool of copy threads.
pub struct Copier {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier").field("threads", &self.threads).finish()
    }
}

impl Copier {
    /// A copier with `threads` threads (at least one).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pinpool-copy-{i}"))
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start copy threads: {e}")))?;
        Ok(Copier { pool, threads })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Copies every range from `src_base` to `dst_base`; returns the bytes copied.
    ///
    /// # Safety
    /// For every range, `[src_base+src, +len)` is readable and `[dst_base+dst, +len)` writable
    /// for the whole call, no destination range overlaps another range (source or
    /// destination), and nothing else writes the destination meanwhile.
    pub unsafe fn copy(
        &self,
        src_base: *const u8,
        dst_base: *mut u8,
        ranges: &[CopyRange],
    ) -> usize {
        let total: usize = ranges.iter().map(|r| r.len).sum();
        let (src, dst) = (src_base as usize, dst_base as usize);
        if total < PARALLEL_MIN || self.threads == 1 {
            for r in ranges {
                // SAFETY: the caller guarantees both ranges are valid and disjoint.
                unsafe { copy_one(src + r.src, dst + r.dst, r.len) };
            }
            return total;
        }
        let chunk = total.div_ceil(self.threads * 2).max(CHUNK_MIN);
        let pieces: Vec<CopyRange> = ranges
            .iter()
            .flat_map(|r| {
                (0..r.len).step_by(chunk).map(move |off| CopyRange {
                    src: r.src + off,
                    dst: r.dst + off,
                    len: chunk.min(r.len - off),
                })
            })
            .collect();
        self.pool.install(|| {
            pieces.par_iter().for_each(|p| {
                // SAFETY: each piece lies inside a range the caller vouched for; pieces of
                // one range are disjoint, and ranges are disjoint by the caller's contract.
                unsafe { copy_one(src + p.src, dst + p.dst, p.len) };
            });
        });
        total
    }
}

/// # Safety
/// `[src, src+len)` readable, `[dst, dst+len)` writable, the two disjoint.
unsafe fn copy_one(src: usize, dst: usize, len: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copy_matches_serial() {
        let src: Vec<u8> = (0..(5 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len() + 100];
        let ranges = [
            CopyRange { src: 0, dst: 100, len: 3 << 20 },
            CopyRange { src: 3 << 20, dst: (3 << 20) + 100, len: (2 << 20) - 5 },
        ];
        let copier = Copier::new(4).unwrap();
        // SAFETY: ranges lie inside both vectors and do not overlap.
        let n = unsafe { copier.copy(src.as_ptr(), dst.as_mut_ptr(), &ranges) };
        assert_eq!(n, (5 << 20) - 5);
        assert_eq!(&dst[100..100 + (5 << 20) - 5], &src[..(5 << 20) - 5]);
        assert!(dst[..100].iter().all(|&b| b == 0));
    }
}
