"""``bench/gpu_check.py --dry-run``: the one-command GPU check runs its
whole code path on the CPU (device cpu, Triton under TRITON_INTERPRET=1, tiny sizes,
absent comparators skipped, the CUDA build skipped with a note), so that it cannot rot
between the rare runs on a lent GPU. About 20 s."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _shared import shared_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RFMEM_PB_PACK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gpu_check_dry_run_runs_every_stage(tmp_path):
    from conftest import EARLY_DIRS, early_result

    early = early_result("gpu_dry_run")  # started by conftest right after collection (second core)
    if early is not None:
        rc, text = early
        tmp_path = Path(EARLY_DIRS["gpu_dry_run"])
    else:
        res = _run(["--dry-run", "--out", str(tmp_path)])
        rc, text = res.returncode, res.stdout[-4000:] + res.stderr[-4000:]
    assert rc == 0, text[-8000:]
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["status"] == "complete" and doc["dry_run"] is True
    assert "--dry-run" in doc["command_line"] and doc["versions"]["torch"]
    st = doc["stages"]
    assert list(st) == ["env", "build", "gpu_tests", "bench_latency", "bench_multitenant", "bench_kmeans",
                        "bench_shared", "cuda_suite", "report"]  # fmt: skip
    assert st["build"]["status"] == "skipped" and "test_cuda_build" in st["build"]["reason"]
    assert all(s["status"] in ("ok", "skipped") for s in st.values()), {k: s.get("error") or s["status"] for k, s in st.items()}
    # the GPU tests were collected and, without CUDA, skipped cleanly
    summary = st["gpu_tests"]["summary"]
    assert summary["tests"] >= 10 and summary["failures"] == 0 and summary["errors"] == 0
    assert summary["skipped"] == summary["tests"]
    # which comparators were found is recorded
    found = doc["comparators_found"]
    assert {"faiss", "faiss_gpu", "cuml", "cuvs"} <= set(found) and found["faiss_gpu"] is False
    w = doc["workloads"]
    # latency: both backends (triton interpreted), every scale, the host syncs of one call
    for sc in w["latency"]["scales"]:
        systems = {(r["system"], r["mode"]) for r in sc["results"] if r.get("p50_ms")}
        assert {("torch", "dense"), ("torch", "rfmem"), ("triton", "dense"), ("triton", "rfmem")} <= systems
        assert all(isinstance(r["host_syncs_per_call"], int) for r in sc["results"] if r["kind"] == "ours")
    banks = w["multitenant"]["banks"]
    assert [b["dtype"] for b in banks] == ["float32", "float16"] * 2
    for b in banks:
        if b["dtype"] == "float32":
            assert any(r["system"] == "torch" and r["mode"] == "rfmem" and r["qps"] > 0 for r in b["results"])
            assert b["route_split"]["queries"] > 0
        else:  # half-precision banks are detected, not assumed
            assert "skipped" in b or b.get("results")
    km = w["kmeans"]["problems"][0]["results"]
    assert {r["system"] for r in km} >= {"torch", "triton", "torch-per-problem"}
    tri = next(r for r in km if r["system"] == "triton")
    assert tri["labels_agree_with_torch"] == 1.0
    sizes = w["shared"]["sizes"]
    assert len(sizes) == 2 and all(any(r.get("qps") for r in s["results"]) for s in sizes)
    # goals: computed from this run's figures
    goals = doc["goals"]
    assert set(goals) == {"rfmem_p50_ms_at_1M_tokens", "multitenant_rfmem_qps_1000x4096", "dense_qps_over_faiss_gpu",
                          "batched_kmeans_over_cuml_per_problem"}  # fmt: skip
    lat = goals["rfmem_p50_ms_at_1M_tokens"]
    last = w["latency"]["scales"][-1]["results"]
    assert lat["value"] == next(r["p50_ms"] for r in last if r["system"] == "torch" and r["mode"] == "rfmem")
    assert goals["batched_kmeans_over_cuml_per_problem"]["value"] is None  # no cuML here: pending, said so
    assert "pending" in goals["batched_kmeans_over_cuml_per_problem"]
    for f in ("gpu-check-latency.png", "gpu-check-throughput.png", "gpu-check.md"):
        assert (tmp_path / f).stat().st_size > 0, f


def test_budget_guard_skips_what_is_left_and_still_writes_json(tmp_path):
    res = _run(["--dry-run", "--out", str(tmp_path), "--budget-s", "0.5", "--stages", "env,bench_latency,bench_shared"])
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    st = doc["stages"]
    assert st["bench_latency"]["status"] == "skipped" and "budget" in st["bench_latency"]["reason"]
    assert st["bench_shared"]["status"] == "skipped" and "build" not in st
    assert st["report"]["status"] == "ok" and doc["status"] == "complete"
    assert re.match(r"^\[\d\d:\d\d:\d\d \+ *\d+\.\ds\] stage env: start", res.stdout)  # timestamped progress


def test_bad_arguments_are_refused(tmp_path):
    res = _run(["--dry-run", "--out", str(tmp_path), "--stages", "env,warp_drive"], timeout=60)
    assert res.returncode == 2 and "warp_drive" in res.stderr
    res = _run([], timeout=60)
    assert res.returncode == 2 and "--out" in res.stderr


class _HashEncoder:
    """Deterministic stand-in for MiniLM (fast): a seeded vector per text."""

    model_name = "hash-encoder"

    def encode(self, texts):
        return np.stack([np.random.default_rng(abs(hash(t)) % 2**32).normal(size=16) for t in texts]).astype(np.float32)


def test_personabench_pack_round_trip(tmp_path):
    shared = shared_dir()
    data = shared / "data" / "personabench" / "eval_data_v1" if shared else None
    golden = shared / "golden" / "personabench_noise0.0.jsonl" if shared else None
    if data is None or not data.is_dir() or not golden.is_file():
        pytest.skip("shared PersonaBench data absent")
    from rfmem_fast.bench.workloads import read_personabench_pack, write_personabench_pack
    from rfmem_fast.datasets import load_personabench

    enc = _HashEncoder()
    path = write_personabench_pack(tmp_path / "pack.npz", data, golden, encoder=enc)
    pack = read_personabench_pack(path)
    ref = load_personabench(data)
    assert pack["questions"] == ref.questions and len(pack["golden"]) == 263
    assert pack["users"] == [q.user_key for q in ref.questions]
    snap = pack["bank"].snapshot()
    assert list(snap.users) == [u.key for u in ref.users]
    assert snap.item_ids.tolist() == [c for u in ref.users for c in u.chunk_ids]
    assert snap.texts.tolist() == [t for u in ref.users for t in u.chunk_texts]
    X = enc.encode([t for u in ref.users for t in u.chunk_texts])
    np.testing.assert_allclose(snap.vectors, X / np.linalg.norm(X, axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_array_equal(pack["queries"], enc.encode([q.question for q in ref.questions]))
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.zeros((1, 2)), Q=np.zeros((1, 2)), meta=np.array(json.dumps({"format": "other"})))
    with pytest.raises(ValueError, match="not a PersonaBench pack"):
        read_personabench_pack(bad)
