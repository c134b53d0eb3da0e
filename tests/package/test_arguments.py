"""Each of pinpool's ``DataLoader`` arguments is declared once (``arguments.ARGUMENTS``): the
loader's signature, ``pinpool.pinned``'s, the user guide's options table, the loader's
attributes and its checks are those declarations, and none can drift from them."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import pinpool
from pinpool import _errors
from pinpool._errors import ArgumentTypeError
from pinpool._main.settings import arguments
from pinpool.adapter import PINNED_ARGUMENTS, Pinned

GUIDE = Path(__file__).resolve().parent.parent.parent / "docs" / "guide.md"
NAMES = [a.name for a in arguments.ARGUMENTS]


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in the user guide, as cells."""
    text = GUIDE.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def _options() -> dict[str, str]:
    """The options table: each argument's shown default, by name."""
    out = {}
    for names, default, *_ in _table("## DataLoader options"):
        for name in re.findall(r"`(\w+)`", names):
            out[name] = default
    return out


def test_the_guides_options_table_is_the_declarations() -> None:
    table = _options()
    assert sorted(table) == sorted(NAMES)
    for argument in arguments.ARGUMENTS:
        assert table[argument.name] == argument.shown_default, argument.name


def test_the_loaders_signature_is_the_declarations() -> None:
    params = inspect.signature(pinpool.DataLoader.__init__).parameters
    names = list(params)
    ours = names[names.index("in_order") + 1 :]
    assert ours == NAMES
    for argument in arguments.ARGUMENTS:
        param = params[argument.name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, argument.name
        assert param.default == argument.default, argument.name
    assert pinpool.loader.PINPOOL_ARGUMENTS == tuple(NAMES)


def test_pinneds_signature_is_the_declarations_it_takes() -> None:
    for function in (pinpool.pinned, Pinned.__init__):
        params = inspect.signature(function).parameters
        keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert sorted(keywords) == sorted(PINNED_ARGUMENTS), function
        for name in keywords:
            assert params[name].default == arguments.BY_NAME[name].default, name


def test_a_loaders_attributes_are_its_arguments() -> None:
    given: dict[str, Any] = {"zero_copy": False, "slot_timeout": 5.0, "overflow": "wait"}
    loader = pinpool.DataLoader(torch.arange(4), batch_size=2, **given)
    for argument in arguments.ARGUMENTS:
        assert vars(loader)[argument.name] == given.get(argument.name, argument.default)


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_refuses_a_wrong_type_by_name_when_the_loader_is_made(name: str) -> None:
    with pytest.raises(ArgumentTypeError, match=rf"\b{name}\b") as caught:
        pinpool.DataLoader(torch.arange(4), batch_size=2, **{name: object()})
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, pinpool.InvalidArgument)
    if name in PINNED_ARGUMENTS:
        inner = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
        with pytest.raises(ArgumentTypeError, match=rf"\b{name}\b"):
            pinpool.pinned(inner, **{name: object()})


def test_the_guides_errors_table_names_every_error() -> None:
    errors = {
        name
        for name, value in vars(_errors).items()
        if isinstance(value, type) and issubclass(value, _errors.PinPoolError)
    }
    errors.discard("PinPoolError")  # (the base, named above the table)
    table = {re.findall(r"`(\w+)`", row[0])[0] for row in _table("## Errors")}
    assert table == errors


@pytest.mark.parametrize(
    ("kwargs", "zero_copy"),
    [
        ({}, False),
        ({"num_workers": 2, "zero_copy": True}, True),
        ({"zero_copy": True}, False),  # (no workers: warned, see tests/unit/test_settings.py)
        ({"num_workers": 2, "zero_copy": True, "batch_size": None}, False),
    ],
)
def test_the_delivery_mode_is_resolved_once_from_the_arguments_and_the_machine(
    kwargs: dict[str, Any], zero_copy: bool
) -> None:
    kwargs.setdefault("batch_size", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = pinpool.DataLoader(torch.arange(4), **kwargs)
    receiver = loader._pinpool_receiver
    mode = receiver.mode
    assert mode.zero_copy is zero_copy
    assert mode.main_process_copies is not zero_copy
    assert (receiver.grants is not None) is zero_copy
    assert not mode.on_device and mode.device is None
    assert mode.pin_thread is bool(torch.accelerator.is_available())
    assert receiver.deliver.mode is mode
