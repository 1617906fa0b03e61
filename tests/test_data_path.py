"""The data-path page (docs/internals/data-path.md) names real code.

Every dotted ``rfmem_fast...`` name on the page (in prose and in the mermaid diagrams)
must resolve: the longest importable module prefix, then attributes. A module split, a
rename or a move that forgets the page fails here. The page must also be in the
documentation's navigation and its diagrams must be mermaid blocks (rendered by
mkdocs-material through pymdownx.superfences).
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "internals" / "data-path.md"
NAME = re.compile(r"rfmem_fast(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module prefix, then attributes.

    Raises:
        ImportError: no prefix is importable. AttributeError: an attribute is missing.
    """
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def page_names() -> list[str]:
    return sorted(set(NAME.findall(PAGE.read_text(encoding="utf-8"))))


def test_the_page_names_enough_of_the_path():
    names = page_names()
    assert len(names) >= 30, names
    for step in ("rfmem_fast.search.search", "rfmem_fast.serving.memory.Memory.add",
                 "rfmem_fast.serving.durability._Durable._commit", "rfmem_fast.store.write_store"):
        assert step in names, step


@pytest.mark.parametrize("dotted", page_names())
def test_every_name_on_the_page_resolves(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"docs/internals/data-path.md names {dotted}, which does not resolve: {exc}")


def test_resolve_fails_on_a_missing_name():
    with pytest.raises(AttributeError):
        resolve("rfmem_fast.search.no_such_function")


def test_the_page_is_in_the_nav_and_its_diagrams_are_mermaid():
    assert "internals/data-path.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    text = PAGE.read_text(encoding="utf-8")
    assert text.count("```mermaid") == 3
    assert "name: mermaid" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
