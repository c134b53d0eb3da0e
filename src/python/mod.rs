//! The PyO3 layer: `pinpool._native`.
//!
//! Each class is a module of its own; what they all convert (panics, errors, timeouts,
//! sizes, flags) is `convert`'s, which CUDA stream is current `stream`'s.
//!
//! Invariants:
//! - This layer sits on top of every other one and nothing uses it.
//! - This layer only converts arguments, results and errors; the logic lives in the core.
//! - Every entry point runs inside [`guarded`]: a panic anywhere below becomes
//!   `pinpool.PinPoolError`, never `PanicException`.
//! - Anything that can block (waiting for a slot, copying, joining threads) runs inside
//!   `Python::detach`, with the GIL released; only copies under
//!   [`crate::transfer::copy::KEEP_GIL_MAX`] bytes keep it (winning it back would cost more).

use pyo3::prelude::*;

mod convert;
mod gather;
mod grants;
mod handoff;
mod pipe;
mod pool;
mod segment;
mod sent;
mod slot;
mod stream;
mod window;

use convert::{guarded, timeout_arg};

/// Whether the CUDA driver can be loaded and reports at least one device.
#[pyfunction]
fn cuda_available() -> bool {
    crate::system::cuda::device_count().map(|n| n > 0).unwrap_or(false)
}

/// Bytes of memory this process could still fault in (None if unknown): what an arena, which
/// is faulted in whole at start-up, may take at most.
#[pyfunction]
fn available_memory() -> Option<usize> {
    crate::memory::arena::available_memory()
}

/// Bytes a claim made ahead of the consumer leaves free in one range, for batches of up to
/// `largest_seen` bytes in an arena of `arena` bytes whose longest part has `part`
/// (`crate::pool::claim::room_kept`).
#[pyfunction]
fn room_kept(largest_seen: usize, arena: usize, part: usize) -> usize {
    crate::pool::claim::room_kept(largest_seen, arena, part)
}

/// Waits (without the GIL) until every pool dropped so far has been freed by the freeing
/// thread, at most `timeout` seconds (forever if None). Returns whether all have.
#[pyfunction]
#[pyo3(signature = (timeout = None))]
fn wait_for_freed_pools(py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
    guarded(|| {
        let timeout = timeout_arg(py, timeout)?;
        Ok(py.detach(|| crate::memory::freeing::flush(timeout)))
    })
}

/// The most recently freed pools, oldest first: dicts with `bytes`, `dropped_on` and
/// `freed_on` (kernel thread ids) and `seconds`.
#[pyfunction]
fn recently_freed_pools(py: Python<'_>) -> PyResult<Vec<Bound<'_, pyo3::types::PyDict>>> {
    guarded(|| {
        crate::memory::freeing::recent()
            .into_iter()
            .map(|r| {
                let d = pyo3::types::PyDict::new(py);
                d.set_item("bytes", r.bytes)?;
                d.set_item("dropped_on", r.dropped_on)?;
                d.set_item("freed_on", r.freed_on)?;
                d.set_item("seconds", r.seconds)?;
                Ok(d)
            })
            .collect()
    })
}

/// The system page size.
#[pyfunction]
fn page_size() -> usize {
    crate::memory::shm::page_size()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyPinPool>()?;
    m.add_class::<slot::PySlot>()?;
    m.add_class::<segment::PyWorkerSegment>()?;
    m.add_class::<segment::PySegmentCache>()?;
    m.add_class::<segment::PyCopying>()?;
    m.add_class::<sent::PySent>()?;
    m.add_class::<pipe::PyPipeWriter>()?;
    m.add_class::<grants::PyGrants>()?;
    m.add_class::<window::PyArenaWindow>()?;
    m.add_class::<handoff::PyHandoff>()?;
    m.add_function(wrap_pyfunction!(stream::_set_stream_hook, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(page_size, m)?)?;
    m.add_function(wrap_pyfunction!(available_memory, m)?)?;
    m.add_function(wrap_pyfunction!(room_kept, m)?)?;
    m.add_function(wrap_pyfunction!(pipe::read_message, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_freed_pools, m)?)?;
    m.add_function(wrap_pyfunction!(recently_freed_pools, m)?)?;
    m.add_function(wrap_pyfunction!(gather::_gather, m)?)?;
    m.add_function(wrap_pyfunction!(segment::check_segment, m)?)?;
    m.add("SEGMENT_DATA_OFFSET", crate::transport::segment::DATA_OFFSET)?;
    Ok(())
}
