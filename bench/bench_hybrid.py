"""Cost of the lexical (BM25) channel against its cost targets, native backend, CPU.

Workload: ``rfmem bench``'s synthetic clustered vectors (d = 384, 8 centres per user)
with a synthetic text per item: ``--words`` (60) words drawn from a Zipf(``--zipf``
1.07) vocabulary of ``--vocab`` (30,000) pseudo-words whose 33 most frequent ranks are
bm25s's English stopwords (removed by the tokenizer, as real function words are). A
query text is 3 words of a random item's text plus 5 Zipf draws (the generator lives in
``rfmem_fast.bench.workloads``: ``zipf_vocab``, ``zipf_texts``, ``query_texts``, shared with
``rfmem bench``'s hybrid rows). Cells:

* ``single``: one user of ``--chunks`` (4,096) items, i.e. 1M tokens at 256 tokens
  per chunk (the ``bench_single_query.py`` workload), one query per call, ``--queries``
  calls after a warm-up, the cells taking turns every ``--block`` calls (``--reps``
  rounds), p50 ms. ``--block`` (default 20) times each cell in runs of consecutive
  queries, as an application making one kind of call runs; ``--block 1`` alternates call
  by call, where each call follows another cell's (the earlier runs' protocol: the dense
  call after rrf's and the other fusions' calls slows to about 1.6x its steady p50 here,
  which flatters every ratio over it):
  ``search(mode="dense")`` without the lexical channel
  against the same call with ``lexical_weight > 0`` for each fusion (the hybrid dense
  path), and the lexical scoring alone (tokenise + postings). Goal: hybrid p50 <= 1.1x dense.
* ``batch``: ``--users`` users x ``--chunks`` items (default 200 x 4,096: the target's
  1,000 users x 4,096 x 384 float32 is 6.3 GB of vectors plus 250M words of text, more
  than this machine holds next to other work; ``--users 1000`` runs it where it fits),
  ``--batch`` queries on random users per call, best of ``--reps`` calls (the cells taking
  turns call by call), q/s. Goal:
  hybrid q/s >= 0.85x dense (at 50 and at 200 users).
* ``single_breakdown_us``: where one convex-raw hybrid query's time goes beyond dense (p50
  us; the dense and the hybrid search in alternating blocks of ``--block`` queries, the
  stages timed by wrapping their calls): ``kernel_hits`` (tokenising, the postings,
  ``bm25_hits``; ``tokenise`` and ``bm25_hits`` also apart), the hybrid probe over the
  dense one (``probe_extra``: the hits' keys, the boosts, the fused list) and the rest
  (``rest_extra``: Python around them).
* ``batch_breakdown_ms``: where the recommended fusion's (convex raw) batch spends its
  time beyond dense: the dense and the hybrid search alternating (best of ``--reps`` + 4
  each), the stages timed inside them by wrapping the calls: tokenising
  (``LexicalIndex.encode_queries``), ``Backend.bm25_hits``, the dense search's probe
  (``Backend.probe_host``) and the hybrid's (``Backend.probe_hits``: the hits' keys, the
  boosts and the fused lists), ms each.
* ``index``: bytes of the lexical index per token (forward CSR + every user's postings)
  and build time per million tokens (tokenising + encoding at add time, the snapshot's
  forward index, the postings of every user).

Usage::

    python bench/bench_hybrid.py [--users 200] [--queries 200] [--dtype float32] [--out bench/results/local/hybrid-<time>.json]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.bench.report import write_json
from rfmem_fast.bench.timing import interleaved_best, interleaved_p50
from rfmem_fast.bench.workloads import (
    SyntheticSpec,
    bank_with_texts,
    query_texts,
    synthetic_bank,
    zipf_texts,
    zipf_vocab,
)
from rfmem_fast.evaluate import machine_info

#: goals: one query's hybrid p50 at most this times dense's; the batch's q/s at least this times dense's
SINGLE_GOAL, BATCH_GOAL = 1.1, 0.85

#: the fusions timed (the lexical weights of the hybrid guide's cost table)
FUSIONS = {
    "convex_max": dict(lexical_weight=0.2, fusion="convex", lexical_norm="max"),
    "convex_raw": dict(lexical_weight=0.03, fusion="convex", lexical_norm="raw"),  # recommended(), MiniLM
    "adaptive": dict(lexical_weight=0.2, fusion="adaptive"),
    "zscore": dict(lexical_weight=0.1, fusion="zscore"),  # recommended(), MPNet
    "rrf": dict(lexical_weight=1.0, fusion="rrf", lexical_rrf_k=10.0, lexical_depth=100),
}


@contextlib.contextmanager
def timed_stages(be) -> Iterator[dict]:
    """Wrap the hybrid path's stages (tokenising, ``KernelHits.of``, ``bm25_hits``, the dense
    and the hybrid probe) so that each call's seconds are appended to the yielded dict's
    lists (keys: tokenise, kernel_hits, bm25_hits, probe_dense, probe_hybrid); restored on exit."""
    from rfmem_fast.lexical import LexicalIndex
    from rfmem_fast.search_lexical import KernelHits

    cls = type(be)
    wrapped = {"tokenise": (LexicalIndex, "encode_queries"), "kernel_hits": (KernelHits, "of"),
               "bm25_hits": (cls, "bm25_hits"), "probe_dense": (cls, "probe_host"),
               "probe_hybrid": (cls, "probe_hits")}  # fmt: skip
    got: dict = {k: [] for k in wrapped}
    saved = {k: owner.__dict__[name] for k, (owner, name) in wrapped.items()}

    def timed(key, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                got[key].append(time.perf_counter() - t)

        return call

    try:
        for k, (owner, name) in wrapped.items():
            f = saved[k]
            setattr(owner, name, classmethod(timed(k, f.__func__)) if isinstance(f, classmethod) else timed(k, f))
        yield got
    finally:
        for k, (owner, name) in wrapped.items():
            setattr(owner, name, saved[k])


def batch_breakdown(bank: MemoryBank, Q: np.ndarray, users: list, texts: list, be, reps: int) -> dict:
    """ms per stage of one batch: the dense and the convex-raw hybrid search alternating
    ``reps`` times, best of each, with the stages' calls wrapped and timed in place."""
    cfg, hc = RFMemConfig(), RFMemConfig(**FUSIONS["convex_raw"])
    with timed_stages(be) as got:
        got.update(dense_search=[], hybrid_search=[])
        for _ in range(reps):
            t = time.perf_counter()
            search(bank, Q, users, cfg, mode="dense", backend=be)
            got["dense_search"].append(time.perf_counter() - t)
            t = time.perf_counter()
            search(bank, Q, users, hc, mode="dense", backend=be, query_texts=texts)
            got["hybrid_search"].append(time.perf_counter() - t)
    out = {k: 1e3 * min(v) for k, v in got.items() if v and k != "kernel_hits"}
    if "probe_dense" in out and "probe_hybrid" in out:
        out["probe_extra"] = out["probe_hybrid"] - out["probe_dense"]
    return out


