//! Unit tests of `window`, kept apart from the code they test.

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
                all.push(Vma { start, end, perms, path, rss: 0, flags: Vec::new(), pkey: None });
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
        unsafe { std::ptr::write_bytes(m.as_ptr().add(i * page_size()), i as u8 + 1, page_size()) };
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
    let unsealed = rustix::fs::memfd_create("pinpool-window-test", MemfdFlags::CLOEXEC).unwrap();
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
