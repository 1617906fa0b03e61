"""Where a single RF-Mem query's time goes at 1M tokens (issue 11 goals), native backend.

One user of 4,096 chunks x d = 384 (1M tokens at 256 tokens per chunk; the workload
of ``rfmem bench``'s latency table: 8 Gaussian centres, half the queries near an item,
half near a centre), ``--queries`` single-query calls per cell after a warm-up, p50 in
ms. Cells, all in one run:

* ``kernel``: the native top-k kernel alone (``NativeBackend.segmented_topk``) for 1
  query and for 3 queries of the same user (one recollection round's branches share
  one read of the bank), i.e. the scan a round cannot avoid;
* ``search dense``; ``search rfmem`` split by the route each query took (the familiar
  ones and the recollecting ones), and the familiar queries run back to back in mode
  rfmem (no recollection in between);
* ``search recollection`` on the float32 bank and on its float16 twin
  (``MemoryBank.astype``), with the mean number of rounds: time per round.

Usage::

    python bench/bench_single_query.py [--queries 200] [--out bench/results/single-query-<time>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.evaluate import machine_info


def _p50(fn, n: int) -> float:
    """Median ms of ``n`` calls of ``fn(i)`` (i = 0..n-1) after 5 warm-up calls."""
    for i in range(5):
        fn(i % n)
    ts = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def main(argv: list[str] | None = None) -> int:
    """Run the cells; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.queries < 2 or args.chunks < 16:
        p.error("--queries must be >= 2 and --chunks >= 16")
    if "native" not in rfmem_fast.available_backends():
        p.error("the native backend is not built")
    wl = synthetic_bank(1, args.chunks, SyntheticSpec(dim=384), seed=0)
    Q, _, _ = wl.queries(args.queries, seed=1)
    user = [wl.users[0]]
    cfg = RFMemConfig()
    be = get_backend("native")
    view = be.view(wl.bank)
    Qt = torch.from_numpy(Q)
    seg1, seg3 = torch.zeros(1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    n = args.queries
    res = search(wl.bank, Q, user * n, cfg, mode="rfmem", backend=be)
    names = np.asarray(res.route_names)
    fam = np.flatnonzero(names == "familiarity")
    rec = np.flatnonzero(names != "familiarity")
    half = wl.bank.astype("float16")
    rounds = search(wl.bank, Q, user * n, cfg, mode="recollection", backend=be).rounds
    cells = {
        "kernel_topk_1_query": _p50(lambda i: be.segmented_topk(view, Qt[i : i + 1], seg1, 10), n),
        "kernel_topk_3_queries": _p50(lambda i: be.segmented_topk(view, Qt[[i, (i + 1) % n, (i + 2) % n]], seg3, 26), n),
        "search_dense": _p50(lambda i: search(wl.bank, Q[i : i + 1], user, cfg, mode="dense", backend=be), n),
        "search_rfmem_all": _p50(lambda i: search(wl.bank, Q[i : i + 1], user, cfg, mode="rfmem", backend=be), n),
        "search_rfmem_familiar_back_to_back": _p50(
            lambda i: search(wl.bank, Q[fam[i] : fam[i] + 1], user, cfg, mode="rfmem", backend=be), len(fam)),
        "search_rfmem_recollecting_only": _p50(
            lambda i: search(wl.bank, Q[rec[i] : rec[i] + 1], user, cfg, mode="rfmem", backend=be), len(rec)),
        "search_recollection_float32": _p50(lambda i: search(wl.bank, Q[i : i + 1], user, cfg, mode="recollection", backend=be), n),
        "search_recollection_float16": _p50(lambda i: search(half, Q[i : i + 1], user, cfg, mode="recollection", backend=be), n),
    }  # fmt: skip
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "loadavg": list(os.getloadavg()),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "workload": {"chunks": args.chunks, "dim": 384, "queries": n, "familiar": int(len(fam)),
                     "recollecting": int(len(rec)), "mean_rounds_recollection": float(np.mean(rounds))},
        "p50_ms": cells,
        "derived": {
            "recollection_ms_per_round_float32": cells["search_recollection_float32"] / float(np.mean(rounds)),
            "rfmem_over_dense_p50": cells["search_rfmem_all"] / cells["search_dense"],
            "search_overhead_over_kernel_dense_ms": cells["search_dense"] - cells["kernel_topk_1_query"],
        },
    }  # fmt: skip
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / f"single-query-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    for k, v in cells.items():
        print(f"{k:40s} p50 {v:8.3f} ms")
    for k, v in doc["derived"].items():
        print(f"{k:40s} {v:8.3f}")
    print(f"familiar {len(fam)} / recollecting {len(rec)}, mean rounds {np.mean(rounds):.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
