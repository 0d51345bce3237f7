"""No devices: the docs stay a reference. README.md and BENCHMARKS.md within their lengths;
``bench_results/`` holds the files the docs cite and nothing else (a citation names a file, or
many with ``*`` and ``{a,b}``), and every citation in backticks finds its file."""

from __future__ import annotations

import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench_results"
DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", *(f"docs/{p.name}" for p in
                                                         (ROOT / "docs").glob("*.md"))]  # fmt: skip
CITED = re.compile(r"`([A-Za-z0-9_{},*.\-]+\.(?:json|txt|log|csv|png|py|\*))`")


def _expand(pattern: str) -> list[str]:
    """``a_{x,y}_b.*`` -> ``["a_x_b.*", "a_y_b.*"]`` (nested braces too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [e for alt in m.group(1).split(",")
            for e in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]  # fmt: skip


NAMED = re.compile(r"[A-Za-z0-9_{},*.\-]+\.(?:json|txt|log|csv|png|py|\*)")
CODE = [*(ROOT / "overlap").rglob("*.py"), *(ROOT / "tools").iterdir()]  # (docstrings cite too)


def _citations() -> list[tuple[str, str]]:
    """``(doc, pattern)`` of every backticked result-file name in the docs."""
    return [(doc, p) for doc in DOCS for tok in CITED.findall((ROOT / doc).read_text())
            for p in _expand(tok) if "/" not in p]  # fmt: skip


def _named_in_code() -> list[str]:
    """Every file-name-like token of the package's and the tools' sources."""
    return [p for f in CODE if f.is_file() for tok in NAMED.findall(f.read_text())
            for p in _expand(tok.rpartition("/")[2])]  # fmt: skip


def test_readme_and_benchmarks_keep_their_lengths():
    assert len((ROOT / "README.md").read_text().splitlines()) < 160
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) < 400


def test_bench_results_holds_what_the_docs_cite_and_nothing_else():
    files = sorted(p.name for p in RESULTS.iterdir())
    patterns = [p for _, p in _citations()] + _named_in_code()
    uncited = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not uncited, f"bench_results/ files no doc cites (cite or delete): {uncited}"


def test_every_citation_finds_its_file():
    files = [p.name for p in RESULTS.iterdir()]
    others = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}  # (scripts, tools)
    lost = [(doc, p) for doc, p in _citations() if not p.endswith(".py")  # (files to write too)
            and not any(fnmatch.fnmatch(f, p) for f in files)
            and not any(fnmatch.fnmatch(f, p) for f in others)]  # fmt: skip
    assert not lost, f"cited files that do not exist: {lost}"
