//! `pinpool.Slot`: one checked-out slot, with the buffer protocol.
//!
//! Invariants:
//! - A slot returns to its pool exactly once: on `release()`, or when the object dies (every
//!   view of it holds a reference, so that is when the last view dies).
//! - While a buffer export or a copy is live ("pins"), an explicit `release()` is deferred
//!   until the last pin goes; the slot never re-enters the pool under a live numpy array,
//!   memoryview or view made by `Slot.view`.
//! - A deferred or automatic release that cannot record its fence waits for the device
//!   instead, so a slot is never reused under a pending GPU read.

use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::{current_stream, guarded, stream_arg, to_py, IntoPy};
use crate::error::Error;
use crate::pool::Pool;
use crate::slots::Ticket;

#[derive(Debug, Default)]
struct Use {
    released: bool,
    pins: usize,
    deferred: Option<Option<usize>>,
}

/// One slot of a `PinPool`, checked out.
#[pyclass(name = "Slot", module = "pinpool._native", frozen, weakref)]
pub struct PySlot {
    pool: Arc<Pool>,
    ticket: Ticket,
    fence_device: Option<usize>,
    state: Mutex<Use>,
}

/// Holds a slot pinned (not returnable) while a copy runs.
pub(crate) struct Pin<'a>(&'a PySlot);

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.0.unpin();
    }
}

impl PySlot {
    pub(crate) fn new(pool: Arc<Pool>, ticket: Ticket, fence_device: Option<usize>) -> Self {
        PySlot { pool, ticket, fence_device, state: Mutex::new(Use::default()) }
    }

    fn state(&self) -> MutexGuard<'_, Use> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn ticket(&self) -> Ticket {
        self.ticket
    }

    /// Pins the slot for a copy into it; it must belong to `pool` and be unreleased.
    pub(crate) fn pin(&self, py: Python<'_>, pool: &Arc<Pool>) -> PyResult<Pin<'_>> {
        if !Arc::ptr_eq(&self.pool, pool) {
            return Err(to_py(py, Error::Invalid("this slot belongs to another pool".into())));
        }
        let mut s = self.state();
        if s.released {
            return Err(to_py(py, Error::SlotReleased { index: self.ticket.index as usize }));
        }
        s.pins += 1;
        Ok(Pin(self))
    }

    fn unpin(&self) {
        let deferred = {
            let mut s = self.state();
            s.pins = s.pins.saturating_sub(1);
            if s.pins == 0 {
                s.deferred.take()
            } else {
                None
            }
        };
        if let Some(stream) = deferred {
            self.give_back(stream);
        }
    }

    /// Returns the slot; if its fence cannot be recorded, waits for the device instead.
    fn give_back(&self, stream: Option<usize>) {
        if self.pool.release(self.ticket, stream).is_err() {
            self.give_back_after_device_sync();
        }
    }

    /// Returns the slot unfenced once every queued GPU operation has finished.
    fn give_back_after_device_sync(&self) {
        if let Some(device) = self.pool.arena().device() {
            let _ = device.synchronize();
        }
        let _ = self.pool.release(self.ticket, None);
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

    fn check_live(&self, py: Python<'_>) -> PyResult<()> {
        if self.state().released {
            return Err(to_py(py, Error::SlotReleased { index: self.ticket.index as usize }));
        }
        Ok(())
    }

    fn address_unchecked(&self) -> usize {
        // A live ticket always has memory; a stale one cannot reach here (checked by callers).
        self.pool.slot_ptr(self.ticket).map(|p| p as usize).unwrap_or(0)
    }
}

#[pymethods]
impl PySlot {
    /// The slot's position in the arena.
    #[getter]
    fn index(&self) -> u32 {
        self.ticket.index
    }

    /// Which checkout of this slot this object is.
    #[getter]
    fn generation(&self) -> u32 {
        self.ticket.generation
    }

    /// The slot's size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.pool.slot_bytes()
    }

    /// The address of the slot's first byte.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        self.check_live(py)?;
        Ok(self.address_unchecked())
    }

    /// Whether `release()` was called (or the slot is waiting for its views to die).
    #[getter]
    fn released(&self) -> bool {
        self.state().released
    }

    /// The CUDA device whose streams fence this slot, or None.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.fence_device
    }

    /// A tensor (numpy array without torch) of `dtype` and `shape` viewing the slot's bytes
    /// from `offset`. The view keeps the slot out of the pool until it dies.
    #[pyo3(signature = (dtype, shape, offset = 0))]
    fn view<'py>(
        slf: &Bound<'py, Self>,
        dtype: &Bound<'py, PyAny>,
        shape: &Bound<'py, PyAny>,
        offset: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        slf.get().check_live(py)?;
        py.import("pinpool._views")?.getattr("slot_view")?.call1((slf, dtype, shape, offset))
    }

    /// Returns the slot to the pool. On a CUDA pool the slot is reused only after the work
    /// queued so far on `stream` has finished (default: torch's current stream, if torch has
    /// initialised CUDA). With live views the return waits until they die.
    #[pyo3(signature = (stream = None))]
    fn release(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        guarded(|| {
            self.check_live(py)?;
            let stream = self.fence_stream(py, stream)?;
            let mut s = self.state();
            if s.released {
                return Err(to_py(py, Error::SlotReleased { index: self.ticket.index as usize }));
            }
            if s.pins > 0 {
                s.released = true;
                s.deferred = Some(stream);
                return Ok(());
            }
            self.pool.release(self.ticket, stream).py(py)?;
            s.released = true;
            Ok(())
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        if !self.state().released {
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
        {
            let mut s = this.state();
            if s.released {
                return Err(PyBufferError::new_err(format!(
                    "slot {} was already released",
                    this.ticket.index
                )));
            }
            s.pins += 1;
        }
        let len = isize::try_from(this.pool.slot_bytes())
            .map_err(|_| PyBufferError::new_err("slot too large for a buffer"))?;
        // SAFETY: `view` is valid (CPython's contract); the pointer is the live slot's first
        // byte and `len` its size; `PyBuffer_FillInfo` takes a new reference on `slf`, which
        // keeps the slot (and the arena, through `pool`) alive until the buffer is released.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.address_unchecked() as *mut std::ffi::c_void,
                len,
                0,
                flags,
            )
        };
        if rc != 0 {
            this.unpin();
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.unpin();
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(index={}, nbytes={}, {})",
            self.ticket.index,
            self.pool.slot_bytes(),
            if self.state().released { "released" } else { "checked out" }
        )
    }
}

impl Drop for PySlot {
    fn drop(&mut self) {
        let s = std::mem::take(&mut *self.state());
        if s.released {
            if let Some(stream) = s.deferred {
                self.give_back(stream);
            }
            return;
        }
        let stream = match self.fence_device {
            Some(device) => Python::attach(|py| current_stream(py, device)),
            None => Ok(None),
        };
        match stream {
            Ok(stream) => self.give_back(stream),
            // The hook failed (interpreter shutting down?): fall back to a full device wait.
            Err(_) => self.give_back_after_device_sync(),
        }
    }
}
