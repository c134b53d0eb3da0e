//! What a checkout + release costs, next to what the allocations a pool saves would cost.
//!
//! Groups:
//! - `checkout+release`: one thread, a host pool (`try_checkout` + `release(None)`);
//! - `checkout+release, 8 threads`: eight threads contending for one pool, time per operation;
//! - `slots of random sizes`: the extent map alone (allocate + free of random sizes among a
//!   few dozen live extents, freed in random order), and a pool's checkout + release of random
//!   sizes with other slots held, on one thread and on eight;
//! - `malloc+free`: `libc::malloc` + `free` of a slot's size, one byte touched;
//! - `cuMemHostAlloc+cuMemFreeHost`: the same with pinned memory (needs a CUDA device);
//! - `checkout+release fenced, instant fences`: a host pool whose releases with a stream go
//!   through the fence tracker, with fences that complete as soon as they are recorded: what
//!   the queue, one fence per stream per retire, and the retire itself cost, without a GPU;
//! - `checkout+release fenced`: a CUDA pool, released behind an event on stream 0 (needs a
//!   CUDA device);
//! - `release with a queued fence`: the release alone (the slots are checked out before the
//!   clock starts), behind a fence that is only queued: what a Python thread pays when a batch
//!   dies;
//! - `copy into a slot`: the copier's GB/s from a shared-memory segment into a slot, 64 MiB,
//!   by thread count (a fresh pool for each count).
//!
//! Without a CUDA device the two CUDA groups are skipped with a note. Kept short: the whole
//! run takes well under two minutes.

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pinpool::allocation::extents::ExtentMap;
use pinpool::memory::shm::Mapping;
use pinpool::system::cuda::{self, Device, StreamHandle};
use pinpool::transfer::copy::CopyRange;
use pinpool::transfer::fence::{FenceId, Fences, ManualFences};
use pinpool::{Pool, PoolConfig, Result};

const MIB: usize = 1 << 20;
/// Slot sizes compared: a small batch, and an awkward large one (past glibc's mmap threshold).
const SIZES: [(usize, &str); 2] = [(MIB, "1MiB"), (37 * MIB, "37MiB")];
const THREADS: usize = 8;

/// CUDA device 0, or `None` with a note saying why `group` is skipped.
fn cuda_device(group: &str) -> Option<Arc<Device>> {
    let why = match cuda::device_count() {
        Ok(n) if n > 0 => match Device::open(0) {
            Ok(d) => return Some(d),
            Err(e) => format!("CUDA device 0 cannot be opened: {e}"),
        },
        Ok(_) => "no CUDA device".to_string(),
        Err(e) => format!("no CUDA driver: {e}"),
    };
    println!("note: skipping {group} ({why})");
    None
}

fn uncontended(c: &mut Criterion) {
    let pool = Pool::new(&PoolConfig::host(MIB, 8)).expect("host pool");
    let mut g = c.benchmark_group("checkout+release");
    g.bench_function("1 thread", |b| {
        b.iter(|| {
            let t = pool.try_checkout().unwrap().expect("a free slot");
            pool.release(black_box(t), None).unwrap();
        })
    });
    g.finish();
}

/// `THREADS` threads each doing `op` `iters` times (each with a size generator of its own);
/// returns the time per operation (wall time / `THREADS`, so that criterion's per-iteration
/// figure is per operation).
fn on_threads(pool: &Arc<Pool>, iters: u64, op: fn(&Pool, &mut Sizes)) -> Duration {
    let start = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let (pool, start) = (Arc::clone(pool), Arc::clone(&start));
            thread::spawn(move || {
                let mut sizes = Sizes(0x9e37_79b9_7f4a_7c15 ^ me as u64);
                start.wait();
                for _ in 0..iters {
                    op(&pool, &mut sizes);
                }
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    for w in workers {
        w.join().unwrap();
    }
    t0.elapsed() / THREADS as u32
}

/// A slot of the pool's size, taken without waiting (spinning until one is free).
fn spin_checkout_release(pool: &Pool, _: &mut Sizes) {
    let t = loop {
        if let Some(t) = pool.try_checkout().unwrap() {
            break t;
        }
        std::hint::spin_loop();
    };
    pool.release(black_box(t), None).unwrap();
}

/// A slot of the pool's size, waiting for one.
fn blocking_checkout_release(pool: &Pool, _: &mut Sizes) {
    let t = pool.checkout(None).unwrap();
    pool.release(black_box(t), None).unwrap();
}

/// A slot of a random size up to 2 MiB, waiting for room.
fn random_checkout_release(pool: &Pool, sizes: &mut Sizes) {
    let t = pool.checkout_bytes(1 + sizes.next(2 * MIB), None).unwrap();
    pool.release(black_box(t), None).unwrap();
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group(format!("checkout+release, {THREADS} threads"));
    // Enough slots that no thread ever waits: only the free list is contended.
    let roomy = Pool::new(&PoolConfig::host(MIB, 2 * THREADS)).expect("host pool");
    g.bench_function(format!("{} slots, try_checkout", 2 * THREADS), |b| {
        b.iter_custom(|iters| on_threads(&roomy, iters, spin_checkout_release))
    });
    // Fewer slots than threads: checkouts block and releases wake them.
    let scarce = Pool::new(&PoolConfig::host(MIB, THREADS / 2)).expect("host pool");
    g.bench_function(format!("{} slots, blocking checkout", THREADS / 2), |b| {
        b.iter_custom(|iters| on_threads(&scarce, iters, blocking_checkout_release))
    });
    g.finish();
}

/// A small, fast generator for sizes (xorshift); deterministic per seed.
struct Sizes(u64);

impl Sizes {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below as u64) as usize
    }
}

