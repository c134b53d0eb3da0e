"""Storms of interrupts (SIGINT every fraction of a millisecond) while a loader with workers is
iterated, in each mode: every one reaches the consumer as ``KeyboardInterrupt``, nothing else
is raised (no ``EOFError`` from a result queue left in the middle of a message: the consumer's
thread reads each message whole, ``_main.epochs.results``), and the next loader works.

A trial is one loader iterated under a storm for a moment and dropped, then a fresh loader
that must give its first batches, right, with no storm. A batch whose taking an interrupt cut
short is lost with that interrupt; so the storm's iterator itself may wait for ever for a lost
batch afterwards (torch's own loader hangs in the same storm), which is why each trial drops
it. ``make storm`` runs :data:`TRIALS` (``$PINPOOL_STORM_TRIALS``) trials per mode; ``make
test`` a few. In a process of its own: its signal handler raises only inside ``next()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.faults

#: Trials per mode.
TRIALS = int(os.environ.get("PINPOOL_STORM_TRIALS", "6"))
#: How long each trial's storm lasts, in seconds.
STORM_S = float(os.environ.get("PINPOOL_STORM_SECONDS", "0.4"))

_STORM = textwrap.dedent(
    """
    import collections, json, os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import pinpool
    from loader_datasets import Indexed

    zero_copy, trials, seconds = sys.argv[2] == "zero-copy", int(sys.argv[3]), float(sys.argv[4])
    inside = False

    def handler(sig, frame):
        if inside:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)

    def loader():
        return pinpool.DataLoader(
            Indexed(100000), batch_size=2, num_workers=2, zero_copy=zero_copy, timeout=60
        )

    raised = collections.Counter()
    got = broken = 0
    for trial in range(trials):
        stop = threading.Event()

        def storm():
            while not stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.0003)

        it = iter(loader())
        storming = threading.Thread(target=storm, daemon=True)
        storming.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            try:
                inside = True
                next(it)
                inside = False
                got += 1
            except BaseException as exc:
                inside = False
                raised[type(exc).__name__] += 1
        stop.set()
        storming.join()
        time.sleep(0.005)  # (the last signals sent reach their handler, outside next())
        del it
        # The next loader works.
        for i, batch in zip(range(4), loader()):
            if batch["idx"].tolist() != [2 * i, 2 * i + 1]:
                broken += 1
    print(json.dumps({"trials": trials, "got": got, "broken": broken, "raised": raised}))
    """
)


def storm(mode: str, trials: int, seconds: float) -> dict:  # type: ignore[type-arg]
    """Runs ``trials`` storms in ``mode`` in a process of their own; what they raised."""
    done = subprocess.run(
        [sys.executable, "-c", _STORM, "tests", mode, str(trials), str(seconds)],
        capture_output=True,
        text=True,
        timeout=120 + trials * (seconds + 3),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["copy", "zero-copy"])
def test_interrupt_storms_surface_as_keyboard_interrupts_only(mode: str) -> None:
    result = storm(mode, TRIALS, STORM_S)
    print(mode, json.dumps(result))  # (make storm's counts)
    assert set(result["raised"]) <= {"KeyboardInterrupt"}, result
    assert result["raised"].get("KeyboardInterrupt", 0) > 0, "the storm never reached next()"
    assert result["broken"] == 0, result
