//! `pinpool._native.ArenaWindow`: a zero-copy worker's window onto the main process's arena
//! ([`crate::memory::window::Window`]), with the buffer protocol.
//!
//! Invariants:
//! - This layer only converts arguments and errors; what is open, and when, is the core's.
//! - Every buffer export is counted by the core ([`Window::add_view`]) and ended once
//!   ([`Window::remove_view`]); each holds a reference to this object, so the window is never
//!   unmapped under a view, and `close()` refuses (`BufferError`) while one is alive.

use std::ffi::c_int;
use std::os::fd::BorrowedFd;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use super::convert::{guarded, size_arg, to_py, IntoPy};
use crate::error::Error;
use crate::memory::window::Window;

/// A lasting mapping of `length` bytes of an arena memfd from file offset `offset`, kept by a
/// zero-copy worker between batches, inaccessible (`PROT_NONE`) except for the one range
/// `open()` makes readable and writable while a batch is written into it.
///
/// `ArenaWindow(fd, offset, length, fault_in=True)`: `fd` is only borrowed (neither kept nor
/// closed); it must be a memfd sealed against shrinking at least `offset + length` bytes
/// long; `offset` is page-aligned and `length` a whole number of pages. The pages are faulted
/// in (without the GIL) and then made inaccessible: their page-table entries stay, so opening
/// them later is cheap. With `fault_in=False` nothing is faulted in yet: `fault_in_privately()`
/// on another thread, or the first `open()`, does it. The mapping is not inherited by forked
/// children. Raises `InvalidArgument` or `OutOfBounds` (both `ValueError`s) for bad
/// arguments.
///
/// The buffer protocol exports the whole window (`memoryview(window)[a:b]`, where byte 0 is
/// file offset `offset`), writable, closed or not: touching a byte outside the open range
/// faults, by design. Each view keeps the window alive, and `close()` refuses while one is.
#[pyclass(name = "ArenaWindow", module = "pinpool._native", frozen)]
pub struct PyArenaWindow {
    window: Window,
}

impl PyArenaWindow {
    /// Whether `open` and `close` are cheap enough to run with the GIL held: a window with a
    /// key, faulted in (and not held by another thread now), switches a range by its key (no
    /// system call once the range is armed; one `pkey_mprotect` when another range is) and
    /// faults nothing in.
    fn cheap_to_switch(&self) -> bool {
        self.window.has_key() && self.window.is_faulted_now()
    }
}

#[pymethods]
impl PyArenaWindow {
    #[new]
    #[pyo3(signature = (fd, offset, length, fault_in = true))]
    fn new(
        py: Python<'_>,
        fd: i32,
        offset: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        fault_in: bool,
    ) -> PyResult<Self> {
        guarded(|| {
            if fd < 0 {
                return Err(to_py(py, Error::Invalid(format!("bad file descriptor {fd}"))));
            }
            let offset = size_arg(py, offset, "offset")?;
            let length = size_arg(py, length, "length")?;
            let window = py
                .detach(|| {
                    // SAFETY: only borrowed for this call, while the caller keeps `fd` open
                    // (documented); a closed or reused number fails the seal and size checks
                    // or maps another sealed memfd, never a file that could shrink.
                    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                    match fault_in {
                        true => Window::new(fd, offset, length),
                        false => Window::unfaulted(fd, offset, length),
                    }
                })
                .py(py)?;
            Ok(PyArenaWindow { window })
        })
    }

    /// The file offset of the window's first byte.
    #[getter]
    fn offset(&self) -> usize {
        self.window.offset()
    }

    /// The window's length in bytes (whole pages).
    #[getter]
    fn length(&self) -> usize {
        self.window.len()
    }

    /// Whether the file's bytes `[offset, offset + nbytes)` lie inside the window.
    fn contains(
        &self,
        py: Python<'_>,
        offset: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        guarded(|| {
            let offset = size_arg(py, offset, "offset")?;
            let nbytes = size_arg(py, nbytes, "nbytes")?;
            Ok(self.window.contains(offset, nbytes))
        })
    }

    /// The file offsets `[start, end)` of the pages open (readable and writable), or None
    /// while the window is closed.
    #[getter]
    fn open_range(&self) -> Option<(usize, usize)> {
        self.window.open_range()
    }

    /// Whether the window has a memory protection key of its own (where the processor and the
    /// kernel have them, and one was left): then `open(..., keyed=True)` keeps the range's
    /// pages writable between batches, and only a thread that calls `allow()` reaches them.
    #[getter]
    fn has_key(&self) -> bool {
        self.window.has_key()
    }

