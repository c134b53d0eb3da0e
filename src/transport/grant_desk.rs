//! The grant desk: where zero-copy workers ask the main process for room in its arena, once
//! they know their batch's size, and get an answer at once ([`crate::pool::grants`]).
//!
//! One desk per process, while a loader needs it ([`register`]): a Unix socket of type
//! `SOCK_SEQPACKET` bound to an abstract address (no file anywhere; the name is the process
//! id and 64 random bits) and one thread that answers on it, without the GIL. A worker
//! connects once and then, per batch, sends one request and reads one answer:
//!
//! - a request is [`REQUEST_WORDS`] little-endian `u64`s: the kind ([`ASK`] or
//!   [`GIVE_BACK`]), a sequence number of the worker's own, the table (a loader's
//!   [`Registration::table`]), then for [`ASK`] the owner, the worker, the task and the
//!   bytes; for [`GIVE_BACK`] the slot's index, generation and nonce, and a zero;
//! - an answer to [`ASK`] is the request's sequence number, then the grant's words
//!   ([`crate::pool::grants::Grant::words`]), or a single `0` for no grant. [`GIVE_BACK`] gets
//!   none.
//!
//! Invariants:
//! - Only processes of this process's effective user are answered (`SO_PEERCRED`): others
//!   are disconnected at once, as is a connection that sends anything but whole requests.
//! - The desk's thread never waits for anything but its socket: a request is answered from
//!   [`crate::pool::grants::Grants::issue`], which never waits; an answer that cannot be sent at
//!   once (the worker is gone) has its grant given back.
//! - The desk lives while a [`Registration`] does; dropping the last one stops its thread,
//!   which closes the socket and every connection before the drop returns. A process forked
//!   from the desk's owner has no desk thread: it neither uses nor stops its parent's, and
//!   takes none of its locks (its thread may have held one at the fork).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::net::{
    accept_with, bind, listen, recv, send, socket_with, sockopt, AddressFamily, RecvFlags,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::error::{Error, Result};
use crate::pool::grants::{
    Answer, Grant, GrantRequest, Grants, GRANT_WORDS, LIKELY_WORDS, MAX_LIKELY,
};
use crate::system::random::random_u64;

/// A request's length, in words.
pub const REQUEST_WORDS: usize = 7;
/// Request kind: a slot for a batch of known size.
pub const ASK: u64 = 1;
/// Request kind: a granted slot the worker will not write (its batch failed, or it took too
/// long to hear the answer).
pub const GIVE_BACK: u64 = 2;

/// The longest a request whose room is on its way waits for its answer (then: no grant).
pub const WAIT_AT_MOST: Duration = Duration::from_secs(5);
/// How often the desk looks whether a waiting request's room has come.
const LOOK_AGAIN_EVERY: rustix::event::Timespec =
    rustix::event::Timespec { tv_sec: 0, tv_nsec: 500_000 };

/// The longest answer: the sequence number, a grant and its likely slots.
const MAX_ANSWER_WORDS: usize = 1 + GRANT_WORDS + MAX_LIKELY * LIKELY_WORDS;

/// The process's desk, while someone holds a registration.
static DESK: Mutex<Weak<Desk>> = Mutex::new(Weak::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Tables = Mutex<HashMap<u64, Weak<Grants>>>;

/// The desk: its address, its tables, its thread.
struct Desk {
    address: Vec<u8>,
    tables: Arc<Tables>,
    stop: Arc<OwnedFd>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pid: u32,
}

impl Desk {
    fn start() -> Result<Arc<Desk>> {
        let listener = socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(|e| Error::os("socket", e))?;
        let pid = std::process::id();
        let address = format!("pinpool-grants-{pid}-{:016x}", random_u64()?).into_bytes();
        let addr = SocketAddrUnix::new_abstract_name(&address).map_err(|e| Error::os("bind", e))?;
        bind(&listener, &addr).map_err(|e| Error::os("bind", e))?;
        listen(&listener, 128).map_err(|e| Error::os("listen", e))?;
        let stop = Arc::new(
            eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| Error::os("eventfd", e))?,
        );
        let tables: Arc<Tables> = Arc::default();
        let (t, s) = (Arc::clone(&tables), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("pinpool-grants".into())
            .spawn(move || serve(&listener, &s, &t))
            .map_err(|e| Error::Invalid(format!("cannot start the grant desk's thread: {e}")))?;
        Ok(Arc::new(Desk { address, tables, stop, thread: Mutex::new(Some(thread)), pid }))
    }
}

impl Drop for Desk {
    fn drop(&mut self) {
        let thread = lock(&self.thread).take();
        if self.pid != std::process::id() {
            std::mem::forget(thread); // (the parent's thread: not in this process)
            return;
        }
        let _ = rustix::io::write(self.stop.as_fd(), &1u64.to_ne_bytes());
        if let Some(thread) = thread {
            let _ = thread.join(); // (it only polls: it ends at once)
        }
    }
}

/// A loader's place at the process's desk: its table is answered there while this lives.
pub struct Registration {
    desk: Arc<Desk>,
    table: u64,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("table", &self.table).finish()
    }
}

