//! Zero-copy tickets issued off the training thread: a slot checked out for a batch as its
//! indices are written to the worker's pipe, by the thread that writes them
//! ([`crate::transport::pipe_writer`]), with no Python lock held.
//!
//! In zero-copy mode each batch's indices travel with the place of a slot the worker writes the
//! batch into. Checking that slot out where torch puts the indices (the training thread, under
//! the GIL) costs that thread a checkout, a table entry and a larger message for every batch;
//! for small batches that was more than the copy it saves (`docs/performance.md`). Here the
//! message is pickled with a placeholder ([`Tickets::marker`] and zeros, [`TICKET_LEN`] bytes),
//! and the pipe's thread checks the slot out and writes the ticket over the placeholder
//! ([`Tickets::patch`]) just before the message goes.
//!
//! A ticket is [`TICKET_LEN`] bytes, ten little-endian `u64`s: `1` (issued; `0`: none, send the
//! batch through copy mode), the slot's table index, its generation, a random nonce (below
//! 2^63), the slot's offset in its memfd, its length, this process's id, the memfd's
//! descriptor, the memfd's length and its inode number.
//!
//! Invariants:
//! - An issued slot is in the table from its checkout until it is adopted (by the batch that
//!   names its index, generation and nonce: once), taken back, or dropped with its owner's
//!   tickets; it stays checked out meanwhile, so the pool cannot hand it out again.
//! - A slot leaves the table un-adopted only through [`Tickets::take_back`],
//!   [`Tickets::drop_owner`] or the table's end, which the caller reaches only once no worker
//!   that got it can write any more; it is then released unfenced (no device work was queued
//!   on it: only an adopted slot reaches the device).
//! - Per (owner, worker) the table remembers the offsets of that worker's last slots (as many
//!   as it keeps windows over), latest first, and offers them first: memory the worker has
//!   mapped already. A checkout never waits.
//! - In a process forked from the table's owner nothing is issued or released.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::slots::Checkout;

/// The length of a ticket and of the placeholder it replaces, bytes.
pub const TICKET_LEN: usize = 80;
/// The length of the random marker that starts a placeholder, bytes.
pub const MARKER_LEN: usize = 16;

/// What one message's ticket is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TicketRequest {
    /// The iterator (sampler) the batch belongs to: its end drops its tickets.
    pub owner: u64,
    /// The worker that gets the indices (its place in torch's list of index queues).
    pub worker: usize,
    /// The slot's size.
    pub nbytes: usize,
    /// Bytes to leave free in one range for batches that come through copy mode.
    pub keep: usize,
}

#[derive(Debug)]
struct Issued {
    pool: Arc<Pool>,
    checkout: Checkout,
    nonce: u64,
    owner: u64,
}

#[derive(Debug, Default)]
struct Table {
    issued: HashMap<(u32, u32), Issued>,
    recent: HashMap<(u64, usize), Vec<usize>>,
}

/// The tickets of one pool: see the module's doc.
#[derive(Debug)]
pub struct Tickets {
    pool: Weak<Pool>,
    marker: [u8; MARKER_LEN],
    windows: usize,
    window_bytes: usize,
    table: Mutex<Table>,
    fallbacks: AtomicU64,
    owner_pid: u32,
}

