"""A statistical judge of an encoder option against the float32 reference of the same model.

An encoder option (a runtime and a precision of :class:`rfmem_fast.encoders.TextEncoder`:
ONNX int8, torch bfloat16, ...) embeds every text a little differently from the torch
float32 encoder of the same model. Whether that difference matters is judged on the
retrieval itself: the same datasets and search configurations are run once with the
reference embeddings and once with the candidate's, and the per-question outcomes are
compared question by question. A candidate passes only where, on every dataset (each
noise level of PersonaBench counts as one) and every search configuration run on it:

(a) **Recall@10 does not move beyond its own noise**: the mean of the paired
    per-question differences ``d_i = recall_candidate_i - recall_reference_i`` lies
    within one standard error of that mean, ``|mean(d)| <= SE`` with
    ``SE = std(d, ddof=1) / sqrt(n)`` (the standard error of the mean paired difference,
    n = the scored questions; equivalently: the paired t statistic is at most 1 in
    absolute value). A candidate equal to the reference has d = 0 and SE = 0 and passes;
    one that changes a single question's recall has ``|mean(d)| == SE`` and passes; two
    or more changes all in the same direction fail. Under pure chance (changes of random
    sign) one check fails about a third of the time, so (a) is strict on its own; it is
    the ratio ``t = mean(d) / SE`` that is reported alongside;
(b) **the lists stay the same**: at least :data:`JUDGE_CRITERIA` ``["identical_top10_min"]``
    (95 %) of the questions get the identical top-10 list (the same ids in the same
    order; the fraction with the same set of ids is reported too);
(c) **the routes stay the same**: in a search configuration with RF-Mem routing (mode
    "rfmem"), at least :data:`JUDGE_CRITERIA` ``["identical_routes_min"]`` (99 %) of the
    questions take the same path (familiarity / recollection).

:func:`compare_runs` applies the three checks to one (dataset, configuration) pair of
:class:`SearchRun` s; :func:`judge` to every dataset and configuration of a candidate;
:func:`search_run` turns a :class:`rfmem_fast.evaluate_datasets.DatasetScores` into a
:class:`SearchRun`. The measurement is ``bench/bench_encoder_judge.py``; its figures and
verdicts for this package's encoder options are in docs/guides/encoders.md ("Judging an
encoder option").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["JUDGE_CRITERIA", "JUDGE_K", "SearchRun", "RunComparison", "Verdict", "compare_runs", "judge",
           "search_run"]

#: the cut-off of the compared lists and of Recall (int)
JUDGE_K = 10

#: the judge's thresholds: (a) ``|mean paired Recall@10 difference| <= recall_se_multiple x SE``;
#: (b) fraction of questions with the identical top-10 list ``>= identical_top10_min``; (c) fraction
#: of questions with the same RF-Mem route ``>= identical_routes_min``
JUDGE_CRITERIA = {"recall_se_multiple": 1.0, "identical_top10_min": 0.95, "identical_routes_min": 0.99}

#: the route names a :class:`SearchRun` may hold
ROUTES = ("familiarity", "recollection")

# rounding slack of the comparisons (the recall values are ratios of small integers)
_EPS = 1e-12


@dataclass(frozen=True)
class SearchRun:
    """Per-question outcome of one search configuration on one dataset.

    Attributes:
        qids: n distinct question ids (str; any hashable is accepted and kept as given).
        recall: float64 ``[n]``, each question's Recall@k in [0, 1] (``recall[i]`` is
            question ``qids[i]``'s).
        top: n tuples of item ids, each question's ranked list (at least its first
            :data:`JUDGE_K` entries; fewer where the memory holds fewer items).
        routes: n route names of :data:`ROUTES`, or None for a configuration without
            RF-Mem routing (mode "dense").

    Raises:
        ValueError: lengths differ (the message names the field), duplicate qids, a
            recall value outside [0, 1] or not finite, an unknown route name.
        TypeError: ``top`` holds an entry that is not a sequence of ids.
    """

    qids: tuple[Any, ...]
    recall: np.ndarray
    top: tuple[tuple[Any, ...], ...]
    routes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        qids = tuple(self.qids)
        recall = np.asarray(self.recall, dtype=np.float64).reshape(-1)
        if isinstance(self.top, (str, bytes)):
            raise TypeError("top must be a sequence of id lists, got a str")
        top = []
        for i, row in enumerate(self.top):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
                raise TypeError(f"top[{i}] must be a sequence of item ids, got {type(row).__name__}")
            top.append(tuple(row))
        n = len(qids)
        if recall.shape[0] != n:
            raise ValueError(f"recall must hold one value per question ({n} qids), got {recall.shape[0]}")
        if len(top) != n:
            raise ValueError(f"top must hold one list per question ({n} qids), got {len(top)}")
        if len(set(qids)) != n:
            dup = next(q for i, q in enumerate(qids) if q in qids[:i])
            raise ValueError(f"qids must be distinct, {dup!r} appears more than once")
        if n and (not np.all(np.isfinite(recall)) or recall.min() < 0.0 or recall.max() > 1.0):
            raise ValueError("recall must be finite values in [0, 1]")
        routes = None
        if self.routes is not None:
            routes = tuple(self.routes)
            if len(routes) != n:
                raise ValueError(f"routes must hold one route per question ({n} qids), got {len(routes)}")
            bad = [r for r in routes if r not in ROUTES]
            if bad:
                raise ValueError(f"routes must be names of {ROUTES}, got {bad[0]!r}")
        object.__setattr__(self, "qids", qids)
        object.__setattr__(self, "recall", recall)
        object.__setattr__(self, "top", tuple(top))
        object.__setattr__(self, "routes", routes)

    def __len__(self) -> int:
        return len(self.qids)


@dataclass(frozen=True)
class RunComparison:
    """The three checks on one (dataset, configuration): candidate against reference.

    Attributes:
        n: questions compared (int).
        recall_reference / recall_candidate: mean Recall@k of each, in points (0-100).
        mean_diff_points: mean of the paired differences ``candidate - reference``, points.
        se_points: its standard error ``std(d, ddof=1) / sqrt(n)``, points (0.0 when every
            difference is the same, e.g. all zero).
        t: ``mean_diff / se`` (0.0 when both are 0; +-inf when only se is 0).
        changed_recall: questions whose recall differs (int).
        recall_ok: criterion (a), ``|mean_diff| <= recall_se_multiple x se``.
        identical_top: fraction of questions with the same top-k ids in the same order.
        identical_top_set: fraction with the same set of top-k ids (order ignored).
        top_ok: criterion (b).
        identical_routes: fraction of questions with the same route, or None without routes.
        routes_ok: criterion (c) (True without routes).
        passed: all three.
    """

    n: int
    recall_reference: float
    recall_candidate: float
    mean_diff_points: float
    se_points: float
    t: float
    changed_recall: int
    recall_ok: bool
    identical_top: float
    identical_top_set: float
    top_ok: bool
    identical_routes: float | None
    routes_ok: bool
    passed: bool

    def failures(self) -> list[str]:
        """One line per failed criterion (empty when :attr:`passed`), with its figure and line."""
        out = []
        if not self.recall_ok:
            out.append(f"(a) Recall@{JUDGE_K} mean difference {self.mean_diff_points:+.3f} points is beyond "
                       f"{JUDGE_CRITERIA['recall_se_multiple']:g} SE = {self.se_points:.3f} (t = {self.t:+.2f})")
        if not self.top_ok:
            out.append(f"(b) identical top-{JUDGE_K} lists {self.identical_top:.4f} < "
                       f"{JUDGE_CRITERIA['identical_top10_min']}")
        if not self.routes_ok:
            out.append(f"(c) identical routes {self.identical_routes:.4f} < {JUDGE_CRITERIA['identical_routes_min']}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The figures as a JSON-serialisable dict (t as a string when infinite)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if not math.isfinite(d["t"]):
            d["t"] = "inf" if d["t"] > 0 else "-inf"
        d["failures"] = self.failures()
        return d


def _check_run(run: Any, name: str) -> SearchRun:
    if not isinstance(run, SearchRun):
        raise TypeError(f"{name} must be a SearchRun, got {type(run).__name__}")
    return run


def compare_runs(reference: SearchRun, candidate: SearchRun, k: int = JUDGE_K) -> RunComparison:
    """Criteria (a), (b) and (c) of the module docstring for one (dataset, configuration).

    The candidate's questions are matched to the reference's by qid (their order may differ).

    Args:
        reference: the float32 reference's :class:`SearchRun`.
        candidate: the candidate encoder's run of the same questions and configuration.
        k: the list length compared in (b) (default :data:`JUDGE_K`; the recall values
            are taken as given).

    Returns:
        RunComparison.

    Raises:
        TypeError: ``reference`` / ``candidate`` is not a SearchRun; ``k`` not an int.
        ValueError: the two hold different question sets (the message names
            ``candidate`` and the ids missing or extra); fewer than 2 questions; one has
            routes and the other not; ``k < 1``.
    """
    reference = _check_run(reference, "reference")
    candidate = _check_run(candidate, "candidate")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int >= 1, got {k!r}")
    if k < 1:
        raise ValueError(f"k must be an int >= 1, got {k}")
    ref_q, cand_q = set(reference.qids), set(candidate.qids)
    if ref_q != cand_q:
        missing = [q for q in reference.qids if q not in cand_q]
        extra = [q for q in candidate.qids if q not in ref_q]
        raise ValueError(
            f"candidate must hold the reference's questions: {len(missing)} missing"
            + (f" (e.g. {missing[:3]!r})" if missing else "") + f", {len(extra)} extra"
            + (f" (e.g. {extra[:3]!r})" if extra else ""))
    n = len(reference)
    if n < 2:
        raise ValueError(f"reference must hold at least 2 questions for a standard error, got {n}")
    if (reference.routes is None) != (candidate.routes is None):
        which = "reference" if reference.routes is None else "candidate"
        raise ValueError(f"{which} has no routes while the other has: compare runs of the same configuration")
    pos = {q: i for i, q in enumerate(candidate.qids)}
    order = np.fromiter((pos[q] for q in reference.qids), dtype=np.int64, count=n)
    d = candidate.recall[order] - reference.recall
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(n))
    if abs(mean) <= _EPS:
        mean = 0.0
    if se <= _EPS:
        se = 0.0
    t = 0.0 if mean == 0.0 else (mean / se if se > 0 else math.copysign(math.inf, mean))
    recall_ok = abs(mean) <= JUDGE_CRITERIA["recall_se_multiple"] * se + _EPS
    kk = int(k)
    same = [reference.top[i][:kk] == candidate.top[j][:kk] for i, j in enumerate(order)]
    same_set = [set(reference.top[i][:kk]) == set(candidate.top[j][:kk]) for i, j in enumerate(order)]
    identical_top = float(np.mean(same))
    top_ok = identical_top >= JUDGE_CRITERIA["identical_top10_min"] - _EPS
    identical_routes: float | None = None
    routes_ok = True
    if reference.routes is not None and candidate.routes is not None:
        identical_routes = float(np.mean([reference.routes[i] == candidate.routes[j] for i, j in enumerate(order)]))
        routes_ok = identical_routes >= JUDGE_CRITERIA["identical_routes_min"] - _EPS
    return RunComparison(
        n=n, recall_reference=100.0 * float(reference.recall.mean()),
        recall_candidate=100.0 * float(candidate.recall.mean()), mean_diff_points=100.0 * mean,
        se_points=100.0 * se, t=t, changed_recall=int(np.count_nonzero(np.abs(d) > _EPS)), recall_ok=bool(recall_ok),
        identical_top=identical_top, identical_top_set=float(np.mean(same_set)), top_ok=bool(top_ok),
        identical_routes=identical_routes, routes_ok=bool(routes_ok),
        passed=bool(recall_ok and top_ok and routes_ok),
    )  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """A candidate judged on every dataset and configuration.

    Attributes:
        comparisons: ``{dataset: {configuration: RunComparison}}``, the reference's order.
        datasets_passed: ``{dataset: bool}``, every configuration of the dataset passed.
        passed: every dataset passed.
    """

    comparisons: dict[str, dict[str, RunComparison]]
    datasets_passed: dict[str, bool] = field(default_factory=dict)
    passed: bool = False

    def failures(self) -> list[str]:
        """``"dataset / configuration: criterion line"`` for each failed criterion."""
        return [f"{ds} / {cfg}: {line}" for ds, by_cfg in self.comparisons.items()
                for cfg, c in by_cfg.items() for line in c.failures()]

    def to_dict(self) -> dict[str, Any]:
        """The verdict and every comparison's figures, JSON-serialisable."""
        return {"passed": self.passed, "datasets_passed": dict(self.datasets_passed),
                "criteria": dict(JUDGE_CRITERIA), "k": JUDGE_K,
                "comparisons": {ds: {cfg: c.to_dict() for cfg, c in by.items()} for ds, by in self.comparisons.items()},
                "failures": self.failures()}


