"""Cost of the context score (RFMemConfig.context_weight / thread_weight), native backend, CPU.

Workload: ``rfmem bench``'s synthetic clustered vectors (d = 384) with a synthetic Zipf text
per item (the generator of ``bench/bench_hybrid.py``) and conversation threads: every user's
items, in insertion order, are sessions of ``--session`` (32) turns, positions 0, 1, ...
Cells, side by side in ONE run, taken in turns call by call (single) or call by call
(batch), so a change of the machine's load hits every cell alike:

* ``dense``: ``search(mode="dense")`` with ``RFMemConfig()`` (no lexical channel);
* ``hybrid``: the recommended pipeline, ``RFMemConfig.recommended()`` (MiniLM pick:
  ``cosine + 0.03 BM25``, never recollecting), with the query texts;
* ``hybrid_context``: the same with the context score on (``--context``, default
  ``context_weight=0.5, context_radius=2, thread_weight=0.3``).

``single``: one user of ``--chunks`` (4,096) items (1M tokens at 256 tokens per chunk), one
query per call, ``--queries`` calls x ``--reps`` rounds after a warm-up: p50 / p99 ms.
Goal: hybrid_context p50 <= 2 x dense p50.

``batch``: ``--users`` (200) users x ``--chunks`` items, ``--batch`` (256) queries on random
users per call, best of ``--reps`` calls per cell: queries per second. Goal: hybrid_context
q/s >= 0.5 x dense q/s.

The JSON (``--out``) holds the machine, the CPU, the versions, the exact command, the load
before and after, and every figure.

Usage::

    python bench/bench_context.py [--users 200] [--batch 256] [--queries 200] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
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
from rfmem_fast.bench.workloads import SyntheticSpec, query_texts, synthetic_bank, zipf_texts, zipf_vocab
from rfmem_fast.evaluate import machine_info


def _threaded(bank: MemoryBank, texts: list[str], session: int) -> MemoryBank:
    """``bank`` rebuilt with ``texts`` and threads: each user's items are sessions of ``session`` turns."""
    s = bank.snapshot()
    n_u = np.diff(s.offsets)
    local = np.concatenate([np.arange(m) for m in n_u]) if n_u.size else np.zeros(0, dtype=np.int64)
    user = np.repeat(np.arange(n_u.size), n_u)
    threads = [f"u{u}-s{j // session}" for u, j in zip(user.tolist(), local.tolist())]
    positions = (local % session).tolist()
    return MemoryBank.from_arrays(s.vectors, s.offsets, list(s.users), list(s.item_ids), texts, threads=threads,
                                  positions=positions)  # fmt: skip


