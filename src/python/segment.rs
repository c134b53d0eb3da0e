//! Worker segments from Python, the public low-level transport the DataLoader is built on: a
//! producer's reusable segment (`WorkerSegment`), the consumer's cache of producers' segments
//! (`SegmentCache`), and `check_segment`.
//!
//! Invariants:
//! - Nothing the consumer is told about a segment (fd, length, nonce, ranges) is trusted: the
//!   file must be a memfd sealed against shrinking, as long as said, with the header the
//!   nonce names, and every copy range is checked against the data area and the target.
//! - No mapping a `SegmentCache` made is ever unmapped on a thread that holds the GIL;
//!   retiring, replacing or collecting hands it to the pool's reclaimer thread. (A
//!   `WorkerSegment` is the producer's own memory: it is unmapped when the object dies.)

use std::ffi::c_int;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use super::convert::{guarded, to_py, IntoPy};
use super::pool::PyPinPool;
use super::sent::{send_target, PySent};
use super::slot::PySlot;
use crate::error::Error;
use crate::pool::fill_and_send::Sending;
use crate::transfer::copy::{CopyRange, Copying};
use crate::transport::segment::{SegmentCache, WorkerSegment};

/// A copy into a slot running on a copy thread (`SegmentCache.copy(..., then_hand_back=True)`).
#[pyclass(name = "Copying", module = "pinpool._native", frozen)]
pub struct PyCopying {
    done: Arc<Copying>,
    /// Where the copy to the device queued after it lands (`copy`'s `send=`).
    sending: Option<Arc<Sending>>,
}

#[pymethods]
impl PyCopying {
    /// Whether the copy has finished.
    #[getter]
    fn done(&self) -> bool {
        self.done.is_done()
    }

    /// Returns once the copy has finished (waiting without the GIL).
    fn wait(&self, py: Python<'_>) {
        if !self.done.is_done() {
            py.detach(|| self.done.wait());
        }
    }

    /// Waits for the copy (without the GIL), then returns the copy to the device queued
    /// after it (`SegmentCache.copy`'s `send=`), or raises what queuing it raised. Once.
    fn sent(&self, py: Python<'_>) -> PyResult<PySent> {
        self.wait(py);
        let outcome = self.sending.as_ref().and_then(|s| s.take());
        match outcome {
            Some(Ok(event)) => Ok(PySent::new(event)),
            Some(Err(e)) => Err(to_py(py, e)),
            None => Err(to_py(
                py,
                Error::Invalid("no copy to the device follows this copy, or it was taken".into()),
            )),
        }
    }

    fn __repr__(&self) -> String {
        format!("Copying({})", if self.done.is_done() { "done" } else { "running" })
    }
}

/// `(src, dst, len)` tuples from Python as copy ranges (checked by the copy itself).
fn copy_ranges(ranges: Vec<(usize, usize, usize)>) -> Vec<CopyRange> {
    ranges.into_iter().map(|(src, dst, len)| CopyRange { src, dst, len }).collect()
}

/// Converts what a sender says of a segment; a value out of range is `OutOfBounds`.
fn segment_told(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    total_len: &Bound<'_, PyAny>,
    nonce: &Bound<'_, PyAny>,
) -> PyResult<((u64, u32), usize, u64)> {
    let out_of_range =
        |what: &'static str| to_py(py, Error::OutOfRange { what, offset: 0, len: 0, size: 0 });
    let key = key.extract::<(u64, u32)>().map_err(|_| out_of_range("segment key"))?;
    let total_len = total_len.extract::<usize>().map_err(|_| out_of_range("segment length"))?;
    let nonce = nonce.extract::<u64>().map_err(|_| out_of_range("segment nonce"))?;
    Ok((key, total_len, nonce))
}

