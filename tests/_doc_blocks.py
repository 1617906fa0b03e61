"""The documentation's code blocks: README.md and every page under docs/.

Conventions (the same for the README and the site's pages):

* every ```` ```python ```` block of a page runs, in order, in ONE scope per page
  (a page's later blocks continue its earlier ones), in a fresh working directory;
* ```` ```py ```` blocks are shown but not run here: they need a service (a Ray cluster)
  and are run by the test of that feature (``tests/test_distributed_ray.py``);
* ```` ```bash ```` blocks are not run, except the HTTP examples
  (``tests/test_readme_serving.py``) and the set-up commands, which
  ``tests/test_conveniences.py`` compares with ``.ci/run``;
* a page declares what its examples need in one HTML comment (invisible on the site):
  ``<!-- docs-test: encoder, prints, requires=langchain_core llama_index.core -->``:
  ``encoder`` gives ``Memory()`` the session's MiniLM encoder, ``prints`` checks every
  ``print(...)  # expected`` line against what the example printed, ``requires`` skips
  the page when a module is not importable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@dataclass
class Page:
    path: Path
    text: str
    blocks: list[str]
    encoder: bool = False
    prints: bool = False
    requires: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang blocks of a markdown text (fences at any indentation)."""
    return [m.group(2) for m in re.finditer(rf"^( *)```{lang}\n(.*?)^\1```\s*$", text, re.S | re.M)]


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def load(path: Path) -> Page:
    text = path.read_text(encoding="utf-8")
    page = Page(path, text, fenced(text, "python"))
    m = re.search(r"<!--\s*docs-test:(.*?)-->", text, re.S)
    if m:
        for item in (s.strip() for s in m.group(1).split(",")):
            if item == "encoder":
                page.encoder = True
            elif item == "prints":
                page.prints = True
            elif item.startswith("requires="):
                page.requires = item.split("=", 1)[1].split()
            elif item:
                raise ValueError(f"{page.name}: unknown docs-test marker {item!r}")
    return page


def pages_with_examples() -> list[Page]:
    return [p for p in map(load, doc_files()) if p.blocks]


def expected_prints(code: str) -> list[str]:
    """The comment of every ``print(...)  # expected output`` line, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+# (.*)$", code, re.M)]


def all_docs_text() -> str:
    """README.md and every page of the site, concatenated (for claims about the docs)."""
    return "\n".join(p.read_text(encoding="utf-8") for p in doc_files())
