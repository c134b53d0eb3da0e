"""The probes in ``benchmarks/`` that time pinpool's steps read them from its trace hook
(``pinpool.trace``) only: none imports a private module of pinpool's or replaces anything of
it, so none rots as the code moves; and each runs, small, on the CPU and prints its table."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCHMARKS = ROOT / "benchmarks"
PROBES = ["first_batch.py", "fresh_workers.py", "next_profile.py", "stall_trace.py"]

#: What a probe may import of pinpool: the public names, the trace hook, the bench's helpers.
ALLOWED = ("pinpool", "pinpool.trace", "pinpool.bench")
#: Functions that replace an attribute of what they are given (the probes' own wrappers).
REPLACERS = {"setattr", "wrap", "_wrap", "_span", "delattr"}


def _root_name(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``a`` for ``a.b.c``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _pinpool_names(tree: ast.Module) -> set[str]:
    """The names a probe binds to pinpool or anything imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "pinpool":
                    names.add(a.asname or "pinpool")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pinpool"):
            names.update(a.asname or a.name for a in node.names)
    return names


@pytest.mark.parametrize("probe", PROBES)
def test_a_probe_reads_the_trace_and_patches_nothing_of_pinpool(probe: str) -> None:
    source = (BENCHMARKS / probe).read_text()
    tree = ast.parse(source)
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        for m in modules:
            if m.split(".")[0] == "pinpool" and m not in ALLOWED:
                if not m.startswith("pinpool.bench."):
                    wrong.append(f"imports {m}")
    ours = _pinpool_names(tree)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _root_name(t) in ours:
                wrong.append(f"line {t.lineno}: assigns to {ast.unparse(t)}")
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if name in REPLACERS and _root_name(node.args[0]) in ours:
                wrong.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_pin"):
            wrong.append(f"line {node.lineno}: reads {ast.unparse(node)}")
    # A private name of pinpool's, however reached (a string, getattr...).
    for n, line in enumerate(source.splitlines(), 1):
        if "pinpool._" in line or "pinpool.loader" in line:
            wrong.append(f"line {n}: {line.strip()}")
    assert not wrong, wrong


def _run(args: list[str], timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=BENCHMARKS,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_first_batch_runs_small_on_the_cpu() -> None:
    args = "--device cpu --loaders pinpool --rounds 1 --batch-size 4 --workers 2 --shape 3 32 32"
    out = _run(["first_batch.py", *args.split()])
    line = next(line for line in out.splitlines() if line.startswith("pinpool "))
    assert "first@" in line and "ensure(" in line and "pool-made@" in line, out
    assert "MiB:" in line, out


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["pinpool", "pinpool-zerocopy"])
def test_next_profile_runs_small_on_the_cpu(loader: str) -> None:
    args = "--steps 60 --workers 2 --shape 64 --batch-size 4".split()
    out = _run(["next_profile.py", "--loader", loader, *args])
    assert "us/batch" in out and "calls" in out and "CPU time per batch" in out, out
    rows = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert {"loader.next", "batch.take", "batch.deliver", "index.put"} <= rows, out
    assert ("batch.adopt" in rows) == (loader == "pinpool-zerocopy") or "batch.copy" in rows
    assert "worker.destination" in rows, out  # (the workers' own, written to a file)


@pytest.mark.slow
def test_stall_trace_runs_small_on_the_cpu() -> None:
    args = "--shape 3 64 64 --batches 4 --workers 2 --late-ms 0.3 --whole-arena".split()
    out = _run(["stall_trace.py", *args])
    assert "2 epochs, whole arena at once" in out, out
    assert "epoch 1: worst" in out and "epoch 2: worst" in out, out
