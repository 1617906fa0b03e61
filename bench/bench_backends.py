"""Backend benchmark: per primitive and end to end, every CPU backend side by side.

Workload (DESIGN.md "Benchmark workloads"): U users x n items of seeded clustered unit
vectors (default 1,000 x 4,096, d = 384), a batch of queries each against a random
user's bank (default 1,024). In ONE run it measures

* this machine's memory bandwidth (a large numpy copy, bytes read + written / s);
* per primitive, for each backend: segmented top-k (k = 10), the fused probe (top-k +
  signals), batched KMeans (one problem per (query, beam slot), (B + 2) * F points,
  B clusters) and alpha-mix; the reference backend on a sample, scaled per item;
* end to end, for each backend: ``search`` in modes dense / rfmem / recollection
  over the whole batch (the reference as the authors run it, one query per call, on
  ``--reference-queries`` queries, its per-route means re-weighted to the batch's route
  split for the ratios), the time
  spent inside each primitive (a timing proxy around the backend), hence the share of
  the time outside scoring (KMeans, mixing, bookkeeping);
* the dense multi-tenant scan's effective bandwidth: each query must read its user's
  whole bank, n x d x 4 bytes, so ``queries * n * d * 4 / time`` (and the bytes of the
  distinct banks touched, for reference), as a fraction of the measured copy bandwidth;
* ratios, each from figures of this run: native vs torch and vs reference throughput.

Usage::

    python bench/bench_backends.py [--users 1000] [--items 4096] [--dim 384] [--queries 1024]
        [--backends native,torch,reference] [--reference-queries 32] [--out FILE]

Results go to ``bench/results/local/backends-<timestamp>.json`` (machine, versions, command,
every figure) and a printed table.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, check_memory, synthetic_bank
from rfmem_fast.evaluate import machine_info

PRIMITIVES = ("segmented_topk", "probe", "batched_kmeans", "alpha_mix")
ROUTES = ("familiarity", "recollection")


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Smallest wall time of ``repeats`` calls of ``fn`` after one warm-up (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Memory bandwidth of a large numpy copy: (bytes read + bytes written) / s."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = best_of(lambda: np.copyto(dst, src), repeats)
    return 2 * nbytes / t


class TimedBackend:
    """Wraps a backend's primitives with wall-clock accumulators (``totals`` in s)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.totals: collections.Counter = collections.Counter()
        for name in PRIMITIVES:
            fn = getattr(backend, name)

            def timed(*a: Any, _fn: Callable = fn, _name: str = name, **k: Any) -> Any:
                t = time.perf_counter()
                out = _fn(*a, **k)
                self.totals[_name] += time.perf_counter() - t
                return out

            setattr(backend, name, timed)


def primitive_inputs(wl: Any, Q: np.ndarray, seg: np.ndarray, cfg: RFMemConfig, seed: int) -> dict[str, Any]:
    """Inputs of the primitives shaped as one recollection round of the batch produces."""
    rng = np.random.default_rng(seed)
    m = Q.shape[0] * cfg.beam_width
    npts = (cfg.beam_width + 2) * cfg.fanout
    snap = wl.bank.snapshot()
    rows = rng.integers(0, snap.vectors.shape[0], size=(m, npts))
    V = torch.from_numpy(snap.vectors[rows])
    return {
        "Q": torch.from_numpy(Q),
        "qseg": torch.from_numpy(seg),
        "V": V,
        "counts": torch.full((m,), npts, dtype=torch.int64),
        "clusters": torch.full((m,), cfg.beam_width, dtype=torch.int64),
        "qb": torch.from_numpy(np.repeat(Q, cfg.beam_width, axis=0)),
        "cent": V[:, : cfg.beam_width].contiguous(),
    }


