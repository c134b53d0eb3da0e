//! A window's keyed range written by the copy threads: they take the caller's rights to the
//! window's protection key for the copy and keep none afterwards. (Here, not in the window's
//! unit tests: the memory layer knows nothing of the copy threads above it.)

use std::os::fd::AsRawFd;

use pinpool::memory::shm::{page_size, Mapping};
use pinpool::memory::window::Window;
use pinpool::transfer::copy::{Copier, CopyRange};

fn keys_required() -> bool {
    std::env::var_os("PINPOOL_REQUIRE_PKEYS").is_some_and(|v| v == "1")
}

/// Whether the calling thread may write the byte at `at` now (its protection-key rights
/// and the page's protection): the kernel writes it there for this thread, as a `read`
/// from a pipe, and fails with `EFAULT` where the thread could not (no fault is raised).
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

fn byte(m: &Mapping, at: usize) -> u8 {
    assert!(at < m.len());
    // SAFETY: inside the test's own readable mapping.
    unsafe { m.as_ptr().add(at).read_volatile() }
}

#[test]
#[cfg_attr(miri, ignore)]
fn copy_threads_write_a_keyed_range_with_the_callers_rights_and_keep_none() {
    let p = page_size();
    let pages = 1024; // 4 MiB: a copy the copier splits among its threads
    let m = Mapping::memfd("pinpool-window-copy-test", pages * p).unwrap();
    let w = Window::new(m.fd().unwrap(), 0, pages * p).unwrap();
    let copier = Copier::new(4).unwrap();
    let src = vec![0x3Cu8; pages * p];
    let ranges = [CopyRange { src: 0, dst: 0, len: pages * p }];
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
