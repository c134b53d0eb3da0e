"""Runs a copy of torch's own ``test/test_dataloader.py`` twice in one sitting, with torch's
DataLoader and with ``pinpool.DataLoader`` swapped in (``sitecustomize.py`` beside this file),
and lists every test whose outcome differs. torch's file is torch's code and stays outside the
repository: bring a copy of the torch version at hand. It needs ``expecttest`` and ``psutil``
(torch's own test dependencies) beside pytest.

    python tests/torch_suite/run.py PATH/test_dataloader.py OUTDIR [--sequential] [pytest args]

Writes ``OUTDIR/{torch,pinpool}.xml`` (JUnit) and ``OUTDIR/{torch,pinpool}.log``; prints each
loader's counts and the tests that differ; exits 1 if any does."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


#: JUnit's element for each outcome but passing, in the order they are looked for.
_OUTCOMES = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))


def outcomes(xml: Path) -> dict[str, str]:
    """Each test case's outcome in a JUnit file: passed, failed, error or skipped."""
    found: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        found[name] = next((o for t, o in _OUTCOMES if t in tags), "passed")
    return found


def start(loader: str, test_file: Path, out: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    """pytest over ``test_file`` with ``loader``'s DataLoader, started."""
    env = dict(os.environ, PINPOOL_TORCH_SUITE=loader)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    command += ["-c", os.devnull, "--rootdir", str(test_file.parent)]  # (no project settings)
    command += [f"--junitxml={out / f'{loader}.xml'}", *extra]
    with open(out / f"{loader}.log", "w") as log:
        return subprocess.Popen(command, env=env, cwd=test_file.parent, stdout=log, stderr=log)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    test_file, out = Path(argv[0]).resolve(), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    # Both at once, on the same machine in the same sitting (with --sequential, one after the
    # other: a machine of few cores).
    extra = [a for a in argv[2:] if a != "--sequential"]
    running = {}
    for loader in ("torch", "pinpool"):
        running[loader] = start(loader, test_file, out, extra)
        if "--sequential" in argv:
            running[loader].wait()
    results = {}
    for loader, proc in running.items():
        proc.wait()
        results[loader] = outcomes(out / f"{loader}.xml")
    for loader, found in results.items():
        kinds = ("passed", "failed", "error", "skipped")
        print(loader, " ".join(f"{list(found.values()).count(k)} {k}" for k in kinds))
    torch_, pinpool_ = results["torch"], results["pinpool"]
    differ = sorted(n for n in torch_.keys() | pinpool_.keys() if torch_.get(n) != pinpool_.get(n))
    for name in differ:
        print(f"differs: {name}: torch {torch_.get(name)}, pinpool {pinpool_.get(name)}")
    print(f"{len(differ)} tests differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
