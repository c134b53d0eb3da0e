//! The one error type of the Rust core.
//!
//! Invariants: every fallible operation of the core returns [`Error`]; nothing in the core
//! panics on bad input or on a failed system or driver call. The PyO3 layer maps each variant
//! onto one Python exception class (`pinpool.PoolExhausted`, `pinpool.SlotReleased`, ...).

use std::fmt;

/// Everything that can go wrong in pinpool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// No room for a slot of `wanted` bytes came before the timeout; what held the arena then.
    Exhausted { waited_ms: u64, wanted: usize, held: Held },
    /// The slot was already released (or the checkout it names is stale).
    SlotReleased { index: usize },
    /// A batch needs more bytes than one slot holds.
    BatchTooLarge { needed: usize, slot_bytes: usize },
    /// A CUDA driver call failed; `name` and `code` are the driver's own (`CUDA_ERROR_...`,
    /// its `CUresult`).
    Cuda { call: &'static str, name: String, code: u32 },
    /// The CUDA driver library could not be loaded: no driver call was made, so there is no
    /// driver error; `reason` is the dynamic loader's message.
    NoDriver { library: &'static str, reason: String },
    /// A byte range falls outside the memory it names.
    OutOfRange { what: &'static str, offset: usize, len: usize, size: usize },
    /// The pool was closed.
    Closed,
    /// An operating-system call failed.
    Os { call: &'static str, errno: i32 },
    /// An argument makes no sense (zero sizes, unknown backend, ...).
    Invalid(String),
    /// Memory of `wanted` bytes was asked for where `available` are (`what`: for what).
    NotEnoughMemory { what: String, wanted: usize, available: usize },
}

/// What holds an arena at one moment (for [`Error::Exhausted`]'s message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    /// Slots checked out, and their bytes.
    pub checked_out: usize,
    pub checked_out_bytes: usize,
    /// Slots released but waiting for their fence, and their bytes.
    pub fenced: usize,
    pub fenced_bytes: usize,
    /// The longest free range, and the arena's length.
    pub largest_free: usize,
    pub arena: usize,
    /// Slots the table can hold at once.
    pub entries: usize,
}

impl Error {
    /// A failed system call's error (from `rustix`), wrapped.
    pub fn os(call: &'static str, errno: rustix::io::Errno) -> Self {
        Error::Os { call, errno: errno.raw_os_error() }
    }

    /// The `errno` of the last failed libc call, wrapped.
    pub fn last_os(call: &'static str) -> Self {
        Error::Os { call, errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0) }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Exhausted { waited_ms, wanted, held: h } => write!(
                f,
                "no room for a slot of {wanted} bytes after {waited_ms} ms: {} slots checked \
                 out ({} bytes), {} fenced ({} bytes); the longest free range is {} bytes of \
                 the arena's {} ({} slots at most)",
                h.checked_out,
                h.checked_out_bytes,
                h.fenced,
                h.fenced_bytes,
                h.largest_free,
                h.arena,
                h.entries
            ),
            Error::SlotReleased { index } => {
                write!(f, "slot {index} was already released; this handle can no longer be used")
            }
            Error::BatchTooLarge { needed, slot_bytes } => write!(
                f,
                "batch needs {needed} bytes but a slot holds {slot_bytes} bytes; \
                 build the pool with larger slots"
            ),
            Error::Cuda { call, name, code } => write!(f, "{call} failed: {name} ({code})"),
            Error::NoDriver { library, reason } => {
                write!(f, "{library} could not be loaded: {reason}")
            }
            Error::OutOfRange { what, offset, len, size } => write!(
                f,
                "{what}: range [{offset}, {offset}+{len}) lies outside the {size} bytes available"
            ),
            Error::Closed => write!(f, "the pool is closed"),
            Error::Os { call, errno } => {
                write!(f, "{call} failed: {}", std::io::Error::from_raw_os_error(*errno))
            }
            Error::Invalid(msg) => f.write_str(msg),
            Error::NotEnoughMemory { what, wanted, available } => write!(
                f,
                "{what}: {wanted} bytes ({:.2} GiB) asked for, but {available} bytes ({:.2} GiB) \
                 of memory are available",
                *wanted as f64 / f64::from(1 << 30),
                *available as f64 / f64::from(1 << 30)
            ),
        }
    }
}

impl std::error::Error for Error {}

/// The text of a caught panic (`catch_unwind`'s payload).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic")
}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, Error>;
