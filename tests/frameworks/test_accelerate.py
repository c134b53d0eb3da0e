"""accelerate's ``prepare`` with a ``pinpool.DataLoader`` keeps the pool (``pinpool._accelerate``).

The shard accelerate returns must load every batch from a pinpool loader with the original's
settings (counted by ``stats()``, lying in the loader's arena), yield what accelerate's own
shard of a torch loader yields from the same seeds, and resume from a state taken mid-epoch;
where pinpool cannot put its loader there, a warning (once) says so and ``pinpool.prepare``
still keeps the pool. One process here; two CPU ranks, copy and zero-copy, in
``tests/frameworks/test_frameworks.py`` (``tests/frameworks/scripts/accelerate_ranks.py``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loader_datasets import Indexed, in_pool

import pinpool
from pinpool import _accelerate
from pinpool._accelerate import shard as adopting

pytest.importorskip("accelerate")
import accelerate
import accelerate.accelerator
import accelerate.data_loader
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

SETTINGS: dict[str, Any] = {"slot_bytes": 1 << 20, "num_slots": 6, "copy_threads": 1}


class Numbers(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Tensors only (accelerate's dispatcher concatenates every leaf of the batches)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": torch.full((3, 4), float(i))}


def ours(zero_copy: bool = False, seed: int = 1, dataset: Any = None) -> pinpool.DataLoader[Any]:
    torch.manual_seed(seed)
    return pinpool.DataLoader(
        Indexed(32) if dataset is None else dataset, batch_size=4, shuffle=True,
        num_workers=2, zero_copy=zero_copy, **SETTINGS,
    )  # fmt: skip


def plain(dataset: Any = None) -> torch.utils.data.DataLoader[Any]:
    torch.manual_seed(1)
    return torch.utils.data.DataLoader(
        Indexed(32) if dataset is None else dataset, batch_size=4, shuffle=True
    )


def indices(loader: Any, seed: int | None = None) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)
    return [batch["idx"].tolist() for batch in loader]


def accelerator(**config: Any) -> Any:
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))


@pytest.fixture
def no_pinpool_warnings() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours_ = [str(w.message) for w in caught if "pinpool" in str(w.message).lower()]
    assert not ours_, ours_


@pytest.fixture
def warned_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-process warning, not yet given."""
    monkeypatch.setattr(adopting, "_warned", False)


def test_the_hook_wraps_accelerate_s_functions_once() -> None:
    module = accelerate.data_loader
    for name in _accelerate.FUNCTIONS:
        wrapper = getattr(module, name)
        assert getattr(wrapper, "__pinpool_wraps__", None) is not None, name
        assert getattr(accelerate.accelerator, name) is wrapper, f"accelerator's {name}"
    assert accelerate.skip_first_batches is module.skip_first_batches
    before = [getattr(module, name) for name in _accelerate.FUNCTIONS]
    _accelerate.patch(module)
    _accelerate.install()
    assert [getattr(module, name) for name in _accelerate.FUNCTIONS] == before
    assert not any(isinstance(f, _accelerate._Finder) for f in sys.meta_path)


