//! A zero-copy worker's window onto the main process's arena: one mapping of a few of its
//! extents, kept between batches but inaccessible except while a batch is written into it.
//!
//! In zero-copy mode a worker writes each batch straight into a slot of the arena (a memfd of
//! the main process's). Mapping the slot's pages per batch, faulting them in and unmapping them
//! afterwards is slow for a large batch (the figures: "a worker's kept windows" in
//! `docs/performance.md`). A [`Window`] maps a stretch of the file once, faults it in, and
//! makes it `PROT_NONE`: the page-table entries stay, so [`Window::open`]ing the pages of the
//! next batch's slot is one `mprotect` (the main process hands the worker the same extents
//! again when it can: [`crate::allocation::extents::ExtentMap::alloc_preferring`]), and a stray
//! write between batches, or into bytes that are not this batch's slot, still faults.
//!
//! Where the processor and the kernel have memory protection keys ([`crate::system::pkeys`]), a
//! window gets a key of its own and a range can be opened *keyed*: its pages are made readable
//! and writable under that key once, and kept so between batches, while each thread's access to
//! the key is off but between [`Window::allow`] and [`Window::deny`] (or [`Window::close`]) on
//! the thread that writes. Reopening the same range then changes no page-table entry: a stray
//! write between batches still faults, from any thread, and so does a write while the writing
//! thread runs code of the caller's with access switched off (a streamed batch's next sample
//! being made).
//!
//! A window can be mapped without its pages faulted in ([`Window::unfaulted`]: one `mmap`,
//! cheap), and faulted in later by another thread ([`Window::fault_in_privately`]): a
//! fresh worker maps the windows of its next slots while it holds the arena's descriptor for
//! its first one, and a thread of its own faults them in while it collates. Where the window
//! has a key, its pages are writable during that fault-in under the key alone, which only the
//! faulting thread switches on: no other thread of the worker can reach them, ever, before a
//! batch's range is opened.
//!
//! Invariants:
//! - A window owns exactly one `MAP_SHARED` mapping of `len > 0` bytes (whole pages) of a
//!   memfd sealed against shrinking, from a page-aligned file offset, with `offset + len` no
//!   more than the file's size when it was mapped (checked with `fstat` after the seals): the
//!   file can never shrink under it, so no access of a mapped page raises `SIGBUS`. The
//!   descriptor is only borrowed to map it. Dropping the window unmaps the range once, in
//!   pieces ([`crate::memory::shm::unmap_in_chunks`]); nothing else unmaps it.
//! - Every page is `PROT_NONE` except (a) between an [`Window::open`] and the next successful
//!   [`Window::close`], the pages of the one range opened (rounded out to pages), and (b) on a
//!   window with a key, the *armed* range: the pages of the last range opened keyed, readable
//!   and writable under the window's key, which stay so after the close. A range opened
//!   plainly is under key 0 (any thread may write it while it is open); a window opened
//!   plainly has no armed range. At most one range is open at a time. Protections change in
//!   pieces of [`crate::memory::shm::MM_CALL_BYTES`] (each `mprotect` call holds the process's
//!   address-space lock, as `munmap` does).
//! - Every page is faulted in before any range is opened: [`Window::open`] faults in a window
//!   that is not yet ([`Window::is_faulted`]) first, under the lock, so an opener waits for a
//!   fault-in under way on another thread instead of writing through page faults.
//! - A thread has access to a window's key only between [`Window::allow`] and the next
//!   [`Window::deny`] or [`Window::close`] on that thread, while a keyed range is open, and
//!   while [`Window::fault_in_privately`] (or the fault-in of a window with a key) runs on it,
//!   under the window's lock: the whole window is readable and writable under the key then,
//!   and `PROT_NONE` again before the lock is let go. A
//!   close on another thread than the one allowed makes the armed range `PROT_NONE` (that
//!   thread's access can only be switched off by itself), and a window dropped while a thread
//!   may still have access keeps its key allocated for good, so that no later window gets it.
//! - Views (the Python buffer exports) are counted; [`Window::close`] changes nothing while
//!   one is alive, so a view is never made inaccessible under a writer that was handed it.
//!   The open range, the armed range and the count change only under the window's lock.
//! - Forked children do not inherit the mapping (`MADV_DONTFORK`); where the kernel refuses
//!   the advice, they get it read-only ([`crate::memory::forked_child`]), never writable.
//! - Only the process that mapped the window acts on its addresses. A copy of the value in a
//!   forked child (a Python object inherited with its parent's memory) names addresses the
//!   child does not have mapped as the window, or has since used for something else: there
//!   it opens nothing, exports no view and unmaps nothing when dropped.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::memory::forked_child;
use crate::memory::shm::{
    check_range, check_sealed, page_size, prefault_shared, unmap_in_chunks, MM_CALL_BYTES,
};
use crate::system::pkeys::{self, Key};

mod access;

