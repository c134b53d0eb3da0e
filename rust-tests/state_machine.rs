//! Property tests of the slot state machine and the fence tracker against a plain model.
//!
//! A [`SlotTable`] plus a [`FenceTracker`] over [`ManualFences`] are driven by random sequences
//! of operations; a model of the same operations predicts every result. The model holds:
//!
//! - a `Vec` of slot states and generations, and every checkout ever handed out;
//! - the release queue: `(checkout, stream)` of every fenced release whose fence is not recorded
//!   yet, in release order;
//! - every fence `ManualFences` has recorded, as `(stream, done)` (its id is its position);
//! - the fences in flight: a fence id and the checkouts behind it.
//!
//! A retire first records one fence per distinct stream over the queue (streams in order of
//! first appearance), then polls the fences in flight in order and frees the checkouts behind the
//! completed ones. A fence that cannot be recorded or queried makes the tracker wait for the
//! whole device (`wait_all`, which in `ManualFences` completes every fence recorded so far),
//! then free its checkouts, and count an error.
//!
//! After every step the test compares the whole observable state: `counts()`, `state(i)` of
//! every slot, `is_live` of every checkout ever issued, the tracker's pending and error counts,
//! `manual.recorded()` and `manual.waits()`. Independently of the model it also checks the
//! safety property itself: a slot released behind a fence on stream `s` is free again only once
//! the first fence recorded on `s` after that release has completed, or the device was waited
//! for after that release.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinpool::allocation::slots::{Counts, SlotTable, State};
use pinpool::system::cuda::StreamHandle;
use pinpool::transfer::fence::{FenceId, FenceTracker, Fences, ManualFences};
use pinpool::{Error, Result, SlotId};
use proptest::prelude::*;

/// The arena's page size: the tables here have one-page slots.
fn page() -> usize {
    pinpool::memory::shm::page_size()
}

/// `table.state(i)` of every slot, at one moment.
type SlotStates = Vec<Option<(State, u32)>>;

/// [`ManualFences`] whose queries can be made to fail (a dead context); records fail through
/// `ManualFences::fail_records`. Each `wait_all` also notes the state of every slot at that
/// moment, so the test can check that a failed fence's slots were still fenced while the
/// device was waited for (and not freed first).
struct FlakyFences {
    manual: Arc<ManualFences>,
    fail_query: AtomicBool,
    table: Arc<SlotTable>,
    /// The slot states seen by each `wait_all`, in order.
    waits: Mutex<Vec<SlotStates>>,
}

impl Fences for FlakyFences {
    fn record(&self, stream: StreamHandle) -> Result<FenceId> {
        self.manual.record(stream)
    }

    fn is_complete(&self, id: FenceId) -> Result<bool> {
        if self.fail_query.load(Ordering::SeqCst) {
            return Err(Error::Cuda {
                call: "cuEventQuery",
                name: "CUDA_ERROR_TEST_QUERY".into(),
                code: 998,
            });
        }
        self.manual.is_complete(id)
    }

    fn recycle(&self, id: FenceId) {
        self.manual.recycle(id)
    }

    fn wait_all(&self) -> Result<()> {
        let states = (0..self.table.len()).map(|i| self.table.state(i)).collect();
        self.waits.lock().unwrap().push(states);
        self.manual.wait_all()
    }
}

/// Which checkout an operation uses.
#[derive(Debug, Clone, Copy)]
enum Pick {
    /// A checkout that is currently checked out (falls back to any checkout if none is).
    Live(usize),
    /// A checkout that has ended (falls back to any checkout if none has).
    Stale(usize),
    /// The most recently released checkout: a second release of it.
    LastReleased,
    /// A checkout the table never issued: a live slot's index with a future generation, or an
    /// index past the end.
    Forged(u32, bool),
}