/// Checks, without mapping it, that `fd` is a real worker segment: a memfd sealed against
/// shrinking, exactly `total_len` bytes long, whose header carries `nonce` and the capacity
/// `total_len - SEGMENT_DATA_OFFSET`. Returns that capacity (data bytes).
///
/// For a consumer that must know a segment is genuine before it trusts what the sender says
/// of it, for instance to size a pool from it (the DataLoader does). `fd` is only borrowed:
/// the caller keeps it and closes it. `key` only names the segment in error messages.
/// `SegmentCache.insert` checks all of this again, so the call is optional.
///
/// Raises `InvalidArgument` (not sealed, bad header, wrong nonce, `fd < 0`) or `OutOfBounds`
/// (the file's length differs from `total_len`, or an argument out of range).
#[pyfunction]
pub(crate) fn check_segment(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    fd: i32,
    total_len: &Bound<'_, PyAny>,
    nonce: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    guarded(|| {
        if fd < 0 {
            return Err(to_py(py, Error::Invalid(format!("bad file descriptor {fd}"))));
        }
        let (key, total_len, nonce) = segment_told(py, key, total_len, nonce)?;
        // SAFETY: only borrowed for this call; the caller keeps `fd` open meanwhile (a closed
        // or reused number fails the seal or header check, never touches memory).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        crate::transport::segment::check_segment_fd(key, borrowed, total_len, nonce).py(py)
    })
}

/// The producer's side of the segment transport: a reusable shared-memory buffer that one
/// process writes batches into and another copies them out of.
///
/// `WorkerSegment(capacity)` creates a memfd sealed against shrinking and growing: a header
/// page (`SEGMENT_DATA_OFFSET` bytes: magic, state word, capacity, a random `nonce`) followed
/// by `capacity` data bytes, rounded up to whole pages (at least one), faulted in without the
/// GIL. Only the producer writes the data area, through the buffer protocol
/// (`memoryview(seg)`, `numpy.frombuffer(seg, ...)`: writable, `capacity` bytes, the header
/// is not exposed; a view keeps the object alive).
///
/// Protocol, per batch: `try_begin()` (False while the consumer still holds the last batch:
/// do not write then), write the data, send `(fd, total_len, nonce)` and the byte counts to
/// the consumer, which copies from the segment and calls `SegmentCache.hand_back`, setting it
/// free for the next `try_begin()`; `abandon()` sets free a batch begun and not sent. The
/// state word is atomic and shared, so beginnings and hand-backs may come from either process,
/// any thread.
///
/// The consumer needs its own descriptor for `fd`: `os.dup(seg.fd)` in the same process,
/// `/proc/<producer pid>/fd/<fd>` from another (same user), or `SCM_RIGHTS`. The producer
/// validates nothing; the consumer checks the seals, length and nonce (`check_segment`,
/// `SegmentCache.insert`). Collecting the object unmaps the segment and closes `fd`, on the
/// calling thread; a consumer's mapping stays valid until it retires it.
#[pyclass(name = "WorkerSegment", module = "pinpool._native", frozen)]
pub struct PyWorkerSegment {
    seg: WorkerSegment,
}

#[pymethods]
impl PyWorkerSegment {
    #[new]
    fn new(py: Python<'_>, capacity: usize) -> PyResult<Self> {
        guarded(|| {
            Ok(PyWorkerSegment { seg: py.detach(|| WorkerSegment::create(capacity)).py(py)? })
        })
    }

    /// Data bytes available (the buffer's length): the requested capacity rounded up to whole
    /// pages.
    #[getter]
    fn capacity(&self) -> usize {
        self.seg.capacity()
    }

    /// Length of the memfd, header included: `capacity + SEGMENT_DATA_OFFSET`, what the
    /// consumer passes to `SegmentCache.insert`.
    #[getter]
    fn total_len(&self) -> usize {
        self.seg.total_len()
    }

    /// The random number in the header, sent along with the fd: the consumer's check that a
    /// descriptor (a recycled fd number, say) really is this segment.
    #[getter]
    fn nonce(&self) -> u64 {
        self.seg.nonce()
    }

    /// The memfd, owned by this object (closed when it dies): never close it, and hand the
    /// consumer a duplicate or a `/proc/<pid>/fd/<fd>` path, not this number.
    #[getter]
    fn fd(&self) -> i32 {
        self.seg.fd().map_or(-1, |fd| fd.as_raw_fd())
    }

    /// Address of the first data byte (page-aligned), in this process.
    #[getter]
    fn address(&self) -> usize {
        self.seg.data_ptr() as usize
    }

