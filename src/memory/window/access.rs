//! Opening a window's pages for one batch, and switching a thread's access to its key.
//!
//! Invariants (the window's, in [`super`], as far as they concern this module):
//! - At most one range is open at a time; the open range, the armed range, the allowed thread
//!   and the view count change only under the window's lock.
//! - [`Window::open`] faults in a window that is not yet faulted, under the lock, before any
//!   page of it is made accessible.
//! - [`Window::close`] changes nothing while a view is alive; a close on another thread than
//!   the one allowed makes the armed range `PROT_NONE`.

use super::{State, Window};
use crate::error::{Error, Result};
use crate::memory::shm::page_size;
use crate::system::pkeys;

impl Window {
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
}
