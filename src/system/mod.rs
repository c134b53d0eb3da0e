//! The machine and the process: what pinpool asks of the hardware, the kernel and the CUDA
//! driver, and the process-wide facts it relies on.
//!
//! - [`cuda`]: the few driver calls we need, loaded at run time, never panicking;
//! - [`pkeys`]: memory protection keys, a thread's own switch for its access to a mapping;
//! - [`priority`]: pinpool's background threads give way to the training thread;
//! - [`random`]: random numbers from the kernel, for nonces and names;
//! - [`forks`]: whether this is still the process that made something, without a system call
//!   (whether a fork happened; what a child sees of shared memory is
//!   [`crate::memory::forked_child`]'s);
//! - [`handoff`]: a job handed to another thread and waited for, taken back if not begun in
//!   time.
//!
//! Invariant: this layer uses nothing of pinpool's but [`crate::error`]; every other layer may
//! use it.

pub mod cuda;
pub mod forks;
pub mod handoff;
pub mod pkeys;
pub mod priority;
pub mod random;
