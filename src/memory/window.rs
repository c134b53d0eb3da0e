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
//!   it opens nothing, exports no view, drops no page tables, and unmaps nothing when dropped.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::memory::forked_child;
use crate::memory::shm::{
    check_range, check_sealed, drop_page_tables_of, page_size, prefault_shared, unmap_in_chunks,
    MM_CALL_BYTES,
};
use crate::system::pkeys::{self, Key};

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

    /// Makes the pages holding the file's bytes `[offset, offset + nbytes)` (inside the
    /// window, at least one byte) readable and writable. Refused while a range is open.
    ///
    /// With `keyed`, on a window that has a key, the pages are made so under the key (at
    /// once, if they are the armed range already), and only threads that [`Window::allow`]
    /// it may touch them; without, or on a window without a key, by any thread, until
    /// [`Window::close`].
    pub fn open(&self, offset: usize, nbytes: usize, keyed: bool) -> Result<()> {
        self.refuse_if_not_ours()?;
        if nbytes == 0 {
            return Err(Error::Invalid("cannot open an empty range of a window".into()));
        }
        if !self.contains(offset, nbytes) {
            return Err(Error::Invalid(format!(
                "bytes [{offset}, {offset}+{nbytes}) of the file are not all inside the window \
                 [{}, {})",
                self.offset,
                self.offset + self.len
            )));
        }
        let mut state = self.state.lock();
        if let Some((start, end)) = state.open {
            return Err(Error::Invalid(format!(
                "bytes [{}, {}) of the window are open already: close() it first",
                self.offset + start,
                self.offset + end
            )));
        }
        self.populate(&mut state, false)?;
        let page = page_size();
        let from = offset - self.offset;
        let start = from / page * page;
        // (At most `len`: the window is whole pages, and the range inside it.)
        let end = (from + nbytes).div_ceil(page) * page;
        match (&self.key, keyed) {
            (Some(key), true) => {
                if state.armed != Some((start, end)) {
                    self.disarm(&mut state)?;
                    if let Err(err) =
                        self.protect(start, end, libc::PROT_READ | libc::PROT_WRITE, Some(key.id()))
                    {
                        let _ = self.protect(start, end, libc::PROT_NONE, None);
                        return Err(err);
                    }
                    state.armed = Some((start, end));
                }
                state.keyed = true;
            }
            (key, _) => {
                self.disarm(&mut state)?;
                // (Under key 0 on a window with a key: any thread may write it.)
                let plain = key.as_ref().map(|_| 0);
                if let Err(err) =
                    self.protect(start, end, libc::PROT_READ | libc::PROT_WRITE, plain)
                {
                    // Whatever pieces were opened are closed again (best effort: the error is
                    // the first failure's).
                    let _ = self.protect(start, end, libc::PROT_NONE, None);
                    return Err(err);
                }
                state.keyed = false;
            }
        }
        state.open = Some((start, end));
        Ok(())
    }

    /// Makes the armed range inaccessible (`PROT_NONE`: no thread's rights reach it then).
    fn disarm(&self, state: &mut State) -> Result<()> {
        if let Some((start, end)) = state.armed {
            self.protect(start, end, libc::PROT_NONE, None)?;
            state.armed = None;
        }
        Ok(())
    }

    /// Switches the calling thread's access to the open range on, where it was opened keyed
    /// (elsewhere every thread has it while the range is open: nothing to do).
    pub fn allow(&self) -> Result<()> {
        let mut state = self.state.lock();
        let (Some(key), true, Some(_)) = (&self.key, state.keyed, state.open) else {
            return Ok(());
        };
        let me = std::thread::current().id();
        if let Some(other) = state.allowed {
            if other != me {
                return Err(Error::Invalid(
                    "another thread has access to this window: one writer at a time".into(),
                ));
            }
        }
        pkeys::allow(key);
        state.allowed = Some(me);
        Ok(())
    }

    /// Switches the calling thread's access to the window's key off (nothing to do where it
    /// has none).
    pub fn deny(&self) {
        let mut state = self.state.lock();
        if let Some(key) = &self.key {
            pkeys::deny(key);
            if state.allowed == Some(std::thread::current().id()) {
                state.allowed = None;
            }
        }
    }

    /// The file offsets `[start, end)` of the pages open, if a range is.
    pub fn open_range(&self) -> Option<(usize, usize)> {
        self.state.lock().open.map(|(start, end)| (self.offset + start, self.offset + end))
    }

    /// The file offsets `[start, end)` of the armed range (see the module's invariants).
    pub fn armed_range(&self) -> Option<(usize, usize)> {
        self.state.lock().armed.map(|(start, end)| (self.offset + start, self.offset + end))
    }

    /// Makes the whole window inaccessible again: the open range's pages, or, for a range
    /// opened keyed, the calling thread's access (the pages stay armed for the next batch).
    /// Returns false, changing nothing, while a view is alive ([`Window::add_view`]); true
    /// once closed (at once, if nothing was open).
    pub fn close(&self) -> Result<bool> {
        if !self.is_ours() {
            return Ok(true); // (nothing of it is mapped here)
        }
        let mut state = self.state.lock();
        if state.views > 0 {
            return Ok(false);
        }
        if let Some((start, end)) = state.open {
            // (On failure the range stays recorded as open: a later close tries again.)
            if state.keyed {
                if let Some(key) = &self.key {
                    pkeys::deny(key);
                }
                let me = std::thread::current().id();
                if state.allowed.is_some_and(|t| t != me) {
                    // Only that thread can switch its own access off.
                    self.disarm(&mut state)?;
                }
            } else {
                self.protect(start, end, libc::PROT_NONE, None)?;
            }
            state.allowed = None;
            state.keyed = false;
            state.open = None;
        }
        Ok(true)
    }

    /// Counts one more view of the whole window (a buffer export); returns its first byte.
    pub fn add_view(&self) -> *mut u8 {
        self.state.lock().views += 1;
        self.ptr.as_ptr()
    }

    /// Ends one view counted by [`Window::add_view`].
    pub fn remove_view(&self) {
        let mut state = self.state.lock();
        state.views = state.views.saturating_sub(1);
    }

    /// Views alive.
    pub fn views(&self) -> usize {
        self.state.lock().views
    }

    /// Drops this process's page-table entries for the whole window (`MADV_DONTNEED`, in
    /// pieces of [`MM_CALL_BYTES`]), open or not: the bytes stay in the file, and the next
    /// access of an open page faults it back in. What it saves is the teardown of the entries
    /// at `munmap` or at the process's exit.
    pub fn drop_page_tables(&self) -> Result<()> {
        if !self.is_ours() {
            return Ok(()); // (nothing of it is mapped here)
        }
        // SAFETY: the window's own page-aligned `MAP_SHARED` file mapping (in the process
        // that mapped it: checked above).
        unsafe { drop_page_tables_of(self.ptr.as_ptr(), self.len) }
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
mod tests {
    use std::os::fd::AsFd;

    use rustix::fs::MemfdFlags;

    use super::*;
    use crate::memory::shm::Mapping;

    /// One mapping (VMA) of this process, from `/proc/self/smaps`.
    #[derive(Debug)]
    struct Vma {
        start: usize,
        end: usize,
        perms: String,
        path: String,
        rss: usize,
        flags: Vec<String>,
        pkey: Option<u32>,
    }

    /// The mappings of this process that overlap `[addr, addr + len)`.
    fn vmas(addr: usize, len: usize) -> Vec<Vma> {
        let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut all: Vec<Vma> = Vec::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let first = words.next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                if let (Ok(start), Ok(end)) =
                    (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    let perms = words.next().unwrap_or("").to_owned();
                    let path = words.nth(3).unwrap_or("").to_owned();
                    all.push(Vma {
                        start,
                        end,
                        perms,
                        path,
                        rss: 0,
                        flags: Vec::new(),
                        pkey: None,
                    });
                    continue;
                }
            }
            let Some(vma) = all.last_mut() else { continue };
            match first {
                "Rss:" => vma.rss = words.next().unwrap().parse::<usize>().unwrap() * 1024,
                "VmFlags:" => vma.flags = words.map(str::to_owned).collect(),
                "ProtectionKey:" => vma.pkey = words.next().and_then(|k| k.parse().ok()),
                _ => {}
            }
        }
        all.retain(|v| v.start < addr + len && addr < v.end);
        all
    }

    /// The protections of the window's pages, page by page (`"rw-s"`, `"---s"`).
    fn page_perms(w: &Window) -> Vec<String> {
        per_page(w, |v| v.perms.clone())
    }

    /// The protection keys of the window's pages, page by page (None where smaps shows none).
    fn page_keys(w: &Window) -> Vec<Option<u32>> {
        per_page(w, |v| v.pkey)
    }

    /// `what` of the mapping holding each of the window's pages, page by page.
    fn per_page<T>(w: &Window, what: impl Fn(&Vma) -> T) -> Vec<T> {
        let base = w.as_ptr() as usize;
        let found = vmas(base, w.len());
        (0..w.len() / page_size())
            .map(|i| {
                let at = base + i * page_size();
                what(found.iter().find(|v| v.start <= at && at < v.end).unwrap())
            })
            .collect()
    }

    /// Whether the machine must have protection keys for these tests (set where it does, so
    /// that the keyed tests cannot pass by finding none): `PINPOOL_REQUIRE_PKEYS=1`.
    fn keys_required() -> bool {
        std::env::var_os("PINPOOL_REQUIRE_PKEYS").is_some_and(|v| v == "1")
    }

    /// Whether the calling thread may write the byte at `at` now (its protection-key rights
    /// and the page's protection): the kernel writes it there for this thread, as a `read`
    /// from a pipe, and fails with `EFAULT` where the thread could not (no fault is raised).
    /// (A forked child cannot tell: windows are not mapped in children.)
    fn writes(at: *mut u8) -> bool {
        let (r, w) = rustix::pipe::pipe().unwrap();
        assert_eq!(rustix::io::write(&w, &[0xEE]).unwrap(), 1);
        // SAFETY: `read` writes at most one byte at `at`, an address of the test's window; the
        // kernel checks the access and fails instead of faulting.
        let got = unsafe { libc::read(r.as_raw_fd(), at.cast(), 1) };
        if got < 0 {
            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));
        }
        got == 1
    }

    /// A sealed memfd of `pages` pages, each filled with its own number plus one.
    fn arena(pages: usize) -> Mapping {
        named_arena("pinpool-window-test", pages)
    }

    fn named_arena(name: &str, pages: usize) -> Mapping {
        let m = Mapping::memfd(name, pages * page_size()).unwrap();
        for i in 0..pages {
            // SAFETY: page `i` lies inside the test's own writable mapping.
            unsafe {
                std::ptr::write_bytes(m.as_ptr().add(i * page_size()), i as u8 + 1, page_size())
            };
        }
        m
    }

    fn byte(m: &Mapping, at: usize) -> u8 {
        assert!(at < m.len());
        // SAFETY: inside the test's own readable mapping.
        unsafe { m.as_ptr().add(at).read_volatile() }
    }

    #[test]
    // Miri: memfds, mmap and mprotect are foreign calls Miri cannot run.
    #[cfg_attr(miri, ignore)]
    fn a_window_is_mapped_populated_inaccessible_and_kept_from_children() {
        let p = page_size();
        let m = arena(8);
        let w = Window::new(m.fd().unwrap(), 2 * p, 4 * p).unwrap();
        assert_eq!((w.offset(), w.len(), w.open_range(), w.views()), (2 * p, 4 * p, None, 0));
        let found = vmas(w.as_ptr() as usize, w.len());
        assert_eq!(found.iter().map(|v| v.end - v.start).sum::<usize>(), 4 * p);
        assert_eq!(found.iter().map(|v| v.rss).sum::<usize>(), 4 * p, "not populated: {found:?}");
        for v in &found {
            assert_eq!(v.perms, "---s", "{found:?}");
            assert!(v.flags.iter().any(|f| f == "dc"), "inherited by children: {found:?}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn faulted_now_is_known_without_waiting_for_the_window() {
        let p = page_size();
        let m = arena(4);
        let w = Window::unfaulted(m.fd().unwrap(), 0, 2 * p).unwrap();
        assert!(!w.is_faulted_now() && !w.is_faulted());
        w.open(0, 1, false).unwrap(); // (faults it in)
        assert!(w.close().unwrap());
        assert!(w.is_faulted_now() && w.is_faulted());
        let held = w.state.lock();
        assert!(!w.is_faulted_now(), "held by another caller: not known now, so false");
        drop(held);
        assert!(w.is_faulted_now());
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn an_unfaulted_window_maps_nothing_in_until_faulted_or_opened() {
        let p = page_size();
        let m = arena(8);
        let w = Window::unfaulted(m.fd().unwrap(), 2 * p, 4 * p).unwrap();
        let rss = |w: &Window| vmas(w.as_ptr() as usize, w.len()).iter().map(|v| v.rss).sum();
        assert!(!w.is_faulted());
        assert_eq!(rss(&w), 0usize, "faulted in at once");
        assert_eq!(page_perms(&w), vec!["---s".to_owned(); 4]);
        // Faulted in privately only where it has a key; otherwise left for the opener.
        let private = w.fault_in_privately().unwrap();
        assert_eq!(private, w.has_key());
        assert!(private || !keys_required(), "no protection key for the window");
        assert_eq!((w.is_faulted(), rss(&w)), (private, if private { 4 * p } else { 0 }));
        assert_eq!(page_perms(&w), vec!["---s".to_owned(); 4], "inaccessible once faulted");
        // The first open faults in whatever is not yet, and reads what the file holds.
        w.open(3 * p, p, false).unwrap();
        assert!(w.is_faulted());
        assert_eq!(rss(&w), 4 * p);
        // SAFETY: the open page, inside the window.
        assert_eq!(unsafe { w.as_ptr().add(p).read_volatile() }, 4);
        w.close().unwrap();
        assert_eq!(w.fault_in_privately(), Ok(true), "once faulted, nothing more to do");
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_window_faulted_in_privately_is_never_reachable_from_another_thread() {
        let p = page_size();
        let pages = 2048; // (8 MiB: the fault-in takes a while)
        let m = Mapping::memfd("pinpool-window-test", pages * p).unwrap();
        let w = Window::unfaulted(m.fd().unwrap(), 0, pages * p).unwrap();
        if !w.has_key() {
            assert!(!keys_required(), "no protection key for the window");
            assert_eq!(w.fault_in_privately(), Ok(false));
            assert!(!w.is_faulted(), "faulted in where every thread could have written it");
            return;
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        let (mut probes, mut reached) = (0, 0);
        std::thread::scope(|s| {
            s.spawn(|| {
                assert_eq!(w.fault_in_privately(), Ok(true));
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            // This thread probes the pages while the other faults them in.
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                for i in (0..pages).step_by(97) {
                    probes += 1;
                    // SAFETY: an address inside the window; `writes` faults nothing.
                    reached += usize::from(writes(unsafe { w.as_ptr().add(i * p) }));
                }
            }
        });
        assert_eq!(reached, 0, "reached {reached} times of {probes} while faulted in");
        assert!(w.is_faulted());
        assert!(page_keys(&w).iter().all(|k| *k == w.key.as_ref().map(Key::id)));
        // The faulting thread's access went with it; this one never had it.
        w.open(p, p, true).unwrap();
        // SAFETY: inside the window; `writes` faults nothing.
        assert!(!writes(unsafe { w.as_ptr().add(p) }), "open keyed, access off");
        w.allow().unwrap();
        // SAFETY: as above.
        assert!(writes(unsafe { w.as_ptr().add(p) }));
        w.close().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn an_open_range_is_written_through_to_the_file_and_closed_again() {
        let p = page_size();
        let m = arena(8);
        let w = Window::new(m.fd().unwrap(), 2 * p, 4 * p).unwrap();
        // File bytes [3p + 10, 4p + 1): file pages 3 and 4, window pages 1 and 2.
        w.open(3 * p + 10, p - 9, false).unwrap();
        assert_eq!(w.open_range(), Some((3 * p, 5 * p)));
        assert_eq!(page_perms(&w), ["---s", "rw-s", "rw-s", "---s"]);
        // SAFETY: window bytes [p + 10, 2p + 1) are open; the test alone touches them.
        unsafe {
            let at = w.as_ptr().add(p + 10);
            assert_eq!(at.read_volatile(), 4, "the file's page 3 as it was");
            std::ptr::write_bytes(at, 0xAB, p - 9);
        }
        assert_eq!(byte(&m, 3 * p + 9), 4);
        assert!((3 * p + 10..4 * p + 1).all(|i| byte(&m, i) == 0xAB), "not in the file");
        assert_eq!(byte(&m, 4 * p + 1), 5);
        // One range at a time.
        let again = w.open(2 * p, 1, false).unwrap_err();
        assert!(again.to_string().contains("open already"), "{again}");
        assert_eq!(page_perms(&w), ["---s", "rw-s", "rw-s", "---s"]);
        assert_eq!(w.close(), Ok(true));
        assert_eq!(w.open_range(), None);
        assert_eq!(page_perms(&w), ["---s"; 4]);
        assert_eq!(w.close(), Ok(true), "a second close is no error");
        // The whole window, then its last byte.
        w.open(2 * p, 4 * p, false).unwrap();
        assert_eq!(page_perms(&w), ["rw-s"; 4]);
        w.close().unwrap();
        w.open(6 * p - 1, 1, false).unwrap();
        assert_eq!(page_perms(&w), ["---s", "---s", "---s", "rw-s"]);
        // SAFETY: the window's last page is open.
        assert_eq!(unsafe { w.as_ptr().add(4 * p - 1).read_volatile() }, 6);
        w.close().unwrap();
        assert_eq!(page_perms(&w), ["---s"; 4]);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn contains_is_exact() {
        let p = page_size();
        let m = arena(8);
        let w = Window::new(m.fd().unwrap(), 2 * p, 4 * p).unwrap();
        assert!(w.contains(2 * p, 4 * p));
        assert!(w.contains(3 * p + 7, p));
        assert!(w.contains(6 * p - 1, 1));
        assert!(w.contains(6 * p, 0));
        assert!(!w.contains(2 * p - 1, 1), "starts before");
        assert!(!w.contains(2 * p, 4 * p + 1), "ends after");
        assert!(!w.contains(6 * p, 1), "past the end");
        assert!(!w.contains(0, p));
        assert!(!w.contains(3 * p, usize::MAX), "overflows");
        assert!(!w.contains(usize::MAX, 2));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn bad_windows_and_ranges_are_refused() {
        let p = page_size();
        let m = arena(8);
        let fd = m.fd().unwrap();
        let invalid = |r: Result<Window>| matches!(r, Err(Error::Invalid(_)));
        let beyond = |r: Result<Window>| matches!(r, Err(Error::OutOfRange { .. }));
        assert!(invalid(Window::new(fd, p + 1, p)), "offset not page-aligned");
        assert!(invalid(Window::new(fd, 0, 0)), "empty");
        assert!(invalid(Window::new(fd, 0, p + 1)), "not whole pages");
        assert!(beyond(Window::new(fd, 6 * p, 4 * p)), "past the file's end");
        assert!(beyond(Window::new(fd, 8 * p, p)), "starts at the file's end");
        assert!(beyond(Window::new(fd, usize::MAX / p * p, p)), "offset + len overflows");
        assert!(Window::new(fd, 4 * p, 4 * p).is_ok(), "up to the file's end");
        // Files that could shrink under the mapping.
        let unsealed =
            rustix::fs::memfd_create("pinpool-window-test", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, 4 * p as u64).unwrap();
        let err = Window::new(unsealed.as_fd(), 0, p).unwrap_err();
        assert!(err.to_string().contains("sealed"), "{err}");
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let err = Window::new(file.as_fd(), 0, p).unwrap_err();
        assert!(err.to_string().contains("sealed"), "{err}");
        // Ranges outside the window, or empty, are not opened.
        let w = Window::new(fd, 2 * p, 4 * p).unwrap();
        for (offset, nbytes) in [(p, p), (2 * p - 1, 2), (5 * p, p + 1), (6 * p, 1), (3 * p, 0)] {
            let err = w.open(offset, nbytes, false).unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "[{offset}, +{nbytes}): {err}");
            assert_eq!(w.open_range(), None);
        }
        assert_eq!(page_perms(&w), ["---s"; 4]);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn close_leaves_a_range_open_while_a_view_is_alive() {
        let p = page_size();
        let m = arena(4);
        let w = Window::new(m.fd().unwrap(), 0, 4 * p).unwrap();
        assert_eq!(w.add_view(), w.as_ptr(), "a view of a closed window");
        w.open(p, p, false).unwrap();
        assert_eq!(w.add_view(), w.as_ptr());
        assert_eq!(w.views(), 2);
        assert_eq!(w.close(), Ok(false));
        assert_eq!(w.open_range(), Some((p, 2 * p)));
        assert_eq!(page_perms(&w), ["---s", "rw-s", "---s", "---s"]);
        w.remove_view();
        assert_eq!(w.close(), Ok(false));
        w.remove_view();
        assert_eq!(w.close(), Ok(true));
        assert_eq!((w.views(), w.open_range()), (0, None));
        assert_eq!(page_perms(&w), ["---s"; 4]);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn dropping_the_page_tables_keeps_the_bytes() {
        let p = page_size();
        let m = arena(8);
        let w = Window::new(m.fd().unwrap(), 4 * p, 4 * p).unwrap();
        let rss =
            |w: &Window| vmas(w.as_ptr() as usize, w.len()).iter().map(|v| v.rss).sum::<usize>();
        w.open(5 * p, 2 * p, false).unwrap();
        // SAFETY: window pages 1 and 2 are open; the test alone touches them.
        unsafe { std::ptr::write_bytes(w.as_ptr().add(p), 0x5A, 2 * p) };
        w.drop_page_tables().unwrap(); // open
        assert_eq!(rss(&w), 0, "page tables left");
        // SAFETY: still open; the pages fault back in with the bytes written.
        assert_eq!(unsafe { w.as_ptr().add(2 * p + 3).read_volatile() }, 0x5A);
        w.close().unwrap();
        w.drop_page_tables().unwrap(); // closed
        assert_eq!(rss(&w), 0, "page tables left");
        assert_eq!(page_perms(&w), ["---s"; 4]);
        assert!((5 * p..7 * p).all(|i| byte(&m, i) == 0x5A));
        assert_eq!((byte(&m, 5 * p - 1), byte(&m, 7 * p)), (5, 8));
        w.open(4 * p, 4 * p, false).unwrap();
        // SAFETY: the whole window is open.
        let seen = unsafe { std::slice::from_raw_parts(w.as_ptr(), 4 * p) };
        assert!(seen[..p].iter().all(|&b| b == 5) && seen[3 * p..].iter().all(|&b| b == 8));
        assert!(seen[p..3 * p].iter().all(|&b| b == 0x5A));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn dropping_a_window_unmaps_it() {
        let p = page_size();
        // (A name of its own: other tests may map their files where this window was.)
        let name = "pinpool-window-drop-test";
        let m = named_arena(name, 4);
        let w = Window::new(m.fd().unwrap(), 0, 4 * p).unwrap();
        w.open(0, p, false).unwrap();
        let (addr, len) = (w.as_ptr() as usize, w.len());
        let ours = |v: &Vma| v.path.contains(name);
        assert_eq!(vmas(addr, len).iter().filter(|v| ours(v)).count(), 2, "open and closed");
        drop(w);
        let left: Vec<Vma> = vmas(addr, len).into_iter().filter(ours).collect();
        assert!(left.is_empty(), "still mapped: {left:?}");
        assert_eq!(byte(&m, 0), 1, "the file keeps its bytes");
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_keyed_range_stays_armed_and_only_a_thread_allowed_reaches_it() {
        let p = page_size();
        let m = arena(8);
        let w = Window::new(m.fd().unwrap(), 2 * p, 4 * p).unwrap();
        let at = |i: usize| {
            // SAFETY: an address inside the window (touched only as each check says).
            unsafe { w.as_ptr().add(i) }
        };
        if !w.has_key() {
            assert!(!keys_required(), "no protection key for the window");
            // No keys here: a keyed open is a plain one.
            w.open(3 * p, p, true).unwrap();
            assert_eq!(page_perms(&w), ["---s", "rw-s", "---s", "---s"]);
            w.allow().unwrap();
            w.deny();
            assert!(writes(at(p)));
            w.close().unwrap();
            assert_eq!((page_perms(&w), w.armed_range()), (vec!["---s".to_owned(); 4], None));
            assert!(!writes(at(p)));
            return;
        }
        let key = w.key.as_ref().unwrap().id();
        // Another thread, started while nobody has access.
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let (back, answers) = std::sync::mpsc::channel::<bool>();
        let other = std::thread::spawn(move || {
            for addr in rx {
                back.send(writes(addr as *mut u8)).unwrap();
            }
        });
        let other_writes = |i: usize| {
            tx.send(at(i) as usize).unwrap();
            answers.recv().unwrap()
        };
        w.open(3 * p + 5, p, true).unwrap(); // window pages 1 and 2
        assert_eq!(page_perms(&w), ["---s", "rw-s", "rw-s", "---s"]);
        assert_eq!(page_keys(&w)[1..3], [Some(key), Some(key)]);
        assert!(!writes(at(p)), "open, but this thread's access is off");
        w.allow().unwrap();
        assert!(writes(at(p)), "allowed");
        assert!(!other_writes(p), "another thread, not allowed");
        assert!(!writes(at(0)), "outside the range");
        // SAFETY: open and allowed on this thread.
        unsafe { at(p + 5).write_volatile(0x77) };
        assert_eq!(byte(&m, 3 * p + 5), 0x77);
        assert_eq!(w.close(), Ok(true));
        assert_eq!(w.armed_range(), Some((3 * p, 5 * p)), "kept armed");
        assert_eq!(page_perms(&w), ["---s", "rw-s", "rw-s", "---s"]);
        assert!(!writes(at(p)), "closed: this thread's access is off again");
        assert!(!other_writes(2 * p));
        // The same range again: nothing to change but this thread's access.
        w.open(3 * p, 2 * p, true).unwrap();
        w.allow().unwrap();
        assert!(writes(at(2 * p)));
        w.deny();
        assert!(!writes(at(2 * p)), "switched off while the range is open");
        w.close().unwrap();
        // Another range, keyed: the old one is disarmed.
        w.open(5 * p, p, true).unwrap();
        assert_eq!(page_perms(&w), ["---s", "---s", "---s", "rw-s"]);
        assert_eq!(w.armed_range(), Some((5 * p, 6 * p)));
        w.close().unwrap();
        // Opened plainly: under key 0, any thread may write it while it is open.
        w.open(2 * p, p, false).unwrap();
        assert_eq!(page_perms(&w), ["rw-s", "---s", "---s", "---s"]);
        assert_eq!(page_keys(&w)[0], Some(0));
        assert_eq!(w.armed_range(), None);
        assert!(other_writes(0));
        w.close().unwrap();
        assert_eq!(page_perms(&w), ["---s"; 4]);
        assert!(!other_writes(0));
        drop(tx);
        other.join().unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_keyed_range_closed_on_another_thread_is_disarmed() {
        let p = page_size();
        let m = arena(4);
        let w = Window::new(m.fd().unwrap(), 0, 4 * p).unwrap();
        if !w.has_key() {
            assert!(!keys_required(), "no protection key for the window");
            return; // (nothing keyed here: the plain case is the tests' above)
        }
        w.open(p, p, true).unwrap();
        w.allow().unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let err = w.allow().unwrap_err();
                assert!(err.to_string().contains("one writer"), "{err}");
                assert_eq!(w.close(), Ok(true));
            });
        });
        // This thread's access is still on, but the pages are inaccessible.
        assert_eq!((w.armed_range(), w.open_range()), (None, None));
        assert_eq!(page_perms(&w), ["---s"; 4]);
        // SAFETY: an address inside the window (the child only tries to write it).
        assert!(!writes(unsafe { w.as_ptr().add(p) }));
        w.deny();
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn copy_threads_write_a_keyed_range_with_the_callers_rights_and_keep_none() {
        let p = page_size();
        let pages = 1024; // 4 MiB: a copy the copier splits among its threads
        let m = Mapping::memfd("pinpool-window-copy-test", pages * p).unwrap();
        let w = Window::new(m.fd().unwrap(), 0, pages * p).unwrap();
        let copier = crate::transfer::copy::Copier::new(4).unwrap();
        let src = vec![0x3Cu8; pages * p];
        let ranges = [crate::transfer::copy::CopyRange { src: 0, dst: 0, len: pages * p }];
        assert!(w.has_key() || !keys_required(), "no protection key for the window");
        w.open(0, pages * p, true).unwrap();
        w.allow().unwrap();
        // SAFETY: the source is the test's own vector, the destination the open window (this
        // thread allowed; the copy's threads take its rights), disjoint, nothing else writing.
        let copied = unsafe { copier.copy(src.as_ptr(), w.as_ptr(), &ranges) };
        assert_eq!(copied, pages * p);
        assert!((0..pages * p).step_by(4093).all(|i| byte(&m, i) == 0x3C));
        // The copy's threads gave the rights up again.
        let at = w.as_ptr() as usize;
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..8 {
            let tx = tx.clone();
            copier.spawn(move || tx.send(writes(at as *mut u8)).unwrap());
        }
        let seen: Vec<bool> = rx.iter().take(8).collect();
        assert_eq!(seen, vec![!w.has_key(); 8], "a copy thread kept access to the key");
        w.close().unwrap();
    }

    /// One step of [`the_window_state_machine_holds_against_a_model`].
    #[derive(Debug, Clone)]
    enum Step {
        Open { page: usize, pages: usize, keyed: bool },
        Allow,
        Deny,
        Close,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0..8usize, 1..4usize, any::<bool>()).prop_map(|(page, pages, keyed)| Step::Open {
                page,
                pages: pages.min(8 - page),
                keyed
            }),
            Just(Step::Allow),
            Just(Step::Deny),
            Just(Step::Close),
        ]
    }

    proptest::proptest! {
        #![proptest_config(crate::proptest_config(48))]

        /// Any sequence of opens (keyed or not), allows, denies and closes: after each step,
        /// the pages this thread can write, and each page's protection, are what a model of
        /// the invariants says (a keyed range stays armed, reached only while allowed; a
        /// plain one only while open; a keyed open on a window without a key is a plain
        /// one), and the bytes written land in the file.
        #[test]
        #[cfg_attr(miri, ignore)]
        fn the_window_state_machine_holds_against_a_model(
            steps in proptest::collection::vec(step(), 1..24)
        ) {
            let p = page_size();
            let m = Mapping::memfd("pinpool-window-model-test", 8 * p).unwrap();
            let w = Window::new(m.fd().unwrap(), 0, 8 * p).unwrap();
            let has_key = w.has_key();
            assert!(has_key || !keys_required(), "no protection key for the window");
            // The model: the open range and whether it is keyed, the armed range, whether
            // this thread's access to the key is on.
            let mut open: Option<(usize, usize, bool)> = None;
            let mut armed: Option<(usize, usize)> = None;
            let mut allowed = false;
            for (n, s) in steps.iter().enumerate() {
                match *s {
                    Step::Open { page, pages, keyed } => {
                        let got = w.open(page * p, pages * p, keyed);
                        if open.is_some() {
                            assert!(got.is_err(), "{n}: a second open");
                        } else {
                            got.unwrap();
                            let keyed = keyed && has_key;
                            if keyed {
                                armed = Some((page, page + pages));
                            } else {
                                armed = None;
                            }
                            open = Some((page, page + pages, keyed));
                        }
                    }
                    Step::Allow => {
                        w.allow().unwrap();
                        if matches!(open, Some((_, _, true))) {
                            allowed = true;
                        }
                    }
                    Step::Deny => {
                        w.deny();
                        allowed = false;
                    }
                    Step::Close => {
                        assert_eq!(w.close(), Ok(true));
                        open = None;
                        allowed = false;
                    }
                }
                let perms = page_perms(&w);
                for page in 0..8 {
                    let inside = |r: Option<(usize, usize)>| r.is_some_and(|(a, b)| a <= page && page < b);
                    let plain_open = matches!(open, Some((a, b, false)) if a <= page && page < b);
                    let want_rw = plain_open || inside(armed);
                    let want_reach = plain_open || (inside(armed) && allowed);
                    assert_eq!(perms[page] == "rw-s", want_rw, "{n} {s:?}: page {page}: {perms:?}");
                    // SAFETY: an address inside the window; `writes` only asks the kernel.
                    let at = unsafe { w.as_ptr().add(page * p + 7) };
                    assert_eq!(writes(at), want_reach, "{n} {s:?}: page {page} reached");
                    if want_reach {
                        assert_eq!(byte(&m, page * p + 7), 0xEE, "{n}: not in the file");
                    }
                }
                assert_eq!(w.open_range(), open.map(|(a, b, _)| (a * p, b * p)));
                assert_eq!(w.armed_range(), armed.map(|(a, b)| (a * p, b * p)));
            }
            w.deny();
        }
    }
}
