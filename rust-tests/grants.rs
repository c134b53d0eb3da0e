//! Zero-copy grants and the grant desk: what a worker asking for room gets, and what it can
//! never get (room the consumer's next batch needs, a slot twice, another iterator's slot).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use pinpool::pool::claim::room_kept;
use pinpool::pool::grants::{GrantRequest, Grants, BIG_FROM, GRANT_WORDS, LIKELY_WORDS};
use pinpool::transport::grant_desk::{self, ASK, GIVE_BACK, REQUEST_WORDS};
use pinpool::{Pool, PoolConfig};
use rustix::net::{
    connect, recv, send, socket_with, AddressFamily, RecvFlags, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};

const PAGE: usize = 4096;

fn pool(slot: usize, slots: usize) -> Arc<Pool> {
    Pool::new(&PoolConfig::host(slot, slots)).unwrap()
}

fn grants(pool: &Arc<Pool>) -> Arc<Grants> {
    let g = Arc::new(Grants::new(16, 1 << 30, BIG_FROM));
    g.use_pool(pool, usize::MAX);
    g.open(7);
    g
}

fn ask(worker: usize, task: u64, nbytes: usize) -> GrantRequest {
    GrantRequest { owner: 7, worker, task, nbytes }
}

#[test]
fn a_grant_is_exactly_the_batch_and_is_adopted_once() {
    let pool = pool(64 * PAGE, 4);
    let g = grants(&pool);
    let grant = g.issue(&ask(0, 0, 3 * PAGE + 1)).unwrap();
    assert_eq!(grant.location.nbytes, 4 * PAGE, "the batch's bytes, rounded up to a page");
    let w = grant.words();
    assert_eq!(w.len(), GRANT_WORDS);
    assert_eq!((w[0], w[5], w[6]), (1, 4 * PAGE as u64, u64::from(std::process::id())));
    assert!(w[3] < 1 << 63);
    let (index, generation) = (grant.slot.index, grant.slot.generation);
    assert!(g.adopt(index, generation, grant.nonce ^ 1).is_none(), "another nonce");
    let (p, slot) = g.adopt(index, generation, grant.nonce).unwrap();
    assert!(Arc::ptr_eq(&p, &pool));
    assert!(g.adopt(index, generation, grant.nonce).is_none(), "adopted once");
    assert!(!g.give_back(index, generation, grant.nonce), "adopted: not given back");
    pool.release(slot, None).unwrap();
    assert_eq!(pool.stats().bytes.free, pool.arena().len());
}

#[test]
fn a_worker_gets_its_last_slots_again_first() {
    let pool = pool(4 * PAGE, 8);
    let g = grants(&pool);
    let first: Vec<_> = (0..3).map(|t| g.issue(&ask(1, t, 4 * PAGE)).unwrap()).collect();
    let other = g.issue(&ask(2, 3, 4 * PAGE)).unwrap();
    for grant in first.iter().chain([&other]) {
        let c = grant.slot;
        assert!(g.give_back(c.index, c.generation, grant.nonce));
    }
    let at = |t: u64, worker| g.issue(&ask(worker, t, 4 * PAGE)).unwrap().location.arena_offset;
    assert_eq!(at(4, 1), first[2].location.arena_offset, "its latest first");
    assert_eq!(at(5, 1), first[1].location.arena_offset);
    assert_eq!(at(6, 2), other.location.arena_offset);
}

#[test]
fn only_the_consumers_next_batch_may_take_the_room_kept_for_it() {
    // An arena of 8 pages in one part; batches of 2 pages: the room kept is 3 pages (2 and a
    // quarter, rounded up), so batches taken ahead leave 3 pages in one range.
    let config = PoolConfig { arena_bytes: Some(8 * PAGE), ..PoolConfig::host(8 * PAGE, 16) };
    let pool = Pool::new(&config).unwrap();
    let g = grants(&pool);
    assert_eq!(room_kept(2 * PAGE, 8 * PAGE, 8 * PAGE), 3 * PAGE);
    // Room for fewer than two batches: one whole batch is kept, so nothing is taken ahead.
    assert_eq!(room_kept(2 * PAGE, 2 * PAGE, 2 * PAGE), 2 * PAGE);
    assert_eq!(room_kept(2 * PAGE, 3 * PAGE, 3 * PAGE), 2 * PAGE);
    assert_eq!(room_kept(2 * PAGE, 5 * PAGE, PAGE), PAGE, "never more than a part");
    let a = g.issue(&ask(0, 1, 2 * PAGE)).unwrap();
    let b = g.issue(&ask(1, 2, 2 * PAGE)).unwrap();
    assert!(g.issue(&ask(2, 3, 2 * PAGE)).is_none(), "task 3 would eat the kept room");
    assert_eq!(g.fallbacks(), 1);
    // Task 0, the consumer's next, takes it; then nothing more fits.
    let head = g.issue(&ask(3, 0, 3 * PAGE)).unwrap();
    assert!(g.issue(&ask(3, 0, PAGE)).is_some(), "the head may take the last page");
    assert!(g.issue(&ask(3, 0, PAGE)).is_none(), "full");
    // The consumer moves on: task 3 is the head now, and a batch given back makes room.
    g.set_head(7, 3);
    let c = head.slot;
    assert!(g.give_back(c.index, c.generation, head.nonce));
    assert!(g.issue(&ask(2, 3, 3 * PAGE)).is_some());
    let _ = (a, b);
}

