"""Cost of the learned second stage (rfmem_fast.second_stage) beside the search's own cost.

For each condition (real banks and questions: PersonaBench at a noise level, the LoCoMo
conversations; MiniLM embeddings from the cache) it times, per query:

* the search: the first stage (``RFMemConfig.recommended(second_stage=None)``) at
  ``out_k = 10`` and at ``out_k = N`` (the stage's candidate list), and
  ``RFMemConfig.recommended()`` with the shipped stage inside the search (``search_stage``:
  what ``Memory`` serves);
* the stage: the features of the top N (:func:`rfmem_fast.second_stage.features_from_result`),
  cold (the per-text term cache cleared) and warm, and the model's scoring + top-k
  (``model.rerank``), for a linear model and a tree ensemble;

batched (all of a condition's questions in one call; ms per query = total / questions)
and single (one query per call; median and p90 over the questions, after a warm-up pass).
The models are fitted on the condition's own lists (cost does not depend on what they
learned). Writes a JSON with the machine, ``uptime`` load before and after, and every
figure.

Run: ``python bench/bench_second_stage.py --out bench/results/local/second-stage-cost.json``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from rfmem_fast import RFMemConfig
from rfmem_fast.datasets import load_locomo, load_personabench
from rfmem_fast.datasets.embedded import dataset_embeddings, default_embedding_cache_dir
from rfmem_fast.evaluate_datasets import search_dataset
from rfmem_fast.second_stage import features_from_result, fit_linear_stage, fit_tree_stage, stage_labels, text_terms


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _ms(f, reps=1):
    t = time.perf_counter()
    for _ in range(reps):
        out = f()
    return 1e3 * (time.perf_counter() - t) / reps, out


def run_condition(label, ds, depth, reps):
    emb = dataset_embeddings(ds, encoder=None, cache_dir=default_embedding_cache_dir())
    qrows = np.array([i for i, q in enumerate(ds.questions) if q.scored], dtype=np.int64)
    texts = [ds.questions[int(i)].text for i in qrows]
    rel = [ds.questions[int(i)].ground_truth for i in qrows]
    rel = [g if isinstance(g, dict) else list(g) for g in rel]
    nq = len(qrows)
    cfg10, cfgN = RFMemConfig.recommended(second_stage=None), RFMemConfig.recommended(second_stage=None, out_k=depth)
    cfgS = RFMemConfig.recommended()  # the first stage and the shipped second stage in one search
    snap = emb.bank.snapshot()
    search_dataset(emb, qrows, cfgN, "rfmem")  # warm-up (postings, layouts)
    out = {"questions": nq, "depth": depth}
    # batched
    out["search_10_batch_ms_per_q"] = _ms(lambda: search_dataset(emb, qrows, cfg10, "rfmem"), reps)[0] / nq
    search_dataset(emb, qrows, cfgS, "rfmem")  # (its term cache warm)
    out["search_stage_batch_ms_per_q"] = _ms(lambda: search_dataset(emb, qrows, cfgS, "rfmem"), reps)[0] / nq
    t, res = _ms(lambda: search_dataset(emb, qrows, cfgN, "rfmem"), reps)
    out["search_N_batch_ms_per_q"] = t / nq
    text_terms.cache_clear()
    out["features_batch_cold_ms_per_q"] = _ms(lambda: features_from_result(res, snap, texts, depth))[0] / nq
    t, (F, V) = _ms(lambda: features_from_result(res, snap, texts, depth), reps)
    out["features_batch_warm_ms_per_q"] = t / nq
    Y = stage_labels(np.asarray(res.ids)[:, :depth], V, rel)
    models = {"linear": fit_linear_stage(F, V, Y, depth=depth, C=0.1),
              "trees": fit_tree_stage(F, V, Y, depth=depth, max_iter=150, max_leaf_nodes=15)}  # fmt: skip
    for name, m in models.items():
        out[f"score_{name}_batch_ms_per_q"] = _ms(lambda: m.rerank(F, V, 10), reps)[0] / nq
    # single queries
    single = {"search_10": [], "search_N": [], "search_stage": [], "features_cold": [], "features_warm": [],
              **{f"score_{n}": [] for n in models}}  # fmt: skip
    text_terms.cache_clear()
    for j in range(nq):
        r = qrows[j : j + 1]
        single["search_10"].append(_ms(lambda: search_dataset(emb, r, cfg10, "rfmem"))[0])
        single["search_stage"].append(_ms(lambda: search_dataset(emb, r, cfgS, "rfmem"))[0])
        t, rj = _ms(lambda: search_dataset(emb, r, cfgN, "rfmem"))
        single["search_N"].append(t)
        single["features_cold"].append(_ms(lambda: features_from_result(rj, snap, texts[j : j + 1], depth))[0])
        t, (Fj, Vj) = _ms(lambda: features_from_result(rj, snap, texts[j : j + 1], depth))
        single["features_warm"].append(t)
        for name, m in models.items():
            single[f"score_{name}"].append(_ms(lambda: m.rerank(Fj, Vj, 10))[0])
    for k, v in single.items():
        out[f"{k}_single_ms_p50"] = float(np.median(v))
        out[f"{k}_single_ms_p90"] = float(np.percentile(v, 90))
    print(label, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared = Path(__file__).resolve().parents[2] / "shared" / "data"  # (../shared beside the checkout)
    ap.add_argument("--personabench", default=str(shared / "personabench" / "eval_data_v1"))
    ap.add_argument("--locomo", default=str(shared / "locomo"))
    ap.add_argument("--noise", default="0.0,0.7")
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import sys

    import sklearn
    import torch

    import rfmem_fast
    from rfmem_fast._native import simd_level

    doc = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "simd_level": int(simd_level())},
           "versions": {"rfmem_fast": rfmem_fast.__version__, "numpy": np.__version__, "torch": torch.__version__,
                        "scikit-learn": sklearn.__version__},
           "load_before": _load(), "conditions": {}}  # fmt: skip
    conds = [(f"pb {n}", load_personabench(a.personabench, noise=float(n))) for n in a.noise.split(",") if n]
    conds.append(("locomo", load_locomo(a.locomo)))
    for label, ds in conds:
        doc["conditions"][label] = run_condition(label, ds, a.depth, a.reps)
    doc["load_after"] = _load()
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
