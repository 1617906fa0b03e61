"""Where a single RF-Mem query's time goes at 1M tokens, native backend.

One user of 4,096 chunks x d = 384 (1M tokens at 256 tokens per chunk; the workload
of ``rfmem bench``'s latency table: 8 Gaussian centres, half the queries near an item,
half near a centre), single-query calls, p50 in ms. Cells, all in ONE run, taken in
turns (round-robin blocks of calls, so that a change of the machine's load hits every
cell alike):

* ``numpy_scan``: the yardstick, one single-threaded numpy scan of the bank
  (``X @ q`` plus a top-10 ``np.argpartition``; BLAS held to one thread);
* ``kernel_topk_1`` / ``kernel_topk_4``: the native top-k of 1 query and of the 4
  branch queries of one recollection round (one pass over the user's rows);
* ``probe``: the native probe (top-k and familiarity signals) of one query;
* ``driver``: the native beam driver alone (``_native.recollect`` on the probe's top-k
  and, where the package has them, the probe's scan scores, as ``search`` calls it),
  with its own profile (``stats``: ms per phase: the rounds' top-k calls, candidate
  filtering, MMR, KMeans, alpha-mix, beam selection, and the mean rounds and branch
  queries per query);
* ``search_dense``, ``search_recollection``, ``search_rfmem_recollecting`` (queries the
  router sends to the Recollection path), ``search_rfmem_all``: the public ``search``;
  ``python_glue`` = search_recollection - probe - driver (argument checks, the bank
  snapshot, result assembly and the exact re-scoring of the hits in Python).

Each cell runs under thread settings (``--threads``): ``1`` (``NativeBackend(
num_threads=1)``: one thread, the path before threads), ``auto`` (the defaults: the
pool adds helpers for idle cores, csrc/cpu/pool.h) and ``always`` (the pool whatever
the load, to show what threads give when a core is free). ``--baseline PATH`` also runs
the whole benchmark against another copy of the package (e.g. a checkout of an
older commit, with its ``_native`` built) in a subprocess, under the first thread
setting of ``--threads``, interleaved with this one block by block, and reports the
two side by side.

The goals (``derived``, per thread setting): search_recollection and
search_rfmem_recollecting p50 <= 2 x numpy_scan p50 and search_dense p50 <= 1.2 x
numpy_scan p50 (``goal_recollection_le_2x``, ``goal_dense_le_1_2x``; the earlier target,
recollection <= 4x, stays as ``goal_le_4x``), on a quiet 2-core machine. The JSON (``--out``, default
``bench/results/local/single-query-recollection-<time>.json``) holds the machine, the load
before and after, versions, the exact command and every figure.

Usage::

    python bench/bench_single_query.py [--queries 200] [--rounds 5] [--threads 1,auto,always]
        [--baseline PATH] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _p(ts: list[float]) -> dict[str, float]:
    a = np.asarray(ts) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "calls": int(a.size)}  # fmt: skip


class Cells:
    """Cells measured in turns: ``add(name, fn, n)`` registers ``fn(i)`` over i < n;
    ``run(rounds)`` calls each cell's block of n calls (after a warm-up) round after round."""

    def __init__(self) -> None:
        self.cells: dict[str, tuple[Callable[[int], Any], int]] = {}
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, fn: Callable[[int], Any], n: int) -> None:
        self.cells[name] = (fn, max(1, n))
        self.times[name] = []

    def warm(self) -> None:
        for fn, n in self.cells.values():
            for i in range(min(5, n)):
                fn(i)

    def block(self, name: str) -> None:
        fn, n = self.cells[name]
        ts = self.times[name]
        for i in range(n):
            t = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t)

    def result(self) -> dict[str, dict[str, float]]:
        return {k: _p(v) for k, v in self.times.items()}


