"""Loaded at start-up by every Python process of a torch-suite run (``run.py`` puts this folder
first on ``PYTHONPATH``), spawned workers and test subprocesses included: with
``PINPOOL_TORCH_SUITE=pinpool``, ``torch.utils.data.DataLoader`` is ``pinpool.DataLoader`` before
torch's test file imports it. Names that torch's testing helpers of an older torch lack are
given neutral values, so that a newer test file imports there."""

import os
import unittest

if os.environ.get("PINPOOL_TORCH_SUITE"):
    import torch.testing._internal.common_utils as _common
    import torch.utils.data

    for _name, _value in {
        "IS_JETSON": False,
        "TEST_WITH_TSAN": False,
        "skipIfNoDill": unittest.skipUnless(
            __import__("importlib").util.find_spec("dill"), "no dill"
        ),
    }.items():
        if not hasattr(_common, _name):
            setattr(_common, _name, _value)
    if os.environ["PINPOOL_TORCH_SUITE"] == "pinpool":
        import pinpool

        torch.utils.data.DataLoader = pinpool.DataLoader  # type: ignore[misc]
