//! Unit tests of `copy`, kept apart from the code they test.

use std::os::fd::AsRawFd;

use super::*;
use crate::memory::shm::{page_size, Mapping};
use crate::memory::window::Window;

/// `copy_streaming` (and the plain copy it uses for the unaligned head and the tail) at
/// every destination alignment and around every 64-byte boundary: the bytes land where
/// they should and nothing outside the range is written.
#[test]
// Miri: `_mm_stream_si128` and `_mm_sfence` are inline assembly, which Miri cannot run.
#[cfg_attr(miri, ignore)]
fn streaming_copy_handles_every_alignment() {
    let src: Vec<u8> = (0..400u32).map(|i| (i * 7 % 251) as u8 + 1).collect();
    for dst_off in 0..64 {
        for len in [0, 1, 15, 16, 63, 64, 65, 127, 128, 129, 191, 200] {
            for src_off in [0, 3] {
                let mut dst = vec![0u8; 400];
                // SAFETY: both ranges lie inside their vectors (64 + 200 + 3 < 400), and
                // the vectors are distinct.
                unsafe {
                    let d = dst.as_mut_ptr() as usize;
                    copy_streaming(src.as_ptr() as usize + src_off, d + dst_off, len);
                }
                assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
                assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&b| b == 0));
            }
        }
    }
}

#[test]
// Miri: rayon's crossbeam-epoch breaks Stacked Borrows (crossbeam-rs/crossbeam#545); `make
// miri` runs this one under Tree Borrows instead, by name.
#[cfg_attr(miri, ignore)]
fn process_copier_is_shared_per_thread_count() {
    let a = process_copier(3).unwrap();
    let b = process_copier(3).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(a.threads(), 3);
    assert_eq!(process_copier(0).unwrap().threads(), 1);
}

#[test]
// Miri: rayon's crossbeam-epoch breaks Stacked Borrows (crossbeam-rs/crossbeam#545); `make
// miri` runs this one under Tree Borrows instead, by name.
#[cfg_attr(miri, ignore)]
fn gathers_from_absolute_addresses() {
    // Sources anywhere in memory: a zero base with absolute offsets.
    let parts: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 200_000]).collect();
    let mut dst = vec![0u8; 40 * 200_000];
    let ranges: Vec<CopyRange> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| CopyRange { src: p.as_ptr() as usize, dst: i * 200_000, len: p.len() })
        .collect();
    let copier = process_copier(4).unwrap();
    // SAFETY: every source is a live vector; destinations are disjoint slices of `dst`.
    let n = unsafe { copier.copy(std::ptr::null(), dst.as_mut_ptr(), &ranges) };
    assert_eq!(n, dst.len());
    for (chunk, part) in dst.chunks(200_000).zip(&parts) {
        assert!(chunk == &part[..]);
    }
}

#[test]
// Miri: rayon's crossbeam-epoch breaks Stacked Borrows (crossbeam-rs/crossbeam#545); `make
// miri` runs this one under Tree Borrows instead, by name.
#[cfg_attr(miri, ignore)]
fn parallel_copy_matches_serial() {
    // Byte i is i * 7 % 251, built by repeating one period (cheap under Miri).
    let period: Vec<u8> = (0..251).map(|i| (i * 7 % 251) as u8).collect();
    let mut src = period.repeat((5 << 20) / 251 + 1);
    src.truncate(5 << 20);
    let mut dst = vec![0u8; src.len() + 100];
    let ranges = [
        CopyRange { src: 0, dst: 100, len: 3 << 20 },
        CopyRange { src: 3 << 20, dst: (3 << 20) + 100, len: (2 << 20) - 5 },
    ];
    // Miri cannot run the streaming stores (inline assembly): only the plain copy there.
    let modes: &[bool] = if cfg!(miri) { &[false] } else { &[false, true] };
    for &streaming in modes {
        dst.fill(0);
        let mut copier = Copier::new(4).unwrap();
        copier.streaming = streaming;
        // SAFETY: ranges lie inside both vectors and do not overlap.
        let n = unsafe { copier.copy(src.as_ptr(), dst.as_mut_ptr(), &ranges) };
        assert_eq!(n, (5 << 20) - 5);
        assert_eq!(&dst[100..100 + (5 << 20) - 5], &src[..(5 << 20) - 5]);
        assert!(dst[..100].iter().all(|&b| b == 0));
        assert_eq!(dst[100 + (5 << 20) - 5..], [0u8; 5]);
    }
}

// A window's keyed range written by the copy threads: they take the caller's rights to the
// window's protection key for the copy and keep none afterwards. (Here, not in the window's
// tests: the memory layer knows nothing of the copy threads above it.)

/// Whether the run demands protection keys (`make test-pkeys`).
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

/// The byte at `at` of the test's mapping `m`.
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
