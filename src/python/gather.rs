//! `_gather`: a DataLoader worker's multi-threaded copy of many arrays into one buffer (the
//! items of a stacked batch into its segment or its zero-copy slot).
//!
//! Invariants: every destination range is checked against the target buffer and against the
//! others (no overlap) before anything is copied; the copy runs without the GIL on this
//! process's own copy threads (`copy::process_copier`). The sources are raw addresses, which
//! nothing can check: this is a private function for `pinpool._wire.codec`, which passes the
//! data pointers of live, contiguous CPU tensors it holds for the whole call.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use super::convert::{guarded, to_py, IntoPy};
use crate::error::Error;
use crate::pool::fill_and_send::validate_ranges;
use crate::transfer::copy::{process_copier, CopyRange};

/// Copies `(source address, nbytes, destination offset)` items into `target` (a writable,
/// C-contiguous buffer) with `threads` threads, without the GIL. Returns the bytes copied.
#[pyfunction]
pub(crate) fn _gather(
    py: Python<'_>,
    target: &Bound<'_, PyAny>,
    items: Vec<(usize, usize, usize)>,
    threads: usize,
) -> PyResult<usize> {
    guarded(|| {
        let buf = PyBuffer::<u8>::get(target)?;
        if buf.readonly() || !buf.is_c_contiguous() {
            let msg = "the target buffer must be writable and C-contiguous";
            return Err(to_py(py, Error::Invalid(msg.into())));
        }
        let (dst, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        let ranges: Vec<CopyRange> =
            items.into_iter().map(|(src, len, dst)| CopyRange { src, dst, len }).collect();
        check_destinations(&ranges, len).py(py)?;
        let copier = process_copier(threads).py(py)?;
        // SAFETY: each destination range lies inside `target`'s buffer, which `buf` keeps
        // exported (alive, writable) for the call, and no two overlap (checked above). The
        // sources are live memory of the caller's for the whole call (this function's
        // contract, see the module comment); a zero base makes their addresses absolute.
        let n = py.detach(|| unsafe { copier.copy(std::ptr::null(), dst as *mut u8, &ranges) });
        drop(buf);
        Ok(n)
    })
}

/// The pool's range checks (destinations inside `len` and pairwise disjoint; sources that
/// do not wrap, their addresses being offsets from zero), plus: no null source.
fn check_destinations(ranges: &[CopyRange], len: usize) -> crate::error::Result<()> {
    if ranges.iter().any(|r| r.len > 0 && r.src == 0) {
        return Err(Error::Invalid("gather: a source address is null".into()));
    }
    validate_ranges(ranges, usize::MAX, len)
}