def _uptime() -> str | None:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the cells; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch-reps", type=int, default=5)
    p.add_argument("--session", type=int, default=32)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--context", default="context_weight=0.5,context_radius=2,thread_weight=0.3")
    p.add_argument("--skip-batch", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "native" not in rfmem_fast.available_backends():
        p.error("the native backend is not built")
    ctx_kw = {k: (int(v) if k == "context_radius" else float(v))
              for k, v in (kv.split("=") for kv in args.context.split(","))}  # fmt: skip
    be = get_backend("native")
    rng = np.random.default_rng(0)
    vocab = zipf_vocab(30000)
    dense_cfg = RFMemConfig()
    hyb_cfg = RFMemConfig.recommended()
    ctx_cfg = hyb_cfg.replace(**ctx_kw)
    load_before = list(os.getloadavg())

    # ---------------------------------------------------------------- single query, 1M tokens
    wl = synthetic_bank(1, args.chunks, SyntheticSpec(dim=384), seed=0)
    texts = zipf_texts(args.chunks, args.words, vocab, 1.07, rng)
    bank = _threaded(wl.bank, texts, args.session)
    Q, _, _ = wl.queries(args.queries, seed=1)
    qt = query_texts(texts, args.queries, vocab, 1.07, rng)
    user = [wl.users[0]]
    cells = {
        "dense": lambda i: search(bank, Q[i : i + 1], user, dense_cfg, mode="dense", backend=be),
        "hybrid": lambda i: search(bank, Q[i : i + 1], user, hyb_cfg, backend=be, query_texts=qt[i : i + 1]),
        "hybrid_context": lambda i: search(bank, Q[i : i + 1], user, ctx_cfg, backend=be, query_texts=qt[i : i + 1]),
    }
    for fn in cells.values():
        for i in range(10):
            fn(i % args.queries)
    ts: dict = {k: [] for k in cells}
    for _ in range(args.reps):
        for i in range(args.queries):
            for k, fn in cells.items():
                t = time.perf_counter()
                fn(i)
                ts[k].append((time.perf_counter() - t) * 1e3)
    single = {k: {"p50_ms": float(np.percentile(v, 50)), "p99_ms": float(np.percentile(v, 99)), "calls": len(v)}
              for k, v in ts.items()}  # fmt: skip
    changed = sum(int(not np.array_equal(a, b)) for a, b in zip(
        (search(bank, Q[i : i + 1], user, hyb_cfg, backend=be, query_texts=qt[i : i + 1]).ids for i in range(50)),
        (search(bank, Q[i : i + 1], user, ctx_cfg, backend=be, query_texts=qt[i : i + 1]).ids for i in range(50)),
    ))  # fmt: skip
    bank = wl = None  # (freed before the batch bank is built)
    gc.collect()

    # ---------------------------------------------------------------- multi-tenant batch
    batch = None
    if not args.skip_batch:
        wlb = synthetic_bank(args.users, args.chunks, SyntheticSpec(dim=384), seed=2)
        tx = zipf_texts(args.users * args.chunks, args.words, vocab, 1.07, rng)
        bankb = _threaded(wlb.bank, tx, args.session)
        del wlb
        gc.collect()
        snapb = bankb.snapshot()
        lex = snapb.lexical
        for u in range(snapb.num_users):  # every user's postings built before the timed calls (an index build)
            lex.postings(u)
        users = list(bankb.users)
        qu = [users[int(j)] for j in rng.integers(len(users), size=args.batch)]
        rows = np.array([snapb.offsets[bankb.user_index(u)] for u in qu]) + rng.integers(args.chunks, size=args.batch)
        Qb = snapb.vectors[rows] + 0.05 * rng.normal(size=(args.batch, 384)).astype(np.float32)
        qtb = [" ".join(tx[int(r)].split()[:3]) + " " + e for r, e in zip(rows, zipf_texts(args.batch, 5, vocab, 1.07, rng))]
        del tx
        bcells = {
            "dense": lambda: search(bankb, Qb, qu, dense_cfg, mode="dense", backend=be),
            "hybrid": lambda: search(bankb, Qb, qu, hyb_cfg, backend=be, query_texts=qtb),
            "hybrid_context": lambda: search(bankb, Qb, qu, ctx_cfg, backend=be, query_texts=qtb),
        }
        for fn in bcells.values():
            fn()
        best = {k: float("inf") for k in bcells}
        for _ in range(args.batch_reps):
            for k, fn in bcells.items():
                t = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - t)
        batch = {k: {"qps": args.batch / v, "best_s": v} for k, v in best.items()}
        bankb = None
        gc.collect()

    import bm25s

    d_p50 = single["dense"]["p50_ms"]
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {**machine_info(), "platform": platform.platform(), "processor": platform.processor()},
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "uptime_after": _uptime(),
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "bm25s": getattr(bm25s, "__version__", None), "python": platform.python_version()},  # fmt: skip
        "workload": {"chunks": args.chunks, "dim": 384, "session_turns": args.session, "words_per_text": args.words,
                     "queries": args.queries, "reps": args.reps, "batch_users": args.users, "batch": args.batch,
                     "batch_reps": args.batch_reps, "backend": "native"},  # fmt: skip
        "configs": {"dense": "RFMemConfig(), mode dense", "hybrid": hyb_cfg.to_dict(), "hybrid_context": ctx_cfg.to_dict()},
        "single": single,
        "single_ratio_over_dense_p50": {k: v["p50_ms"] / d_p50 for k, v in single.items()},
        "single_queries_whose_ids_context_changed_of_50": changed,
        "batch": batch,
        "batch_ratio_over_dense_qps": None if batch is None else {k: v["qps"] / batch["dense"]["qps"] for k, v in batch.items()},
        "goals": {
            "single_context_over_dense_p50_max": 2.0,
            "batch_context_over_dense_qps_min": 0.5,
            "single_met": single["hybrid_context"]["p50_ms"] <= 2.0 * d_p50,
            "batch_met": None if batch is None else batch["hybrid_context"]["qps"] >= 0.5 * batch["dense"]["qps"],
        },
    }
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / f"context-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(doc, out)
    print(json.dumps({k: doc[k] for k in ("single_ratio_over_dense_p50", "batch_ratio_over_dense_qps", "goals")}, indent=1))
    print(json.dumps({"single": single, "batch": batch}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
