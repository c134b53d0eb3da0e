//! What a pool says back: what it is when made (logged), its counters as the dict
//! `PinPool.stats()` returns, and its notes, each kind logged once per process.
//!
//! Invariant: the stats dict has exactly the keys of `PoolStats` in `python/pinpool/_stats.py`
//! (`tests/package/test_typing.py` compares them with a real `stats()`).

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::memory::device_choice::PoolDevice;
use crate::pool::{Pool, Stats};
use crate::transport::reclaim::SegmentStats;

/// Whether `note` is logged for the first time in this process: a note that every pool of a
/// machine gets (no CUDA device, memory not locked) is said once, not once per pool. Every
/// pool still lists its notes in `pool.notes`.
pub(super) fn first_time(note: &str) -> bool {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    // Notes that name sizes or errors differ only in those: the words before the first number
    // or parenthesis say which kind a note is.
    let kind: String =
        note.split(|c: char| c.is_ascii_digit() || c == '(').next().unwrap_or(note).to_owned();
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.contains(&kind) {
        return false;
    }
    seen.push(kind);
    true
}

pub(super) fn stats_dict<'py>(
    py: Python<'py>,
    s: &Stats,
    segments: &SegmentStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("slots_free", s.slots.free)?;
    d.set_item("slots_checked_out", s.slots.checked_out)?;
    d.set_item("slots_fenced", s.slots.fenced)?;
    d.set_item("slots_preparing", s.slots.preparing)?;
    d.set_item("checkouts", s.checkouts)?;
    d.set_item("waits", s.waits)?;
    d.set_item("wait_seconds", s.wait_ns as f64 / 1e9)?;
    d.set_item("releases", s.releases)?;
    d.set_item("bytes_copied", s.bytes_copied)?;
    d.set_item("copies", s.copies)?;
    d.set_item("segments_mapped", segments.mapped)?;
    d.set_item("segments_unmapped", segments.unmapped)?;
    d.set_item("pending_unmaps", segments.pending)?;
    d.set_item("fence_errors", s.fence_errors)?;
    d.set_item("arena_bytes", s.bytes.arena)?;
    d.set_item("bytes_free", s.bytes.free)?;
    d.set_item("bytes_checked_out", s.bytes.checked_out)?;
    d.set_item("bytes_fenced", s.bytes.fenced)?;
    d.set_item("bytes_preparing", s.bytes.preparing)?;
    d.set_item("largest_free", s.bytes.largest_free)?;
    d.set_item("free_ranges", s.bytes.holes)?;
    Ok(d)
}

/// Logs what a new pool is (on the `pinpool` logger): its notes and the device's, each kind
/// once per process (warnings); its sizes, backend and start-up time (debug). Returns every
/// note, for `pool.notes`.
pub(super) fn log_made(py: Python<'_>, pool: &Pool, chosen: PoolDevice) -> PyResult<Vec<String>> {
    let mut notes = chosen.notes;
    notes.extend_from_slice(pool.arena().notes());
    let logger = py.import("logging")?.call_method1("getLogger", ("pinpool",))?;
    for note in notes.iter().filter(|n| first_time(n)) {
        logger.call_method1("warning", (note.as_str(),))?;
    }
    logger.call_method1(
        "debug",
        (format!(
            "pool of {} bytes, slots of up to {} bytes, {} at once: {} ({}){}; ready in {:.3} s",
            pool.arena().len(),
            pool.largest_slot(),
            pool.num_slots(),
            pool.backend().name(),
            pool.residency().name(),
            match (pool.arena().device(), chosen.reason) {
                (Some(d), Some(reason)) => format!(", device {} ({reason})", d.ordinal()),
                (Some(d), None) => format!(", device {}", d.ordinal()),
                (None, _) => String::new(),
            },
            pool.arena().timings().iter().map(|t| t.1).sum::<f64>()
        ),),
    )?;
    Ok(notes)
}
