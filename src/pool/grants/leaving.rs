//! How a grant leaves the table: adopted by the batch that names it, given back by a worker
//! whose batch will not arrive in it, or released when its owner closes (or the table drops).
//!
//! Invariants:
//! - A grant leaves the table once: adopted, given back or released, whichever comes first.
//! - A slot granted and not adopted is released unfenced (no device work was queued on it),
//!   and never in a process forked from the table's owner.

use std::sync::Arc;

use super::{Grants, Issued};
use crate::allocation::slots::SlotId;
use crate::pool::Pool;

impl Grants {
    /// The slot granted as (`index`, `generation`) with `nonce`, which leaves the table: its
    /// pool and slot. None if no such grant is out (never made, adopted already, given
    /// back, or another nonce).
    pub fn adopt(&self, index: u32, generation: u32, nonce: u64) -> Option<(Arc<Pool>, SlotId)> {
        let issued = self.take(index, generation, nonce)?;
        let mut table = self.table();
        if table.owners.get(&issued.owner).is_some_and(|o| issued.task >= o.head) {
            // (not yielded yet: room the batches behind it may wait for)
            let entry = (issued.owner, issued.task, issued.slot);
            table.unyielded.insert((index, generation), entry);
        }
        drop(table);
        self.changed();
        Some((issued.pool, issued.slot))
    }

    fn take(&self, index: u32, generation: u32, nonce: u64) -> Option<Issued> {
        let mut table = self.table();
        match table.issued.get(&(index, generation)) {
            Some(issued) if issued.nonce == nonce => {}
            _ => return None,
        }
        table.issued.remove(&(index, generation))
    }

    /// Releases the slot granted as (`index`, `generation`) with `nonce`, whose batch will not
    /// arrive in it; returns whether there was one.
    pub fn give_back(&self, index: u32, generation: u32, nonce: u64) -> bool {
        match self.take(index, generation, nonce) {
            Some(issued) => {
                self.release(&issued.pool, issued.slot);
                self.changed();
                true
            }
            None => false,
        }
    }

    /// Closes `owner` (every owner with None): no more grants for it; releases the slots
    /// granted to it and not adopted, once no worker that got them can write any more.
    pub fn close(&self, owner: Option<u64>) {
        let gone: Vec<Issued> = {
            let mut table = self.table();
            table.owners.retain(|&o, _| owner.is_some_and(|w| w != o));
            table.unyielded.retain(|_, u| owner.is_some_and(|w| w != u.0));
            let keys: Vec<(u32, u32)> = table
                .issued
                .iter()
                .filter(|(_, v)| owner.is_none_or(|w| w == v.owner))
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| table.issued.remove(k)).collect()
        };
        for issued in gone {
            self.release(&issued.pool, issued.slot);
        }
        self.changed();
    }

    fn release(&self, pool: &Pool, slot: SlotId) {
        if !self.forked() {
            let _ = pool.release(slot, None); // (unfenced: see the module's doc)
        }
    }
}

impl Drop for Grants {
    fn drop(&mut self) {
        if self.forked() {
            // A forked copy: the slots are the parent's to give back.
            std::mem::forget(std::mem::take(
                &mut self.table.get_mut().unwrap_or_else(|e| e.into_inner()).issued,
            ));
            return;
        }
        self.close(None);
    }
}
