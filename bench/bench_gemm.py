"""The native top-k kernels per SIMD level and path: what the
cost rule of the GEMM path and the half-precision scan rest on.

Three measurements, each at every SIMD level this CPU runs (``_native.set_simd_cap``:
2 AVX-512, 1 AVX2 + FMA + F16C, 0 baseline), single-threaded, CPU time of the calling
process (``time.process_time``: less sensitive to other processes than wall time on a
shared machine), best of ``--repeats``:

* ``rates``: multiply-adds per second of the scan path and of the GEMM path, float32 and
  float16 scan copies, on one shared segment (``--rows`` x d, ``--queries`` queries) and
  faiss ``IndexFlatIP`` (BLAS) on the same data; the GEMM / scan ratio is the constant
  of the cost rule (csrc/cpu/topk.cpp ``kScanRate`` / ``kGemmRate``);
* ``crossover``: the GEMM path's speed-up over the scan path for ``nq`` queries per
  segment of ``L`` rows (many segments, one group of queries each), the table behind
  the rule's thresholds (``_native.gemm_pays``, printed beside each cell); with
  ``--scan-type int8`` both paths read the int8 scan copy (at every segment size), the
  table behind the int8 copy's own threshold (csrc/cpu/kernels.h ``kI8GemmMinQueries``);
* ``bandwidth``: a multi-tenant batch (``--users`` segments of ``--items`` rows, one
  query per random user, the scan path) on float32, float16 and bfloat16 copies: bytes
  of scan copy read per second, and the half / float32 speed-up;
* ``exact``: the exact re-scoring (``RN32(q . x)``: float64 sums of the exact products
  and their error bound, simd.h ``exact_sums``) per row: ``--exact-queries`` queries on
  one segment of ``--items`` rows with k = every row (each re-scored exactly) less the
  same call with k = 10, in nanoseconds per re-scored row (the candidates' ordering
  included, the same at every level).

The cap applies to the GEMM micro-kernels and the half-precision scans; the float32 scan
path has its own compile-time clones (``target_clones``, csrc/cpu/common.h), so its
"level 0" figure is its AVX2 clone on an AVX2 machine.

The JSON (``bench/results/local/gemm-<timestamp>.json`` or ``--out``) holds the machine, the
versions, the load averages, the exact command and every figure.

Usage::

    python bench/bench_gemm.py [--parts rates,crossover,bandwidth,exact] [--rows 100000]
        [--queries 1024] [--users 400] [--items 4096] [--crossover-rows 200000] [--levels 2,1,0]
        [--scan-type float32|int8] [--exact-queries 64] [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import _native
from rfmem_fast.bench.report import write_json
from rfmem_fast.evaluate import machine_info
from rfmem_fast.precision import int8_scan_copy, to_scan_copy

PARTS = ("rates", "crossover", "bandwidth", "exact")


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Smallest CPU time (s) of ``repeats`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return max(best, 1e-9)


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    X = rng.standard_normal((n, d), dtype=np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X


def _copies(X: np.ndarray) -> dict[str, Any]:
    return {"float32": None, "float16": to_scan_copy(X, "float16").view(np.uint16), "bfloat16": to_scan_copy(X, "bfloat16")}


def _shared_segment(seed: int, n: int, b: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One segment of n unit rows and b unit queries of it: (X, Q, offsets, qseg)."""
    rng = np.random.default_rng(seed)
    X = _unit(rng, n, d)
    Q = _unit(rng, b, d)
    return X, Q, np.array([0, n], dtype=np.int64), np.zeros(b, dtype=np.int64)


