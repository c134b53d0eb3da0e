//! Which CUDA device a pool binds to when the caller names none: the rank's own.
//!
//! Under torchrun each rank drives its own GPU, so `PinPool(...)` without `device=` must not
//! mean device 0 on every rank. The automatic choice, first that applies:
//!
//! 1. the device of the CUDA context current on the calling thread (`torch.cuda.set_device(n)`
//!    makes device n's primary context current there);
//! 2. `$LOCAL_RANK` modulo the number of devices (torchrun, Lightning and accelerate set it);
//! 3. device 0, if there is one;
//! 4. no CUDA: host memory, with a note saying why (`device=None` only: see below).
//!
//! Invariants:
//! - [`choose`] is a pure function of what it is given (the current context's device, the text
//!   of `$LOCAL_RANK`, the device count); [`DeviceRequest::resolve`] only gathers those from
//!   the driver and the environment, and binds no context on the calling thread.
//! - A request for no CUDA ([`DeviceRequest::Cpu`], or the `host` backend) never touches the
//!   driver.
//! - Only `device=None` with `backend="auto"` falls back to host memory where CUDA cannot be
//!   used, with a note saying why. CUDA asked for by name (`device="cuda"`, an ordinal,
//!   `"cuda:N"`, a CUDA backend) is an [`Error::Invalid`] there, naming what was asked for,
//!   why CUDA cannot be used (the driver's own error, or the loader's message when the
//!   driver cannot be loaded) and how to get host memory instead: as `pinpool.DataLoader`
//!   refuses `device="cuda"` where torch sees no GPU.
//! - A `$LOCAL_RANK` that is set but is not a rank is an error, not silently device 0: every
//!   rank would then share one GPU.

use crate::error::{Error, Result};
use crate::memory::arena::Backend;
use crate::system::cuda;

/// What `device=` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// No CUDA: host memory (`device="cpu"`).
    Cpu,
    /// This device ordinal (`device=n`, `"cuda:n"`), which must exist.
    Ordinal(usize),
    /// The rank's device, see the module's note, which must exist (`device="cuda"`).
    Cuda,
    /// The rank's device, see the module's note, or host memory where there is none
    /// (`device=None`).
    Automatic,
}

/// Why [`choose`] picked the device it picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChoiceReason {
    /// The device of the CUDA context current on the calling thread.
    CurrentContext,
    /// `$LOCAL_RANK` (this value) modulo the number of devices.
    LocalRank(usize),
    /// The first device: no context current and no `$LOCAL_RANK`.
    FirstDevice,
}

impl std::fmt::Display for ChoiceReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChoiceReason::CurrentContext => f.write_str("the CUDA context current on this thread"),
            ChoiceReason::LocalRank(rank) => write!(f, "LOCAL_RANK={rank} modulo the device count"),
            ChoiceReason::FirstDevice => {
                f.write_str("the first device: no current context, no LOCAL_RANK")
            }
        }
    }
}

/// A device picked automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChosenDevice {
    /// The device ordinal.
    pub ordinal: usize,
    /// Why this one.
    pub reason: ChoiceReason,
}

/// The automatic choice: `current` is the device of the context current on the calling thread,
/// `local_rank` the text of `$LOCAL_RANK` (None when unset), `count` the number of devices.
/// `Ok(None)` when there is no device. A blank `local_rank` counts as unset; one that is not
/// a whole number from 0 is an error.
pub fn choose(
    current: Option<usize>,
    local_rank: Option<&str>,
    count: usize,
) -> Result<Option<ChosenDevice>> {
    if count == 0 {
        return Ok(None);
    }
    if let Some(ordinal) = current.filter(|&d| d < count) {
        return Ok(Some(ChosenDevice { ordinal, reason: ChoiceReason::CurrentContext }));
    }
    match local_rank.map(str::trim).filter(|text| !text.is_empty()) {
        Some(text) => {
            let rank: usize = text.parse().map_err(|_| {
                Error::Invalid(format!(
                    "LOCAL_RANK={text:?} is not a rank (a whole number from 0), so the pool \
                     cannot tell which GPU is this process's: fix LOCAL_RANK, or pass device= \
                     to PinPool"
                ))
            })?;
            Ok(Some(ChosenDevice { ordinal: rank % count, reason: ChoiceReason::LocalRank(rank) }))
        }
        None => Ok(Some(ChosenDevice { ordinal: 0, reason: ChoiceReason::FirstDevice })),
    }
}

/// What a request came to: the device to build the pool's arena on (None: no CUDA), and what
/// to tell the user about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolDevice {
    /// The device ordinal, or None for no CUDA.
    pub ordinal: Option<usize>,
    /// Why the pool has no CUDA although it could have had (for `pool.notes`).
    pub notes: Vec<String>,
    /// How an automatic choice was made (for the log), if one was.
    pub reason: Option<ChoiceReason>,
}

impl DeviceRequest {
    /// Turns the request into a device, asking the driver and `$LOCAL_RANK` for an automatic
    /// one (see the module's note). `backend` is the backend asked for (None: `auto`).
    pub fn resolve(self, backend: Option<Backend>) -> Result<PoolDevice> {
        let as_asked = |ordinal| PoolDevice { ordinal, notes: Vec::new(), reason: None };
        let host = |note: String| PoolDevice { ordinal: None, notes: vec![note], reason: None };
        // What was asked for by name, if CUDA was, and how to get host memory instead.
        let named = match (self, backend) {
            (DeviceRequest::Cpu, _) | (_, Some(Backend::Host)) => return Ok(as_asked(None)),
            // (The arena checks that the device exists: `cuda::require_device`.)
            (DeviceRequest::Ordinal(n), _) => return Ok(as_asked(Some(n))),
            (DeviceRequest::Cuda, _) => {
                Some(("device=\"cuda\"".to_owned(), cuda::HOST_MEMORY_HINT.to_owned()))
            }
            (DeviceRequest::Automatic, Some(b)) => Some((
                format!("backend={:?}", b.name()),
                "backend=\"auto\" (the default) uses host memory where there is no GPU".to_owned(),
            )),
            (DeviceRequest::Automatic, None) => None,
        };
        let count = match (cuda::device_count(), &named) {
            (Ok(n), _) => n,
            (Err(e), Some((what, hint))) => {
                return Err(Error::Invalid(format!(
                    "{what} was asked for, but CUDA cannot be used here ({e}): {hint}"
                )))
            }
            (Err(e), None) => {
                return Ok(host(format!("CUDA unavailable ({e}): using host memory (not pinned)")))
            }
        };
        let local_rank = std::env::var("LOCAL_RANK").ok();
        match (choose(cuda::current_context_device(), local_rank.as_deref(), count)?, named) {
            (Some(c), _) => Ok(PoolDevice {
                ordinal: Some(c.ordinal),
                notes: Vec::new(),
                reason: Some(c.reason),
            }),
            (None, Some((what, hint))) => Err(Error::Invalid(format!(
                "{what} was asked for, but the driver reports no CUDA device: {hint}"
            ))),
            (None, None) => Ok(host("no CUDA device found: using host memory (not pinned)".into())),
        }
    }
}

#[cfg(test)]
mod tests;
