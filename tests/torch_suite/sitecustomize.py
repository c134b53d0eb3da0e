"""Loaded at start-up by every Python process of a torch-suite run (``run.py`` puts this folder
first on ``PYTHONPATH``), spawned workers and test subprocesses included: with
``PINPOOL_TORCH_SUITE=pinpool``, ``torch.utils.data.DataLoader`` is ``pinpool.DataLoader`` before
torch's test file imports it.

Names that torch's testing helpers of an older torch lack are given neutral values as those
helpers are imported, not before: importing them asks torch whether CUDA is there, which marks
every process forked from this one unable to use CUDA (torch's rule for forks), and a
forkserver's server that imported them would hand that mark to every worker it forks."""

import importlib.abc
import importlib.util
import os
import sys
import unittest

_HELPERS = "torch.testing._internal.common_utils"


def _neutral_values() -> dict:
    return {
        "IS_JETSON": False,
        "TEST_WITH_TSAN": False,
        "skipIfNoDill": unittest.skipUnless(importlib.util.find_spec("dill"), "no dill"),
    }


class _FillInHelpers(importlib.abc.MetaPathFinder):
    """Finds torch's testing helpers as the other finders do, and sets the names they lack
    once they have run."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _HELPERS:
            return None
        sys.meta_path.remove(self)  # (once: the next finder finds the module)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            for key, value in _neutral_values().items():
                if not hasattr(module, key):
                    setattr(module, key, value)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("PINPOOL_TORCH_SUITE"):
    sys.meta_path.insert(0, _FillInHelpers())
    if os.environ["PINPOOL_TORCH_SUITE"] == "pinpool":
        import torch.utils.data

        import pinpool

        torch.utils.data.DataLoader = pinpool.DataLoader  # type: ignore[misc]