def bench_primitives(name: str, wl: Any, inp: dict[str, Any], cfg: RFMemConfig, sample: int | None, repeats: int) -> dict[str, Any]:
    """Seconds per call of each primitive on the full batch (a sample scaled up for ``sample``)."""
    be = get_backend(name)
    view = be.view(wl.bank)
    b, m = inp["Q"].shape[0], inp["V"].shape[0]
    nb = min(b, sample) if sample else b
    nm = min(m, sample * cfg.beam_width) if sample else m
    Q, qseg = inp["Q"][:nb], inp["qseg"][:nb]
    k0 = max(cfg.probe_k, cfg.out_k, cfg.beam_width * cfg.fanout)
    r = max(1, repeats if not sample else 1)
    out = {
        "segmented_topk": best_of(lambda: be.segmented_topk(view, Q, qseg, cfg.out_k), r) * b / nb,
        "probe": best_of(lambda: be.probe(view, Q, qseg, k0, cfg.probe_k, cfg.temperature, cfg.entropy), r) * b / nb,
        "batched_kmeans": best_of(
            lambda: be.batched_kmeans(inp["V"][:nm], inp["counts"][:nm], inp["clusters"][:nm], cfg.kmeans_iters, cfg.kmeans_tol, cfg.kmeans_seed), r
        ) * m / nm,
        "alpha_mix": best_of(lambda: be.alpha_mix(inp["qb"][:nm], inp["cent"][:nm], inp["qb"][:nm], cfg.alpha), r) * m / nm,
    }
    return {"seconds": out, "sampled": nb < b}


def bench_end_to_end(name: str, wl: Any, Q: np.ndarray, users: list, cfg: RFMemConfig, modes: list[str]) -> dict[str, Any]:
    """Per mode: wall seconds of one whole-batch search, seconds inside each primitive, routes."""
    be = get_backend(name)
    timed = TimedBackend(be)
    res: dict[str, Any] = {}
    for mode in modes:
        search(wl.bank, Q[:4], users[:4], cfg, mode=mode, backend=be)  # warm-up
        timed.totals.clear()
        t = time.perf_counter()
        r = search(wl.bank, Q, users, cfg, mode=mode, backend=be)
        total = time.perf_counter() - t
        inside = dict(timed.totals)
        scoring = inside.get("segmented_topk", 0.0) + inside.get("probe", 0.0)
        res[mode] = {
            "seconds": total,
            "queries": len(users),
            "qps": len(users) / total,
            "ms_per_query": 1e3 * total / len(users),
            "primitive_seconds": inside,
            "outside_scoring_fraction": max(0.0, 1.0 - scoring / total),
            "routes": {"familiarity": int((r.route == 0).sum()), "recollection": int((r.route == 1).sum())},
            "mean_rounds_recollection": float(r.rounds[r.route == 1].mean()) if (r.route == 1).any() else 0.0,
        }
    return res


def bench_reference_loop(wl: Any, Q: np.ndarray, users: list, cfg: RFMemConfig, modes: list[str]) -> dict[str, Any]:
    """The reference backend as the authors run it: one ``search`` call per query.

    Per mode: mean ms per query over the sample, and the mean per route (so that the
    ratios can re-weight them by the full batch's route split).
    """
    be = get_backend("reference")
    res: dict[str, Any] = {}
    for mode in modes:
        search(wl.bank, Q[:1], users[:1], cfg, mode=mode, backend=be)  # warm-up
        times = {0: [], 1: []}
        for i in range(len(users)):
            t = time.perf_counter()
            r = search(wl.bank, Q[i : i + 1], users[i : i + 1], cfg, mode=mode, backend=be)
            times[int(r.route[0])].append(time.perf_counter() - t)
        every = times[0] + times[1]
        res[mode] = {
            "seconds": sum(every),
            "queries": len(every),
            "qps": len(every) / sum(every),
            "ms_per_query": 1e3 * sum(every) / len(every),
            "ms_per_query_by_route": {ROUTES[k]: 1e3 * float(np.mean(v)) for k, v in times.items() if v},
            "routes": {ROUTES[k]: len(v) for k, v in times.items()},
            "loop": "one search call per query",
        }
    return res


