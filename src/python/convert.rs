//! Converting between Python and the core: a panic into `pinpool.PinPoolError`, a core
//! error into its Python exception, and the arguments every class takes (timeouts, sizes,
//! flags).
//!
//! Invariants:
//! - [`guarded`] turns every panic below an entry point into `pinpool.PinPoolError`, never
//!   `PanicException`.
//! - A value of the right type but out of range is an `InvalidArgument` naming the argument;
//!   a value of the wrong type an `ArgumentTypeError` (an `InvalidArgument` and a
//!   `TypeError`), never PyO3's `OverflowError`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use pyo3::prelude::*;

use crate::error::Error;

/// Runs `f`, turning a panic into `pinpool.PinPoolError`.
pub(crate) fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let msg = crate::error::panic_message(&*panic);
            Python::attach(|py| {
                Err(to_py(py, Error::Invalid(format!("internal error in pinpool: {msg}"))))
            })
        }
    }
}

// The exception classes are defined once, in Python (`pinpool/_errors.py`, where they also
// derive from the built-in exceptions users catch: `TimeoutError`, `ValueError`); these import
// them, by type, when first raised.
pyo3::import_exception!(pinpool._errors, PinPoolError);
pyo3::import_exception!(pinpool._errors, PoolExhausted);
pyo3::import_exception!(pinpool._errors, PoolClosed);
pyo3::import_exception!(pinpool._errors, SlotReleased);
pyo3::import_exception!(pinpool._errors, BatchTooLarge);
pyo3::import_exception!(pinpool._errors, CudaError);
pyo3::import_exception!(pinpool._errors, InvalidArgument);
pyo3::import_exception!(pinpool._errors, ArgumentTypeError);
pyo3::import_exception!(pinpool._errors, OutOfBounds);
pyo3::import_exception!(pinpool._errors, NotEnoughMemory);

/// Builds the Python exception for a core error.
pub(crate) fn to_py(_py: Python<'_>, err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Exhausted { .. } => PoolExhausted::new_err(msg),
        Error::SlotReleased { .. } => SlotReleased::new_err(msg),
        Error::BatchTooLarge { needed, slot_bytes } => {
            BatchTooLarge::new_err((msg, needed, slot_bytes))
        }
        Error::Cuda { name, code, .. } => CudaError::new_err((msg, name, code)),
        // (Not a CudaError: no driver call was made, there is no driver name or code.)
        Error::NoDriver { .. } => PinPoolError::new_err(msg),
        Error::OutOfRange { .. } => OutOfBounds::new_err(msg),
        Error::Closed => PoolClosed::new_err(msg),
        Error::Os { .. } => PinPoolError::new_err(msg),
        Error::Invalid(_) => InvalidArgument::new_err(msg),
        Error::NotEnoughMemory { .. } => NotEnoughMemory::new_err(msg),
    }
}

/// Extension trait: `result.py(py)?` converts a core error.
pub(crate) trait IntoPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// Timeouts from this long on mean "no limit": no wait can tell them apart, and a deadline
/// this far out could not be computed (`Instant + Duration` overflows long before
/// `Duration` does).
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Converts a `timeout=` argument in seconds: None (no limit) or a finite non-negative
/// number; one of [`FOREVER`] or more is no limit too.
pub(crate) fn timeout_arg(py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        Some(t) if !(t >= 0.0 && t.is_finite()) => Err(to_py(
            py,
            Error::Invalid(format!("timeout must be a non-negative number, got {t}")),
        )),
        Some(t) => Ok(Duration::try_from_secs_f64(t).ok().filter(|d| *d < FOREVER)),
        None => Ok(None),
    }
}

/// Converts a size or count argument `name`: a non-negative int that fits a `usize`. A
/// negative or huge int is an `InvalidArgument` naming the argument (not PyO3's
/// `OverflowError`); anything else an `ArgumentTypeError` (an `InvalidArgument` and a
/// `TypeError`) naming it.
pub(crate) fn size_arg(py: Python<'_>, value: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let int = value.is_instance_of::<pyo3::types::PyInt>()
        && !value.is_instance_of::<pyo3::types::PyBool>();
    match value.extract::<usize>() {
        Ok(n) if int => Ok(n),
        _ if int => Err(to_py(
            py,
            Error::Invalid(format!(
                "{name} must be a non-negative integer of at most {}, got {value}",
                usize::MAX
            )),
        )),
        _ => Err(ArgumentTypeError::new_err(format!(
            "{name} must be a non-negative integer, not {} ({})",
            value.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()),
            value.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
        ))),
    }
}

/// `value` as a bool, or an `ArgumentTypeError` naming `name` (a string, say `"yes"`, is not
/// one).
pub(crate) fn bool_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    match value.cast::<pyo3::types::PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => Err(ArgumentTypeError::new_err(format!(
            "{name} must be True or False, not {}",
            value.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
        ))),
    }
}