def build(args: argparse.Namespace) -> tuple[Cells, dict[str, Any], Callable[[], dict[str, Any]]]:
    """The cells of this package (the one on sys.path) and the workload facts."""
    import torch
    from threadpoolctl import threadpool_limits

    import rfmem_fast
    from rfmem_fast import RFMemConfig, _native, search
    from rfmem_fast.backends.native import NativeBackend, _draws_by_clusters
    from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
    from rfmem_fast.recollection import recollection_capacity

    wl = synthetic_bank(1, args.chunks, SyntheticSpec(dim=384), seed=0)
    Q, _, _ = wl.queries(args.queries, seed=1)
    user = [wl.users[0]]
    cfg = RFMemConfig()
    n = args.queries
    probe_be = NativeBackend()
    view = probe_be.view(wl.bank)
    X, off = NativeBackend._bank(view)
    res = search(wl.bank, Q, user * n, cfg, mode="rfmem", backend=probe_be)
    names = np.asarray(res.route_names)
    rec = np.flatnonzero(names != "familiarity")
    seg1 = np.zeros(1, dtype=np.int64)
    seg4 = np.zeros(4, dtype=np.int64)
    k0 = max(cfg.probe_k, cfg.out_k, cfg.beam_width * cfg.fanout)
    has_ref = "keep_scan_scores" in (_native.probe.__doc__ or "")
    kw_keep = {"keep_scan_scores": True} if has_ref else {}
    probes = [_native.probe(X, off, Q[i : i + 1], seg1, k0, cfg.probe_k, cfg.temperature, cfg.entropy, 1,
                            view.row_norm_max, **kw_keep) for i in range(n)]  # fmt: skip
    width = recollection_capacity(cfg) + 1
    draws = _draws_by_clusters(int(cfg.kmeans_seed), int(cfg.beam_width))
    has_stats = hasattr(_native, "recollect_stat_names")
    has_pool = hasattr(_native, "set_thread_pool")
    stats = {th: np.zeros(len(_native.recollect_stat_names)) if has_stats else None for th in args.threads}

    def driver(i: int, threads: int, st: np.ndarray | None = None):
        kw = {"stats": st} if st is not None else {}
        if has_ref and probes[i][5] is not None:  # as search does: the probe's scan scores prune the rounds
            kw.update(ref_scores=probes[i][5], ref_ok=probes[i][6], dense=True)
        return _native.recollect(X, off, Q[i : i + 1], seg1, probes[i][0], probes[i][1], cfg.beam_width, cfg.fanout,
                                 cfg.max_rounds, cfg.out_k, float(cfg.alpha), float(cfg.mmr_lambda),
                                 float(cfg.score_floor), cfg.kmeans_iters, float(cfg.kmeans_tol), draws, width,
                                 threads, view.row_norm_max, 256 << 20, None, **kw)  # fmt: skip

    def scan(i: int) -> None:
        s = X @ Q[i]
        np.argpartition(s, -10)[-10:]

    blas = threadpool_limits(1, user_api="blas")  # numpy's scan on one thread (OpenMP, i.e. torch, untouched)
    cells = Cells()
    cells.add("numpy_scan", scan, n)
    for th in args.threads:
        be = NativeBackend(num_threads=1) if th == "1" else NativeBackend()
        mode = {"1": "auto", "auto": "auto", "always": "always"}[th]

        def wrap(fn: Callable[[int], Any], mode: str = mode) -> Callable[[int], Any]:
            if not has_pool:
                return fn

            def g(i: int) -> Any:
                prev = _native.set_thread_pool(mode)
                try:
                    return fn(i)
                finally:
                    _native.set_thread_pool(prev)

            return g

        threads = 1 if th == "1" else max(1, torch.get_num_threads())
        Q4 = [Q[[i, (i + 1) % n, (i + 2) % n, (i + 3) % n]] for i in range(n)]
        cells.add(f"{th}/kernel_topk_1", wrap(lambda i, t=threads: _native.segmented_topk(
            X, off, Q[i : i + 1], seg1, 5, t, view.row_norm_max)), n)  # fmt: skip
        cells.add(f"{th}/kernel_topk_4", wrap(lambda i, t=threads: _native.segmented_topk(
            X, off, Q4[i], seg4, 6, t, view.row_norm_max)), n)  # fmt: skip
        cells.add(f"{th}/probe", wrap(lambda i, t=threads: _native.probe(
            X, off, Q[i : i + 1], seg1, k0, cfg.probe_k, cfg.temperature, cfg.entropy, t, view.row_norm_max,
            **kw_keep)), n)
        cells.add(f"{th}/driver", wrap(lambda i, t=threads, s=stats[th]: driver(i, t, s)), n)
        cells.add(f"{th}/search_dense", wrap(lambda i, b=be: search(wl.bank, Q[i : i + 1], user, cfg, mode="dense",
                                                                    backend=b)), n)  # fmt: skip
        cells.add(f"{th}/search_recollection", wrap(lambda i, b=be: search(
            wl.bank, Q[i : i + 1], user, cfg, mode="recollection", backend=b)), n)  # fmt: skip
        cells.add(f"{th}/search_rfmem_recollecting", wrap(lambda i, b=be: search(
            wl.bank, Q[rec[i] : rec[i] + 1], user, cfg, mode="rfmem", backend=b)), len(rec))  # fmt: skip
        cells.add(f"{th}/search_rfmem_all", wrap(lambda i, b=be: search(wl.bank, Q[i : i + 1], user, cfg,
                                                                        mode="rfmem", backend=b)), n)  # fmt: skip
    rounds = search(wl.bank, Q, user * n, cfg, mode="recollection", backend=probe_be).rounds
    facts = {
        "package": str(Path(rfmem_fast.__file__).parent),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "simd_level": int(_native.simd_level()) if hasattr(_native, "simd_level") else None,
        "min_work_per_thread": float(_native.MIN_WORK_PER_THREAD),
        "workload": {"chunks": args.chunks, "dim": 384, "queries": n, "recollecting": int(len(rec)),
                     "mean_rounds_recollection": float(np.mean(rounds))},
    }  # fmt: skip

    def finish() -> dict[str, Any]:
        out: dict[str, Any] = {}
        if has_stats:
            nm = list(_native.recollect_stat_names)
            for th, st in stats.items():
                calls = len(cells.times[f"{th}/driver"]) + min(5, n)  # the warm-up calls count too
                per = st / max(calls, 1)
                out[th] = {k[:-2] + "_ms" if k.endswith("_s") else k: float(v * 1e3 if k.endswith("_s") else v)
                           for k, v in zip(nm, per)}  # fmt: skip
        blas.restore_original_limits()
        return {"driver_profile_per_query": out,
                "pool_counters": _native.pool_counters() if hasattr(_native, "pool_counters") else None}

    return cells, facts, finish