def single_breakdown(bank: MemoryBank, Q: np.ndarray, user: list, texts: list, be, reps: int, block: int) -> dict:
    """us per stage of one query (p50): the dense and the convex-raw hybrid search in
    alternating blocks of ``block`` consecutive queries, ``reps`` rounds over the queries,
    the stages' calls wrapped and timed in place. ``kernel_hits``: tokenising, the users'
    postings and ``bm25_hits``; ``probe_extra``: the hybrid probe (with the hits' keys, the
    boosts and the fused list) over the dense one; ``rest_extra``: what the hybrid search
    adds beyond both (Python around them)."""
    cfg, hc = RFMemConfig(), RFMemConfig(**FUSIONS["convex_raw"])
    n = Q.shape[0]
    with timed_stages(be) as got:
        got.update(dense_search=[], hybrid_search=[])
        for _ in range(reps):
            for i0 in range(0, n, block):
                for key, c, tx in (("dense_search", cfg, False), ("hybrid_search", hc, True)):
                    for i in range(i0, min(n, i0 + block)):
                        t = time.perf_counter()
                        search(bank, Q[i : i + 1], user, c, mode="dense", backend=be,
                               query_texts=texts[i : i + 1] if tx else None)  # fmt: skip
                        got[key].append(time.perf_counter() - t)
    out = {k: 1e6 * float(np.median(v)) for k, v in got.items() if v}
    if all(k in out for k in ("probe_dense", "probe_hybrid", "kernel_hits", "dense_search", "hybrid_search")):
        out["probe_extra"] = out["probe_hybrid"] - out["probe_dense"]
        out["rest_extra"] = out["hybrid_search"] - out["dense_search"] - out["kernel_hits"] - out["probe_extra"]
    return out