#[derive(Debug, Clone)]
enum Op {
    /// `table.try_checkout()`.
    TryCheckout,
    /// What a pool's checkout does: try, retire fences, try again, and when nothing is free, a
    /// short `wait` that must come back empty-handed.
    Checkout,
    /// `table.release(checkout, false)`.
    Release(Pick),
    /// `tracker.release_fenced(&table, checkout, stream)`: queues, records nothing.
    ReleaseFenced(Pick, StreamHandle),
    /// `manual.complete_stream(stream)`: the GPU reached every fence recorded on `stream`.
    CompleteStream(StreamHandle),
    /// `manual.complete_all()`.
    CompleteAll,
    /// `tracker.retire_ready(&table)`.
    RetireReady,
    /// `table.complete_fence(checkout)` on a checkout that is not the slot's fenced checkout.
    StrayCompleteFence(Pick),
    /// `table.unfence(checkout)` on a checkout that is not the slot's fenced checkout.
    StrayUnfence(Pick),
    /// Make later fence records fail (or stop failing).
    FailRecord(bool),
    /// Make later fence queries fail (or stop failing).
    FailQuery(bool),
    /// `table.admit(page)`: one page of the arena (maybe one ready already) became ready.
    Admit(usize),
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        4 => any::<usize>().prop_map(Pick::Live),
        2 => any::<usize>().prop_map(Pick::Stale),
        2 => Just(Pick::LastReleased),
        1 => (any::<u32>(), any::<bool>()).prop_map(|(i, past_end)| Pick::Forged(i, past_end)),
    ]
}

/// Mostly a few streams, so that releases share them; now and then one of many.
fn stream() -> impl Strategy<Value = StreamHandle> {
    prop_oneof![8 => 0usize..4, 1 => 4usize..1000]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::TryCheckout),
        3 => Just(Op::Checkout),
        3 => pick().prop_map(Op::Release),
        6 => (pick(), stream()).prop_map(|(p, s)| Op::ReleaseFenced(p, s)),
        4 => stream().prop_map(Op::CompleteStream),
        1 => Just(Op::CompleteAll),
        4 => Just(Op::RetireReady),
        1 => pick().prop_map(Op::StrayCompleteFence),
        1 => pick().prop_map(Op::StrayUnfence),
        1 => any::<bool>().prop_map(Op::FailRecord),
        1 => any::<bool>().prop_map(Op::FailQuery),
        2 => (0usize..7).prop_map(Op::Admit),
    ]
}

/// The model's view of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Out,
    Fenced,
}

/// One fence recorded in the model, and the checkouts waiting on it.
#[derive(Debug, Clone)]
struct InFlight {
    fence: FenceId,
    checkouts: Vec<SlotId>,
}

/// What the test expects of the table, the tracker and the fences.
struct Model {
    /// The id of the table under test.
    table: u32,
    /// State of each slot.
    slots: Vec<Slot>,
    /// Generation of each slot's latest checkout (0 before the first).
    generation: Vec<u32>,
    /// The page of the arena each slot holds while it is out or fenced.
    page: Vec<Option<usize>>,
    /// Which pages of the arena are ready.
    ready: Vec<bool>,
    /// Every checkout ever handed out, in order.
    issued: Vec<SlotId>,
    /// The checkout most recently released successfully.
    last_released: Option<SlotId>,
    /// Fenced releases whose fence is not recorded yet, in release order.
    queued: Vec<(SlotId, StreamHandle)>,
    /// Every fence recorded so far: its stream and whether it has completed.
    fences: Vec<(StreamHandle, bool)>,
    /// Recorded fences whose checkouts are not free yet, in recording order.
    in_flight: Vec<InFlight>,
    fail_record: bool,
    fail_query: bool,
    /// Fences that failed to record or query, as the tracker counts them.
    errors: u64,
    /// `wait_all` calls.
    waits: u64,
    /// For each `wait_all` not checked yet: the checkouts it frees afterwards.
    waited_for: Vec<Vec<SlotId>>,
}