fn random_sizes(c: &mut Criterion) {
    const PAGE: usize = 4096;
    let mut g = c.benchmark_group("slots of random sizes");
    // The extent map alone: 48 live extents of 1 byte to 2 MiB in a 256 MiB arena of 4
    // parts; each iteration frees one at random and allocates one of a random size.
    let arena = 256 * MIB;
    let mut map = ExtentMap::new(arena, PAGE, &[64 * MIB, 128 * MIB, 192 * MIB]).unwrap();
    map.free(0, arena).unwrap();
    let mut sizes = Sizes(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<(usize, usize)> =
        (0..48).filter_map(|_| map.alloc(1 + sizes.next(2 * MIB), 0)).collect();
    g.bench_function("extent map: free one + allocate one, 48 live", |b| {
        b.iter(|| {
            let i = sizes.next(live.len());
            let (o, l) = live.swap_remove(i);
            map.free(o, l).unwrap();
            live.push(map.alloc(black_box(1 + sizes.next(2 * MIB)), 0).expect("room"));
        })
    });
    // A pool: checkout + release of a random size while 16 other slots are held.
    let config = PoolConfig { arena_bytes: Some(arena), ..PoolConfig::host(64 * MIB, 64) };
    let pool = Pool::new(&config).expect("host pool");
    let held: Vec<_> = (0..16)
        .map(|k| pool.try_checkout_bytes(1 + (k * 97 * PAGE) % (2 * MIB), 0).unwrap().unwrap())
        .collect();
    g.bench_function("pool: checkout + release, 16 held", |b| {
        b.iter(|| {
            let n = 1 + sizes.next(2 * MIB);
            let t = pool.try_checkout_bytes(black_box(n), 0).unwrap().expect("room");
            pool.release(black_box(t), None).unwrap();
        })
    });
    g.bench_function(format!("pool: checkout + release, {THREADS} threads"), |b| {
        b.iter_custom(|iters| on_threads(&pool, iters, random_checkout_release))
    });
    for t in held {
        pool.release(t, None).unwrap();
    }
    g.finish();
}

fn malloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("malloc+free");
    for (size, name) in SIZES {
        g.bench_with_input(BenchmarkId::from_parameter(name), &size, |b, &size| {
            b.iter(|| {
                // SAFETY: malloc has no preconditions; the result is checked for null before
                // the one write, which lies inside the `size` (> 0) bytes just allocated, and
                // the pointer is freed exactly once, right after.
                unsafe {
                    let p = libc::malloc(black_box(size)).cast::<u8>();
                    assert!(!p.is_null(), "malloc({size}) failed");
                    p.write_volatile(1);
                    libc::free(black_box(p).cast());
                }
            })
        });
    }
    g.finish();
}

fn pinned_alloc(c: &mut Criterion) {
    const GROUP: &str = "cuMemHostAlloc+cuMemFreeHost";
    let Some(device) = cuda_device(GROUP) else { return };
    let mut g = c.benchmark_group(GROUP);
    for (size, name) in SIZES {
        g.bench_with_input(BenchmarkId::from_parameter(name), &size, |b, &size| {
            b.iter(|| {
                let p = device.host_alloc(black_box(size)).expect("cuMemHostAlloc");
                // SAFETY: `p` is a live allocation of `size` (> 0) bytes from `host_alloc`, so
                // the one write lies inside it; it is freed once, on the same device, and not
                // used afterwards.
                unsafe {
                    p.write_volatile(1);
                    device.free_host(black_box(p)).expect("cuMemFreeHost");
                }
            })
        });
    }
    g.finish();
}

/// Fences that have completed by the time they are recorded: the tracker's cost alone.
#[derive(Default)]
struct InstantFences {
    next: AtomicUsize,
}

impl Fences for InstantFences {
    fn record(&self, _stream: StreamHandle) -> Result<FenceId> {
        Ok(self.next.fetch_add(1, Ordering::Relaxed))
    }

