//! `Grants`: a loader's zero-copy grants, answered at the process's grant desk
//! (`crate::pool::grants`, `crate::transport::grant_desk`); this layer converts arguments and wraps
//! adopted slots as `Slot`s.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::convert::{guarded, IntoPy};
use super::pool::PyPinPool;
use super::slot::PySlot;
use crate::pool::grants::{GrantRequest, Grants};
use crate::transport::grant_desk::{self, Registration};

/// The zero-copy grants of one loader, and its place at the process's grant desk.
#[pyclass(name = "Grants", module = "pinpool._native", frozen)]
pub struct PyGrants {
    inner: Arc<Grants>,
    desk: Mutex<Option<Registration>>,
    fence_device: Mutex<Option<usize>>,
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
impl PyGrants {
    /// A table whose workers keep at most `windows` windows and `window_bytes` bytes of them,
    /// and whose batches of `big_from` bytes and more are big (told as likely, remembered for
    /// the next iterator), answered at the process's grant desk (started if need be) until `close()`.
    #[new]
    #[pyo3(signature = (windows, window_bytes, big_from = crate::pool::grants::BIG_FROM))]
    fn new(py: Python<'_>, windows: usize, window_bytes: usize, big_from: usize) -> PyResult<Self> {
        guarded(|| {
            let inner = Arc::new(Grants::new(windows, window_bytes, big_from));
            let desk = grant_desk::register(&inner).py(py)?;
            Ok(PyGrants { inner, desk: Mutex::new(Some(desk)), fence_device: Mutex::new(None) })
        })
    }

    /// `(address, table)`: where workers ask (an abstract socket name, without its leading
    /// NUL) and the number their requests name this table by; None once closed.
    #[getter]
    fn desk<'py>(&self, py: Python<'py>) -> Option<(Bound<'py, PyBytes>, u64)> {
        let desk = self.desk.lock().unwrap_or_else(|e| e.into_inner());
        desk.as_ref().map(|d| (PyBytes::new(py, d.address()), d.table()))
    }

    /// Grants come from `pool` from now on, for batches of up to `largest` bytes.
    fn use_pool(&self, py: Python<'_>, pool: &PyPinPool, largest: usize) -> PyResult<()> {
        guarded(|| {
            let p = pool.get(py)?;
            *self.fence_device.lock().unwrap_or_else(|e| e.into_inner()) = pool.device_for_fences();
            self.inner.use_pool(&p, largest);
            Ok(())
        })
    }

    /// Whether the loader's pool is being made: until `use_pool`, requests wait for it.
    fn pool_coming(&self, coming: bool) {
        self.inner.pool_coming(coming);
    }

    /// What the desk answers a request now, without waiting for room on its way: the grant's
    /// words (`crate::pool::grants::Grant::words`), or None.
    fn issue(
        &self,
        owner: u64,
        worker: usize,
        task: u64,
        nbytes: usize,
    ) -> PyResult<Option<Vec<u64>>> {
        guarded(|| {
            let request = GrantRequest { owner, worker, task, nbytes };
            Ok(self.inner.issue(&request).map(|g| g.words()))
        })
    }

    /// Iterator `owner`'s workers may be granted slots from now on.
    fn open(&self, owner: u64) {
        self.inner.open(owner);
    }

    /// The consumer of iterator `owner` waits for task `task` next.
    fn set_head(&self, owner: u64, task: u64) {
        self.inner.set_head(owner, task);
    }

    /// The slot granted as (`index`, `generation`) with `nonce`, as a `Slot`, once; None if no
    /// such grant is out.
    fn adopt(
        &self,
        index: &Bound<'_, PyAny>,
        generation: &Bound<'_, PyAny>,
        nonce: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PySlot>> {
        guarded(|| {
            let Some((i, g, n)) = claim(index, generation, nonce) else { return Ok(None) };
            let device = *self.fence_device.lock().unwrap_or_else(|e| e.into_inner());
            Ok(self.inner.adopt(i, g, n).map(|(pool, c)| PySlot::new(pool, c, device)))
        })
    }

    /// Releases the slot granted as (`index`, `generation`) with `nonce` (its batch will not
    /// arrive in it); returns whether there was one.
    fn give_back(
        &self,
        index: &Bound<'_, PyAny>,
        generation: &Bound<'_, PyAny>,
        nonce: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        guarded(|| {
            let Some((i, g, n)) = claim(index, generation, nonce) else { return Ok(false) };
            Ok(self.inner.give_back(i, g, n))
        })
    }

    /// Stops iterator `owner` (every one, with None): no more grants for it, and its requests
    /// waiting at the desk are answered at once; what was granted stays out until `close`.
    #[pyo3(signature = (owner = None))]
    fn stop(&self, owner: Option<u64>) {
        self.inner.stop(owner);
    }

    /// Closes iterator `owner` (every one, and the table's place at the desk, with None):
    /// releases the slots granted to it and not adopted, once no worker that got them can write
    /// any more.
    #[pyo3(signature = (owner = None))]
    fn close(&self, owner: Option<u64>) -> PyResult<()> {
        guarded(|| {
            self.inner.close(owner);
            if owner.is_none() {
                drop(self.desk.lock().unwrap_or_else(|e| e.into_inner()).take());
            }
            Ok(())
        })
    }

    /// Requests that got no grant (their batches went through copy mode).
    #[getter]
    fn fallbacks(&self) -> u64 {
        self.inner.fallbacks()
    }

    /// Grants that named where the worker's next slots will likely be.
    #[getter]
    fn told_likely(&self) -> u64 {
        self.inner.told_likely()
    }

    /// Grants made and not yet adopted, given back or closed.
    #[getter]
    fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }
}
