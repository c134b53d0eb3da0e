//! `Handoff`: a job handed to another thread and waited for without waking for signals
//! (`crate::system::handoff`).

use pyo3::prelude::*;

use super::convert::{guarded, timeout_arg};
use crate::system::handoff::{Handoff, Stage, Waited};

/// A job handed from one thread to another. Its wait releases the GIL and only the job's end
/// (or the time given to take it back) ends it: a signal's Python handler runs once the wait
/// has returned, not inside it.
#[pyclass(name = "Handoff", module = "pinpool._native", frozen)]
#[derive(Default)]
pub struct PyHandoff {
    inner: Handoff,
}

#[pymethods]
impl PyHandoff {
    /// A hand-off nobody has begun.
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// For the runner: whether it is the one to run the job.
    fn take(&self) -> bool {
        self.inner.take()
    }

    /// The job is done: every waiter is woken.
    fn finish(&self) {
        self.inner.finish();
    }

    /// `"waiting"`, `"taken"` or `"done"`.
    #[getter]
    fn stage(&self) -> &'static str {
        match self.inner.stage() {
            Stage::Waiting => "waiting",
            Stage::Taken => "taken",
            Stage::Done => "done",
        }
    }

    /// Waits, without the GIL, until the job is done; True then. With `take_back_after`
    /// seconds, a job nobody has begun by then is taken back: False, and the caller runs it.
    #[pyo3(signature = (take_back_after = None))]
    fn wait(&self, py: Python<'_>, take_back_after: Option<f64>) -> PyResult<bool> {
        guarded(|| {
            let after = timeout_arg(py, take_back_after)?;
            Ok(py.detach(|| self.inner.wait(after)) == Waited::Done)
        })
    }
}
