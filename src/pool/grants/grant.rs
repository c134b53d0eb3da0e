//! One grant: the slot granted, the nonce its batch must name, where it lies and where the
//! worker's next slots will likely be; and the words it travels as: [`GRANT_WORDS`]
//! little-endian `u64`s, then [`LIKELY_WORDS`] for each likely slot (the layout: the module doc of
//! [`super`]).
//!
//! Invariant: the words of a grant are exactly what `python/pinpool/` decodes; a change here is
//! a change of the wire between the main process and its workers.

use crate::allocation::slots::SlotId;
use crate::pool::SlotLocation;

/// Words of a grant before its likely slots.
pub const GRANT_WORDS: usize = 11;
/// Words of one likely slot.
pub const LIKELY_WORDS: usize = 5;

/// A slot granted to a worker, and where its next slots will likely be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The slot.
    pub slot: SlotId,
    /// The nonce its batch's handle must name.
    pub nonce: u64,
    /// Where it lies in shared memory.
    pub location: SlotLocation,
    /// Extents the worker may pre-map (its first big grant only).
    pub likely: Vec<SlotLocation>,
}

impl Grant {
    /// The grant as the words a worker reads (see the module's doc).
    pub fn words(&self) -> Vec<u64> {
        let p = &self.location;
        let mut out = vec![
            1,
            u64::from(self.slot.index),
            u64::from(self.slot.generation),
            self.nonce,
            p.offset as u64,
            p.nbytes as u64,
            u64::from(std::process::id()),
            p.fd as u64,
            p.part_len as u64,
            p.inode,
            self.likely.len() as u64,
        ];
        for h in &self.likely {
            out.extend([h.offset as u64, h.nbytes as u64, h.fd as u64, h.part_len as u64, h.inode]);
        }
        out
    }
}
