"""The native beam driver against the Python one, in ONE run.

Single queries: ``search`` called with one query at a time over one user's memory of
128 / 512 / 4,096 chunks x 384 (32K / 128K / 1M tokens at 256 tokens a chunk), in modes
dense, recollection and rfmem, on the native backend with its C++ beam driver
(``NativeBackend(beam_driver="native")``) and with the Python driver over the same
kernels (``beam_driver="python"``): p50 / p99 wall time and p50 CPU time of the calling
thread (``time.thread_time``; on a busy machine the wall time also counts the time the
thread waits for a core, the CPU time does not). Each driver runs every query in a block,
twice, in blocks A B A B (so both see about the same load, and a query runs after one of
its own driver, as in a serving loop); both drivers' rows are checked to be equal. Batches: one multi-tenant batch (``--mt-users`` users x
``--mt-items`` items, ``--mt-batch`` queries, each against a random user) in mode
recollection with 1 and 2 threads, queries per second of each driver.

The JSON (``bench/results/local/beam-driver-<timestamp>.json`` or ``--out``) holds the
machine, the load averages before and after, versions, the exact command, every figure
and the ratios (Python driver / native driver; rfmem p50 / dense p50). The targets
at 1M tokens: recollection p50 <= 0.5 ms and rfmem p50 / dense p50 <= 1.3 on a quiet
machine.

Usage::

    python bench/bench_beam_driver.py [--queries 200] [--chunks 128,512,4096]
        [--modes dense,recollection,rfmem] [--mt-users 200] [--mt-items 1024]
        [--mt-batch 512] [--threads 1,2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import RFMemConfig, search
from rfmem_fast.backends.native import NativeBackend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.evaluate import machine_info

DRIVERS = ("native", "python")


def stats(wall_ms: list[float], cpu_ms: list[float]) -> dict[str, float]:
    """p50 / p99 / mean of the wall times and p50 of the CPU times, in ms."""
    w, c = np.asarray(wall_ms), np.asarray(cpu_ms)
    return {
        "p50_ms": float(np.percentile(w, 50)),
        "p99_ms": float(np.percentile(w, 99)),
        "mean_ms": float(w.mean()),
        "cpu_p50_ms": float(np.percentile(c, 50)),
        "calls": int(w.size),
    }


def single_queries(chunks: int, queries: int, warmup: int, modes: list[str], seed: int) -> dict[str, Any]:
    """Single-query latency of every (mode, driver) over one user of ``chunks`` items."""
    wl = synthetic_bank(1, chunks, SyntheticSpec(dim=384), seed=seed)
    Q, seg, _ = wl.queries(queries + warmup, seed=seed + 1)
    users = [wl.users[i] for i in seg]
    cfg = RFMemConfig()
    backends = {d: NativeBackend(num_threads=1, beam_driver=d) for d in DRIVERS}
    out: dict[str, Any] = {"chunks": chunks, "tokens": chunks * 256, "cells": {}}
    for mode in modes:
        wall: dict[str, list[float]] = {d: [] for d in DRIVERS}
        cpu: dict[str, list[float]] = {d: [] for d in DRIVERS}
        rows: dict[str, list[np.ndarray]] = {d: [] for d in DRIVERS}
        for rep in range(2):  # blocks A B A B: both drivers see about the same load
            for d in DRIVERS:
                for i in range(queries + warmup):
                    t, c = time.perf_counter(), time.thread_time()
                    res = search(wl.bank, Q[i : i + 1], users[i : i + 1], cfg, mode=mode, backend=backends[d])
                    c, t = time.thread_time() - c, time.perf_counter() - t
                    if i >= warmup:
                        wall[d].append(t * 1e3)
                        cpu[d].append(c * 1e3)
                    if rep == 0:
                        rows[d].append(res.rows)
        if not np.array_equal(np.concatenate(rows["native"]), np.concatenate(rows["python"])):
            raise AssertionError(f"{mode}: the drivers disagree")
        for d in DRIVERS:
            out["cells"][f"{mode}/{d}"] = stats(wall[d], cpu[d])
            print(f"{chunks:5d} chunks {mode:13s} {d:6s} p50 {out['cells'][f'{mode}/{d}']['p50_ms']:7.3f} ms "
                  f"(cpu {out['cells'][f'{mode}/{d}']['cpu_p50_ms']:7.3f} ms)", file=sys.stderr)  # fmt: skip
    cells = out["cells"]
    out["ratios"] = {}
    for mode in modes:
        out["ratios"][f"{mode}: python / native p50"] = cells[f"{mode}/python"]["p50_ms"] / cells[f"{mode}/native"]["p50_ms"]
    if "dense" in modes and "rfmem" in modes:
        for d in DRIVERS:
            out["ratios"][f"rfmem / dense p50 ({d} driver)"] = cells[f"rfmem/{d}"]["p50_ms"] / cells[f"dense/{d}"]["p50_ms"]
    return out


def batch(users: int, items: int, b: int, threads: list[int], seed: int) -> dict[str, Any]:
    """Queries per second of one multi-tenant recollection batch, per driver and thread count."""
    wl = synthetic_bank(users, items, SyntheticSpec(dim=384), seed=seed)
    Q, seg, _ = wl.queries(b, seed=seed + 1)
    us = [wl.users[i] for i in seg]
    cfg = RFMemConfig()
    out: dict[str, Any] = {"users": users, "items": items, "batch": b, "cells": {}}
    for th in threads:
        for d in DRIVERS:
            be = NativeBackend(num_threads=th, beam_driver=d)
            search(wl.bank, Q[:16], us[:16], cfg, mode="recollection", backend=be)  # warm-up
            saved = torch.get_num_threads()
            torch.set_num_threads(th)  # the Python driver's tensor operations
            try:
                t = time.perf_counter()
                search(wl.bank, Q, us, cfg, mode="recollection", backend=be)
                dt = time.perf_counter() - t
            finally:
                torch.set_num_threads(saved)
            out["cells"][f"threads={th}/{d}"] = {"qps": b / dt, "ms_per_query": dt / b * 1e3}
            print(f"batch {b} threads={th} {d:6s} {b / dt:9.1f} q/s", file=sys.stderr)
        out["cells"][f"threads={th}/native over python"] = (
            out["cells"][f"threads={th}/native"]["qps"] / out["cells"][f"threads={th}/python"]["qps"]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200, help="timed single-query calls per cell")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--chunks", default="128,512,4096", help="items of the single user (x 256 tokens)")
    p.add_argument("--modes", default="dense,recollection,rfmem")
    p.add_argument("--mt-users", type=int, default=200)
    p.add_argument("--mt-items", type=int, default=1024)
    p.add_argument("--mt-batch", type=int, default=512, help="0 skips the batch")
    p.add_argument("--threads", default="1,2", help="thread counts of the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError as exc:
        p.error(f"--chunks / --threads must be comma lists of ints: {exc}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("dense", "recollection", "rfmem")]
    if bad or args.queries < 1 or min(chunks + threads, default=1) < 1:
        p.error(f"unknown modes {bad}, or --queries / --chunks / --threads below 1")
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "rfmem_fast_path": str(Path(rfmem_fast.__file__).parent),
                     "torch": torch.__version__, "numpy": np.__version__},
        "environment": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "RFMEM_NUM_THREADS", "RFMEM_BEAM_DRIVER")},
        "loadavg_before": list(os.getloadavg()),
        "single_query": [single_queries(c, args.queries, args.warmup, modes, args.seed) for c in chunks],
    }  # fmt: skip
    if args.mt_batch > 0:
        doc["batch"] = batch(args.mt_users, args.mt_items, args.mt_batch, threads, args.seed + 7)
    doc["loadavg_after"] = list(os.getloadavg())
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / "local" / f"beam-driver-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    for sq in doc["single_query"]:
        for k, v in sq["ratios"].items():
            print(f"{sq['chunks']:5d} chunks  {k:40s} {v:6.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
