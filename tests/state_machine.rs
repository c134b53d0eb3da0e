//! Property tests of the slot state machine against a plain model.
//!
//! A [`SlotTable`] plus a [`FenceTracker`] over [`ManualFences`] are driven by random sequences
//! of operations; a model of the same operations (a `Vec` of slot states, a list of every ticket
//! ever handed out, a `done` flag per fence) predicts every result. After every step the test
//! compares the whole observable state: `counts()`, `state(i)` of every slot, `is_live` of every
//! ticket ever issued, the tracker's pending count and error count, and the stream each fence
//! was last recorded on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::cuda::StreamHandle;
use pinpool::fence::{FenceTracker, Fences, ManualFences};
use pinpool::slots::{Counts, SlotTable, State};
use pinpool::{Error, Result, Ticket};
use proptest::prelude::*;

/// Lets the test keep a handle on the fences the tracker owns, and make them fail on demand.
struct SharedFences {
    manual: Arc<ManualFences>,
    fail_record: Arc<AtomicBool>,
    fail_query: Arc<AtomicBool>,
}

fn record_error() -> Error {
    Error::Cuda { call: "cuEventRecord", name: "CUDA_ERROR_TEST_RECORD".into(), code: 999 }
}

impl Fences for SharedFences {
    fn record(&self, index: usize, stream: StreamHandle) -> Result<()> {
        if self.fail_record.load(Ordering::SeqCst) {
            return Err(record_error());
        }
        self.manual.record(index, stream)
    }

    fn is_complete(&self, index: usize) -> Result<bool> {
        if self.fail_query.load(Ordering::SeqCst) {
            return Err(Error::Cuda {
                call: "cuEventQuery",
                name: "CUDA_ERROR_TEST_QUERY".into(),
                code: 998,
            });
        }
        self.manual.is_complete(index)
    }
}

/// Which ticket an operation uses.
#[derive(Debug, Clone, Copy)]
enum Pick {
    /// A ticket that is currently checked out (falls back to any ticket if none is).
    Live(usize),
    /// A ticket whose checkout has ended (falls back to any ticket if none has).
    Stale(usize),
    /// The most recently released ticket: a second release of it.
    LastReleased,
    /// A ticket the table never issued: a live slot's index with a future generation, or an
    /// index past the end.
    Forged(u32, bool),
}

#[derive(Debug, Clone)]
enum Op {
    /// `table.try_checkout()`.
    TryCheckout,
    /// What a pool's blocking checkout does: try, retire completed fences, try again, and
    /// when nothing is free, a short `wait` that must come back empty-handed.
    Checkout,
    /// `table.release(ticket, false)`.
    Release(Pick),
    /// `tracker.release_fenced(&table, ticket, stream)`.
    ReleaseFenced(Pick, StreamHandle),
    /// `manual.complete(slot)`: the GPU finished the work behind slot's fence.
    CompleteFence(usize),
    /// `tracker.retire_ready(&table)`.
    RetireReady,
    /// `table.complete_fence(ticket)` on a ticket that is not the slot's fenced checkout.
    StrayCompleteFence(Pick),
    /// `table.unfence(ticket)` on a ticket that is not the slot's fenced checkout.
    StrayUnfence(Pick),
    /// Make the next fence records fail (or stop failing).
    FailRecord(bool),
    /// Make the next fence queries fail (or stop failing).
    FailQuery(bool),
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        4 => any::<usize>().prop_map(Pick::Live),
        2 => any::<usize>().prop_map(Pick::Stale),
        2 => Just(Pick::LastReleased),
        1 => (any::<u32>(), any::<bool>()).prop_map(|(i, past_end)| Pick::Forged(i, past_end)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::TryCheckout),
        3 => Just(Op::Checkout),
        4 => pick().prop_map(Op::Release),
        4 => (pick(), 1usize..1000).prop_map(|(p, s)| Op::ReleaseFenced(p, s)),
        4 => any::<usize>().prop_map(Op::CompleteFence),
        3 => Just(Op::RetireReady),
        1 => pick().prop_map(Op::StrayCompleteFence),
        1 => pick().prop_map(Op::StrayUnfence),
        1 => any::<bool>().prop_map(Op::FailRecord),
        1 => any::<bool>().prop_map(Op::FailQuery),
    ]
}

/// The model's view of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Out,
    Fenced,
}

