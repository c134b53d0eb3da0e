//! Zero-copy grants: a slot of exactly a batch's size, checked out for the worker that has
//! just collated the batch, when it asks ([`crate::transport::grant_desk`]).
//!
//! In zero-copy mode a worker writes its batch straight into the main process's arena. It asks
//! for the room once it knows the batch's size (a collated batch's, or a streamed batch's from
//! its first sample), so nothing is guessed: the slot is exactly the batch's bytes, rounded up
//! to a page. The answer is a *grant* ([`Grant`]): where the slot lies in shared memory and a
//! random nonce; the worker's handle names (index, generation, nonce), and the main process
//! adopts the slot only for that claim ([`Grants::adopt`]). No room: the worker writes the batch
//! into a segment of its own (copy mode), counted in [`Grants::fallbacks`].
//!
//! Why no batch waits on room held for batches behind it: room is only ever granted to a batch
//! that exists; a grant for any batch but the one the consumer waits for next (the *head*,
//! [`Grants::set_head`]) must leave [`crate::pool::claim::room_kept`] bytes free in one range,
//! so the head, which may take that range too, finds room as large as 1.5 times the largest
//! batch asked for so far whatever was granted ahead of it; and nothing here ever waits (a
//! request is answered at once). A batch that finds no room goes through copy mode in its
//! turn, where the consumer's own claim may use the kept range too, or the free ranges in
//! pieces between its arrays (`SlotTable::try_checkout_split`).
//!
//! A grant is [`GRANT_WORDS`] little-endian `u64`s, then its likely slots: `1` (granted; `0`:
//! none), the slot's table index, its generation, the nonce (below 2^63), the slot's offset in
//! its memfd, its length, this process's id, the memfd's descriptor, the memfd's length and its
//! inode number, then how many likely slots follow and, for each, [`LIKELY_WORDS`] words:
//! offset, length, descriptor, memfd length and inode of an extent the worker's next slots will
//! likely be in (sent with a worker's first big grant only, for it to pre-map them).
//!
//! This module is the table and its answers to requests; `leaving` is how a grant leaves it,
//! `planned` where a fresh worker's slots will likely be, `grant` one grant and the words it
//! travels as.
//!
//! Invariants:
//! - A granted slot is in the table from its checkout until it is adopted (by the batch that
//!   names its index, generation and nonce: once), given back, or dropped with its owner; it
//!   stays checked out meanwhile, so the pool cannot hand it out again. It leaves un-adopted
//!   only once no worker that got it can write any more (the caller's promise), and is then
//!   released unfenced (no device work was queued on it: only an adopted slot reaches the
//!   device).
//! - Only an open owner (an iterator, [`Grants::open`]) gets grants: a late request of an
//!   ended iterator's worker gets none, so nothing is granted that no one would take back.
//! - Per (owner, worker) the table remembers the offsets of that worker's last slots (as many
//!   as it keeps windows over) and offers them first: memory the worker has mapped already.
//! - In a process forked from the table's owner nothing is granted or released.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::allocation::slots::{Preference, SlotId};
use crate::pool::{claim::room_kept, Pool, SlotLocation};
use crate::system::random::random_u64;

mod grant;
mod leaving;
mod planned;

pub use grant::{Grant, GRANT_WORDS, LIKELY_WORDS};
pub use planned::{PLANNED_SLOTS, SPARE_SLOTS};

use planned::planned;

/// By default, batches of at least this many bytes are big ([`Grants::new`]): a fresh worker's
/// first big grant names where its next slots will likely be, for it to pre-map them, and a
/// worker's last big slots are offered to the worker of the same id of the next iterator (a
/// small window costs a fresh worker little to fault in).
pub const BIG_FROM: usize = 8 << 20;
/// The most likely slots one grant carries.
pub const MAX_LIKELY: usize = 8;

/// One worker's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRequest {
    /// The iterator the batch belongs to ([`Grants::open`]).
    pub owner: u64,
    /// The worker asking (torch's worker id).
    pub worker: usize,
    /// The batch's task number in its iterator (torch's order of dispatch).
    pub task: u64,
    /// The batch's bytes.
    pub nbytes: usize,
}

