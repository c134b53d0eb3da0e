//! Memory protection keys (x86-64 `pku`), where the processor and the kernel have them: a
//! thread's own switch for its access to the pages that carry a key.
//!
//! Every page carries a key (0 unless `pkey_mprotect` set another); each thread's PKRU
//! register says, key by key, whether that thread may touch such pages. Changing one's own
//! rights is one unprivileged instruction (`WRPKRU`) that changes no page-table entry, so a
//! zero-copy worker's window ([`crate::memory::window`]) kept readable and writable under a key
//! of its own costs nothing to open and close for the thread that writes the batch, where
//! `mprotect` rewrites every page's entry twice a batch, and makes the kernel flush the
//! other CPUs' TLBs where the worker's other threads ran.
//!
//! Invariants:
//! - Keys are allocated only by [`Key::alloc`], with access switched off in the allocating
//!   thread; the keys this process holds are in one bit set, and a key is freed only by
//!   dropping its [`Key`] (never while a thread might still have access to it: the owner's
//!   business, see [`crate::memory::window`]).
//! - A thread's access to a key of ours is switched on only by [`allow`] on that thread,
//!   until [`deny`] there; and for the length of one copy task that took its caller's rights
//!   ([`Adopted`]), which switches off every key of ours as it ends. A thread inherits its
//!   creator's register: pinpool starts no thread between [`allow`] and [`deny`], and its copy
//!   threads switch every key of ours off as they start.
//! - `RDPKRU` and `WRPKRU` run only once a key has been allocated in this process (so the
//!   processor has them and the kernel switched them on); everywhere else (other
//!   processors, other systems, Miri) no key is ever allocated and every call here does
//!   nothing.

use std::sync::atomic::{AtomicU32, Ordering};

/// The keys this process holds, one bit each (keys 1 to 15).
static OURS: AtomicU32 = AtomicU32::new(0);

/// PKRU's two bits for `key`: access disabled (the low one) and write disabled.
fn bits(key: u32) -> u32 {
    0b11 << (2 * key)
}

/// PKRU's access-disabled bits for every key in `set`.
fn access_disabled(set: u32) -> u32 {
    (1..16).filter(|k| set & (1 << k) != 0).map(|k| 1 << (2 * k)).sum()
}

/// PKRU's bits for every key in `set`.
fn bits_of(set: u32) -> u32 {
    (1..16).filter(|k| set & (1 << k) != 0).map(bits).sum()
}

/// A protection key of this process's, freed when dropped.
#[derive(Debug)]
pub struct Key {
    id: u32,
}

impl Key {
    /// A new key, with access to its pages switched off in the calling thread (and in every
    /// thread that does not switch it on); None where the processor or the kernel has no
    /// keys, or none is left (a process has 15).
    pub fn alloc() -> Option<Key> {
        let id = sys::alloc()?;
        if !(1..16).contains(&id) {
            sys::free(id);
            return None;
        }
        OURS.fetch_or(1 << id, Ordering::AcqRel);
        Some(Key { id })
    }

    /// The key's number (1 to 15).
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        OURS.fetch_and(!(1 << self.id), Ordering::AcqRel);
        sys::free(self.id);
    }
}

/// Whether this process holds any key (and so whether the calls below do anything).
pub fn in_use() -> bool {
    OURS.load(Ordering::Acquire) != 0
}

/// Switches the calling thread's access to `key`'s pages on (reading and writing).
pub fn allow(key: &Key) {
    // (A key exists: the instructions are there.)
    let pkru = sys::read();
    sys::write(pkru & !bits(key.id));
}

/// Switches the calling thread's access to `key`'s pages off.
pub fn deny(key: &Key) {
    let pkru = sys::read();
    sys::write(pkru | (1 << (2 * key.id)));
}

/// Whether the calling thread may write `key`'s pages now.
pub fn allowed(key: &Key) -> bool {
    sys::read() & bits(key.id) == 0
}

/// The calling thread's rights to this process's keys, to hand to a copy task
/// ([`Adopted`]); nothing where no key is held.
#[derive(Debug, Clone, Copy)]
pub struct Rights(Option<u32>);

impl Rights {
    /// The calling thread's rights now.
    pub fn of_this_thread() -> Rights {
        if !in_use() {
            return Rights(None);
        }
        Rights(Some(sys::read()))
    }
}

/// A copy task's rights, taken from the thread that asked for the copy, for as long as this
/// lives; dropped, it switches every key of ours off on this thread.
#[must_use]
pub struct Adopted(bool);

impl Adopted {
    /// Takes `rights` (for this process's keys only) on the calling thread.
    pub fn new(rights: Rights) -> Adopted {
        let Some(theirs) = rights.0 else { return Adopted(false) };
        let mask = bits_of(OURS.load(Ordering::Acquire));
        let mine = sys::read();
        sys::write((mine & !mask) | (theirs & mask));
        Adopted(true)
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        if self.0 {
            deny_all_ours();
        }
    }
}