def rates(levels: list[int], n: int, b: int, d: int, repeats: int) -> list[dict[str, Any]]:
    """GMAC/s of the scan and GEMM paths per level and scan type on one shared segment; faiss beside."""
    X, Q, off, qs = _shared_segment(0, n, b, d)
    copies = _copies(X)
    out = []
    for lv in levels:
        _native.set_simd_cap(lv)
        for path in ("scan", "gemm"):
            for st in ("float32", "float16"):
                t = _best(lambda: _native.segmented_topk(X, off, Q, qs, 10, 1, 1.0001, copies[st], st, path), repeats)
                out.append({"level": lv, "path": path, "scan_type": st, "seconds": t, "qps": b / t, "gmac_per_s": n * d * b / t / 1e9})
                print(f"rates  level {lv} {path:4s} {st:8s} {out[-1]['gmac_per_s']:7.1f} GMAC/s  {out[-1]['qps']:8.0f} q/s", file=sys.stderr)
    _native.set_simd_cap(-1)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
        index = faiss.IndexFlatIP(d)
        index.add(X)
        t = _best(lambda: index.search(Q, 10), repeats)
        out.append({"level": None, "path": "faiss IndexFlatIP", "scan_type": "float32", "seconds": t, "qps": b / t, "gmac_per_s": n * d * b / t / 1e9})
        print(f"rates  faiss IndexFlatIP       {out[-1]['gmac_per_s']:7.1f} GMAC/s  {out[-1]['qps']:8.0f} q/s", file=sys.stderr)
    except ImportError:
        pass
    return out


def _rule(nq: int, seg_rows: int, d: int, level: int, scan_type: str) -> bool:
    """Whether the engine takes the GEMM path: ``_native.gemm_pays`` (float32 rows), or the
    int8 copy's own rule at levels with an int8 GEMM kernel (``INT8_GEMM_MIN_QUERIES``)."""
    if scan_type == "int8" and level >= 1:
        return nq >= _native.INT8_GEMM_MIN_QUERIES and seg_rows >= 128
    return bool(_native.gemm_pays(nq, seg_rows, d, level))