    fn is_complete(&self, _id: FenceId) -> Result<bool> {
        Ok(true)
    }

    fn recycle(&self, _id: FenceId) {}

    fn wait_all(&self) -> Result<()> {
        Ok(())
    }
}

fn fenced_instant(c: &mut Criterion) {
    const SLOTS: usize = 8;
    let mut g = c.benchmark_group("checkout+release fenced, instant fences");
    for streams in [1, 4] {
        let fences = Arc::new(InstantFences::default());
        let pool = Pool::with_fences(&PoolConfig::host(MIB, SLOTS), Box::new(Arc::clone(&fences)))
            .expect("host pool with fences");
        // Streams from 10 up: 1 and 2 are the CUDA handles of the legacy and the per-thread
        // default stream, whose fences are recorded at once, on the releasing thread.
        let mut k: StreamHandle = 0;
        let plural = if streams == 1 { "" } else { "s" };
        g.bench_function(format!("{SLOTS} slots, {streams} stream{plural}"), |b| {
            b.iter(|| {
                // The release only queues; a checkout that finds no free slot (or the pool's
                // fence thread, whichever comes first) records one fence per stream for
                // everything queued and frees the slots behind it.
                let t = pool.checkout(None).unwrap();
                k = (k + 1) % streams;
                pool.release(black_box(t), Some(10 + k)).unwrap();
            })
        });
        let stats = pool.stats();
        println!(
            "{streams} stream{plural}: {} fenced releases, {} fences recorded, {} checkouts waited",
            stats.releases,
            fences.next.load(Ordering::Relaxed),
            stats.waits
        );
    }
    g.finish();
}

fn fenced_cuda(c: &mut Criterion) {
    const GROUP: &str = "checkout+release fenced";
    if cuda_device(GROUP).is_none() {
        return;
    }
    let config = PoolConfig { device: Some(0), ..PoolConfig::host(MIB, 8) };
    let pool = match Pool::new(&config) {
        Ok(p) => p,
        Err(e) => {
            println!("note: skipping {GROUP} (no CUDA pool: {e})");
            return;
        }
    };
    let mut g = c.benchmark_group(GROUP);
    g.bench_function(format!("stream 0, {}", pool.backend().name()), |b| {
        b.iter(|| {
            // The release only queues the slot; the pool's fence thread (or a checkout that
            // finds none free) records one event on stream 0 for everything queued. It
            // completes at once (no work queued), but the slots come back only once the pool
            // has seen it complete.
            let t = pool.checkout(None).unwrap();
            pool.release(black_box(t), Some(0)).unwrap();
        })
    });
    g.finish();
}

fn release_queued(c: &mut Criterion) {
    let mut g = c.benchmark_group("release with a queued fence");
    g.bench_function("1 thread", |b| {
        b.iter_custom(|iters| {
            // A fresh pool per batch of iterations, with a slot for each, all checked out
            // before the clock starts. Its fences complete only when told, after the clock
            // stops, so every timed release just queues.
            let n = usize::try_from(iters).unwrap_or(usize::MAX).max(1);
            let fences = Arc::new(ManualFences::new());
            let pool = Pool::with_fences(&PoolConfig::host(4096, n), Box::new(Arc::clone(&fences)))
                .expect("host pool with fences");
            let checkouts: Vec<_> = (0..n).map(|_| pool.try_checkout().unwrap().unwrap()).collect();
            let t0 = Instant::now();
            for t in checkouts {
                pool.release(black_box(t), Some(10)).unwrap();
            }
            let took = t0.elapsed();
            pool.retire_fences();
            fences.complete_all();
            took
        })
    });
    g.finish();
}

fn copy_into_slot(c: &mut Criterion) {
    const BYTES: usize = 64 * MIB;
    let src = Mapping::memfd("pinpool-bench", BYTES).expect("a segment");
    // SAFETY: the mapping is BYTES long, writable and ours alone.
    unsafe { std::ptr::write_bytes(src.as_ptr(), 7, BYTES) };
    let ranges = [CopyRange { src: 0, dst: 0, len: BYTES }];
    let mut g = c.benchmark_group("copy into a slot, 64 MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    for threads in [1, 2, 4, 8] {
        let config = PoolConfig { copy_threads: threads, ..PoolConfig::host(BYTES, 1) };
        let pool = Pool::new(&config).expect("host pool");
        let t = pool.try_checkout().unwrap().expect("a free slot");
        g.bench_with_input(BenchmarkId::new("threads", threads), &threads, |b, _| {
            b.iter(|| pool.copy_in(t, black_box(&src), &ranges).unwrap())
        });
        pool.release(t, None).unwrap();
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = uncontended, contended, random_sizes, malloc_free, pinned_alloc, fenced_instant, fenced_cuda,
        release_queued, copy_into_slot
}
criterion_main!(benches);
