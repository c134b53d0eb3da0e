//! `PipeWriter`: a pipe written by a thread of its own (`crate::transport::pipe_writer`);
//! `read_message`: one whole message read from a pipe (`crate::transport::pipe_reader`).

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyEOFError, PyOSError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::{guarded, timeout_arg, IntoPy, FOREVER};
use crate::error::Error;
use crate::transport::pipe_reader::{self, Message, Waited};
use crate::transport::pipe_writer::PipeWriter;

/// How long a wait for a message goes without running the signal handlers (a signal the
/// kernel gave another thread does not interrupt the wait).
const HANDLERS_RUN_EVERY: Duration = Duration::from_millis(20);

/// One message from the pipe whose read end is `fd` (framed as `Connection.send_bytes` frames
/// it), or None when none came within `timeout` seconds (None: no limit).
///
/// The wait runs without the GIL, and the signal handlers run during it (their exception is
/// raised with nothing read); once a message has begun to come it is read whole, signals or
/// not, so the pipe is never left in the middle of one. The end of file before a message is
/// an `EOFError`, a failed read an `OSError`, as `Connection.recv_bytes` raises them.
#[pyfunction]
#[pyo3(signature = (fd, timeout = None))]
pub fn read_message<'py>(
    py: Python<'py>,
    fd: i32,
    timeout: Option<f64>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    guarded(|| {
        if fd < 0 {
            return Err(PyOSError::new_err(format!("not a file descriptor: {fd}")));
        }
        // SAFETY: `fd` is only borrowed for this call, while the caller holds the pipe open
        // (the queue whose read end it is); nothing here closes or keeps it.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let wait = timeout_arg(py, timeout)?.unwrap_or(FOREVER);
        let deadline = Instant::now().checked_add(wait);
        loop {
            let left = deadline.map_or(FOREVER, |d| d.saturating_duration_since(Instant::now()));
            let slice = left.min(HANDLERS_RUN_EVERY);
            match py.detach(|| pipe_reader::wait_readable(fd, slice)).map_err(os_error)? {
                Waited::Readable => break,
                Waited::TimedOut if left <= HANDLERS_RUN_EVERY => return Ok(None),
                Waited::TimedOut | Waited::Interrupted => py.check_signals()?,
            }
        }
        match py.detach(|| pipe_reader::read_message(fd)).map_err(os_error)? {
            Message::Whole(bytes) => Ok(Some(PyBytes::new(py, &bytes))),
            Message::Ended => Err(PyEOFError::new_err("the pipe was closed by every writer")),
        }
    })
}

/// A reading error as Python's own reads raise it: an `OSError`.
fn os_error(err: Error) -> PyErr {
    match err {
        Error::Os { errno, .. } => PyOSError::new_err((errno, err.to_string())),
        other => PyOSError::new_err(other.to_string()),
    }
}

/// Writes messages to a pipe on a thread of its own, framed as
/// `multiprocessing.Connection.send_bytes` frames them, in the order they were sent.
#[pyclass(name = "PipeWriter", module = "pinpool._native", frozen)]
pub struct PyPipeWriter {
    inner: PipeWriter,
}

#[pymethods]
impl PyPipeWriter {
    /// A writer of the pipe whose write end is `fd` (only borrowed: it writes to a duplicate).
    #[new]
    fn new(py: Python<'_>, fd: i32) -> PyResult<Self> {
        guarded(|| Ok(PyPipeWriter { inner: PipeWriter::new(fd).py(py)? }))
    }

    /// Queues `data` as one message; returns at once. Raises `PoolClosed` once closed.
    fn send(&self, py: Python<'_>, data: &Bound<'_, PyBytes>) -> PyResult<()> {
        guarded(|| self.inner.send(data.as_bytes()).py(py))
    }

    /// Closes the writer (what was sent is still written) and waits, without the GIL, at most
    /// `timeout` seconds for its thread to end; returns whether it ended.
    #[pyo3(signature = (timeout = 1.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        guarded(|| {
            let wait = timeout_arg(py, Some(timeout))?.unwrap_or(FOREVER);
            Ok(py.detach(|| self.inner.close(wait)))
        })
    }

    /// Messages written whole so far.
    #[getter]
    fn written(&self) -> u64 {
        self.inner.written()
    }

    /// The write error the thread ended on (no reader left, say), or None.
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.error().map(|e| e.to_string())
    }
}
