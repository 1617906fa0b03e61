"""``rfmem tune pipeline``: the whole recommended pipeline (first stage + second stage) by ONE nested CV.

``rfmem tune context`` chooses the first stage (fusion + conversation context) by nested
leave-one-user-out CV, and ``rfmem tune second-stage`` fits the second stage on top of
the all-user first-stage pick. Adding their two nested gains is an approximation: the
stage's folds saw a first stage chosen with every user. This procedure removes that:

For each held-out user ``u`` (a PersonaBench person at every noise level, a LoCoMo
conversation):

1. the first stage is the configuration :func:`rfmem_fast.tuning_datasets.tune_context`
   picks in its outer fold ``u`` (chosen on the other users only);
2. the second stage is chosen and fitted on the other users only, on the lists of THAT
   first stage (:func:`rfmem_fast.tuning_second_stage.tune_second_stage`'s outer fold
   ``u``: an inner leave-one-user-out over the others picks the family "all" candidate,
   "off" included, then the pick is refitted without ``u``);
3. ``u``'s questions are scored by that pipeline.

So no question is scored by a pipeline any part of which was chosen or fitted with its
user. Each distinct first-stage pick is prepared once (its lists and features for every
user) and its stage procedure run once; a user takes its values from the run of its own
pick. The result reports, per condition, dense Recall@k, the first stage alone (nested),
the whole pipeline (nested) and its gain over dense with the paired standard error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .tuning_datasets import DatasetCondition, _name, context_candidates, tune_context
from .tuning_second_stage import DEPTHS, prepare_stage_conditions, stage_candidates, tune_second_stage

__all__ = ["PipelineTuneResult", "tune_pipeline", "format_pipeline", "pipeline_json"]


@dataclass
class PipelineTuneResult:
    """What :func:`tune_pipeline` measured.

    Attributes:
        conditions: condition labels; users: the fold users (sorted); k: Recall cut-off.
        dense: condition -> dense Recall@k (the paper's dense retrieval, same encoder).
        first: condition -> nested Recall@k of the first stage alone (each user under its fold's pick).
        pipeline: condition -> nested Recall@k of the whole pipeline.
        gain_se: condition -> paired standard error of the pipeline's gain over dense (a fraction).
        first_picks / stage_picks: user -> the first stage / second stage chosen without that user.
        seconds: wall time.
    """

    conditions: list[str]
    users: list[str]
    k: int
    dense: dict[str, float]
    first: dict[str, float]
    pipeline: dict[str, float]
    gain_se: dict[str, float]
    first_picks: dict[str, str]
    stage_picks: dict[str, str]
    seconds: float
    notes: list[str] = field(default_factory=list)


def tune_pipeline(conditions: Sequence[DatasetCondition], families: Sequence[str] = ("linear",),
                  depths: Sequence[int] = DEPTHS, k: int = 10, backend: str = "auto", cache_dir: Any = "default",
                  progress: Callable[[str], None] | None = None) -> PipelineTuneResult:  # fmt: skip
    """The fully nested CV of the first stage and the second stage together (module docstring).

    Args:
        conditions: :class:`rfmem_fast.tuning_datasets.DatasetCondition` list (one encoder).
        families: the second stage's model families ("linear", "trees"); "off" is always a candidate.
        depths: the stage depths N tried (each >= k).
        k: Recall cut-off.
        backend, cache_dir, progress: the search backend, the embedding cache ("default": the
            user's), status lines.

    Returns:
        PipelineTuneResult.

    Raises:
        ValueError: fewer than 2 users; a depth below k; an unknown family; as the searches.
    """
    from .tuning import gain_se

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    ctx = tune_context(conditions, k=k, backend=backend, cache_dir=cache_dir, progress=say)
    by_name = {_name(fam, cfg): cfg for fam, cfg in context_candidates()}
    first_pick = dict(p.split(": ", 1) for p in ctx.picks["all"])
    users = list(ctx.users)
    if set(first_pick) != set(users):
        raise ValueError("the first stage's nested picks do not cover every user")
    labels = [c.label for c in conditions]
    held: dict[str, np.ndarray] = {}
    first_held: dict[str, np.ndarray] = {}
    dense: dict[str, np.ndarray] = {}
    stage_picks: dict[str, str] = {}
    for name in sorted(set(first_pick.values())):
        cfg = by_name[name].replace(second_stage=None)
        say(f"pipeline: first stage {name!r} (the pick of {sum(v == name for v in first_pick.values())} folds)")
        data = prepare_stage_conditions(conditions, depths, k, cfg, backend, cache_dir, progress=say)
        res = tune_second_stage(data, stage_candidates(families, depths), k, progress=say)
        stage_of = dict(p.split(": ", 1) for p in res.picks["all"])
        for c in data:
            if c.label not in held:
                held[c.label] = np.full(len(c.qrows), np.nan)
                first_held[c.label] = np.full(len(c.qrows), np.nan)
                dense[c.label] = c.dense
            mine = np.array([first_pick[u] == name for u in c.users.tolist()], dtype=bool)
            held[c.label][mine] = res.held["all"][c.label][mine]
            first_held[c.label][mine] = c.first[mine]
        for u, v in first_pick.items():
            if v == name:
                stage_picks[u] = stage_of[u]
    return PipelineTuneResult(
        conditions=labels, users=users, k=k, dense={lab: float(dense[lab].mean()) for lab in labels},
        first={lab: float(first_held[lab].mean()) for lab in labels},
        pipeline={lab: float(held[lab].mean()) for lab in labels},
        gain_se={lab: gain_se(held[lab] - dense[lab]) for lab in labels}, first_picks=first_pick,
        stage_picks=stage_picks, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def format_pipeline(res: PipelineTuneResult) -> str:
    """Plain-text table of a :class:`PipelineTuneResult`: per condition, dense Recall@k, the
    first stage alone (nested), the whole pipeline (nested) and its gain over dense in points
    with the paired standard error in brackets (the result of ``rfmem tune pipeline``).

    Returns:
        str, one line per row. Raises nothing for a result of :func:`tune_pipeline`.
    """
    labs, w = res.conditions, 16
    lines = [f"whole pipeline, Recall@{res.k}, ONE nested leave-one-user-out over {len(res.users)} users",
             f"{'':<26}" + "".join(f"{lab:>{w}}" for lab in labs),
             f"{'dense':<26}" + "".join(f"{res.dense[lab]:>{w}.4f}" for lab in labs),
             f"{'first stage (nested)':<26}" + "".join(f"{res.first[lab]:>{w}.4f}" for lab in labs),
             f"{'pipeline (nested)':<26}" + "".join(f"{res.pipeline[lab]:>{w}.4f}" for lab in labs),
             f"{'gain over dense, points':<26}" + "".join(
                 f"{100 * (res.pipeline[lab] - res.dense[lab]):>+9.2f} ({100 * res.gain_se[lab]:.2f})" for lab in labs)]
    return "\n".join(lines)


def pipeline_json(res: PipelineTuneResult) -> dict[str, Any]:
    """The result as a JSON-serialisable dict (``rfmem tune pipeline --json``).

    Returns:
        dict with ``k``, ``conditions``, ``users``, ``dense``, ``first_stage_nested``,
        ``pipeline_nested`` (condition -> Recall@k, floats in [0, 1]),
        ``pipeline_gain_over_dense_points`` / ``pipeline_gain_se_points`` (condition ->
        points), ``first_stage_picks`` / ``second_stage_picks`` (user -> candidate name),
        ``seconds`` and ``notes``. Raises nothing for a result of :func:`tune_pipeline`.
    """
    return {
        "k": res.k, "conditions": res.conditions, "users": res.users, "dense": res.dense,
        "first_stage_nested": res.first, "pipeline_nested": res.pipeline,
        "pipeline_gain_over_dense_points": {lab: 100 * (res.pipeline[lab] - res.dense[lab]) for lab in res.conditions},
        "pipeline_gain_se_points": {lab: 100 * res.gain_se[lab] for lab in res.conditions},
        "first_stage_picks": res.first_picks, "second_stage_picks": res.stage_picks, "seconds": res.seconds,
        "notes": res.notes,
    }  # fmt: skip
