//! What a forked child gets of this process's arenas: a private, copy-on-write view.
//!
//! An arena is shared memory (`MAP_SHARED` memfds), so a child made by `fork` (a DataLoader
//! worker started by the `fork` method, any `os.fork`) would inherit it shared: a stray write
//! in the child would land in the parent's batches. Each arena part is registered here while
//! it exists; a fork handler in the child maps every registered part again over the same
//! addresses, `MAP_PRIVATE` from the same memfd. The child still reads whatever it inherited
//! (a batch it holds, the bytes the parent writes later into pages it has not written), and
//! what it writes stays its own, as with the rest of its memory. It then points the part's
//! descriptor at `/dev/null`, so it holds no way back into the parent's arena either.
//!
//! Other writable shared mappings are registered read-only ([`register_read_only`]): a child
//! can read them but not write them. (The segments of workers the main process has mapped
//! are kept out of children altogether: `shm::Mapping::from_fd`.)
//!
//! Boundary: this module says what a forked child sees of shared memory; whether a fork
//! happened is [`crate::system::forks`]'s.
//!
//! Invariants:
//! - A registration is live from before its part is mapped until before it is unmapped
//!   ([`Registration::unmapping`]): a child never maps over a range that no longer belongs to
//!   the arena, and a range mapped over that was still reserved is harmless. From then until
//!   it is dropped, a child only lets go of the descriptor; the owner points the descriptor
//!   at `/dev/null` itself before dropping the registration and closing it
//!   ([`let_go_of`]), so a child never redirects a descriptor number that was closed and
//!   reused for another file.
//! - The child handler only reads atomics and makes `mmap`, `open`, `dup2` and `close`
//!   calls: async-signal-safe, as a fork handler must be.
//! - If the private mapping cannot be made (strict overcommit refusing its size), the part is
//!   mapped read-only instead: a stray write in the child faults rather than reaching the
//!   parent. If the table is full, a part goes unregistered and its children share it as
//!   before (counted in [`unregistered`]).

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

const CAPACITY: usize = 256;
const FREE: u8 = 0;
const FILLING: u8 = 1;
const LIVE: u8 = 2;
/// The range is being unmapped: a child leaves it, but still lets go of the descriptor.
const DESCRIPTOR_ONLY: u8 = 3;

struct Entry {
    state: AtomicU8,
    addr: AtomicUsize,
    len: AtomicUsize,
    fd: AtomicI32,
}

#[allow(clippy::declare_interior_mutable_const)] // (the initializer of each table entry)
const EMPTY: Entry = Entry {
    state: AtomicU8::new(FREE),
    addr: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    fd: AtomicI32::new(-1),
};

static TABLE: [Entry; CAPACITY] = [EMPTY; CAPACITY];
static HANDLER: Once = Once::new();
static UNREGISTERED: AtomicU64 = AtomicU64::new(0);

/// A part of an arena that forked children get privately; unregistered when dropped.
#[derive(Debug)]
pub struct Registration(Option<usize>);

/// Registers `len` bytes at `addr`, mapped (or about to be) `MAP_SHARED` from offset 0 of
/// memfd `fd`, which stays open for as long as the registration lives (-1: see
/// [`register_read_only`]).
pub fn register(addr: usize, len: usize, fd: i32) -> Registration {
    HANDLER.call_once(|| {
        // SAFETY: `in_child` is an `extern "C"` function without arguments that lives for the
        // whole program and keeps to async-signal-safe calls; no prepare or parent handler.
        // If registering fails (out of memory), children share the arena as without this.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    for (i, entry) in TABLE.iter().enumerate() {
        if entry.state.compare_exchange(FREE, FILLING, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            entry.addr.store(addr, Ordering::Relaxed);
            entry.len.store(len, Ordering::Relaxed);
            entry.fd.store(fd, Ordering::Relaxed);
            entry.state.store(LIVE, Ordering::Release);
            return Registration(Some(i));
        }
    }
    UNREGISTERED.fetch_add(1, Ordering::Relaxed);
    Registration(None)
}

/// Registers `len` bytes at `addr`, a writable shared mapping that forked children get
/// read-only (their descriptors are left as they are).
pub fn register_read_only(addr: usize, len: usize) -> Registration {
    register(addr, len, -1)
}

impl Registration {
    /// The range is about to be unmapped: children forked from now on leave it alone.
    pub fn unmapping(&self) {
        if let Some(i) = self.0 {
            TABLE[i].state.store(DESCRIPTOR_ONLY, Ordering::Release);
        }
    }
}

/// Points `fd` at `/dev/null` (its number stays open, the file behind it is let go), as a
/// child does; false if `/dev/null` cannot be opened.
pub fn let_go_of(fd: i32) -> bool {
    // SAFETY: a constant NUL-terminated path; plain flags.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if null < 0 {
        return false;
    }
    // SAFETY: both are descriptors of this process, `fd` owned by the caller; `null` is ours.
    unsafe {
        libc::dup3(null, fd, libc::O_CLOEXEC);
        libc::close(null);
    }
    true
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(i) = self.0.take() {
            TABLE[i].state.store(FREE, Ordering::Release);
        }
    }
}

/// Parts that found the table full (their children share them).
pub fn unregistered() -> u64 {
    UNREGISTERED.load(Ordering::Relaxed)
}

extern "C" fn in_child() {
    let mut null = -1;
    for entry in TABLE.iter() {
        let state = entry.state.load(Ordering::Acquire);
        if state != LIVE && state != DESCRIPTOR_ONLY {
            continue;
        }
        let fd = entry.fd.load(Ordering::Relaxed);
        if fd < 0 {
            let (addr, len) =
                (entry.addr.load(Ordering::Relaxed), entry.len.load(Ordering::Relaxed));
            // SAFETY: `[addr, addr+len)` is a live mapping of the parent's at the moment of the
            // fork (registered while mapped), so of this child's; only its protection changes.
            unsafe { libc::mprotect(addr as *mut libc::c_void, len, libc::PROT_READ) };
            continue;
        }
        if state == LIVE {
            let addr = entry.addr.load(Ordering::Relaxed);
            // SAFETY: `[addr, addr+len)` is the registered part, mapped from `fd` in the
            // parent at the moment of the fork and so in this child (see the invariants).
            unsafe { privatize(addr, entry.len.load(Ordering::Relaxed), fd) };
        }
        if null < 0 {
            // SAFETY: a constant NUL-terminated path; plain flags.
            null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        }
        if null >= 0 {
            // SAFETY: both are descriptors of this process; `fd` keeps its number (the
            // arena's owner closes it once) but no longer names the parent's memfd.
            unsafe { libc::dup3(null, fd, libc::O_CLOEXEC) };
        }
    }
    if null >= 0 {
        // SAFETY: opened above, and ours alone.
        unsafe { libc::close(null) };
    }
}

/// Maps `[addr, addr+len)` again from offset 0 of `fd`, privately (read-only and shared if
/// a private mapping is refused).
///
/// # Safety
/// The range must be a mapping of `fd` from offset 0, in a single-threaded process (a
/// forked child): replacing it with a mapping of the same file at the same place keeps every
/// pointer into it valid, and nothing else maps or unmaps meanwhile.
unsafe fn privatize(addr: usize, len: usize, fd: i32) {
    let at = addr as *mut libc::c_void;
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let private = libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE;
    // SAFETY: see the function's contract.
    if unsafe { libc::mmap(at, len, rw, private, fd, 0) } == libc::MAP_FAILED {
        // SAFETY: as above.
        unsafe { libc::mmap(at, len, libc::PROT_READ, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0) };
    }
}

#[cfg(test)]
mod tests;
