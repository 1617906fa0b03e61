"""Multi-tenant batch throughput of this package against another copy of it, side by side.

A before / after check for a change that must not slow the batch down: the same
synthetic multi-tenant workload (``rfmem_fast.bench.workloads``: ``--users`` users x
``--chunks`` items of d = 384, 8 clustered centres per user, a Zipf text per item), a
batch of ``--batch`` queries on random users, native backend, through the public
``search``. Cells (q/s, best of ``--reps`` calls):

* ``dense``: ``RFMemConfig()``, mode "dense";
* ``rfmem``: ``RFMemConfig()``, mode "rfmem" (the probe, the routing, the beam driver);
* ``hybrid``: convex raw 0.03 BM25 fusion with the query texts, mode "dense";
* ``recommended``: ``RFMemConfig.recommended("minilm")``'s first stage with the query
  texts (the fusion and the context score; ``second_stage=None`` where the copy has one).

The two copies run in turn (``--rounds`` rounds; in each round this copy, then the
baseline, each in a fresh subprocess on the same seeds), so a change of the machine's
load hits both alike; the JSON (``--out``) holds every round, the median ratios, the
machine (CPU, SIMD level), the load before and after, versions and the exact command.

Usage::

    python bench/bench_batch_compare.py --baseline /path/to/other/checkout [--users 50] [--batch 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cells(users: int, chunks: int, batch: int, reps: int) -> dict:
    """q/s of every cell in this process (the package on sys.path)."""
    import numpy as np

    from rfmem_fast import RFMemConfig, search
    from rfmem_fast.backends import get_backend
    from rfmem_fast.bench.workloads import SyntheticSpec, bank_with_texts, synthetic_bank, zipf_texts, zipf_vocab

    rng = np.random.default_rng(0)
    vocab = zipf_vocab(30000)
    wl = synthetic_bank(users, chunks, SyntheticSpec(dim=384), seed=2)
    texts = zipf_texts(users * chunks, 60, vocab, 1.07, rng)
    bank = bank_with_texts(wl.bank, texts)
    snap = bank.snapshot()
    for u in range(snap.num_users):  # every user's postings built before the timing
        snap.lexical.postings(u)
    names = list(bank.users)
    qu = [names[int(j)] for j in rng.integers(len(names), size=batch)]
    rows = np.array([snap.offsets[bank.user_index(u)] for u in qu]) + rng.integers(chunks, size=batch)
    Q = snap.vectors[rows] + 0.05 * rng.normal(size=(batch, 384)).astype(np.float32)
    qt = [" ".join(texts[int(r)].split()[:3]) + " " + e for r, e in zip(rows, zipf_texts(batch, 5, vocab, 1.07, rng))]
    be = get_backend("native")
    hyb = RFMemConfig(lexical_weight=0.03, fusion="convex", lexical_norm="raw")
    try:  # the first stage: the same pipeline in a copy with and one without a second stage
        first = RFMemConfig.recommended("minilm", second_stage=None)
    except (TypeError, ValueError):
        first = RFMemConfig.recommended("minilm")
    cells = {
        "dense": lambda: search(bank, Q, qu, RFMemConfig(), mode="dense", backend=be),
        "rfmem": lambda: search(bank, Q, qu, RFMemConfig(), mode="rfmem", backend=be),
        "hybrid": lambda: search(bank, Q, qu, hyb, mode="dense", backend=be, query_texts=qt),
        "recommended": lambda: search(bank, Q, qu, first, backend=be, query_texts=qt),
    }
    out = {}
    for name, fn in cells.items():
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        out[name] = batch / best
    return out


def _child(path: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=path)
    code = ("import json, sys; sys.path.insert(0, %r); from bench_batch_compare import run_cells; "
            "print(json.dumps(run_cells(%d, %d, %d, %d)))") % (str(ROOT / "bench"), args.users, args.chunks,
                                                                args.batch, args.reps)  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and write the JSON; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="the other copy of the package (its checkout directory)")
    p.add_argument("--users", type=int, default=50)
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / f"batch-compare-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    args = p.parse_args(argv)
    base = str(Path(args.baseline).resolve())
    if not (Path(base) / "rfmem_fast").is_dir():
        p.error(f"--baseline must be a checkout holding rfmem_fast/, got {args.baseline!r}")
    import numpy as np

    from rfmem_fast._native import simd_level
    from rfmem_fast.evaluate import machine_info

    load_before = list(os.getloadavg())
    rounds = []
    for r in range(args.rounds):
        this, other = _child(str(ROOT), args), _child(base, args)
        rounds.append({"this": this, "baseline": other})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {this[k]:.0f} / {other[k]:.0f} q/s" for k in this))
    ratios = {k: float(np.median([x["this"][k] / x["baseline"][k] for x in rounds])) for k in rounds[0]["this"]}
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "simd_level": int(simd_level()),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "package": str(ROOT),
        "baseline": base,
        "workload": {"users": args.users, "chunks": args.chunks, "dim": 384, "batch": args.batch, "reps": args.reps},
        "rounds": rounds,
        "median_ratio_this_over_baseline": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print("median this / baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