impl Registration {
    /// The desk's abstract address (without the leading NUL).
    pub fn address(&self) -> &[u8] {
        &self.desk.address
    }

    /// The number requests name this table by.
    pub fn table(&self) -> u64 {
        self.table
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.desk.pid != std::process::id() {
            // A forked child's copy (a worker's, collected there): the parent's desk thread
            // may have held the lock at the fork, and nothing here answers anyway.
            return;
        }
        lock(&self.desk.tables).remove(&self.table);
    }
}

/// Answers requests for `grants` at the process's desk (started now if there is none) until
/// the registration is dropped.
pub fn register(grants: &Arc<Grants>) -> Result<Registration> {
    let desk = {
        let mut current = lock(&DESK);
        match current.upgrade().filter(|d| d.pid == std::process::id()) {
            Some(desk) => desk,
            None => {
                let desk = Desk::start()?;
                *current = Arc::downgrade(&desk);
                desk
            }
        }
    };
    let table = loop {
        let id = random_u64()? >> 1;
        let mut tables = lock(&desk.tables);
        if id != 0 && !tables.contains_key(&id) {
            tables.insert(id, Arc::downgrade(grants));
            break id;
        }
    };
    Ok(Registration { desk, table })
}

/// A request whose room is on its way ([`Answer::Wait`]): asked again as things change.
struct Parked {
    conn: RawFd,
    seq: u64,
    table: u64,
    request: GrantRequest,
    since: Instant,
}

/// The desk's thread: answers every connection until `stop` is written.
fn serve(listener: &OwnedFd, stop: &OwnedFd, tables: &Tables) {
    let me = rustix::process::geteuid();
    let mut conns: Vec<OwnedFd> = Vec::new();
    let mut parked: Vec<Parked> = Vec::new();
    let mut seen: HashMap<u64, (u64, u64)> = HashMap::new(); // (per table: the epochs looked at)
    loop {
        let (stopped, incoming, ready) = {
            let mut fds = Vec::with_capacity(conns.len() + 2);
            fds.push(PollFd::new(stop, PollFlags::IN));
            fds.push(PollFd::new(listener, PollFlags::IN));
            fds.extend(conns.iter().map(|c| PollFd::new(c, PollFlags::IN)));
            let timeout = (!parked.is_empty()).then_some(&LOOK_AGAIN_EVERY);
            match poll(&mut fds, timeout) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => return, // (cannot happen with valid descriptors)
            }
            let ready: Vec<bool> = fds[2..].iter().map(|f| !f.revents().is_empty()).collect();
            (!fds[0].revents().is_empty(), !fds[1].revents().is_empty(), ready)
        };
        if stopped {
            return; // (the socket and every connection close as they drop)
        }
        let mut keep = Vec::with_capacity(conns.len());
        for (conn, ready) in conns.drain(..).zip(ready) {
            if !ready || read_requests(&conn, tables, &mut parked) {
                keep.push(conn);
            } else {
                let fd = conn.as_raw_fd();
                parked.retain(|p| p.conn != fd); // (its worker is gone)
            }
        }
        conns = keep;
        if !parked.is_empty() {
            answer_parked(&conns, tables, &mut parked, &mut seen);
        }
        if incoming {
            while let Ok(conn) = accept_with(listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK)
            {
                match sockopt::socket_peercred(&conn) {
                    Ok(cred) if cred.uid == me => conns.push(conn),
                    _ => {} // (another user's process, or no credentials: closed)
                }
            }
        }
    }
}

/// A table looked at for the parked requests: its grants and their epochs (the table's, its
/// pool's).
type Looked = (Arc<Grants>, (u64, u64));

