//! Worker segments from Python: a worker's reusable segment (`WorkerSegment`), and the main
//! process's cache of worker segments (`SegmentCache`).
//!
//! Invariant: no mapping made here is ever unmapped on a thread that holds the GIL; closing or
//! collecting any of these objects hands its mappings to the pool's reclaimer thread.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::pool::PyPinPool;
use super::slot::PySlot;
use super::{guarded, to_py, IntoPy};
use crate::copy::CopyRange;
use crate::error::Error;
use crate::transport::segment::{SegmentCache, WorkerSegment};

/// Converts a sender's claims about a segment; a value out of range is `OutOfBounds`.
fn segment_claims(
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

/// Checks, without mapping it, that `fd` (borrowed) is a real worker segment of `total_len`
/// bytes carrying `nonce` (sealed, that long, its header intact); returns its capacity. The
/// DataLoader calls this before it sizes a pool from what the segment's sender claims.
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
        let (key, total_len, nonce) = segment_claims(py, key, total_len, nonce)?;
        // SAFETY: only borrowed for this call; the caller keeps `fd` open meanwhile (a closed
        // or reused number fails the seal or header check, never touches memory).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        crate::transport::segment::check_segment_fd(key, borrowed, total_len, nonce).py(py)
    })
}

/// A worker process's reusable batch segment (a sealed memfd with a small header).
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

    /// Data bytes available.
    #[getter]
    fn capacity(&self) -> usize {
        self.seg.capacity()
    }

    /// Length of the memfd, header included (what the receiver maps).
    #[getter]
    fn total_len(&self) -> usize {
        self.seg.total_len()
    }

    /// The random number in the header that the receiver checks.
    #[getter]
    fn nonce(&self) -> u64 {
        self.seg.nonce()
    }

    /// The memfd (owned by this object).
    #[getter]
    fn fd(&self) -> i32 {
        self.seg.fd().map_or(-1, |fd| fd.as_raw_fd())
    }

    /// Address of the first data byte.
    #[getter]
    fn address(&self) -> usize {
        self.seg.data_ptr() as usize
    }

    /// Claims the segment for a new batch; False while the receiver still reads the last one.
    fn try_claim(&self) -> bool {
        self.seg.try_claim()
    }

    /// Gives up a claim without sending the batch.
    fn unclaim(&self) {
        self.seg.unclaim()
    }

    /// Whether the receiver still holds the last batch.
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

/// The main process's mappings of worker segments, keyed by `(worker_key, segment_id)`.
#[pyclass(name = "SegmentCache", module = "pinpool._native", frozen)]
pub struct PySegmentCache {
    cache: SegmentCache,
}

#[pymethods]
impl PySegmentCache {
    #[new]
    fn new(py: Python<'_>, pool: &Bound<'_, PyPinPool>) -> PyResult<Self> {
        Ok(PySegmentCache { cache: SegmentCache::new(pool.get().get(py)?) })
    }

    /// Maps the segment behind `fd` (taking ownership of the fd, which is closed at once, also
    /// when an argument is refused) and checks its header against `nonce`.
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
            let (key, total_len, nonce) = segment_claims(py, key, total_len, nonce)?;
            py.detach(|| self.cache.insert(key, owned, total_len, nonce)).py(py)
        })
    }

    /// Whether the segment `key` is mapped here.
    fn __contains__(&self, key: (u64, u32)) -> bool {
        self.cache.contains(key)
    }

    fn __len__(&self) -> usize {
        self.cache.len()
    }

    /// Copies `(src_offset, dst_offset, nbytes)` ranges (source offsets within the segment's
    /// data area) into `slot`, validating each, without the GIL.
    fn copy_to_slot(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        slot: &Bound<'_, PySlot>,
        ranges: Vec<(usize, usize, usize)>,
    ) -> PyResult<usize> {
        guarded(|| {
            let ranges: Vec<CopyRange> =
                ranges.into_iter().map(|(src, dst, len)| CopyRange { src, dst, len }).collect();
            let slot = slot.get();
            let _pin = slot.pin(py, self.cache.pool())?;
            let ticket = slot.ticket();
            let total = ranges.iter().fold(0usize, |n, r| n.saturating_add(r.len));
            if total < crate::copy::KEEP_GIL_MAX {
                return self.cache.copy_to_slot(key, ticket, &ranges).py(py);
            }
            py.detach(|| self.cache.copy_to_slot(key, ticket, &ranges)).py(py)
        })
    }

    /// Copies `(src_offset, dst_offset, nbytes)` ranges into any writable, C-contiguous
    /// buffer (a bytearray, a CPU tensor's memory ...), validating each, without the GIL.
    fn copy_to_buffer(
        &self,
        py: Python<'_>,
        key: (u64, u32),
        buffer: &Bound<'_, PyAny>,
        ranges: Vec<(usize, usize, usize)>,
    ) -> PyResult<usize> {
        guarded(|| {
            let ranges: Vec<CopyRange> =
                ranges.into_iter().map(|(src, dst, len)| CopyRange { src, dst, len }).collect();
            let buf = PyBuffer::<u8>::get(buffer)?;
            if buf.readonly() || !buf.is_c_contiguous() {
                return Err(to_py(
                    py,
                    Error::Invalid("the target buffer must be writable and C-contiguous".into()),
                ));
            }
            let (dst, len) = (buf.buf_ptr() as usize, buf.len_bytes());
            // SAFETY: `buf` keeps the exporter's memory alive and writable for this call; we
            // are its only writer while we hold the export (the caller's contract, as for any
            // buffer-filling function), and the segment mapping cannot alias it.
            let n = py
                .detach(|| unsafe { self.cache.copy_to_memory(key, dst as *mut u8, len, &ranges) });
            drop(buf);
            n.py(py)
        })
    }

    /// Returns the segment to its worker for reuse.
    fn release(&self, py: Python<'_>, key: (u64, u32)) -> PyResult<()> {
        guarded(|| self.cache.release(key).py(py))
    }

    /// Forgets the segment; it is unmapped on the reclaimer thread. False if unknown.
    fn retire(&self, key: (u64, u32)) -> bool {
        self.cache.retire(key)
    }

    /// Retires every segment of one worker (all with None); returns how many.
    #[pyo3(signature = (worker = None))]
    fn retire_all(&self, worker: Option<u64>) -> usize {
        self.cache.retire_all(worker)
    }
}