/// What the test expects of the table, the tracker and the fences.
struct Model {
    /// The id of the table under test.
    table: u32,
    /// State of each slot.
    slots: Vec<Slot>,
    /// Generation of each slot's latest checkout (0 before the first).
    generation: Vec<u32>,
    /// Whether each slot's fence has completed (`ManualFences` starts out complete).
    done: Vec<bool>,
    /// The stream each slot's fence was last recorded on (`ManualFences` starts at 0).
    stream: Vec<StreamHandle>,
    /// Every ticket ever handed out, in order.
    issued: Vec<Ticket>,
    /// The ticket most recently released successfully.
    last_released: Option<Ticket>,
    fail_record: bool,
    fail_query: bool,
    /// Fence queries that failed so far.
    errors: u64,
}

impl Model {
    fn new(n: usize, table: u32) -> Self {
        Model {
            table,
            slots: vec![Slot::Free; n],
            generation: vec![0; n],
            done: vec![true; n],
            stream: vec![0; n],
            issued: Vec::new(),
            last_released: None,
            fail_record: false,
            fail_query: false,
            errors: 0,
        }
    }

    fn is_live(&self, t: Ticket) -> bool {
        let i = t.index as usize;
        i < self.slots.len() && self.slots[i] == Slot::Out && self.generation[i] == t.generation
    }

    fn is_fenced_checkout(&self, t: Ticket) -> bool {
        let i = t.index as usize;
        i < self.slots.len() && self.slots[i] == Slot::Fenced && self.generation[i] == t.generation
    }

    fn counts(&self) -> Counts {
        let count = |s| self.slots.iter().filter(|&&x| x == s).count();
        Counts {
            free: count(Slot::Free),
            checked_out: count(Slot::Out),
            fenced: count(Slot::Fenced),
        }
    }

    fn pending(&self) -> usize {
        self.counts().fenced
    }

    fn choose(&self, pick: Pick) -> Option<Ticket> {
        let n = self.slots.len() as u32;
        let from = |list: Vec<Ticket>, k: usize| {
            if list.is_empty() {
                None
            } else {
                Some(list[k % list.len()])
            }
        };
        let any = |k: usize| from(self.issued.clone(), k);
        match pick {
            Pick::Live(k) => {
                let live: Vec<Ticket> =
                    self.issued.iter().copied().filter(|&t| self.is_live(t)).collect();
                from(live, k).or_else(|| any(k))
            }
            Pick::Stale(k) => {
                let stale: Vec<Ticket> =
                    self.issued.iter().copied().filter(|&t| !self.is_live(t)).collect();
                from(stale, k).or_else(|| any(k))
            }
            Pick::LastReleased => self.last_released,
            Pick::Forged(k, past_end) => Some(if past_end {
                Ticket { table: self.table, index: n.saturating_add(k % 1000), generation: k }
            } else {
                let index = k % n;
                // A generation the slot has not reached yet.
                Ticket {
                    table: self.table,
                    index,
                    generation: self.generation[index as usize].wrapping_add(1),
                }
            }),
        }
    }

    /// Models a successful checkout; returns the slots that may be handed out.
    fn free_slots(&self) -> Vec<usize> {
        (0..self.slots.len()).filter(|&i| self.slots[i] == Slot::Free).collect()
    }

    /// Models `retire_ready`: returns how many slots it frees.
    fn retire(&mut self) -> usize {
        let mut n = 0;
        for i in 0..self.slots.len() {
            if self.slots[i] == Slot::Fenced && (self.fail_query || self.done[i]) {
                if self.fail_query {
                    self.errors += 1;
                }
                self.slots[i] = Slot::Free;
                n += 1;
            }
        }
        n
    }
}

struct Harness {
    table: SlotTable,
    tracker: FenceTracker,
    manual: Arc<ManualFences>,
    fail_record: Arc<AtomicBool>,
    fail_query: Arc<AtomicBool>,
    model: Model,
}

impl Harness {
    fn new(n: usize) -> Self {
        let manual = Arc::new(ManualFences::new(n));
        let fail_record = Arc::new(AtomicBool::new(false));
        let fail_query = Arc::new(AtomicBool::new(false));
        let tracker = FenceTracker::new(Box::new(SharedFences {
            manual: Arc::clone(&manual),
            fail_record: Arc::clone(&fail_record),
            fail_query: Arc::clone(&fail_query),
        }));
        let table = SlotTable::new(n).unwrap();
        let model = Model::new(n, table.id());
        Harness { table, tracker, manual, fail_record, fail_query, model }
    }