/// What a request gets now ([`Grants::answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A slot.
    Granted(Grant),
    /// No room now, but it is on its way: ask again when something changes.
    Wait,
    /// No room, and none is coming that this batch may take.
    No,
}

#[derive(Debug)]
struct Issued {
    pool: Arc<Pool>,
    slot: SlotId,
    nonce: u64,
    owner: u64,
    task: u64,
}

/// The arena offsets of one worker's slots in one iterator.
#[derive(Debug, Default)]
struct WorkerOffsets {
    /// Arena offsets of its last slots, latest first (those it keeps windows over).
    recent: Vec<usize>,
    /// Offsets it was told of as likely, offered after `recent`.
    likely: Vec<usize>,
}

/// An open iterator.
#[derive(Debug, Default)]
struct Owner {
    /// The task the consumer waits for next.
    head: u64,
    workers: HashMap<usize, WorkerOffsets>,
}

#[derive(Debug, Default)]
struct Table {
    issued: HashMap<(u32, u32), Issued>,
    /// Adopted slots of batches not yet yielded to the consumer: (owner, task, slot).
    unyielded: HashMap<(u32, u32), (u64, u64, SlotId)>,
    owners: HashMap<u64, Owner>,
    /// Per worker id, across iterators, the locations of its last big slots, latest first, in
    /// the pool whose table id is `last_table`.
    last: HashMap<usize, Vec<SlotLocation>>,
    last_table: u32,
    /// The largest batch asked for, rounded up to a page.
    largest: usize,
}

/// The grants of one loader: see the module's doc.
#[derive(Debug)]
pub struct Grants {
    pool: Mutex<Weak<Pool>>,
    windows: usize,
    window_bytes: usize,
    big_from: usize,
    table: Mutex<Table>,
    told_likely: AtomicU64,
    fallbacks: AtomicU64,
    epoch: AtomicU64,
    /// No pool yet, but one is being made: requests wait for it.
    pool_coming: AtomicBool,
    /// The largest batch granted a slot, in bytes.
    largest: AtomicUsize,
    owner_pid: u32,
}

