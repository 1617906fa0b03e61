"""Does recollection pay on top of the recommended first stage? Nested CV of three Recollection paths.

The question (docs "Retrieval quality", "Recollection on the fused scores"): the paper's
Recollection path starts from the dense probe and scores its rounds densely. Started from
the recommended first stage instead (dense + 0.03 x BM25 + the conversation context, no
second stage), does routing some queries to it find more of the evidence than the first
stage alone?

Per question (PersonaBench at each noise level, the LoCoMo conversations in ../shared) it
computes Recall@k of

* ``first``: ``RFMemConfig.recommended(encoder, second_stage=None)``'s top k;
* ``reco_dense``: the paper's Recollection path (``RFMemConfig()``, mode "recollection":
  the dense probe's start, dense rounds);
* ``reco_start``: the same beam (the native driver, :func:`rfmem_fast.recollection.recollect`)
  whose first round takes the first stage's list (its top ``probe_k`` rows and their
  context scores) instead of the dense probe; later rounds dense;
* ``reco_fused``: every round fused (:func:`fused_beam`, spec section 4 with one change:
  a branch query ``q`` scores row ``x`` by the first stage's score with ``q`` in place of
  the original query in the dense term: ``b(x) = q . x + w BM25(q0_text, x)`` and the
  context score ``c(x) = b(x) + w_n max_{N(x)} b + w_s max_{T(x)} b`` of
  :mod:`rfmem_fast.context`, float64, every row of the user's memory; KMeans as the
  reference: scikit-learn, ``random_state = seed``).

and the routed pipelines: a query recollects when the spec's rule (section 2) on the first
stage's own signals says so (``mean`` and the temperature-softmax ``entropy`` of its top
``probe_k`` context scores). The thresholds (a grid) and the path are chosen by **nested
leave-one-user-out**: for each held-out user (a PersonaBench person at every noise level, a
LoCoMo conversation) the pick maximises ``mean_c g_c + min_c g_c`` (``g_c``: the mean
Recall@k gain over ``first`` on condition c) over the other users only, then scores the
held-out user's questions. "never" (no recollection) is a candidate, so the procedure may
decline. The oracle (the better of ``first`` and a path, per question) bounds what any
router could get.

Usage::

    python bench/bench_fused_recollection.py --encoder minilm \\
        --personabench ../shared/data/personabench --locomo ../shared/data/locomo \\
        --out bench/results/fused-recollection-minilm.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

PATHS = ("reco_dense", "reco_start", "reco_fused")
THETA_HIGH = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)
THETA_LOW = (-1.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
TAU = (0.0, 0.1, 0.15, 0.2, 0.22, 1.0)


def context_scores(base: np.ndarray, order: list[np.ndarray], radius: int, w_n: float, w_s: float) -> np.ndarray:
    """The context score of every row of one user (:mod:`rfmem_fast.context`'s definition, float64).

    Args:
        base: float64 [n_u] base scores of the user's rows.
        order: the user's threads, each int [m] local rows in (position, row) order (a row
            without a thread is a thread of its own).
        radius, w_n, w_s: ``context_radius``, ``context_weight``, ``thread_weight``.

    Returns:
        float64 [n_u].
    """
    c = base.copy()
    for t in order:
        b = base[t]
        m = b.shape[0]
        nb = np.full(m, -np.inf)
        for o in range(1, radius + 1):
            if o < m:
                nb[:-o] = np.maximum(nb[:-o], b[o:])
                nb[o:] = np.maximum(nb[o:], b[:-o])
        nb = np.where(np.isfinite(nb), nb, 0.0)
        c[t] = b + w_n * nb + w_s * b.max()
    return c


def thread_order(snap: Any, lo: int, hi: int) -> list[np.ndarray]:
    """The threads of rows [lo, hi) of a snapshot as local row lists in (position, row) order
    (no position last; the engine's order, :func:`rfmem_fast.context._thread_order`), then each
    row without a thread alone."""
    from rfmem_fast.context import NO_POSITION, _thread_order

    n = hi - lo
    th = [None] * n if snap.threads is None else list(snap.threads[lo:hi])
    rows = np.array([i for i in range(n) if th[i] is not None], dtype=np.int64)
    alone = [np.array([i]) for i in range(n) if th[i] is None]
    if rows.size == 0:
        return alone
    pos = np.full(n, NO_POSITION, dtype=np.int64) if snap.positions is None else np.asarray(snap.positions[lo:hi])
    srt, code = _thread_order([th[i] for i in rows], pos[rows], rows)
    return np.split(srt, np.flatnonzero(np.diff(code)) + 1) + alone


def fused_beam(X: np.ndarray, q0: np.ndarray, beta: np.ndarray, order: list[np.ndarray], cfg: Any, start: tuple) -> list[int]:
    """The Recollection path (spec section 4) with every round scored by the first stage's context score.

    Args:
        X: float64 [n_u, d] the user's rows; q0: float64 [d] the query; beta: float64 [n_u] its
            lexical boosts ``w BM25``; order: :func:`thread_order`; cfg: the RFMemConfig of the
            beam (alpha, beam_width, fanout, max_rounds, mmr_lambda, score_floor, out_k,
            kmeans_seed) and of the context (context_radius, context_weight, thread_weight).
        start: (local rows int [k0], scores float [k0]) the first round's candidates (the first
            stage's list).

    Returns:
        the first out_k local rows in order of discovery.
    """
    from sklearn.cluster import KMeans

    B, F, R = cfg.beam_width, cfg.fanout, cfg.max_rounds
    beam = [(q0, 0.0)]
    seen: set[int] = set()
    results: list[int] = []
    for level in range(R):
        children = []
        n_l = (B + level) * F
        for q, acc in beam:
            if level == 0:
                rows, sc = start
                keep = [(int(r), float(s)) for r, s in zip(rows, sc) if r >= 0 and int(r) not in seen
                        and s >= cfg.score_floor][:n_l]  # fmt: skip
            else:
                c = context_scores(X @ q + beta, order, cfg.context_radius, cfg.context_weight, cfg.thread_weight)
                idx = np.lexsort((np.arange(c.shape[0]), -c))
                keep = []
                for r in idx:
                    if len(keep) == n_l:
                        break
                    if int(r) not in seen and c[r] >= cfg.score_floor:
                        keep.append((int(r), float(c[r])))
            if not keep:
                continue
            rows = np.array([r for r, _ in keep])
            sc = np.array([s for _, s in keep])
            V = X[rows]
            if cfg.mmr_lambda < 1 and len(rows) > 1:
                S = V @ V.T
                np.fill_diagonal(S, -np.inf)
                sc = cfg.mmr_lambda * sc - (1 - cfg.mmr_lambda) * S.max(axis=1)
            kc = min(B, len(rows))
            labels = KMeans(n_clusters=kc, random_state=cfg.kmeans_seed, n_init="auto").fit(V).labels_ if kc > 1 \
                else np.zeros(len(rows), dtype=int)  # fmt: skip
            for lab in range(kc):
                mem = np.flatnonzero(labels == lab)
                if mem.size == 0:
                    continue
                cen = V[mem].mean(axis=0)
                cen /= max(np.linalg.norm(cen), 1e-30)
                child = cfg.alpha * q + (1 - cfg.alpha) * cen + q0
                child /= max(np.linalg.norm(child), 1e-30)
                children.append((child, acc + float(sc[mem].sum()), [(int(rows[m]), float(sc[m])) for m in mem]))
        if not children:
            break
        order_c = sorted(range(len(children)), key=lambda i: -children[i][1])[:B]
        beam = []
        for i in order_c:
            q, acc, hits = children[i]
            beam.append((q, acc))
            for r, _ in hits:
                if r not in seen:
                    seen.add(r)
                    results.append(r)
        if len(results) >= cfg.out_k:
            break
    return results[: cfg.out_k]


def signals(sc: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, "mean"-convention entropy and count (spec section 1,
    :func:`rfmem_fast.signals.familiarity_signals`) of rows of scores [b, K] (-inf padding)."""
    import torch

    from rfmem_fast.signals import familiarity_signals

    return tuple(t.numpy() for t in familiarity_signals(torch.from_numpy(np.asarray(sc, dtype=np.float64)), temperature))


def route_rules() -> list[tuple[float, float, float]]:
    """The threshold grid (theta_high, theta_low, tau) with theta_low < theta_high."""
    return [(h, lo, t) for h in THETA_HIGH for lo in THETA_LOW if lo < h for t in TAU]


def routes(mean: np.ndarray, ent: np.ndarray, count: np.ndarray, rule: tuple[float, float, float]) -> np.ndarray:
    """bool [b]: recollect under the spec's router (section 2,
    :func:`rfmem_fast.routing.threshold.route_by_thresholds`) with these thresholds."""
    from rfmem_fast.routing.base import RECOLLECTION
    from rfmem_fast.routing.threshold import route_by_thresholds

    return np.asarray(route_by_thresholds(mean, ent, count, *rule)[0]) == RECOLLECTION


def run_condition(cond: Any, encoder: str, say: Any) -> dict[str, Any]:
    """Every question's Recall@k under each path, and the first stage's signals."""
    import torch

    from rfmem_fast.backends import get_backend
    from rfmem_fast.config import RFMemConfig
    from rfmem_fast.datasets.embedded import dataset_embeddings, default_embedding_cache_dir
    from rfmem_fast.evaluate_datasets import score_result, search_dataset
    from rfmem_fast.models import recommended_alias
    from rfmem_fast.recollection import recollect
    from rfmem_fast.search_lexical import lexical_hits

    ds = cond.dataset
    emb = dataset_embeddings(ds, encoder=encoder, cache_dir=default_embedding_cache_dir(), say=say)
    qrows = np.array([i for i, q in enumerate(ds.questions) if q.scored], dtype=np.int64)
    first = RFMemConfig.recommended(recommended_alias(encoder), second_stage=None)
    paper = RFMemConfig()
    k = first.out_k
    res = search_dataset(emb, qrows, first, "rfmem")
    out: dict[str, Any] = {"first": score_result(ds, qrows, res, k)["recall"]}
    out["reco_dense"] = score_result(ds, qrows, search_dataset(emb, qrows, paper, "recollection"), k)["recall"]
    snap = emb.bank.snapshot()
    rows = np.asarray(res.rows)
    csc = np.asarray(res.context_scores, dtype=np.float64) if res.context_scores is not None else None
    base = np.asarray(res.scores, dtype=np.float64)
    lsc = base if csc is None else np.where(np.isfinite(csc), csc, base)
    lsc = np.where(rows >= 0, lsc, -np.inf)
    out["mean"], out["entropy"], out["count"] = signals(lsc[:, : first.probe_k], first.temperature)

    def score_rows(rr: list[list[int]]) -> np.ndarray:
        return np.array([ds.score(ds.questions[int(i)], [str(snap.item_ids[r]) for r in row][:k], k)["recall"]
                         for i, row in zip(qrows, rr)])  # fmt: skip

    be = get_backend("native")
    view = be.view(emb.bank)
    seg = np.array([emb.bank.user_index(emb.users[i]) for i in qrows], dtype=np.int64)
    Q = np.ascontiguousarray(emb.Q[qrows], dtype=np.float32)
    l0 = (torch.from_numpy(lsc[:, : first.probe_k].astype(np.float32)), torch.from_numpy(rows[:, : first.probe_k].copy()))
    o = recollect(be, view, torch.from_numpy(Q), torch.from_numpy(seg), paper, level0=l0)
    out["reco_start"] = score_rows([[int(r) for r in row if r >= 0] for row in o.rows.numpy()])
    t0 = time.perf_counter()
    cfg = paper.replace(context_radius=first.context_radius, context_weight=first.context_weight,
                        thread_weight=first.thread_weight)  # fmt: skip
    hits = lexical_hits(snap, seg, [ds.questions[int(i)].text for i in qrows])
    X64 = snap.vectors.astype(np.float64)
    orders: dict[int, list[np.ndarray]] = {}
    found = []
    for j in range(len(qrows)):
        u = int(seg[j])
        lo_, hi_ = int(snap.offsets[u]), int(snap.offsets[u + 1])
        if u not in orders:
            orders[u] = thread_order(snap, lo_, hi_)
        beta = np.zeros(hi_ - lo_)
        if hits[j] is not None:
            beta = first.lexical_weight * hits[j][1]
        start = (rows[j, : first.probe_k] - lo_, lsc[j, : first.probe_k])
        start = (np.where(rows[j, : first.probe_k] >= 0, start[0], -1), start[1])
        loc = fused_beam(X64[lo_:hi_], Q[j].astype(np.float64), beta, orders[u], cfg, start)
        found.append([r + lo_ for r in loc])
    out["reco_fused"] = score_rows(found)
    out["fused_seconds"] = time.perf_counter() - t0
    out["users"] = np.array([f"{cond.group}{ds.questions[int(i)].user_key}" for i in qrows], dtype=object)
    say(f"{cond.label}: first {out['first'].mean():.4f} " + " ".join(f"{p} {out[p].mean():.4f}" for p in PATHS))
    return out


def nested(data: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Nested leave-one-user-out choice of (path, thresholds) or "never" (module docstring)."""
    users = sorted({u for d in data for u in d["users"].tolist()})
    rules = route_rules()
    # gains[c][p][r]: float [nq] per-question gain of path p routed by rule r on condition c
    cands = [("never", None)] + [(p, r) for p in PATHS for r in rules]
    G = []
    for d in data:
        rows = []
        for p, r in cands:
            if p == "never":
                rows.append(np.zeros(d["first"].shape[0]))
            else:
                m = routes(d["mean"], d["entropy"], d["count"], r)
                rows.append(np.where(m, d[p] - d["first"], 0.0))
        G.append(np.array(rows))  # [cands, nq]
    masks = [{u: d["users"] == u for u in users} for d in data]

    def objective(train: list[str]) -> np.ndarray:
        per = []
        for g, mk in zip(G, masks):
            sel = np.zeros(g.shape[1], dtype=bool)
            for u in train:
                sel |= mk[u]
            if sel.any():
                per.append(g[:, sel].mean(axis=1))
        P = np.array(per)  # [conditions, cands]
        return P.mean(axis=0) + P.min(axis=0)

    held = [np.zeros(d["first"].shape[0]) for d in data]
    picks = {}
    for u in users:
        ci = int(np.argmax(objective([v for v in users if v != u])))  # first maximum: "never" wins ties
        picks[u] = cands[ci][0] if cands[ci][1] is None else f"{cands[ci][0]} {cands[ci][1]}"
        for c, (g, mk) in enumerate(zip(G, masks)):
            held[c][mk[u]] = g[ci][mk[u]]
    allpick = int(np.argmax(objective(users)))
    from rfmem_fast.tuning import gain_se

    return {
        "nested_gain_points": {lab: 100 * float(h.mean()) for lab, h in zip(labels, held)},
        "nested_gain_se_points": {lab: 100 * gain_se(h) for lab, h in zip(labels, held)},
        "picks": picks,
        "all_user_pick": cands[allpick][0] if cands[allpick][1] is None else f"{cands[allpick][0]} {cands[allpick][1]}",
        "rules": len(rules),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every condition, print the table, write the JSON (module docstring)."""
    from rfmem_fast.datasets import load_locomo, load_personabench
    from rfmem_fast.tuning_datasets import DatasetCondition

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", default="minilm", help="minilm | mpnet (default minilm)")
    ap.add_argument("--personabench", default=None, help="PersonaBench folder")
    ap.add_argument("--noise", default="0.0,0.3,0.5,0.7", help="comma list of noise levels")
    ap.add_argument("--locomo", default=None, help="LoCoMo folder")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    if not (args.personabench or args.locomo):
        ap.error("give at least one of --personabench, --locomo")
    conds = []
    if args.personabench:
        conds += [DatasetCondition(f"pb {n}", load_personabench(args.personabench, noise=float(n)), args.encoder, "pb:")
                  for n in args.noise.split(",")]  # fmt: skip
    if args.locomo:
        conds.append(DatasetCondition("locomo", load_locomo(args.locomo), args.encoder, "locomo:"))
    say = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    data = [run_condition(c, args.encoder, say) for c in conds]
    labels = [c.label for c in conds]
    nest = nested(data, labels)
    table = {lab: {"first": float(d["first"].mean()), **{p: float(d[p].mean()) for p in PATHS},
                   **{f"oracle_{p}": float(np.maximum(d["first"], d[p]).mean()) for p in PATHS},
                   "questions": int(d["first"].shape[0]), "fused_beam_seconds": d["fused_seconds"]}
             for lab, d in zip(labels, data)}  # fmt: skip
    print(f"{'':12}" + "".join(f"{lab:>10}" for lab in labels))
    for key in ("first",) + PATHS + tuple(f"oracle_{p}" for p in PATHS):
        print(f"{key:12}" + "".join(f"{table[lab][key]:10.4f}" for lab in labels))
    print(f"{'nested gain':12}" + "".join(f"{nest['nested_gain_points'][lab]:+10.2f}" for lab in labels))
    print(f"{'  (s.e.)':12}" + "".join(f"{nest['nested_gain_se_points'][lab]:10.2f}" for lab in labels))
    print("all-user pick:", nest["all_user_pick"])
    from rfmem_fast.evaluate import machine_info

    doc = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_info(),
           "encoder": args.encoder, "k": 10, "recall": table, "routed": nest, "seconds": time.perf_counter() - t0}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