    /// Checks a ticket the table just handed out against the model, and records it.
    fn accept(&mut self, got: Option<Ticket>) -> std::result::Result<(), TestCaseError> {
        let free = self.model.free_slots();
        match got {
            None => prop_assert!(free.is_empty(), "nothing handed out while {free:?} are free"),
            Some(t) => {
                let i = t.index as usize;
                prop_assert!(i < self.model.slots.len(), "index {i} out of range");
                prop_assert_eq!(
                    self.model.slots[i],
                    Slot::Free,
                    "slot {} handed out while {:?}",
                    i,
                    self.model.slots[i]
                );
                prop_assert!(
                    self.issued_never(t),
                    "ticket {:?} handed out twice (issued: {:?})",
                    t,
                    self.model.issued
                );
                prop_assert_ne!(t.generation, self.model.generation[i], "generation not bumped");
                self.model.slots[i] = Slot::Out;
                self.model.generation[i] = t.generation;
                self.model.issued.push(t);
            }
        }
        Ok(())
    }

    fn issued_never(&self, t: Ticket) -> bool {
        !self.model.issued.contains(&t)
    }

    fn step(&mut self, op: &Op) -> std::result::Result<(), TestCaseError> {
        match *op {
            Op::TryCheckout => {
                let got = self.table.try_checkout();
                self.accept(got)?;
            }
            Op::Checkout => {
                let mut got = self.table.try_checkout();
                if got.is_none() {
                    let retired = self.tracker.retire_ready(&self.table);
                    prop_assert_eq!(retired, self.model.retire());
                    got = self.table.try_checkout();
                }
                if got.is_none() {
                    let t0 = Instant::now();
                    self.table.wait(Duration::from_millis(1));
                    prop_assert!(t0.elapsed() < Duration::from_secs(5), "wait overslept");
                    got = self.table.try_checkout();
                }
                self.accept(got)?;
            }
            Op::Release(p) => {
                let Some(t) = self.model.choose(p) else { return Ok(()) };
                let got = self.table.release(t, false);
                if self.model.is_live(t) {
                    prop_assert_eq!(got, Ok(()));
                    self.model.slots[t.index as usize] = Slot::Free;
                    self.model.last_released = Some(t);
                } else {
                    prop_assert_eq!(got, Err(Error::SlotReleased { index: t.index as usize }));
                }
            }
            Op::ReleaseFenced(p, stream) => {
                let Some(t) = self.model.choose(p) else { return Ok(()) };
                let got = self.tracker.release_fenced(&self.table, t, stream);
                if !self.model.is_live(t) {
                    prop_assert_eq!(got, Err(Error::SlotReleased { index: t.index as usize }));
                } else if self.model.fail_record {
                    // The slot stays checked out under the same ticket.
                    prop_assert_eq!(got, Err(record_error()));
                } else {
                    prop_assert_eq!(got, Ok(()));
                    let i = t.index as usize;
                    self.model.slots[i] = Slot::Fenced;
                    self.model.done[i] = false;
                    self.model.stream[i] = stream;
                    self.model.last_released = Some(t);
                }
            }
            Op::CompleteFence(k) => {
                let i = k % self.model.slots.len();
                self.manual.complete(i);
                self.model.done[i] = true;
            }
            Op::RetireReady => {
                let retired = self.tracker.retire_ready(&self.table);
                prop_assert_eq!(retired, self.model.retire());
            }
            Op::StrayCompleteFence(p) => {
                let Some(t) = self.model.choose(p) else { return Ok(()) };
                if !self.model.is_fenced_checkout(t) {
                    prop_assert!(!self.table.complete_fence(t), "stray complete_fence({t:?})");
                }
            }
            Op::StrayUnfence(p) => {
                let Some(t) = self.model.choose(p) else { return Ok(()) };
                if !self.model.is_fenced_checkout(t) {
                    self.table.unfence(t);
                }
            }
            Op::FailRecord(on) => {
                self.fail_record.store(on, Ordering::SeqCst);
                self.model.fail_record = on;
            }
            Op::FailQuery(on) => {
                self.fail_query.store(on, Ordering::SeqCst);
                self.model.fail_query = on;
            }
        }
        self.check()
    }