impl Model {
    fn new(n: usize, ready: usize, table: u32) -> Self {
        Model {
            table,
            slots: vec![Slot::Free; n],
            generation: vec![0; n],
            page: vec![None; n],
            ready: (0..n).map(|i| i < ready).collect(),
            issued: Vec::new(),
            last_released: None,
            queued: Vec::new(),
            fences: Vec::new(),
            in_flight: Vec::new(),
            fail_record: false,
            fail_query: false,
            errors: 0,
            waits: 0,
            waited_for: Vec::new(),
        }
    }

    fn is_live(&self, t: SlotId) -> bool {
        let i = t.index as usize;
        i < self.slots.len() && self.slots[i] == Slot::Out && self.generation[i] == t.generation
    }

    fn is_fenced_checkout(&self, t: SlotId) -> bool {
        let i = t.index as usize;
        i < self.slots.len() && self.slots[i] == Slot::Fenced && self.generation[i] == t.generation
    }

    fn counts(&self) -> Counts {
        let count = |s| self.slots.iter().filter(|&&x| x == s).count();
        Counts {
            free: count(Slot::Free).min(self.free_pages().len()),
            checked_out: count(Slot::Out),
            fenced: count(Slot::Fenced),
            preparing: self.ready.iter().filter(|&&r| !r).count(),
        }
    }

    /// Pages that are ready and held by no slot, lowest first: a checkout takes the first.
    fn free_pages(&self) -> Vec<usize> {
        (0..self.ready.len()).filter(|&p| self.ready[p] && !self.page.contains(&Some(p))).collect()
    }

    /// A slot goes back: its entry and its page.
    fn free_slot(&mut self, i: usize) {
        self.slots[i] = Slot::Free;
        self.page[i] = None;
    }

    /// Checkouts waiting on a fence: queued or in flight.
    fn pending(&self) -> usize {
        self.queued.len() + self.in_flight.iter().map(|f| f.checkouts.len()).sum::<usize>()
    }

    fn choose(&self, pick: Pick) -> Option<SlotId> {
        let n = self.slots.len() as u32;
        let from = |list: Vec<SlotId>, k: usize| {
            if list.is_empty() {
                None
            } else {
                Some(list[k % list.len()])
            }
        };
        let any = |k: usize| from(self.issued.clone(), k);
        match pick {
            Pick::Live(k) => {
                let live: Vec<SlotId> =
                    self.issued.iter().copied().filter(|&t| self.is_live(t)).collect();
                from(live, k).or_else(|| any(k))
            }
            Pick::Stale(k) => {
                let stale: Vec<SlotId> =
                    self.issued.iter().copied().filter(|&t| !self.is_live(t)).collect();
                from(stale, k).or_else(|| any(k))
            }
            Pick::LastReleased => self.last_released,
            Pick::Forged(k, past_end) => Some(if past_end {
                SlotId { table: self.table, index: n.saturating_add(k % 1000), generation: k }
            } else {
                let index = k % n;
                // A generation the slot has not reached yet.
                SlotId {
                    table: self.table,
                    index,
                    generation: self.generation[index as usize].wrapping_add(1),
                }
            }),
        }
    }

    /// The entries a checkout may use.
    fn free_slots(&self) -> Vec<usize> {
        (0..self.slots.len()).filter(|&i| self.slots[i] == Slot::Free).collect()
    }

    /// `complete_stream(stream)`: every fence recorded so far on `stream` completes; checkouts
    /// still queued are not affected (their fence is not recorded yet).
    fn complete_stream(&mut self, stream: StreamHandle) {
        for f in self.fences.iter_mut().filter(|f| f.0 == stream) {
            f.1 = true;
        }
    }

    fn complete_all(&mut self) {
        for f in &mut self.fences {
            f.1 = true;
        }
    }

