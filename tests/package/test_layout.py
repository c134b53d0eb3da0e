"""The package's modules import each other without a circle (one may not be needed to load
another that needs it), the parts split by where their code runs keep apart, and the main
process's rooms, split by job, import one another one way only: counting imports made inside
functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent.parent / "python" / "pinpool"


def imports_of(path: Path) -> set[str]:
    """The pinpool modules ``path`` imports (relative imports, at any depth in the file)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join((*base, *node.module.split("."))))
            else:
                found.update(".".join((*base, alias.name)) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pinpool."))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_in_the_package() -> None:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {m for m in imports_of(p) if m in files and m != name} for name, p in files.items()
    }
    circles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circles.append([*stack[stack.index(m) :], m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


#: What each part of the package, split by where its code runs, may not import: the wire
#: format both sides share stands on its own; the workers' side and the main process's side
#: meet only through it.
SEPARATE = {
    "pinpool._wire": ("pinpool._main", "pinpool._worker"),
    "pinpool._worker": ("pinpool._main",),
    "pinpool._main": ("pinpool._worker",),
}


#: What each room of the main process's side (``pinpool._main``, one folder a job) and
#: ``pinpool.pinned`` may not import: the rooms import one another one way only, the epochs
#: the route and resume, the route the settings; resume and the settings stand alone; the
#: adapter has the route and the settings, none of the epochs' worker machinery.
ROOMS = {
    "pinpool._main.route": ("pinpool._main.epochs", "pinpool._main.resume"),
    "pinpool._main.resume": (
        "pinpool._main.epochs",
        "pinpool._main.route",
        "pinpool._main.settings",
    ),
    "pinpool._main.settings": (
        "pinpool._main.epochs",
        "pinpool._main.route",
        "pinpool._main.resume",
    ),
    "pinpool.adapter": ("pinpool._main.epochs", "pinpool._main.resume"),
}


def wrong_imports(rules: dict[str, tuple[str, ...]]) -> list[str]:
    """Each import of a module of a part in ``rules`` that the part may not make."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    wrong = []
    for name, path in sorted(files.items()):
        for part, forbidden in rules.items():
            if name == part or name.startswith(part + "."):
                wrong += [
                    f"{name} imports {m}"
                    for m in sorted(imports_of(path))
                    if any(m == f or m.startswith(f + ".") for f in forbidden)
                ]
    return wrong


def test_the_wire_format_and_the_two_sides_import_only_what_they_may() -> None:
    wrong = wrong_imports(SEPARATE)
    assert not wrong, wrong


def test_the_main_process_rooms_import_one_another_one_way() -> None:
    files = {module_name(p) for p in PACKAGE.rglob("*.py")}
    assert all(room in files for room in ROOMS), sorted(set(ROOMS) - files)
    wrong = wrong_imports(ROOMS)
    assert not wrong, wrong
