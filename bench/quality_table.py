"""Retrieval-quality table of the README: encoders x noise levels x modes, oracle included.

For every (encoder, noise level) whose embeddings are cached or can be encoded, runs
:func:`rfmem_fast.evaluate.run_personabench` for

* dense, the paper's Recollection path and RF-Mem (``RFMemConfig.paper()``) and the
  oracle router over the paper's two paths;
* RF-Mem with the paper's router and ``merge="interleave"``;
* ``RFMemConfig.recommended(encoder)`` (fixed, nothing fitted here: the profile prior
  with weight 0.3 on the Familiarity path; its honest score is the nested-CV score of
  the procedure that chose it, ``rfmem tune --grid profile``) and the previous pick of
  ``rfmem tune --grid merge`` (recollect every query, ``merge="rescore"``);
* learned routers (logistic regression, MLP) fitted leave-one-user-out on the paper's
  two paths, and the logistic router with the interleave and rescore merges;

and writes one JSON (figures, machine, command) plus a markdown table on stdout::

    python bench/quality_table.py --encoders minilm,mpnet --noise all --out bench/results/quality.json

The cost table times one whole-batch search of the 263 questions (``--backend``,
median of 5, the configurations alternated so that they share the
machine's load, which is recorded), for dense, paper RF-Mem, recommended(encoder), the
previous merge-grid pick and RF-Mem + interleave.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rfmem_fast import RFMemConfig
from rfmem_fast.evaluate import machine_info, run_personabench

NOISE_LEVELS = (0.0, 0.3, 0.5, 0.7)
#: what ``rfmem tune --grid merge`` picks for MiniLM (the previous recommended())
MERGE_PICK = RFMemConfig(merge="rescore", rescore_weight=0.5, theta_high=1.0, theta_low=1.0, tau=0.0)


def rows_for(data: str, encoder: str, noise: float, backend: str) -> dict[str, dict[str, float]]:
    """{row name: {"recall", "ndcg", "reco_frac", "ms_per_query"}} for one condition."""
    out: dict[str, dict[str, float]] = {}

    def add(name: str, rep, mode: str) -> None:
        m = rep.modes[mode]
        n = sum(m.routes.values()) or 1
        out[name] = {
            "recall": m.metrics["Overall"]["recall"],
            "ndcg": m.metrics["Overall"]["ndcg"],
            "reco_frac": m.routes.get("recollection", 0) / n,
            "ms_per_query": m.batch_ms_per_query,
        }

    kw = dict(noise=noise, encoder=encoder, backend=backend, latency=False)
    rec = RFMemConfig.recommended("mpnet" if encoder == "mpnet" else "minilm")
    paper = run_personabench(data, config=RFMemConfig.paper(), **kw)
    add("dense", paper, "dense")
    add("recollection (paper)", paper, "recollection")
    add("RF-Mem (paper)", paper, "rfmem")
    out["oracle (paper paths)"] = {"recall": paper.oracle["Overall"]["recall"], "ndcg": paper.oracle["Overall"]["ndcg"]}
    add("RF-Mem + interleave", run_personabench(data, config=RFMemConfig.paper(merge="interleave"), modes=["rfmem"], **kw), "rfmem")
    add("recommended(encoder)", run_personabench(data, config=rec, modes=["rfmem"], **kw), "rfmem")
    add("recollect all + rescore 0.5 (merge grid)", run_personabench(data, config=MERGE_PICK, modes=["rfmem"], **kw), "rfmem")
    for kind in ("logistic", "mlp"):
        rep = run_personabench(data, config=RFMemConfig.paper(), modes=["rfmem"], cv="users", router_kind=kind, **kw)
        add(f"RF-Mem, {kind} router (LOO)", rep, "rfmem")
    for merge in ("interleave", "rescore"):
        rep = run_personabench(data, config=RFMemConfig.paper(merge=merge), modes=["rfmem"], cv="users", router_kind="logistic", **kw)
        add(f"RF-Mem + {merge}, logistic router (LOO)", rep, "rfmem")
    return out


def cost_for(data: str, encoder: str, noise: float, backend: str, repeats: int = 5) -> dict[str, dict[str, float]]:
    """ms per query of one whole-batch search (median of ``repeats``, the three
    configurations alternated so that they share the machine's load) and the share of
    questions recollecting, for dense, paper RF-Mem, recommended(encoder), the merge-grid pick and
    RF-Mem + interleave."""
    import numpy as np

    from rfmem_fast import search
    from rfmem_fast.datasets.embedded import default_embedding_cache_dir, personabench_embeddings

    emb = personabench_embeddings(data, noise, encoder=encoder, cache_dir=default_embedding_cache_dir())
    rec = RFMemConfig.recommended("mpnet" if encoder == "mpnet" else "minilm")
    runs = {"dense": (RFMemConfig.paper(), "dense"), "RF-Mem (paper)": (RFMemConfig.paper(), "rfmem"),
            "recommended(encoder)": (rec, "rfmem"), "recollect all + rescore 0.5 (merge grid)": (MERGE_PICK, "rfmem"),
            "RF-Mem + interleave": (RFMemConfig.paper(merge="interleave"), "rfmem")}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in runs}
    frac = {}
    for name, (cfg, mode) in runs.items():  # warm-up
        frac[name] = float(np.mean(search(emb.bank, emb.Q, emb.users, cfg, mode=mode, backend=backend).route == 1))
    for _ in range(repeats):
        for name, (cfg, mode) in runs.items():
            t0 = time.perf_counter()
            search(emb.bank, emb.Q, emb.users, cfg, mode=mode, backend=backend)
            times[name].append(time.perf_counter() - t0)
    n = len(emb.users)
    return {k: {"ms_per_query": 1e3 * float(np.median(v)) / n, "reco_frac": frac[k]} for k, v in times.items()}


def markdown(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Rows = modes, columns = conditions; cells Recall@10 (and the recollecting share)."""
    conds = list(results)
    names = list(next(iter(results.values())))
    lines = ["| mode | " + " | ".join(conds) + " |", "|---|" + "---|" * len(conds)]
    for n in names:
        cells = []
        for c in conds:
            r = results[c].get(n)
            if r is None:
                cells.append("-")
                continue
            extra = f" ({100 * r['reco_frac']:.0f} %)" if "reco_frac" in r and n != "dense" else ""
            cells.append(f"{r['recall']:.4f}{extra}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "personabench" / "eval_data_v1"))
    p.add_argument("--encoders", default="minilm")
    p.add_argument("--noise", default="all", help="all or a comma list")
    p.add_argument("--conditions", default=None, help="explicit ENC:NOISE pairs (comma list), instead of --encoders x --noise")
    p.add_argument("--backend", default="native")
    p.add_argument("--out", default=None, help="JSON output file")
    args = p.parse_args(argv)
    noises = NOISE_LEVELS if args.noise == "all" else tuple(float(x) for x in args.noise.split(","))
    t0 = time.perf_counter()
    pairs = [(e, n) for e in args.encoders.split(",") for n in noises]
    if args.conditions:
        pairs = [(c.rpartition(":")[0], float(c.rpartition(":")[2])) for c in args.conditions.split(",")]
    results, costs = {}, {}
    for enc, noise in pairs:
        label = f"{enc} {noise}"
        print(f"[{time.perf_counter() - t0:.0f} s] {label}", file=sys.stderr)
        results[label] = rows_for(args.data, enc, noise, args.backend)
        costs[label] = cost_for(args.data, enc, noise, args.backend)
    print(markdown(results))
    print()
    print("| cost: ms per query (batch of 263), % recollecting | " + " | ".join(costs) + " |")
    print("|---|" + "---|" * len(costs))
    for name in next(iter(costs.values())):
        print(f"| {name} | " + " | ".join(f"{c[name]['ms_per_query']:.3f} ({100 * c[name]['reco_frac']:.0f} %)" for c in costs.values()) + " |")
    if args.out:
        doc = {"results": results, "cost": costs, "machine": machine_info(), "command": "python " + " ".join(sys.argv),
               "seconds": time.perf_counter() - t0}  # fmt: skip
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
