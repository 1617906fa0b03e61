"""Cost of filtered search, native backend, CPU.

Workload: ``rfmem bench``'s synthetic clustered vectors (d = 384, 8 centres per user,
items in random cluster order); item j of a user of n items gets the metadata
``{"bucket": floor(100 j / n)}``, so ``{"bucket": {"$lt": p}}`` keeps p % of the user's
items (rounded up to a whole item). Cells, each against the same search without a
filter, in modes "dense" and "rfmem":

* ``single``: one user of ``--chunks`` (4,096) items, i.e. 1M tokens at 256 tokens per
  chunk (the ``bench_single_query.py`` workload), one query per call, ``--queries``
  calls after a warm-up, p50 ms, for filters keeping 1 %, 10 %, 50 % and 100 % of the
  items. 1 % and 10 % are row lists in the native kernel (a quarter or less of the
  segment: :data:`rfmem_fast.filters.LIST_MAX_FRACTION`), 50 % and 100 % masks.
* ``batch``: ``--users`` users x ``--chunks`` items, ``--batch`` queries on random users
  per call, one filter for the whole batch (and a per-query mix of the four
  selectivities), best of ``--reps`` calls, queries per second.
* ``compile``: the filters' compilation alone (the first one per snapshot builds the
  metadata columns; later ones hit the bank's cache), ms.

In mode "rfmem" a filter changes what the probe sees, hence the routing: a query whose
matching items are few or far routes to the (costlier) Recollection path more often.
Each rfmem cell therefore also records the share of queries that recollected, and the
cost of the unfiltered search over a bank holding only the matching items (``sub_bank``:
the same results, so the same routes, without a filter: the cost of the filter itself
is the difference).

The cells of one table take turns call by call (single) or call by call per repetition
(batch), so that a change of the machine's load (this one is shared) hits them alike.

Goal: selective filters (1 %, 10 %, 50 %) cost no more than an unfiltered search
(p50 ratio <= 1, batch q/s ratio >= 1; the JSON records whether each is met; in mode
"rfmem" against the same routes: the ``sub_bank`` cells).

Usage::

    python bench/bench_filters.py [--users 50] [--queries 200] [--out bench/results/local/filters-<time>.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.report import write_json
from rfmem_fast.bench.timing import interleaved_best, interleaved_p50
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.evaluate import machine_info
from rfmem_fast.filters import compile_filters

#: kept fraction (percent) -> filter
SELECTIVITY = {p: {"bucket": {"$lt": p}} for p in (1, 10, 50, 100)}
MODES = ("dense", "rfmem")


def _sub_bank(bank, pct: int) -> MemoryBank:
    """A bank of every user's items that ``SELECTIVITY[pct]`` keeps (same order and ids)."""
    snap = bank.snapshot()
    out = MemoryBank(bank.dim)
    for u, user in enumerate(snap.users):
        a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
        keep = [j for j in range(b - a) if (100 * j) // (b - a) < pct]
        rows = np.asarray(keep, dtype=np.int64) + a
        out.add(user, snap.vectors[rows], list(snap.item_ids[rows]))
    return out


def _reco_share(bank, Q, users, cfg, be, f) -> float:
    """Share of the queries that took the Recollection path (mode "rfmem")."""
    return float(search(bank, Q, users, cfg, mode="rfmem", backend=be, filters=f).route.mean())


def _tag(bank) -> None:
    """Every item's metadata: {"bucket": floor(100 j / n)} (j its position in its user of n items)."""
    for user in bank.users:
        ids = bank.item_ids_of(user)
        bank.set_metadata(user, ids, [{"bucket": (100 * j) // len(ids)} for j in range(len(ids))])


def main(argv: list[str] | None = None) -> int:
    """Run the cells; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--users", type=int, default=50)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "native" not in rfmem_fast.available_backends():
        p.error("the native backend is not built")
    be = get_backend("native")
    cfg = RFMemConfig()
    rng = np.random.default_rng(0)

    # ---------------------------------------------------------------- one user, 1M tokens
    wl = synthetic_bank(1, args.chunks, SyntheticSpec(dim=384), seed=0)
    bank = wl.bank
    _tag(bank)
    Q, _, _ = wl.queries(args.queries, seed=1)
    user = [wl.users[0]]
    n = args.queries
    single: dict = {}
    subs = {pct: _sub_bank(bank, pct) for pct in SELECTIVITY}
    single_routes: dict = {}
    for mode in MODES:
        cells = {"unfiltered": lambda i, mode=mode: search(bank, Q[i : i + 1], user, cfg, mode=mode, backend=be)}
        for pct, f in SELECTIVITY.items():
            cells[f"{pct}%"] = lambda i, f=f, mode=mode: search(bank, Q[i : i + 1], user, cfg, mode=mode, backend=be,
                                                                filters=f)  # fmt: skip
            if mode == "rfmem":
                sb = subs[pct]
                cells[f"{pct}%_sub_bank"] = lambda i, sb=sb, mode=mode: search(sb, Q[i : i + 1], user, cfg, mode=mode,
                                                                               backend=be)  # fmt: skip
        single[mode] = interleaved_p50(cells, n)
    single_routes = {"unfiltered": _reco_share(bank, Q, user * n, cfg, be, None),
                     **{f"{p}%": _reco_share(bank, Q, user * n, cfg, be, f) for p, f in SELECTIVITY.items()}}  # fmt: skip
    del subs
    snap = bank.snapshot()
    seg = bank.segments_for(user)
    compile_ms = {}
    for pct, f in SELECTIVITY.items():
        bank._meta_cache.clear()  # the first compilation of a snapshot builds the columns
        t = time.perf_counter()
        compile_filters(bank, snap, seg, f)
        first = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for _ in range(50):
            compile_filters(bank, snap, seg, f)
        compile_ms[f"{pct}%"] = {"first": first, "cached": (time.perf_counter() - t) * 1e3 / 50}
    del bank, wl, snap
    gc.collect()

    # ---------------------------------------------------------------- multi-tenant batch
    wlb = synthetic_bank(args.users, args.chunks, SyntheticSpec(dim=384), seed=2)
    bankb = wlb.bank
    _tag(bankb)
    users = list(bankb.users)
    qu = [users[int(j)] for j in rng.integers(len(users), size=args.batch)]
    snapb = bankb.snapshot()
    rows = np.array([snapb.offsets[bankb.user_index(u)] for u in qu]) + rng.integers(args.chunks, size=args.batch)
    Qb = snapb.vectors[rows] + 0.05 * rng.normal(size=(args.batch, 384)).astype(np.float32)
    mixed = [SELECTIVITY[int(p)] for p in rng.choice(list(SELECTIVITY), size=args.batch)]
    batch: dict = {}
    subs_b = {pct: _sub_bank(bankb, pct) for pct in SELECTIVITY if pct < 100}  # 100 %: the bank itself
    subs_b[100] = bankb
    for mode in MODES:
        cells = {"unfiltered": lambda mode=mode: search(bankb, Qb, qu, cfg, mode=mode, backend=be)}
        for pct, f in SELECTIVITY.items():
            cells[f"{pct}%"] = lambda f=f, mode=mode: search(bankb, Qb, qu, cfg, mode=mode, backend=be, filters=f)
            if mode == "rfmem" and pct < 100:
                sb = subs_b[pct]
                cells[f"{pct}%_sub_bank"] = lambda sb=sb, mode=mode: search(sb, Qb, qu, cfg, mode=mode, backend=be)
        cells["per_query_mix"] = lambda mode=mode: search(bankb, Qb, qu, cfg, mode=mode, backend=be, filters=mixed)
        batch[mode] = {k: args.batch / t for k, t in interleaved_best(cells, args.reps).items()}
    del subs_b
    gc.collect()
    batch_routes = {"unfiltered": _reco_share(bankb, Qb, qu, cfg, be, None),
                    **{f"{p}%": _reco_share(bankb, Qb, qu, cfg, be, f) for p, f in SELECTIVITY.items()},
                    "per_query_mix": _reco_share(bankb, Qb, qu, cfg, be, mixed)}  # fmt: skip

    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        up = None
    def over(c: dict, k: str) -> float:  # a filtered cell over its baseline (rfmem: the sub bank's routes)
        base = c.get(f"{k}_sub_bank", c["unfiltered"])
        return c[k] / base

    ratio_single = {m: {k: v / c["unfiltered"] for k, v in c.items() if k != "unfiltered" and "sub_bank" not in k}
                    for m, c in single.items()}  # fmt: skip
    ratio_batch = {m: {k: v / c["unfiltered"] for k, v in c.items() if k != "unfiltered" and "sub_bank" not in k}
                   for m, c in batch.items()}  # fmt: skip
    same_routes_single = {k: over(single["rfmem"], k) for k in ("1%", "10%", "50%", "100%")}
    same_routes_batch = {k: over(batch["rfmem"], k) for k in ("1%", "10%", "50%", "100%")}  # 100 %: the bank itself
    selective = ("1%", "10%", "50%")
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {**machine_info(), "simd_level": rfmem_fast._native.simd_level(), "threads": be._threads()},
        "loadavg": list(os.getloadavg()),
        "uptime": up,
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "workload": {"chunks": args.chunks, "dim": 384, "queries": n, "batch_users": args.users, "batch": args.batch,
                     "filters": {f"{p}%": f for p, f in SELECTIVITY.items()}, "backend": "native",
                     "list_max_fraction": rfmem_fast.filters.LIST_MAX_FRACTION},  # fmt: skip
        "single_p50_ms": single,
        "single_ratio_over_unfiltered": ratio_single,
        "single_rfmem_ratio_over_sub_bank": same_routes_single,
        "single_recollection_share": single_routes,
        "batch_qps": batch,
        "batch_ratio_over_unfiltered": ratio_batch,
        "batch_rfmem_ratio_over_sub_bank": same_routes_batch,
        "batch_recollection_share": batch_routes,
        "compile_ms": compile_ms,
        "goals": {
            "selective_single_p50_ratio_max": 1.0,
            "selective_batch_qps_ratio_min": 1.0,
            "single_dense_met": {k: ratio_single["dense"][k] <= 1.0 for k in selective},
            "batch_dense_met": {k: ratio_batch["dense"][k] >= 1.0 for k in selective},
            "single_rfmem_same_routes_met": {k: same_routes_single[k] <= 1.0 for k in selective},
            "batch_rfmem_same_routes_met": {k: same_routes_batch[k] >= 1.0 for k in selective},
        },
    }
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / "local" / f"filters-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(doc, out)
    print(json.dumps({k: doc[k] for k in ("single_p50_ms", "single_ratio_over_unfiltered",
                                          "single_rfmem_ratio_over_sub_bank", "single_recollection_share", "batch_qps",
                                          "batch_ratio_over_unfiltered", "batch_rfmem_ratio_over_sub_bank",
                                          "batch_recollection_share", "goals")}, indent=1))  # fmt: skip
    print(f"load {doc['loadavg']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
