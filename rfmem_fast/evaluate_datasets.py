"""Evaluation of any dataset of the loader interface (LoCoMo, LongMemEval, PersonaBench).

:func:`evaluate_dataset` is the building block: one dataset, one configuration, one mode
-> per-question metric arrays (with the users and categories, for cross-validation and
cross-dataset tuning). :func:`run_dataset` runs several modes and cut-offs and builds the
report ``rfmem eval locomo`` / ``rfmem eval longmemeval`` print (:func:`format_dataset_report`)
and write (:func:`dataset_report_json`, :func:`dataset_records`).

The items and questions are embedded with the encoder through the embedding cache of
:func:`rfmem_fast.datasets.embedded.dataset_embeddings`; the bank holds the item texts;
the search is :func:`rfmem_fast.search.search`. When the configuration has a lexical
channel (``getattr(config, "lexical_weight", 0.0) > 0``) the question texts are passed
as ``query_texts``; otherwise the call is the dense-only one.

(``rfmem eval personabench`` keeps its own job, :func:`rfmem_fast.evaluate.run_personabench`,
with the golden-file records, routers fitted by CV and the latency loop.)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .config import RFMemConfig
from .datasets.embedded import DatasetEmbeddings, dataset_embeddings, default_embedding_cache_dir
from .evaluate import describe_config, mode_label, query_texts_kw, write_records
from .metrics import OVERALL
from .search import MODES, SearchResult, search

__all__ = [
    "DatasetScores",
    "DatasetReport",
    "evaluate_dataset",
    "score_result",
    "search_dataset",
    "run_dataset",
    "aggregate_metrics",
    "format_dataset_report",
    "dataset_report_json",
    "dataset_records",
]

_DEFAULT_CACHE = object()


@dataclass
class DatasetScores:
    """Per-question figures of one (dataset, config, mode, k), scored questions only.

    Attributes:
        metrics: {metric name: float64 [n]} (``dataset.metric_names``), row i = scored question i.
        users: object ndarray [n], the user key of each scored question.
        categories: object ndarray [n], each question's category.
        qids: object ndarray [n], question ids.
        index: int64 [n], row of each scored question in ``dataset.questions``.
        result: the SearchResult of the scored questions (rows aligned with the arrays).
        k: the cut-off (int); mode: the mode (str); seconds: wall time of the search.
    """

    metrics: dict[str, np.ndarray]
    users: np.ndarray
    categories: np.ndarray
    qids: np.ndarray
    index: np.ndarray
    result: SearchResult
    k: int
    mode: str
    seconds: float = 0.0

    @property
    def recall(self) -> np.ndarray:
        """float64 [n]: the dataset's Recall@k per scored question (``metrics["recall"]``)."""
        return self.metrics["recall"]


def _embeddings(dataset: Any, encoder_or_embeddings: Any, cache_dir: Any, say: Callable[[str], None]) -> DatasetEmbeddings:
    if isinstance(encoder_or_embeddings, DatasetEmbeddings):
        if encoder_or_embeddings.dataset is not dataset:
            raise ValueError("encoder_or_embeddings: these embeddings were built for another dataset object")
        return encoder_or_embeddings
    cache = default_embedding_cache_dir() if cache_dir is _DEFAULT_CACHE else cache_dir
    return dataset_embeddings(dataset, encoder=encoder_or_embeddings, cache_dir=cache, say=say)


def search_dataset(
    emb: DatasetEmbeddings, rows: np.ndarray, config: RFMemConfig, mode: str, backend: str = "auto"
) -> SearchResult:
    """Search the questions ``rows`` (int indices into ``emb.dataset.questions``) in their users' memories.

    Passes ``query_texts`` (the question texts) only when the config reads them (``lexical_weight > 0`` or a second stage)
    (a configuration without that field searches densely).

    Returns:
        SearchResult, row j = question ``rows[j]``.

    Raises:
        ValueError: as :func:`rfmem_fast.search.search` (unknown mode, bad config).
    """
    rows = np.asarray(rows, dtype=np.int64)
    qs = emb.dataset.questions
    kwargs = query_texts_kw(config, [qs[i].text for i in rows])
    return search(emb.bank, emb.Q[rows], [emb.users[i] for i in rows], config, mode=mode, backend=backend, **kwargs)