/// Asks again for the parked requests whose table or pool changed since they were last asked
/// for, in each iterator's task order (the consumer reaches the lower first), answering those
/// that get a grant, those whose room is no longer on its way and those parked for
/// [`WAIT_AT_MOST`].
fn answer_parked(
    conns: &[OwnedFd],
    tables: &Tables,
    parked: &mut Vec<Parked>,
    seen: &mut HashMap<u64, (u64, u64)>,
) {
    parked.sort_by_key(|p| (p.table, p.request.owner, p.request.task));
    let mut looked: HashMap<u64, Option<Looked>> = HashMap::new();
    let mut still = Vec::with_capacity(parked.len());
    for p in parked.drain(..) {
        let entry = looked.entry(p.table).or_insert_with(|| {
            let grants = lock(tables).get(&p.table).and_then(Weak::upgrade)?;
            let pool_epoch = grants.pool().map_or(0, |pool| pool.epoch());
            let epochs = (grants.epoch(), pool_epoch);
            Some((grants, epochs))
        });
        let Some((grants, epochs)) = entry.as_ref() else {
            send_answer(conns, &p, None); // (the loader is gone)
            continue;
        };
        let overdue = p.since.elapsed() >= WAIT_AT_MOST;
        if !overdue && seen.get(&p.table) == Some(epochs) {
            still.push(p); // (nothing changed since it was asked for)
            continue;
        }
        match grants.answer(&p.request) {
            Answer::Granted(grant) => {
                if !send_answer(conns, &p, Some(&grant)) {
                    let c = grant.slot;
                    grants.give_back(c.index, c.generation, grant.nonce);
                }
            }
            Answer::Wait if !overdue => still.push(p),
            Answer::Wait | Answer::No => {
                grants.refused(&p.request);
                send_answer(conns, &p, None);
            }
        }
    }
    seen.clear();
    for (table, entry) in looked {
        if let Some((_, epochs)) = entry {
            seen.insert(table, epochs);
        }
    }
    *parked = still;
}

/// Sends `grant` (or no grant) to the worker whose request `p` is; whether it went.
fn send_answer(conns: &[OwnedFd], p: &Parked, grant: Option<&Grant>) -> bool {
    match conns.iter().find(|c| c.as_raw_fd() == p.conn) {
        Some(conn) => send_to(conn, p.seq, grant),
        None => false,
    }
}

fn send_to(conn: &OwnedFd, seq: u64, grant: Option<&Grant>) -> bool {
    let mut words = vec![seq];
    match grant {
        Some(g) => words.extend(g.words().into_iter().take(MAX_ANSWER_WORDS - 1)),
        None => words.push(0),
    }
    let bytes: Vec<u8> = words.iter().flat_map(|x| x.to_le_bytes()).collect();
    send(conn, &bytes, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok()
}

/// Reads what `conn` has sent and answers each request it can now, parking those whose room
/// is on its way; false when it is to be closed (the worker is gone, or it sent something
/// that is not a request).
fn read_requests(conn: &OwnedFd, tables: &Tables, parked: &mut Vec<Parked>) -> bool {
    let mut buf = [0u8; REQUEST_WORDS * 8 + 8];
    loop {
        let n = match recv(conn, &mut buf[..], RecvFlags::DONTWAIT) {
            Ok((_, n)) => n,
            Err(rustix::io::Errno::AGAIN) => return true,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return false,
        };
        if n != REQUEST_WORDS * 8 {
            return false; // (0: closed by the worker; anything else: not a request)
        }
        let w: Vec<u64> = buf[..n]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let grants = lock(tables).get(&w[2]).and_then(Weak::upgrade);
        match w[0] {
            ASK => {
                let request = GrantRequest {
                    owner: w[3],
                    worker: usize::try_from(w[4]).unwrap_or(usize::MAX),
                    task: w[5],
                    nbytes: usize::try_from(w[6]).unwrap_or(usize::MAX),
                };
                let answer = grants.as_ref().map_or(Answer::No, |g| g.answer(&request));
                let grant = match answer {
                    Answer::Granted(grant) => Some(grant),
                    Answer::Wait => {
                        let since = Instant::now();
                        let (conn, seq, table) = (conn.as_raw_fd(), w[1], w[2]);
                        parked.push(Parked { conn, seq, table, request, since });
                        continue;
                    }
                    Answer::No => {
                        if let Some(g) = &grants {
                            g.refused(&request);
                        }
                        None
                    }
                };
                if !send_to(conn, w[1], grant.as_ref()) {
                    if let (Some(g), Some(grant)) = (&grants, &grant) {
                        let c = grant.slot;
                        g.give_back(c.index, c.generation, grant.nonce);
                    }
                    return false;
                }
            }
            GIVE_BACK => {
                if let (Some(g), Ok(index), Ok(generation)) =
                    (&grants, u32::try_from(w[3]), u32::try_from(w[4]))
                {
                    g.give_back(index, generation, w[5]);
                }
            }
            _ => return false,
        }
    }
}
