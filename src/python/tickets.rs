//! `Tickets`: zero-copy slots checked out by the index queues' writer threads
//! (`crate::tickets`); this layer converts arguments and wraps adopted slots as `Slot`s.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::guarded;
use super::slot::PySlot;
use crate::tickets::{TicketRequest, Tickets};

/// The zero-copy tickets of one `PinPool` (made by `PinPool.tickets`).
#[pyclass(name = "Tickets", module = "pinpool._native", frozen)]
pub struct PyTickets {
    pub(crate) inner: Arc<Tickets>,
    pub(crate) fence_device: Option<usize>,
}

/// A claim's (index, generation, nonce), if each is an int in its range.
fn claim(
    index: &Bound<'_, PyAny>,
    generation: &Bound<'_, PyAny>,
    nonce: &Bound<'_, PyAny>,
) -> Option<(u32, u32, u64)> {
    Some((index.extract().ok()?, generation.extract().ok()?, nonce.extract().ok()?))
}

#[pymethods]
impl PyTickets {
    /// What a message carries where its ticket goes: a random marker, then zeros.
    #[getter]
    fn placeholder<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.placeholder())
    }

    /// Checks a slot of `nbytes` out now for worker `worker` of iterator `owner` (leaving
    /// `keep` bytes free in one range) and returns its ticket (zeros: none).
    fn issue<'py>(
        &self,
        py: Python<'py>,
        owner: u64,
        worker: usize,
        nbytes: usize,
        keep: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        guarded(|| {
            let request = TicketRequest { owner, worker, nbytes, keep };
            Ok(PyBytes::new(py, &self.inner.issue(&request)))
        })
    }

    /// The slot issued as (`index`, `generation`) with `nonce`, as a `Slot`, once; None if no
    /// such ticket is out.
    fn adopt(
        &self,
        index: &Bound<'_, PyAny>,
        generation: &Bound<'_, PyAny>,
        nonce: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PySlot>> {
        guarded(|| {
            let Some((i, g, n)) = claim(index, generation, nonce) else { return Ok(None) };
            Ok(self.inner.adopt(i, g, n).map(|(pool, c)| PySlot::new(pool, c, self.fence_device)))
        })
    }

    /// Releases the slot issued as (`index`, `generation`) with `nonce` (its batch will not
    /// arrive in it); returns whether there was one.
    fn take_back(
        &self,
        index: &Bound<'_, PyAny>,
        generation: &Bound<'_, PyAny>,
        nonce: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        guarded(|| {
            let Some((i, g, n)) = claim(index, generation, nonce) else { return Ok(false) };
            Ok(self.inner.take_back(i, g, n))
        })
    }

    /// Releases the slots issued for iterator `owner` (all with None): once no worker that
    /// got them can write any more.
    #[pyo3(signature = (owner = None))]
    fn drop(&self, owner: Option<u64>) -> PyResult<()> {
        guarded(|| {
            self.inner.drop_owner(owner);
            Ok(())
        })
    }

    /// Tickets that could not be issued (the batch went through copy mode).
    #[getter]
    fn fallbacks(&self) -> u64 {
        self.inner.fallbacks()
    }

    /// Tickets issued and not yet adopted, taken back or dropped.
    #[getter]
    fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }
}
