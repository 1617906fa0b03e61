"""The documentation site builds with ``mkdocs build --strict`` (broken links, anchors and
API references fail it), and the README stays a front page.

The build needs the ``docs`` extra (mkdocs, mkdocs-material, mkdocstrings-python), which
``[test]`` includes, so CI runs it; without mkdocs installed the build test is skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from _doc_blocks import DOCS, README, ROOT, doc_files


def _missing_docs_packages() -> list[str]:
    """The docs extra's packages that are not importable (by their module names)."""
    wanted = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings_handlers": "mkdocstrings-python"}
    return [pkg for module, pkg in wanted.items() if importlib.util.find_spec(module) is None]


def test_mkdocs_build_strict(tmp_path):
    missing = _missing_docs_packages()
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)}): pip install '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert (site / "index.html").is_file()
    api = (site / "reference" / "api" / "core" / "index.html").read_text(encoding="utf-8")
    assert "MemoryBank" in api and "RFMemConfig" in api  # mkdocstrings rendered the docstrings


def test_mkdocs_config_is_strict():
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^strict: true$", text, re.M)
    for key in ("not_found", "anchors", "unrecognized_links", "omitted_files"):
        assert re.search(rf"^\s+{key}: warn$", text, re.M), key  # a warning fails a strict build


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        assert page.relative_to(DOCS).as_posix() in nav, page


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for link in re.findall(r"\]\(((?:docs/)[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_docs_point_nowhere_outside_the_repository():
    """No page sends readers to files that are not in the repository (the spec, DESIGN.md)."""
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        assert "RFMEM_SPEC" not in text and "DESIGN.md" not in text, path
        assert not re.search(r"\]\([^)]*\.\./shared", text), path


def test_cli_reference_lists_every_command():
    from rfmem_fast.cli import build_parser

    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")

    def walk(parser: argparse.ArgumentParser, prefix: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield f"{prefix} {name}"
                    yield from walk(sub, f"{prefix} {name}")

    commands = list(walk(build_parser(), "rfmem"))
    assert len(commands) >= 10
    for command in commands:
        assert f"`{command}" in page, command


def test_configuration_reference_lists_every_field():
    from rfmem_fast import RFMemConfig

    page = (DOCS / "reference" / "configuration.md").read_text(encoding="utf-8")
    for f in dataclasses.fields(RFMemConfig):
        assert re.search(rf"^\| `{f.name}` \|", page, re.M), f.name


def test_license_changelog_citation():
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert (ROOT / "CHANGELOG.md").is_file()
    cff = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    assert "cff-version" in cff and "Recollection-Familiarity" in cff and "rfmem_fast" in cff
    assert "Apache-2.0" in cff