    /// `table.complete_fence(t)`: 1 if it freed the slot.
    fn complete_fence(&mut self, t: SlotId) -> usize {
        if self.is_fenced_checkout(t) {
            self.free_slot(t.index as usize);
            1
        } else {
            0
        }
    }

    /// Fences failed: one error each, then one device wait (which completes every recorded
    /// fence), then the checkouts are freed.
    fn give_up(&mut self, checkouts: &[SlotId], failures: u64) -> usize {
        self.errors += failures;
        self.waits += 1;
        self.waited_for.push(checkouts.to_vec());
        self.complete_all();
        checkouts.iter().map(|&t| self.complete_fence(t)).sum()
    }

    /// Models `retire_ready`: returns how many slots it frees.
    fn retire(&mut self) -> usize {
        let mut freed = 0;
        // One fence per distinct stream, in order of first appearance in the queue.
        let mut groups: Vec<(StreamHandle, Vec<SlotId>)> = Vec::new();
        for (t, s) in std::mem::take(&mut self.queued) {
            match groups.iter_mut().find(|g| g.0 == s) {
                Some(g) => g.1.push(t),
                None => groups.push((s, vec![t])),
            }
        }
        let mut failed = Vec::new();
        let mut failures = 0;
        for (stream, checkouts) in groups {
            if self.fail_record {
                failures += 1;
                failed.extend(checkouts);
            } else {
                self.fences.push((stream, false));
                self.in_flight.push(InFlight { fence: self.fences.len() - 1, checkouts });
            }
        }
        // Poll every fence in flight, in order.
        let mut still = Vec::new();
        for f in std::mem::take(&mut self.in_flight) {
            if self.fail_query {
                failures += 1;
                failed.extend(f.checkouts);
            } else if self.fences[f.fence].1 {
                freed += f.checkouts.iter().map(|&t| self.complete_fence(t)).sum::<usize>();
            } else {
                still.push(f);
            }
        }
        self.in_flight = still;
        // Every fence that failed in one round (record or query) counts one error; they all
        // share one device wait, after the polling.
        if failures > 0 {
            freed += self.give_up(&failed, failures);
        }
        freed
    }
}

/// A fenced release the test watches until its slot is free again.
struct Watched {
    slot: SlotId,
    stream: StreamHandle,
    /// `manual.recorded().len()` at the release: the fence covering it has an id at least this.
    fences_before: usize,
    /// `manual.waits()` at the release.
    waits_before: u64,
}

struct Harness {
    table: Arc<SlotTable>,
    tracker: FenceTracker,
    manual: Arc<ManualFences>,
    flaky: Arc<FlakyFences>,
    model: Model,
    watched: Vec<Watched>,
}

impl Harness {
    fn new(n: usize) -> Self {
        Self::with_ready(n, n)
    }

    /// A table of `n` slots whose first `ready` are free, the rest preparing.
    fn with_ready(n: usize, ready: usize) -> Self {
        let manual = Arc::new(ManualFences::new());
        let table = Arc::new(SlotTable::with_ready(n, ready).unwrap());
        let flaky = Arc::new(FlakyFences {
            manual: Arc::clone(&manual),
            fail_query: AtomicBool::new(false),
            table: Arc::clone(&table),
            waits: Mutex::new(Vec::new()),
        });
        let tracker = FenceTracker::new(Box::new(Arc::clone(&flaky)));
        let model = Model::new(n, ready, table.id());
        Harness { table, tracker, manual, flaky, model, watched: Vec::new() }
    }

