//! `pinpool.PinPool`: the Python face of [`crate::pool::Pool`].
//!
//! Its arguments that need more than a plain conversion are `arguments`' (`device=`,
//! `backend=`, `prefer=`); what it says back (what a new pool is, its notes logged once, the
//! stats dict) is `reporting`'s.
//!
//! Invariant: only translates types and errors; whatever can block (a checkout that waits,
//! making the arena, a flush) runs with the GIL released.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, Weak};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::{bool_arg, guarded, size_arg, timeout_arg, to_py, IntoPy};
use super::slot::PySlot;
use crate::error::Error;
use crate::pool::claim::{Claim, ClaimRules};
use crate::pool::{Counters, Pool, PoolConfig};
use crate::transport::reclaim::{Reclaimer, SharedReclaimer};

mod arguments;
mod reporting;

use arguments::{
    backend_arg, cuts_arg, default_copy_threads, device_arg, parse_device, preference,
    preferred_offsets,
};
use reporting::{log_made, stats_dict};

/// A fixed arena of (pinned) host memory, handed out as slots of any size.
///
/// `slot_bytes`: the largest slot (and the size of a checkout that does not say); the arena's
/// parts are whole multiples of it. `num_slots`: the most slots out or fenced at once.
/// `arena_bytes`: the arena's size, rounded up to whole `slot_bytes` (default:
/// `slot_bytes * num_slots`, equal slots). `background=True`: only the first `ready_first`
/// bytes (default: 16 MiB, and at least one largest slot) are made ready before the pool is
/// returned, the rest on a background thread (checkouts wait for room not ready yet).
///
/// `device`: an ordinal, `"cuda:N"` or a `torch.device` binds that GPU; `"cpu"` means no CUDA
/// (host memory); `None` (the default) or `"cuda"` the rank's own GPU: the device of the CUDA
/// context current on this thread (`torch.cuda.set_device`), else `$LOCAL_RANK` modulo the
/// device count, else device 0. Where CUDA cannot be used, `None` gives host memory (with a
/// note); a device or CUDA backend asked for by name raises `InvalidArgument` saying why.
#[pyclass(name = "PinPool", module = "pinpool._native", frozen)]
pub struct PyPinPool {
    pool: Mutex<Option<Arc<Pool>>>,
    /// Still reaches the pool after `close()` while slots keep it alive (for `stats()`).
    weak: Weak<Pool>,
    /// The counters, which outlive the pool (for `stats()` once it is gone).
    counters: Arc<Counters>,
    /// The reclaimer this pool's segment caches share, and their counts (for `stats()`).
    segments: SharedReclaimer,
    device: Option<usize>,
    backend: &'static str,
    memory: &'static str,
    slot_bytes: usize,
    num_slots: usize,
    arena_bytes: usize,
    largest_slot: usize,
    address: usize,
    copy_threads: usize,
    notes: Vec<String>,
    startup: Vec<(&'static str, f64)>,
}

impl PyPinPool {
    /// Where `slot` lies in shared memory (`Pool::slot_location`). None for `cuda-hostalloc`
    /// (no memfd), a released slot, or once closed.
    fn location_of(&self, slot: &PySlot) -> Option<crate::pool::SlotLocation> {
        let pool = self.pool.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        pool.slot_location(slot.id())
    }

    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<Pool>> {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| to_py(py, Error::Closed))
    }

    /// The reclaimer for a new segment cache of this pool.
    pub(crate) fn reclaimer(&self, py: Python<'_>) -> PyResult<Arc<Reclaimer>> {
        self.segments.get().py(py)
    }

    fn wrap(&self, pool: Arc<Pool>, id: crate::allocation::slots::SlotId) -> PySlot {
        PySlot::new(pool, id, self.device_for_fences())
    }

    pub(crate) fn device_for_fences(&self) -> Option<usize> {
        match self.backend {
            "host" => None,
            _ => self.device,
        }
    }
}

