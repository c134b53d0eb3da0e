//! Which CUDA stream is current: the hook `pinpool/__init__.py` installs (torch's current
//! stream of a device), and the `stream=` argument that overrides it.
//!
//! Invariants:
//! - The hook is installed once per process; until then no stream is current (no GPU work
//!   can be reading a slot).
//! - Asking the hook never sees or clears an exception Python is unwinding: it is set aside
//!   for the call and put back after.

use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::types::PyInt;

use super::convert::to_py;
use crate::error::Error;

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
            // An int is taken as it is: asking it for `cuda_stream` first would raise and
            // catch an AttributeError on every release (about half a microsecond).
            let raw = if s.is_instance_of::<PyInt>() || !s.hasattr("cuda_stream")? {
                s.clone()
            } else {
                s.getattr("cuda_stream")?
            };
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
pub(super) fn _set_stream_hook(hook: Py<PyAny>) -> bool {
    STREAM_HOOK.set(hook).is_ok()
}