    /// Checks a checkout the table just handed out against the model, and records it.
    fn accept(&mut self, got: Option<SlotId>) -> std::result::Result<(), TestCaseError> {
        let free = self.model.free_slots();
        let pages = self.model.free_pages();
        match got {
            None => prop_assert!(
                free.is_empty() || pages.is_empty(),
                "nothing handed out while entries {free:?} and pages {pages:?} are free"
            ),
            Some(t) => {
                prop_assert!(!pages.is_empty(), "a slot handed out with no page ready and free");
                prop_assert_eq!(
                    self.table.extent(t),
                    Some((pages[0] * page(), page())),
                    "not the first free page"
                );
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
                    !self.model.issued.contains(&t),
                    "checkout {:?} handed out twice (issued: {:?})",
                    t,
                    self.model.issued
                );
                prop_assert_ne!(t.generation, self.model.generation[i], "generation not bumped");
                self.model.slots[i] = Slot::Out;
                self.model.page[i] = Some(pages[0]);
                self.model.generation[i] = t.generation;
                self.model.issued.push(t);
            }
        }
        Ok(())
    }

    fn retire(&mut self) -> std::result::Result<(), TestCaseError> {
        let retired = self.tracker.retire_ready(&self.table);
        prop_assert_eq!(retired, self.model.retire(), "slots freed by retire_ready");
        Ok(())
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
                    self.retire()?;
                    got = self.table.try_checkout();
                }
                if got.is_none() {
                    let t0 = Instant::now();
                    self.table.wait(self.table.epoch(), Duration::from_millis(1));
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
                    self.model.free_slot(t.index as usize);
                    self.model.last_released = Some(t);
                } else {
                    prop_assert_eq!(got, Err(Error::SlotReleased { index: t.index as usize }));
                }
            }
            Op::ReleaseFenced(p, stream) => {
                let Some(t) = self.model.choose(p) else { return Ok(()) };
                let fences_before = self.manual.recorded().len();
                let waits_before = self.manual.waits();
                let got = self.tracker.release_fenced(&self.table, t, stream);
                if self.model.is_live(t) {
                    // Succeeds even while records fail: a release only queues.
                    prop_assert_eq!(got, Ok(()));
                    prop_assert_eq!(
                        self.manual.recorded().len(),
                        fences_before,
                        "a release recorded a fence"
                    );
                    self.model.slots[t.index as usize] = Slot::Fenced;
                    self.model.queued.push((t, stream));
                    self.model.last_released = Some(t);
                    self.watched.push(Watched { slot: t, stream, fences_before, waits_before });
                } else {
                    prop_assert_eq!(got, Err(Error::SlotReleased { index: t.index as usize }));
                }
            }
            Op::CompleteStream(stream) => {
                self.manual.complete_stream(stream);
                self.model.complete_stream(stream);
            }
            Op::CompleteAll => {
                self.manual.complete_all();
                self.model.complete_all();
            }
            Op::RetireReady => self.retire()?,
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
                self.manual.fail_records(on);
                self.model.fail_record = on;
            }
            Op::Admit(p) => {
                let want = self.model.ready.get(p) == Some(&false);
                prop_assert_eq!(self.table.admit(p * page(), page()), want, "admit(page {})", p);
                if want {
                    self.model.ready[p] = true;
                }
            }
            Op::FailQuery(on) => {
                self.flaky.fail_query.store(on, Ordering::SeqCst);
                self.model.fail_query = on;
            }
        }
        self.check()
    }

    /// Compares everything observable with the model, and checks the fence safety property.
    fn check(&mut self) -> std::result::Result<(), TestCaseError> {
        let m = &self.model;
        prop_assert_eq!(self.table.counts(), m.counts());
        prop_assert_eq!(self.tracker.pending(), m.pending());
        prop_assert_eq!(self.tracker.errors(), m.errors);
        prop_assert_eq!(self.manual.waits(), m.waits);
        let recorded = self.manual.recorded();
        prop_assert_eq!(&recorded, &m.fences, "fences recorded (stream, done)");
        for i in 0..m.slots.len() {
            let want = match m.slots[i] {
                Slot::Free => State::Free,
                Slot::Out => State::CheckedOut,
                Slot::Fenced => State::Fenced,
            };
            prop_assert_eq!(self.table.state(i), Some((want, m.generation[i])), "slot {}", i);
        }
        prop_assert_eq!(self.table.state(m.slots.len()), None);
        // The model itself: each fenced slot waits in exactly one place, queue or one fence.
        let mut waiting: Vec<SlotId> = m.queued.iter().map(|q| q.0).collect();
        waiting.extend(m.in_flight.iter().flat_map(|f| f.checkouts.iter().copied()));
        let mut fenced: Vec<SlotId> =
            m.issued.iter().copied().filter(|&t| m.is_fenced_checkout(t)).collect();
        let key = |t: &SlotId| (t.index, t.generation);
        waiting.sort_unstable_by_key(key);
        fenced.sort_unstable_by_key(key);
        prop_assert_eq!(waiting, fenced, "model: fenced slots vs queue + fences in flight");
        let mut live_indices = Vec::new();
        for &t in &m.issued {
            prop_assert_eq!(self.table.is_live(t), m.is_live(t), "is_live({:?})", t);
            let held = m.page[t.index as usize];
            let want = if m.is_live(t) { held.map(|p| (p * page(), page())) } else { None };
            prop_assert_eq!(self.table.extent(t), want, "extent({:?})", t);
            if m.is_live(t) {
                live_indices.push(t.index);
            }
        }
        // No slot is held under two checkouts at once.
        let held = live_indices.len();
        live_indices.sort_unstable();
        live_indices.dedup();
        prop_assert_eq!(live_indices.len(), held, "a slot is live under two checkouts");
        // A device wait comes before the slots behind the failed fence are freed.
        let seen = std::mem::take(&mut *self.flaky.waits.lock().unwrap());
        let expected = std::mem::take(&mut self.model.waited_for);
        prop_assert_eq!(seen.len(), expected.len(), "wait_all calls in this step");
        for (states, checkouts) in seen.iter().zip(&expected) {
            for t in checkouts {
                prop_assert_eq!(
                    states[t.index as usize],
                    Some((State::Fenced, t.generation)),
                    "slot {} freed before the device wait that its failed fence needs",
                    t.index
                );
            }
        }
        // Safety, judged from the table and the fences alone: a fenced release is over only
        // once the first fence recorded on its stream after it has completed, or after a
        // device-wide wait that came after it.
        let waits = self.manual.waits();
        let mut still = Vec::new();
        for w in std::mem::take(&mut self.watched) {
            let i = w.slot.index as usize;
            if self.table.state(i) == Some((State::Fenced, w.slot.generation)) {
                still.push(w);
                continue;
            }
            let covered = recorded
                .iter()
                .skip(w.fences_before)
                .find(|f| f.0 == w.stream)
                .is_some_and(|f| f.1);
            prop_assert!(
                covered || waits > w.waits_before,
                "slot {} freed before its fence on stream {} completed (fences {:?})",
                i,
                w.stream,
                &recorded[w.fences_before..]
            );
        }
        self.watched = still;
        Ok(())
    }

    /// Stops the failures, records and completes every fence, retires: no slot stays fenced.
    fn drain_fences(&mut self) -> std::result::Result<(), TestCaseError> {
        self.step(&Op::FailQuery(false))?;
        self.step(&Op::FailRecord(false))?;
        self.step(&Op::RetireReady)?;
        prop_assert!(self.model.queued.is_empty());
        self.step(&Op::CompleteAll)?;
        self.step(&Op::RetireReady)?;
        prop_assert_eq!(self.tracker.pending(), 0);
        prop_assert_eq!(self.table.counts().fenced, 0);
        prop_assert!(self.watched.is_empty(), "a fenced release never ended");
        Ok(())
    }
}

