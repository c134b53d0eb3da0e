//! `pinpool.Slot`: one checked-out slot, with the buffer protocol.
//!
//! Invariants:
//! - The rules for giving the slot back (holds, deferred release, the device-wait fallback)
//!   are the core's [`Slot`]; this layer only converts arguments and errors, asks Python for
//!   the current stream, and holds the slot for each buffer export.
//! - The slot returns to its pool when the object dies, if it was not released before (every
//!   view of it holds a reference, so that is when the last view dies).

use std::ffi::c_int;
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::convert::{guarded, IntoPy};
use super::sent::{send_target, PySent};
use super::stream::{current_stream, stream_arg};
use crate::allocation::slots::SlotId;
use crate::pool::slot::{OwnedSlotHold, Slot, SlotHold};
use crate::pool::Pool;

/// One slot of a `PinPool`, checked out.
#[pyclass(name = "Slot", module = "pinpool._native", frozen, weakref)]
pub struct PySlot {
    /// Shared with copies still running into the slot ([`OwnedSlotHold`]).
    slot: Arc<Slot>,
    fence_device: Option<usize>,
    /// Where the slot lies in the arena, `(offset, len)`: fixed for the checkout's life.
    extent: (usize, usize),
}

impl PySlot {
    /// Wraps `id`, a live checkout of `pool`.
    pub(crate) fn new(pool: Arc<Pool>, id: SlotId, fence_device: Option<usize>) -> Self {
        // (A checkout just checked out is live; a stale one gets an empty extent, and every
        // use of it is refused by the core's `Slot` anyway.)
        let extent = pool.extent(id).unwrap_or((0, 0));
        PySlot { slot: Arc::new(Slot::new(pool, id)), fence_device, extent }
    }

    /// The checkout this object holds.
    pub(crate) fn id(&self) -> SlotId {
        self.slot.id()
    }

    /// Pins the slot for a copy into it; it must belong to `pool` and be unreleased.
    pub(crate) fn hold(&self, py: Python<'_>, pool: &Arc<Pool>) -> PyResult<SlotHold<'_>> {
        self.slot.hold(pool).py(py)
    }

    /// As [`PySlot::hold`], for a copy that outlives the call (and perhaps this object).
    pub(crate) fn hold_owned(&self, py: Python<'_>, pool: &Arc<Pool>) -> PyResult<OwnedSlotHold> {
        self.slot.hold_owned(pool).py(py)
    }

    /// The copy of [`PySlot::send`]: queued on `stream` with an event after it; returns the
    /// event and the raw stream. The caller releases the slot fenced on that stream (or
    /// later). With `keep_gil`, the driver is called with the GIL held (`then_release=True`).
    fn queue_send(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        nbytes: usize,
        stream: &Bound<'_, PyAny>,
        keep_gil: bool,
    ) -> PyResult<(crate::system::cuda::Event, usize)> {
        let pool = Arc::clone(self.slot.pool());
        let (dst, stream) = send_target(py, &pool, target, nbytes, stream)?;
        let _hold = self.hold(py, &pool)?; // refused once released
        let id = self.slot.id();
        // SAFETY: `dst` is the data of a contiguous CUDA tensor on the pool's device with at
        // least `nbytes` bytes (checked above), kept alive by the caller until the copy has
        // run; the slot is held while the copy is queued, and the caller releases it fenced
        // on `stream`, behind the copy (`send`'s documented contract).
        let send = || unsafe { pool.send(id, dst, nbytes, stream) };
        let event = match keep_gil {
            true => send(),
            false => py.detach(send),
        };
        let event = event.py(py)?;
        Ok((event, stream))
    }

    fn fence_stream(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<usize>> {
        match self.fence_device {
            Some(device) => stream_arg(py, stream, device),
            // No GPU fences on a host pool; the argument is still checked.
            None => stream_arg(py, stream, usize::MAX).map(|_| None),
        }
    }
}

#[pymethods]
impl PySlot {
    /// The slot table's entry this checkout holds.
    #[getter]
    fn index(&self) -> u32 {
        self.slot.id().index
    }

    /// Which checkout of this slot this object is.
    #[getter]
    fn generation(&self) -> u32 {
        self.slot.id().generation
    }

    /// The slot's size in bytes (what was asked for, rounded up to a page).
    #[getter]
    fn nbytes(&self) -> usize {
        self.extent.1
    }

    /// Where the slot starts in the arena, in bytes (a multiple of the page size).
    #[getter]
    fn offset(&self) -> usize {
        self.extent.0
    }

    /// The address of the slot's first byte.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.slot.address().py(py)? as usize)
    }

    /// Whether `release()` was called (or the slot is waiting for its views to die).
    #[getter]
    fn released(&self) -> bool {
        self.slot.is_released()
    }

    /// The CUDA device whose streams fence this slot, or None.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.fence_device
    }

