"""The README's Python examples run as written (so the documentation cannot rot)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    serving = re.search(r"^## Serving\n.*?(?=^## )", text, re.S | re.M)  # run by test_readme_serving.py
    if serving:
        text = text[: serving.start()] + text[serving.end() :]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), scope)
    res, bank = scope["res"], scope["bank"]
    assert res.ids.shape == (2, 10) and set(res.route_names) <= {"familiarity", "recollection"}
    assert all(str(x).startswith("a") for x in res.ids_list(0))  # alice's items only
    assert "a2" not in bank.item_ids_of("alice") and bank.num_items == 79
    assert np.isfinite(res.scores[0]).all()
    assert res.texts_list(1) == ["..."] * len(res.ids_list(1)) and all(t is None for t in res.texts[0])
    documented = re.search(r'repr\(bank\)  # "(.*?)"', README.read_text(encoding="utf-8")).group(1)
    assert repr(bank) == documented