impl Grants {
    /// A table whose workers keep `windows` windows at most, and `window_bytes` bytes of them,
    /// and whose batches of `big_from` bytes and more are big (see [`BIG_FROM`]); no pool yet
    /// ([`Grants::use_pool`]).
    pub fn new(windows: usize, window_bytes: usize, big_from: usize) -> Self {
        Grants {
            pool: Mutex::new(Weak::new()),
            windows: windows.max(1),
            window_bytes,
            big_from,
            told_likely: AtomicU64::new(0),
            table: Mutex::new(Table::default()),
            fallbacks: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            pool_coming: AtomicBool::new(false),
            largest: AtomicUsize::new(usize::MAX),
            owner_pid: std::process::id(),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forked(&self) -> bool {
        std::process::id() != self.owner_pid
    }

    /// Grants come from `pool` from now on (the loader's pool, once made), for batches of up
    /// to `largest` bytes (a larger one is the loader's to take, by its rules for them).
    pub fn use_pool(&self, pool: &Arc<Pool>, largest: usize) {
        *self.pool.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(pool);
        self.largest.store(largest, Ordering::SeqCst);
        self.pool_coming.store(false, Ordering::SeqCst);
        self.changed();
    }

    /// Whether a pool is being made (a loader's first batches are told its size): until
    /// [`Grants::use_pool`], requests wait for it rather than go without.
    pub fn pool_coming(&self, coming: bool) {
        self.pool_coming.store(coming, Ordering::SeqCst);
        self.changed();
    }

    /// Iterator `owner` may be granted slots; its head is task 0 (a new epoch's, for an
    /// iterator open already: what was not yielded of the last one is no longer waited for).
    pub fn open(&self, owner: u64) {
        let mut t = self.table();
        t.owners.entry(owner).or_default().head = 0;
        t.unyielded.retain(|_, u| u.0 != owner);
        drop(t);
        self.changed();
    }

    /// Stops iterator `owner` (every one, with None): it gets no more grants, and its requests
    /// waiting at the desk for room on its way are answered at once, with none (an iterator
    /// ending, or a persistent one's epoch: nobody waits for those batches any more, and their
    /// workers must not wait either). What was granted to it stays out until adopted, given
    /// back or closed ([`Grants::close`]): its workers may still be writing it.
    pub fn stop(&self, owner: Option<u64>) {
        let mut t = self.table();
        t.owners.retain(|&o, _| owner.is_some_and(|w| w != o));
        t.unyielded.retain(|_, u| owner.is_some_and(|w| w != u.0));
        drop(t);
        self.changed();
    }

    /// The consumer of iterator `owner` waits for task `task` next: the batches before it are
    /// the consumer's.
    pub fn set_head(&self, owner: u64, task: u64) {
        let mut t = self.table();
        if let Some(o) = t.owners.get_mut(&owner) {
            o.head = task;
            if !t.unyielded.is_empty() {
                t.unyielded.retain(|_, u| u.0 != owner || u.1 >= task);
            }
        }
        drop(t);
        self.changed();
    }

    /// How many windows over slots of `nbytes` a worker keeps (at least one).
    fn kept(&self, nbytes: usize) -> usize {
        (self.window_bytes / nbytes.max(1)).clamp(1, self.windows)
    }

    /// Checks a slot of `request.nbytes` out for that worker (preferably where its last slots
    /// were) and returns the grant; None (counted in [`Grants::fallbacks`]) when there is no
    /// room now that leaves what the head needs, no pool, the pool is closed, its memory is no
    /// memfd, or the owner is not open.
    pub fn issue(&self, request: &GrantRequest) -> Option<Grant> {
        match self.answer(request) {
            Answer::Granted(grant) => Some(grant),
            Answer::Wait | Answer::No => {
                self.refused(request);
                None
            }
        }
    }

    /// Counts a request that gets no grant (see [`Grants::fallbacks`]).
    pub fn refused(&self, request: &GrantRequest) {
        if request.nbytes > 0 {
            self.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What `request` gets now: a grant, or [`Answer::Wait`] while the room it needs is held by
    /// batches the consumer will reach first (and fenced slots), or [`Answer::No`]. Never
    /// waits; counts nothing.
    pub fn answer(&self, request: &GrantRequest) -> Answer {
        if self.forked() || request.nbytes == 0 {
            return Answer::No;
        }
        let Some(pool) = self.pool.lock().unwrap_or_else(|e| e.into_inner()).upgrade() else {
            if self.pool_coming.load(Ordering::SeqCst) {
                return Answer::Wait;
            }
            return Answer::No;
        };
        if request.nbytes > self.largest.load(Ordering::SeqCst) {
            return Answer::No;
        }
        let page = crate::memory::shm::page_size();
        let Some(size) = request.nbytes.checked_next_multiple_of(page) else { return Answer::No };
        if size > pool.largest_slot() {
            return Answer::No;
        }
        let table_id = pool.table_id();
        let big = size >= self.big_from;
        let (keep, prefer, seeds) = {
            let mut t = self.table();
            t.largest = t.largest.max(size);
            let largest = t.largest;
            if t.last_table != table_id {
                t.last.clear(); // (another pool's locations name other memory)
                t.last_table = table_id;
            }
            let last = if big { t.last.get(&request.worker).cloned() } else { None };
            let Some(owner) = t.owners.get_mut(&request.owner) else { return Answer::No };
            let keep = if request.task <= owner.head {
                0
            } else {
                room_kept(largest, pool.arena().len(), pool.largest_slot())
            };
            let offsets = owner.workers.entry(request.worker).or_default();
            let fresh = offsets.recent.is_empty() && offsets.likely.is_empty();
            let seeds: Vec<SlotLocation> = match last {
                Some(last) if fresh => last,
                _ if fresh && big => planned(&pool, request.worker, size, self.kept(size)),
                _ => Vec::new(),
            };
            let mut prefer = offsets.recent.clone();
            prefer.extend(offsets.likely.iter().filter(|o| !offsets.recent.contains(o)));
            prefer.extend(seeds.iter().map(|s| s.arena_offset));
            (keep, prefer, seeds)
        };
        let slot = match pool.try_checkout_bytes_preferring(size, keep, &prefer, Preference::Prefer)
        {
            Ok(Some(slot)) => slot,
            Ok(None) => return self.wait_or_not(&pool, request, size, keep),
            Err(_) => return Answer::No,
        };
        let Some(location) = pool.slot_location(slot) else {
            let _ = pool.release(slot, None);
            return Answer::No;
        };
        let Ok(nonce) = random_u64() else {
            let _ = pool.release(slot, None);
            return Answer::No;
        };
        let nonce = nonce >> 1;
        let at = location.arena_offset;
        let likely: Vec<SlotLocation> =
            seeds.into_iter().filter(|s| s.arena_offset != at).take(MAX_LIKELY).collect();
        let mut t = self.table();
        let Some(owner) = t.owners.get_mut(&request.owner) else {
            drop(t); // (closed meanwhile: its workers can no longer write)
            let _ = pool.release(slot, None);
            return Answer::No;
        };
        let kept = self.kept(location.nbytes);
        let offsets = owner.workers.entry(request.worker).or_default();
        if !likely.is_empty() {
            offsets.likely = likely.iter().map(|s| s.arena_offset).collect();
            self.told_likely.fetch_add(1, Ordering::Relaxed);
        }
        offsets.likely.retain(|&o| o != at);
        offsets.recent.retain(|&o| o != at);
        offsets.recent.insert(0, at);
        offsets.recent.truncate(kept);
        if big {
            let last = t.last.entry(request.worker).or_default();
            last.retain(|p| p.arena_offset != at);
            last.insert(0, location);
            last.truncate(kept);
        }
        let issued = Issued {
            pool: Arc::clone(&pool),
            slot,
            nonce,
            owner: request.owner,
            task: request.task,
        };
        t.issued.insert((slot.index, slot.generation), issued);
        Answer::Granted(Grant { slot, nonce, location, likely })
    }

    /// Whether a request that found no room now is worth an answer later: the room it needs
    /// (a slot of `size` and `keep` bytes in one range) is on its way, held by fenced slots or
    /// by batches of its iterator the consumer reaches before this one (granted and not yet
    /// adopted, or adopted and not yet yielded). Batches the consumer has been handed do not
    /// count: it may keep them.
    fn wait_or_not(&self, pool: &Pool, request: &GrantRequest, size: usize, keep: usize) -> Answer {
        let before: Vec<SlotId> = {
            let t = self.table();
            let first = |owner: u64, task: u64| owner == request.owner && task < request.task;
            t.issued
                .values()
                .filter(|i| first(i.owner, i.task))
                .map(|i| i.slot)
                .chain(t.unyielded.values().filter(|u| first(u.0, u.1)).map(|u| u.2))
                .collect()
        };
        if pool.room_once_back(size, keep, &before) {
            Answer::Wait
        } else {
            Answer::No
        }
    }

    /// A number that changes whenever an answer may change without the pool's bytes changing
    /// (a head moves, an iterator opens or closes, a batch is adopted); with
    /// [`Pool::epoch`], when a waiting request is worth asking again.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// The pool grants come from, if it is still there.
    pub fn pool(&self) -> Option<Arc<Pool>> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).upgrade()
    }

    /// Requests that got no grant (their batches went through copy mode).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    /// Grants that named where the worker's next slots will likely be.
    pub fn told_likely(&self) -> u64 {
        self.told_likely.load(Ordering::Relaxed)
    }

    /// Grants made and not yet adopted, given back or dropped.
    pub fn outstanding(&self) -> usize {
        self.table().issued.len()
    }
}
