//! `Sent`: a copy to the device queued without the GIL (by `SegmentCache.copy` with `send=`,
//! or `Slot.send`), and the check of the CUDA tensor such a copy writes into.
//!
//! Invariants: a target is accepted only as a contiguous CUDA tensor on the pool's device with
//! room for the copy; `Sent` only records and waits on the event after the copy.

use pyo3::prelude::*;

use super::convert::{guarded, to_py, IntoPy};
use super::stream::stream_arg;
use crate::error::Error;
use crate::pool::Pool;
use crate::system::cuda::Event;

/// Where a copy of `nbytes` bytes to the device goes: the device address of `target` (checked
/// by [`device_target`] against the device `pool`'s arena was pinned for) and the raw stream
/// `stream` names (a `torch.cuda.Stream` or a raw `CUstream` int).
pub(crate) fn send_target(
    py: Python<'_>,
    pool: &Pool,
    target: &Bound<'_, PyAny>,
    nbytes: usize,
    stream: &Bound<'_, PyAny>,
) -> PyResult<(u64, usize)> {
    let device = pool_device(py, pool)?;
    let dst = device_target(target, device, nbytes).map_err(|e| to_py(py, e))?;
    let stream = stream_arg(py, Some(stream), device)?.unwrap_or(0);
    Ok((dst, stream))
}

/// The ordinal of the device `pool`'s arena was pinned for, which copies to a device need.
pub(crate) fn pool_device(py: Python<'_>, pool: &Pool) -> PyResult<usize> {
    pool.arena().device().map(|d| d.ordinal()).ok_or_else(|| {
        to_py(py, Error::Invalid("copies to a device need a pool pinned on that device".into()))
    })
}

/// Checks that `target` is a contiguous CUDA tensor on `device` with at least `nbytes`
/// bytes; returns its data's device address.
fn device_target(target: &Bound<'_, PyAny>, device: usize, nbytes: usize) -> Result<u64, Error> {
    let bad = |why: &str| Error::Invalid(format!("the device copy's target {why}"));
    let attr = |name: &str| target.getattr(name).map_err(|_| bad("is not a torch tensor"));
    if !attr("is_cuda")?.is_truthy().unwrap_or(false) {
        return Err(bad("is not a CUDA tensor"));
    }
    let index: Option<usize> = attr("device")?.getattr("index").ok().and_then(|i| i.extract().ok());
    if index != Some(device) {
        return Err(bad(&format!("is not on the pool's device (cuda:{device})")));
    }
    let contiguous = target.call_method0("is_contiguous").and_then(|c| c.is_truthy());
    if !contiguous.unwrap_or(false) {
        return Err(bad("is not contiguous"));
    }
    let len: usize = attr("nbytes")?.extract().map_err(|_| bad("has no byte count"))?;
    if len < nbytes {
        return Err(bad(&format!("holds {len} bytes, fewer than {nbytes}")));
    }
    let ptr: u64 = target
        .call_method0("data_ptr")
        .and_then(|p| p.extract())
        .map_err(|_| bad("has no data pointer"))?;
    Ok(ptr)
}

/// A copy to the device queued by `SegmentCache.copy` (`send=`) or `Slot.send`:
/// the event recorded after it.
#[pyclass(name = "Sent", module = "pinpool._native", frozen)]
pub struct PySent {
    event: Event,
}

impl PySent {
    pub(crate) fn new(event: Event) -> Self {
        PySent { event }
    }
}

#[pymethods]
impl PySent {
    /// Whether the copy has run.
    #[getter]
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        self.event.is_complete().py(py)
    }

    /// Makes the work queued on `stream` from now on (a `torch.cuda.Stream` or a raw
    /// `CUstream` int; default: torch's current stream) wait for the copy. The calling
    /// thread does not wait.
    #[pyo3(signature = (stream = None))]
    fn make_wait(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        guarded(|| {
            let device = self.event.device().ordinal();
            let stream = super::stream::stream_arg(py, stream, device)?.unwrap_or(0);
            self.event.make_wait(stream).py(py)
        })
    }
}
