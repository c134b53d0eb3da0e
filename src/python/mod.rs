//! The PyO3 layer: `pinpool._native`.
//!
//! Invariants:
//! - This layer sits on top of every other one and nothing uses it.
//! - This layer only converts arguments, results and errors; the logic lives in the core.
//! - Every entry point runs inside [`guarded`]: a panic anywhere below becomes
//!   `pinpool.PinPoolError`, never `PanicException`.
//! - Anything that can block (waiting for a slot, copying, joining threads) runs inside
//!   `Python::detach`, with the GIL released; only copies under
//!   [`crate::transfer::copy::KEEP_GIL_MAX`] bytes keep it (winning it back would cost more).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;

use crate::error::Error;

mod gather;
mod grants;
mod handoff;
mod pipe;
mod pool;
mod segment;
mod sent;
mod slot;
mod window;

/// Runs `f`, turning a panic into `pinpool.PinPoolError`.
pub(crate) fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let msg = crate::error::panic_message(&*panic);
            Python::attach(|py| {
                Err(to_py(py, Error::Invalid(format!("internal error in pinpool: {msg}"))))
            })
        }
    }
}

// The exception classes are defined once, in Python (`pinpool/_errors.py`, where they also
// derive from the built-in exceptions users catch: `TimeoutError`, `ValueError`); these import
// them, by type, when first raised.
pyo3::import_exception!(pinpool._errors, PinPoolError);
pyo3::import_exception!(pinpool._errors, PoolExhausted);
pyo3::import_exception!(pinpool._errors, PoolClosed);
pyo3::import_exception!(pinpool._errors, SlotReleased);
pyo3::import_exception!(pinpool._errors, BatchTooLarge);
pyo3::import_exception!(pinpool._errors, CudaError);
pyo3::import_exception!(pinpool._errors, InvalidArgument);
pyo3::import_exception!(pinpool._errors, ArgumentTypeError);
pyo3::import_exception!(pinpool._errors, OutOfBounds);
pyo3::import_exception!(pinpool._errors, NotEnoughMemory);

/// Builds the Python exception for a core error.
pub(crate) fn to_py(_py: Python<'_>, err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Exhausted { .. } => PoolExhausted::new_err(msg),
        Error::SlotReleased { .. } => SlotReleased::new_err(msg),
        Error::BatchTooLarge { needed, slot_bytes } => {
            BatchTooLarge::new_err((msg, needed, slot_bytes))
        }
        Error::Cuda { name, code, .. } => CudaError::new_err((msg, name, code)),
        // (Not a CudaError: no driver call was made, there is no driver name or code.)
        Error::NoDriver { .. } => PinPoolError::new_err(msg),
        Error::OutOfRange { .. } => OutOfBounds::new_err(msg),
        Error::Closed => PoolClosed::new_err(msg),
        Error::Os { .. } => PinPoolError::new_err(msg),
        Error::Invalid(_) => InvalidArgument::new_err(msg),
        Error::NotEnoughMemory { .. } => NotEnoughMemory::new_err(msg),
    }
}

/// Extension trait: `result.py(py)?` converts a core error.
pub(crate) trait IntoPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// The function that says which CUDA stream is current: `hook(device) -> int | None`.
static STREAM_HOOK: OnceLock<Py<PyAny>> = OnceLock::new();

/// Asks the stream hook for the current stream of `device`; `Ok(None)` when torch's CUDA is
/// not in use (then no GPU work can be reading a slot).
///
/// This runs where a slot is released implicitly too: as the last view of a batch dies, which
/// may happen while Python unwinds an exception (a `list(loader)` that raised frees the batches
/// it had). The hook must neither see that exception nor clear it: it is set aside for the
/// call and put back after.
pub(crate) fn current_stream(py: Python<'_>, device: usize) -> PyResult<Option<usize>> {
    let Some(hook) = STREAM_HOOK.get().filter(|_| device != usize::MAX) else { return Ok(None) };
    let unwinding = PyErr::take(py);
    let asked = hook.bind(py).call1((device,)).and_then(|value| {
        if value.is_none() {
            Ok(None)
        } else {
            value.extract::<usize>().map(Some)
        }
    });
    if let Some(err) = unwinding {
        err.restore(py);
    }
    asked
}

