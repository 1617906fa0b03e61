"""``rfmem tune``: choose an RF-Mem configuration by leave-one-user-out cross-validation.

The search space is a grid (scikit-learn's ``ParameterGrid``; no hand-written
optimiser) over

* the Recollection path: ``alpha``, ``beam_width``, ``fanout``, ``max_rounds``,
  ``mmr_lambda`` (spec section 4);
* the merge of the two paths: ``merge`` with ``rrf_k`` / ``rescore_weight``
  (:mod:`rfmem_fast.routing.merge`);
* the router: ``temperature`` and the thresholds ``theta_high`` / ``theta_low`` /
  ``tau`` (spec sections 1-2), including "always recollect" and "never recollect"
  (= dense, the safe fallback).

Every grid point is scored on every *condition* (an encoder and a noise level) with
per-question Recall@k. This is cheap because the parts are independent: a question's
Recollection-path list depends only on the Recollection and merge settings (one
``search(mode="recollection")`` per such setting and condition), its route only on the
probe signals and the router settings, and RF-Mem's list is the dense list or the
Recollection-path list according to the route. Per-question recalls are cached on
disk, so a second run with the same grid and data costs seconds.

Selection objective (for a set of training users): for each condition ``c``, the gain
``g_c`` = Recall@k of the config minus Recall@k of dense on those users' scored
questions; objective = ``mean_c g_c + min(0, min_c g_c)`` (the mean gain, with a
shortfall below dense in any condition counted twice). Ties go to the config that
recollects the fewest questions (the cheaper one), then to grid order.

Protocol (the honest score): **nested leave-one-user-out**. For each of the users, the
selection runs on the other users' questions only and the chosen config is scored on
the held-out user's questions; every question is thus scored by a config chosen
without it, and the CV Recall@k of a condition pools those scores over all users. The
recommended config is what the same selection picks on all users; its nested-CV score
is the score of that procedure.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .config import RFMemConfig

__all__ = [
    "GRIDS",
    "Condition",
    "TuneResult",
    "tune_personabench",
    "format_tune",
    "tune_json",
    "default_tune_cache_dir",
]

#: merge settings
MERGES: list[dict[str, Any]] = [
    {"merge": "none"},
    {"merge": "interleave"},
    {"merge": "rrf", "rrf_k": 60.0},
    {"merge": "rescore", "rescore_weight": 0.25},
    {"merge": "rescore", "rescore_weight": 0.5},
    {"merge": "rescore", "rescore_weight": 1.0},
]
PAPER_ROUTER = {"theta_high": 0.6, "theta_low": 0.2, "tau": 0.2}  # spec section 2
ALWAYS = {"theta_high": 1.0, "theta_low": 1.0, "tau": 0.0}  # every query recollects
NEVER = {"theta_high": -1.0, "theta_low": -1.0, "tau": 0.0}  # dense
_PAPER_RECOLLECTION = {"alpha": [0.5], "beam_width": [4], "fanout": [1], "max_rounds": [10], "mmr_lambda": [0.9]}


@dataclass(frozen=True)
class SearchSpace:
    """A tuning grid.

    Attributes:
        recollection: ParameterGrid dict over alpha, beam_width, fanout, max_rounds,
            mmr_lambda (spec section 4).
        merges: merge settings (dicts of RFMemConfig fields).
        temperatures: softmax temperatures of the entropy (spec section 1).
        routers: router settings (theta_high, theta_low, tau dicts; ALWAYS / NEVER
            express "always" / "never recollect").
    """

    recollection: dict[str, list[Any]]
    merges: list[dict[str, Any]]
    temperatures: list[float]
    routers: list[dict[str, float]]

    def recollection_points(self) -> list[dict[str, Any]]:
        """The recollection grid's points (ParameterGrid order)."""
        from sklearn.model_selection import ParameterGrid

        return [dict(g) for g in ParameterGrid(self.recollection)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description."""
        return {"recollection": self.recollection, "merges": self.merges, "temperatures": self.temperatures, "routers": self.routers}


def _threshold_points() -> list[dict[str, float]]:
    # scikit-learn's ParameterGrid order (sorted keys, last key fastest) without importing
    # sklearn.model_selection at import time (it pulls optional packages such as rich)
    grid = {"theta_high": [0.5, 0.6, 0.7], "theta_low": [0.1, 0.2, 0.3], "tau": [0.0, 0.15, 0.2, 0.22]}
    keys, values = zip(*sorted(grid.items()))
    points = [dict(zip(keys, v)) for v in itertools.product(*values)]
    return [g for g in points if g["theta_low"] <= g["theta_high"]] + [dict(ALWAYS), dict(NEVER)]


#: the grids of ``rfmem tune --grid NAME``
GRIDS: dict[str, SearchSpace] = {
    # everything the issue lists: 48 recollection settings x 6 merges x 2 temperatures x 38 routers
    "full": SearchSpace(
        {"alpha": [0.3, 0.5, 0.8], "beam_width": [3, 4], "fanout": [1, 2], "max_rounds": [3, 10], "mmr_lambda": [0.9, 1.0]},
        MERGES, [20.0, 30.0], _threshold_points(),
    ),
    # the authors' Recollection path and router kept; only the new knobs chosen: how to
    # merge, and whether to route by the paper's thresholds, always or never recollect
    "merge": SearchSpace(_PAPER_RECOLLECTION, MERGES, [20.0], [dict(PAPER_ROUTER), dict(ALWAYS), dict(NEVER)]),
    # a tiny grid for tests
    "quick": SearchSpace(
        {"alpha": [0.5], "beam_width": [4], "fanout": [1, 2], "max_rounds": [3], "mmr_lambda": [0.9]},
        MERGES, [20.0], [dict(PAPER_ROUTER), dict(ALWAYS), dict(NEVER)],
    ),
}


def default_tune_cache_dir() -> Path:
    """Cache of per-question recalls of ``rfmem tune`` (``$RFMEM_CACHE/../tune``;
    default ``~/.cache/rfmem_fast/tune``)."""
    from .datasets.embedded import default_embedding_cache_dir

    return default_embedding_cache_dir().parent / "tune"


@dataclass(frozen=True)
class Condition:
    """One evaluation condition: an encoder (alias or folder) and a noise level."""

    encoder: str
    noise: float

    @property
    def label(self) -> str:
        """"<encoder name> noise <noise>"."""
        return f"{Path(self.encoder).name} noise {self.noise}"


@dataclass
class _CondData:
    users: np.ndarray  # [nq] user key per question
    evaluated: np.ndarray  # [nq] bool
    dense: np.ndarray  # [nq] dense recall
    reco: np.ndarray  # [P, M, nq] Recollection-path recall
    routes: np.ndarray  # [T, H, nq] bool: recollect
    emb: Any


@dataclass
class TuneResult:
    """What :func:`tune_personabench` found (see :func:`tune_json` for the layout)."""

    conditions: list[Condition]
    users: list[str]
    k: int
    grid: str
    space: SearchSpace
    n_candidates: int
    recommended: RFMemConfig
    recommended_in_sample: dict[str, float]
    cv: dict[str, dict[str, float]]
    folds: list[dict[str, Any]]
    top: list[dict[str, Any]]
    cost: dict[str, dict[str, dict[str, float]]]
    seconds: float
    notes: list[str] = field(default_factory=list)


def _cache_file(cache_dir: Path | None, emb: Any, rec: dict[str, Any], k: int) -> Path | None:
    if cache_dir is None or not emb.cache_file:
        return None
    from . import __version__

    h = hashlib.sha256(json.dumps([__version__, Path(emb.cache_file).name, rec, k], sort_keys=True).encode())
    return cache_dir / f"reco-{h.hexdigest()[:24]}.npy"


def _condition_data(
    cond: Condition,
    data_dir: Any,
    space: SearchSpace,
    k: int,
    backend: str,
    cache_dir: Path | None,
    emb_cache: Any,
    say: Callable[[str], None],
) -> _CondData:
    from .datasets.embedded import personabench_embeddings
    from .routing import question_recalls
    from .router import RECOLLECTION, route_by_thresholds
    from .search import search
    from .signals import familiarity_signals

    import torch

    emb = personabench_embeddings(data_dir, noise=cond.noise, encoder=cond.encoder, cache_dir=emb_cache, say=say)
    qs = emb.data.questions
    gts = [q.gt_segment_ids for q in qs]
    base = RFMemConfig()
    dense_res = search(emb.bank, emb.Q, emb.users, base, mode="dense", backend=backend)
    dense = question_recalls(dense_res, gts, k)
    rec_grid = space.recollection_points()
    reco = np.zeros((len(rec_grid), len(space.merges), len(qs)))
    t0 = time.perf_counter()
    done = 0
    for pi, rec in enumerate(rec_grid):
        for mi, mg in enumerate(space.merges):
            key = {**rec, **mg}
            cf = _cache_file(cache_dir, emb, key, k)
            if cf is not None and cf.is_file():
                try:
                    reco[pi, mi] = np.load(cf)
                    continue
                except (OSError, ValueError):
                    pass
            res = search(emb.bank, emb.Q, emb.users, base.replace(**key), mode="recollection", backend=backend)
            reco[pi, mi] = question_recalls(res, gts, k)
            done += 1
            if cf is not None:
                cf.parent.mkdir(parents=True, exist_ok=True)
                tmp = cf.with_name(cf.name + f".{os.getpid()}.tmp.npy")
                np.save(tmp, reco[pi, mi])
                os.replace(tmp, cf)
    say(f"tune: {cond.label}: {done} searches run ({time.perf_counter() - t0:.1f} s), {len(rec_grid) * len(space.merges) - done} cached")
    scores = torch.from_numpy(np.asarray(dense_res.probe_scores, dtype=np.float64))
    rgrid = space.routers
    routes = np.zeros((len(space.temperatures), len(rgrid), len(qs)), dtype=bool)
    for ti, temp in enumerate(space.temperatures):
        mean, ent, count = familiarity_signals(scores, temp, base.entropy)
        for hi, g in enumerate(rgrid):
            r, _ = route_by_thresholds(mean, ent, count, g["theta_high"], g["theta_low"], g["tau"])
            routes[ti, hi] = r == RECOLLECTION
    return _CondData(
        users=np.asarray(emb.users), evaluated=np.array([q.is_evaluated for q in qs]),
        dense=dense, reco=reco, routes=routes, emb=emb,
    )  # fmt: skip


def _candidate_config(idx: tuple[int, int, int, int], space: SearchSpace) -> RFMemConfig:
    p, m, t, h = idx
    return RFMemConfig().replace(
        **space.recollection_points()[p], **space.merges[m], temperature=space.temperatures[t], **space.routers[h]
    )


def tune_personabench(
    data_dir: str | os.PathLike[str],
    encoders: Sequence[str] = ("minilm",),
    noises: Sequence[float] = (0.0,),
    grid: str = "full",
    k: int = 10,
    backend: str = "auto",
    cache_dir: Path | None | str = "default",
    emb_cache: Any = "default",
    top: int = 10,
    timing: bool = True,
    progress: Callable[[str], None] | None = None,
    conditions: Sequence[tuple[str, float]] | None = None,
) -> TuneResult:
    """Grid-search RF-Mem's configuration with nested leave-one-user-out CV on PersonaBench.

    Args:
        data_dir: folder holding ``synthetic_data/``.
        encoders: encoders (aliases "minilm" / "mpnet" or folders), one condition each
            per noise level.
        noises: noise levels.
        grid: a name of GRIDS ("full", "merge", "quick").
        k: Recall cut-off.
        backend: search backend.
        cache_dir: per-question recall cache ("default": :func:`default_tune_cache_dir`;
            None: no cache).
        emb_cache: embedding cache folder ("default" or None, as
            :func:`rfmem_fast.evaluate.run_personabench`).
        top: how many of the best configurations (on all users) to list.
        timing: time dense, paper RF-Mem and the recommended config per condition.
        progress: optional callable receiving status lines.
        conditions: explicit (encoder, noise) pairs, instead of every encoder at
            every noise level.

    Returns:
        TuneResult.

    Raises:
        ValueError: unknown grid name, fewer than 2 users, k < 1, no condition.
    """
    from sklearn.model_selection import LeaveOneGroupOut

    from .datasets.embedded import default_embedding_cache_dir
    from .routing import question_recalls
    from .search import search

    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {sorted(GRIDS)}, got {grid!r}")
    space = GRIDS[grid]
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    cache = default_tune_cache_dir() if cache_dir == "default" else (Path(cache_dir) if cache_dir else None)
    ecache = default_embedding_cache_dir() if emb_cache == "default" else emb_cache
    pairs = conditions if conditions is not None else [(e, n) for e in encoders for n in noises]
    conds = [Condition(str(e), float(n)) for e, n in pairs]
    if not conds:
        raise ValueError("no condition to tune on")
    data = [_condition_data(c, data_dir, space, k, backend, cache, ecache, say) for c in conds]
    users = list(dict.fromkeys(data[0].users.tolist()))
    if len(users) < 2:
        raise ValueError("leave-one-user-out needs at least 2 users")
    P, M, T, H = len(space.recollection_points()), len(space.merges), len(space.temperatures), len(space.routers)
    U, C = len(users), len(conds)

    # per condition and user: the summed recall gain over dense of every candidate [C, P, M, T, H, U]
    gain = np.zeros((C, P, M, T, H, U))
    n_q = np.zeros((C, U))
    dense_sum = np.zeros((C, U))
    frac = np.zeros((C, T, H))
    for ci, d in enumerate(data):
        onehot = (d.users[:, None] == np.asarray(users)[None, :]) & d.evaluated[:, None]  # [nq, U]
        delta = d.reco - d.dense[None, None, :]  # [P, M, nq]
        gain[ci] = np.einsum("pmq,thq,qu->pmthu", delta, d.routes.astype(np.float64), onehot.astype(np.float64), optimize=True)
        n_q[ci] = onehot.sum(axis=0)
        dense_sum[ci] = (d.dense[:, None] * onehot).sum(axis=0)
        frac[ci] = d.routes.mean(axis=2)
    cost_frac = frac.mean(axis=0)  # [T, H] fraction recollecting, mean over conditions

    def ranked(train_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidates ordered best first by the objective on the training users' questions."""
        g = gain[..., train_mask].sum(axis=-1) / n_q[:, train_mask].sum(axis=1)[:, None, None, None, None]  # [C,P,M,T,H]
        obj = g.mean(axis=0) + np.minimum(0.0, g.min(axis=0))
        fr = np.broadcast_to(cost_frac[None, None], obj.shape).ravel()
        return np.lexsort((np.arange(obj.size), fr, -np.round(obj.ravel(), 12))), obj

    def unravel(flat: int) -> tuple[int, int, int, int]:
        return tuple(int(x) for x in np.unravel_index(flat, (P, M, T, H)))  # type: ignore[return-value]

    # nested leave-one-user-out (outer folds = users)
    held_gain = np.zeros(C)
    folds = []
    uidx = np.arange(U)
    for tr, te in LeaveOneGroupOut().split(uidx[:, None], groups=uidx):
        mask = np.zeros(U, dtype=bool)
        mask[tr] = True
        best = unravel(ranked(mask)[0][0])
        u = int(te[0])
        held_gain += gain[(slice(None), *best, u)]
        folds.append({"held_out_user": users[u], "chosen": _short(_candidate_config(best, space)), "held_out_recall": {
            conds[ci].label: float((gain[(ci, *best, u)] + dense_sum[ci, u]) / max(n_q[ci, u], 1)) for ci in range(C)
        }})  # fmt: skip
    order, obj = ranked(np.ones(U, dtype=bool))
    best = unravel(order[0])
    rec_cfg = _candidate_config(best, space)
    paper = RFMemConfig.paper()
    cv: dict[str, dict[str, float]] = {}
    in_sample: dict[str, float] = {}
    for ci, c in enumerate(conds):
        d, emb = data[ci], data[ci].emb
        ev = d.evaluated
        gts = [q.gt_segment_ids for q in emb.data.questions]
        paper_rf = question_recalls(search(emb.bank, emb.Q, emb.users, paper, mode="rfmem", backend=backend), gts, k)
        paper_re = question_recalls(search(emb.bank, emb.Q, emb.users, paper, mode="recollection", backend=backend), gts, k)
        cv[c.label] = {
            "dense": float(d.dense[ev].mean()),
            "paper_rfmem": float(paper_rf[ev].mean()),
            "paper_oracle": float(np.maximum(d.dense, paper_re)[ev].mean()),
            "tuned_cv": float((held_gain[ci] + dense_sum[ci].sum()) / n_q[ci].sum()),
        }
        in_sample[c.label] = float((gain[(ci, *best)].sum() + dense_sum[ci].sum()) / n_q[ci].sum())
    top_list = []
    for flat in order[:top]:
        idx = unravel(flat)
        top_list.append({
            "config": _short(_candidate_config(idx, space)), "objective_in_sample": float(obj[idx]),
            "fraction_recollecting": float(cost_frac[idx[2], idx[3]]),
            "recall_in_sample": {c.label: float((gain[(ci, *idx)].sum() + dense_sum[ci].sum()) / n_q[ci].sum()) for ci, c in enumerate(conds)},
        })  # fmt: skip
    cost: dict[str, dict[str, dict[str, float]]] = {}
    if timing:
        for ci, c in enumerate(conds):
            emb = data[ci].emb
            cost[c.label] = {}
            for name, cfg, mode in (("dense", paper, "dense"), ("paper_rfmem", paper, "rfmem"), ("recommended", rec_cfg, "rfmem")):
                search(emb.bank, emb.Q[:8], emb.users[:8], cfg, mode=mode, backend=backend)  # warm-up
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    res = search(emb.bank, emb.Q, emb.users, cfg, mode=mode, backend=backend)
                    ts.append(time.perf_counter() - t0)
                cost[c.label][name] = {
                    "ms_per_query": 1e3 * float(np.median(ts)) / len(emb.users),
                    "fraction_recollecting": float(np.mean(res.route == 1)),
                }
    return TuneResult(
        conditions=conds, users=users, k=k, grid=grid, space=space, n_candidates=int(obj.size), recommended=rec_cfg,
        recommended_in_sample=in_sample, cv=cv, folds=folds, top=top_list, cost=cost,
        seconds=time.perf_counter() - t_start,
    )  # fmt: skip


_SHORT_KEYS = ("alpha", "beam_width", "fanout", "max_rounds", "mmr_lambda", "merge", "rrf_k", "rescore_weight",
               "temperature", "theta_high", "theta_low", "tau")  # fmt: skip


def _short(cfg: RFMemConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    out = {k: d[k] for k in _SHORT_KEYS}
    if out["merge"] != "rrf":
        out.pop("rrf_k")
    if out["merge"] != "rescore":
        out.pop("rescore_weight")
    return out


def tune_json(res: TuneResult) -> dict[str, Any]:
    """The tuning result as a JSON-serialisable dict."""
    from .evaluate import machine_info

    return {
        "protocol": "nested leave-one-user-out over the PersonaBench users; selection objective: "
        "mean over conditions of (Recall@k - dense Recall@k) + min(0, worst condition's gain)",
        "conditions": [c.label for c in res.conditions],
        "users": res.users,
        "k": res.k,
        "grid": res.grid,
        "space": res.space.to_dict(),
        "n_candidates": res.n_candidates,
        "recommended": _short(res.recommended),
        "recommended_in_sample": res.recommended_in_sample,
        "cv": res.cv,
        "folds": res.folds,
        "top": res.top,
        "cost": res.cost,
        "seconds": res.seconds,
        "machine": machine_info(),
        "notes": res.notes,
    }


def format_tune(res: TuneResult) -> str:
    """The tuning result as plain-text tables."""
    lines = [
        f"rfmem tune (grid {res.grid!r}): {res.n_candidates} configurations x {len(res.conditions)} conditions, "
        f"{len(res.users)} users, Recall@{res.k}, {res.seconds:.0f} s",
        "",
        f"Nested leave-one-user-out CV (each user scored by the config chosen on the other {len(res.users) - 1}):",
        f"{'condition':<34}{'dense':>9}{'paper RF-Mem':>14}{'tuned (CV)':>12}{'gain':>8}{'paper oracle':>14}",
    ]
    for label, v in res.cv.items():
        lines.append(
            f"{label:<34}{v['dense']:>9.4f}{v['paper_rfmem']:>14.4f}{v['tuned_cv']:>12.4f}"
            f"{100 * (v['tuned_cv'] - v['dense']):>+8.2f}{v['paper_oracle']:>14.4f}"
        )
    lines += ["", "Chosen per fold:"]
    for f in res.folds:
        lines.append(f"  without {f['held_out_user']}: {f['chosen']}")
    lines += ["", f"Recommended (chosen on all users): {_short(res.recommended)}"]
    if res.cost:
        lines.append(f"{'condition':<34}{'dense ms/q':>12}{'paper ms/q':>12}{'rec. ms/q':>12}{'paper reco %':>14}{'rec. reco %':>13}")
        for label, c in res.cost.items():
            lines.append(
                f"{label:<34}{c['dense']['ms_per_query']:>12.3f}{c['paper_rfmem']['ms_per_query']:>12.3f}"
                f"{c['recommended']['ms_per_query']:>12.3f}{100 * c['paper_rfmem']['fraction_recollecting']:>14.1f}"
                f"{100 * c['recommended']['fraction_recollecting']:>13.1f}"
            )
    lines += ["", f"Top {len(res.top)} on all users (in-sample selection scores, optimistic):"]
    for i, t in enumerate(res.top, 1):
        rec = ", ".join(f"{v:.4f}" for v in t["recall_in_sample"].values())
        lines.append(f"{i:>3}. obj {t['objective_in_sample']:+.4f}  reco {100 * t['fraction_recollecting']:.0f}%  R@k [{rec}]  {t['config']}")
    return "\n".join(lines)