def derived(p50: dict[str, float], threads: list[str]) -> dict[str, Any]:
    """Ratios to the numpy scan and the Python glue, per thread setting."""
    scan = p50["numpy_scan"]
    out: dict[str, Any] = {}
    for th in threads:
        g = lambda k: p50[f"{th}/{k}"]  # noqa: E731
        out[th] = {
            "search_recollection_over_numpy_scan": g("search_recollection") / scan,
            "search_rfmem_recollecting_over_numpy_scan": g("search_rfmem_recollecting") / scan,
            "driver_over_numpy_scan": g("driver") / scan,
            "python_glue_ms": g("search_recollection") - g("probe") - g("driver"),
            "dense_over_numpy_scan": g("search_dense") / scan,
            "goal_le_4x": g("search_recollection") <= 4 * scan and g("search_rfmem_recollecting") <= 4 * scan,
            "goal_recollection_le_2x": g("search_recollection") <= 2 * scan and g("search_rfmem_recollecting") <= 2 * scan,
            "goal_dense_le_1_2x": g("search_dense") <= 1.2 * scan,
        }
    return out


def child_main(args: argparse.Namespace) -> int:
    """--serve: a baseline process; reads cell names on stdin, runs their block, replies."""
    cells, facts, finish = build(args)
    cells.warm()
    print(json.dumps({"ready": sorted(cells.cells), "facts": facts}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "done":
            break
        if name in cells.cells:
            cells.block(name)
        print("ok", flush=True)
    print(json.dumps({"result": cells.result(), "extra": finish()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200, help="distinct queries (calls per cell per round)")
    p.add_argument("--rounds", type=int, default=5, help="turns: each cell runs one block of calls per round")
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--threads", default="1,auto,always", help="thread settings among 1, auto, always")
    p.add_argument("--baseline", default=None, help="another copy of rfmem_fast (its parent directory) to compare")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    if args.queries < 4 or args.chunks < 16 or args.rounds < 1:
        p.error("--queries must be >= 4, --chunks >= 16 and --rounds >= 1")
    if any(t not in ("1", "auto", "always") for t in args.threads) or not args.threads:
        p.error(f"--threads: choose among 1, auto, always, got {args.threads}")
    if args.serve:
        return child_main(args)
    import rfmem_fast
    from rfmem_fast.evaluate import machine_info

    if "native" not in rfmem_fast.available_backends():
        p.error("the native backend is not built")
    load_before = list(os.getloadavg())
    cells, facts, finish = build(args)
    base = None
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(args.baseline).resolve()),
                                                         os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        child_args = [sys.executable, str(Path(__file__).resolve()), "--serve", "--queries", str(args.queries),
                      "--chunks", str(args.chunks), "--threads", args.threads[0]]  # fmt: skip
        base = subprocess.Popen(child_args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                cwd=str(Path(args.baseline).resolve()))  # fmt: skip
        hello = json.loads(base.stdout.readline())
        base_cells, base_facts = hello["ready"], hello["facts"]
    cells.warm()
    for r in range(args.rounds):
        for name in cells.cells:
            cells.block(name)
            if base is not None and r < args.rounds:
                bn = name if name == "numpy_scan" else f"{args.threads[0]}/" + name.split("/", 1)[1]
                if name.startswith(args.threads[0] + "/") or name == "numpy_scan":
                    base.stdin.write(bn + "\n")
                    base.stdin.flush()
                    base.stdout.readline()
        print(f"round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    res = cells.result()
    p50 = {k: v["p50_ms"] for k, v in res.items()}
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        **facts,
        "threads": args.threads,
        "cells": res,
        "derived": derived(p50, args.threads),
        **finish(),
    }
    if base is not None:
        base.stdin.write("done\n")
        base.stdin.flush()
        out = json.loads(base.stdout.readline())
        base.wait(timeout=60)
        bp50 = {k: v["p50_ms"] for k, v in out["result"].items() if out["result"][k]["calls"]}
        doc["baseline"] = {"path": str(Path(args.baseline).resolve()), **base_facts, "cells": out["result"],
                           "derived": derived(bp50, ["1"]) if "1/driver" in bp50 else None, **out["extra"]}
        doc["baseline"]["cells_run"] = base_cells
    path = Path(args.out) if args.out else (Path(__file__).with_name("results") / "local"
                                            / f"single-query-recollection-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    cols = args.threads + (["baseline"] if base is not None else [])
    print(f"{'cell (p50 ms)':32s}" + "".join(f"{c:>12s}" for c in cols))
    names = ["numpy_scan"] + list(dict.fromkeys(k.split("/", 1)[1] for k in res if "/" in k))
    for nm in names:
        row = []
        for c in cols:
            if c == "baseline":
                v = doc["baseline"]["cells"].get(nm if nm == "numpy_scan" else f"{args.threads[0]}/{nm}", {}).get("p50_ms")
            else:
                v = p50.get(nm if nm == "numpy_scan" else f"{c}/{nm}")
            row.append(f"{v:12.4f}" if v is not None else f"{'-':>12s}")
        print(f"{nm:32s}" + "".join(row))
    for c in args.threads:
        d = doc["derived"][c]
        print(f"[{c}] search_recollection / numpy_scan = {d['search_recollection_over_numpy_scan']:.2f}, "
              f"rfmem (recollecting) / numpy_scan = {d['search_rfmem_recollecting_over_numpy_scan']:.2f}, "
              f"dense / numpy_scan = {d['dense_over_numpy_scan']:.2f}, python glue {d['python_glue_ms']:.3f} ms; "
              f"goals: recollection <= 2x {d['goal_recollection_le_2x']}, dense <= 1.2x {d['goal_dense_le_1_2x']}")  # fmt: skip
    for th, prof in doc.get("driver_profile_per_query", {}).items():
        print(f"[{th}] driver per query: " + ", ".join(f"{k} {v:.4f}" for k, v in prof.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
