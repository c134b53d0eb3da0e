//! `pinpool.Segment`: a shared-memory file mapped read-only by `PinPool.map_segment`, for
//! copies into slots with `PinPool.copy_into`.
//!
//! Invariants:
//! - The mapping is unmapped (and its fd closed) exactly once, on the pool's reclaimer thread,
//!   never on the caller's: on `close()`, on leaving a `with` block, or when the object dies.
//! - A copy that still borrows the mapping keeps it alive (it holds an `Arc`); the reclaimer
//!   gets it once the last borrower is done.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use super::to_py;
use crate::error::Error;
use crate::pool::Pool;
use crate::shm::Mapping;

/// A shared-memory segment mapped read-only by `PinPool.map_segment`.
#[pyclass(name = "Segment", module = "pinpool._native", frozen)]
pub struct PySegment {
    pool: Arc<Pool>,
    map: Mutex<Option<Arc<Mapping>>>,
    nbytes: usize,
}

impl PySegment {
    pub(crate) fn new(pool: Arc<Pool>, map: Mapping) -> Self {
        let nbytes = map.len();
        PySegment { pool, map: Mutex::new(Some(Arc::new(map))), nbytes }
    }

    pub(crate) fn mapping(&self, py: Python<'_>) -> PyResult<Arc<Mapping>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| to_py(py, Error::Invalid("this segment was closed".into())))
    }

    fn take(&self) {
        if let Some(map) = self.map.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.pool.retire_shared_segment(map);
        }
    }
}

#[pymethods]
impl PySegment {
    /// Bytes mapped.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// Hands the mapping to the background thread, which unmaps it and closes its fd.
    fn close(&self) {
        self.take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.take();
        false
    }
}

impl Drop for PySegment {
    fn drop(&mut self) {
        self.take();
    }
}
