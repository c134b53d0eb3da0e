"""The tested torch range: declared once, checked at import, warned about outside it."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from pinpool import _torch_versions
from pinpool._torch_versions import NEWEST, OLDEST, check, parse

ROOT = Path(__file__).resolve().parent.parent.parent


def test_versions_parse() -> None:
    assert parse("2.11.0+cu130") == (2, 11)
    assert parse("2.15.0") == (2, 15)
    assert parse("2.6.0a0+git1234") == (2, 6)
    assert parse("nightly") is None


def test_the_suite_runs_on_a_torch_in_the_range() -> None:
    assert check(torch.__version__), torch.__version__


def test_pyproject_declares_the_tested_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = f"torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"
    for extra in ("torch", "bench"):
        assert declared in project["optional-dependencies"][extra], extra
    oldest = (ROOT / "requirements-oldest.txt").read_text()
    assert f"torch=={OLDEST[0]}.{OLDEST[1]}." in oldest
    newest = (ROOT / "requirements-dev.txt").read_text()
    assert f"torch=={NEWEST[0]}.{NEWEST[1]}." in newest


def test_outside_the_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_versions, "_warned", False)
    expected = r"tested with torch 2\.6 to 2\.15; this is torch 2\.5\.1"
    with pytest.warns(RuntimeWarning, match=expected):
        assert not check("2.5.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check("3.0.0")  # (once per process)
        assert check(f"{NEWEST[0]}.{NEWEST[1]}.0")
