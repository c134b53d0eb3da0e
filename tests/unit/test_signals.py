"""Signal handlers' exceptions around pinpool's waits and finalizers (``pinpool._signals``,
``_native.Handoff``): a wait no handler cuts short, and a signal handed back by a finalizer
that comes once the finalizers its object's going sets off have run, not inside one of them."""

from __future__ import annotations

import multiprocessing.util
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pinpool import _signals
from pinpool._native import Handoff


class Interrupted(Exception):
    """What the test's signal handlers raise."""


@contextmanager
def on_sigusr1(fn: Callable[[int, Any], None]) -> Iterator[None]:
    old = signal.signal(signal.SIGUSR1, fn)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def after(seconds: float, then: Callable[[], None]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        then()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def signal_main() -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)


def sleep_until_interrupted(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("kind", ["handoff", "event"])
def test_a_handler_runs_after_a_handoffs_wait_not_inside_it(kind: str) -> None:
    """A signal comes while the main thread waits for a job done on another thread: with a
    hand-off the handler runs once the wait has returned, the job done; with a
    ``threading.Event`` (the contrast) inside the wait, which its exception ends before the
    job is done."""
    handoff = Handoff()
    event = threading.Event()
    seen: list[bool] = []

    def record(signum: int, frame: Any) -> None:
        seen.append(handoff.stage == "done" if kind == "handoff" else event.is_set())
        raise Interrupted

    def job() -> None:
        assert handoff.take()
        time.sleep(0.3)
        handoff.finish()
        event.set()

    with on_sigusr1(record):
        sender = after(0.05, signal_main)
        runner = after(0.0, job)
        try:
            with pytest.raises(Interrupted):
                assert handoff.wait() if kind == "handoff" else event.wait(10.0)
                sleep_until_interrupted(5.0)
        finally:
            sender.join()
            runner.join()
    assert seen == ([True] if kind == "handoff" else [False])


def test_a_job_nobody_began_in_time_is_taken_back() -> None:
    """The waiter takes back a job its runner has not begun in the time given (the runner
    then skips it); one begun in time is waited for to its end, past that time."""
    handoff = Handoff()
    t0 = time.monotonic()
    assert handoff.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.05
    assert handoff.stage == "taken"
    assert handoff.take() is False
    handoff.finish()
    assert handoff.wait(0.0) is True

    begun = Handoff()
    assert begun.take() is True

    def job() -> None:
        begun.finish()

    runner = after(0.2, job)
    t0 = time.monotonic()
    assert begun.wait(0.01) is True
    assert time.monotonic() - t0 >= 0.15
    runner.join()
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            Handoff().wait(bad)


class _Resource:
    """Something with a multiprocessing ``Finalize`` (as a queue or a process has), whose
    callback takes a while and sleeps, so a signal can come in it."""

    def __init__(self, log: list[str]) -> None:
        multiprocessing.util.Finalize(self, _Resource._release, (log,))

    @staticmethod
    def _release(log: list[str]) -> None:
        log.append("release begun")
        time.sleep(0.2)
        log.append("release done")


class _Holder:
    """An object whose finalizer takes a signal handler's exception and hands it back, and
    which alone holds a ``_Resource``: the resource's finalizer runs as the holder goes,
    right after the holder's ``__del__`` returns."""

    def __init__(self, log: list[str]) -> None:
        self.resource = _Resource(log)

    def __del__(self) -> None:
        try:
            signal.raise_signal(signal.SIGUSR1)
        except BaseException as exc:
            if not _signals.hand_back(exc):
                raise


def test_a_signal_handed_back_comes_after_the_finalizers_its_object_sets_off() -> None:
    """The handler raises in the holder's ``__del__``, which hands the exception back; the
    resource's finalizer then runs (0.2 s, asleep): the same exception comes after it, in the
    consumer's code, rather than inside it, where Python would only print it. The handler
    itself runs once (as torch's SIGCHLD handler reports a dead worker once: run again, it
    would find nothing to raise), and is the signal's handler again afterwards."""
    log: list[str] = []
    raised: list[BaseException] = []

    def record(signum: int, frame: Any) -> None:
        log.append(f"raised in {frame.f_code.co_name if frame is not None else '?'}")
        raised.append(Interrupted("once"))
        raise raised[-1]

    holder = _Holder(log)
    with on_sigusr1(record):
        with pytest.raises(Interrupted) as caught:
            del holder
            sleep_until_interrupted(5.0)
            log.append("not raised")
        assert signal.getsignal(signal.SIGUSR1) is record
    assert log == ["raised in __del__", "release begun", "release done"], log
    assert raised == [caught.value]
    tb = caught.value.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "sleep_until_interrupted" in frames and "__del__" not in frames, frames
    assert any("handed it back" in note for note in caught.value.__notes__)


def test_a_finalizer_not_in_the_main_thread_hands_nothing_back() -> None:
    """Handlers run in the main thread only: an exception a finalizer catches elsewhere is
    not a handler's, and the signal's handler is left as it was."""
    got: list[bool] = []

    def run() -> None:
        try:
            raise Interrupted("not a handler's")
        except Interrupted as exc:
            got.append(_signals.hand_back(exc))

    with on_sigusr1(lambda signum, frame: None) as _:
        before = signal.getsignal(signal.SIGUSR1)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert signal.getsignal(signal.SIGUSR1) is before
    assert got == [False]


def test_a_handed_back_error_raised_inside_another_finalizer_is_a_handlers_again() -> None:
    """The signal handed back is sent once the main thread has left the finalizers it runs,
    but the thread may enter another one between that look and the signal: the exception is
    then raised again there, through the one-call handler ``hand_back`` installed. That
    finalizer must know it for a handler's (``signal_of``), to hand it back in turn, or Python
    would only print it: torch's report of a dead worker, lost."""
    delivered: list[int] = []
    seen: list[int | None] = []

    def raise_it(signum: int, frame: Any) -> None:
        raise Interrupted("from the handler")

    def __del__() -> None:  # (named so: the signal handed back waits until it returns)
        try:
            raise_it(signal.SIGUSR1, None)
        except Interrupted as exc:
            assert _signals.hand_back(exc)
        # As if the signal came here: the one-call handler raises the exception again.
        try:
            signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)  # type: ignore[operator]
        except Interrupted as again:
            seen.append(_signals.signal_of(again))
        signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))

    with on_sigusr1(raise_it):
        __del__()
        deadline = time.monotonic() + 5
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.01)  # (the signal handed back, sent now: taken by the no-op above)
    assert seen == [signal.SIGUSR1], "the exception raised again was not known for a handler's"
    assert delivered == [signal.SIGUSR1]
