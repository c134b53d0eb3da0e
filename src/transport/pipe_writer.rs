//! A pipe written by a thread of its own: the sender queues a message and goes on; the
//! thread frames it the way Python's `multiprocessing.Connection.send_bytes` does and writes
//! it, waiting for the reader where the pipe is full.
//!
//! The DataLoader sends every batch's indices to a worker through such a pipe (its index
//! queue). Writing them on the training thread costs that thread the write and the wake-up of
//! the worker; queuing them here costs a channel send (the figures: "Indices written by a
//! thread of their own" in `docs/performance.md`).
//!
//! Invariants:
//! - Messages reach the pipe whole, in the order they were sent, each framed as
//!   `send_bytes` frames it (a 4-byte big-endian length, or `-1` and an 8-byte length above
//!   `i32::MAX`), so the reader's `recv_bytes` (a `multiprocessing.Queue`'s `get()`) reads
//!   them unchanged. This writer must be the pipe's only writer.
//! - [`PipeWriter::send`] never waits for the reader and never takes a lock the writing
//!   thread holds across a system call.
//! - The writer owns a duplicate of the pipe's descriptor, set non-blocking, and closes it
//!   when its thread ends: when the writer is closed or dropped and its messages are written,
//!   or given up (no reader, a write error, or [`GIVE_UP_AFTER`] closed with the pipe still
//!   full). A write error is kept ([`PipeWriter::error`]); later messages are dropped.
//! - Dropping the writer never waits; in a process forked from its owner (which has no copy
//!   of the thread) it touches nothing.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Once the writer is closed, how long its thread waits for a full pipe to drain before it
/// gives the rest up (a reader that has stopped reading by then is not coming back).
pub const GIVE_UP_AFTER: Duration = Duration::from_millis(200);
/// How often a thread waiting on a full pipe looks whether the writer was closed.
const POLL_EVERY: rustix::event::Timespec =
    rustix::event::Timespec { tv_sec: 0, tv_nsec: 20_000_000 };

/// One message on its way to the thread, framed already.
type Outgoing = Vec<u8>;

#[derive(Default)]
struct State {
    error: Option<Error>,
    done: bool,
}

struct Shared {
    closing: AtomicBool,
    written: AtomicU64,
    state: Mutex<State>,
    ended: Condvar,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending end: see the module's doc.
pub struct PipeWriter {
    tx: Mutex<Option<Sender<Outgoing>>>,
    shared: Arc<Shared>,
    owner: u32,
}

impl std::fmt::Debug for PipeWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipeWriter").field("written", &self.written()).finish()
    }
}

impl PipeWriter {
    /// Starts a writer of the pipe `fd` (only borrowed: the writer writes to a duplicate).
    pub fn new(fd: RawFd) -> Result<Self> {
        if fd < 0 {
            return Err(Error::os("fcntl(F_DUPFD_CLOEXEC)", rustix::io::Errno::BADF));
        }
        // SAFETY: only borrowed for the one `fcntl` below, which duplicates it; a number that
        // is not open fails there with EBADF and touches no memory.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let dup = rustix::io::fcntl_dupfd_cloexec(borrowed, 0)
            .map_err(|e| Error::os("fcntl(F_DUPFD_CLOEXEC)", e))?;
        let st = rustix::fs::fstat(&dup).map_err(|e| Error::os("fstat", e))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Fifo {
            return Err(Error::Invalid(format!("descriptor {fd} is not a pipe")));
        }
        set_nonblocking(dup.as_fd())?;
        let (tx, rx) = channel::<Outgoing>();
        let shared = Arc::new(Shared {
            closing: AtomicBool::new(false),
            written: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            ended: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("pinpool-pipe".into())
            .spawn(move || {
                let error = write_all_messages(&dup, &rx, &worker).err();
                drop(dup);
                drop(rx); // later sends fail: nothing is written after an error
                let mut state = worker.state();
                state.error = error;
                state.done = true;
                worker.ended.notify_all();
            })
            .map_err(|e| Error::Invalid(format!("cannot start a pipe writer thread: {e}")))?;
        Ok(PipeWriter { tx: Mutex::new(Some(tx)), shared, owner: std::process::id() })
    }

    /// Queues `payload` as one message. Fails only once the writer is closed; a message sent
    /// after a write error is dropped (that error is kept, see [`PipeWriter::error`]).
    pub fn send(&self, payload: &[u8]) -> Result<()> {
        self.queue(frame(payload))
    }

    fn queue(&self, message: Outgoing) -> Result<()> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return Err(Error::Closed) };
        let _ = tx.send(message); // Err only once the thread has ended on an error
        Ok(())
    }