/// Switches the calling thread's access to every key of ours off (a copy thread as it starts:
/// it may have been started from a thread that had access).
pub fn deny_all_ours() {
    let ours = OURS.load(Ordering::Acquire);
    if ours == 0 {
        return;
    }
    let pkru = sys::read();
    sys::write((pkru & !bits_of(ours)) | access_disabled(ours));
}

/// Sets the protection of `[addr, addr + len)` and its key: `pkey_mprotect`.
///
/// # Safety
/// As `mprotect`: the range is a whole number of pages of a mapping the caller owns, and no
/// reference into it is used in a way the new protection forbids.
pub unsafe fn protect(addr: *mut u8, len: usize, prot: libc::c_int, key: u32) -> bool {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::protect(addr, len, prot, key) }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
mod sys {
    use std::arch::asm;

    const PKEY_DISABLE_ACCESS: libc::c_long = 1;

    pub(super) fn alloc() -> Option<u32> {
        // SAFETY: a system call with no pointer arguments; it fails (EINVAL, ENOSPC, ENOSYS)
        // where keys are missing or used up.
        let id =
            unsafe { libc::syscall(libc::SYS_pkey_alloc, 0 as libc::c_long, PKEY_DISABLE_ACCESS) };
        u32::try_from(id).ok()
    }

    pub(super) fn free(id: u32) {
        // SAFETY: frees a key this process allocated; no pointer arguments.
        unsafe { libc::syscall(libc::SYS_pkey_free, libc::c_long::from(id)) };
    }

    pub(super) unsafe fn protect(addr: *mut u8, len: usize, prot: libc::c_int, key: u32) -> bool {
        // SAFETY: guaranteed by the caller (see `super::protect`).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pkey_mprotect,
                addr,
                len,
                libc::c_long::from(prot),
                libc::c_long::from(key),
            )
        };
        rc == 0
    }

    pub(super) fn read() -> u32 {
        let pkru: u32;
        // SAFETY: RDPKRU (ECX = 0) only reads this thread's PKRU; it is called only once a key
        // was allocated in this process, so the processor has it and the kernel switched it on.
        unsafe {
            asm!("rdpkru", in("ecx") 0u32, out("eax") pkru, out("edx") _,
                 options(nomem, nostack, preserves_flags));
        }
        pkru
    }

    pub(super) fn write(pkru: u32) {
        // SAFETY: WRPKRU (ECX = EDX = 0) sets this thread's PKRU (as for `read`, only where
        // keys exist). It changes which pages this thread may touch: no `nomem`, so the
        // compiler keeps memory accesses on their side of it.
        unsafe {
            asm!("wrpkru", in("eax") pkru, in("ecx") 0u32, in("edx") 0u32,
                 options(nostack, preserves_flags));
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
mod sys {
    pub(super) fn alloc() -> Option<u32> {
        None
    }
    pub(super) fn free(_id: u32) {}
    pub(super) unsafe fn protect(_: *mut u8, _: usize, _: libc::c_int, _: u32) -> bool {
        false
    }
    pub(super) fn read() -> u32 {
        0
    }
    pub(super) fn write(_pkru: u32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_two_per_key() {
        assert_eq!(bits(1), 0b1100);
        assert_eq!(access_disabled(0b110), (1 << 2) | (1 << 4));
        assert_eq!(bits_of(1 << 15), 0b11 << 30);
        assert_eq!(bits_of(0), 0);
    }

    /// Where the machine has keys (elsewhere there is nothing to try): one is allocated,
    /// switched on and off on its thread, handed to a copy task on another, and freed.
    #[test]
    fn a_key_is_switched_per_thread_and_handed_to_a_task() {
        let Some(key) = Key::alloc() else {
            let required = std::env::var_os("PINPOOL_REQUIRE_PKEYS").is_some_and(|v| v == "1");
            assert!(!required, "no protection key could be allocated");
            return;
        };
        assert!(in_use());
        assert!(!allowed(&key), "a new key starts switched off in its thread");
        allow(&key);
        assert!(allowed(&key));
        deny(&key);
        assert!(!allowed(&key));
        allow(&key);
        let rights = Rights::of_this_thread();
        deny(&key);
        let seen = std::thread::scope(|s| {
            s.spawn(|| {
                let before = allowed(&key);
                let during = {
                    let _a = Adopted::new(rights);
                    allowed(&key)
                };
                (before, during, allowed(&key))
            })
            .join()
            .unwrap()
        });
        assert_eq!(seen, (false, true, false));
        drop(key);
    }
}