def index_cost(bank: MemoryBank, t_encode: float) -> dict:
    """Bytes per token and build time per million tokens of ``bank``'s lexical index."""
    snap = bank.snapshot()
    lex = snap.lexical
    tokens = int(np.asarray(lex.tf, dtype=np.int64).sum())
    fwd = int(lex.ptr.nbytes + lex.terms.nbytes + lex.tf.nbytes + lex.has_text.nbytes)
    t = time.perf_counter()
    post = 0
    for u in range(snap.num_users):
        post += lex.postings(u).nbytes
    t_post = time.perf_counter() - t
    return {
        "tokens": tokens,
        "items": snap.num_items,
        "vocabulary": len(lex.vocab),
        "forward_bytes": fwd,
        "postings_bytes": post,
        "bytes_per_token": (fwd + post) / tokens,
        "forward_bytes_per_token": fwd / tokens,
        "postings_bytes_per_token": post / tokens,
        "encode_s": t_encode,
        "postings_s": t_post,
        "build_s_per_million_tokens": (t_encode + t_post) / tokens * 1e6,
        "encode_s_per_million_tokens": t_encode / tokens * 1e6,
        "postings_s_per_million_tokens": t_post / tokens * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the cells; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--block", type=int, default=20, help="single: calls of one cell in a row (1: call by call)")
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--zipf", type=float, default=1.07)
    p.add_argument("--dtype", default="float32", help="the banks' dtype (float32, float16, bfloat16, int8)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "native" not in rfmem_fast.available_backends():
        p.error("the native backend is not built")
    be = get_backend("native")
    rng = np.random.default_rng(0)
    vocab = zipf_vocab(args.vocab)

    # ---------------------------------------------------------------- single query, 1M tokens
    wl = synthetic_bank(1, args.chunks, SyntheticSpec(dim=384), seed=0)
    texts = zipf_texts(args.chunks, args.words, vocab, args.zipf, rng)
    t = time.perf_counter()
    bank_with_texts(wl.bank, None, dtype=args.dtype).snapshot()
    t_plain = time.perf_counter() - t
    t = time.perf_counter()
    bank = bank_with_texts(wl.bank, texts, dtype=args.dtype)
    bank.snapshot()
    t_encode1 = max(time.perf_counter() - t - t_plain, 0.0)
    Q, _, _ = wl.queries(args.queries, seed=1)
    qt = query_texts(texts, args.queries, vocab, args.zipf, rng)
    user = [wl.users[0]]
    n = args.queries
    cfg = RFMemConfig()
    lex = bank.snapshot().lexical
    cells = {
        "dense": lambda i: search(bank, Q[i : i + 1], user, cfg, mode="dense", backend=be),
        "lexical_scoring_only": lambda i: lex.scores(0, qt[i]),
    }
    for name, fz in FUSIONS.items():
        c = RFMemConfig(**fz)
        cells[name] = lambda i, c=c: search(bank, Q[i : i + 1], user, c, mode="dense", backend=be,
                                            query_texts=qt[i : i + 1])  # fmt: skip
    single = interleaved_p50(cells, n, args.reps, block=args.block)
    single_bd = single_breakdown(bank, Q, user, qt, be, args.reps, args.block)
    hits = [0 if (v := lex.scores(0, q)) is None else int(np.count_nonzero(v)) for q in qt]
    index1 = index_cost(bank_with_texts(wl.bank, texts), t_encode1)
    del bank, wl, lex
    gc.collect()

    # ---------------------------------------------------------------- multi-tenant batch
    wlb = synthetic_bank(args.users, args.chunks, SyntheticSpec(dim=384), seed=2)
    tx = zipf_texts(args.users * args.chunks, args.words, vocab, args.zipf, rng)
    t = time.perf_counter()
    bank_with_texts(wlb.bank, None, dtype=args.dtype).snapshot()
    t_plain_b = time.perf_counter() - t
    gc.collect()
    t = time.perf_counter()
    bankb = bank_with_texts(wlb.bank, tx, dtype=args.dtype)
    bankb.snapshot()
    t_encode_b = max(time.perf_counter() - t - t_plain_b, 0.0)
    del wlb
    gc.collect()
    indexb = index_cost(bankb, t_encode_b)  # every user's postings built here, before the searches
    users = list(bankb.users)
    qu = [users[int(j)] for j in rng.integers(len(users), size=args.batch)]
    snapb = bankb.snapshot()
    rows = np.array([snapb.offsets[bankb.user_index(u)] for u in qu]) + rng.integers(args.chunks, size=args.batch)
    Qb = snapb.vectors[rows] + 0.05 * rng.normal(size=(args.batch, 384)).astype(np.float32)
    qtb = [" ".join(tx[int(r)].split()[:3]) + " " + e for r, e in zip(rows, zipf_texts(args.batch, 5, vocab, args.zipf, rng))]
    bcells = {"dense": lambda: search(bankb, Qb, qu, cfg, mode="dense", backend=be)}
    for name in FUSIONS:
        c = RFMemConfig(**FUSIONS[name])
        bcells[name] = lambda c=c: search(bankb, Qb, qu, c, mode="dense", backend=be, query_texts=qtb)
    batch = {k: args.batch / v for k, v in interleaved_best(bcells, args.reps).items()}
    breakdown = batch_breakdown(bankb, Qb, qu, qtb, be, args.reps + 4)

    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        up = None
    import bm25s

    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "loadavg": list(os.getloadavg()),
        "uptime": up,
        "versions": {"rfmem_fast": rfmem_fast.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "bm25s": getattr(bm25s, "__version__", None)},  # fmt: skip
        "workload": {"chunks": args.chunks, "dim": 384, "dtype": args.dtype, "words_per_text": args.words, "vocab": args.vocab,
                     "zipf": args.zipf, "queries": n, "single_block": args.block, "batch_users": args.users, "batch": args.batch,
                     "mean_lexical_hits_single": float(np.mean(hits)), "fusions": FUSIONS},  # fmt: skip
        "single_p50_ms": single,
        "single_ratio_over_dense": {k: v / single["dense"] for k, v in single.items() if k in FUSIONS},
        "single_breakdown_us": single_bd,
        "batch_qps": batch,
        "batch_ratio_over_dense": {k: v / batch["dense"] for k, v in batch.items() if k != "dense"},
        "batch_breakdown_ms": breakdown,
        "index_single_user": index1,
        "index_batch_bank": indexb,
        "goals": {
            "single_hybrid_over_dense_p50_max": SINGLE_GOAL,
            "batch_hybrid_over_dense_qps_min": BATCH_GOAL,
            "single_met": {k: v / single["dense"] <= SINGLE_GOAL for k, v in single.items() if k in FUSIONS},
            "batch_met": {k: v / batch["dense"] >= BATCH_GOAL for k, v in batch.items() if k != "dense"},
        },
    }
    out = Path(args.out) if args.out else Path(__file__).with_name("results") / "local" / f"hybrid-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(doc, out)
    print(json.dumps({k: doc[k] for k in ("single_p50_ms", "single_ratio_over_dense", "single_breakdown_us", "batch_qps",
                                          "batch_ratio_over_dense", "batch_breakdown_ms")}, indent=1))  # fmt: skip
    print(f"index: {index1['bytes_per_token']:.2f} B/token, build {index1['build_s_per_million_tokens']:.2f} s/M tokens "
          f"(single user); batch bank {indexb['bytes_per_token']:.2f} B/token; wrote {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
