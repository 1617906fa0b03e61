"""The documentation's Python examples run as written (so the documentation cannot rot).

Every ```python block of README.md and of every page under docs/ runs, one scope per
page (conventions: ``tests/_doc_blocks.py``); pages whose examples rely on particular
results are checked further below (``CHECKS``).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from _doc_blocks import DOCS, README, ROOT, Page, expected_prints, pages_with_examples

PAGES = pages_with_examples()


def _check_readme(scope: dict, page: Page) -> None:
    res, hits = scope["res"], scope["hits"]
    assert res.ids.shape == (2, 10) and set(res.route_names) <= {"familiarity", "recollection"}
    assert all(str(x).startswith("a") for x in res.ids_list(0))  # alice's items only
    assert hits and hits[0].text == "I moved to Lyon in 2021."


def _check_memory_banks(scope: dict, page: Page) -> None:
    res, bank = scope["res"], scope["bank"]
    assert res.ids.shape == (2, 10) and set(res.route_names) <= {"familiarity", "recollection"}
    assert all(str(x).startswith("a") for x in res.ids_list(0))  # alice's items only
    assert "a2" not in bank.item_ids_of("alice") and bank.num_items == 79
    assert np.isfinite(res.scores[0]).all()
    assert res.texts_list(1) == ["..."] * len(res.ids_list(1)) and all(t is None for t in res.texts[0])
    documented = re.search(r'repr\(bank\)  # "(.*?)"', page.text).group(1)
    assert repr(bank) == documented


def _check_serving(scope: dict, page: Page) -> None:
    assert scope["stats"]["requests"] == 3 and scope["stats"]["batches"] <= 3
    assert (page.cwd / "memdir" / "memory.json").is_file()


def _check_gpu(scope: dict, page: Page) -> None:
    tres = scope["tres"]
    assert tres.to_result().ids.shape == (2, 10)


CHECKS = {
    "README.md": _check_readme,
    "docs/guides/memory-banks.md": _check_memory_banks,
    "docs/guides/serving.md": _check_serving,
    "docs/guides/gpu.md": _check_gpu,
}


def test_the_examples_are_collected():
    """The pages that hold examples today are found (a broken fence regex would skip them all)."""
    names = {p.name for p in PAGES}
    assert set(CHECKS) <= names, sorted(names)
    assert {"docs/guides/frameworks.md", "docs/guides/calibration.md"} <= names
    assert all(p.path == README or p.path.is_relative_to(DOCS) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_doc_python_blocks_run(page: Page, tmp_path, monkeypatch, capsys, request):
    for module in page.requires:
        pytest.importorskip(module)
    if page.encoder:
        import rfmem_fast.serving.memory as memory_module

        text_encoder = request.getfixturevalue("text_encoder")  # loaded once per session
        monkeypatch.setattr(memory_module, "_default_encoder", lambda: text_encoder)
    monkeypatch.chdir(tmp_path)
    page.cwd = tmp_path
    code = "\n".join(page.blocks)
    scope: dict = {"__name__": "__docs__"}
    exec(compile(code, str(page.path), "exec"), scope)
    if page.prints:
        expected = expected_prints(code)
        assert expected, f"{page.name} is marked 'prints' but has no print(...)  # output line"
        printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
        assert printed == expected
    check = CHECKS.get(page.path.relative_to(ROOT).as_posix())
    if check is not None:
        check(scope, page)
