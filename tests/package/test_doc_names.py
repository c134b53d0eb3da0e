"""Every file and every class member the project's text names exists, so the text cannot go
stale unseen.

The text: ``README.md``, ``docs/*.md``, the docstring of each module of ``python/pinpool``
and the ``//!`` doc of each file of ``src/``. In it, every span in backticks (Markdown's
`` `x` `` and reST's ````x```` or ``:class:`x```), every relative Markdown link and every
entry of a file tree (a fenced block with no language whose first line is a folder, as in
docs/development.md's source layout) is read, and:

- a file path (``src/pool/claim.rs``, ``_main/epochs/results.py``, ``benchmarks/``, a path
  inside a command) must name a file, or with a trailing ``/`` a folder, of the repository:
  from its root, from ``python/pinpool/``, from ``src/``, from the folder of the file naming
  it, or else as the end of some path in the repository (``pool/claim.rs``);
- ``Class.member`` (``Receiver.take``), whose class is the project's (a class of
  ``python/pinpool``, a pyclass of the extension as Python sees it, a Rust struct, enum or
  trait of ``src/``), and Rust's ``Type::member``, must name a member defined on it: a def,
  a property, a class attribute, an attribute assigned as ``self.x``, a Rust field, variant or
  ``fn`` of one of its ``impl`` blocks;
- ``module.name`` under pinpool (``pinpool._native.read_message``,
  ``_main.epochs.workers.WorkersIter``, ``receiver.Receiver.encode_local``) must name a module
  of the package that defines the name (and, after a class, a member of it).

Names of other projects (torch's ``DataLoader._get_iterator``, ``torch.cuda.Stream``, the
standard library, accelerate) are not the project's and are not checked, nor are trace events
(``batch.copy``: keys of ``pinpool._trace.EVENTS``), absolute paths, globs, URLs and
placeholders. A user's ``loader``, ``pool`` and ``slot`` are read as objects of pinpool's
``DataLoader``, ``PinPool`` and ``Slot``. Where a name could be either, it passes: a
member a class may inherit from a base outside the project, a member of one of several
classes of that name. A table cell that starts with "was" names what was removed, as it was
(docs/design.md's removed mechanisms): it is not checked. Everything is read as text (Python
through ``ast``); nothing is imported, so the check takes well under a second.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "python" / "pinpool"
SRC = ROOT / "src"

#: Folders that are not the project's text or code: tools' caches, virtual environments,
#: build output (hidden folders other than these are skipped too).
SKIPPED_DIRS = {"target", "dist", "demo-results", "__pycache__", "node_modules"}
KEPT_HIDDEN_DIRS = {".ci", ".github"}

#: Files and folders the text names that are not in the repository, each for a reason.
OUTSIDE_PATHS = {
    # torch's own files: the loader pinpool subclasses, and the test suite run against both
    # loaders by tests/torch_suite/run.py.
    "torch/utils/data/dataloader.py": "torch's DataLoader",
    "test/test_dataloader.py": "torch's DataLoader tests",
    "test_dataloader.py": "torch's DataLoader tests",
    # The standard library, whose queue pinpool's result reading replaces.
    "multiprocessing/queues.py": "the standard library's multiprocessing queues",
    # Made by a run, not kept: `make wheel` and `make demo` write these.
    "dist/": "the wheel `make wheel` writes",
    "demo-results/": "what `make demo` writes",
    # A user's script in the guide's torchrun example.
    "train.py": "the user's training script of docs/guide.md",
    # Placeholders of docs/development.md's rule for where a module's tests go.
    "x.rs": "placeholder",
    "x/mod.rs": "placeholder",
    "x/tests.rs": "placeholder",
    # Not a path: "not applicable", in a table.
    "n/a": "not applicable",
}

#: Project-looking ``Class.member`` names that are another project's, each for a reason (none
#: now: torch's ``DataLoader.x`` passes anyway, pinpool's DataLoader having torch's as a base).
OUTSIDE_NAMES: dict[str, str] = {}

#: First names that stand for a user's object of a project class, as the text writes them:
#: ``loader.stats()`` is a ``pinpool.DataLoader`` the user made (not the module
#: ``pinpool.loader``), ``pool.notes`` a ``PinPool``, ``slot.view`` a ``Slot``.
OBJECTS = {"loader": "DataLoader", "pool": "PinPool", "slot": "Slot"}
#: First names that stand for other objects, not for the pinpool module of that name:
#: ``workers`` are a loader's worker processes.
NOT_MODULES = {"workers"}

#: Endings that make a backticked word a file name.
FILE_SUFFIXES = (".py", ".pyi", ".rs", ".md", ".sh", ".toml", ".lock", ".txt", ".json", ".ipynb")
#: Of those, the ones a bare name (no folder) is checked for: others name a run's output
#: (``results.json``, ``table.txt``), wherever it was written.
CODE_SUFFIXES = (".py", ".pyi", ".rs", ".md", ".sh", ".toml", ".lock")

#: Bases outside the project whose members the text does not name on a project class: a
#: class with any other base outside the project may have members no file here defines.
PLAIN_BASES = {"object", "Generic", "Protocol", "NamedTuple", "TypedDict"}


# --- the text ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """One piece of the project's text: where it is (``path``, its ``first_line`` there) and
    what it says."""

    path: Path
    first_line: int
    body: str
    markdown: bool


def texts() -> list[Text]:
    """Every piece of text checked: the Markdown files whole, each Python module's docstring
    (the extension's stubs' too), each Rust file's ``//!`` lines at its top."""
    found = [
        Text(p, 1, p.read_text(), True)
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ]
    for p in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]):
        tree = ast.parse(p.read_text())
        if tree.body and isinstance(tree.body[0], ast.Expr):
            value = tree.body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append(Text(p, tree.body[0].lineno, value.value, False))
    for p in sorted(SRC.rglob("*.rs")):
        lines = []
        for line in p.read_text().splitlines():
            if not line.startswith("//!"):
                break
            lines.append(line[3:])
        if lines:
            found.append(Text(p, 1, "\n".join(lines), False))
    return found


