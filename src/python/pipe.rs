//! `PipeWriter`: a pipe written by a thread of its own (`crate::transport::pipe_writer`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::{guarded, timeout_arg, IntoPy, FOREVER};
use crate::transport::pipe_writer::PipeWriter;

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