    /// Closes the writer: what was sent is still written (for up to [`GIVE_UP_AFTER`] while
    /// the pipe stays full), then the thread ends and closes its descriptor. Waits for that
    /// for at most `wait`; returns whether it ended.
    pub fn close(&self, wait: Duration) -> bool {
        self.shared.closing.store(true, Ordering::SeqCst);
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        let deadline = Instant::now() + wait;
        let mut state = self.shared.state();
        while !state.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state =
                self.shared.ended.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Messages written whole so far.
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::SeqCst)
    }

    /// The write error the thread ended on, if any (no reader left, say).
    pub fn error(&self) -> Option<Error> {
        self.shared.state().error.clone()
    }
}

impl Drop for PipeWriter {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A forked copy: the thread and the channel's other end live in the parent only.
            if let Some(tx) = self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
                std::mem::forget(tx);
            }
            return;
        }
        self.shared.closing.store(true, Ordering::SeqCst);
        drop(self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// `payload` framed as `multiprocessing.Connection.send_bytes` frames it.
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = header(payload.len());
    out.reserve_exact(payload.len());
    out.extend_from_slice(payload);
    out
}

/// The length header `send_bytes` puts before `len` bytes.
fn header(len: usize) -> Vec<u8> {
    match i32::try_from(len) {
        Ok(n) => n.to_be_bytes().to_vec(),
        Err(_) => [(-1i32).to_be_bytes().as_slice(), &(len as u64).to_be_bytes()].concat(),
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd).map_err(|e| Error::os("fcntl(F_GETFL)", e))?;
    rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| Error::os("fcntl(O_NONBLOCK)", e))
}

