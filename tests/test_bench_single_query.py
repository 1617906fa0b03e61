"""bench/bench_single_query.py at tiny sizes: every cell of every thread
setting is measured, the driver's profile and the pool's counters are recorded, the
ratios to the numpy scan are derived, and --baseline runs the same cells against a
second copy of the package (here: this one) in a subprocess, side by side. No timing is
asserted."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_single_query", ROOT / "bench" / "bench_single_query.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_single_query_tiny(tmp_path):
    pytest.importorskip("rfmem_fast._native")
    mod = _load()
    out = tmp_path / "sq.json"
    args = ["--queries", "6", "--rounds", "1", "--chunks", "600", "--threads", "1,auto", "--out", str(out),
            "--baseline", str(ROOT)]  # fmt: skip
    assert mod.main(args) == 0
    doc = json.loads(out.read_text())
    cells = ["kernel_topk_1", "kernel_topk_4", "probe", "driver", "search_dense", "search_recollection",
             "search_rfmem_recollecting", "search_rfmem_all"]  # fmt: skip
    assert set(doc["cells"]) == {"numpy_scan"} | {f"{t}/{c}" for t in ("1", "auto") for c in cells}
    for name, c in doc["cells"].items():
        assert c["calls"] >= 1 and math.isfinite(c["p50_ms"]) and c["p50_ms"] > 0, name
    for t in ("1", "auto"):
        d = doc["derived"][t]
        assert math.isfinite(d["search_recollection_over_numpy_scan"]) and isinstance(d["goal_le_4x"], bool)
        assert d["goal_recollection_le_2x"] == (d["search_recollection_over_numpy_scan"] <= 2
                                                 and d["search_rfmem_recollecting_over_numpy_scan"] <= 2)
        assert d["goal_dense_le_1_2x"] == (d["dense_over_numpy_scan"] <= 1.2)
        prof = doc["driver_profile_per_query"][t]
        assert prof["total_ms"] > 0 and prof["rounds"] >= 1 and prof["scan_rows"] >= 0
    assert doc["pool_counters"]["helpers"] >= 0
    assert doc["workload"]["chunks"] == 600 and doc["command"].startswith("python")
    assert "machine" in doc and len(doc["load_before"]) == 3
    base = doc["baseline"]
    assert set(base["cells"]) == {"numpy_scan"} | {f"1/{c}" for c in cells}
    assert all(v["calls"] >= 1 for v in base["cells"].values())
    assert math.isfinite(base["derived"]["1"]["search_recollection_over_numpy_scan"])


def test_bench_single_query_rejects_bad_arguments():
    mod = _load()
    with pytest.raises(SystemExit):
        mod.main(["--threads", "3"])
    with pytest.raises(SystemExit):
        mod.main(["--queries", "2"])