/// A mapping of `[offset, offset + len)` of an arena memfd, inaccessible but for the range
/// opened.
pub struct Window {
    ptr: NonNull<u8>,
    len: usize,
    /// The file offset of the mapping's first byte.
    offset: usize,
    state: Mutex<State>,
    /// Set only where `MADV_DONTFORK` was refused: children get the window read-only.
    read_only_in_children: Option<forked_child::Registration>,
    /// The process that mapped it (see the invariants).
    owner: u32,
    /// The window's protection key, where the machine has them and one was left.
    key: Option<Key>,
}

/// What the lock guards.
#[derive(Debug, Default)]
struct State {
    /// The pages open for the batch being written, `[start, end)` from the mapping's first
    /// byte.
    open: Option<(usize, usize)>,
    /// Whether the open range is the armed one (its access switched per thread).
    keyed: bool,
    /// The pages readable and writable under the window's key, kept between batches.
    armed: Option<(usize, usize)>,
    /// The thread whose access to the key is on, if one's is.
    allowed: Option<std::thread::ThreadId>,
    /// Views alive.
    views: usize,
    /// Whether every page has been faulted in (see the invariants).
    faulted: bool,
}

// SAFETY: the window is a mapping owned by this value; its open range and view count change
// only under its lock, and who writes which bytes when is for the holders of its pointer to
// coordinate (one worker writing one batch), as for `shm::Mapping`.
unsafe impl Send for Window {}
// SAFETY: as above: `&Window` changes nothing but under its lock.
unsafe impl Sync for Window {}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("key", &self.key.as_ref().map(Key::id))
            .field("state", &*self.state.lock())
            .finish()
    }
}

impl Window {
    /// Maps `len` bytes (a whole number of pages, at least one) of the file behind `fd`
    /// (only borrowed) from file offset `offset` (page-aligned), shared; faults every page in
    /// ([`Window::fault_in`]), leaving them all inaccessible. Fails unless the file is a memfd
    /// sealed against shrinking at least `offset + len` bytes long.
    pub fn new(fd: BorrowedFd<'_>, offset: usize, len: usize) -> Result<Self> {
        let window = Window::unfaulted(fd, offset, len)?;
        window.fault_in()?;
        Ok(window)
    }

    /// As [`Window::new`], but nothing is faulted in: the mapping is made inaccessible
    /// (`PROT_NONE`) and its pages are faulted in later, by [`Window::fault_in_privately`] on
    /// another thread, or by the first [`Window::open`].
    pub fn unfaulted(fd: BorrowedFd<'_>, offset: usize, len: usize) -> Result<Self> {
        let page = page_size();
        if len == 0 || len % page != 0 || offset % page != 0 {
            return Err(Error::Invalid(format!(
                "a window must start on a page boundary and be a whole number of pages \
                 ({page} bytes), not {len} bytes from offset {offset}"
            )));
        }
        check_sealed(fd)?;
        let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat", e))?;
        let size = usize::try_from(st.st_size).unwrap_or(0);
        check_range("arena file", offset, len, size)?;
        // (Fits, being inside the file, whose size an `off_t` holds.)
        let file_offset = libc::off_t::try_from(offset).map_err(|_| Error::OutOfRange {
            what: "arena file",
            offset,
            len,
            size,
        })?;
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of `len` bytes of a file at
        // least `offset + len` bytes long that cannot shrink; it aliases no Rust object.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                file_offset,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::last_os("mmap"));
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(Error::Os { call: "mmap", errno: 0 })?;
        // From here on, dropping `window` unmaps the range.
        let mut window = Window {
            ptr,
            len,
            offset,
            state: Mutex::new(State::default()),
            read_only_in_children: Some(forked_child::register_read_only(
                ptr.as_ptr() as usize,
                len,
            )),
            owner: std::process::id(),
            key: None,
        };
        window.keep_from_children();
        window.key = Key::alloc();
        Ok(window)
    }

    /// Faults every page in on the calling thread (at once if they are already), leaving them
    /// inaccessible. On a window with a key they are writable meanwhile under the key alone
    /// (this thread's access switched on for it); on one without, by every thread of the
    /// process for that while. Refused in a forked child (see the invariants).
    pub fn fault_in(&self) -> Result<()> {
        self.refuse_if_not_ours()?;
        let mut state = self.state.lock();
        self.populate(&mut state, false).map(|_| ())
    }

    /// Faults every page in on the calling thread without any other thread ever being able
    /// to reach them, where the window has a key (see [`Window::fault_in`]); true once they
    /// are faulted in (now or before). Does nothing and returns false on a window without a
    /// key: its pages would be writable by every thread while they are faulted in.
    pub fn fault_in_privately(&self) -> Result<bool> {
        self.refuse_if_not_ours()?;
        let mut state = self.state.lock();
        self.populate(&mut state, true)
    }

    /// Whether every page has been faulted in.
    pub fn is_faulted(&self) -> bool {
        self.state.lock().faulted
    }

    /// Whether every page has been faulted in, known without waiting: false while another
    /// thread holds the window (faulting it in, say).
    pub fn is_faulted_now(&self) -> bool {
        self.state.try_lock().is_some_and(|state| state.faulted)
    }

