"""Smoke tests of the benchmark suite (rfmem_fast.bench, bench/): tiny sizes, so it cannot rot.

* ``rfmem bench --quick`` with explicit tiny size flags writes a JSON report with the
  machine, versions, command, every workload's figures and the headline ratios, plus
  the PNG plots;
* its hybrid rows (``RFMemConfig.recommended()`` over seeded synthetic texts) exist, have
  finite figures and ratios to dense, and their rows equal a direct ``search`` call with
  the same config on the same inputs;
* the PersonaBench workload runs on the real data with a stand-in encoder (the MiniLM
  encoding itself is covered by tests/test_encoders.py);
* bench/test_primitives_bench.py runs once with ``--benchmark-disable``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rfmem_fast import available_backends
from rfmem_fast.bench.cli import PRESETS, resolve
from rfmem_fast.bench.runners import Bench, BenchSettings
from rfmem_fast.bench.workloads import chunks_for_tokens, format_tokens, parse_size, parse_size_list
from rfmem_fast.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--scales", "8K", "--shared-sizes", "2000", "--batch-sizes", "1,8", "--users", "5", "--items", "64",
    "--mt-batch", "16", "--latency-queries", "4", "--min-queries", "4", "--reference-queries", "2",
    "--reference-budget", "0.5", "--warmup", "1", "--personabench", "none", "--no-progress",
]  # fmt: skip


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_sizes_parse():
    assert parse_size("32K", binary=True) == 32 * 1024
    assert chunks_for_tokens(parse_size("1M", binary=True), 256) == 4096
    assert chunks_for_tokens(parse_size("128K", binary=True), 256) == 512
    assert parse_size("1e5", binary=False) == 100_000 and parse_size("1M", binary=False) == 10**6
    assert parse_size_list("32K, 128K,32K", binary=True) == [32768, 131072]
    assert format_tokens(1024 * 1024) == "1M"
    with pytest.raises(ValueError):
        parse_size("-3", binary=False)


def test_presets_resolve():
    p = build_parser()
    st, resolved, _ = resolve(p.parse_args(["bench", "--smoke"]))
    assert resolved["preset"] == "smoke" and st.users == PRESETS["smoke"]["users"] and st.personabench is None
    st, _, _ = resolve(p.parse_args(["bench", "--quick", "--users", "7"]))
    assert st.users == 7 and st.items == PRESETS["quick"]["items"]  # explicit flags override the preset
    st, _, _ = resolve(p.parse_args(["bench"]))
    assert st.scales == [32768, 131072, 1048576] and st.batch_sizes == [1, 64, 1024] and (st.users, st.items) == (1000, 4096)
    assert st.thread_counts == [1, 2]
    st, _, _ = resolve(p.parse_args(["bench", "--quick", "--threads", "1"]))
    assert st.thread_counts == [1]  # --threads alone: no cell at another count
    st, _, _ = resolve(p.parse_args(["bench", "--quick", "--threads", "1", "--thread-counts", "1,2"]))
    assert st.thread_counts == [1, 2]


def test_multitenant_scan_bytes_of_each_dtype(tmp_path, capsys):
    """The multi-tenant cells' scan copy and scan rate count the bytes each bank holds:
    ``BankSnapshot.scan_nbytes`` (int8: a byte per value and the rows' scales)."""
    from rfmem_fast import MemoryBank

    if "native" not in available_backends():
        pytest.skip("the native backend is not built")
    out = tmp_path / "mt.json"
    argv = ["bench", "--workloads", "multitenant", "--dtypes", "float32,int8", "--thread-counts", "1",
            "--backends", "native", "--no-reference", "--no-faiss", "--no-plots", *TINY, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    mt = json.loads(out.read_text())["workloads"]["multitenant"]
    users, items = mt["users"], mt["items"]
    d = json.loads(out.read_text())["settings"]["synthetic"]["dim"]
    bank = MemoryBank(d, dtype="int8")
    bank.add("u", np.random.default_rng(0).normal(size=(items, d)), ids=[str(i) for i in range(items)])
    per_user = {"float32": items * d * 4, "int8": bank.snapshot().scan_nbytes}
    assert per_user["int8"] < items * d * 2  # (a quarter of float32's, and the scales)
    assert mt["scan_mib"] == {dt: v * users / 2**20 for dt, v in per_user.items()}
    dense = [r for r in mt["results"] if r["kind"] == "ours" and r["mode"] == "dense"]
    assert {r["dtype"] for r in dense} == {"float32", "int8"}
    for r in dense:
        assert r["scan_gb_per_s"] == pytest.approx(r["qps"] * per_user[r["dtype"]] / 1e9, rel=1e-12)


def test_bad_flags_exit_2(capsys):
    assert main(["bench", "--backends", "nope", "--no-progress"]) == 2
    assert "not available" in capsys.readouterr().err
    assert main(["bench", "--scales", "abc", "--no-progress"]) == 2


def test_bench_cli_quick_tiny(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--quick", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Latency" in printed and "Ratios" in printed
    doc = json.loads(out.read_text())
    for key in ("machine", "versions", "command", "settings", "config", "workloads", "ratios"):
        assert key in doc
    assert doc["machine"]["cpu"] and doc["machine"]["cores"] >= 1
    for lib in ("torch", "numpy", "faiss", "rfmem_fast"):
        assert doc["versions"][lib]
    ours = doc["settings"]["backends"]
    assert ours and "reference" not in ours
    w = doc["workloads"]
    # latency: every (system, mode) with p50 / p99
    recs = w["latency"]["scales"][0]["results"]
    assert w["latency"]["scales"][0]["chunks"] == 32
    systems = {(r["system"], r["mode"]) for r in recs}
    for b in ours + ["reference"]:
        for m in ("dense", "recollection", "rfmem"):
            assert (b, m) in systems
    assert ("faiss", "dense") in systems
    assert all(_finite(r["p50_ms"]) and r["p99_ms"] >= r["p50_ms"] for r in recs)
    assert all(r["sampled"] for r in recs if r["kind"] == "reference")
    # batch + multitenant: qps per system and batch size
    bat = w["batch"]["sizes"][0]["results"]
    assert {r["batch_size"] for r in bat if r["kind"] != "reference"} == {1, 8}
    assert all(_finite(r["qps"]) and r["qps"] > 0 for r in bat)
    mt = w["multitenant"]["results"]
    assert all(_finite(r["qps"]) for r in mt)
    # results agree with the reference on the queries it ran (ids are exact on every backend)
    assert all(r["agree_reference"] == 1.0 for r in mt if r["kind"] == "ours" and r.get("agree_reference") is not None)
    # route splits and ratios
    assert 0.0 <= w["multitenant"]["route_split"]["familiarity_fraction"] <= 1.0
    rt = doc["ratios"]
    for name in ("rfmem_p50_over_dense_p50", "rfmem_qps_over_faiss_dense_qps", "rfmem_speedup_vs_reference"):
        assert _finite(rt[name]["value"]), name
    assert rt["rfmem_p50_over_dense_p50"]["paper"] == 1.42
    assert rt["rfmem_qps_over_faiss_dense_qps"]["batch_size"] == 8
    # dtype and thread-count variants side by side, the targets' ratios
    assert doc["settings"]["dtypes"] == ["float32", "float16"] and doc["settings"]["thread_counts"] == [1, 2]
    variants = {(r["system"], r["dtype"], r["threads"]) for r in mt if r["kind"] == "ours"}
    assert variants == {(b, dt, t) for b in ours for dt in ("float32", "float16") for t in (1, 2)}
    assert {r["threads"] for r in bat if r["kind"] == "faiss"} == {1, 2}
    assert all(r["agree_reference"] == 1.0 for r in mt if r["dtype"] == "float16" and r.get("agree_reference") is not None)
    # each dtype's scan copy as its bank holds it (float16: 2 bytes a value), and the dense
    # cells' scan rate from it
    mib = w["multitenant"]["scan_mib"]
    n_values = w["multitenant"]["users"] * w["multitenant"]["items"] * doc["settings"]["synthetic"]["dim"]
    assert mib == {"float32": n_values * 4 / 2**20, "float16": n_values * 2 / 2**20}
    for r in mt:
        if r["kind"] == "ours" and r["mode"] == "dense":
            want = r["qps"] * mib[r["dtype"]] * 2**20 / w["multitenant"]["users"] / 1e9
            assert r["scan_gb_per_s"] == pytest.approx(want, rel=1e-12)
    for name, goal in (("shared_dense_qps_over_faiss_dense_qps", ">= 1"), ("multitenant_float16_dense_qps_over_float32", ">= 1.6"),
                       ("multitenant_float16_rfmem_qps_over_float32", ">= 1.4")):  # fmt: skip
        assert _finite(rt[name]["value"]) and rt[name]["goal"] == goal and rt[name]["threads"] == 2, name
    assert set(rt["shared_dense_qps_over_faiss_dense_qps"]["per_threads"]) == {"1", "2"}  # JSON object keys
    assert rt["rfmem_qps_over_faiss_dense_qps"]["goal"] == ">= 0.3"
    assert all(_finite(v) for per in rt["thread_scaling"]["qps_ratio"].values() for v in per.values())
    assert _finite(rt["rfmem_speedup_vs_reference"]["single_query"]["value"])
    assert rt["route_split"]["familiarity_fraction"]
    assert w["personabench"].get("skipped")
    from rfmem_fast.bench.report import build_tables, format_markdown

    md = format_markdown(build_tables(doc))
    assert "| system | mode |" in md and "reference (per-query loop)" in md
    assert "recommended() (dense + BM25)" in md and "hybrid p50 / dense p50" in md and "hybrid qps / dense qps" in md
    for suffix in ("-latency.png", "-throughput.png"):
        png = tmp_path / f"b{suffix}"
        assert png.is_file() and png.stat().st_size > 1000
    _check_hybrid(doc)


def _check_hybrid(doc):
    """The hybrid rows of a TINY --quick report: present, finite, and equal to a direct search."""
    from rfmem_fast import RFMemConfig, search

    w, rt = doc["workloads"], doc["ratios"]
    head = doc["settings"]["hybrid"]["backend"]
    assert head == ("native" if "native" in doc["settings"]["backends"] else doc["settings"]["backends"][0])
    lat = w["latency"]["scales"][0]
    hl = [r for r in lat["results"] if r["kind"] == "hybrid"]
    assert len(hl) == 1 and hl[0]["mode"] == "hybrid" and hl[0]["system"] == head and hl[0]["n_queries"] == 4
    assert all(_finite(hl[0][k]) for k in ("p50_ms", "p99_ms", "dense_p50_ms", "p50_over_dense_p50"))
    assert lat["text_tokens"] > 0 and w["latency"]["texts"]["words"] == 60
    hm = [r for r in w["multitenant"]["results"] if r["kind"] == "hybrid"]
    assert {r["threads"] for r in hm} == {1, 2} and all(r["dtype"] == "float32" for r in hm)
    for r in hm:
        assert all(_finite(r[k]) and r[k] > 0 for k in ("qps", "dense_qps", "qps_over_dense_qps"))
        assert r["differs_from_dense"] > 0  # the lexical channel changes some top-k
    h = rt["hybrid_p50_over_dense_p50"]
    assert _finite(h["value"]) and h["value"] == hl[0]["p50_over_dense_p50"] and h["goal"] == "<= 1.3"
    q = rt["hybrid_qps_over_dense_qps"]
    assert _finite(q["value"]) and q["threads"] == 2 and q["goal"] == ">= 0.6" and set(q["per_threads"]) == {"1", "2"}

    # the same inputs, rebuilt from the same settings: a direct search with the same config gives the same rows
    st, _, _ = resolve(build_parser().parse_args(["bench", "--quick", *TINY]))
    bench = Bench(st, progress=False)
    cfg = RFMemConfig.recommended(second_stage=None)  # (the bench's hybrid rows: the first stage)
    inp = bench.latency_inputs(0, lat["tokens"])
    tb, n0 = inp["texts"].bank, inp["n_warm"]
    snap = tb.snapshot()
    assert hl[0]["check_rows"]
    for i, rows in hl[0]["check_rows"].items():
        j = n0 + int(i)
        res = search(tb, inp["Q"][j : j + 1], [tb.users[int(inp["qseg"][j])]], cfg, backend=head,
                     query_texts=inp["texts"].queries[j : j + 1])  # fmt: skip
        assert res.rows[0].tolist() == rows
        assert list(res.ids[0]) == [snap.item_ids[r] for r in rows if r >= 0]
    inp = bench.multitenant_inputs()
    tb, n0, bs = inp["texts"].bank, inp["n_warm"], w["multitenant"]["batch_size"]
    users = [tb.users[int(u)] for u in inp["qseg"][n0 : n0 + bs]]
    res = search(tb, inp["Q"][n0 : n0 + bs], users, cfg, backend=head, query_texts=inp["texts"].queries[n0 : n0 + bs])
    dense = search(inp["sb"].bank, inp["Q"][n0 : n0 + bs], users, RFMemConfig(), mode="dense", backend=head)
    for r in hm:
        assert r["check_rows"]
        for i, rows in r["check_rows"].items():
            assert res.rows[int(i)].tolist() == rows
    sample = [int(i) for i in hm[-1]["check_rows"]]
    assert np.mean([res.rows[i].tolist() != dense.rows[i].tolist() for i in sample]) == hm[-1]["differs_from_dense"]


class _HashEncoder:
    """Stand-in encoder: a seeded unit vector per distinct text (deterministic, instant)."""

    model_name = "hash-encoder-test"

    def encode(self, texts):
        out = np.empty((len(texts), 384), dtype=np.float32)
        for i, t in enumerate(texts):
            rng = np.random.default_rng(abs(hash(t)) % (2**32))
            v = rng.standard_normal(384).astype(np.float32)
            out[i] = v / np.linalg.norm(v)
        return out


def test_personabench_workload_fake_encoder():
    from rfmem_fast.bench.workloads import default_personabench_dir

    pb = default_personabench_dir()
    if pb is None:
        pytest.skip("PersonaBench data absent")
    st = BenchSettings(
        backends=["torch"], workloads=["personabench"], modes=["dense", "rfmem"], personabench=pb,
        pb_users_per_community=1, reference_queries=2, reference_budget_s=0.5, warmup=1, cache_dir=None,
        encoder=_HashEncoder(),
    )  # fmt: skip
    out = Bench(st, progress=False).run()["personabench"]
    assert out["users"] == 2 and out["questions"] > 10 and not out["embeddings_cached"]
    got = {(r["system"], r["mode"]) for r in out["results"]}
    assert {("torch", "dense"), ("torch", "rfmem"), ("faiss", "dense"), ("reference", "rfmem")} <= got
    assert all(_finite(r["p50_ms"]) for r in out["results"])
    assert {(r["system"], r["mode"]) for r in out["batch"]} == {("torch", "dense"), ("torch", "rfmem"), ("torch", "hybrid")}
    assert out["route_split"]["queries"] == out["questions"]
    # the hybrid rows: recommended() over the real chunk and question texts
    hy = [r for r in out["results"] if r["kind"] == "hybrid"]
    assert len(hy) == 1 and _finite(hy[0]["p50_ms"]) and _finite(hy[0]["p50_over_dense_p50"])
    hb = [r for r in out["batch"] if r["kind"] == "hybrid"]
    assert len(hb) == 1 and _finite(hb[0]["qps_over_dense_qps"])


def test_primitives_bench_suite_runs_once():
    env = dict(os.environ, RFMEM_BENCH_SMOKE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", str(ROOT / "bench" / "test_primitives_bench.py"),
         "--benchmark-disable", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_memory_guard_skips_materialising_cells():
    from rfmem_fast.bench.systems import OursSystem

    b = Bench(BenchSettings(backends=["torch"], faiss=False, reference=False), progress=False)
    assert "score matrix" in b._too_big(OursSystem("torch"), "rfmem", 1024, 10**9)
    assert b._too_big(OursSystem("torch"), "dense", 1, 1000) is None


def test_bench_gemm_script_tiny(tmp_path):
    """bench/bench_gemm.py at tiny sizes: every part writes its figures; the crossover
    cells record the cost rule's choice; the half-precision scans are timed."""
    pytest.importorskip("rfmem_fast._native")
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gemm", ROOT / "bench" / "bench_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "g.json"
    args = ["--rows", "600", "--queries", "16", "--users", "4", "--items", "200", "--crossover-rows", "3000",
            "--dim", "32", "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert mod.main(args) == 0
    doc = json.loads(out.read_text())
    levels = list(range(doc["simd_level_supported"], -1, -1))
    assert {(r["level"], r["path"], r["scan_type"]) for r in doc["rates"] if r["level"] is not None} == {
        (lv, p, st) for lv in levels for p in ("scan", "gemm") for st in ("float32", "float16")
    }
    assert all(_finite(r["gmac_per_s"]) and r["gmac_per_s"] > 0 for r in doc["rates"])
    from rfmem_fast import _native

    for r in doc["crossover"]:
        assert r["rule_takes_gemm"] == _native.gemm_pays(r["queries_per_segment"], r["seg_rows"], 32, r["level"])
    assert {r["scan_type"] for r in doc["bandwidth"]} == {"float32", "float16", "bfloat16"}
    assert all(_finite(r["speedup_over_float32"]) for r in doc["bandwidth"])
    out8 = tmp_path / "g8.json"  # the int8 copy's crossover: its own rule
    assert mod.main(["--parts", "crossover", "--scan-type", "int8", "--crossover-rows", "3000", "--dim", "32",
                     "--repeats", "1", "--out", str(out8)]) == 0  # fmt: skip
    cells = json.loads(out8.read_text())["crossover"]
    assert cells and {r["scan_type"] for r in cells} == {"int8"} and all(_finite(r["gemm_speedup"]) for r in cells)
    for r in cells:
        nq, rows = r["queries_per_segment"], r["seg_rows"]
        want = nq >= 24 and rows >= 128 if r["level"] >= 1 else _native.gemm_pays(nq, rows, 32, 0)
        assert r["rule_takes_gemm"] == want, r
    assert _native.int8_min_rows() == 0  # restored to the suite's setting
    outx = tmp_path / "gx.json"  # the exact re-scoring per row, every level
    assert mod.main(["--parts", "exact", "--items", "300", "--exact-queries", "4", "--dim", "32", "--repeats", "1",
                     "--out", str(outx)]) == 0  # fmt: skip
    ex = json.loads(outx.read_text())["exact"]
    assert [r["level"] for r in ex] == levels
    assert all(_finite(r["exact_ns_per_row"]) and r["exact_ns_per_row"] >= 0 and r["seconds_all"] > 0 for r in ex)
    assert _native.simd_level() == doc["simd_level_supported"]  # the cap lifted again


def test_to_markdown_renders_a_report_of_an_older_version():
    """bench/to_markdown.py renders a committed report written before the per-thread
    ratios existed (by the engine before the GEMM path and half-precision banks)."""
    name = "bench-scan-path-only-intel-xeon-amx.json"
    root = Path(__file__).resolve().parents[1]
    path = root / "bench" / "results" / name
    if not path.is_file():
        pytest.skip(f"{path} is not in this checkout")
    res = subprocess.run([sys.executable, str(root / "bench" / "to_markdown.py"), str(path)], capture_output=True,
                         text=True, timeout=120, cwd=root)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "**Ratios (headline backend: native)**" in res.stdout and "RF-Mem qps / faiss dense qps" in res.stdout
