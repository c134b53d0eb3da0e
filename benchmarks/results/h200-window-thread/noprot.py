"""The experiment of callN and callW2: a zero-copy worker's windows left writable while kept
(opened whole once, never closed again), patched into an installed copy of pinpool (argument:
the folder holding its ``pinpool`` package)."""

import sys
from pathlib import Path

path = Path(sys.argv[1]) / "pinpool" / "_worker" / "windows.py"
s = path.read_text()
OPEN = "    window.open(offset, nbytes)\n    return window, offset - window.offset, new"
WHOLE = (
    "    if window.open_range is None:\n"
    "        window.open(window.offset, window.length)\n"
    "    return window, offset - window.offset, new"
)
CLOSE_DOC = '    """Makes ``window`` inaccessible again; one that cannot be is no longer kept."""\n'
CLOSE_AT = "    _here()\n    if window.length >= OFF_PATH_BYTES:\n        closing"
NO_CLOSE = "    _here()\n    return None\n    if window.length >= OFF_PATH_BYTES:\n        closing"
for old, new in ((OPEN, WHOLE), (CLOSE_DOC, CLOSE_DOC + "    return\n"), (CLOSE_AT, NO_CLOSE)):
    assert s.count(old) == 1, old
    s = s.replace(old, new)
path.write_text(s)
print("patched", path)
