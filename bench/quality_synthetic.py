"""Does a retrieval-quality setting hurt on the synthetic clustered data? (README "Retrieval quality")

The synthetic banks of :mod:`rfmem_fast.bench.workloads` carry labels only through how
their queries are generated, so two measures are sensible:

* *specific* queries (noise around one of the user's items): hit rate @10 of that
  generating item, and its reciprocal rank (MRR@10);
* *vague* queries (noise around one of the user's cluster centres): precision@10, the
  share of the top 10 whose nearest centre is the generating one.

For each configuration (dense, the paper's RF-Mem, ``RFMemConfig.recommended()`` and
profile weights around it) the script runs one ``search`` of the whole query set and
writes the measures, with the machine and the exact command, to JSON::

    python bench/quality_synthetic.py --users 20 --items 2000 --queries 4000 --out bench/results/quality-synthetic.json
    python bench/quality_synthetic.py --spread 1.5 --specific-noise 2 5 --vague-noise 3 8 --out ...  # harder
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from rfmem_fast import RFMemConfig, search
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.evaluate import machine_info


def measures(res, bank, sb, Q_user, item_row, cen, specific) -> dict[str, float]:
    """hit@10 / MRR@10 of the generating item (specific queries), precision@10 of the centre (vague ones)."""
    snap = bank.snapshot()
    rows = res.rows
    hit = rows == item_row[:, None]
    found = hit.any(axis=1)
    rank = np.where(found, hit.argmax(axis=1) + 1, 0)
    sp = specific
    # nearest centre of every returned item
    V = snap.vectors[np.where(rows >= 0, rows, 0)]  # [nq, k, d]
    C = sb.centres[Q_user]  # [nq, c, d]
    near = np.einsum("qkd,qcd->qkc", V, C).argmax(axis=2)
    prec = ((near == cen[:, None]) & (rows >= 0)).sum(axis=1) / rows.shape[1]
    return {
        "specific_hit_at_10": float(found[sp].mean()),
        "specific_mrr_at_10": float(np.where(found, 1.0 / np.maximum(rank, 1), 0.0)[sp].mean()),
        "vague_precision_at_10": float(prec[~sp].mean()),
        "fraction_recollecting": float((res.route == 1).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--items", type=int, default=2000, help="items per user")
    p.add_argument("--queries", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spread", type=float, default=1.0, help="item noise around its centre (SyntheticSpec.spread)")
    p.add_argument("--specific-noise", type=float, nargs=2, default=(0.3, 1.5), metavar=("LO", "HI"))
    p.add_argument("--vague-noise", type=float, nargs=2, default=(0.5, 2.0), metavar=("LO", "HI"))
    p.add_argument("--backend", default="native")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    spec = SyntheticSpec(spread=args.spread, specific_noise=tuple(args.specific_noise), vague_noise=tuple(args.vague_noise))
    sb = synthetic_bank(args.users, args.items, spec, seed=args.seed)
    bank = sb.bank
    Q, uidx, specific, item_row, cen = sb.queries(args.queries, seed=args.seed + 1, labels=True)
    users = [sb.users[u] for u in uidx]
    configs = {
        "dense": (RFMemConfig.paper(), "dense"),
        "RF-Mem (paper)": (RFMemConfig.paper(), "rfmem"),
        "recommended()": (RFMemConfig.recommended(), "rfmem"),
        "recollect all + rescore 0.5 (merge grid)": (
            RFMemConfig(merge="rescore", rescore_weight=0.5, theta_high=1.0, theta_low=1.0, tau=0.0), "rfmem"),
    }
    for w in (0.05, 0.1, 0.2, 0.5):
        configs[f"dense + profile prior {w}"] = (RFMemConfig(profile_weight=w), "dense")
    results = {}
    for name, (cfg, mode) in configs.items():
        t1 = time.perf_counter()
        res = search(bank, Q, users, cfg, mode=mode, backend=args.backend)
        results[name] = {**measures(res, bank, sb, uidx, item_row, cen, specific),
                         "ms_per_query": 1e3 * (time.perf_counter() - t1) / len(users)}  # fmt: skip
        print(name, json.dumps({k: round(v, 4) for k, v in results[name].items()}), file=sys.stderr)
    print("| config | specific hit@10 | specific MRR@10 | vague precision@10 | % recollecting |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['specific_hit_at_10']:.4f} | {r['specific_mrr_at_10']:.4f} | "
              f"{r['vague_precision_at_10']:.4f} | {100 * r['fraction_recollecting']:.0f} % |")  # fmt: skip
    if args.out:
        doc = {"results": results, "spec": spec.to_dict(), "users": args.users, "items_per_user": args.items,
               "queries": args.queries, "specific_queries": int(specific.sum()), "machine": machine_info(),
               "command": "python " + " ".join(sys.argv), "seconds": time.perf_counter() - t0}  # fmt: skip
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
