//! Copying lists of byte ranges with a fixed set of threads of our own.
//!
//! Invariants:
//! - The copier never decides what is safe to copy: callers validate every range against the memory
//!   it names first ([`crate::pool::fill_and_send::validate_ranges`]), then call the `unsafe`
//!   [`Copier::copy`].
//! - Work runs on the copier's own threads, never on a Python thread's intra-op pool, so
//!   torch's `set_num_threads(1)` in its pin thread does not throttle us.
//! - Small copies run on the calling thread: a thread hand-off costs more than it saves.
//! - Big copies write with non-temporal stores on x86-64 (the destination is read next by the
//!   GPU, not the CPU); `PINPOOL_STREAMING_COPY=0` turns that off for comparison.
//! - A copy may also run in the background ([`Copier::spawn`]): the caller returns at once and
//!   waits on its [`Copying`] later. The job owns everything the copy touches (see
//!   `Pool::copy_in_background`), and `Copying` is set even if the job unwinds, so no waiter
//!   waits forever.
//! - A copy runs with its caller's rights to this process's memory protection keys
//!   ([`crate::system::pkeys`]): each piece takes them on its thread and gives them up as it ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

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

/// Below this many bytes in all, a copy is quicker than handing the GIL back and forth: a
/// thread that releases it must win it back from threads that keep it up to the interpreter's
/// switch interval, far longer than such a copy takes ("Small copies keep the GIL" in
/// `docs/performance.md`). The Python layer copies batches this small without releasing the
/// GIL.
pub const KEEP_GIL_MAX: usize = PARALLEL_MIN;
/// No chunk handed to a thread is smaller than this.
const CHUNK_MIN: usize = 256 << 10;

/// The most copy threads one copier may have. A copy is bound by memory bandwidth long before
/// this many threads help, and each thread costs a stack and a start-up: an unchecked number
/// (a typo, `100000`) would take minutes to start, or exhaust the process's threads.
pub const MAX_COPY_THREADS: usize = 64;

/// A fixed pool of copy threads.
pub struct Copier {
    pool: rayon::ThreadPool,
    threads: usize,
    streaming: bool,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier").field("threads", &self.threads).finish()
    }
}