def judge(reference: Mapping[str, Mapping[str, SearchRun]], candidate: Mapping[str, Mapping[str, SearchRun]],
          k: int = JUDGE_K) -> Verdict:
    """Judge a candidate encoder's runs against the reference's on every dataset and configuration.

    Args:
        reference: ``{dataset: {configuration: SearchRun}}`` of the float32 reference
            (e.g. ``{"personabench-0.3": {"paper-rfmem": run, "paper-dense": run, ...}}``).
        candidate: the same datasets and configurations run with the candidate's embeddings.
        k: as :func:`compare_runs`.

    Returns:
        Verdict: passed only if :func:`compare_runs` passes for every (dataset, configuration).

    Raises:
        TypeError: ``reference`` / ``candidate`` not mappings of mappings of SearchRun.
        ValueError: no dataset; the two hold different datasets or configurations (the
            message names ``candidate`` and the key); as :func:`compare_runs` (the message
            prefixed with the dataset and configuration).
    """
    for name, arg in (("reference", reference), ("candidate", candidate)):
        if not isinstance(arg, Mapping) or not all(isinstance(v, Mapping) for v in arg.values()):
            raise TypeError(f"{name} must be a mapping {{dataset: {{configuration: SearchRun}}}}")
    if not reference:
        raise ValueError("reference must hold at least one dataset")
    if set(reference) != set(candidate):
        missing = [d for d in reference if d not in candidate]
        extra = [d for d in candidate if d not in reference]
        raise ValueError(f"candidate must hold the reference's datasets: missing {missing}, extra {extra}")
    comparisons: dict[str, dict[str, RunComparison]] = {}
    for ds, by_cfg in reference.items():
        if set(by_cfg) != set(candidate[ds]):
            raise ValueError(f"candidate[{ds!r}] must hold the reference's configurations {sorted(by_cfg)}, "
                             f"got {sorted(candidate[ds])}")
        comparisons[ds] = {}
        for cfg, run in by_cfg.items():
            try:
                comparisons[ds][cfg] = compare_runs(run, candidate[ds][cfg], k)
            except ValueError as e:
                raise ValueError(f"{ds} / {cfg}: {e}") from None
    per_ds = {ds: all(c.passed for c in by.values()) for ds, by in comparisons.items()}
    return Verdict(comparisons=comparisons, datasets_passed=per_ds, passed=all(per_ds.values()))


def search_run(scores: Any, k: int = JUDGE_K) -> SearchRun:
    """A :class:`SearchRun` from an evaluation's per-question scores.

    Args:
        scores: a :class:`rfmem_fast.evaluate_datasets.DatasetScores` (``qids``, ``recall``,
            ``result`` and ``mode``); its recall is taken at its own k.
        k: how many ids of each ranked list are kept (default :data:`JUDGE_K`).

    Returns:
        SearchRun with routes for mode "rfmem", none otherwise.

    Raises:
        TypeError: ``scores`` lacks those attributes.
    """
    for attr in ("qids", "recall", "result", "mode"):
        if not hasattr(scores, attr):
            raise TypeError(f"scores must be a DatasetScores (it has no {attr!r})")
    res = scores.result
    top = [tuple(str(x) for x in res.ids_list(j)[:k]) for j in range(len(scores.qids))]
    routes = list(res.route_names) if scores.mode == "rfmem" else None
    return SearchRun(qids=tuple(str(q) for q in scores.qids), recall=scores.recall, top=tuple(top),
                     routes=tuple(routes) if routes is not None else None)