    /// Begins a new batch in the segment (atomically, free -> in flight). False while the
    /// consumer still holds the last batch (not yet handed back: `SegmentCache.hand_back`):
    /// the data must not be written then. Never blocks.
    fn try_begin(&self) -> bool {
        self.seg.try_begin()
    }

    /// Sets the segment free without sending it: a batch begun was abandoned. Only for a
    /// batch the consumer never saw; a sent batch is freed by the consumer's `hand_back`.
    fn abandon(&self) {
        self.seg.abandon()
    }

    /// Whether a batch is in flight: being written, or sent and not yet handed back.
    #[getter]
    fn in_flight(&self) -> bool {
        self.seg.in_flight()
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let len = isize::try_from(this.seg.capacity())
            .map_err(|_| PyBufferError::new_err("segment too large for a buffer"))?;
        // SAFETY: `view` is valid (CPython's contract); the data area is mapped for as long as
        // this object lives, and `PyBuffer_FillInfo` takes a reference on it.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(view, slf.as_ptr(), this.seg.data_ptr().cast(), len, 0, flags)
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// The consumer's side of the segment transport: the producers' segments this process has
/// mapped, keyed by `(producer, segment)` (a 64-bit and a 32-bit unsigned int, chosen by the
/// caller), and copies from them into `pool`'s slots or any writable buffer.
///
/// Use it in the process that owns `pool` (a forked child's copies are refused). Per batch:
/// `insert` a segment the first time it arrives (it stays mapped for later batches),
/// `copy` what the producer wrote into a slot or a buffer, then `hand_back` it so the
/// producer can begin its next batch there; `retire` / `retire_all` forget segments (a
/// producer gone, a segment replaced). Every method may be called from any thread; copies of
/// 1 MiB and more run without the GIL on the pool's copy threads. A retired, replaced or collected
/// segment is unmapped on the pool's reclaimer thread (`pool.flush()` waits for it), never
/// on the caller's; one still being copied from is unmapped once that copy ends.
///
/// Raises `PoolClosed` if `pool` is closed. The cache keeps the pool's memory alive.
#[pyclass(name = "SegmentCache", module = "pinpool._native", frozen)]
pub struct PySegmentCache {
    cache: SegmentCache,
}

#[pymethods]
impl PySegmentCache {
    #[new]
    fn new(py: Python<'_>, pool: &Bound<'_, PyPinPool>) -> PyResult<Self> {
        let pool = pool.get();
        Ok(PySegmentCache { cache: SegmentCache::new(pool.get(py)?, pool.reclaimer(py)?) })
    }

    /// Maps the segment behind `fd` under `key`, after checking that it is a memfd sealed
    /// against shrinking (so it can never be truncated under the mapping, which would crash
    /// the next read), at least `total_len` bytes long, with the header `nonce` names and a
    /// capacity of `total_len - SEGMENT_DATA_OFFSET`. Runs without the GIL.
    ///
    /// Takes ownership of `fd`: it is closed before this returns, whether the segment is
    /// accepted or refused, so pass a descriptor of your own (`os.dup`, or one opened from
    /// `/proc/<pid>/fd/<fd>`), and never close it yourself. A segment already under `key` is
    /// replaced and retired. Raises `InvalidArgument` (not sealed, bad header or nonce, no
    /// data area, `fd < 0`) or `OutOfBounds` (the file is shorter than `total_len`, or an
    /// argument out of range).
    fn insert(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        fd: i32,
        total_len: &Bound<'_, PyAny>,
        nonce: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(|| {
            if fd < 0 {
                return Err(to_py(py, Error::Invalid(format!("bad file descriptor {fd}"))));
            }
            // SAFETY: the caller hands us ownership of `fd` (documented); it is closed exactly
            // once, by this OwnedFd, whatever happens below.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let (key, total_len, nonce) = segment_told(py, key, total_len, nonce)?;
            py.detach(|| self.cache.insert(key, owned, total_len, nonce)).py(py)
        })
    }

    /// Whether a segment is mapped under `key`.
    fn __contains__(&self, key: (u64, u32)) -> bool {
        self.cache.contains(key)
    }

    /// Segments mapped.
    fn __len__(&self) -> usize {
        self.cache.len()
    }

    /// Copies `(src_offset, dst_offset, nbytes)` ranges from the data area of segment `key`
    /// (offset 0 is its first data byte) into `into`: a slot of this cache's pool, or any
    /// writable, C-contiguous buffer (a `bytearray`, a numpy array). The one copy out of a
    /// segment; its options say what follows the copy and where it runs:
    ///
    /// - none: the copy, here (from 1 MiB without the GIL, on the pool's copy threads; into a
    ///   buffer always without it); returns the bytes copied. The segment stays in flight:
    ///   `hand_back(key)` once no more copies of this batch are needed.
    /// - `send=(target, nbytes, stream)` (into a slot of a pool whose memory the driver
    ///   pinned): then a copy of the slot's first `nbytes` bytes into `target` (a contiguous
    ///   CUDA tensor on the pool's device with at least `nbytes` bytes) queued on `stream` (a
    ///   `torch.cuda.Stream` or a raw `CUstream` int), and an event after it; returns a
    ///   `Sent`. Keep `target` alive until the `Sent` is waited for; release the slot fenced
    ///   on `stream` after this call.
    /// - `then_hand_back=True` (into a slot): the copy (and the send, if asked) runs on one of
    ///   the pool's copy threads, which then hands the segment back (do not call `hand_back`
    ///   too); returns a `Copying` at once, whose `sent()` gives the `Sent`. Until the copy
    ///   is done the slot stays out of the pool: a release meanwhile takes effect then. Read
    ///   the slot only after `Copying.wait()`.
    ///
    /// Every range is checked before anything is copied or queued: sources within the
    /// segment's capacity (`OutOfBounds`), destinations within `into` (`BatchTooLarge`), not
    /// overlapping each other (`InvalidArgument`). A slot must be one of this cache's pool and
    /// unreleased (`SlotReleased`); it is held for the copy, so a concurrent `release()` waits
    /// for its end. An unknown `key`, a read-only or non-contiguous buffer, an option with a
    /// buffer, or a `target` that does not qualify is `InvalidArgument`.
    #[pyo3(signature = (key, into, ranges, *, then_hand_back = false, send = None))]
    fn copy<'py>(
        &self,
        py: Python<'py>,
        key: (u64, u32),
        into: &Bound<'py, PyAny>,
        ranges: Vec<(usize, usize, usize)>,
        then_hand_back: bool,
        send: Option<(Bound<'py, PyAny>, usize, Bound<'py, PyAny>)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guarded(|| {
            let ranges = copy_ranges(ranges);
            let Ok(slot) = into.cast::<PySlot>() else {
                if then_hand_back || send.is_some() {
                    let what = "then_hand_back= and send= copy into a slot, not a buffer";
                    return Err(to_py(py, Error::Invalid(what.into())));
                }
                return self.copy_to_buffer(py, key, into, &ranges)?.into_bound_py_any(py);
            };
            match (then_hand_back, send) {
                (false, None) => self.copy_to_slot(py, key, slot, &ranges)?.into_bound_py_any(py),
                (false, Some((target, nbytes, stream))) => self
                    .copy_to_device(py, key, slot, &ranges, (&target, nbytes, &stream))?
                    .into_bound_py_any(py),
                (true, None) => {
                    let hold = slot.get().hold_owned(py, self.cache.pool())?;
                    let done = self.cache.copy_to_slot_then_hand_back(key, hold, &ranges).py(py)?;
                    PyCopying { done, sending: None }.into_bound_py_any(py)
                }
                (true, Some((target, nbytes, stream))) => self
                    .copy_to_device_then_hand_back(
                        py,
                        key,
                        slot,
                        &ranges,
                        (&target, nbytes, &stream),
                    )?
                    .into_bound_py_any(py),
            }
        })
    }

    /// Hands segment `key` back to its producer: marks it free (with release ordering), so
    /// the producer's next `try_begin()` succeeds and it may overwrite the data. Call it only
    /// after the last copy of this batch has returned. The segment stays mapped for the next
    /// batch. Handing back a free segment does nothing; an unknown `key` is `InvalidArgument`.
    fn hand_back(&self, py: Python<'_>, key: (u64, u32)) -> PyResult<()> {
        guarded(|| self.cache.hand_back(key).py(py))
    }

    /// Forgets segment `key`, unmapping it on the pool's reclaimer thread (after any copy
    /// still reading it). Returns False if `key` is unknown. Does not mark it free: do that
    /// with `hand_back` first if the producer is to reuse it.
    fn retire(&self, key: (u64, u32)) -> bool {
        self.cache.retire(key)
    }

    /// Retires every segment of producer `worker` (of all producers with None), as `retire`
    /// does; returns how many.
    #[pyo3(signature = (worker = None))]
    fn retire_all(&self, worker: Option<u64>) -> usize {
        self.cache.retire_all(worker)
    }
}

/// What `SegmentCache.copy` sends on to the device: `(target, nbytes, stream)`.
type SendTo<'a, 'py> = (&'a Bound<'py, PyAny>, usize, &'a Bound<'py, PyAny>);

/// The ways of `SegmentCache.copy` (see there).
impl PySegmentCache {
    fn copy_to_slot(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        slot: &Bound<'_, PySlot>,
        ranges: &[CopyRange],
    ) -> PyResult<usize> {
        let slot = slot.get();
        let _hold = slot.hold(py, self.cache.pool())?;
        let id = slot.id();
        let total = ranges.iter().fold(0usize, |n, r| n.saturating_add(r.len));
        if total < crate::transfer::copy::KEEP_GIL_MAX {
            return self.cache.copy_to_slot(key, id, ranges).py(py);
        }
        py.detach(|| self.cache.copy_to_slot(key, id, ranges)).py(py)
    }