#[test]
fn no_grant_for_an_iterator_that_is_not_open_and_closing_one_frees_its_grants_only() {
    let pool = pool(4 * PAGE, 4);
    let g = grants(&pool);
    assert!(g.issue(&GrantRequest { owner: 8, ..ask(0, 0, PAGE) }).is_none(), "not open");
    g.open(8);
    let theirs = g.issue(&GrantRequest { owner: 8, ..ask(0, 0, PAGE) }).unwrap();
    let mine = g.issue(&ask(0, 0, PAGE)).unwrap();
    g.close(Some(7));
    assert_eq!(g.outstanding(), 1);
    let c = mine.slot;
    assert!(g.adopt(c.index, c.generation, mine.nonce).is_none());
    assert!(g.issue(&ask(0, 0, PAGE)).is_none(), "closed");
    assert_eq!(pool.stats().slots.checked_out, 1);
    drop(g);
    assert_eq!(pool.stats().slots.checked_out, 0, "the table's end releases the rest");
    let _ = theirs;
}

#[test]
fn no_grant_without_a_pool_or_for_a_batch_no_part_holds() {
    let g = Arc::new(Grants::new(16, 1 << 30, BIG_FROM));
    g.open(7);
    assert!(g.issue(&ask(0, 0, PAGE)).is_none(), "no pool yet");
    let pool = pool(4 * PAGE, 2);
    g.use_pool(&pool, 3 * PAGE + 1);
    assert!(g.issue(&ask(0, 0, 3 * PAGE + 2)).is_none(), "one byte over the largest batch");
    assert!(g.issue(&ask(0, 0, 3 * PAGE + 1)).is_some());
    g.use_pool(&pool, usize::MAX);
    assert!(g.issue(&ask(0, 0, pool.largest_slot() + 1)).is_none());
    assert!(g.issue(&ask(0, 0, 0)).is_none());
    pool.close();
    assert!(g.issue(&ask(0, 0, PAGE)).is_none(), "closed");
    assert_eq!(g.fallbacks(), 4, "an empty batch asks for nothing");
}

#[test]
fn a_fresh_worker_is_told_where_its_next_big_slots_will_be_and_gets_them() {
    let size = BIG_FROM;
    let pool = pool(size, 12);
    let g = grants(&pool);
    let first = g.issue(&ask(1, 0, size)).unwrap();
    assert_eq!(first.likely.len(), 4, "its share (4, its own first included) and a spare");
    assert_eq!(g.told_likely(), 1);
    assert_eq!(first.words().len(), GRANT_WORDS + first.likely.len() * LIKELY_WORDS);
    // Worker 1's share: places 4 to 7; the spare is worker 2's last, place 11.
    let places: Vec<usize> = first.likely.iter().map(|h| h.arena_offset / size).collect();
    assert_eq!(first.location.arena_offset / size, 4);
    assert_eq!(places, vec![5, 6, 7, 11]);
    let second = g.issue(&ask(1, 1, size)).unwrap();
    assert_eq!(second.location.arena_offset / size, 5, "where it was told");
    assert!(second.likely.is_empty(), "told once");
    // The next iterator's worker 1 is offered its predecessor's places first, latest first,
    // and told of the others.
    g.close(Some(7));
    g.open(9);
    let next = g.issue(&GrantRequest { owner: 9, ..ask(1, 0, size) }).unwrap();
    assert_eq!(next.location.arena_offset / size, 5);
    let told: Vec<usize> = next.likely.iter().map(|h| h.arena_offset / size).collect();
    assert_eq!(told, vec![4]);
}

/// The desk is one per process: tests that register with it take turns (one checks that the
/// last registration's drop closes it).
static DESK_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn desk_turn() -> std::sync::MutexGuard<'static, ()> {
    DESK_TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn connect_to(address: &[u8]) -> OwnedFd {
    let fd = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .unwrap();
    connect(&fd, &SocketAddrUnix::new_abstract_name(address).unwrap()).unwrap();
    fd
}

fn request(fd: &OwnedFd, words: [u64; REQUEST_WORDS]) {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    send(fd, &bytes, SendFlags::empty()).unwrap();
}