    /// Faults the whole window in, under the lock (see [`Window::fault_in`]); with `privately`,
    /// only where it has a key (false where not).
    fn populate(&self, state: &mut State, privately: bool) -> Result<bool> {
        if state.faulted {
            return Ok(true);
        }
        // (A range is opened only once the window is faulted in: nothing is open or armed.)
        debug_assert!(state.open.is_none() && state.armed.is_none());
        let (len, ptr) = (self.len, self.ptr.as_ptr());
        let done = match &self.key {
            Some(key) => {
                self.protect(0, len, libc::PROT_READ | libc::PROT_WRITE, Some(key.id()))
                    .inspect_err(|_| {
                        let _ = self.protect(0, len, libc::PROT_NONE, None);
                    })?;
                let had = pkeys::allowed(key);
                pkeys::allow(key);
                // SAFETY: the range is this window's own shared mapping, readable and writable
                // (under its key, which this thread has access to now), of a file that holds
                // all of it.
                let done = unsafe { prefault_shared(ptr, len) };
                if !had {
                    pkeys::deny(key);
                }
                done
            }
            None if privately => return Ok(false),
            None => {
                self.protect(0, len, libc::PROT_READ | libc::PROT_WRITE, None).inspect_err(
                    |_| {
                        let _ = self.protect(0, len, libc::PROT_NONE, None);
                    },
                )?;
                // SAFETY: as above, readable and writable by every thread for this while.
                unsafe { prefault_shared(ptr, len) }
            }
        };
        // (The pages keep the window's key, if it has one; no thread's access to it is on.)
        self.protect(0, len, libc::PROT_NONE, None)?;
        done?;
        state.faulted = true;
        Ok(true)
    }

    fn refuse_if_not_ours(&self) -> Result<()> {
        if self.is_ours() {
            return Ok(());
        }
        Err(Error::Invalid(
            "this window was mapped by the process this one was forked from: it is not mapped \
             here"
                .into(),
        ))
    }

    /// Leaves the mapping out of children forked from now on (`MADV_DONTFORK`), as
    /// `shm::Mapping` does with a worker's segment; where the kernel refuses, the read-only
    /// registration stays.
    fn keep_from_children(&mut self) {
        // SAFETY: `[ptr, ptr+len)` is exactly this window's mapping; the advice changes only
        // what a later fork copies.
        let advised =
            unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTFORK) };
        if advised == 0 {
            self.read_only_in_children = None;
        }
    }

    /// Sets the protection of `[start, end)` (whole pages, from the first byte) to `prot`, in
    /// pieces of [`MM_CALL_BYTES`], and its pages' key to `key` where one is given (else the
    /// pages keep theirs).
    fn protect(&self, start: usize, end: usize, prot: libc::c_int, key: Option<u32>) -> Result<()> {
        debug_assert!(start <= end && end <= self.len && start % page_size() == 0);
        let mut at = start;
        while at < end {
            let n = MM_CALL_BYTES.min(end - at);
            // SAFETY: `[at, at+n)` lies inside this window's own mapping and starts on a page
            // boundary; only the protection (and the key) changes. No reference into the
            // range exists on our side; a view's holder that touches pages made inaccessible
            // faults, by design, and a view is never closed under (see the module's
            // invariants).
            let done = unsafe {
                let addr = self.ptr.as_ptr().add(at);
                match key {
                    Some(key) => pkeys::protect(addr, n, prot, key),
                    None => libc::mprotect(addr.cast(), n, prot) == 0,
                }
            };
            if !done {
                return Err(Error::last_os(if key.is_some() {
                    "pkey_mprotect"
                } else {
                    "mprotect"
                }));
            }
            at += n;
        }
        Ok(())
    }

    /// The file offset of the window's first byte.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: windows are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The window's first byte (file offset [`Window::offset`]). Only the open range may be
    /// touched.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether the file's bytes `[offset, offset + nbytes)` lie inside the window.
    pub fn contains(&self, offset: usize, nbytes: usize) -> bool {
        offset >= self.offset
            && offset.checked_add(nbytes).is_some_and(|end| end <= self.offset + self.len)
    }

    /// Whether the window has a protection key (so that [`Window::open`] with `keyed` keeps
    /// the range's pages writable between batches and access is switched per thread).
    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// Whether this is the process that mapped the window (not a child forked from it).
    pub fn is_ours(&self) -> bool {
        std::process::id() == self.owner
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // Children forked from now on leave the range alone (before it can be reused).
        self.read_only_in_children = None;
        let key = self.key.take();
        if !self.is_ours() {
            std::mem::forget(key); // (a copy of the parent's: the number is not ours to free)
            return; // a forked child's copy: the range is not this window's here
        }
        // SAFETY: `ptr`/`len` describe exactly the mapping made in `new`, in the process
        // that made it (checked above), unmapped only here; no view can be alive (each holds
        // its owner, and so this window, alive).
        unsafe { unmap_in_chunks(self.ptr.as_ptr(), self.len) };
        if let Some(key) = key {
            let state = self.state.get_mut();
            if let Some(thread) = state.allowed {
                if thread != std::thread::current().id() {
                    // That thread may still have access to the key: never hand it out again.
                    std::mem::forget(key);
                    return;
                }
                pkeys::deny(&key);
            }
            drop(key);
        }
    }
}

#[cfg(test)]
mod tests;
