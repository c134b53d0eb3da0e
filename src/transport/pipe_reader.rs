//! Reading a pipe one whole message at a time, framed as Python's
//! `multiprocessing.Connection.send_bytes` frames it (the DataLoader's result queue).
//!
//! Python's own `recv_bytes` reads a message in several reads from Python code, and a signal
//! handler's exception (Ctrl-C) raised between two of them leaves the rest of the message in
//! the pipe: the next read takes its middle for a length, and the queue is out of step for
//! good (`EOFError: Ran out of input`, or a pickle error). Here waiting and reading are apart:
//! [`wait_readable`] may end early for a signal (the caller then runs the handlers, with
//! nothing read), and [`read_message`] reads the whole message, going on through signals, and
//! returns only when it has it all, or the pipe has failed.
//!
//! Invariants:
//! - [`read_message`] consumes exactly one message or, at end of file before its first byte,
//!   nothing; it never returns with part of a message read (but for a pipe that failed or
//!   closed in the middle of one, which is an error).
//! - Nothing here keeps the descriptor: it is borrowed for each call.

use std::os::fd::BorrowedFd;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// How a wait for a message ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited {
    /// A message (or the end of file) is there to read.
    Readable,
    /// The time given passed first.
    TimedOut,
    /// A signal came first: the caller runs its handlers, then waits again.
    Interrupted,
}

/// What [`read_message`] read.
#[derive(Debug, PartialEq, Eq)]
pub enum Message {
    /// One message's bytes, whole.
    Whole(Vec<u8>),
    /// The end of file, before the first byte of a message: every writer has closed.
    Ended,
}

/// Waits at most `wait` for `fd` to have something to read.
pub fn wait_readable(fd: BorrowedFd<'_>, wait: Duration) -> Result<Waited> {
    let timeout = Timespec {
        tv_sec: wait.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(0) => Ok(Waited::TimedOut),
        Ok(_) => Ok(Waited::Readable),
        Err(Errno::INTR) => Ok(Waited::Interrupted),
        Err(e) => Err(Error::os("poll", e)),
    }
}

/// Reads one whole message from `fd` (a blocking pipe), going on through signals.
pub fn read_message(fd: BorrowedFd<'_>) -> Result<Message> {
    let mut head = [0u8; 4];
    if !fill(fd, &mut head, true)? {
        return Ok(Message::Ended);
    }
    let len = match i32::from_be_bytes(head) {
        -1 => {
            let mut long = [0u8; 8];
            fill(fd, &mut long, false)?;
            usize::try_from(u64::from_be_bytes(long))
                .map_err(|_| Error::Invalid("a message longer than this machine can hold".into()))?
        }
        n => usize::try_from(n)
            .map_err(|_| Error::Invalid(format!("a message with a negative length ({n})")))?,
    };
    let mut body = Vec::new();
    body.try_reserve_exact(len)
        .map_err(|_| Error::Invalid(format!("a message of {len} bytes: no memory to hold it")))?;
    body.resize(len, 0);
    fill(fd, &mut body, false)?;
    Ok(Message::Whole(body))
}

/// Fills `buf` from `fd`. With `may_end`, the end of file before the first byte returns false;
/// anywhere else it is an error.
fn fill(fd: BorrowedFd<'_>, buf: &mut [u8], may_end: bool) -> Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(fd, &mut buf[got..]) {
            Ok(0) if got == 0 && may_end => return Ok(false),
            Ok(0) => {
                return Err(Error::os("read (end of file in the middle of a message)", Errno::PIPE))
            }
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(Error::os("read", e)),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::{AsFd, OwnedFd};

    fn pipe() -> (OwnedFd, std::fs::File) {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        (read, write.into())
    }

    fn framed(payload: &[u8]) -> Vec<u8> {
        [(payload.len() as i32).to_be_bytes().as_slice(), payload].concat()
    }

    #[test]
    fn messages_come_whole_and_in_order() {
        let (r, mut w) = pipe();
        w.write_all(&framed(b"one")).unwrap();
        w.write_all(&framed(b"")).unwrap();
        w.write_all(&framed(&[7u8; 1000])).unwrap();
        assert_eq!(wait_readable(r.as_fd(), Duration::ZERO).unwrap(), Waited::Readable);
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Whole(b"one".to_vec()));
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Whole(vec![]));
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Whole(vec![7u8; 1000]));
        assert_eq!(wait_readable(r.as_fd(), Duration::from_millis(1)).unwrap(), Waited::TimedOut);
    }

    #[test]
    fn a_message_written_in_pieces_is_read_whole() {
        let (r, mut w) = pipe();
        let message = framed(&(0..200_000u32).map(|i| i as u8).collect::<Vec<_>>());
        let writer = std::thread::spawn(move || {
            for piece in message.chunks(7_000) {
                w.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let got = read_message(r.as_fd()).unwrap();
        writer.join().unwrap();
        let Message::Whole(body) = got else { panic!("no message") };
        assert_eq!(body.len(), 200_000);
        assert!(body.iter().enumerate().all(|(i, b)| *b == i as u8));
    }

    #[test]
    fn the_eight_byte_length_is_read() {
        let (r, mut w) = pipe();
        let head = [(-1i32).to_be_bytes().as_slice(), &5u64.to_be_bytes()].concat();
        w.write_all(&head).unwrap();
        w.write_all(b"hello").unwrap();
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Whole(b"hello".to_vec()));
    }

    #[test]
    fn the_end_of_file_is_an_end_before_a_message_and_an_error_inside_one() {
        let (r, mut w) = pipe();
        w.write_all(&framed(b"whole")).unwrap();
        w.write_all(&10i32.to_be_bytes()).unwrap();
        w.write_all(b"part").unwrap();
        drop(w);
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Whole(b"whole".to_vec()));
        let err = read_message(r.as_fd()).unwrap_err();
        assert!(err.to_string().contains("middle of a message"), "{err}");
        let (r, w) = pipe();
        drop(w);
        assert_eq!(read_message(r.as_fd()).unwrap(), Message::Ended);
    }

    #[test]
    fn a_negative_length_is_refused() {
        let (r, mut w) = pipe();
        w.write_all(&(-5i32).to_be_bytes()).unwrap();
        assert!(read_message(r.as_fd()).unwrap_err().to_string().contains("negative length"));
    }
}
