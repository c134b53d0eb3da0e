"""A storm of interrupts (SIGINT every fraction of a millisecond) while a loader with workers
is iterated: every one reaches the consumer as ``KeyboardInterrupt`` (a batch whose taking one
cut short is lost, and meeting it again is that interrupt too), nothing else is raised, and the
process goes on and exits. (torch's own loader hangs in the same storm.) In a process of its
own: its signal handler raises only inside ``next()``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.faults

_STORM = textwrap.dedent(
    """
    import collections, json, os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import pinpool
    from loader_datasets import Indexed

    inside = False

    def handler(sig, frame):
        if inside:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    loader = pinpool.DataLoader(Indexed(4000), batch_size=2, num_workers=2, timeout=30)
    stop = threading.Event()

    def storm():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.0003)

    raised = collections.Counter()
    got = 0
    it = iter(loader)
    threading.Thread(target=storm, daemon=True).start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        try:
            inside = True
            next(it)
            inside = False
            got += 1
        except StopIteration:
            inside = False
            break
        except BaseException as exc:
            inside = False
            raised[type(exc).__name__ + ": " + str(exc)[:60]] += 1
    stop.set()
    time.sleep(0.01)
    inside = False
    del it, loader
    print(json.dumps({"got": got, "raised": raised}))
    """
)


def test_an_interrupt_storm_surfaces_as_keyboard_interrupts_only() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STORM, "tests"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    kinds = {k.split(":")[0] for k in result["raised"]}
    assert kinds <= {"KeyboardInterrupt"}, result["raised"]
    assert sum(result["raised"].values()) > 0, "the storm never reached the consumer"