/// Converts a `stream=` argument: None asks the hook (not for `device == usize::MAX`, which
/// only checks the argument); an int is a raw `CUstream`, trusted to be live (the driver
/// dereferences it); anything with a `cuda_stream` attribute (a `torch.cuda.Stream`) gives
/// that.
pub(crate) fn stream_arg(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
    device: usize,
) -> PyResult<Option<usize>> {
    match stream {
        None => current_stream(py, device),
        Some(s) if s.is_none() => current_stream(py, device),
        Some(s) => {
            let raw = if s.hasattr("cuda_stream")? { s.getattr("cuda_stream")? } else { s.clone() };
            raw.extract::<usize>().map(Some).map_err(|_| {
                to_py(
                    py,
                    Error::Invalid(
                        "stream must be a torch.cuda.Stream, a raw CUstream int, or None".into(),
                    ),
                )
            })
        }
    }
}

/// Installs the stream hook (called once by `pinpool/__init__.py`).
#[pyfunction]
fn _set_stream_hook(hook: Py<PyAny>) -> bool {
    STREAM_HOOK.set(hook).is_ok()
}

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

/// Timeouts from this long on mean "no limit": no wait can tell them apart, and a deadline
/// this far out could not be computed (`Instant + Duration` overflows long before
/// `Duration` does).
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Converts a `timeout=` argument in seconds: None (no limit) or a finite non-negative
/// number; one of [`FOREVER`] or more is no limit too.
pub(crate) fn timeout_arg(py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        Some(t) if !(t >= 0.0 && t.is_finite()) => Err(to_py(
            py,
            Error::Invalid(format!("timeout must be a non-negative number, got {t}")),
        )),
        Some(t) => Ok(Duration::try_from_secs_f64(t).ok().filter(|d| *d < FOREVER)),
        None => Ok(None),
    }
}

/// Converts a size or count argument `name`: a non-negative int that fits a `usize`. A
/// negative or huge int is an `InvalidArgument` naming the argument (not PyO3's
/// `OverflowError`); anything else an `ArgumentTypeError` (an `InvalidArgument` and a
/// `TypeError`) naming it.
pub(crate) fn size_arg(py: Python<'_>, value: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let int = value.is_instance_of::<pyo3::types::PyInt>()
        && !value.is_instance_of::<pyo3::types::PyBool>();
    match value.extract::<usize>() {
        Ok(n) if int => Ok(n),
        _ if int => Err(to_py(
            py,
            Error::Invalid(format!(
                "{name} must be a non-negative integer of at most {}, got {value}",
                usize::MAX
            )),
        )),
        _ => Err(ArgumentTypeError::new_err(format!(
            "{name} must be a non-negative integer, not {} ({})",
            value.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()),
            value.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
        ))),
    }
}

/// `value` as a bool, or an `ArgumentTypeError` naming `name` (a string, say `"yes"`, is not
/// one).
pub(crate) fn bool_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    match value.cast::<pyo3::types::PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => Err(ArgumentTypeError::new_err(format!(
            "{name} must be True or False, not {}",
            value.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
        ))),
    }
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
    m.add_function(wrap_pyfunction!(_set_stream_hook, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(page_size, m)?)?;
    m.add_function(wrap_pyfunction!(available_memory, m)?)?;
    m.add_function(wrap_pyfunction!(room_kept, m)?)?;
    m.add_function(wrap_pyfunction!(wait_for_freed_pools, m)?)?;
    m.add_function(wrap_pyfunction!(recently_freed_pools, m)?)?;
    m.add_function(wrap_pyfunction!(gather::_gather, m)?)?;
    m.add_function(wrap_pyfunction!(segment::check_segment, m)?)?;
    m.add("SEGMENT_DATA_OFFSET", crate::transport::segment::DATA_OFFSET)?;
    Ok(())
}
