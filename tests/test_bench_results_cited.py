"""The committed benchmark results and their citations agree.

Every file in ``bench/results/`` (new runs go to the git-ignored ``bench/results/local/``)
is named by the docs, README, CHANGELOG, tests, bench scripts or code: by its exact name,
by a brace pattern (``contention-vs-51f1a6b-amd-epyc-zen4-{before,after}-{1,2,3}.json``)
or a glob (``single-query-vs-062c7db-amd-epyc-busy-*.json``); a PNG counts as cited when
the JSON it plots is. And every ``bench/results/NAME`` written out in those files exists
(placeholders such as ``<time>`` or ``personabench-B.json`` aside).
"""
from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TOKEN = re.compile(r"(bench/results/)?([A-Za-z0-9_.{},*<>-]+\.(?:json|png))")
PLACEHOLDER = re.compile(r"[<>]|(?:^|-)[A-Z](?:-|\.)")


def _sources() -> list[Path]:
    """The files that may cite a result: docs, README, CHANGELOG, tests, bench scripts, code."""
    out = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    out += sorted((ROOT / "docs").rglob("*.md"))
    out += sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    out += sorted((ROOT / "rfmem_fast").rglob("*.py"))
    out += [p for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in {".cpp", ".h", ".inc", ".cu", ".cuh"}]
    return [p for p in out if p.is_file() and p.resolve() != Path(__file__).resolve()]


def _expand(name: str) -> list[str]:
    """Brace expansion: ``a-{x,y}-{1,2}.json`` -> the four names (no nesting)."""
    parts = re.split(r"(\{[^{}]*\})", name)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _citations() -> tuple[set[str], dict[str, str]]:
    """(every cited name or bench/results/ glob, brace-expanded; {bench/results/NAME: the file citing it})."""
    names: set[str] = set()
    explicit: dict[str, str] = {}
    for src in _sources():
        for prefix, raw in TOKEN.findall(src.read_text(encoding="utf-8", errors="replace")):
            if raw.startswith((".", "-")) or PLACEHOLDER.search(raw):
                continue
            for name in _expand(raw):
                if "*" in name and not prefix:
                    continue  # a glob cites results only when written as bench/results/GLOB
                names.add(name)
                if prefix:
                    explicit.setdefault(name, str(src.relative_to(ROOT)))
    return names, explicit


def _committed() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


def _cited(name: str, names: set[str]) -> bool:
    return name in names or any("*" in n and fnmatch.fnmatchcase(name, n) for n in names)


def test_every_committed_result_is_cited():
    names, _ = _citations()
    files = _committed()
    assert files, RESULTS
    uncited = [f for f in files
               if not _cited(f, names) and not (f.endswith(".png") and _cited(f[:-4] + ".json", names))]
    assert uncited == [], f"results no doc, test or script names (cite them or git rm them): {uncited}"


def test_every_cited_result_is_committed():
    _, explicit = _citations()
    files = _committed()
    missing = {name: src for name, src in explicit.items()
               if not any(fnmatch.fnmatchcase(f, name) for f in files)}
    assert missing == {}, f"cited but not in bench/results/: {missing}"


def test_brace_expansion():
    assert _expand("a-{x,y}-{1,2}.json") == ["a-x-1.json", "a-x-2.json", "a-y-1.json", "a-y-2.json"]
    assert _expand("plain.json") == ["plain.json"]
