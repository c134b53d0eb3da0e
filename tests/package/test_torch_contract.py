"""pinpool's contract with torch's and multiprocessing's private internals
(``pinpool._torch_contract``): it holds on the installed torch, it is the only module that
spells a private path, it names every private attribute the modules that touch torch's
objects use, and its check can fail."""

from __future__ import annotations

import ast
import io
import multiprocessing.queues
import re
import tokenize
from pathlib import Path

import pytest
import torch.utils.data
from torch_contract_check import assigned_attributes, check_installed_torch

from pinpool import _torch_contract as contract
from pinpool._torch_contract import MultiProcessingIter

PACKAGE = Path(__file__).resolve().parent.parent.parent / "python" / "pinpool"

#: The contract (what pinpool relies on; its check against the installed torch is this
#: directory's ``torch_contract_check.py``).
CONTRACT_MODULES = ("_torch_contract.py",)

#: Private torch and multiprocessing paths, as a module could spell them.
PRIVATE_PATHS = {
    "torch.utils.data._utils": re.compile(r"torch\.utils\.data\._utils\b"),
    "torch.utils.data.dataloader._": re.compile(r"torch\.utils\.data\.dataloader\._"),
    "from torch.utils.data[.dataloader] import _": re.compile(
        r"from\s+torch\.utils\.data(\.dataloader)?\s+import\s+(\([^)]*|[^\n(]*)\b_[A-Za-z]"
    ),
    "multiprocessing.queues": re.compile(r"multiprocessing\.queues\b"),
    "multiprocessing.context": re.compile(r"multiprocessing\.context\b"),
    "torch._C": re.compile(r"torch\._C\b"),
    "torch._utils": re.compile(r"torch\._utils\b"),
}

#: Where a private path may still be spelled outside the contract, and why.
ALLOWED = {
    # Runs when any slot is released; importing pinpool must not import torch (the contract
    # module does): the contract's doc names this exception.
    "_cuda_stream.py": {"torch._C"},
}

#: The modules that read or set attributes on torch's DataLoader, its iterator or a
#: multiprocessing queue.
TOUCHING = (
    "loader.py",
    "_main/epochs/workers.py",
    "_main/epochs/loader_iter.py",
    "_main/epochs/index_queue.py",
    "_main/resume/checkpoint.py",
)


def code_of(path: Path) -> str:
    """The file's text with its comments blanked (strings, docstrings included, stay)."""
    lines = path.read_text().splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            line = lines[row - 1]
            lines[row - 1] = line[:col] + " " * (token.end[1] - col) + line[token.end[1] :]
    return "".join(lines)


def test_the_installed_torch_keeps_the_contract() -> None:
    assert check_installed_torch() == [], f"torch {torch.__version__}"


def test_private_paths_are_spelled_only_in_the_contract() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in CONTRACT_MODULES or name.startswith("bench/"):
            continue
        code = code_of(path)
        for label, pattern in PRIVATE_PATHS.items():
            if label in ALLOWED.get(name, ()):
                continue
            for match in pattern.finditer(code):
                line = code.count("\n", 0, match.start()) + 1
                found.append(f"{name}:{line}: {label}")
    assert not found, "private paths outside _torch_contract.py: " + "; ".join(found)
    # (the scan does find them: the contract spells each)
    contract_code = code_of(PACKAGE / "_torch_contract.py")
    for label in ("torch.utils.data._utils", "torch.utils.data.dataloader._", "torch._C"):
        assert PRIVATE_PATHS[label].search(contract_code), label


def private_names_used(path: Path) -> set[str]:
    """The private (single underscore) attribute names ``path`` reads or sets: attributes, and
    names given to getattr/hasattr/setattr/delattr as strings. pinpool's own ``_pin_`` names
    are left out."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            names.add(node.args[1].value)
    return {
        n
        for n in names
        if n.startswith("_") and not n.startswith("__") and not n.startswith("_pinpool_")
    }


def test_private_attributes_used_on_torch_objects_are_in_the_tables() -> None:
    torch_side: set[str] = set()
    for cls in (MultiProcessingIter, torch.utils.data.DataLoader, multiprocessing.queues.Queue):
        torch_side |= set(dir(cls)) | assigned_attributes(cls)
    listed = (
        set(contract.ITERATOR_ATTRIBUTES)
        | set(contract.LOADER_ATTRIBUTES)
        | set(contract.QUEUE_ATTRIBUTES)
    )
    missing = {
        name: sorted((private_names_used(PACKAGE / name) & torch_side) - listed)
        for name in TOUCHING
    }
    assert not any(missing.values()), f"used but not in the contract's tables: {missing}"
    # (and the scan sees them: the workers' iterator uses most of the iterator's)
    assert {"_index_queues", "_try_get_data", "_workers"} <= private_names_used(
        PACKAGE / "_main" / "epochs" / "workers.py"
    )


def test_the_tables_say_what_each_name_is_for() -> None:
    for table in (
        contract.ITERATOR_ATTRIBUTES,
        contract.LOADER_ATTRIBUTES,
        contract.QUEUE_ATTRIBUTES,
        contract.COLLATE_ATTRIBUTES,
    ):
        for name, use in table.items():
            assert name.startswith("_") or table is contract.COLLATE_ATTRIBUTES, name
            assert len(use) > 10, name


def test_check_reports_a_missing_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(MultiProcessingIter, "_try_get_data")
    problems = check_installed_torch()
    assert any("_try_get_data is missing" in p for p in problems), problems


def test_check_reports_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    def _try_get_data(self: object, wait: float = 5.0) -> None:
        pass

    monkeypatch.setattr(MultiProcessingIter, "_try_get_data", _try_get_data)
    problems = check_installed_torch()
    assert any("_try_get_data takes ('self', 'wait')" in p for p in problems), problems


def test_check_reports_an_attribute_torch_no_longer_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(contract.ITERATOR_ATTRIBUTES, "_not_set_by_torch", "a test's")
    monkeypatch.setitem(contract.QUEUE_ATTRIBUTES, "_not_set_either", "a test's")
    problems = check_installed_torch()
    assert any("no longer sets self._not_set_by_torch" in p for p in problems), problems
    assert any("Queue no longer sets self._not_set_either" in p for p in problems), problems


def test_check_reports_missing_module_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.data._utils.signal_handling as signal_handling

    monkeypatch.delattr(signal_handling, "_remove_worker_pids")
    monkeypatch.delattr(contract.torch_collate, "collate_tensor_fn")
    problems = check_installed_torch()
    assert any("_remove_worker_pids is missing" in p for p in problems), problems
    assert any("collate.collate_tensor_fn is missing" in p for p in problems), problems
