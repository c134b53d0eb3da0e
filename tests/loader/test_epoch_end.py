"""An epoch's end: the final ``next()`` hands the workers' shutdown to pinpool's ending thread
instead of waiting for each worker to exit, and nothing is lost by it: the next epoch runs,
and the loader can be closed, while the old workers still exit; the ending thread reaps every
one of them (and kills one stuck in its exit); an epoch left early is still shut down before
``del`` returns."""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from loader_datasets import Indexed

import pinpool
import pinpool.trace
from pinpool._main.epochs import ending_thread

N, BATCH = 24, 4


class _HeldAtExit:
    """A ``worker_init_fn`` that writes the worker's pid to ``folder``, and, while the file
    ``folder/hold`` exists, keeps the worker from exiting until it is removed (a finalizer
    multiprocessing runs as the worker's process ends)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        (self.folder / f"pid-{os.getpid()}").write_text("")
        if (self.folder / "hold").exists():
            multiprocessing.util.Finalize(None, _wait_gone, (self.folder / "hold",), exitpriority=1)


def _wait_gone(path: Path) -> None:
    deadline = 30.0
    while path.exists() and deadline > 0:
        threading.Event().wait(0.01)
        deadline -= 0.01


def _pids(folder: Path) -> set[int]:
    return {int(p.name[4:]) for p in folder.glob("pid-*")}


def _started(folder: Path, n: int, timeout: float = 30.0) -> set[int]:
    """The pids of ``n`` workers once each has run its ``worker_init_fn`` (the first batch can
    come from one worker before the other has started)."""
    deadline = time.monotonic() + timeout
    while len(pids := _pids(folder)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return pids


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not yet a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("zero_copy", [False, True])
def test_an_epochs_final_next_leaves_the_workers_exit_to_the_ending_thread(
    tmp_path: Path, zero_copy: bool
) -> None:
    (tmp_path / "hold").write_text("")
    loader = pinpool.DataLoader(
        Indexed(N),
        batch_size=BATCH,
        num_workers=2,
        zero_copy=zero_copy,
        worker_init_fn=_HeldAtExit(tmp_path),
    )
    with pinpool.trace.recording() as events:
        got = [b["idx"].tolist() for b in loader]  # the final next() returns: StopIteration
        first = _pids(tmp_path)
        assert len(first) == 2
        # Its workers are still held in their exit: the final next() did not wait for them.
        assert all(_running(pid) for pid in first)
        for f in tmp_path.glob("pid-*"):
            f.unlink()
        # A second epoch runs while the first one's workers exit.
        again = [b["idx"].tolist() for b in loader]
        second = _pids(tmp_path)
        assert len(second) == 2 and not second & first
        # Nor does closing the loader wait: its workers had nothing left to write.
        del loader
        gc.collect()
        assert all(_running(pid) for pid in first | second)
        (tmp_path / "hold").unlink()
        ending_thread.wait_all()
    expected = [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
    assert got == again == expected
    # Both epochs' workers have exited and been reaped, by the ending thread.
    assert not [pid for pid in first | second if os.path.exists(f"/proc/{pid}")]
    # (This test's: an earlier test's iterator may be collected meanwhile and shut down.)
    shutdowns = [
        e
        for e in events
        if e.name == "workers.shutdown" and set(e.details.get("pids", ())) & (first | second)
    ]
    assert len(shutdowns) == 2 and all(e.details.get("background") for e in shutdowns), events
    ends = [e for e in events if e.name == "workers.end"]
    assert len(ends) == 2 and {e.thread for e in ends} == {"pinpool-workers-end"}


@pytest.mark.parametrize("ending_thread_state", ["idle", "busy"])
def test_an_epoch_left_early_is_shut_down_before_del_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending_thread_state: str
) -> None:
    """Tasks were in flight: the workers are shut down and reaped before ``del`` returns, on
    the ending thread (where no signal handler can cut it short), or, if that thread is busy
    with another shutdown for longer than the main thread gives it, on a thread of their own
    (the ending thread then skips it)."""
    from pinpool._main.epochs import workers

    ran_on: list[str] = []
    steps = workers.WorkersIter._shutdown_steps

    def recorded(self: workers.WorkersIter) -> list[BaseException]:
        ran_on.append(threading.current_thread().name)
        return steps(self)

    monkeypatch.setattr(workers.WorkersIter, "_shutdown_steps", recorded)
    monkeypatch.setattr(workers, "_TAKEN_UP_S", 0.2)
    loader = pinpool.DataLoader(
        Indexed(N), batch_size=BATCH, num_workers=2, worker_init_fn=_HeldAtExit(tmp_path)
    )
    it = iter(loader)
    assert next(it)["idx"].tolist() == [0, 1, 2, 3]
    pids = _started(tmp_path, 2)
    assert len(pids) == 2
    busy = threading.Event()

    def hold() -> None:  # (another shutdown, keeping the ending thread busy)
        busy.wait(10.0)

    if ending_thread_state == "busy":
        ending_thread.hand_over(hold)
    del it
    gc.collect()
    busy.set()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    expected = (
        "pinpool-workers-end" if ending_thread_state == "idle" else "pinpool-workers-shutdown"
    )
    assert ran_on == [expected]
    ending_thread.wait_all()
    assert ran_on == [expected]  # (taken back: the ending thread did not run it again)
    del loader
    gc.collect()


def test_a_worker_that_fails_to_exit_is_killed_by_the_ending_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker stuck in its exit is killed after torch's status-check interval, as torch's
    # own shutdown would, by the ending thread.
    from pinpool._main.epochs import workers

    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(workers, "mp_status_check_interval", lambda: 0.2)
    (tmp_path / "hold").write_text("")
    loader = pinpool.DataLoader(
        Indexed(N), batch_size=BATCH, num_workers=2, worker_init_fn=_HeldAtExit(tmp_path)
    )
    assert len(list(loader)) == N // BATCH
    pids = _pids(tmp_path)
    del loader
    gc.collect()
    ending_thread.wait_all()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert (tmp_path / "hold").exists()  # (nobody let them go: they were killed)


EXIT_SCRIPT = """
import multiprocessing.util, sys, time
import torch
import pinpool, pinpool.trace