/// 256 cases; under Miri, which interprets every step, 4 (about 45 s each for the model
/// test), and no regression file (file access is refused under Miri's isolation).
fn config() -> ProptestConfig {
    #[cfg(miri)]
    let config =
        ProptestConfig { cases: 4, failure_persistence: None, ..ProptestConfig::default() };
    #[cfg(not(miri))]
    let config = ProptestConfig { cases: 256, ..ProptestConfig::default() };
    config
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn slot_table_and_fences_follow_the_model(
        (n, ready) in (1usize..6).prop_flat_map(|n| (Just(n), 0..=n)),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut h = Harness::with_ready(n, ready);
        h.check()?;
        for op in &ops {
            h.step(op)?;
        }
        // Drain: every fence completes and is retired, everything still out is released; the
        // table ends all free.
        h.drain_fences()?;
        let live: Vec<SlotId> =
            h.model.issued.iter().copied().filter(|&t| h.model.is_live(t)).collect();
        for t in live {
            prop_assert_eq!(h.table.release(t, false), Ok(()));
            h.model.free_slot(t.index as usize);
        }
        for i in 0..n {
            h.step(&Op::Admit(i))?;
        }
        h.check()?;
        prop_assert_eq!(h.table.counts(), Counts { free: n, checked_out: 0, fenced: 0, preparing: 0 });
        // Every slot can be checked out once more, each exactly once.
        let mut seen: Vec<u32> = (0..n).map(|_| h.table.try_checkout().unwrap().index).collect();
        prop_assert!(h.table.try_checkout().is_none());
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
    }

    /// A fenced slot is never handed out before a fence recorded after its release on its own
    /// stream completes: not when other streams complete, not when its stream completes before
    /// its fence was recorded, however often the tracker is polled.
    #[test]
    fn fenced_slot_waits_for_a_fence_recorded_after_its_release(
        n in 1usize..7,
        streams in proptest::collection::vec(0usize..3, 6),
        early in proptest::collection::vec(any::<bool>(), 6),
        completed in proptest::collection::vec(0usize..3, 0..4),
        polls in 0usize..4,
    ) {
        let h = Harness::new(n);
        let checkouts: Vec<SlotId> = (0..n).map(|_| h.table.try_checkout().unwrap()).collect();
        let stream_of = |k: usize| 10 + streams[k];
        // The early releases get their fences recorded by a first retire; the late ones are
        // released after it, so their fences are not recorded yet.
        for k in (0..n).filter(|&k| early[k]) {
            h.tracker.release_fenced(&h.table, checkouts[k], stream_of(k)).unwrap();
        }
        prop_assert_eq!(h.tracker.retire_ready(&h.table), 0);
        prop_assert_eq!(
            h.manual.recorded().iter().map(|f| f.0).collect::<Vec<_>>(),
            {
                let mut firsts = Vec::new();
                for s in (0..n).filter(|&k| early[k]).map(stream_of) {
                    if !firsts.contains(&s) {
                        firsts.push(s);
                    }
                }
                firsts
            },
            "one fence per stream, in order of first release"
        );
        for k in (0..n).filter(|&k| !early[k]) {
            h.tracker.release_fenced(&h.table, checkouts[k], stream_of(k)).unwrap();
        }
        let done = |s: StreamHandle| completed.iter().any(|&c| 10 + c == s);
        for &c in &completed {
            h.manual.complete_stream(10 + c);
        }
        let mut retired = 0;
        for _ in 0..polls {
            retired += h.tracker.retire_ready(&h.table);
        }
        // Exactly the early releases on completed streams come back; late ones got a fresh
        // fence (or none yet), which has not completed.
        let mut expected: Vec<u32> = (0..n)
            .filter(|&k| early[k] && done(stream_of(k)))
            .map(|k| checkouts[k].index)
            .collect();
        expected.sort_unstable();
        prop_assert_eq!(retired, if polls > 0 { expected.len() } else { 0 });
        let take_all = |h: &Harness| -> Vec<u32> {
            std::iter::from_fn(|| h.table.try_checkout()).map(|t| t.index).collect()
        };
        let mut handed = take_all(&h);
        handed.sort_unstable();
        prop_assert_eq!(&handed, if polls > 0 { &expected } else { &Vec::new() });
        h.tracker.retire_ready(&h.table);
        handed.extend(take_all(&h));
        handed.sort_unstable();
        prop_assert_eq!(&handed, &expected);
        prop_assert_eq!(h.tracker.pending(), n - expected.len());
        for (k, t) in checkouts.iter().enumerate() {
            if !expected.contains(&t.index) {
                prop_assert_eq!(
                    h.table.state(t.index as usize),
                    Some((State::Fenced, t.generation)),
                    "release {} on stream {}",
                    k,
                    stream_of(k)
                );
            }
        }
        // Every fence is recorded now: completing the streams again frees everything left.
        prop_assert!(h.manual.recorded().iter().all(|f| !f.1 || done(f.0)));
        for s in 10..13 {
            h.manual.complete_stream(s);
        }
        prop_assert_eq!(h.tracker.retire_ready(&h.table), n - expected.len());
        prop_assert_eq!(h.tracker.pending(), 0);
        prop_assert_eq!(h.table.counts().free, n - expected.len());
        prop_assert_eq!(h.tracker.errors(), 0);
        prop_assert_eq!(h.manual.waits(), 0);
    }
}