def crossover(levels: list[int], d: int, repeats: int, total_rows: int = 200_000,
              scan_type: str = "float32") -> list[dict[str, Any]]:  # fmt: skip
    """GEMM / scan speed-up per (queries per segment, segment rows) and the rule's choice;
    ``scan_type`` "int8": both paths over the int8 copy (read at every segment size here,
    ``_native.set_int8_min_rows(0)``; the rule is the int8 copy's, ``_rule``)."""
    rng = np.random.default_rng(1)
    out = []
    prev = _native.int8_min_rows()
    if scan_type == "int8":
        _native.set_int8_min_rows(0)
    try:
        for lv in levels:
            _native.set_simd_cap(lv)
            for L in (32, 64, 128, 512, 4096):
                U = max(1, total_rows // L // 8)
                X = _unit(rng, U * L, d)
                off = np.arange(U + 1, dtype=np.int64) * L
                kw: dict[str, Any] = {}
                if scan_type == "int8":
                    codes, meta = int8_scan_copy(X)
                    kw = {"scan": codes, "scan_meta": meta, "scan_type": "int8"}
                for nq in (2, 4, 8, 12, 16, 24, 32, 48):
                    Q = _unit(rng, U * nq, d)
                    qs = np.repeat(np.arange(U), nq).astype(np.int64)
                    ts = _best(lambda: _native.segmented_topk(X, off, Q, qs, 10, 1, 1.0001, path="scan", **kw), repeats)
                    tg = _best(lambda: _native.segmented_topk(X, off, Q, qs, 10, 1, 1.0001, path="gemm", **kw), repeats)
                    out.append({"level": lv, "scan_type": scan_type, "seg_rows": L, "queries_per_segment": nq,
                                "segments": U, "gemm_speedup": ts / tg, "rule_takes_gemm": _rule(nq, L, d, lv, scan_type)})  # fmt: skip
                row = " ".join(f"{r['queries_per_segment']}:{r['gemm_speedup']:.2f}{'*' if r['rule_takes_gemm'] else ''}"
                               for r in out if r["level"] == lv and r["seg_rows"] == L)  # fmt: skip
                print(f"crossover {scan_type} level {lv} L={L:5d}: {row}   (* = the rule takes GEMM)", file=sys.stderr)
    finally:
        _native.set_simd_cap(-1)
        _native.set_int8_min_rows(prev)
    return out


def bandwidth(levels: list[int], users: int, items: int, d: int, b: int, repeats: int) -> list[dict[str, Any]]:
    """Multi-tenant scan (one query per random user): bytes of scan copy per second per type."""
    rng = np.random.default_rng(2)
    X = _unit(rng, users * items, d)
    off = np.arange(users + 1, dtype=np.int64) * items
    copies = _copies(X)
    qs = rng.integers(0, users, b).astype(np.int64)
    Q = _unit(rng, b, d)
    out = []
    for lv in levels:
        _native.set_simd_cap(lv)
        best: dict[str, float] = {}
        for _ in range(repeats):  # interleaved, so that a change of load hits every type alike
            for st in ("float32", "float16", "bfloat16"):
                t0 = time.process_time()
                _native.segmented_topk(X, off, Q, qs, 10, 1, 1.0001, copies[st], st, "scan")
                best[st] = min(best.get(st, float("inf")), time.process_time() - t0)
        for st, t in best.items():
            nbytes = b * items * d * (4 if st == "float32" else 2)
            out.append({"level": lv, "scan_type": st, "qps": b / t, "scan_gb_per_s": nbytes / t / 1e9,
                        "speedup_over_float32": best["float32"] / t})  # fmt: skip
            print(f"bandwidth level {lv} {st:8s} {b / t:8.0f} q/s {nbytes / t / 1e9:6.1f} GB/s  x{best['float32'] / t:.2f}", file=sys.stderr)
    _native.set_simd_cap(-1)
    return out


def exact(levels: list[int], items: int, d: int, b: int, repeats: int) -> list[dict[str, Any]]:
    """Nanoseconds per exactly re-scored row per level: k = every row less k = 10 (interleaved)."""
    X, Q, off, qs = _shared_segment(3, items, b, d)
    out = []
    for lv in levels:
        _native.set_simd_cap(lv)
        best = {10: float("inf"), items: float("inf")}
        for k in best:  # warm-up
            _native.segmented_topk(X, off, Q, qs, k, 1, 1.0001, None, "float32", "scan")
        for _ in range(repeats):
            for k in best:
                t0 = time.process_time()
                _native.segmented_topk(X, off, Q, qs, k, 1, 1.0001, None, "float32", "scan")
                best[k] = min(best[k], time.process_time() - t0)
        ns = max(best[items] - best[10], 0.0) / (b * (items - 10)) * 1e9
        out.append({"level": lv, "rows": items, "queries": b, "seconds_k10": best[10], "seconds_all": best[items],
                    "exact_ns_per_row": ns})  # fmt: skip
        print(f"exact  level {lv} {ns:7.1f} ns per re-scored row (d = {d})", file=sys.stderr)
    _native.set_simd_cap(-1)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--rows", type=int, default=100_000, help="rates: rows of the shared segment")
    p.add_argument("--queries", type=int, default=1024, help="rates / bandwidth: queries")
    p.add_argument("--users", type=int, default=400, help="bandwidth: segments")
    p.add_argument("--items", type=int, default=4096, help="bandwidth: rows per segment")
    p.add_argument("--crossover-rows", type=int, default=200_000, help="crossover: rows of each (L, nq) cell's bank")
    p.add_argument("--scan-type", choices=("float32", "int8"), default="float32",
                   help="crossover: the rows both paths read (int8: the int8 scan copy)")
    p.add_argument("--exact-queries", type=int, default=64, help="exact: queries of the segment")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--levels", default=None, help="SIMD levels (default: every level this CPU runs, highest first)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad} (choose from {PARTS})")
    top = _native.set_simd_cap(-1)
    levels = [int(x) for x in args.levels.split(",")] if args.levels else list(range(top, -1, -1))
    if any(lv < 0 or lv > top for lv in levels):
        p.error(f"--levels: this CPU runs levels 0..{top}")
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "simd_level_supported": top,
        "gemm_kc": _native.GEMM_KC,
        "threads": 1,
        "loadavg_before": list(os.getloadavg()),
    }
    if "rates" in parts:
        doc["rates"] = rates(levels, args.rows, args.queries, args.dim, args.repeats)
    if "crossover" in parts:
        doc["crossover"] = crossover(levels, args.dim, args.repeats, args.crossover_rows, args.scan_type)
    if "bandwidth" in parts:
        doc["bandwidth"] = bandwidth(levels, args.users, args.items, args.dim, args.queries, args.repeats)
    if "exact" in parts:
        doc["exact"] = exact(levels, args.items, args.dim, args.exact_queries, args.repeats)
    doc["loadavg_after"] = list(os.getloadavg())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = write_json(doc, args.out or Path(__file__).with_name("results") / "local" / f"gemm-{stamp}.json")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
