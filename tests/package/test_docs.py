"""Every complete Python block of ``README.md`` and ``docs/*.md`` runs as written.

A block's first line decides what happens to it:

- ``# fragment`` (it uses names defined elsewhere): not run;
- ``# needs: cuda``: run only where torch sees a CUDA device;
- ``# needs: 2 GPUs ...``: run as a script under torchrun with two ranks, only where two GPUs
  are present;
- anything else: run here, on the CPU.

The CPU blocks run in one fresh interpreter (this file, run as a script), one after another,
each in a namespace of its own as a ``__main__`` module would be, so torch and the frameworks
are imported once; each block is then one test, passed or failed on its own result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^#+ (.*)$", re.M)


@dataclass(frozen=True)
class Block:
    name: str  # file and heading, for the test's id
    code: str
    kind: str  # "fragment", "cuda", "two-gpus" or "cpu"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for n, match in enumerate(_BLOCK.finditer(text)):
            code = match.group(1)
            headings = _HEADING.findall(text, 0, match.start())
            where = headings[-1] if headings else "top"
            first = code.split("\n", 1)[0].strip().lower()
            if first.startswith("# fragment"):
                kind = "fragment"
            elif first.startswith("# needs: cuda"):
                kind = "cuda"
            elif first.startswith("# needs: 2 gpus"):
                kind = "two-gpus"
            else:
                kind = "cpu"
            found.append(Block(f"{doc.relative_to(ROOT)}#{n}: {where}", code, kind))
    return found


ALL = blocks()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env() -> dict[str, str]:
    # The interpreter's own path, so that a checkout's build (maturin develop) is found.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, Any]:
    """Runs every CPU block in one fresh interpreter; each block's outcome by name."""
    runnable = [b for b in ALL if b.kind == "cpu" or (b.kind == "cuda" and _gpus() > 0)]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "blocks.json")
        spec.write_text(json.dumps([[b.name, b.code] for b in runnable]))
        done = subprocess.run(
            [sys.executable, __file__, str(spec)],
            cwd=tmp,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        out = Path(tmp, "blocks.json.out")
        if not out.exists():
            pytest.fail(f"the blocks' runner died:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_the_docs_have_runnable_blocks() -> None:
    kinds = [b.kind for b in ALL]
    assert kinds.count("cpu") >= 8, kinds
    # The README's first example runs on a laptop as written.
    readme = [b for b in ALL if b.name.startswith("README.md")]
    assert readme and readme[0].kind == "cpu"


@pytest.mark.parametrize("block", [b for b in ALL if b.kind in ("cpu", "cuda")], ids=str)
def test_block_runs(block: Block, cpu_results: dict[str, Any]) -> None:
    if block.kind == "cuda" and _gpus() == 0:
        pytest.skip("the block needs CUDA (its first line says so); torch sees no GPU")
    result = cpu_results[block.name]
    assert result["error"] is None, f"{block.name}\n{block.code}\n{result['error']}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "two-gpus"], ids=str)
def test_two_gpu_block_runs_under_torchrun(block: Block, tmp_path: Path) -> None:
    if _gpus() < 2:
        pytest.skip(f"the block needs two GPUs under torchrun; this machine has {_gpus()}")
    script = tmp_path / "train.py"
    script.write_text(block.code)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node=2", str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def _run_blocks(spec: str) -> None:
    """The runner (this file as a script): runs each ``[name, code]`` of ``spec`` as a
    ``__main__`` module of its own would run, and writes each one's outcome next to it."""
    results = {}
    runner = sys.modules["__main__"]
    for name, code in json.loads(Path(spec).read_text()):
        # A module of its own, as sys.modules["__main__"]: what the block defines (a dataset,
        # a batch class) is found there when a batch is unpickled.
        module = types.ModuleType("__main__")
        module.__file__ = name
        sys.modules["__main__"] = module
        print(f"== {name}", flush=True)
        try:
            exec(compile(code, name, "exec"), module.__dict__)
            error = None
        except BaseException:  # a failed block is reported, and the next one runs
            error = traceback.format_exc()
        finally:
            sys.modules["__main__"] = runner
        results[name] = {"error": error}
    Path(spec + ".out").write_text(json.dumps(results))


if __name__ == "__main__":
    _run_blocks(sys.argv[1])