def reference_ms_for_split(ref: dict[str, Any], routes: dict[str, int]) -> float:
    """Reference ms per query re-weighted to a route split (falls back to its plain mean)."""
    by = ref["ms_per_query_by_route"]
    total = sum(routes.values())
    if not all(r in by for r, n in routes.items() if n):
        return ref["ms_per_query"]
    return sum(by[r] * n for r, n in routes.items() if n) / total


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--items", type=int, default=4096)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--backends", default=",".join(b for b in ("native", "torch", "reference") if b in rfmem_fast.available_backends()))
    p.add_argument("--modes", default="dense,rfmem,recollection")
    p.add_argument("--reference-queries", type=int, default=64, help="queries run through the reference (per-query figures)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    cfg = RFMemConfig()
    check_memory(args.users * args.items * args.dim * 4 * 2, "the bank")
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    print(f"numpy copy bandwidth: {bw / 1e9:.1f} GB/s (read + write)", file=sys.stderr)
    wl = synthetic_bank(args.users, args.items, SyntheticSpec(dim=args.dim), seed=args.seed)
    Q, seg, _ = wl.queries(args.queries, seed=args.seed + 1)
    users = [wl.users[i] for i in seg]
    print(f"bank: {args.users} x {args.items} x {args.dim} ({wl.nbytes / 1e9:.2f} GB), built in {wl.build_s:.1f} s", file=sys.stderr)
    inp = primitive_inputs(wl, Q, seg, cfg, args.seed + 2)

    doc: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "torch_threads": torch.get_num_threads()},
        "workload": {"users": args.users, "items": args.items, "dim": args.dim, "queries": args.queries,
                     "bank_bytes": wl.nbytes, "config": cfg.to_dict()},
        "copy_bandwidth_bytes_per_s": bw,
        "primitives": {},
        "end_to_end": {},
    }  # fmt: skip
    for name in backends:
        sample = args.reference_queries if name == "reference" else None
        print(f"primitives: {name}", file=sys.stderr)
        doc["primitives"][name] = bench_primitives(name, wl, inp, cfg, sample, args.repeats)
        nq = min(args.queries, args.reference_queries) if name == "reference" else args.queries
        print(f"end to end: {name} ({nq} queries)", file=sys.stderr)
        if name == "reference":
            doc["end_to_end"][name] = bench_reference_loop(wl, Q[:nq], users[:nq], cfg, modes)
        else:
            doc["end_to_end"][name] = bench_end_to_end(name, wl, Q[:nq], users[:nq], cfg, modes)

    # the dense scan as bandwidth: each query reads its user's whole bank
    per_query_bytes = args.items * args.dim * 4
    distinct = len(set(seg.tolist()))
    scan = {}
    for name, e2e in doc["end_to_end"].items():
        if "dense" in e2e:
            t = e2e["dense"]["seconds"]
            nq = e2e["dense"]["queries"]
            eff = nq * per_query_bytes / t
            scan[name] = {
                "effective_bytes_per_s": eff,
                "fraction_of_copy_bandwidth": eff / bw,
                "distinct_bank_bytes_per_s": (distinct if nq == args.queries else nq) * per_query_bytes / t,
            }
    doc["dense_scan"] = scan
    ratios: dict[str, Any] = {}
    e2e = doc["end_to_end"]
    for mode in modes:
        for a, b in (("native", "torch"), ("native", "reference"), ("torch", "reference")):
            if a in e2e and b in e2e and mode in e2e[a] and mode in e2e[b]:
                ref_ms = e2e[b][mode]["ms_per_query"]
                if b == "reference":  # the sample's route split re-weighted to the full batch's
                    ref_ms = reference_ms_for_split(e2e[b][mode], e2e[a][mode]["routes"])
                ratios[f"{mode}_{a}_over_{b}_throughput"] = ref_ms / e2e[a][mode]["ms_per_query"]
    ratios["targets"] = {"rfmem_native_over_torch": ">= 3", "rfmem_native_over_reference": ">= 50",
                         "native_outside_scoring_fraction": "< 0.30", "native_dense_scan_fraction_of_bandwidth": ">= 0.60"}  # fmt: skip
    doc["ratios"] = ratios
    doc["wall_seconds"] = time.perf_counter() - t0

    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "local" / f"backends-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))

    print(f"\nmachine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores; copy bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'backend':<11}{'primitive':<16}{'seconds':>10}")
    for name, pr in doc["primitives"].items():
        for prim, s in pr["seconds"].items():
            print(f"{name:<11}{prim:<16}{s:>10.4f}{'  (sampled, scaled)' if pr['sampled'] else ''}")
    print(f"\n{'backend':<11}{'mode':<14}{'ms/query':>10}{'qps':>10}{'outside scoring':>17}{'routes fam/rec':>16}")
    for name, per in e2e.items():
        for mode, r in per.items():
            print(f"{name:<11}{mode:<14}{r['ms_per_query']:>10.3f}{r['qps']:>10.1f}{r.get('outside_scoring_fraction', float('nan')):>17.2f}"
                  f"{r['routes']['familiarity']:>8}/{r['routes']['recollection']}")  # fmt: skip
    for name, s in scan.items():
        print(f"dense scan {name}: {s['effective_bytes_per_s'] / 1e9:.1f} GB/s effective = {s['fraction_of_copy_bandwidth']:.2f} of copy bandwidth")
    for k, v in ratios.items():
        if k != "targets":
            print(f"{k}: {v:.1f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