def test_the_hook_is_there_when_pinpool_is_imported_first() -> None:
    # This process may have imported them in either order: a fresh one, pinpool first (the
    # rank script imports accelerate first).
    check = (
        "import sys, pinpool, pinpool._accelerate\n"
        "assert 'torch' not in sys.modules and 'accelerate' not in sys.modules\n"
        "import accelerate.accelerator as a, accelerate.data_loader as d\n"
        "print(hasattr(d.prepare_data_loader, '__pinpool_wraps__'),"
        " a.prepare_data_loader is d.prepare_data_loader,"
        " any(isinstance(f, pinpool._accelerate._Finder) for f in sys.meta_path))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "True True False", done.stdout


@pytest.mark.parametrize("hook", ["1", "0"], ids=["on", "off"])
def test_the_finder_patches_the_module_as_it_is_imported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    """The import hook, on a stand-in module: patched right after it executes (its
    functions wrapped; a module of an unknown shape gets wrappers that only warn), the finder
    gone; ``PINPOOL_ACCELERATE_HOOK=0`` leaves it alone."""
    name = "pinpool_test_stand_in"
    (tmp_path / f"{name}.py").write_text(
        "def prepare_data_loader(dataloader):\n    return dataloader\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_accelerate, "TARGET", name)
    monkeypatch.setenv("PINPOOL_ACCELERATE_HOOK", hook)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    _accelerate.install()
    _accelerate.install()
    finders = [f for f in sys.meta_path if isinstance(f, _accelerate._Finder)]
    assert len(finders) == (1 if hook == "1" else 0)
    module = __import__(name)
    assert not any(isinstance(f, _accelerate._Finder) for f in sys.meta_path)
    wrapped = hasattr(module.prepare_data_loader, "__pinpool_wraps__")
    assert wrapped == (hook == "1")
    assert module.prepare_data_loader(5) == 5  # not a pinpool loader: untouched
    if wrapped:
        assert "def prepare_data_loader" in module.__loader__.get_source(name)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_prepare_keeps_the_pool_and_accelerate_s_order(
    zero_copy: bool, no_pinpool_warnings: None
) -> None:
    acc = accelerator()
    model = torch.nn.Linear(12, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    original = ours(zero_copy)
    model, optimizer, shard = acc.prepare(model, optimizer, original)
    assert type(shard).__name__ == "DataLoaderShard"
    base = shard.base_dataloader
    assert type(base) is pinpool.DataLoader and base is not original
    for name, value in {**SETTINGS, "zero_copy": zero_copy}.items():
        assert getattr(base, name) == value, name
    assert base.pool is not original.pool, "each loader made inside prepare has its own arena"
    reference = acc.prepare(plain())
    for seed in (2, 3):  # two epochs
        got: list[list[int]] = []
        torch.manual_seed(seed)
        for batch in shard:
            assert in_pool(shard.pool, batch["x"]), "a batch outside the pool"
            got.append(batch["idx"].tolist())
            loss = model(batch["x"].flatten(1)).sum()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        assert got == indices(reference, seed)
    stats = shard.stats()
    assert stats["batches"] == 16 and stats["overflow_batches"] == 0
    if zero_copy:
        assert stats["zero_copy_batches"] > 0
    # The loader given to prepare is not kept by the shard (its own arena goes with it).
    gone = weakref.ref(original)
    del original
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    "how", ["state_dict", "save_state", "seedable"], ids=["state_dict", "save_state", "seedable"]
)
def test_a_prepared_loader_resumes_mid_epoch(
    tmp_path: Path, how: str, no_pinpool_warnings: None
) -> None:
    """A state taken after 3 batches of an epoch, loaded into a newly prepared loader in a
    fresh Accelerator, yields the rest of that epoch: through the shard's own
    ``state_dict``, through ``Accelerator.save_state``/``load_state`` with
    ``use_stateful_dataloader`` (no torchdata needed: the pinpool loader is the stateful
    one), and with accelerate's ``SeedableRandomSampler``."""
    config = {
        "use_stateful_dataloader": how != "state_dict",
        "use_seedable_sampler": how == "seedable",
    }
    acc = accelerator(**config)
    shard = acc.prepare(ours())
    indices(shard, 2)  # a first epoch: the state is taken in the second
    assert shard.use_stateful_dataloader == config["use_stateful_dataloader"]
    torch.manual_seed(3)
    it = iter(shard)
    head = [next(it)["idx"].tolist() for _ in range(3)]
    if how == "state_dict":
        state = shard.state_dict()
    else:
        acc.save_state(str(tmp_path))
    rest = [batch["idx"].tolist() for batch in it]
    assert len(head + rest) == 8

    again = accelerator(**config)
    # A program that resumes seeds torch as it did (accelerate's seedable sampler takes its
    # seed from torch's then); else another seed, which the state's RNG states override.
    resumed = again.prepare(ours(seed=1 if how == "seedable" else 7))
    if how == "state_dict":
        resumed.load_state_dict(state)
    else:
        again.load_state(str(tmp_path))
    # accelerate's loaders start each iter() at their own epoch, which the caller sets.
    resumed.set_epoch(1)
    torch.manual_seed(4)
    assert indices(resumed) == rest
    assert resumed.stats()["batches"] == len(rest)


def test_skip_first_batches_keeps_the_pool(no_pinpool_warnings: None) -> None:
    acc = accelerator()
    shard = acc.prepare(ours())
    full = indices(shard, 2)
    torch.manual_seed(2)
    skipped = acc.skip_first_batches(shard, 3)
    assert type(skipped.base_dataloader) is pinpool.DataLoader
    assert skipped.base_dataloader.slot_bytes == SETTINGS["slot_bytes"]
    assert indices(skipped, 2) == full[3:]
    assert skipped.stats()["batches"] == 5


def test_dispatching_keeps_the_pool(no_pinpool_warnings: None) -> None:
    # accelerate's default for an IterableDataset, and dispatch_batches=True: process 0
    # loads and sends each process its part.
    acc = accelerator(dispatch_batches=True)
    shard = acc.prepare(ours(dataset=Numbers()))
    assert type(shard).__name__ == "DataLoaderDispatcher"
    assert indices(shard, 2) == indices(acc.prepare(plain(Numbers())), 2)
    assert shard.stats()["batches"] == 8


def test_the_loader_s_device_follows_accelerate_s_placement() -> None:
    device = adopting.delivery_device
    assert device(None, None) is None
    assert device("cuda", None) == "cuda"  # no placement: the loader's own
    assert device(None, torch.device("cpu")) is None
    assert device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert device("cuda", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert device("cpu", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert device("cuda:0", torch.device("cuda", 1)) == "cuda:0"  # a GPU named by the caller


def test_a_prepare_that_cannot_keep_the_pool_warns_once(
    monkeypatch: pytest.MonkeyPatch, warned_afresh: None
) -> None:
    """An accelerate whose functions are not the shape pinpool knows gets wrappers that only
    warn: once per process, naming pinpool.prepare, which then keeps the pool through
    accelerate's public methods (its shard of a torch loader, wrapped by pinpool.pinned)."""
    module = accelerate.data_loader
    why = "accelerate 0.0's prepare_data_loader takes no put_on_device (simulated)"
    wrapper = _accelerate._wrap(
        _accelerate.original(module.prepare_data_loader), "prepare_data_loader", why
    )
    monkeypatch.setattr(accelerate.accelerator, "prepare_data_loader", wrapper)
    monkeypatch.setattr(adopting, "incompatible", lambda module: why)
    acc = accelerator()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lost = acc.prepare(ours())
        acc.prepare(ours())
        kept = pinpool.prepare(acc, ours())
        got = indices(kept, 2)
    messages = [str(w.message) for w in caught if "pinpool" in str(w.message)]
    assert len(messages) == 1, messages
    assert why in messages[0] and "pinpool.prepare(accelerator, loader)" in messages[0]
    assert caught[0].filename == __file__, "the warning names the caller's line"
    assert type(lost.base_dataloader) is torch.utils.data.DataLoader  # accelerate's own
    assert type(kept).__name__ == "Pinned"
    assert got == indices(acc.prepare(plain()), 2)
    assert kept.stats()["batches"] == 8 and kept.pool is not None
    assert kept.pool.slot_bytes == SETTINGS["slot_bytes"]


def test_a_loader_that_cannot_be_rebuilt_warns_and_stays_accelerate_s(
    monkeypatch: pytest.MonkeyPatch, warned_afresh: None
) -> None:
    def fails(*args: Any) -> Any:
        raise RuntimeError("a base loader pinpool does not know")

    monkeypatch.setattr(adopting, "rebuild", fails)
    acc = accelerator()
    with pytest.warns(UserWarning, match="does not know.*pinpool.prepare"):
        shard = acc.prepare(ours())
    assert type(shard.base_dataloader) is torch.utils.data.DataLoader
    assert indices(shard, 2) == indices(acc.prepare(plain()), 2)


def test_pinpool_prepare_adopts_without_the_hook(
    monkeypatch: pytest.MonkeyPatch, no_pinpool_warnings: None
) -> None:
    # accelerate's own function, as bound where pinpool's hook is off.
    monkeypatch.setattr(
        accelerate.accelerator,
        "prepare_data_loader",
        _accelerate.original(accelerate.data_loader.prepare_data_loader),
    )
    acc = accelerator()
    assert type(acc.prepare(ours()).base_dataloader) is torch.utils.data.DataLoader
    shard = pinpool.prepare(acc, ours())
    assert type(shard.base_dataloader) is pinpool.DataLoader
    assert indices(shard, 2) == indices(acc.prepare(plain()), 2)
    assert shard.stats()["batches"] == 8
    # Other loaders go to accelerate as they are.
    assert type(pinpool.prepare(acc, plain()).base_dataloader) is torch.utils.data.DataLoader