def score_result(dataset: Any, rows: np.ndarray, result: SearchResult, k: int) -> dict[str, np.ndarray]:
    """The dataset's metrics at k of each row of a SearchResult.

    Args:
        dataset: the dataset (its ``score`` and ``metric_names``).
        rows: int [n] question indices, ``result`` row j answering question ``rows[j]``.
        result: SearchResult of those questions.
        k: cut-off (int >= 1).

    Returns:
        {metric name: float64 [n]}.
    """
    names = tuple(dataset.metric_names)
    out = {m: np.zeros(len(rows), dtype=np.float64) for m in names}
    for j, i in enumerate(rows):
        got = dataset.score(dataset.questions[int(i)], [str(x) for x in result.ids_list(j)], k)
        for m in names:
            out[m][j] = got[m]
    return out


def evaluate_dataset(
    dataset: Any,
    encoder_or_embeddings: Any = None,
    config: RFMemConfig | None = None,
    mode: str = "rfmem",
    k: int | None = None,
    backend: str = "auto",
    cache_dir: Any = _DEFAULT_CACHE,
    users: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DatasetScores:
    """Search a dataset's scored questions with one configuration and mode; per-question metrics.

    Args:
        dataset: a dataset of the loader interface (:mod:`rfmem_fast.datasets.base`).
        encoder_or_embeddings: a :class:`~rfmem_fast.datasets.embedded.DatasetEmbeddings`
            of this very dataset (reused: nothing is encoded), or an encoder for
            :func:`~rfmem_fast.datasets.embedded.dataset_embeddings` (None / "minilm":
            the offline MiniLM, "mpnet", a folder, an object with ``encode``).
        config: RFMemConfig (default ``RFMemConfig()``).
        mode: "dense" | "recollection" | "rfmem".
        k: cut-off (default ``config.out_k``); a k above ``out_k`` searches with
            ``out_k = k`` (what a caller asking for k items gets).
        backend: backend name for :func:`rfmem_fast.search.search`.
        cache_dir: embedding cache folder (default: the user's cache; None: no cache).
        users: score only the questions of these user keys (e.g. a CV fold); default all.
        progress: optional callable receiving status lines.

    Returns:
        DatasetScores: ``.recall`` (float64 [n]), ``.metrics``, ``.users``,
        ``.categories``, ``.qids`` of the n scored questions, load order.

    Raises:
        ValueError: unknown mode, k < 1, no scored question (of ``users``), embeddings of
            another dataset; as :func:`rfmem_fast.search.search`.
        TypeError: ``dataset`` does not follow the interface.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    config = config or RFMemConfig()
    k = config.out_k if k is None else k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    k = int(k)
    emb = _embeddings(dataset, encoder_or_embeddings, cache_dir, progress or (lambda s: None))
    keep = None if users is None else set(users)
    rows = np.array(
        [i for i, q in enumerate(dataset.questions) if q.scored and (keep is None or q.user_key in keep)], dtype=np.int64
    )
    if rows.size == 0:
        raise ValueError(f"no scored question{'' if users is None else ' of the users ' + repr(sorted(keep or []))}")
    cfg = config if k <= config.out_k else config.replace(out_k=k)
    t0 = time.perf_counter()
    res = search_dataset(emb, rows, cfg, mode, backend)
    secs = time.perf_counter() - t0
    qs = dataset.questions
    return DatasetScores(
        metrics=score_result(dataset, rows, res, k),
        users=np.array([qs[i].user_key for i in rows], dtype=object),
        categories=np.array([qs[i].category for i in rows], dtype=object),
        qids=np.array([qs[i].qid for i in rows], dtype=object),
        index=rows, result=res, k=k, mode=mode, seconds=secs,
    )  # fmt: skip


def aggregate_metrics(categories: Sequence[str], metrics: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Means per category (first-seen order) and "Overall": ``{category: {metric: mean, "count": n}}``.

    Args:
        categories: n category labels.
        metrics: {metric: float [n]}.

    Returns:
        The dict (an empty input gives Overall with zeros and count 0).
    """
    cats = list(dict.fromkeys(str(c) for c in categories))
    carr = np.asarray([str(c) for c in categories], dtype=object)
    out: dict[str, dict[str, float]] = {}
    for c in cats + [OVERALL]:
        sel = np.ones(len(carr), dtype=bool) if c == OVERALL else carr == c
        n = int(sel.sum())
        out[c] = {m: (float(v[sel].mean()) if n else 0.0) for m, v in metrics.items()}
        out[c]["count"] = n
    return out


@dataclass
class DatasetReport:
    """What :func:`run_dataset` measured.

    Attributes:
        dataset: dataset name; scores: {mode: {k: DatasetScores}}; metrics_at: {mode: {k:
        aggregate_metrics}}; oracle_at: {k: aggregate} (per question the better of dense and
        recollection by (recall, ndcg)) when both ran; routes: {mode: {"familiarity": n,
        "recollection": n}}; batch_ms_per_query: {mode: ms}; k / ks: primary and all
        cut-offs; sizes, encoder, backend, config, stats and notes.
    """

    dataset: str
    scores: dict[str, dict[int, DatasetScores]]
    metrics_at: dict[str, dict[int, dict[str, dict[str, float]]]]
    oracle_at: dict[int, dict[str, dict[str, float]]]
    routes: dict[str, dict[str, int]]
    batch_ms_per_query: dict[str, float]
    k: int
    ks: list[int]
    n_users: int
    n_items: int
    n_questions: int
    n_scored: int
    metric_names: tuple[str, ...]
    encoder: str
    backend: str
    config: RFMemConfig
    embeddings_cached: bool
    encode_items_s: float
    stats: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)


