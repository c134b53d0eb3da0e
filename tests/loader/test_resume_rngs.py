"""A checkpoint cannot be right where the sampler draws its order from a random generator the
state does not capture (Python's ``random``, numpy's global one): the resumed epoch would draw
another order, and samples would be seen twice and others never. Such a loader refuses to save
its state, naming the sampler and the generator; one drawing from torch's does not."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from loader_datasets import Indexed

import pinpool
from pinpool._main.resume.checkpoint import NotResumable


class PythonShuffled(torch.utils.data.Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


class NumpyShuffled(PythonShuffled):
    def __iter__(self) -> Iterator[int]:
        return iter(int(i) for i in np.random.permutation(self.n))


class RandomSamplerShuffledByPython(torch.utils.data.RandomSampler):
    """A subclass of torch's own sampler is looked at as any sampler of the user's is."""

    def __init__(self, n: int) -> None:
        super().__init__(range(n))

    def __iter__(self) -> Iterator[int]:
        order = list(range(len(self.data_source)))
        random.shuffle(order)
        return iter(order)


class TorchShuffled(PythonShuffled):
    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())


@pytest.mark.parametrize(
    ("sampler", "named"),
    [
        (PythonShuffled, "Python's random module"),
        (NumpyShuffled, "numpy's global random"),
        (RandomSamplerShuffledByPython, "Python's random module"),
    ],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_drawing_from_an_uncaptured_generator_is_refused_by_name(
    sampler: type, named: str, workers: int
) -> None:
    loader = pinpool.DataLoader(Indexed(40), batch_size=4, sampler=sampler(40), num_workers=workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(NotResumable, match=named) as info:
        loader.state_dict()
    assert sampler.__name__ in str(info.value)
    del it


def test_a_sampler_drawing_from_torchs_generator_resumes() -> None:
    torch.manual_seed(3)
    loader = pinpool.DataLoader(Indexed(40), batch_size=4, sampler=TorchShuffled(40))
    it = iter(loader)
    seen = [int(i) for _ in range(3) for i in next(it)["idx"]]
    state = loader.state_dict()
    rest = [int(i) for b in it for i in b["idx"]]
    again = pinpool.DataLoader(Indexed(40), batch_size=4, sampler=TorchShuffled(40))
    again.load_state_dict(state)
    assert [int(i) for b in again for i in b["idx"]] == rest
    assert sorted(seen + rest) == list(range(40))
