"""The main job end to end: `rfmem eval personabench` on the real data."""
from __future__ import annotations

import json

import pytest
from _shared import shared_dir

from rfmem_fast.cli import main


def test_eval_personabench_writes_golden_keys(tmp_path, capsys, golden_rows, pb_cache_dir):
    data = shared_dir() / "data" / "personabench" / "eval_data_v1"
    out, figs = tmp_path / "pb.jsonl", tmp_path / "pb.json"
    rc = main(["eval", "personabench", "--data", str(data), "--no-latency", "--out", str(out), "--json", str(figs),
               "--cache-dir", str(pb_cache_dir)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "Overall" in text and "RF-Mem routes" in text and "Preference_hard" in text
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 263
    assert set(records[0]) == set(golden_rows[0])
    by_key = {(g["community"], g["q_id"]): g for g in golden_rows}
    same = sum(r["rfmem_ids"] == by_key[(r["community"], r["q_id"])]["rfmem_ids"] for r in records)
    assert same >= 0.95 * 263
    doc = json.loads(figs.read_text())
    assert abs(doc["modes"]["dense"]["metrics"]["Overall"]["recall"] - 0.5385) <= 0.005
    assert doc["machine"]["cores"] >= 1 and "command" in doc


def test_eval_bad_arguments(tmp_path, capsys):
    assert main(["eval", "personabench", "--data", str(tmp_path), "--no-latency"]) == 2
    assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "personabench", "--data", str(tmp_path), "--modes", "fast"])
    with pytest.raises(SystemExit):
        main(["eval", "personabench", "--data", str(tmp_path), "--set", "alpha=7"])