fn reply(fd: &OwnedFd) -> Vec<u64> {
    let mut buf = [0u8; 1024];
    let (_, n) = recv(fd, &mut buf[..], RecvFlags::empty()).unwrap();
    buf[..n].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn the_desk_answers_asks_and_takes_slots_back() {
    let pool = pool(4 * PAGE, 4);
    let g = grants(&pool);
    let _turn = desk_turn();
    let desk = grant_desk::register(&g).unwrap();
    let fd = connect_to(desk.address());
    request(&fd, [ASK, 41, desk.table(), 7, 0, 0, 2 * PAGE as u64]);
    let got = reply(&fd);
    assert_eq!((got[0], got[1], got[6]), (41, 1, 2 * PAGE as u64));
    assert_eq!(g.outstanding(), 1);
    request(&fd, [GIVE_BACK, 42, desk.table(), got[2], got[3], got[4], 0]);
    // Another table, or a closed owner: no grant.
    request(&fd, [ASK, 43, desk.table() ^ 1, 7, 0, 0, PAGE as u64]);
    assert_eq!(reply(&fd), vec![43, 0]);
    assert_eq!(g.outstanding(), 0, "given back (the desk answers in order)");
    request(&fd, [ASK, 44, desk.table(), 99, 0, 0, PAGE as u64]);
    assert_eq!(reply(&fd), vec![44, 0]);
    // Anything but a whole request closes the connection.
    send(&fd, b"nonsense", SendFlags::empty()).unwrap();
    let mut buf = [0u8; 8];
    let (_, n) = recv(&fd, &mut buf[..], RecvFlags::empty()).unwrap();
    assert_eq!(n, 0, "closed by the desk");
}

#[test]
fn the_desk_stops_with_its_last_registration() {
    let pool = pool(4 * PAGE, 4);
    let g = grants(&pool);
    let _turn = desk_turn();
    let (a, b) = (grant_desk::register(&g).unwrap(), grant_desk::register(&g).unwrap());
    assert_eq!(a.address(), b.address(), "one desk a process");
    let address = a.address().to_vec();
    drop(a);
    let fd = connect_to(&address);
    request(&fd, [ASK, 1, b.table(), 7, 0, 0, PAGE as u64]);
    assert_eq!(reply(&fd)[1], 1);
    drop(b);
    std::thread::sleep(Duration::from_millis(10));
    let again = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .unwrap();
    let refused = connect(&again, &SocketAddrUnix::new_abstract_name(&address).unwrap());
    assert!(refused.is_err(), "the desk's socket is closed");
    let mut buf = [0u8; 8];
    let (_, n) = recv(fd.as_fd(), &mut buf[..], RecvFlags::empty()).unwrap();
    assert_eq!(n, 0, "and its connections");
}

#[test]
fn a_request_waits_for_room_the_batches_before_it_hold() {
    use pinpool::pool::grants::Answer;
    let config = PoolConfig { arena_bytes: Some(16 * PAGE), ..PoolConfig::host(16 * PAGE, 64) };
    let pool = Pool::new(&config).unwrap();
    let g = grants(&pool);
    let first: Vec<_> = (0..3).map(|t| g.issue(&ask(0, t, 3 * PAGE)).unwrap()).collect();
    assert_eq!(g.answer(&ask(1, 3, 4 * PAGE)), Answer::Wait);
    let c = first[0].slot;
    let (_, slot) = g.adopt(c.index, c.generation, first[0].nonce).unwrap();
    g.set_head(7, 1);
    pool.release(slot, None).unwrap();
    let again = g.answer(&ask(1, 3, 4 * PAGE));
    assert!(matches!(again, Answer::Wait | Answer::Granted(_)), "{again:?}");
}

#[test]
fn stopping_an_owner_answers_its_parked_requests_at_once_and_keeps_its_grants_out() {
    let config = PoolConfig { arena_bytes: Some(16 * PAGE), ..PoolConfig::host(16 * PAGE, 64) };
    let pool = Pool::new(&config).unwrap();
    let g = grants(&pool);
    let first: Vec<_> = (0..3).map(|t| g.issue(&ask(0, t, 3 * PAGE)).unwrap()).collect();
    let _turn = desk_turn();
    let desk = grant_desk::register(&g).unwrap();
    let fd = connect_to(desk.address());
    // Task 3 waits for room the batches before it hold: parked at the desk.
    request(&fd, [ASK, 1, desk.table(), 7, 1, 3, 4 * PAGE as u64]);
    let mut poll_fds = [PollFd::new(&fd, PollFlags::IN)];
    let short = Timespec { tv_sec: 0, tv_nsec: 50_000_000 };
    assert_eq!(poll(&mut poll_fds, Some(&short)).unwrap(), 0, "parked, not answered");
    let t0 = std::time::Instant::now();
    g.stop(Some(7));
    assert_eq!(reply(&fd), vec![1, 0], "answered with no grant");
    assert!(t0.elapsed() < Duration::from_millis(100), "{:?}", t0.elapsed());
    assert!(g.issue(&ask(0, 4, PAGE)).is_none(), "no more grants for a stopped owner");
    // What was granted before stays out for its writer: adopted, or taken back at close.
    let c = first[0].slot;
    assert!(g.adopt(c.index, c.generation, first[0].nonce).is_some());
    assert_eq!(g.outstanding(), 2);
    g.close(Some(7));
    assert_eq!(g.outstanding(), 0);
}
