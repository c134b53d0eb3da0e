"""pinpool.DataLoader inside the frameworks people train with: Lightning and accelerate.

Frameworks rebuild a DataLoader from its public attributes, or from the arguments its
``__init__`` was called with, to put a distributed sampler in. A rebuilt pinpool loader must be
a working pinpool loader with the same settings and none of the original's internals, and the
batches a framework's steps see must come from a pool (counted by ``stats()``, lying in the
pool's memory): a framework path that silently fell back to ordinary memory fails here.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from loader_datasets import Indexed, in_pool, sum_collate
from torch.utils.data import SequentialSampler, default_collate

import pinpool

pl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.utilities.data import _update_dataloader  # noqa: E402

HERE = Path(__file__).resolve().parent


def rebuilt(loader: Any) -> Any:
    """The loader as Lightning rebuilds it to put a sampler in (outside its hooks)."""
    return _update_dataloader(loader, SequentialSampler(loader.dataset))


def run_ranks(tmp_path: Path, command: list[str]) -> list[dict[str, Any]]:
    """Runs a script under ``tests/frameworks/scripts`` (``command``, with the output dir put
    after the script's path) and returns the reports its ranks wrote."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *sys.path]))
    script = next(i for i, part in enumerate(command) if part.endswith(".py"))
    argv = [*command[: script + 1], str(tmp_path), *command[script + 1 :]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_a_rebuilt_loader_keeps_the_settings_and_nothing_else(zero_copy: bool) -> None:
    settings = dict(
        slot_bytes=1 << 20, num_slots=5, copy_threads=1, overflow="wait", zero_copy=zero_copy
    )
    first = pinpool.DataLoader(Indexed(24), batch_size=4, num_workers=2, **settings)
    assert first.collate_fn is default_collate  # torch's default: what the caller asked for
    for name, value in settings.items():
        assert getattr(first, name) == value, name
    again = rebuilt(first)
    assert type(again) is pinpool.DataLoader
    assert again.collate_fn is default_collate
    for name, value in settings.items():
        assert getattr(again, name) == value, name
    assert again._pinpool_receiver is not first._pinpool_receiver
    assert again.pool is not first.pool, "a pool the loader made itself is not shared"
    assert again.pool is not None and again.pool.slot_bytes == 1 << 20
    expect = [b["idx"].tolist() for b in torch.utils.data.DataLoader(Indexed(24), batch_size=4)]
    it = iter(again)
    got = [next(it)["idx"].tolist()]
    # The original goes away mid-epoch: the rebuilt loader's workers and pool are its own.
    del first
    gc.collect()
    for batch in it:
        got.append(batch["idx"].tolist())
        assert in_pool(again.pool, batch["x"])
    assert got == expect
    assert again.stats()["batches"] == len(expect)


def test_a_pinpool_collate_handed_back_is_not_wrapped_twice() -> None:
    pool = pinpool.PinPool(1 << 20, 4, device="cpu")
    first = pinpool.DataLoader(Indexed(8), batch_size=4, collate_fn=sum_collate, pool=pool)
    assert first.collate_fn is sum_collate
    # A framework that reads what torch's iterator used (pinpool's collate) and passes it on.
    again = pinpool.DataLoader(
        Indexed(8), batch_size=4, collate_fn=first._pinpool_collate, pool=pool
    )
    assert again.collate_fn is sum_collate
    assert again._pinpool_collate.token != first._pinpool_collate.token
    batches = list(again)
    assert [b["idx"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(in_pool(pool, b["total"]) for b in batches)
    # A pool the caller gave is the caller's: a rebuilt loader shares it.
    assert rebuilt(again).pool is pool


class Steps(pl.LightningModule):
    """Records, for every step, the sample indices and whether the batch lay in the pool of
    the loader Lightning iterates."""

    def __init__(self, train: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(12, 1)
        self.train_loader = train
        self.seen: dict[str, list[int]] = {"fit": [], "validate": [], "predict": []}
        self.outside: list[str] = []

    def train_dataloader(self) -> Any:
        if self.train_loader is None:
            self.train_loader = pinpool.DataLoader(Indexed(16), batch_size=4, num_workers=2)
        return self.train_loader

    def _record(self, stage: str, batch: dict[str, Any], loader: Any) -> None:
        self.seen[stage] += batch["idx"].tolist()
        if not in_pool(loader.pool, batch["x"]):
            self.outside.append(stage)

    def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
        self._record("fit", batch, self.trainer.train_dataloader)
        return self.layer(batch["x"].flatten(1)).sum()

    def validation_step(self, batch: dict[str, Any], index: int) -> None:
        self._record("validate", batch, self.trainer.val_dataloaders)

    def predict_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
        self._record("predict", batch, self.trainer.predict_dataloaders)
        return batch["idx"]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer() -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_lightning_fit_validate_and_predict_in_one_process(recwarn: Any) -> None:
    model = Steps()  # the training loader comes from the hook
    fit = trainer()
    fit.fit(model)
    assert sorted(model.seen["fit"]) == list(range(16))
    assert model.train_loader.stats()["batches"] == 4
    val = pinpool.DataLoader(Indexed(8), batch_size=4, num_workers=2)  # passed in
    fit.validate(model, dataloaders=val)
    assert sorted(model.seen["validate"]) == list(range(8))
    assert fit.val_dataloaders.stats()["batches"] == 2
    pred = pinpool.DataLoader(Indexed(12), batch_size=4)
    out = fit.predict(model, dataloaders=pred)
    assert [o.tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # Lightning rebuilds a predict loader (to track indices): the rebuilt one is pinpool's.
    used = fit.predict_dataloaders
    assert type(used) is pinpool.DataLoader and used.stats()["batches"] == 3
    assert not model.outside, f"batches outside the pool in {model.outside}"
    ours = [str(w.message) for w in recwarn if "pinpool" in str(w.message).lower()]
    assert not ours, ours


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hook", "passed"])
def test_lightning_ddp_with_two_cpu_ranks(tmp_path: Path, how: str) -> None:
    """``strategy="ddp"``, 2 CPU ranks (gloo): Lightning puts a DistributedSampler in by
    rebuilding the loader. With ``hook``, pinpool is first imported inside the hook, after
    Lightning has wrapped the DataLoader classes that existed then."""
    script = HERE / "scripts" / "lightning_ddp.py"
    reports = run_ranks(tmp_path, [sys.executable, str(script), how])
    assert [r["rank"] for r in reports] == [0, 1]
    seen = sorted(i for r in reports for i in r["seen"])
    assert seen == list(range(32)), "every sample once, across the two ranks"
    for r in reports:
        assert r["loader"] == "pinpool.loader.DataLoader"
        assert r["steps"] == 4 and r["batches"] == 4, r
        assert r["pool"] == [1 << 20, 7], "the rebuilt loader lost pinpool's settings"
        assert r["in_pool"], "a batch outside the rank's pool"
        assert not [w for w in r["warnings"] if "pinpool" in w.lower()], r["warnings"]


@pytest.mark.slow
def test_accelerate_prepare_keeps_the_pool_on_two_cpu_ranks(tmp_path: Path) -> None:
    """``accelerator.prepare`` of a pinpool loader on two CPU ranks under torchrun (gloo),
    copy then zero-copy in the one launch: each rank's batches come from its own pool, are
    the ones accelerate's own shard gives that rank, and together cover the dataset once; a
    state taken mid-epoch resumes the rank's rest. One process:
    tests/frameworks/test_accelerate.py."""
    pytest.importorskip("accelerate")
    script = str(HERE / "scripts" / "accelerate_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script]
    reports = run_ranks(tmp_path, command)
    assert [(r["rank"], r["ranks"]) for r in reports] == [(0, 2), (1, 2)]
    for mode in ("copy", "zero-copy"):
        seen = sorted(i for r in reports for i in r[mode]["seen"])
        assert seen == list(range(32)), f"{mode}: every sample once, across the ranks"
        for r in reports:
            got = r[mode]
            assert r["hooked"], "accelerate imported before pinpool: patched at import"
            assert got["loader"] == "pinpool.loader.DataLoader", got["loader"]
            assert got["settings"] == [1 << 20, 7, 1, mode == "zero-copy"], got["settings"]
            assert got["batches_seen"] == got["expected"], f"{mode}: not accelerate's shard"
            assert got["steps"] == 4 and got["batches"] == 4, got
            assert got["in_pool"], f"{mode}: a batch outside the rank's pool"
            if mode == "zero-copy":
                assert got["zero_copy_batches"] > 0, got
            assert len(got["head"]) == 2 and len(got["rest"]) == 2
            assert got["resumed"] == got["rest"], f"{mode}: resumed elsewhere"
            assert got["resumed_batches"] == 2
        assert not [w for r in reports for w in r["warnings"] if "pinpool" in w.lower()]


class DeviceSteps(pl.LightningModule):
    """Checks that every training batch is already on the GPU, delivered by pinpool."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(12, 1)
        self.loader = loader
        self.devices: set[str] = set()
        self.seen: list[int] = []

    def train_dataloader(self) -> Any:
        return self.loader

    def training_step(self, batch: dict[str, Any], index: int) -> torch.Tensor:
        self.devices.add(str(batch["x"].device))
        self.seen += batch["idx"].tolist()
        return self.layer(batch["x"].flatten(1)).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.cuda
def test_lightning_fit_with_batches_delivered_on_the_gpu() -> None:
    loader = pinpool.DataLoader(Indexed(16), batch_size=4, num_workers=2, device="cuda")
    model = DeviceSteps(loader)
    fit = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fit.fit(model)
    assert sorted(model.seen) == list(range(16))
    assert model.devices == {"cuda:0"}
    assert loader.stats()["batches"] == 4 and loader.pool is not None
    assert loader.pool.memory == "pinned", loader.pool.memory


def guide_block(heading: str, index: int) -> str:
    """The ``index``-th python code block under the user guide's ``heading``."""
    text = (HERE.parent.parent / "docs" / "guide.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n")[index + 1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["lightning", "accelerate"])
def test_the_guide_snippets_run_and_count_their_batches(index: int) -> None:
    # tests/package/test_docs.py runs them too; here each in an interpreter of its own, and
    # what they print is checked.
    code = guide_block("## Lightning and accelerate", index)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "4", done.stdout[-2000:]