def slow_exit(worker_id):
    multiprocessing.util.Finalize(None, time.sleep, (0.5,), exitpriority=1)

def seen(event):
    if event.name == "workers.end":
        print("workers.end", flush=True)

pinpool.trace.set_hook(seen)
loader = pinpool.DataLoader(
    torch.arange(24), batch_size=4, num_workers=2, worker_init_fn=slow_exit
)
assert sum(len(b) for b in loader) == 24
print("epoch over", flush=True)
"""


def test_the_interpreters_exit_waits_for_an_ended_epochs_workers() -> None:
    # The script ends right after the epoch, its workers still in their (slow) exit: the
    # interpreter waits for the ending thread to shut them down, rather than tearing
    # everything down under it.
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["epoch", "over", "workers.end"], proc.stdout


def test_the_result_queues_feeder_is_not_waited_for_at_exit_after_a_shutdown() -> None:
    # torch cancels that wait only on its pin thread's path, after joining the thread: a
    # shutdown cut short there left the interpreter's exit waiting for a feeder that a worker
    # dead holding the queue's write lock keeps stuck for ever. pinpool cancels it after
    # every shutdown, at an epoch's end (on the ending thread) and when left early.
    loader = pinpool.DataLoader(Indexed(N), batch_size=BATCH, num_workers=2)
    ended = iter(loader)
    assert len(list(ended)) == N // BATCH
    left = iter(loader)
    next(left)
    inners = [ended._inner, left._inner]  # type: ignore[attr-defined]
    del left
    gc.collect()
    ending_thread.wait_all()
    for inner in inners:
        assert inner._worker_result_queue._joincancelled
    del ended, inners, loader
    gc.collect()


def test_the_ending_thread_is_started_again_if_it_has_ended() -> None:
    """A job that escapes its own error handling does not end the ending thread (a warning
    says so), and an ending thread that has ended all the same is started again before the
    next shutdown is handed over, rather than left with work nobody runs. (The thread the
    test sets aside stays, idle, waiting on the queue it was given.)"""

    def escapes() -> None:
        raise RuntimeError("a job's own error")

    ending_thread.start()
    with pytest.warns(RuntimeWarning, match="a job's own error"):
        ending_thread.hand_over(escapes).wait(10.0)
    assert ending_thread._thread is not None and ending_thread._thread.is_alive()
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    ending_thread._thread = gone
    ran = threading.Event()
    assert ending_thread.hand_over(ran.set).wait(10.0)
    assert ran.is_set() and ending_thread._thread is not gone and ending_thread._thread.is_alive()