#[test]
fn failed_records_count_per_stream_and_share_one_device_wait() {
    let mut h = Harness::new(4);
    for _ in 0..4 {
        h.step(&Op::TryCheckout).unwrap();
    }
    let [a, b, c, d] = [0, 1, 2, 3].map(|k| h.model.issued[k]);
    // One fence in flight on stream 1, then records fail with three checkouts on two streams.
    h.tracker.release_fenced(&h.table, a, 1).unwrap();
    h.tracker.retire_ready(&h.table);
    h.manual.fail_records(true);
    for (t, s) in [(b, 2), (c, 3), (d, 2)] {
        h.tracker.release_fenced(&h.table, t, s).unwrap();
    }
    // Each stream's failed record counts an error; one device wait covers them all and
    // frees their slots. It completes the fence of stream 1 too, whose slot the next
    // retire frees.
    assert_eq!(h.tracker.retire_ready(&h.table), 3);
    assert_eq!(h.manual.waits(), 1);
    assert_eq!(h.tracker.errors(), 2);
    assert_eq!(h.manual.recorded(), vec![(1, true)]);
    assert_eq!(h.tracker.retire_ready(&h.table), 1);
    assert_eq!(h.tracker.pending(), 0);
    assert_eq!(h.table.counts().free, 4);
}

