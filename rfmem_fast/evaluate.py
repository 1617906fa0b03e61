"""The PersonaBench evaluation job: raw text -> embeddings -> Dense / Recollection / RF-Mem -> metrics.

Implements the evaluation protocol of RFMEM_SPEC.md section 6 and reports what
section 7 tabulates: Recall@k and NDCG@k per category and Overall for each mode, the
route split of RF-Mem (and the oracle router, the better of dense and recollection
per question), and latency per query with and without query encoding.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .bank import MemoryBank
from .config import RFMemConfig
from .datasets import load_personabench
from .metrics import aggregate, recall_ndcg_at_k
from .search import MODES, SearchResult, search

# The keys of one line of --out, the same as ../shared/golden/personabench_noise0.0.jsonl.
RECORD_KEYS = (
    "community", "user", "q_id", "question", "type", "difficulty", "gt_segment_ids",
    "probe_segment_ids", "probe_scores", "mean_score", "entropy", "route",
    "dense_ids", "recollection_ids", "rfmem_ids",
)  # fmt: skip
_MODE_KEY = {"dense": "dense_ids", "recollection": "recollection_ids", "rfmem": "rfmem_ids"}


@dataclass
class ModeReport:
    """Figures of one mode.

    Attributes:
        metrics: {category: {"recall", "ndcg", "count"}} incl. "Overall" (evaluated
            questions only, i.e. without type "Subjective").
        batch_ms_per_query: wall time of one whole-batch search / number of queries (ms).
        search_ms: per-query latency of single-query searches, {"p50", "p99", "mean"} (ms).
        encode_search_ms: the same, query encoding included (ms).
        routes: {"familiarity": n, "recollection": n} over all questions.
    """

    metrics: dict[str, dict[str, float]]
    batch_ms_per_query: float
    search_ms: dict[str, float] = field(default_factory=dict)
    encode_search_ms: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)


@dataclass
class EvalReport:
    """Everything the job measured (see :func:`run_personabench`)."""

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
    return info


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
) -> EvalReport:
    """Run Dense / Recollection / RF-Mem on PersonaBench and score them (spec sections 6-7).

    Args:
        data_dir: folder holding ``synthetic_data/`` (see
            :func:`rfmem_fast.datasets.load_personabench`).
        noise: noise level of the private data (0.0, 0.3, 0.5, 0.7).
        modes: subset of ("dense", "recollection", "rfmem").
        backend: backend name for :func:`rfmem_fast.search`.
        config: RFMemConfig (default: the spec's, i.e. the golden config).
        k: cut-off of Recall@k / NDCG@k (default ``config.out_k``).
        latency: also time single-query searches (with and without encoding).
        encoder: object with ``encode(list[str]) -> float32 [n, d]`` (default: the
            offline MiniLM :class:`rfmem_fast.encoders.TextEncoder`).
        progress: optional callable receiving status lines.

    Returns:
        EvalReport; ``records`` holds one dict per question with the keys of
        RECORD_KEYS (those of the golden file) when all three modes ran, else the
        keys of the modes that ran.

    Raises:
        ValueError: unknown mode; FileNotFoundError: missing data.
    """
    config = config or RFMemConfig()
    k = k or config.out_k
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be a subset of {MODES}, got {m!r}")
    say = progress or (lambda s: None)
    data = load_personabench(data_dir, noise=noise)
    if encoder is None:
        from .encoders import TextEncoder

        encoder = TextEncoder()
    say(f"encoding {sum(len(u) for u in data.users)} chunks of {len(data.users)} users")
    t0 = time.perf_counter()
    texts = [t for u in data.users for t in u.chunk_texts]
    X = encoder.encode(texts)
    enc_s = time.perf_counter() - t0
    bank = MemoryBank(X.shape[1])
    pos = 0
    for u in data.users:
        bank.add(u.key, X[pos : pos + len(u)], u.chunk_ids, texts=u.chunk_texts)
        pos += len(u)
    questions = data.questions
    qtexts = [q.question for q in questions]
    users = [q.user_key for q in questions]
    Q = encoder.encode(qtexts)

    results: dict[str, SearchResult] = {}
    scored: dict[str, list[tuple[str, float, float]]] = {}  # (category, recall, ndcg) per evaluated question
    reports: dict[str, ModeReport] = {}
    for mode in modes:
        search(bank, Q[:1], users[:1], config, mode=mode, backend=backend)  # warm-up
        t0 = time.perf_counter()
        res = search(bank, Q, users, config, mode=mode, backend=backend)
        batch_s = time.perf_counter() - t0
        results[mode] = res
        rows = [
            (q.category, *recall_ndcg_at_k([str(x) for x in res.ids_list(i)], q.gt_segment_ids, k))
            for i, q in enumerate(questions)
            if q.is_evaluated
        ]
        scored[mode] = rows
        rep = ModeReport(metrics=aggregate(rows), batch_ms_per_query=1e3 * batch_s / len(questions))
        names = res.route_names
        rep.routes = {r: names.count(r) for r in ("familiarity", "recollection")}
        if latency:
            s_t, e_t = [], []
            for i in range(len(questions)):
                t0 = time.perf_counter()
                qv = encoder.encode([qtexts[i]])
                t1 = time.perf_counter()
                search(bank, qv, [users[i]], config, mode=mode, backend=backend)
                t2 = time.perf_counter()
                s_t.append(t2 - t1)
                e_t.append(t2 - t0)
            rep.search_ms, rep.encode_search_ms = _pct(s_t), _pct(e_t)
        reports[mode] = rep
        say(f"{mode}: Recall@{k} {rep.metrics['Overall']['recall']:.4f}")

    oracle = None
    if "dense" in results and "recollection" in results:
        # per question, the better of the two paths (by recall, then NDCG)
        oracle = aggregate(max(a, b, key=lambda row: row[1:]) for a, b in zip(scored["dense"], scored["recollection"]))

    any_res = next(iter(results.values()))
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
        n_chunks=len(texts),
        encode_chunks_s=enc_s,
        backend=next(iter(results.values())).backend if results else backend,
        config=config,
        k=k,
        machine=machine_info(),
    )


def format_report(rep: EvalReport) -> str:
    """The report as a plain-text table (metrics per category and mode, routes, latency)."""
    cats = sorted({c for m in rep.modes.values() for c in m.metrics if c != "Overall"}) + ["Overall"]
    cols = list(rep.modes) + (["oracle"] if rep.oracle else [])
    table = {**{m: r.metrics for m, r in rep.modes.items()}, **({"oracle": rep.oracle} if rep.oracle else {})}
    lines = [
        f"PersonaBench: {rep.n_users} users, {rep.n_chunks} chunks, {rep.n_questions} questions "
        f"({rep.n_evaluated} evaluated), backend {rep.backend}, k={rep.k}",
        "",
        f"{'category':<24}{'n':>5}" + "".join(f"{c + ' R@' + str(rep.k):>20}{c + ' N@' + str(rep.k):>20}" for c in cols),
    ]
    for cat in cats:
        n = next(int(t[cat]["count"]) for t in table.values() if cat in t)
        cells = "".join(
            f"{table[c][cat]['recall']:>20.4f}{table[c][cat]['ndcg']:>20.4f}" if cat in table[c] else f"{'-':>20}{'-':>20}"
            for c in cols
        )
        lines.append(f"{cat:<24}{n:>5}{cells}")
    lines.append("")
    if "rfmem" in rep.modes:
        r = rep.modes["rfmem"].routes
        lines.append(f"RF-Mem routes: familiarity {r.get('familiarity', 0)}, recollection {r.get('recollection', 0)}")
    lines.append(f"encoding {rep.n_chunks} chunks: {rep.encode_chunks_s:.2f} s")
    lines.append(f"{'mode':<14}{'batch ms/q':>12}{'search p50':>12}{'search p99':>12}{'enc+search p50':>16}{'enc+search p99':>16}")
    for m, r in rep.modes.items():
        s, e = r.search_ms, r.encode_search_ms
        lines.append(
            f"{m:<14}{r.batch_ms_per_query:>12.3f}{s.get('p50', float('nan')):>12.3f}{s.get('p99', float('nan')):>12.3f}"
            f"{e.get('p50', float('nan')):>16.3f}{e.get('p99', float('nan')):>16.3f}"
        )
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
        "k": rep.k,
        "n_questions": rep.n_questions,
        "n_evaluated": rep.n_evaluated,
        "encode_chunks_s": rep.encode_chunks_s,
        "modes": {
            m: {
                "metrics": r.metrics,
                "batch_ms_per_query": r.batch_ms_per_query,
                "search_ms": r.search_ms,
                "encode_search_ms": r.encode_search_ms,
                "routes": r.routes,
            }
            for m, r in rep.modes.items()
        },
        "oracle": rep.oracle,
    }