impl Tickets {
    /// A table for `pool`'s slots. A worker keeps `windows` windows at most, and
    /// `window_bytes` bytes of them (`handle.windows_kept` on the Python side).
    pub fn new(pool: &Arc<Pool>, windows: usize, window_bytes: usize) -> Result<Self> {
        let mut marker = [0u8; MARKER_LEN];
        fill_random(&mut marker)?;
        Ok(Tickets {
            pool: Arc::downgrade(pool),
            marker,
            windows: windows.max(1),
            window_bytes,
            table: Mutex::new(Table::default()),
            fallbacks: AtomicU64::new(0),
            owner_pid: std::process::id(),
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forked(&self) -> bool {
        std::process::id() != self.owner_pid
    }

    /// The bytes a placeholder starts with (random, this table's own).
    pub fn marker(&self) -> [u8; MARKER_LEN] {
        self.marker
    }

    /// A placeholder: the marker, then zeros, [`TICKET_LEN`] bytes in all.
    pub fn placeholder(&self) -> [u8; TICKET_LEN] {
        let mut out = [0u8; TICKET_LEN];
        out[..MARKER_LEN].copy_from_slice(&self.marker);
        out
    }

    /// How many windows over slots of `nbytes` a worker keeps (at least one).
    fn kept(&self, nbytes: usize) -> usize {
        (self.window_bytes / nbytes.max(1)).clamp(1, self.windows)
    }

    /// Checks a slot out for `request` (preferably where that worker's last slots were) and
    /// returns its ticket; a ticket of zeros (counted in [`Tickets::fallbacks`]) when there is
    /// no room, the pool is gone or closed, or its memory is no memfd.
    pub fn issue(&self, request: &TicketRequest) -> [u8; TICKET_LEN] {
        match self.try_issue(request) {
            Some(ticket) => ticket,
            None => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                [0u8; TICKET_LEN]
            }
        }
    }

    fn try_issue(&self, request: &TicketRequest) -> Option<[u8; TICKET_LEN]> {
        if self.forked() || request.nbytes == 0 {
            return None;
        }
        let pool = self.pool.upgrade()?;
        let key = (request.owner, request.worker);
        let prefer = self.table().recent.get(&key).cloned().unwrap_or_default();
        let checkout = pool
            .try_checkout_bytes_preferring(request.nbytes, request.keep, &prefer, false)
            .ok()??;
        let Some(fields) = pool.slot_place(checkout) else {
            let _ = pool.release(checkout, None);
            return None;
        };
        let mut nonce = [0u8; 8];
        if fill_random(&mut nonce).is_err() {
            let _ = pool.release(checkout, None);
            return None;
        }
        let nonce = u64::from_le_bytes(nonce) >> 1;
        let (at, kept) = (fields.arena_offset, self.kept(fields.nbytes));
        {
            let mut table = self.table();
            let recent = table.recent.entry(key).or_default();
            recent.retain(|&o| o != at);
            recent.insert(0, at);
            recent.truncate(kept);
            let issued = Issued { pool: Arc::clone(&pool), checkout, nonce, owner: request.owner };
            table.issued.insert((checkout.index, checkout.generation), issued);
        }
        let words = [
            1,
            u64::from(checkout.index),
            u64::from(checkout.generation),
            nonce,
            fields.offset as u64,
            fields.nbytes as u64,
            u64::from(std::process::id()),
            fields.fd as u64,
            fields.part_len as u64,
            fields.inode,
        ];
        let mut out = [0u8; TICKET_LEN];
        for (chunk, word) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        Some(out)
    }

    /// Writes a ticket for `request` over the first placeholder in `message` (a pickled
    /// message); returns whether there was one. A message without one is left as it is and
    /// no slot is checked out for it.
    pub fn patch(&self, message: &mut [u8], request: &TicketRequest) -> bool {
        let Some(at) = find(message, &self.marker) else { return false };
        if message.len() - at < TICKET_LEN {
            return false;
        }
        let ticket = self.issue(request);
        message[at..at + TICKET_LEN].copy_from_slice(&ticket);
        true
    }

    /// The slot issued as (`index`, `generation`) with `nonce`, which leaves the table: its
    /// pool and checkout. None if no such ticket is out (never issued, adopted already, taken
    /// back, or another nonce).
    pub fn adopt(&self, index: u32, generation: u32, nonce: u64) -> Option<(Arc<Pool>, Checkout)> {
        let mut table = self.table();
        match table.issued.get(&(index, generation)) {
            Some(issued) if issued.nonce == nonce => {}
            _ => return None,
        }
        let issued = table.issued.remove(&(index, generation))?;
        Some((issued.pool, issued.checkout))
    }

    /// Releases the slot issued as (`index`, `generation`) with `nonce`, whose batch will not
    /// arrive in it; returns whether there was one.
    pub fn take_back(&self, index: u32, generation: u32, nonce: u64) -> bool {
        match self.adopt(index, generation, nonce) {
            Some((pool, checkout)) => {
                self.release(&pool, checkout);
                true
            }
            None => false,
        }
    }

    /// Releases the slots issued for `owner` (every one with None) and forgets its workers'
    /// last slots; once no worker that got them can write any more.
    pub fn drop_owner(&self, owner: Option<u64>) {
        let gone: Vec<Issued> = {
            let mut table = self.table();
            table.recent.retain(|&(o, _), _| owner.is_some_and(|w| w != o));
            let keys: Vec<(u32, u32)> = table
                .issued
                .iter()
                .filter(|(_, v)| owner.is_none_or(|w| w == v.owner))
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| table.issued.remove(k)).collect()
        };
        for issued in gone {
            self.release(&issued.pool, issued.checkout);
        }
    }

    fn release(&self, pool: &Pool, checkout: Checkout) {
        if !self.forked() {
            let _ = pool.release(checkout, None); // (unfenced: see the module's doc)
        }
    }

    /// Tickets that could not be issued (sent as zeros).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    /// Tickets issued and not yet adopted, taken back or dropped.
    pub fn outstanding(&self) -> usize {
        self.table().issued.len()
    }
}

impl Drop for Tickets {
    fn drop(&mut self) {
        if self.forked() {
            // A forked copy: the slots are the parent's to give back.
            std::mem::forget(std::mem::take(
                &mut self.table.get_mut().unwrap_or_else(|e| e.into_inner()).issued,
            ));
            return;
        }
        self.drop_owner(None);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn fill_random(out: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < out.len() {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::os("getrandom", e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use std::os::fd::AsRawFd;

    const SLOT: usize = 64 << 10;

    fn words(ticket: &[u8]) -> Vec<u64> {
        ticket.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn request(worker: usize) -> TicketRequest {
        TicketRequest { owner: 7, worker, nbytes: SLOT, keep: 0 }
    }

    fn pool(slots: usize) -> Arc<Pool> {
        Pool::new(&PoolConfig::host(SLOT, slots)).unwrap()
    }

    #[test]
    fn a_ticket_names_its_slot_and_is_adopted_once() {
        let pool = pool(4);
        let tickets = Tickets::new(&pool, 16, 1 << 30).unwrap();
        let t = words(&tickets.issue(&request(0)));
        assert_eq!(t[0], 1);
        assert!(t[3] < 1 << 63);
        assert_eq!(t[5], SLOT as u64);
        assert_eq!(t[6], u64::from(std::process::id()));
        let (fd, _, len) = pool.arena().part_at(0).unwrap();
        assert_eq!((t[7], t[8]), (fd.as_raw_fd() as u64, len as u64));
        assert_eq!(t[9], pool.arena().part_inode_at(0).unwrap());
        assert_eq!(tickets.outstanding(), 1);
        assert_eq!(pool.free_slots(), 3);
        let (index, generation) = (t[1] as u32, t[2] as u32);
        assert!(tickets.adopt(index, generation, t[3] ^ 1).is_none(), "another nonce");
        let (p, checkout) = tickets.adopt(index, generation, t[3]).unwrap();
        assert!(Arc::ptr_eq(&p, &pool));
        assert!(tickets.adopt(index, generation, t[3]).is_none(), "adopted once");
        assert_eq!(pool.extent(checkout).unwrap().1, SLOT);
        pool.release(checkout, None).unwrap();
        assert_eq!(pool.free_slots(), 4);
    }

    #[test]
    fn a_worker_gets_its_last_slots_again_first() {
        let pool = pool(8);
        let tickets = Tickets::new(&pool, 16, 1 << 30).unwrap();
        let first: Vec<Vec<u64>> = (0..3).map(|_| words(&tickets.issue(&request(1)))).collect();
        let other = words(&tickets.issue(&request(2)));
        // All back (not adopted): the next ones for worker 1 are its own, latest first.
        for t in first.iter().chain([&other]) {
            assert!(tickets.take_back(t[1] as u32, t[2] as u32, t[3]));
        }
        assert_eq!(pool.free_slots(), 8);
        let again = words(&tickets.issue(&request(1)));
        assert_eq!(again[4], first[2][4]);
        let next = words(&tickets.issue(&request(1)));
        assert_eq!(next[4], first[1][4]);
        let theirs = words(&tickets.issue(&request(2)));
        assert_eq!(theirs[4], other[4]);
    }

    #[test]
    fn no_room_gives_a_ticket_of_zeros_and_counts_it() {
        let pool = pool(1);
        let tickets = Tickets::new(&pool, 16, 1 << 30).unwrap();
        assert_eq!(words(&tickets.issue(&request(0)))[0], 1);
        assert_eq!(tickets.issue(&request(0)), [0u8; TICKET_LEN]);
        assert_eq!(tickets.fallbacks(), 1);
        let keep = TicketRequest { keep: SLOT, ..request(0) };
        tickets.drop_owner(None);
        assert_eq!(tickets.issue(&keep), [0u8; TICKET_LEN], "the kept room is honoured");
        pool.close();
        assert_eq!(tickets.issue(&request(0)), [0u8; TICKET_LEN]);
        assert_eq!(tickets.fallbacks(), 3);
    }

    #[test]
    fn a_placeholder_is_patched_in_place_and_nothing_else_is() {
        let pool = pool(2);
        let tickets = Tickets::new(&pool, 16, 1 << 30).unwrap();
        let mut message = b"head".to_vec();
        message.extend_from_slice(&tickets.placeholder());
        message.extend_from_slice(b"tail");
        assert!(tickets.patch(&mut message, &request(0)));
        assert_eq!(&message[..4], b"head");
        assert_eq!(&message[4 + TICKET_LEN..], b"tail");
        assert_eq!(words(&message[4..4 + TICKET_LEN])[0], 1);
        let mut plain = b"no placeholder here".to_vec();
        assert!(!tickets.patch(&mut plain, &request(0)));
        assert_eq!(plain, b"no placeholder here");
        // A marker too near the end to hold a ticket is no placeholder.
        let mut cut = tickets.marker().to_vec();
        assert!(!tickets.patch(&mut cut, &request(0)));
        assert_eq!(tickets.outstanding(), 1);
    }

    #[test]
    fn dropping_an_owner_releases_its_slots_only() {
        let pool = pool(4);
        let tickets = Tickets::new(&pool, 16, 1 << 30).unwrap();
        let mine = words(&tickets.issue(&request(0)));
        let theirs = words(&tickets.issue(&TicketRequest { owner: 8, ..request(0) }));
        tickets.drop_owner(Some(7));
        assert_eq!(tickets.outstanding(), 1);
        assert!(tickets.adopt(mine[1] as u32, mine[2] as u32, mine[3]).is_none());
        assert_eq!(pool.free_slots(), 3);
        drop(tickets);
        assert_eq!(pool.free_slots(), 4, "the table's end releases the rest");
        let _ = theirs;
    }

    #[test]
    fn a_worker_keeps_as_many_windows_as_its_bytes_allow() {
        let pool = pool(8);
        let tickets = Tickets::new(&pool, 16, 3 * SLOT).unwrap();
        assert_eq!(tickets.kept(SLOT), 3);
        assert_eq!(tickets.kept(SLOT * 100), 1);
        assert_eq!(tickets.kept(1), 16);
        let t: Vec<Vec<u64>> = (0..5).map(|_| words(&tickets.issue(&request(0)))).collect();
        assert_eq!(tickets.table().recent[&(7, 0)].len(), 3);
        let _ = t;
    }
}
