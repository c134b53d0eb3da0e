"""One measured run: make a loader, warm it up, then time a window of ``steps`` batches.

What a run records (the timed window starts after ``warmup`` batches, with workers running,
and ends the epoch: the dataset holds ``warmup + steps`` batches):

- ``time_to_first_batch_s``: from just before the loader is constructed to the moment the
  first ``next()`` returns (construction, ``iter()``, workers starting, the first batch);
- ``end_of_epoch_ms``: the first epoch's final ``next()``, the one that raises
  ``StopIteration`` (where workers are not persistent, it shuts them down);
- ``wall_s``: ``perf_counter`` from just before the first timed ``next()`` to the end of the
  last step, after ``torch.cuda.synchronize()``, so queued copies and kernels are inside it;
- ``gb_per_s`` = bytes / wall / 1e9 (bytes: ``nbytes`` of every tensor of every timed batch,
  strings count 0), ``batches_per_s`` = steps / wall and ``us_per_batch`` = wall / steps in
  microseconds. With no CUDA there is no copy: this is the rate at which batches reach the
  consumer;
- compute loop only: per step the batch goes to the device, :meth:`ComputeWork.step` queues
  the work between two CUDA events, then ``loss.item()`` waits for it. ``busy_ms`` per step is
  the event interval; ``idle_share`` = 1 - sum(busy) / wall; ``steps_per_s`` = steps / wall.
  A third event, recorded before the batch goes to the device, also counts the step's own copy
  of a CPU batch (``.to(device)``) as GPU work: ``idle_share_copy_busy`` (the same as
  ``idle_share`` for batches already on the device);
- ``step_ms``: wall time of each step (for the compute loop, up to after ``item()``), and
  ``wait_ms``: the part of it spent in ``next()``, summarised as ``next_ms_median`` and
  ``next_ms_p99``;
- ``probe_*_ms``: a thread sleeps 1 ms in a loop; its lateness (actual sleep - 1 ms) over the
  window, max and p99. A main process busy holding the GIL shows up here;
- ``cpu_ms_per_batch``: ``getrusage(RUSAGE_SELF)`` user+sys over the window (every thread of
  the main process but the probe's, workers excluded) / steps;
- ``pinned_mib``: for torch loaders the peak of torch's pinned host allocator
  (``allocated_bytes.peak``; its cache is emptied and its peak reset before the loader is
  made); for pinpool loaders the pool's ``arena_bytes`` plus that peak;
- ``pinned_held_bytes`` (and ``pinned_held_mib``): the pinned host memory the loader's
  process holds at the end of the epoch, before the loader is deleted: for torch loaders
  what torch's caching host allocator holds (``allocated_bytes.current`` of
  ``torch.cuda.host_memory_stats()``: its blocks in use and cached, at their rounded sizes);
  for pinpool loaders the pool's ``arena_bytes`` (fixed) plus that (normally 0). Without
  CUDA torch pins nothing: None for torch loaders (``pinned_held`` says ``n/a (no CUDA)``),
  the arena's size for pinpool's (ordinary host memory there); ``pinned_held`` says which;
- ``overflow_batches``, ``zero_copy_fallbacks``: pinpool loaders only (None for torch's),
  from ``loader.stats()`` at the end: batches that went to unpinned memory, and batches a
  zero-copy loader moved through copy mode instead.

The stall scenario also follows the loader's whole life: the probe runs from before
construction to the end, the loader goes through a second whole epoch after the first, then
``del it, loader`` and ``gc.collect()`` are timed one by one. ``phases`` holds, for each of
:data:`PHASES`, its wall time (``wall_ms``) and the worst probe lateness within it
(``probe_max_ms``: a lateness that runs across a phase boundary is split there, so no phase is
charged more than its own wall time; 0 when no wake-up was held up in it, ``probe_samples``
says how many wake-ups fell in it), and the same for a second sleeper in a process of its own
(``outside_max_ms``, ``outside_samples``): where it is late too, the machine's CPUs were all
taken, not the loader's process held up. The per-step figures above still cover the timed
window of the first epoch only (its probe figures clipped to the window the same way).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

import pinpool

from .gpu_work import ComputeWork
from .loaders import LoaderSpec, build, transfer
from .pinned_memory import host_pinned, host_pinned_held, pinned_held, reset_host_pinned
from .probes import OutsideProbe, StallProbe
from .workloads import batch_nbytes, collate_of

MIB = 1 << 20

#: The phases of a loader's life that the stall scenario reports one by one, in order.
PHASES = {
    "construction": "building the loader object",
    "first_batch": "iter() and the first next()",
    "epoch1": "the rest of the first epoch (warm-up, the timed steps, the end of the epoch)",
    "epoch2": "a second whole epoch over the same loader",
    "del": "del it, loader",
    "gc": "gc.collect() right after",
}


@dataclass
class Scenario:
    """What every run of one scenario does (saved as the JSON's ``scenarios`` entries)."""

    workload: str
    mode: str  # "throughput", "compute", "stall" or "churn"
    batch_size: int
    shape: tuple[int, ...]
    workers: int
    prefetch_factor: int
    warmup: int
    steps: int
    description: str = "not run"


def _sync(device: torch.device | None) -> None:
    if device is not None:
        torch.cuda.synchronize(device)


def _pool_info(pool: Any) -> dict[str, Any] | None:
    """A pinpool loader's pool, as plain figures (None for torch loaders)."""
    if pool is None:
        return None
    names = ("arena_bytes", "slot_bytes", "num_slots", "backend", "memory", "notes")
    return {name: getattr(pool, name) for name in names}


class Step(NamedTuple):
    """One step's bytes, times (``perf_counter`` seconds) and the CUDA events of its work."""

    nbytes: int
    start: float  # before next()
    got: float  # next() returned
    end: float  # the step is over (compute loop: after loss.item())
    events: tuple[Any, Any, Any] | None  # before the copy to the device, work start, work end


def _step(spec: LoaderSpec, it: Any, device: torch.device | None, work: ComputeWork | None) -> Step:
    """One step: ``next(it)``, the batch to the device, the work (if any). Lets next()'s
    StopIteration through."""
    t0 = time.perf_counter()
    batch = next(it)
    t1 = time.perf_counter()
    nbytes = batch_nbytes(batch)
    before = None
    if work is not None:
        before = work.before_event
        before.record()
    on_device = transfer(spec, batch, device)
    del batch
    events = None
    if work is not None:
        start, end, loss = work.step(on_device)
        loss.item()  # the read-back: a main thread that stalls now leaves the GPU idle
        events = (before, start, end)
    del on_device
    return Step(nbytes, t0, t1, time.perf_counter(), events)


def _outliving_workers(grace_s: float = 5.0) -> int:
    """Worker processes still alive ``grace_s`` (torch's status-check interval) after the
    loader went: pinpool's workers of an ended epoch exit, and are reaped, on a thread of
    pinpool's, as the training loop goes on."""
    deadline = time.monotonic() + grace_s
    while (alive := len(multiprocessing.active_children())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _phase(
    probe: StallProbe, outside: OutsideProbe, start: float, end: float, **extra: Any
) -> dict[str, Any]:
    """One phase of a loader's life: its wall time and the worst lateness in it of the probe
    in the loader's process and of the one outside it."""
    late = probe.late_ms(start, end)
    late_outside = outside.late_ms(start, end)
    return {
        "wall_ms": (end - start) * 1e3,
        "probe_max_ms": float(late.max()) if len(late) else 0.0,
        "probe_samples": len(late),
        "outside_max_ms": float(late_outside.max()) if len(late_outside) else 0.0,
        "outside_samples": len(late_outside),
        **extra,
    }


def run_once(
    spec: LoaderSpec,
    dataset: Any,
    plan: Scenario,
    device: torch.device | None,
    work: ComputeWork | None,
    sampler: Any = None,
) -> dict[str, Any]:
    """Makes a fresh loader for ``spec``, runs one repeat of ``plan``, returns the figures.
    ``sampler``: the rank's shard of ``dataset`` in a data-parallel run.

    Every mode: construction, the first batch (``time_to_first_batch_s``), the rest of the
    warm-up, then the timed window of ``plan.steps`` batches, which ends the epoch. The stall
    scenario goes on for a whole second epoch over the same loader, then deletes the loader
    and collects garbage; its probe runs from before construction to the end, and each of
    :data:`PHASES` is reported on its own (``phases``).
    """
    if plan.mode == "churn":
        return run_churn(spec, dataset, plan, device)
    life = plan.mode == "stall"  # the whole life, phase by phase
    epoch = plan.warmup + plan.steps  # batches in the dataset
    reset_host_pinned()
    probe, outside = StallProbe(), OutsideProbe()
    if life:
        outside.start()
        probe.start()
    loader: Any = None
    it: Any = None
    try:
        t_start = time.perf_counter()
        loader = build(
            spec,
            dataset,
            batch_size=plan.batch_size,
            workers=plan.workers,
            prefetch_factor=plan.prefetch_factor,
            device=None if device is None else str(device),
            sampler=sampler,
            collate_fn=collate_of(dataset),
        )
        t_built = time.perf_counter()
        it = iter(loader)
        first = _step(spec, it, device, work)  # the first batch opens the warm-up
        for _ in range(plan.warmup - 1):
            _step(spec, it, device, work)
        _sync(device)
        nbytes, step_s, wait_s, events = 0, [], [], []
        if not life:
            probe.start()
        probe_cpu0 = probe.cpu_s()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(plan.steps):
            st = _step(spec, it, device, work)
            nbytes += st.nbytes
            wait_s.append(st.got - st.start)
            step_s.append(st.end - st.start)
            if st.events is not None:
                events.append(st.events)
        _sync(device)
        t1 = time.perf_counter()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        probe_cpu1 = probe.cpu_s()
        if not life:
            probe.stop()
        t_last = time.perf_counter()
        if next(it, None) is not None:  # the dataset holds exactly warmup + steps batches
            raise RuntimeError("the loader yielded more batches than the run asked for")
        t_epoch1 = time.perf_counter()
        if life:  # a second epoch over the same loader
            it = iter(loader)
            second = _step(spec, it, device, work)
            batches = 1
            while True:
                try:
                    _step(spec, it, device, work)
                except StopIteration:
                    break
                batches += 1
            _sync(device)
            t_epoch2 = time.perf_counter()
            if batches != epoch:
                raise RuntimeError(f"the second epoch had {batches} batches, not {epoch}")
        pinned = host_pinned()
        torch_held = host_pinned_held()
        pool = _pool_info(getattr(loader, "pool", None))
        stats = loader.stats() if hasattr(loader, "stats") else None
        t_del = time.perf_counter()
        del it, loader
        t_gc = time.perf_counter()
        gc.collect()
        t_end = time.perf_counter()
        _sync(device)
    except BaseException:
        # A failed run: its loader and workers go now, not with the traceback that holds them.
        it = loader = None  # noqa: F841
        gc.collect()
        _sync(device)
        raise
    finally:
        probe.stop()
        outside.stop()
        # A deleted pinpool loader's arena is freed on a background thread. Wait for that
        # here, outside every measurement, so it does not run into the next loader's.
        t_release = time.perf_counter()
        pinpool.wait_for_freed_pools(timeout=120)
        release_s = time.perf_counter() - t_release
    wall = t1 - t0
    # The main process's CPU, less the probe thread's own (it wakes 1000 times a second, so
    # its share would grow with the time a batch takes, not with the loader's work).
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    cpu -= probe_cpu1 - probe_cpu0
    late_ms = probe.late_ms(t0, t1)
    steps_ms = [s * 1e3 for s in step_s]
    next_ms = [s * 1e3 for s in wait_s]
    rec: dict[str, Any] = {
        "steps": plan.steps,
        "bytes": nbytes,
        "wall_s": wall,
        "gb_per_s": nbytes / wall / 1e9,
        "batches_per_s": plan.steps / wall,
        "us_per_batch": wall / plan.steps * 1e6,
        "background_release_s": release_s,
        "time_to_first_batch_s": first.got - t_start,
        "end_of_epoch_ms": (t_epoch1 - t_last) * 1e3,
        "step_ms": steps_ms,
        "wait_ms": next_ms,
        "step_ms_median": float(np.median(steps_ms)),
        "step_ms_max": max(steps_ms),
        "next_ms_median": float(np.median(next_ms)),
        "next_ms_p99": float(np.percentile(next_ms, 99)),
        "next_ms_max": max(next_ms),
        "probe_samples": len(late_ms),
        "probe_max_ms": float(late_ms.max()) if len(late_ms) else None,
        "probe_p99_ms": float(np.percentile(late_ms, 99)) if len(late_ms) else None,
        "probe_p50_ms": float(np.percentile(late_ms, 50)) if len(late_ms) else None,
        "cpu_s": cpu,
        "cpu_ms_per_batch": cpu / plan.steps * 1e3,
        "torch_host_pinned": pinned,
        "pool": pool,
        "loader_stats": stats,
        **pinned_held(stats, pool, torch_held),
        "leaked_workers": _outliving_workers(),
    }
    if life:
        rec["phases"] = {
            "construction": _phase(probe, outside, t_start, t_built),
            "first_batch": _phase(probe, outside, t_built, first.got),
            "epoch1": _phase(probe, outside, first.got, t_epoch1, batches=epoch - 1),
            "epoch2": _phase(
                probe,
                outside,
                t_epoch1,
                t_epoch2,
                batches=batches,
                first_batch_ms=(second.got - t_epoch1) * 1e3,
            ),
            "del": _phase(probe, outside, t_del, t_gc),
            "gc": _phase(probe, outside, t_gc, t_end),
        }
    torch_peak = None if pinned is None else pinned["allocated_bytes_peak"]
    rec["pinned_mib"] = None if torch_peak is None else torch_peak / MIB
    if pool is not None:
        rec["pinned_mib"] = (pool["arena_bytes"] + (torch_peak or 0)) / MIB
    if events:
        busy = [float(a.elapsed_time(b)) for _, a, b in events]
        with_copy = [float(a.elapsed_time(b)) for a, _, b in events]
        rec["busy_ms"] = busy
        rec["idle_share_copy_busy"] = max(0.0, 1.0 - sum(with_copy) / (wall * 1e3))
        rec["busy_ms_median"] = float(np.median(busy))
        rec["idle_share"] = max(0.0, 1.0 - sum(busy) / (wall * 1e3))
        rec["steps_per_s"] = plan.steps / wall
    return rec


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_churn(
    spec: LoaderSpec, dataset: Any, plan: Scenario, device: torch.device | None
) -> dict[str, Any]:
    """``plan.steps`` loaders for ``spec`` made one after the other, each run for one epoch
    over ``dataset`` (a few items) and dropped: the time each costs, and how far the process's
    resident memory and threads grew over the loop (what the loaders left behind, or had not
    given back yet)."""
    gc.collect()
    pinpool.wait_for_freed_pools(timeout=120)
    rss0, threads0 = _rss_mib(), _threads()
    rss_peak, threads_peak = rss0, threads0
    t0 = time.perf_counter()
    for _ in range(plan.steps):
        loader = build(
            spec,
            dataset,
            batch_size=plan.batch_size,
            workers=plan.workers,
            prefetch_factor=plan.prefetch_factor,
            device=None if device is None else str(device),
            collate_fn=collate_of(dataset),
        )
        for batch in loader:
            del batch
        del loader
        rss_peak, threads_peak = max(rss_peak, _rss_mib()), max(threads_peak, _threads())
    _sync(device)
    wall = time.perf_counter() - t0
    gc.collect()
    pinpool.wait_for_freed_pools(timeout=120)
    return {
        "steps": plan.steps,
        "ms_per_loader": wall / plan.steps * 1e3,
        "rss_growth_mib": rss_peak - rss0,
        "thread_growth": threads_peak - threads0,
        "rss_left_mib": _rss_mib() - rss0,
    }