    fn copy_to_device(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        slot: &Bound<'_, PySlot>,
        ranges: &[CopyRange],
        (target, nbytes, stream): SendTo<'_, '_>,
    ) -> PyResult<PySent> {
        let (dst, stream) = send_target(py, self.cache.pool(), target, nbytes, stream)?;
        let slot = slot.get();
        let _hold = slot.hold(py, self.cache.pool())?;
        let id = slot.id();
        // SAFETY: `dst` is the data of a contiguous CUDA tensor on the pool's device with at
        // least `nbytes` bytes (checked above), which the caller keeps alive until the copy has
        // run and releases the slot fenced on `stream` after this call (`copy`'s contract).
        let event = py
            .detach(|| unsafe { self.cache.copy_to_device(key, id, ranges, dst, nbytes, stream) })
            .py(py)?;
        Ok(PySent::new(event))
    }

    fn copy_to_device_then_hand_back(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        slot: &Bound<'_, PySlot>,
        ranges: &[CopyRange],
        (target, nbytes, stream): SendTo<'_, '_>,
    ) -> PyResult<PyCopying> {
        let (dst, stream) = send_target(py, self.cache.pool(), target, nbytes, stream)?;
        let hold = slot.get().hold_owned(py, self.cache.pool())?;
        // The target stays alive until the copy to it is queued, whatever the caller drops
        // meanwhile (a reference dropped on the copy thread: Python lets go of it the next
        // time a thread attaches).
        let keep = target.clone().unbind();
        // SAFETY: `dst` is the data of a contiguous CUDA tensor on the pool's device with at
        // least `nbytes` bytes (checked above), kept alive by `keep` until the copy is queued
        // and by the caller until it has run; the caller releases the slot fenced on `stream`
        // after this call (`copy`'s contract).
        let (done, sending) = unsafe {
            self.cache.copy_to_device_then_hand_back(key, hold, ranges, dst, nbytes, stream, keep)
        }
        .py(py)?;
        Ok(PyCopying { done, sending: Some(sending) })
    }

    fn copy_to_buffer(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        buffer: &Bound<'_, PyAny>,
        ranges: &[CopyRange],
    ) -> PyResult<usize> {
        let buf = PyBuffer::<u8>::get(buffer)?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(to_py(
                py,
                Error::Invalid("the target buffer must be writable and C-contiguous".into()),
            ));
        }
        let (dst, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        // SAFETY: `buf` keeps the exporter's memory alive and writable for this call; we are
        // its only writer while we hold the export (the caller's contract, as for any
        // buffer-filling function), and the segment mapping cannot alias it.
        let n =
            py.detach(|| unsafe { self.cache.copy_to_memory(key, dst as *mut u8, len, ranges) });
        drop(buf);
        n.py(py)
    }
}