def run_dataset(
    dataset: Any,
    modes: Sequence[str] = MODES,
    config: RFMemConfig | None = None,
    ks: Sequence[int] | None = None,
    encoder: Any = None,
    backend: str = "auto",
    cache_dir: Any = _DEFAULT_CACHE,
    progress: Callable[[str], None] | None = None,
) -> DatasetReport:
    """Every requested mode at every cut-off on one dataset (``rfmem eval locomo|longmemeval``).

    Args:
        dataset: a dataset of the loader interface.
        modes: subset of ("dense", "recollection", "rfmem"); with "rfmem" the other two
            also run (for the oracle).
        config: RFMemConfig (default ``RFMemConfig()``).
        ks: cut-offs (default ``[config.out_k]``); the first given is the primary one.
            A k above ``out_k`` is scored on a run with ``out_k = k`` (noted).
        encoder, backend, cache_dir, progress: as :func:`evaluate_dataset`.

    Returns:
        DatasetReport.

    Raises:
        ValueError: unknown mode, a k < 1; as :func:`evaluate_dataset`.
    """
    from .evaluate import machine_info

    config = config or RFMemConfig()
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be a subset of {MODES}, got {m!r}")
    ks_in = [int(x) for x in (ks or [config.out_k])]
    if any(x < 1 for x in ks_in):
        raise ValueError(f"every k must be >= 1, got {ks_in}")
    k = ks_in[0]
    ks_all = sorted(set(ks_in))
    say = progress or (lambda s: None)
    emb = _embeddings(dataset, encoder, cache_dir, say)
    run_modes = [m for m in MODES if m in modes or ("rfmem" in modes and m in ("dense", "recollection"))]
    scores: dict[str, dict[int, DatasetScores]] = {}
    metrics_at: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    routes: dict[str, dict[str, int]] = {}
    batch_ms: dict[str, float] = {}
    notes = list(getattr(dataset, "notes", []) or [])
    for kk in ks_all:
        if kk > config.out_k:
            notes.append(f"@{kk} figures come from a run with out_k={kk} (the config asks for {config.out_k})")
    for mode in run_modes:
        scores[mode] = {}
        base = None
        for kk in ks_all:
            if kk <= config.out_k and base is not None:  # same search, another cut-off
                s = DatasetScores(score_result(dataset, base.index, base.result, kk), base.users, base.categories,
                                  base.qids, base.index, base.result, kk, mode, base.seconds)  # fmt: skip
            else:
                s = evaluate_dataset(dataset, emb, config, mode, kk, backend)
                if kk <= config.out_k:
                    base = s
            scores[mode][kk] = s
        metrics_at[mode] = {kk: aggregate_metrics(s.categories, s.metrics) for kk, s in scores[mode].items()}
        first = scores[mode][min(ks_all, key=lambda x: (x > config.out_k, x))]
        names = first.result.route_names
        routes[mode] = {r: names.count(r) for r in ("familiarity", "recollection")}
        batch_ms[mode] = 1e3 * first.seconds / max(len(first.index), 1)
        say(f"{dataset.name} {mode_label(mode, config)}: Recall@{k} {metrics_at[mode][k][OVERALL]['recall']:.4f}")
    oracle_at: dict[int, dict[str, dict[str, float]]] = {}
    if "dense" in scores and "recollection" in scores:
        for kk in ks_all:
            d, r = scores["dense"][kk], scores["recollection"][kk]
            take_r = (r.metrics["recall"] > d.metrics["recall"]) | (
                (r.metrics["recall"] == d.metrics["recall"]) & (r.metrics["ndcg"] > d.metrics["ndcg"])
            )
            best = {m: np.where(take_r, r.metrics[m], d.metrics[m]) for m in d.metrics}
            oracle_at[kk] = aggregate_metrics(d.categories, best)
    return DatasetReport(
        dataset=str(dataset.name), scores=scores, metrics_at=metrics_at, oracle_at=oracle_at, routes=routes,
        batch_ms_per_query=batch_ms, k=k, ks=ks_all, n_users=emb.n_users, n_items=emb.n_items,
        n_questions=len(dataset.questions), n_scored=sum(1 for q in dataset.questions if q.scored),
        metric_names=tuple(dataset.metric_names), encoder=emb.model,
        backend=next(iter(scores.values()))[k].result.backend if scores else backend, config=config,
        embeddings_cached=emb.cached, encode_items_s=emb.encode_items_s, stats=dict(getattr(dataset, "stats", {}) or {}),
        notes=notes, machine=machine_info(),
    )  # fmt: skip