    /// Compares everything observable with the model.
    fn check(&self) -> std::result::Result<(), TestCaseError> {
        let m = &self.model;
        prop_assert_eq!(self.table.counts(), m.counts());
        prop_assert_eq!(self.tracker.pending(), m.pending());
        prop_assert_eq!(self.tracker.errors(), m.errors);
        for i in 0..m.slots.len() {
            let want = match m.slots[i] {
                Slot::Free => State::Free,
                Slot::Out => State::CheckedOut,
                Slot::Fenced => State::Fenced,
            };
            prop_assert_eq!(self.table.state(i), Some((want, m.generation[i])), "slot {}", i);
            prop_assert_eq!(self.manual.is_complete(i).unwrap(), m.done[i], "fence of slot {}", i);
            prop_assert_eq!(self.manual.stream_of(i), m.stream[i], "stream of slot {}", i);
        }
        prop_assert_eq!(self.table.state(m.slots.len()), None);
        let mut live_indices = Vec::new();
        for &t in &m.issued {
            prop_assert_eq!(self.table.is_live(t), m.is_live(t), "is_live({:?})", t);
            if m.is_live(t) {
                live_indices.push(t.index);
            }
        }
        // No slot is held under two tickets at once.
        let held = live_indices.len();
        live_indices.sort_unstable();
        live_indices.dedup();
        prop_assert_eq!(live_indices.len(), held, "a slot is live under two tickets");
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn slot_table_and_fences_follow_the_model(
        n in 1usize..6,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut h = Harness::new(n);
        h.check()?;
        for op in &ops {
            h.step(op)?;
        }
        // Drain: complete every fence, retire, release everything; the table ends all free.
        h.fail_query.store(false, Ordering::SeqCst);
        h.model.fail_query = false;
        for i in 0..n {
            h.manual.complete(i);
            h.model.done[i] = true;
        }
        h.step(&Op::RetireReady)?;
        let live: Vec<Ticket> =
            h.model.issued.iter().copied().filter(|&t| h.model.is_live(t)).collect();
        for t in live {
            prop_assert_eq!(h.table.release(t, false), Ok(()));
            h.model.slots[t.index as usize] = Slot::Free;
        }
        h.check()?;
        prop_assert_eq!(h.table.counts(), Counts { free: n, checked_out: 0, fenced: 0 });
        // Every slot can be checked out once more, each exactly once.
        let mut seen: Vec<u32> = (0..n).map(|_| h.table.try_checkout().unwrap().index).collect();
        prop_assert!(h.table.try_checkout().is_none());
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
    }

    /// A fenced slot is never handed out before its own fence completes, whatever order fences
    /// of other slots complete in, and however often the tracker is polled.
    #[test]
    fn fenced_slot_waits_for_its_own_fence(
        n in 1usize..6,
        victim in any::<usize>(),
        polls in 0usize..4,
        others in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let h = Harness::new(n);
        let tickets: Vec<Ticket> = (0..n).map(|_| h.table.try_checkout().unwrap()).collect();
        let victim = tickets[victim % n];
        for (k, &t) in tickets.iter().enumerate() {
            h.tracker.release_fenced(&h.table, t, k + 1).unwrap();
        }
        // Complete some other slots' fences; the victim's stays pending.
        let mut completed: Vec<u32> = others
            .iter()
            .map(|&k| (k % n) as u32)
            .filter(|&i| i != victim.index)
            .collect();
        completed.sort_unstable();
        completed.dedup();
        for &i in &completed {
            h.manual.complete(i as usize);
        }
        let mut retired = 0;
        for _ in 0..polls {
            retired += h.tracker.retire_ready(&h.table);
        }
        prop_assert_eq!(retired, if polls > 0 { completed.len() } else { 0 });
        // Take everything that is free: exactly the retired slots, never the victim.
        let take_all = |h: &Harness| -> Vec<u32> {
            std::iter::from_fn(|| h.table.try_checkout()).map(|t| t.index).collect()
        };
        let mut handed = take_all(&h);
        handed.sort_unstable();
        prop_assert_eq!(&handed, if polls > 0 { &completed } else { &Vec::new() });
        // Polling again frees the rest of the completed slots, still never the victim.
        h.tracker.retire_ready(&h.table);
        handed.extend(take_all(&h));
        handed.sort_unstable();
        prop_assert_eq!(&handed, &completed);
        prop_assert!(!handed.contains(&victim.index), "slot handed out before its fence completed");
        prop_assert_eq!(
            h.table.state(victim.index as usize),
            Some((State::Fenced, victim.generation))
        );
        prop_assert_eq!(h.tracker.pending(), n - handed.len());
        prop_assert!(!h.table.is_live(victim));
        h.manual.complete(victim.index as usize);
        prop_assert_eq!(h.tracker.retire_ready(&h.table), 1);
        let t = h.table.try_checkout().unwrap();
        prop_assert_eq!(t.index, victim.index);
        prop_assert_ne!(t.generation, victim.generation);
    }
}

#[test]
fn wait_returns_at_once_when_a_slot_is_free_or_the_table_is_closed() {
    let table = SlotTable::new(1).unwrap();
    let t0 = Instant::now();
    table.wait(Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(5), "waited although a slot was free");
    let _held = table.try_checkout().unwrap();
    table.close();
    let t0 = Instant::now();
    table.wait(Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(5), "waited although the table is closed");
}
