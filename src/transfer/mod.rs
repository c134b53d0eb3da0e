//! Transfer: moving bytes, and knowing when the GPU is done with them.
//!
//! - [`copy`]: multi-threaded copies of checked byte ranges, on threads of pinpool's own;
//! - [`fence`]: what keeps a released slot out of circulation until the GPU work that reads
//!   it has finished.
//!
//! Invariant: this layer uses only [`crate::system`], [`crate::memory`] and
//! [`crate::allocation`] (and [`crate::error`]). It decides nothing about what is safe to
//! copy: callers check every range first.

pub mod copy;
pub mod fence;