    /// Whether every page has been faulted in.
    #[getter]
    fn faulted(&self) -> bool {
        self.window.is_faulted()
    }

    /// Faults every page in on the calling thread, without the GIL, where the window has a key:
    /// the pages are writable meanwhile under the key alone, with only this thread's access
    /// on, so no other thread can reach them. True once faulted in (now or before); False,
    /// doing nothing, on a window without a key (the first `open()` faults it in then).
    fn fault_in_privately(&self, py: Python<'_>) -> PyResult<bool> {
        guarded(|| py.detach(|| self.window.fault_in_privately()).py(py))
    }

    /// The file offsets `[start, end)` of the pages kept readable and writable under the
    /// window's key between batches (the last range opened keyed), or None.
    #[getter]
    fn armed_range(&self) -> Option<(usize, usize)> {
        self.window.armed_range()
    }

    /// Makes the pages holding the file's bytes `[offset, offset + nbytes)` readable and
    /// writable (the range must lie inside the window and hold at least one byte), without
    /// the GIL (with it, on a window with a key that is faulted in: that costs no fault and
    /// at most one `pkey_mprotect`). One range at a time: raises `InvalidArgument` while one
    /// is open.
    ///
    /// With `keyed=True` on a window with a key, the pages are made so under the key (at
    /// once, if they are the range opened keyed last), and only a thread that calls
    /// `allow()` may touch them, until it calls `deny()` or `close()`; otherwise any thread
    /// may, until `close()`.
    #[pyo3(signature = (offset, nbytes, keyed = false))]
    fn open(
        &self,
        py: Python<'_>,
        offset: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        keyed: bool,
    ) -> PyResult<()> {
        guarded(|| {
            let offset = size_arg(py, offset, "offset")?;
            let nbytes = size_arg(py, nbytes, "nbytes")?;
            if self.cheap_to_switch() {
                // (No page to fault in, no mprotect that must wait for other threads' TLBs:
                // giving the GIL up and taking it back would cost more, and could hand it to
                // another thread of the worker for as long as that thread keeps it.)
                return self.window.open(offset, nbytes, keyed).py(py);
            }
            py.detach(|| self.window.open(offset, nbytes, keyed)).py(py)
        })
    }

    /// Switches the calling thread's access to the range opened keyed on (nothing to do for
    /// a range opened otherwise). Raises `InvalidArgument` while another thread's is on.
    fn allow(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| self.window.allow().py(py))
    }

    /// Switches the calling thread's access to the window's key off.
    fn deny(&self) {
        self.window.deny()
    }

    /// Makes the whole window inaccessible again (nothing to do if nothing is open), without
    /// the GIL (with it, on a window with a key that is faulted in): the open range's pages,
    /// or, for a range opened keyed, the calling thread's access (the pages stay so under the
    /// key for the next batch). Raises `BufferError`, changing nothing, while a view of the
    /// window is alive.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            let closed = match self.cheap_to_switch() {
                true => self.window.close(),
                false => py.detach(|| self.window.close()),
            };
            if !closed.py(py)? {
                return Err(PyBufferError::new_err(format!(
                    "cannot close the window while {} view(s) of it are alive: release them \
                     first",
                    self.window.views()
                )));
            }
            Ok(())
        })
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        guarded(|| {
            let window = &slf.get().window;
            if !window.is_ours() {
                return Err(PyBufferError::new_err(
                    "this window was mapped by the process this one was forked from",
                ));
            }
            let len = isize::try_from(window.len())
                .map_err(|_| PyBufferError::new_err("window too large for a buffer"))?;
            let ptr = window.add_view();
            // SAFETY: `view` is valid (CPython's contract); the window is mapped for as long
            // as this object lives, `len` bytes from `ptr`, and `PyBuffer_FillInfo` takes a
            // new reference on `slf` for the buffer's life. The view is counted from here
            // until `__releasebuffer__`.
            let rc =
                unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len, 0, flags) };
            if rc != 0 {
                window.remove_view();
                return Err(PyErr::fetch(slf.py()));
            }
            Ok(())
        })
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.window.remove_view();
    }

    fn __repr__(&self) -> String {
        let (start, end) = (self.window.offset(), self.window.offset() + self.window.len());
        match self.window.open_range() {
            Some((a, b)) => format!("ArenaWindow([{start}, {end}), open [{a}, {b}))"),
            None => format!("ArenaWindow([{start}, {end}), closed)"),
        }
    }
}
