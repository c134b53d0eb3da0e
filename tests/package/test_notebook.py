"""The repository keeps the claim, not the run.

``docs/performance.md`` holds one short section per claim and ``benchmarks/results/`` only the
small summaries it cites; logs, one-off scripts and dated runs live in git history. README.md
and the user guide carry no dated runs or commit ids, README's limits stay a short list,
every relative link in the docs reaches a file and, with an anchor, a heading of it, and the
design's glossary ("Words") lists each word once.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

MAX_RESULT_FILES = 40
RAW_SUFFIXES = (".log", ".sh", ".py", ".patch")
MAX_PERFORMANCE_LINES = 300
MAX_LIMITS_LINES = 12

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_DATE = re.compile(r"(?<!\d)20\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])(?!\d)")
# A commit id as prose cites one: 7 to 40 hex digits standing alone, with a digit and a letter
# in it (so neither a number nor an English word such as "defaced"), not a 0x constant.
_HEX_WORD = re.compile(r"(?<![\w.-])(?<!0x)[0-9a-f]{7,40}(?![\w-])")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked (their lines kept, so numbers still match)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def result_files() -> list[str]:
    """The files of ``benchmarks/results/``, relative to the repository: those git tracks where
    this is a git checkout, else those on disk."""
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "benchmarks/results"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        return [p for p in out.split("\0") if p]
    return [str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if p.is_file()]


def dates_in(text: str) -> list[str]:
    return [m.group(0) for m in _DATE.finditer(without_code_blocks(text))]


def commit_ids_in(text: str) -> list[str]:
    words = _HEX_WORD.findall(without_code_blocks(text))
    return [w for w in words if re.search(r"\d", w) and re.search(r"[a-f]", w)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as shown (no code marks, links as their text),
    lower case, without punctuation but hyphens, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in _HEADING.finditer(without_code_blocks(path.read_text())):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def section(text: str, heading: str) -> list[str]:
    """The non-blank lines under ``## heading``, up to the next heading of that level or above."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}") + 1
    body = []
    for line in lines[start:]:
        if re.match(r"#{1,2} ", line):
            break
        body.append(line)
    return [line for line in body if line.strip()]


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file is missing, or whose anchor names no heading."""
    broken = []
    for target in _LINK.findall(without_code_blocks(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def test_results_keep_only_a_few_summaries() -> None:
    files = result_files()
    assert files, "benchmarks/results/ has no files (its README at least)"
    assert len(files) <= MAX_RESULT_FILES, (
        f"benchmarks/results/ has {len(files)} files; keep at most {MAX_RESULT_FILES} summaries "
        "that docs/performance.md cites (the rest lives in git history)"
    )
    raw = [f for f in files if f.endswith(RAW_SUFFIXES)]
    assert not raw, f"logs and one-off scripts belong in git history, not the tree: {raw}"


def test_every_result_file_performance_cites_exists() -> None:
    cited = re.findall(r"`(benchmarks/results/[^`\s]*)`", PERFORMANCE.read_text())
    assert cited
    missing = []
    for path in cited:
        # {a,b} alternatives, then a glob: each must match something.
        head, brace, rest = path.partition("{")
        options = rest.split("}", 1)[0].split(",") if brace else [""]
        tail = rest.split("}", 1)[1] if brace else ""
        for option in options:
            if not glob.glob(str(ROOT / f"{head}{option}{tail}")):
                missing.append(f"{head}{option}{tail}")
    assert not missing, f"docs/performance.md cites files that are not there: {missing}"


@pytest.mark.parametrize("doc", [README, GUIDE], ids=lambda p: p.name)
def test_no_dated_runs_or_commit_ids(doc: Path) -> None:
    text = doc.read_text()
    assert not dates_in(text), f"{doc.name} names dated runs: {dates_in(text)}"
    assert not commit_ids_in(text), f"{doc.name} names commits: {commit_ids_in(text)}"


def test_the_checks_see_what_they_look_for() -> None:
    assert dates_in("measured on the H200, 2026-12-04") == ["2026-12-04"]
    assert commit_ids_in("wheels of 54745cc (before) and `f2c5a2e`") == ["54745cc", "f2c5a2e"]
    assert not commit_ids_in("a 1234567 byte arena, defaced, 0xdeadbeef12")
    assert not commit_ids_in("```python\nSEED = 'abc1234def'\n```\n")
    assert not dates_in("```sh\n$TMPDIR/2026-12-04-host\n```\n")
    assert slug("Counters: `stats()`") == "counters-stats"
    assert slug("A loader's whole life at 268 MB batches") == (
        "a-loaders-whole-life-at-268-mb-batches"
    )


def test_performance_is_short() -> None:
    lines = PERFORMANCE.read_text().splitlines()
    assert len(lines) <= MAX_PERFORMANCE_LINES, (
        f"docs/performance.md has {len(lines)} lines; at most {MAX_PERFORMANCE_LINES}: one "
        "section per claim, the history in git"
    )


def glossary_words(text: str) -> list[str]:
    """The words of the first column of the table under ``## Words`` in ``text``, each of a
    row's comma-separated spellings ("pin, pinned") on its own, lower-cased."""
    section = text.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]  # (no header)
    return [w.strip().lower() for row in rows for w in row.split("|")[1].split(",")]


def test_the_glossary_lists_each_word_once() -> None:
    words = glossary_words((ROOT / "docs" / "design.md").read_text())
    assert {"arena", "slot", "pin", "pinned", "hand back"} <= set(words), words  # (it is read)
    twice = sorted({w for w in words if words.count(w) > 1})
    assert not twice, f"docs/design.md's Words list these more than once: {twice}"
    # (and the check sees a word given twice)
    assert glossary_words("x\n## Words\n| w | m |\n| - | - |\n| a, b | 1 |\n| b | 2 |\n") == [
        "a",
        "b",
        "b",
    ]


def test_readme_limits_are_a_short_list() -> None:
    limits = section(README.read_text(), "Limits")
    assert limits, "README.md has no Limits section"
    assert len(limits) <= MAX_LIMITS_LINES, (
        f"README's Limits section has {len(limits)} lines; at most {MAX_LIMITS_LINES}, one a limit"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert not broken_links(doc), "\n".join(broken_links(doc))
