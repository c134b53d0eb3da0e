"""The torch versions pinpool is tested with, and a warning outside them.

pinpool relies on private parts of torch's DataLoader (see the torch contract in
``docs/design.md``), which torch may change in any release. The range below is the one the
test suite runs on: the oldest (``make test-oldest``), the GPU machine's, and the newest
(``make test``); ``pyproject.toml`` declares the same.

Invariants: importing this module imports nothing of torch's; :func:`check` warns at most
once per process, and never raises.
"""

from __future__ import annotations

import re
import warnings

#: The oldest and the newest torch (major, minor) the suite runs on.
OLDEST = (2, 6)
NEWEST = (2, 15)

_warned = False


def requirement() -> str:
    """The pip requirement for a torch in the tested range ("torch>=2.6,<2.16")."""
    return f"torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"


def parse(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string ("2.11.0+cu130" -> (2, 11))."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check(version: str) -> bool:
    """Whether ``version`` is in the tested range; warns once (per process) when it is not."""
    global _warned
    seen = parse(version)
    if seen is not None and OLDEST <= seen <= NEWEST:
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"pinpool is tested with torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}; "
            f"this is torch {version}: pinpool.DataLoader relies on parts of torch's "
            "DataLoader that may have changed",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
