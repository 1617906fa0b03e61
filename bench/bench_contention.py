"""Single-query latency on a busy machine: quiet vs CPU contention.

A serving process answers one query at a time while other processes load the cores.
This benchmark measures, in ONE run, the latency of single-query ``search`` calls
(p50 / p90 / p99 / max over ``--queries`` calls, distinct queries, after a warm-up)

* at two scales: ``1m`` = users of 4,096 x 384 items (the paper's 1M-token memory) and
  ``personabench`` = users of 88 x 384 items (PersonaBench's mean chunks per user);
* in modes ``dense`` and ``rfmem``;
* per backend (default: native and torch) and thread setting: ``default`` (the
  package's defaults, nothing set) and ``1`` (one thread: ``NativeBackend(num_threads=1)``
  and ``torch.set_num_threads(1)``), the known-safe reference;
* quiet, then with ``--competitors`` CPU-bound processes (default 2: one per core of a
  2-core machine) that this script starts and stops itself;
* per ``--gap-ms`` (default ``0,2``): the idle time between two calls. ``0`` is a
  closed loop (the measuring process is itself CPU-bound, so with two competitors on
  two cores it is preempted about once per scheduler tick, and its p99 holds one
  tick's wait whatever the search costs); ``2`` models a server that waits for its
  next request (the kernel's scheduler places a waking task ahead of the ones that
  ran meanwhile, so an idle-then-busy search is rarely made to wait).

The target: p99 under contention <= 3 x p99 quiet with the default threads.
The JSON (``bench/results/local/contention-<timestamp>.json`` or ``--out``) holds the
machine, the load averages seen before each condition, versions, the exact command and
every figure, plus the ratios. The script uses only the public API, so it also runs
against older versions of the package (for a before/after on one machine).

Usage::

    python bench/bench_contention.py [--queries 300] [--scales 1m,personabench]
        [--modes dense,rfmem] [--backends native,torch] [--competitors 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.evaluate import machine_info

SCALES = {"1m": (8, 4096), "personabench": (6, 88)}  # (users, items per user), d = 384
_SPIN = "import itertools\nfor _ in itertools.count():\n    pass\n"


def percentiles(ms: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max / mean of latencies in ms."""
    a = np.asarray(ms)
    return {
        "p50_ms": float(np.percentile(a, 50)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
        "mean_ms": float(a.mean()),
        "calls": int(a.size),
    }


def backend_for(name: str, threads: str) -> Any:
    """The backend instance of a cell: package defaults, or one thread."""
    if threads == "default" or name != "native":
        return get_backend(name)
    from rfmem_fast.backends.native import NativeBackend

    return NativeBackend(num_threads=1)


def measure(wl: Any, Q: np.ndarray, users: list[str], mode: str, backend: str, threads: str, warmup: int,
            gap_ms: float = 0.0) -> dict:
    """Latencies of single-query searches: the first ``warmup`` queries warm up, each
    of the others is one measured call, with ``gap_ms`` milliseconds of sleep before
    each call (0: back to back)."""
    saved = torch.get_num_threads()
    if threads == "1":
        torch.set_num_threads(1)
    try:
        be = backend_for(backend, threads)
        cfg = RFMemConfig()
        for i in range(warmup):
            search(wl.bank, Q[i : i + 1], users[i : i + 1], cfg, mode=mode, backend=be)
        ms = []
        for i in range(warmup, Q.shape[0]):
            if gap_ms > 0:
                time.sleep(gap_ms / 1e3)
            t = time.perf_counter()
            search(wl.bank, Q[i : i + 1], users[i : i + 1], cfg, mode=mode, backend=be)
            ms.append((time.perf_counter() - t) * 1e3)
        return percentiles(ms)
    finally:
        torch.set_num_threads(saved)


def start_competitors(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound Python processes (busy loops), started now."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]
    time.sleep(1.0)  # let them get going
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes this script started (by their handles)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=300, help="single-query calls per cell")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--scales", default="1m,personabench")
    p.add_argument("--modes", default="dense,rfmem")
    p.add_argument("--backends", default=",".join(b for b in ("native", "torch") if b in rfmem_fast.available_backends()))
    p.add_argument("--threads", default="default,1", help="thread settings: default and/or 1")
    p.add_argument("--competitors", type=int, default=2, help="CPU-bound processes in the contended condition")
    p.add_argument("--gap-ms", default="0,2",
                   help="comma list of idle milliseconds between two calls (0: back to back; >0: a server between requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        gaps = [float(g) for g in args.gap_ms.split(",") if g.strip()]
    except ValueError:
        p.error(f"--gap-ms: expected a comma list of numbers, got {args.gap_ms!r}")
    if not gaps or any(g < 0 for g in gaps):
        p.error(f"--gap-ms: expected non-negative numbers, got {args.gap_ms!r}")
    scales = [s.strip() for s in args.scales.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    threads = [t.strip() for t in args.threads.split(",") if t.strip()]
    for s in scales:
        if s not in SCALES:
            p.error(f"--scales: unknown scale {s!r} (choose from {sorted(SCALES)})")
    for t in threads:
        if t not in ("default", "1"):
            p.error(f"--threads: unknown setting {t!r} (default, 1)")
    if args.queries < 1 or args.competitors < 0:
        p.error("--queries must be >= 1 and --competitors >= 0")

    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "rfmem_fast_path": str(Path(rfmem_fast.__file__).parent),
                     "torch": torch.__version__, "numpy": np.__version__, "torch_threads": torch.get_num_threads()},
        "environment": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "RFMEM_NUM_THREADS")},
        "workload": {"scales": {s: {"users": SCALES[s][0], "items": SCALES[s][1], "dim": 384} for s in scales},
                     "queries": args.queries, "warmup": args.warmup, "competitors": args.competitors,
                     "gap_ms": gaps},
        "conditions": {},
    }  # fmt: skip
    work = {}
    for s in scales:
        wl = synthetic_bank(*SCALES[s], SyntheticSpec(dim=384), seed=args.seed)
        Q, seg, _ = wl.queries(args.queries + args.warmup, seed=args.seed + 1)
        work[s] = (wl, Q, [wl.users[i] for i in seg])
    for cond in ("quiet", "contention"):
        procs = start_competitors(args.competitors) if cond == "contention" else []
        try:
            res: dict[str, Any] = {"loadavg_before": list(os.getloadavg()), "cells": {}}
            for s in scales:
                wl, Q, users = work[s]
                for mode in modes:
                    for be in backends:
                        for th in threads:
                            for gap in gaps:
                                key = f"{s}/{mode}/{be}/threads={th}/gap={gap:g}ms"
                                r = measure(wl, Q, users, mode, be, th, args.warmup, gap)
                                res["cells"][key] = r
                                print(f"{cond:10s} {key:48s} p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms",
                                      file=sys.stderr)
            res["loadavg_after"] = list(os.getloadavg())
        finally:
            stop(procs)
        doc["conditions"][cond] = res
    ratios = {}
    for key, q in doc["conditions"]["quiet"]["cells"].items():
        c = doc["conditions"]["contention"]["cells"][key]
        ratios[key] = {"p50": c["p50_ms"] / q["p50_ms"], "p99": c["p99_ms"] / q["p99_ms"],
                       "goal_p99_le_3x": c["p99_ms"] <= 3 * q["p99_ms"]}  # fmt: skip
    doc["ratios_contention_over_quiet"] = ratios
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / "local" / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    for key, r in ratios.items():
        print(f"{key:48s} p99 contention / quiet = {r['p99']:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