/// The thread's loop: every message, in order, until the channel is closed and empty.
fn write_all_messages(fd: &OwnedFd, rx: &Receiver<Outgoing>, shared: &Shared) -> Result<()> {
    for message in rx {
        write_whole(fd.as_fd(), &message, shared)?;
        shared.written.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

/// Writes all of `bytes`, waiting while the pipe is full (giving up [`GIVE_UP_AFTER`] after
/// the writer was closed).
fn write_whole(fd: BorrowedFd<'_>, mut bytes: &[u8], shared: &Shared) -> Result<()> {
    use rustix::event::{PollFd, PollFlags};
    use rustix::io::Errno;
    let mut closed_since: Option<Instant> = None;
    while !bytes.is_empty() {
        match rustix::io::write(fd, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                if shared.closing.load(Ordering::SeqCst) {
                    let since = *closed_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= GIVE_UP_AFTER {
                        return Err(Error::os("write (the pipe stayed full)", Errno::AGAIN));
                    }
                }
                let _ =
                    rustix::event::poll(&mut [PollFd::new(&fd, PollFlags::OUT)], Some(&POLL_EVERY));
            }
            Err(e) => return Err(Error::os("write", e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    fn pipe() -> (std::fs::File, OwnedFd) {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        (read.into(), write)
    }

    fn read_message(r: &mut std::fs::File) -> Vec<u8> {
        let mut head = [0u8; 4];
        r.read_exact(&mut head).unwrap();
        let n = i32::from_be_bytes(head);
        let len = if n == -1 {
            let mut long = [0u8; 8];
            r.read_exact(&mut long).unwrap();
            u64::from_be_bytes(long) as usize
        } else {
            n as usize
        };
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).unwrap();
        body
    }

    #[test]
    fn messages_arrive_whole_and_in_order_across_full_pipes() {
        let (mut r, w) = pipe();
        let writer = PipeWriter::new(w.as_raw_fd()).unwrap();
        // The writer has its own descriptor.
        drop(w);
        // Sizes around the framing's and the pipe's edges; 300 KiB fills a 64 KiB pipe.
        let sizes = [0usize, 1, 16383, 16384, 16385, 65536, 300 << 10, 7, 2];
        let sent: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(i, &n)| vec![i as u8 + 1; n]).collect();
        for m in &sent {
            writer.send(m).unwrap();
        }
        for m in &sent {
            assert_eq!(&read_message(&mut r), m);
        }
        assert!(writer.close(Duration::from_secs(5)));
        assert_eq!(writer.written(), sizes.len() as u64);
        assert!(writer.error().is_none());
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap(); // EOF: the writer's descriptor is closed
        assert!(rest.is_empty());
    }

    #[test]
    fn closing_still_writes_what_was_sent() {
        let (mut r, w) = pipe();
        let writer = PipeWriter::new(w.as_raw_fd()).unwrap();
        drop(w);
        for i in 0..100u32 {
            writer.send(&i.to_le_bytes()).unwrap();
        }
        assert!(writer.close(Duration::from_secs(5)));
        assert!(matches!(writer.send(b"late"), Err(Error::Closed)));
        for i in 0..100u32 {
            assert_eq!(read_message(&mut r), i.to_le_bytes());
        }
    }

    #[test]
    fn a_pipe_nobody_reads_is_given_up_after_close_and_the_error_kept() {
        let (r, w) = pipe();
        let writer = PipeWriter::new(w.as_raw_fd()).unwrap();
        drop(w);
        writer.send(&vec![0u8; 1 << 20]).unwrap(); // more than the pipe holds
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(writer.written(), 0);
        let t = Instant::now();
        assert!(writer.close(Duration::from_secs(5)));
        assert!(t.elapsed() >= GIVE_UP_AFTER && t.elapsed() < Duration::from_secs(4));
        assert!(matches!(writer.error(), Some(Error::Os { .. })));
        drop(r);
    }

    #[test]
    fn a_closed_reader_ends_the_thread_with_an_error_and_later_sends_are_dropped() {
        let (r, w) = pipe();
        let writer = PipeWriter::new(w.as_raw_fd()).unwrap();
        drop(w);
        drop(r); // EPIPE (Rust ignores SIGPIPE in test binaries as in Python)
        writer.send(b"nobody reads this").unwrap();
        let t = Instant::now();
        while writer.error().is_none() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(writer.error(), Some(Error::Os { errno: libc::EPIPE, .. })));
        writer.send(b"dropped").unwrap();
        assert!(writer.close(Duration::from_secs(5)));
        assert_eq!(writer.written(), 0);
    }

    #[test]
    fn refuses_a_descriptor_that_is_not_a_pipe() {
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(matches!(PipeWriter::new(f.as_raw_fd()), Err(Error::Invalid(_))));
        assert!(matches!(PipeWriter::new(-1), Err(Error::Os { .. })));
    }

    #[test]
    fn lengths_past_i32_use_the_eight_byte_header() {
        assert_eq!(header(0), 0i32.to_be_bytes());
        assert_eq!(header(i32::MAX as usize), i32::MAX.to_be_bytes());
        let long = header(1 << 31);
        assert_eq!(&long[..4], &(-1i32).to_be_bytes());
        assert_eq!(&long[4..], &(1u64 << 31).to_be_bytes());
        assert_eq!(frame(b"ab"), [0, 0, 0, 2, b'a', b'b']);
    }

    #[test]
    fn dropping_the_writer_flushes_and_closes_without_waiting() {
        let (mut r, w) = pipe();
        let writer = PipeWriter::new(w.as_raw_fd()).unwrap();
        drop(w);
        writer.send(b"last words").unwrap();
        let t = Instant::now();
        drop(writer);
        assert!(t.elapsed() < Duration::from_secs(2), "the drop waited");
        assert_eq!(read_message(&mut r), b"last words");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }
}