def _shown(names: Sequence[str]) -> list[str]:
    """Metric columns of the table: the aliases "recall" / "ndcg" hidden when the dataset names its own."""
    names = list(names)
    return names if len(names) <= 2 else [m for m in names if m not in ("recall", "ndcg")]


def format_dataset_report(rep: DatasetReport) -> str:
    """The report as plain-text tables: per k, per category, each mode's (and the oracle's) metrics."""
    from .evaluate import _model_name

    cols = list(rep.metrics_at) + (["oracle"] if rep.oracle_at else [])
    label = {c: mode_label(c, rep.config) for c in cols}
    shown = _shown(rep.metric_names)
    lines = [
        f"{rep.dataset}: {rep.n_users} users, {rep.n_items} items, {rep.n_questions} questions ({rep.n_scored} scored), "
        f"encoder {_model_name(rep.encoder)}, backend {rep.backend}",
    ]
    for kk in rep.ks:
        table = {m: rep.metrics_at[m][kk] for m in rep.metrics_at}
        if rep.oracle_at:
            table["oracle"] = rep.oracle_at[kk]
        any_t = next(iter(table.values()))
        cats = sorted(c for c in any_t if c != OVERALL) + [OVERALL]
        # two metrics: one table with every mode side by side; more: one table per mode
        groups = [cols] if len(shown) <= 2 else [[c] for c in cols]
        for group in groups:
            heads = [(f"{label[c]} " if len(group) > 1 else "") + f"{m}@{kk}" for c in group for m in shown]
            w = max(12, max(len(h) for h in heads) + 2)
            title = "" if len(group) > 1 else f"{label[group[0]]}: "
            lines += ["", f"{title + 'category':<28}{'n':>5}" + "".join(f"{h:>{w}}" for h in heads)]
            for cat in cats:
                cells = "".join(f"{table[c][cat][m]:>{w}.4f}" for c in group for m in shown)
                lines.append(f"{cat:<28}{int(any_t[cat]['count']):>5}{cells}")
    lines.append("")
    if "rfmem" in rep.routes:
        r = rep.routes["rfmem"]
        lines.append(f"RF-Mem routes: familiarity {r.get('familiarity', 0)}, recollection {r.get('recollection', 0)}")
    for note in rep.notes:
        lines.append(f"note: {note}")
    cached = " (cached)" if rep.embeddings_cached else ""
    lines.append(f"encoding {rep.n_items} items: {rep.encode_items_s:.2f} s{cached}")
    for m, ms in rep.batch_ms_per_query.items():
        lines.append(f"{mode_label(m, rep.config):<14} batch {ms:.3f} ms/query")
    return "\n".join(lines)


