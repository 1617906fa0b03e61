"""Peak memory of one search per backend, at sizes where an unchunked path would need gigabytes.

For each scenario and backend, one ``search`` runs in a fresh process
(:func:`rfmem_fast.bench.memory.measure`: warm-up, peak RSS reset, one call) and the
growth of its peak RSS (``VmHWM``) over the RSS before the call is recorded, with the
wall time and a spot check against the exact top-k. Default sizes:

* ``long_user``: one user with 100,000 items (d = 32), 8,192 queries, mode dense
  (without the memory budget's chunking: +10 GB on torch, +0 MB on native);
* ``recollection``: the same bank, 2,048 queries, mode recollection (without the chunking: +10 GB);
* ``many_users``: 2,000 users sharing 100,000 items, 8,192 queries, mode dense.

Every backend runs with its default ``memory_budget`` (256 MiB) unless ``--budget``.
The JSON (``bench/results/local/memory-<timestamp>.json`` or ``--out``) holds the machine,
versions, the load averages, the exact command and every figure.

Usage::

    python bench/bench_memory.py [--scenarios long_user,recollection,many_users]
        [--backends torch,native] [--items 100000] [--queries 8192]
        [--reco-queries 2048] [--reco-items N] [--users 2000] [--budget BYTES] [--out FILE]
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
from rfmem_fast.bench.memory import SCENARIOS, measure
from rfmem_fast.evaluate import machine_info


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--backends", default=",".join(b for b in ("torch", "native") if b in rfmem_fast.available_backends()))
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=8192)
    p.add_argument("--reco-queries", type=int, default=2048)
    p.add_argument("--reco-items", type=int, default=None, help="bank of the recollection scenario (default --items)")
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--budget", type=int, default=None, help="memory_budget in bytes (default: the backends' default)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(f"--scenarios: unknown scenario {s!r} (choose from {SCENARIOS})")
    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "loadavg_before": list(os.getloadavg()),
        "results": [],
    }
    for s in scenarios:
        sizes = dict(items=args.items, queries=args.queries, dim=args.dim)
        if s == "recollection":
            sizes.update(items=args.reco_items or args.items, queries=args.reco_queries)
        if s == "many_users":
            sizes.update(users=args.users)
        for r in measure(s, backends, budget=args.budget, **sizes):
            doc["results"].append(r)
            print(f"{s:14s} {r['backend']:8s} peak growth {r['growth_bytes'] / 2**20:9.1f} MiB "
                  f"(budget {r['budget_bytes'] / 2**20:.0f} MiB)  {r['seconds']:7.1f} s  correct={r['correct']}",
                  file=sys.stderr)  # fmt: skip
    doc["loadavg_after"] = list(os.getloadavg())
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / "local" / f"memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