    /// A tensor (numpy array without torch) of `dtype` and `shape` viewing the slot's bytes
    /// from `offset`. The view keeps the slot out of the pool until it dies. Every argument
    /// is checked in Python (`pinpool._views.slot_view`), a negative offset included.
    #[pyo3(
        signature = (dtype, shape, offset = None),
        text_signature = "($self, dtype, shape, offset=0)"
    )]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        dtype: &Bound<'py, PyAny>,
        shape: &Bound<'py, PyAny>,
        offset: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        slf.get().slot.address().py(py)?; // refused once released
        let offset = match offset {
            Some(offset) => offset.clone(),
            None => 0_usize.into_pyobject(py)?.into_any(),
        };
        py.import("pinpool._views")?.getattr("slot_view")?.call1((slf, dtype, shape, offset))
    }

    /// Queues a copy of the slot's first `nbytes` bytes to `target` (a contiguous CUDA tensor
    /// on the pool's device with at least `nbytes` bytes) on `stream` (a `torch.cuda.Stream`
    /// or a raw `CUstream` int). Keep `target` alive until the copy has run.
    ///
    /// - `then_release=False`: an event is recorded after the copy, returned as a `Sent`, and
    ///   the driver is called without the GIL; release the slot fenced on `stream` (or
    ///   later).
    /// - `then_release=True`: the slot then returns to the pool fenced on that stream, and
    ///   nothing is returned: one call for a batch sent on the stream that uses it, with no
    ///   event to wait for (work queued on `stream` after this call sees the copy done). The
    ///   driver is called with the GIL held: this is the training thread's call for a small
    ///   batch, and queuing a copy from pinned memory returns quickly, while a thread that
    ///   gives the GIL up there hands it to torch's pin thread, which keeps it for the whole
    ///   of its next step (the figures are in `docs/performance.md`).
    #[pyo3(signature = (target, nbytes, stream, *, then_release = false))]
    fn send(
        &self,
        py: Python<'_>,
        target: &Bound<'_, PyAny>,
        nbytes: usize,
        stream: &Bound<'_, PyAny>,
        then_release: bool,
    ) -> PyResult<Option<PySent>> {
        guarded(|| {
            let (event, stream) = self.queue_send(py, target, nbytes, stream, then_release)?;
            if !then_release {
                return Ok(Some(PySent::new(event)));
            }
            self.slot.release(Some(stream)).py(py)?;
            Ok(None)
        })
    }

    /// Returns the slot to the pool. On a CUDA pool the slot is reused only after the work
    /// queued so far on `stream` has finished (default: torch's current stream, if torch has
    /// initialised CUDA). With live views the return waits until they die.
    #[pyo3(signature = (stream = None))]
    fn release(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        guarded(|| {
            self.slot.address().py(py)?; // a released slot is refused before its stream
            let stream = self.fence_stream(py, stream)?;
            self.slot.release(stream).py(py)
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        if !self.slot.is_released() {
            self.release(py, None)?;
        }
        Ok(false)
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let ptr = this.slot.pin_held().map_err(|e| PyBufferError::new_err(e.to_string()))?;
        let len = match isize::try_from(this.extent.1) {
            Ok(len) => len,
            Err(_) => {
                this.slot.unpin();
                return Err(PyBufferError::new_err("slot too large for a buffer"));
            }
        };
        // SAFETY: `view` is valid (CPython's contract); the pointer is the live slot's first
        // byte and `len` its size; `PyBuffer_FillInfo` takes a new reference on `slf`, which
        // keeps the slot (and the arena, through `pool`) alive until the buffer is released.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr.cast::<std::ffi::c_void>(),
                len,
                0,
                flags,
            )
        };
        if rc != 0 {
            this.slot.unpin();
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.slot.unpin();
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(index={}, nbytes={}, {})",
            self.slot.id().index,
            self.extent.1,
            if self.slot.is_released() { "released" } else { "checked out" }
        )
    }
}

impl Drop for PySlot {
    fn drop(&mut self) {
        let device = self.fence_device;
        self.slot.finish(|| match device {
            // The hook failing (interpreter shutting down?) means a full device wait.
            Some(device) => Python::attach(|py| current_stream(py, device)).map_err(|_| ()),
            None => Ok(None),
        });
    }
}