/// `FenceTracker::errors` counts every fence that failed to record or query.
#[test]

fn every_failed_fence_query_counts_an_error() {
    let h = Harness::new(2);
    let (a, b) = (h.table.try_checkout().unwrap(), h.table.try_checkout().unwrap());
    h.tracker.release_fenced(&h.table, a, 1).unwrap();
    h.tracker.release_fenced(&h.table, b, 2).unwrap();
    assert_eq!(h.tracker.retire_ready(&h.table), 0);
    assert_eq!(h.manual.recorded().len(), 2);
    h.flaky.fail_query.store(true, Ordering::SeqCst);
    assert_eq!(h.tracker.retire_ready(&h.table), 2);
    assert_eq!(h.tracker.errors(), 2, "two fences failed to query");
}

#[test]
fn wait_returns_at_once_when_something_was_freed_or_the_table_is_closed() {
    let table = SlotTable::new(1).unwrap();
    let seen = table.epoch();
    let held = table.try_checkout().unwrap();
    table.release(held, false).unwrap();
    let t0 = Instant::now();
    table.wait(seen, Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(5), "waited although a slot was freed since");
    let t0 = Instant::now();
    table.wait(table.epoch(), Duration::from_millis(30));
    assert!(t0.elapsed() >= Duration::from_millis(30), "woke with nothing freed");
    let seen = table.epoch();
    table.close();
    let t0 = Instant::now();
    table.wait(seen, Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(5), "waited although the table is closed");
}
