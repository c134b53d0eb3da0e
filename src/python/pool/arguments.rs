//! The arguments of `PinPool` that need more than a plain conversion: `device=` (an ordinal,
//! a name or a `torch.device`), `copy_threads`' default, `prefer=` / `prefer_only=`, and a
//! batch's `cuts`.
//!
//! Invariant: a value that cannot be meant is an `InvalidArgument` saying what was expected
//! (a bool or a float is no device); a value of the wrong type keeps Python's `TypeError`.

use pyo3::prelude::*;

use super::super::convert::{size_arg, to_py, IntoPy};
use crate::allocation::slots::Preference;
use crate::error::Error;
use crate::memory::arena::Backend;
use crate::memory::device_choice::DeviceRequest;
use crate::transfer::copy::MAX_COPY_THREADS;

/// A `device=` argument: an ordinal, a name ("cpu", "cuda", "cuda:N"), or a `torch.device`.
#[derive(FromPyObject)]
pub(super) enum DeviceArg<'py> {
    Index(i64),
    Name(String),
    Object(Bound<'py, PyAny>),
}

/// `device=` as given: an int, a string, or an object whose `str()` names a device (a
/// `torch.device`); a bool or a float is none of these.
pub(super) fn device_arg<'py>(value: &Bound<'py, PyAny>) -> PyResult<DeviceArg<'py>> {
    let py = value.py();
    if value.is_instance_of::<pyo3::types::PyBool>()
        || value.is_instance_of::<pyo3::types::PyFloat>()
    {
        return Err(to_py(
            py,
            Error::Invalid(format!(
                "device must be None, 'cpu', 'cuda', 'cuda:N', an int or a torch.device, not {}",
                value.repr()?
            )),
        ));
    }
    if let Ok(i) = value.extract::<i64>() {
        return Ok(DeviceArg::Index(i));
    }
    if let Ok(s) = value.extract::<String>() {
        return Ok(DeviceArg::Name(s));
    }
    Ok(DeviceArg::Object(value.clone()))
}

/// Parses `device=`: "cpu" means no CUDA; `None` and "cuda" (torch's "the current device")
/// the rank's own device, chosen by [`DeviceRequest::resolve`] (`None` only may come to host
/// memory where there is no GPU).
pub(super) fn parse_device(
    py: Python<'_>,
    device: Option<DeviceArg<'_>>,
) -> PyResult<DeviceRequest> {
    let text = match device {
        None => return Ok(DeviceRequest::Automatic),
        Some(DeviceArg::Index(i)) => {
            return usize::try_from(i)
                .map(DeviceRequest::Ordinal)
                .map_err(|_| to_py(py, Error::Invalid(format!("device must be >= 0, got {i}"))))
        }
        Some(DeviceArg::Name(s)) => s,
        Some(DeviceArg::Object(o)) => o.str()?.to_string(),
    };
    let bad = || {
        to_py(
            py,
            Error::Invalid(format!(
                "device must be None, 'cpu', 'cuda', 'cuda:N', an int or a torch.device, not \
                 {text:?}"
            )),
        )
    };
    match text.as_str() {
        "cpu" => Ok(DeviceRequest::Cpu),
        "cuda" => Ok(DeviceRequest::Cuda),
        other => match other.strip_prefix("cuda:") {
            Some(n) => n.parse::<usize>().map(DeviceRequest::Ordinal).map_err(|_| bad()),
            None => Err(bad()),
        },
    }
}

/// `copy_threads` when not given: `$PINPOOL_COPY_THREADS`, else the cores up to 8. A value
/// in the environment that is not a number from 1 to [`MAX_COPY_THREADS`] is an error, not
/// silently replaced.
/// Converts `backend=`: None is `"auto"`; a string names a backend (`Backend::parse` says
/// which); anything else is an `InvalidArgument` naming what was given.
pub(super) fn backend_arg(
    py: Python<'_>,
    backend: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Backend>> {
    let name = match backend {
        None => "auto".to_owned(),
        Some(b) => b.extract::<String>().map_err(|_| {
            to_py(
                py,
                Error::Invalid(format!(
                    "backend must be 'auto', 'cuda-register', 'cuda-hostalloc' or 'host', not {}",
                    b.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
                )),
            )
        })?,
    };
    Backend::parse(&name).py(py)
}

pub(super) fn default_copy_threads() -> Result<usize, Error> {
    match std::env::var("PINPOOL_COPY_THREADS") {
        Ok(text) if !text.trim().is_empty() => text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_COPY_THREADS).contains(n))
            .ok_or_else(|| {
                Error::Invalid(format!(
                "PINPOOL_COPY_THREADS must be a number from 1 to {MAX_COPY_THREADS}, not {text:?}"
            ))
            }),
        // Under torchrun (or Lightning, accelerate), LOCAL_WORLD_SIZE ranks share the cores.
        _ => {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            let ranks = std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&n| n > 0)
                .unwrap_or(1);
            Ok((cores / ranks).clamp(1, 8))
        }
    }
}

/// The most offsets a `prefer=` argument may hold: each costs a look at the free list, under
/// the slot table's lock.
pub(super) const MAX_PREFERRED: usize = 64;

/// Converts a `prefer=` argument: None, or an iterable of at most [`MAX_PREFERRED`]
/// non-negative ints (arena offsets). A negative or huge int, or too many, is an
/// `InvalidArgument`; anything that is not an int (or not iterable) keeps Python's
/// `TypeError`.
pub(super) fn preferred_offsets(
    py: Python<'_>,
    prefer: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<usize>> {
    let Some(prefer) = prefer.filter(|p| !p.is_none()) else { return Ok(Vec::new()) };
    let too_many = || format!("prefer holds more than {MAX_PREFERRED} offsets");
    sizes_arg(py, prefer, MAX_PREFERRED, too_many, "each offset in prefer")
}

/// The Python flag `prefer_only` as the core's [`Preference`].
pub(super) fn preference(prefer_only: bool) -> Preference {
    if prefer_only {
        Preference::OnlyThere
    } else {
        Preference::Prefer
    }
}

/// The most cuts a batch claimed in pieces may have (a leaf each, and its end).
pub(super) const MAX_CUTS: usize = 1 << 16;

/// A batch's `cuts` (`PinPool.claim_split`): non-negative ints, at most [`MAX_CUTS`] of them
/// (their order is checked by the core).
pub(super) fn cuts_arg(py: Python<'_>, cuts: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let too_many = || format!("a batch has more than {MAX_CUTS} cuts");
    sizes_arg(py, cuts, MAX_CUTS, too_many, "each cut")
}

/// An iterable of at most `most` non-negative ints, each converted as `size_arg` does (named
/// `each`); more than `most` is an `InvalidArgument` saying `too_many()`.
fn sizes_arg(
    py: Python<'_>,
    items: &Bound<'_, PyAny>,
    most: usize,
    too_many: impl Fn() -> String,
    each: &str,
) -> PyResult<Vec<usize>> {
    let mut out = Vec::new();
    for item in items.try_iter()? {
        if out.len() == most {
            return Err(to_py(py, Error::Invalid(too_many())));
        }
        out.push(size_arg(py, &item?, each)?);
    }
    Ok(out)
}