@dataclass(frozen=True)
class Mention:
    """A name as the text gives it: ``kind`` is "span" (in backticks), "link" (a Markdown
    link's target) or "tree" (a path spelled out by a file tree)."""

    text: Text
    line: int
    name: str
    kind: str

    def where(self) -> str:
        return f"{self.text.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# A code span: a run of backticks, text (not across a blank line), the same run.
_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:[^`\n]|\n(?![ \t]*\n))+?)(?<!`)\1(?!`)")
_LINK = re.compile(r"\]\(([^()\s]+)\)")


def _line_at(text: Text, body: str, offset: int) -> int:
    return text.first_line + body.count("\n", 0, offset)


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _was_cell(body: str, offset: int) -> bool:
    """Whether ``offset`` lies in a table cell that starts with "was": a removed thing, named
    as it was."""
    start = body.rfind("\n", 0, offset) + 1
    line_start = body[start:offset]
    if not line_start.lstrip().startswith("|"):
        return False
    cell = line_start[line_start.rfind("|") + 1 :]
    return re.match(r"\s*was\b", cell) is not None


def mentions(text: Text) -> Iterator[Mention]:
    """What ``text`` names: its backticked spans and, in Markdown, its links' targets and its
    file trees' entries (code blocks are not read otherwise)."""
    body = text.body
    if text.markdown:
        for block in _FENCE.finditer(body):
            if block.group(1) == "":
                yield from _tree_entries(text, block.group(2), _line_at(text, body, block.start()))
        body = _FENCE.sub(_blank, body)
    for m in _SPAN.finditer(body):
        if not _was_cell(body, m.start()):
            yield Mention(text, _line_at(text, body, m.start()), m.group(2).strip(), "span")
    if text.markdown:
        for m in _LINK.finditer(body):
            if not _was_cell(body, m.start()):
                yield Mention(text, _line_at(text, body, m.start()), m.group(1), "link")


_NAME = r"[\w.-]+(?:/[\w.-]+)*/?"
_TREE_ENTRY = re.compile(rf"^( *)({_NAME}(?:, {_NAME})*)(?:  |$)")


def _tree_entries(text: Text, block: str, fence_line: int) -> Iterator[Mention]:
    """The paths a file tree spells out: each entry under the folders above it (by indent).
    Only lines whose indent is a level (two spaces a level, up to six) start an entry; deeper
    ones continue a description."""
    lines = block.split("\n")
    if not lines or not re.match(r"^[\w.-]+(/[\w.-]+)*/\s", lines[0] + " "):
        return
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders open above
    for n, line in enumerate(lines):
        m = _TREE_ENTRY.match(line)
        indent = len(line) - len(line.lstrip(" "))
        if not m or indent % 2 or indent > 12 or not line.strip():
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        names = m.group(2).split(", ")
        if not all(name.endswith(("/", *FILE_SUFFIXES)) for name in names):
            continue  # a description's words, not an entry
        for name in names:
            yield Mention(text, fence_line + 1 + n, parent + name, "tree")
        if len(names) == 1 and names[0].endswith("/"):
            folders.append((indent, parent + names[0]))


# --- the repository ----------------------------------------------------------------------


def repo_paths() -> tuple[set[str], set[str]]:
    """Every file and every folder of the repository, as paths from its root (``a/b.py``,
    folders with a trailing ``/``), without build output, caches or virtual environments."""
    files: set[str] = set()
    folders: set[str] = set()
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIPPED_DIRS and (not d.startswith(".") or d in KEPT_HIDDEN_DIRS)
        ]
        rel = Path(top).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        folders.update(prefix + d + "/" for d in dirs)
        files.update(prefix + n for n in names)
    return files, folders


def _is_path(token: str) -> bool:
    """Whether a word (one of a span's) is a file path to check."""
    if not re.fullmatch(r"[\w./-]+", token) or not re.search(r"[A-Za-z]", token):
        return False
    if "://" in token or token.startswith(("/", "-")):
        return False  # an absolute path (/proc, /dev/shm: the machine's), or an option
    if "/" in token:
        return True
    return token.endswith(CODE_SUFFIXES) and not token.startswith(".")


def paths_in(mention: Mention) -> list[str]:
    """The file paths a mention names: a link's target (its anchor dropped), a tree's entry,
    or each word of a span that is a path (skipping globs, placeholders and variables)."""
    if mention.kind == "link":
        target = mention.name.split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            return []  # an anchor of the same page, a URL, a mailto
        return [target]
    if mention.kind == "tree":
        return [mention.name]
    if re.search(r"[*{}<>$~]", mention.name):
        return []  # a glob, a placeholder (<pid>, {a,b}), a variable ($TMPDIR)
    return [t for t in mention.name.split() if _is_path(t)]


def path_exists(path: str, mention: Mention, files: set[str], folders: set[str]) -> bool:
    """Whether ``path`` names a file (or, with a trailing ``/``, a folder) of the repository,
    from one of the places a path is read from, or as the end of some path."""
    folder = path.endswith("/")
    pool = folders if folder else files | folders
    here = mention.text.path.parent.relative_to(ROOT).as_posix()
    bases = ["", "python/pinpool/", "src/", "" if here == "." else here + "/"]
    for base in bases:
        full = os.path.normpath(base + path).replace(os.sep, "/") + ("/" if folder else "")
        if full in pool or full + "/" in pool:
            return True
    tail = path
    while tail.startswith("./"):
        tail = tail[2:]
    tail = tail.rstrip("/")
    return any(p.rstrip("/").endswith("/" + tail) or p.rstrip("/") == tail for p in pool)


def _outside(path: str) -> bool:
    return any(path == o or path.endswith("/" + o) for o in OUTSIDE_PATHS)


def stale_paths(all_mentions: list[Mention]) -> tuple[list[str], int]:
    """The paths named that exist nowhere (``file:line: `path` ...``), and how many were
    checked."""
    files, folders = repo_paths()
    stale, checked = [], 0
    for m in all_mentions:
        for path in paths_in(m):
            if _outside(path):
                continue
            checked += 1
            if not path_exists(path, m, files, folders):
                stale.append(f"{m.where()}: `{path}` is no file of the repository")
    return stale, checked


# --- the project's names -----------------------------------------------------------------


@dataclass
class Kind:
    """A class or type of the project, under one name (several of that name merged): the
    members defined on it, and its bases as named (Python's; a Rust type has none)."""

    members: set[str] = field(default_factory=set)
    bases: set[str] = field(default_factory=set)


@dataclass
class Names:
    """What the project defines: Python classes (``python``), Rust types (``rust``), each by
    name, and each Python module's top-level names by dotted path under pinpool."""

    python: dict[str, Kind]
    rust: dict[str, Kind]
    modules: dict[str, set[str]]

    def kind(self, name: str) -> Kind | None:
        """The project's class or type of that name, as Python or Rust sees it, or None."""
        if name not in self.python and name not in self.rust:
            return None
        merged = Kind()
        for table in (self.python, self.rust):
            if name in table:
                merged.members |= table[name].members
                merged.bases |= table[name].bases
        return merged

    def has_member(self, name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether the class ``name`` defines ``member``, or may inherit it: from a base of
        the project's that does, or from a base outside the project (which is not read)."""
        kind = self.kind(name)
        if kind is None or member in kind.members:
            return kind is not None
        for base in kind.bases - seen:
            if base.rsplit(".", 1)[-1] in PLAIN_BASES:
                continue
            if self.kind(base) is None or self.has_member(base, member, seen | {name}):
                return True
        return False


def _class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                members.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
                members.update(c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            members.add(stmt.target.id)
    for n in ast.walk(node):
        # self.x = ..., self.x: T = ..., cls.x = ...
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign | ast.AugAssign):
            targets = [n.target]
        for t in targets:
            for a in ast.walk(t):
                if (
                    isinstance(a, ast.Attribute)
                    and isinstance(a.value, ast.Name)
                    and a.value.id in ("self", "cls")
                ):
                    members.add(a.attr)
        # object.__setattr__(self, "x", ...) (a frozen class's own attributes)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "__setattr__"
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
        ):
            members.add(str(n.args[1].value))
    return members


def _base_name(expr: ast.expr) -> str:
    """A base as named (``Generic[_T]`` -> ``Generic``; ``torch.utils.data.DataLoader``
    whole, a name of no project class)."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return ast.unparse(expr)


def _top_level_names(tree: ast.Module) -> set[str]:
    """A module's names: its defs, classes, assignments and imports (under ``if`` and ``try``
    too), and the strings of its ``__all__``."""
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                if stmt.value is not None:
                    names.update(
                        c.value
                        for c in ast.walk(stmt.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            for alias in stmt.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(stmt, ast.If | ast.Try | ast.With):
            todo.extend(stmt.body)
            todo.extend(getattr(stmt, "orelse", []))
            todo.extend(getattr(stmt, "finalbody", []))
            for handler in getattr(stmt, "handlers", []):
                todo.extend(handler.body)
    return names


def python_names() -> tuple[dict[str, Kind], dict[str, set[str]]]:
    """Every class of the package (``.py`` and the extension's ``.pyi``) with its members and
    bases, and every module's top-level names by dotted path (``_main.route.receiver``; a
    package's by its folder's path, the package itself as "")."""
    kinds: dict[str, Kind] = {}
    modules: dict[str, set[str]] = {}
    for p in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]):
        tree = ast.parse(p.read_text())
        parts = p.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.setdefault(".".join(parts), set()).update(_top_level_names(tree))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                kind = kinds.setdefault(node.name, Kind())
                kind.members |= _class_members(node)
                kind.bases |= {_base_name(b) for b in node.bases}
    # A package's submodules are its names too (``pinpool.bench``, ``_main.epochs.workers``).
    for dotted in list(modules):
        if dotted:
            parent, _, child = dotted.rpartition(".")
            modules.setdefault(parent, set()).add(child)
    return kinds, modules


_RUST_NOISE = re.compile(
    r"//[^\n]*|/\*.*?\*/"  # comments
    r'|r(#*)".*?"\1|"(?:\\.|[^"\\])*"'  # strings, raw or not
    r"|'(?:\\.|[^\\'\n])'",  # chars ('{'), not lifetimes ('a)
    re.S,
)


def _strip_rust(code: str) -> str:
    """Rust source with comments and string and char literals blanked, in place (their braces
    would upset the matching of blocks)."""
    return _RUST_NOISE.sub(_blank, code)


def _block(code: str, start: int) -> str:
    """The text of the braced block whose ``{`` is at ``start`` (or from it to the end)."""
    depth = 0
    for i in range(start, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return code[start : i + 1]
    return code[start:]


def _top_depth_only(block: str) -> str:
    """The text of a block at its own level (inner blocks blanked): its fields, or variants."""
    out, depth = [], 0
    for ch in block[1:-1]:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _drop_generics(header: str) -> str:
    while True:
        shorter = re.sub(r"<[^<>]*>", "", header)
        if shorter == header:
            return header
        header = shorter


_RUST_ITEM = re.compile(r"\b(struct|enum|trait|union|type)\s+([A-Za-z_]\w*)")
_RUST_IMPL = re.compile(r"\bimpl\b")
_PYCLASS = re.compile(r"#\[pyclass(?:\(([^)]*)\))?\][^;{]*?\bstruct\s+(\w+)", re.S)


def rust_names() -> dict[str, Kind]:
    """Every struct, enum, trait and type alias of ``src/`` with its members: fields,
    variants, the ``fn``s, consts and types of its ``impl`` blocks (a trait's own ``fn``s
    too, and those of the traits it implements); a pyclass also under its Python name, with
    the names pyo3 gives its methods."""
    kinds: dict[str, Kind] = {}
    defined: set[str] = set()  # (a type only implemented here, as PyErr, is not the project's)
    python_name: dict[str, str] = {}
    for p in sorted(SRC.rglob("*.rs")):
        raw = p.read_text()
        for m in _PYCLASS.finditer(raw):
            named = re.search(r'name\s*=\s*"(\w+)"', m.group(1) or "")
            python_name[m.group(2)] = named.group(1) if named else m.group(2)
        code = _strip_rust(raw)
        for m in _RUST_ITEM.finditer(code):
            item, name = m.group(1), m.group(2)
            if item == "type":
                continue  # an alias (or an associated type): its members are another type's
            defined.add(name)
            kind = kinds.setdefault(name, Kind())
            after = code[m.end() :]
            brace, semi = after.find("{"), after.find(";")
            if brace < 0 or (0 <= semi < brace):
                continue  # a unit or tuple struct
            block = _block(code, m.end() + brace)
            level = _drop_generics(_top_depth_only(block))
            attrs = r"(?:^|,)\s*(?:#\[[^\]]*\]\s*)*"
            if item in ("struct", "union"):
                field_re = attrs + r"(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:"
                kind.members |= set(re.findall(field_re, level))
            elif item == "enum":
                kind.members |= set(re.findall(attrs + r"([A-Z]\w*)", level))
            else:  # a trait: its fns are its members
                kind.members |= set(re.findall(r"\bfn\s+(\w+)", block))
        for m in _RUST_IMPL.finditer(code):
            brace = code.find("{", m.end())
            if brace < 0:
                continue
            header = re.split(r"\swhere\s", _drop_generics(code[m.end() : brace]))[0]
            trait = None
            if re.search(r"\sfor\s", header):
                trait_part, header = re.split(r"\sfor\s", header, maxsplit=1)
                trait = re.findall(r"\w+", trait_part)[-1:] or None
            idents = re.findall(r"[A-Za-z_]\w*", header)
            if not idents:
                continue
            kind = kinds.setdefault(idents[-1], Kind())
            block = _block(code, brace)
            kind.members |= set(re.findall(r"\b(?:fn|const|type)\s+(\w+)", block))
            raw_block = raw[brace : brace + len(block)]
            kind.members |= set(re.findall(r'name\s*=\s*"(\w+)"', raw_block))
            if trait:
                kind.bases.add(trait[0])
    for rust, py in python_name.items():
        if rust in kinds and py != rust:
            defined.add(py)
            kinds.setdefault(py, Kind()).members |= kinds[rust].members
    # A trait's members are its implementors' (a default method is called on them).
    for kind in kinds.values():
        for trait in list(kind.bases):
            if trait in kinds:
                kind.members |= kinds[trait].members
        kind.bases = set()  # Rust has no inheritance; the traits' members are now the type's
    return {name: kind for name, kind in kinds.items() if name in defined}


@functools.cache
def project_names() -> Names:
    """What the project defines, read once."""
    python, modules = python_names()
    return Names(python, rust_names(), modules)


def trace_events() -> set[str]:
    """The names of pinpool's trace events (``batch.copy``): the keys of ``_trace.EVENTS``."""
    tree = ast.parse((PACKAGE / "_trace.py").read_text())
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "EVENTS" for t in targets):
            assert isinstance(node, ast.Assign | ast.AnnAssign)
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("pinpool._trace has no EVENTS")


_DOTTED = re.compile(r"~?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^()]*\))?")
_RUST_PATH = re.compile(r"((?:\w+::)*[A-Z]\w*)::(\w+)(?:\([^()]*\))?")


def _modules_named(names: Names, dotted: str, anchored: bool) -> list[str]:
    """The modules of the package that ``dotted`` names: from the package's root, or (not
    ``anchored``) as the end of a module's path (``receiver``: ``_main.route.receiver``)."""
    if anchored:
        return [dotted] if dotted in names.modules else []
    return [m for m in names.modules if m == dotted or m.endswith("." + dotted)]


def check_name(span: str, names: Names, events: set[str]) -> tuple[bool, str] | None:
    """Checks one backticked span as a code name: None if it is none of the project's
    (another project's name, a user's object, a trace event, not a name at all), else whether
    it exists and why not."""
    m = _RUST_PATH.fullmatch(span)
    if m:
        kind_name = m.group(1).split("::")[-1]
        if kind_name == "Self" or kind_name not in names.rust:
            return None
        if names.rust[kind_name].members and m.group(2) not in names.rust[kind_name].members:
            return False, f"the Rust type {kind_name} has no member {m.group(2)}"
        return True, ""
    m = _DOTTED.fullmatch(span)
    if not m or span.endswith(FILE_SUFFIXES) or m.group(1) in events or span in OUTSIDE_NAMES:
        return None
    segs = m.group(1).split(".")
    anchored = segs[0] == "pinpool"
    if anchored:
        segs = segs[1:]
    elif segs[0] in OBJECTS:
        segs = [OBJECTS[segs[0]], *segs[1:]]
    elif segs[0] in NOT_MODULES:
        return None
    # The longest start of the name that is a module, then names defined in it.
    for k in range(len(segs), -1 if anchored else 0, -1):
        found = _modules_named(names, ".".join(segs[:k]), anchored)
        if not found:
            continue
        rest = segs[k:]
        if not rest:
            return True, ""
        if not any(rest[0] in names.modules[f] for f in found):
            return (
                False,
                f"no module {' or '.join(f or 'pinpool' for f in found)} defines {rest[0]}",
            )
        if len(rest) >= 2 and names.kind(rest[0]) is not None:
            if not names.has_member(rest[0], rest[1]):
                return False, f"the class {rest[0]} has no member {rest[1]}"
        return True, ""
    if anchored or names.kind(segs[0]) is None:
        return None  # not the project's: torch, the standard library, a variable
    if not names.has_member(segs[0], segs[1]):
        return False, f"the class {segs[0]} has no member {segs[1]}"
    return True, ""


def stale_names(all_mentions: list[Mention], names: Names) -> tuple[list[str], int]:
    """The code names of the text that do not exist (``file:line: `name`: why``), and how
    many were checked."""
    events = trace_events()
    stale, checked = [], 0
    for m in all_mentions:
        if m.kind != "span":
            continue
        result = check_name(m.name, names, events)
        if result is None:
            continue
        checked += 1
        if not result[0]:
            stale.append(f"{m.where()}: `{m.name}`: {result[1]}")
    return stale, checked


# --- the tests ---------------------------------------------------------------------------


ALL_TEXTS = texts()
ALL_MENTIONS = [m for t in ALL_TEXTS for m in mentions(t)]


def test_the_text_names_only_files_that_exist() -> None:
    stale, checked = stale_paths(ALL_MENTIONS)
    assert checked >= 200, f"only {checked} paths found: is the extractor broken?"
    assert not stale, f"{len(stale)} of {checked} paths named are stale:\n" + "\n".join(stale)


def test_the_text_names_only_members_that_exist() -> None:
    stale, checked = stale_names(ALL_MENTIONS, project_names())
    assert checked >= 100, f"only {checked} names found: is the extractor broken?"
    assert not stale, f"{len(stale)} of {checked} names are stale:\n" + "\n".join(stale)


def test_the_check_finds_what_does_not_exist() -> None:
    """The check can fail: made-up names in a made-up text are reported, and real ones are
    not."""
    doc = ROOT / "docs" / "made-up.md"
    body = (
        "`Receiver.no_such_method` and `Receiver.take`; `_main/no_such_file.py` and "
        "`_main/route/receiver.py`; [gone](no-such-page.md), [here](design.md#words);\n"
        "`pinpool._native.no_such_function`, `pinpool._native.read_message`; "
        "`Pool::no_such_fn`, `Pool::claim`; `torch.cuda.Stream`, `DataLoader._get_iterator`;\n"
        "```\nsrc/\n  pool/\n    claim.rs      the claim\n    no_such.rs    gone\n```\n"
        "| a | b |\n| --- | --- |\n| x | was `_main/read_ahead.py`, `Receiver.big` |\n"
    )
    made_up = list(mentions(Text(doc, 1, body, True)))
    paths, n_paths = stale_paths(made_up)
    assert n_paths == 8, paths  # the tree's four, two spans, two links; the removed not read
    assert [p.split(": ", 1)[1].split(" ")[0] for p in paths] == [
        "`src/pool/no_such.rs`",
        "`_main/no_such_file.py`",
        "`no-such-page.md`",
    ]
    found, n_names = stale_names(made_up, project_names())
    # torch.cuda.Stream is not the project's; DataLoader._get_iterator is (pinpool's loader
    # overrides it); the removed ones are not read.
    assert n_names == 7, found
    assert [f.split(": ")[1] for f in found] == [
        "`Receiver.no_such_method`",
        "`pinpool._native.no_such_function`",
        "`Pool::no_such_fn`",
    ], found
    assert all(f.startswith("docs/made-up.md:") for f in [*paths, *found])


def test_every_kind_of_text_is_read() -> None:
    kinds = {(t.path.suffix, t.markdown) for t in ALL_TEXTS}
    assert kinds == {(".md", True), (".py", False), (".pyi", False), (".rs", False)}
    # A Rust module doc and a Python docstring each give their spans, at their lines.
    lib = next(t for t in ALL_TEXTS if t.path == SRC / "lib.rs")
    assert any(m.name == "system" and m.line <= 10 for m in mentions(lib))