def dataset_report_json(rep: DatasetReport) -> dict[str, Any]:
    """The report's figures as a JSON-serialisable dict (no per-question records)."""
    return {
        "dataset": rep.dataset,
        "machine": rep.machine,
        "backend": rep.backend,
        "encoder": rep.encoder,
        "config": rep.config.to_dict(),
        "configuration": describe_config(rep.config),
        "k": rep.k,
        "ks": rep.ks,
        "n_users": rep.n_users,
        "n_items": rep.n_items,
        "n_questions": rep.n_questions,
        "n_scored": rep.n_scored,
        "metric_names": list(rep.metric_names),
        "embeddings_cached": rep.embeddings_cached,
        "encode_items_s": rep.encode_items_s,
        "modes": {
            m: {
                "label": mode_label(m, rep.config),
                "metrics": rep.metrics_at[m][rep.k],
                "metrics_at": {str(kk): v for kk, v in rep.metrics_at[m].items()},
                "batch_ms_per_query": rep.batch_ms_per_query[m],
                "routes": rep.routes[m],
            }
            for m in rep.metrics_at
        },
        "oracle_at": {str(kk): v for kk, v in rep.oracle_at.items()},
        "stats": rep.stats,
        "notes": rep.notes,
    }


def dataset_records(rep: DatasetReport, dataset: Any) -> list[dict[str, Any]]:
    """One dict per scored question: qid, user, category, question, ground truth, and per mode
    the returned ids (``{mode}_ids``) and the metrics at the primary k (``{mode}_metrics``)."""
    first = next(iter(rep.scores.values()))[rep.k]
    out = []
    for j, i in enumerate(first.index):
        q = dataset.questions[int(i)]
        gt = q.ground_truth
        gt = list(getattr(gt, "correct", gt)) if not isinstance(gt, dict) else gt
        rec: dict[str, Any] = {"qid": q.qid, "user": q.user_key, "category": q.category, "question": q.text,
                               "ground_truth": gt}  # fmt: skip
        for mode, by_k in rep.scores.items():
            s = by_k[rep.k]
            rec[f"{mode}_ids"] = [str(x) for x in s.result.ids_list(j)]
            rec[f"{mode}_metrics"] = {m: float(v[j]) for m, v in s.metrics.items()}
        out.append(rec)
    return out


def write_dataset_records(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write one JSON line per record to ``path`` atomically (:func:`rfmem_fast.evaluate.write_records`)."""
    write_records(records, path)