#[pymethods]
impl PyPinPool {
    #[new]
    #[pyo3(
        signature = (slot_bytes, num_slots, device = None, backend = None, copy_threads = None, background = None, arena_bytes = None, ready_first = None),
        text_signature = "(slot_bytes, num_slots, device=None, backend='auto', copy_threads=None, background=False, arena_bytes=None, ready_first=None)"
    )]
    #[allow(clippy::too_many_arguments)] // (Python's keyword arguments)
    fn new(
        py: Python<'_>,
        slot_bytes: &Bound<'_, PyAny>,
        num_slots: &Bound<'_, PyAny>,
        device: Option<&Bound<'_, PyAny>>,
        backend: Option<&Bound<'_, PyAny>>,
        copy_threads: Option<&Bound<'_, PyAny>>,
        background: Option<&Bound<'_, PyAny>>,
        arena_bytes: Option<&Bound<'_, PyAny>>,
        ready_first: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guarded(|| {
            let slot_bytes = size_arg(py, slot_bytes, "slot_bytes")?;
            let arena_bytes = arena_bytes.map(|n| size_arg(py, n, "arena_bytes")).transpose()?;
            let num_slots = size_arg(py, num_slots, "num_slots")?;
            let ready_first = ready_first.map(|n| size_arg(py, n, "ready_first")).transpose()?;
            let request = parse_device(py, device.map(device_arg).transpose()?)?;
            let backend = backend_arg(py, backend)?;
            let background = match background {
                None => false,
                Some(b) => bool_arg(b, "background")?,
            };
            let copy_threads = match copy_threads {
                Some(n) => size_arg(py, n, "copy_threads")?,
                None => default_copy_threads().py(py)?,
            };
            // On this thread (detached, not moved): the automatic choice reads its context.
            let chosen = py.detach(|| request.resolve(backend)).py(py)?;
            let config = PoolConfig {
                slot_bytes,
                num_slots,
                arena_bytes,
                device: chosen.ordinal,
                backend,
                copy_threads,
                background,
                ready_first,
            };
            let pool = py.detach(|| Pool::new(&config)).py(py)?;
            let notes = log_made(py, &pool, chosen)?;
            Ok(PyPinPool {
                device: pool.arena().device().map(|d| d.ordinal()),
                backend: pool.backend().name(),
                memory: pool.residency().name(),
                slot_bytes: pool.slot_bytes(),
                num_slots: pool.num_slots(),
                arena_bytes: pool.arena().len(),
                largest_slot: pool.largest_slot(),
                address: pool.arena().base() as usize,
                copy_threads: pool.copy_threads(),
                notes,
                startup: pool.arena().timings().to_vec(),
                counters: pool.counters(),
                segments: SharedReclaimer::default(),
                weak: Arc::downgrade(&pool),
                pool: Mutex::new(Some(pool)),
            })
        })
    }

    /// Takes a slot of `nbytes` (default: `slot_bytes`), waiting (without the GIL) up to
    /// `timeout` seconds for room.
    #[pyo3(signature = (timeout = None, nbytes = None))]
    fn checkout(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        nbytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySlot> {
        guarded(|| {
            let timeout = timeout_arg(py, timeout)?;
            let pool = self.get(py)?;
            let bytes = match nbytes {
                Some(n) => size_arg(py, n, "nbytes")?,
                None => self.slot_bytes,
            };
            if let Some(t) = pool.try_checkout_bytes(bytes, 0).py(py)? {
                return Ok(self.wrap(pool, t));
            }
            let p = Arc::clone(&pool);
            let slot = py.detach(move || p.checkout_bytes(bytes, timeout)).py(py)?;
            Ok(self.wrap(pool, slot))
        })
    }

    /// Takes a slot of `nbytes` (default: `slot_bytes`) by a loader's rules, waiting without
    /// the GIL while room is on its way: a `Slot`, or `"later"` (with `defer`, at once: no free
    /// range, once fenced slots are back, would hold it and `reserve` more bytes; or `timeout`
    /// passed), or `"overflow"` (with `overflow`, at once: no free range, once fenced slots are
    /// back, would hold it). `reserve`: bytes to leave free in one range for other claims.
    /// Without `defer`, a timeout raises `PoolExhausted`.
    #[pyo3(signature = (nbytes = None, reserve = 0, timeout = None, overflow = false, defer = false))]
    fn claim<'py>(
        &self,
        py: Python<'py>,
        nbytes: Option<&Bound<'_, PyAny>>,
        reserve: usize,
        timeout: Option<f64>,
        overflow: bool,
        defer: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        guarded(|| {
            let rules = ClaimRules { reserve, timeout: timeout_arg(py, timeout)?, overflow, defer };
            let pool = self.get(py)?;
            let bytes = match nbytes {
                Some(n) => size_arg(py, n, "nbytes")?,
                None => self.slot_bytes,
            };
            // The common case, room beyond the reserve, keeps the GIL: handing it back and
            // forth would cost more than the checkout.
            if let Some(t) = pool.try_checkout_bytes(bytes, rules.reserve).py(py)? {
                return Ok(Bound::new(py, self.wrap(pool, t))?.into_any());
            }
            let p = Arc::clone(&pool);
            Ok(match py.detach(move || p.claim(bytes, &rules)).py(py)? {
                Claim::Slot(t) => Bound::new(py, self.wrap(pool, t))?.into_any(),
                Claim::Later => "later".into_pyobject(py)?.into_any(),
                Claim::Overflow => "overflow".into_pyobject(py)?.into_any(),
            })
        })
    }

    /// Takes a slot of `nbytes` (default: `slot_bytes`), or returns None at once if there is
    /// no room for it, or (with `reserve`) none that leaves `reserve` bytes free in one range
    /// for other callers. `prefer`: arena offsets (`Slot.offset`s, at most 64) where the slot
    /// should start, in order of preference: the first where it can start now (free, a whole
    /// number of pages, in one part, `reserve` honoured) is taken, else it goes wherever
    /// first fit puts it; with `prefer_only`, nowhere else (None).
    #[pyo3(signature = (nbytes = None, reserve = 0, prefer = None, prefer_only = false))]
    fn try_checkout(
        &self,
        py: Python<'_>,
        nbytes: Option<&Bound<'_, PyAny>>,
        reserve: usize,
        prefer: Option<&Bound<'_, PyAny>>,
        prefer_only: bool,
    ) -> PyResult<Option<PySlot>> {
        guarded(|| {
            let pool = self.get(py)?;
            let bytes = match nbytes {
                Some(n) => size_arg(py, n, "nbytes")?,
                None => self.slot_bytes,
            };
            let prefer = preferred_offsets(py, prefer)?;
            Ok(pool
                .try_checkout_bytes_preferring(bytes, reserve, &prefer, preference(prefer_only))
                .py(py)?
                .map(|t| self.wrap(pool, t)))
        })
    }

    /// The bytes `[0, cuts[-1])` of one batch as consecutive slots, cut only at `cuts` (ints
    /// increasing from 0: where no array of the batch is split), at once, without waiting:
    /// `[(start, Slot), ...]` in the batch's order, or None (nothing taken) when the free
    /// ranges cannot hold the pieces. For the batch the consumer waits for when no one free
    /// range holds it.
    fn claim_split<'py>(
        &self,
        py: Python<'py>,
        cuts: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        guarded(|| {
            let cuts = cuts_arg(py, cuts)?;
            let pool = self.get(py)?;
            let Some(pieces) = pool.try_checkout_split(&cuts).py(py)? else { return Ok(None) };
            // Every piece held by a Slot first: one that goes unused is released as it drops.
            let slots: Vec<(usize, PySlot)> = pieces
                .into_iter()
                .map(|(start, slot)| (start, self.wrap(Arc::clone(&pool), slot)))
                .collect();
            Ok(Some(PyList::new(py, slots)?))
        })
    }

    /// Counters and slot states, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(|| {
            let snapshot = match self.weak.upgrade() {
                Some(pool) => pool.stats(),
                None => self.counters.final_stats(),
            };
            stats_dict(py, &snapshot, &self.segments.stats())
        })
    }

    /// Waits (without the GIL) until every retired segment has been unmapped.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            let _pool = self.get(py)?;
            py.detach(|| self.segments.flush());
            Ok(())
        })
    }

    /// Stops new checkouts and wakes waiters (they raise `PoolClosed`). Slots already out stay
    /// valid; the arena is freed on the freeing thread once the last of them is released or
    /// collected. With `wait=True`, returns only once retired segments are unmapped and, if
    /// no slot is out, the arena is freed.
    #[pyo3(signature = (wait = false))]
    fn close(&self, py: Python<'_>, wait: bool) -> PyResult<()> {
        guarded(|| {
            let taken = self.pool.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(pool) = taken {
                pool.close();
                if wait {
                    py.detach(|| self.segments.flush());
                }
                drop(pool); // cheap: the arena goes to the freeing thread
            }
            if wait {
                py.detach(|| crate::memory::freeing::flush(None));
            }
            Ok(())
        })
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py, false)?;
        Ok(false)
    }

    /// `"cuda-register"`, `"cuda-hostalloc"` or `"host"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// `"pinned"`, `"locked"` or `"pageable"`.
    #[getter]
    fn memory(&self) -> &'static str {
        self.memory
    }

    /// The size of a checkout that does not say (rounded up to a page).
    #[getter]
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The most slots out or fenced at once.
    #[getter]
    fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// The whole arena's size in bytes.
    #[getter]
    fn arena_bytes(&self) -> usize {
        self.arena_bytes
    }

    /// The largest slot the arena can ever hold (its longest part: at least `slot_bytes`).
    #[getter]
    fn largest_slot(&self) -> usize {
        self.largest_slot
    }

    /// The arena's first byte, as an integer: a slot starts at `address + slot.offset`.
    /// (Kept after `close()`, when nothing is mapped there any more.)
    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    /// Where a slot lives in shared memory: `(fd, slot offset in that memfd, memfd length)`,
    /// for worker processes that write batches straight into slots. None for
    /// `cuda-hostalloc` (no memfd), a released slot, or once closed.
    fn slot_memfd(&self, slot: &PySlot) -> Option<(i32, usize, usize)> {
        self.location_of(slot).map(|l| (l.fd, l.offset, l.part_len))
    }

    /// As `slot_memfd`, with the memfd's inode number last: `(fd, slot offset in that memfd,
    /// memfd length, inode)`, what a zero-copy grant names (the inode lets the worker
    /// check that the descriptor it opens is that file).
    fn slot_location(&self, slot: &PySlot) -> Option<(i32, usize, usize, u64)> {
        self.location_of(slot).map(|l| (l.fd, l.offset, l.part_len, l.inode))
    }

    /// The arena's memfd parts, in order: `(fd, first byte's arena offset, length)`, for the
    /// main process to tell a zero-copy worker where its next slots will be. Empty for
    /// `cuda-hostalloc` (no memfd), or once closed.
    fn memfd_parts(&self) -> Vec<(i32, usize, usize)> {
        let Some(pool) = self.pool.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Vec::new();
        };
        let (arena, mut at, mut parts) = (pool.arena(), 0, Vec::new());
        while let Some((fd, start, len)) = arena.part_at(at) {
            parts.push((fd.as_raw_fd(), start, len));
            at = start + len;
        }
        parts
    }

    /// CUDA device ordinal, or None on the host backend.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }

    /// Threads used for copies.
    #[getter]
    fn copy_threads(&self) -> usize {
        self.copy_threads
    }

    /// Seconds each start-up step took (`populate`, `cuMemHostRegister`, ...).
    #[getter]
    fn startup<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, secs) in &self.startup {
            d.set_item(*name, *secs)?;
        }
        Ok(d)
    }

    /// Why the pool differs from what was asked (e.g. no CUDA, memory not locked).
    #[getter]
    fn notes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut notes = self.notes.clone();
        if let Some(e) = self.weak.upgrade().as_deref().and_then(Pool::prepare_error) {
            notes.push(format!("preparing the rest of the arena failed ({e}): fewer slots"));
        }
        PyList::new(py, &notes)
    }

    fn __repr__(&self) -> String {
        format!(
            "PinPool(slot_bytes={}, num_slots={}, arena_bytes={}, backend={:?}, memory={:?}, \
             device={}{})",
            self.slot_bytes,
            self.num_slots,
            self.arena_bytes,
            self.backend,
            self.memory,
            // As Python writes it: an ordinal, or None.
            self.device.map_or_else(|| "None".to_string(), |d| d.to_string()),
            if self.closed() { ", closed" } else { "" }
        )
    }
}