impl Copier {
    /// A copier with `threads` threads, from 1 to [`MAX_COPY_THREADS`].
    pub fn new(threads: usize) -> Result<Self> {
        if !(1..=MAX_COPY_THREADS).contains(&threads) {
            return Err(Error::Invalid(format!(
                "copy_threads must be from 1 to {MAX_COPY_THREADS}, not {threads}"
            )));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pinpool-copy-{i}"))
            .start_handler(|_| {
                // (Started by a thread that may have had access to a window's key: a copy
                // thread has none but during a copy that hands it its caller's.)
                crate::system::pkeys::deny_all_ours();
            })
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start copy threads: {e}")))?;
        Ok(Copier { pool, threads, streaming: streaming_default() })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job` on one of the copier's threads; returns at once.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        self.pool.spawn(job);
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
        let streaming = self.streaming;
        // The caller's protection-key rights go with each piece: a zero-copy worker's window
        // open under its key is writable by the thread that opened it (and so by this copy).
        let rights = crate::system::pkeys::Rights::of_this_thread();
        self.pool.install(|| {
            pieces.par_iter().for_each(|p| {
                let _rights = crate::system::pkeys::Adopted::new(rights);
                // SAFETY: each piece lies inside a range the caller vouched for; pieces of
                // one range are disjoint, and ranges are disjoint by the caller's contract.
                unsafe {
                    if streaming {
                        copy_streaming(src + p.src, dst + p.dst, p.len)
                    } else {
                        copy_one(src + p.src, dst + p.dst, p.len)
                    }
                };
            });
        });
        total
    }
}

/// Set once a copy running in the background has finished.
#[derive(Debug, Default)]
pub struct Copying {
    done: AtomicBool,
    lock: Mutex<()>,
    woken: Condvar,
}

impl Copying {
    /// Whether the copy has finished.
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits until the copy has finished (its bytes are visible to the caller then).
    pub fn wait(&self) {
        if self.is_done() {
            return;
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.is_done() {
            guard = self.woken.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Marks the copy finished and wakes every waiter.
    pub fn set(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.done.store(true, Ordering::Release);
        self.woken.notify_all();
    }
}

/// Sets a [`Copying`] when dropped: at the end of a background job, even one that unwinds.
pub struct SetWhenDropped(pub std::sync::Arc<Copying>);

impl Drop for SetWhenDropped {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// This process's shared copier with `threads` threads, for copies that belong to no pool
/// (a DataLoader worker gathering a batch). Made on first use, and made again in a forked
/// child, which inherits the parent's copier but none of its threads.
pub fn process_copier(threads: usize) -> Result<std::sync::Arc<Copier>> {
    use std::sync::{Arc, Mutex};
    type Slot = Option<(u32, Arc<Copier>)>;
    static COPIERS: Mutex<Vec<Slot>> = Mutex::new(Vec::new());
    let threads = threads.clamp(1, MAX_COPY_THREADS);
    let pid = std::process::id();
    let mut copiers = COPIERS.lock().unwrap_or_else(|e| e.into_inner());
    if copiers.len() <= threads {
        copiers.resize(threads + 1, None);
    }
    if let Some((owner, copier)) = &copiers[threads] {
        if *owner == pid {
            return Ok(Arc::clone(copier));
        }
        // A forked child: the parent's pool has no threads here. Forget it without running
        // its destructor, which would wait for threads that do not exist in this process.
        if let Some((_, stale)) = copiers[threads].take() {
            std::mem::forget(stale);
        }
    }
    let copier = Arc::new(Copier::new(threads)?);
    copiers[threads] = Some((pid, Arc::clone(&copier)));
    Ok(copier)
}

/// Whether big copies use non-temporal stores: yes, unless `PINPOOL_STREAMING_COPY=0`.
pub fn streaming_default() -> bool {
    if cfg!(miri) {
        // Miri cannot run the non-temporal stores (inline assembly).
        return false;
    }
    static STREAMING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STREAMING.get_or_init(|| std::env::var("PINPOOL_STREAMING_COPY").map_or(true, |v| v != "0"))
}

/// # Safety
/// `[src, src+len)` readable, `[dst, dst+len)` writable, the two disjoint.
unsafe fn copy_one(src: usize, dst: usize, len: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
}

/// Like [`copy_one`], but the destination is written with non-temporal stores: the cache
/// lines are not read first and not kept, which saves memory bandwidth when the destination
/// is read next by the GPU's DMA engine, not by the CPU.
///
/// # Safety
/// As [`copy_one`].
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(src: usize, dst: usize, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    let head = ((LINE - dst % LINE) % LINE).min(len);
    // SAFETY: the first `head` bytes lie inside both ranges (head <= len).
    unsafe { copy_one(src, dst, head) };
    let body = (len - head) / LINE * LINE;
    let mut off = head;
    while off < head + body {
        // SAFETY: `[off, off+64)` lies inside both ranges (off + 64 <= head + body <= len);
        // `dst + off` is 64-byte aligned, as `_mm_stream_si128` needs (16 would do); the
        // loads are unaligned loads.
        unsafe {
            let s = (src + off) as *const __m128i;
            let d = (dst + off) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        off += LINE;
    }
    // SAFETY: the tail `[off, len)` lies inside both ranges.
    unsafe { copy_one(src + off, dst + off, len - off) };
    // SAFETY: a store fence has no preconditions; it orders the streaming stores before any
    // later store (e.g. the slot state that hands the data on).
    unsafe { _mm_sfence() };
}

/// Elsewhere: a plain copy.
///
/// # Safety
/// As [`copy_one`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(src: usize, dst: usize, len: usize) {
    // SAFETY: forwarded.
    unsafe { copy_one(src, dst, len) }
}

#[cfg(test)]
mod tests;
