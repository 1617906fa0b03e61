"""``rfmem tune``: choose an RF-Mem configuration by leave-one-user-out cross-validation.

The search space is a grid (scikit-learn's ``ParameterGrid``; no hand-written
optimiser) over

* the Recollection path: ``alpha``, ``beam_width``, ``fanout``, ``max_rounds``,
  ``mmr_lambda`` (spec section 4);
* the merge of the two paths: ``merge`` with ``rrf_k`` / ``rescore_weight``
  (:mod:`rfmem_fast.routing.merge`);
* the router: ``temperature`` and the thresholds ``theta_high`` / ``theta_low`` /
  ``tau`` (spec sections 1-2), including "always recollect" and "never recollect"
  (= dense, the safe fallback);
* the profile prior ``profile_weight`` (:mod:`rfmem_fast.routing.profile`; grids
  "profile" and "profile-merge").

Every grid point is scored on every *condition* (an encoder and a noise level) with
per-question Recall@k. This is cheap because the parts are independent: for a given
profile weight, a question's Recollection-path list depends only on the Recollection
and merge settings (one ``search(mode="recollection")`` per such setting and
condition), its route only on the probe signals and the router settings, and RF-Mem's
list is the dense list or the Recollection-path list according to the route. Per-question recalls are cached on
disk, so a second run with the same grid and data costs seconds.

Selection objective (for a set of training users): for each condition ``c``, the gain
``g_c`` = Recall@k of the config minus Recall@k of dense on those users' scored
questions; objective = ``mean_c g_c + min(0, min_c g_c)`` (the mean gain, with a
shortfall below dense in any condition counted twice). Ties go to the config that
recollects the fewest questions (the cheaper one), then to grid order.

The per-question gains of the held-out scores also give a paired standard error
(``gain_se``): with ~230 questions a Recall@10 difference of 1-2 points is within one
or two standard errors.

Protocol (the honest score): **nested leave-one-user-out**. For each of the users, the
selection runs on the other users' questions only and the chosen config is scored on
the held-out user's questions; every question is thus scored by a config chosen
without it, and the CV Recall@k of a condition pools those scores over all users. The
recommended config is what the same selection picks on all users; its nested-CV score
is the score of that procedure.

The grid selection and the re-ranker's (:func:`rerank_cv_personabench`) stay one module:
both run this nested protocol over the same :class:`Condition` list, router presets,
:func:`gain_se` and timing, and the re-ranker's fits are observed through this module's
``_fit_spec``.
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
    "RERANK_SPECS",
    "rerank_cv_personabench",
    "rerank_config",
    "format_rerank_cv",
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
#: profile weights of the "profile" grids
PROFILE_WEIGHTS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5]
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
        profiles: profile weights (``RFMemConfig.profile_weight``; default [0.0]: off).
    """

    recollection: dict[str, list[Any]]
    merges: list[dict[str, Any]]
    temperatures: list[float]
    routers: list[dict[str, float]]
    profiles: list[float] = field(default_factory=lambda: [0.0])

    def recollection_points(self) -> list[dict[str, Any]]:
        """The recollection grid's points (ParameterGrid order)."""
        from sklearn.model_selection import ParameterGrid

        return [dict(g) for g in ParameterGrid(self.recollection)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description."""
        return {"recollection": self.recollection, "merges": self.merges, "temperatures": self.temperatures,
                "routers": self.routers, "profiles": self.profiles}  # fmt: skip


def _threshold_points() -> list[dict[str, float]]:
    # scikit-learn's ParameterGrid order (sorted keys, last key fastest) without importing
    # sklearn.model_selection at import time (it pulls optional packages such as rich)
    grid = {"theta_high": [0.5, 0.6, 0.7], "theta_low": [0.1, 0.2, 0.3], "tau": [0.0, 0.15, 0.2, 0.22]}
    keys, values = zip(*sorted(grid.items()))
    points = [dict(zip(keys, v)) for v in itertools.product(*values)]
    return [g for g in points if g["theta_low"] <= g["theta_high"]] + [dict(ALWAYS), dict(NEVER)]


#: the grids of ``rfmem tune --grid NAME``
GRIDS: dict[str, SearchSpace] = {
    # every combination: 48 recollection settings x 6 merges x 2 temperatures x 38 routers
    "full": SearchSpace(
        {"alpha": [0.3, 0.5, 0.8], "beam_width": [3, 4], "fanout": [1, 2], "max_rounds": [3, 10], "mmr_lambda": [0.9, 1.0]},
        MERGES, [20.0, 30.0], _threshold_points(),
    ),
    # the authors' Recollection path and router kept; only the new knobs chosen: how to
    # merge, and whether to route by the paper's thresholds, always or never recollect
    "merge": SearchSpace(_PAPER_RECOLLECTION, MERGES, [20.0], [dict(PAPER_ROUTER), dict(ALWAYS), dict(NEVER)]),
    # the profile prior alone: the profile weight, never recollecting (dense + profile prior)
    "profile": SearchSpace(_PAPER_RECOLLECTION, [{"merge": "none"}], [20.0], [dict(NEVER)], PROFILE_WEIGHTS),
    # the profile weight x the "merge" grid
    "profile-merge": SearchSpace(
        _PAPER_RECOLLECTION, MERGES, [20.0], [dict(PAPER_ROUTER), dict(ALWAYS), dict(NEVER)], PROFILE_WEIGHTS
    ),
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
    dense: np.ndarray  # [W, nq] dense recall per profile weight
    reco: np.ndarray  # [W, P, M, nq] Recollection-path recall
    routes: np.ndarray  # [W, T, H, nq] bool: recollect
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
    from .routing.base import RECOLLECTION
    from .routing.threshold import route_by_thresholds
    from .search import search
    from .signals import familiarity_signals

    import torch

    emb = personabench_embeddings(data_dir, noise=cond.noise, encoder=cond.encoder, cache_dir=emb_cache, say=say)
    qs = emb.data.questions
    gts = [q.gt_segment_ids for q in qs]
    rec_grid = space.recollection_points()
    W, P, M, nq = len(space.profiles), len(rec_grid), len(space.merges), len(qs)
    dense = np.zeros((W, nq))
    reco = np.zeros((W, P, M, nq))
    routes = np.zeros((W, len(space.temperatures), len(space.routers), nq), dtype=bool)
    never = all(g == NEVER for g in space.routers)  # no route recollects: no Recollection-path search needed
    t0 = time.perf_counter()
    done = 0
    for wi, w in enumerate(space.profiles):
        base = RFMemConfig(profile_weight=float(w))
        dense_res = search(emb.bank, emb.Q, emb.users, base, mode="dense", backend=backend)
        dense[wi] = question_recalls(dense_res, gts, k)
        for pi, rec in enumerate(rec_grid if not never else []):
            for mi, mg in enumerate(space.merges):
                key = {**rec, **mg, **({"profile_weight": float(w)} if w else {})}
                cf = _cache_file(cache_dir, emb, key, k)
                if cf is not None and cf.is_file():
                    try:
                        reco[wi, pi, mi] = np.load(cf)
                        continue
                    except (OSError, ValueError):
                        pass
                res = search(emb.bank, emb.Q, emb.users, base.replace(**key), mode="recollection", backend=backend)
                reco[wi, pi, mi] = question_recalls(res, gts, k)
                done += 1
                if cf is not None:
                    cf.parent.mkdir(parents=True, exist_ok=True)
                    tmp = cf.with_name(cf.name + f".{os.getpid()}.tmp.npy")
                    np.save(tmp, reco[wi, pi, mi])
                    os.replace(tmp, cf)
        scores = torch.from_numpy(np.asarray(dense_res.probe_scores, dtype=np.float64))
        for ti, temp in enumerate(space.temperatures):
            mean, ent, count = familiarity_signals(scores, temp, base.entropy)
            for hi, g in enumerate(space.routers):
                r, _ = route_by_thresholds(mean, ent, count, g["theta_high"], g["theta_low"], g["tau"])
                routes[wi, ti, hi] = r == RECOLLECTION
    total = 0 if never else W * P * M
    say(f"tune: {cond.label}: {done} searches run ({time.perf_counter() - t0:.1f} s), {total - done} cached")
    return _CondData(
        users=np.asarray(emb.users), evaluated=np.array([q.is_evaluated for q in qs]),
        dense=dense, reco=reco, routes=routes, emb=emb,
    )  # fmt: skip


def gain_se(gains: np.ndarray) -> float:
    """Standard error of a mean per-question gain (sample standard deviation / sqrt(n)): the
    paired noise of a Recall@k difference measured on these questions."""
    g = np.asarray(gains, dtype=np.float64)
    return float(g.std(ddof=1) / np.sqrt(len(g))) if len(g) > 1 else float("nan")


def _candidate_config(idx: tuple[int, ...], space: SearchSpace) -> RFMemConfig:
    w, p, m, t, h = idx
    return RFMemConfig().replace(
        **space.recollection_points()[p], **space.merges[m], temperature=space.temperatures[t], **space.routers[h],
        profile_weight=float(space.profiles[w]),
    )  # fmt: skip


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
    W, P, M = len(space.profiles), len(space.recollection_points()), len(space.merges)
    T, H, U, C = len(space.temperatures), len(space.routers), len(users), len(conds)

    # per condition and user: the summed recall gain over dense (profile weight 0) of every
    # candidate [C, W, P, M, T, H, U]: (profiled dense - dense) + route * (Recollection path - profiled dense)
    gain = np.zeros((C, W, P, M, T, H, U))
    n_q = np.zeros((C, U))
    dense_sum = np.zeros((C, U))
    frac = np.zeros((C, W, T, H))
    for ci, d in enumerate(data):
        onehot = ((d.users[:, None] == np.asarray(users)[None, :]) & d.evaluated[:, None]).astype(np.float64)  # [nq, U]
        delta = d.reco - d.dense[:, None, None, :]  # [W, P, M, nq]
        gain[ci] = np.einsum("wpmq,wthq,qu->wpmthu", delta, d.routes.astype(np.float64), onehot, optimize=True)
        gain[ci] += np.einsum("wq,qu->wu", d.dense - d.dense[:1], onehot)[:, None, None, None, None, :]
        n_q[ci] = onehot.sum(axis=0)
        dense_sum[ci] = (d.dense[0][:, None] * onehot).sum(axis=0)
        frac[ci] = d.routes.mean(axis=3)
    cost_frac = frac.mean(axis=0)  # [W, T, H] fraction recollecting, mean over conditions
    shape = (W, P, M, T, H)

    def ranked(train_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidates ordered best first by the objective on the training users' questions."""
        g = gain[..., train_mask].sum(axis=-1) / n_q[:, train_mask].sum(axis=1)[:, None, None, None, None, None]  # [C, *shape]
        obj = g.mean(axis=0) + np.minimum(0.0, g.min(axis=0))
        fr = np.broadcast_to(cost_frac[:, None, None], obj.shape).ravel()
        return np.lexsort((np.arange(obj.size), fr, -np.round(obj.ravel(), 12))), obj

    def unravel(flat: int) -> tuple[int, ...]:
        return tuple(int(x) for x in np.unravel_index(flat, shape))

    # nested leave-one-user-out (outer folds = users)
    held_gain = np.zeros(C)
    held_q = [np.zeros(len(d.users)) for d in data]
    folds = []
    uidx = np.arange(U)
    for tr, te in LeaveOneGroupOut().split(uidx[:, None], groups=uidx):
        mask = np.zeros(U, dtype=bool)
        mask[tr] = True
        best = unravel(ranked(mask)[0][0])
        u = int(te[0])
        held_gain += gain[(slice(None), *best, u)]
        w, pi, mi, ti, hi = best
        for ci, d in enumerate(data):  # per question: the held-out user's gains (for the standard error)
            sel = d.users == users[u]
            routed = np.where(d.routes[w, ti, hi], d.reco[w, pi, mi], d.dense[w])
            held_q[ci][sel] = routed[sel] - d.dense[0][sel]
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
            "dense": float(d.dense[0][ev].mean()),
            "paper_rfmem": float(paper_rf[ev].mean()),
            "paper_oracle": float(np.maximum(d.dense[0], paper_re)[ev].mean()),
            "tuned_cv": float((held_gain[ci] + dense_sum[ci].sum()) / n_q[ci].sum()),
            "gain_se": gain_se(held_q[ci][ev]),
        }
        in_sample[c.label] = float((gain[(ci, *best)].sum() + dense_sum[ci].sum()) / n_q[ci].sum())
    top_list = []
    for flat in order[:top]:
        idx = unravel(flat)
        top_list.append({
            "config": _short(_candidate_config(idx, space)), "objective_in_sample": float(obj[idx]),
            "fraction_recollecting": float(cost_frac[idx[0], idx[3], idx[4]]),
            "recall_in_sample": {c.label: float((gain[(ci, *idx)].sum() + dense_sum[ci].sum()) / n_q[ci].sum()) for ci, c in enumerate(conds)},
        })  # fmt: skip
    cost: dict[str, dict[str, dict[str, float]]] = {}
    if timing:
        runs = (("dense", paper, "dense"), ("paper_rfmem", paper, "rfmem"), ("recommended", rec_cfg, "rfmem"))
        cost = {c.label: _time_configs(data[ci].emb, runs, backend) for ci, c in enumerate(conds)}
    return TuneResult(
        conditions=conds, users=users, k=k, grid=grid, space=space, n_candidates=int(obj.size), recommended=rec_cfg,
        recommended_in_sample=in_sample, cv=cv, folds=folds, top=top_list, cost=cost,
        seconds=time.perf_counter() - t_start,
    )  # fmt: skip


_SHORT_KEYS = ("alpha", "beam_width", "fanout", "max_rounds", "mmr_lambda", "merge", "rrf_k", "rescore_weight",
               "temperature", "theta_high", "theta_low", "tau", "profile_weight")  # fmt: skip


def _short(cfg: RFMemConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    out = {k: d[k] for k in _SHORT_KEYS}
    if out["merge"] != "rrf":
        out.pop("rrf_k")
    if out["merge"] != "rescore":
        out.pop("rescore_weight")
    if not out["profile_weight"]:
        out.pop("profile_weight")
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
        f"{'condition':<34}{'dense':>9}{'paper RF-Mem':>14}{'tuned (CV)':>12}{'gain':>8}{'+- SE':>7}{'paper oracle':>14}",
    ]
    for label, v in res.cv.items():
        lines.append(
            f"{label:<34}{v['dense']:>9.4f}{v['paper_rfmem']:>14.4f}{v['tuned_cv']:>12.4f}"
            f"{100 * (v['tuned_cv'] - v['dense']):>+8.2f}{100 * v['gain_se']:>7.2f}{v['paper_oracle']:>14.4f}"
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


# ------------------------------------------------------------------ the learned re-ranker, nested CV

#: the re-ranker procedure's menu (``rfmem tune --grid rerank``), simplest first (ties go to
#: the earlier one). "mode" is the path every query takes while its pool is built: "dense"
#: never recollects (pool = the probe's top ``depth``), "recollection" always does (pool =
#: the probe's top ``depth`` + the recollected hits).
RERANK_SPECS: list[dict[str, Any]] = [
    {"name": "dense"},
    {"name": "rescore", "config": {"merge": "rescore", "rescore_weight": 0.5, **ALWAYS}},
    {"name": "profile", "features": ["cos", "profile"], "mode": "dense"},
    {"name": "learned merge", "features": ["cos", "support", "recollected"], "mode": "recollection"},
    {"name": "learned merge + profile", "features": ["cos", "profile", "support", "recollected"], "mode": "recollection"},
]


@dataclass
class _RerankData:
    users: np.ndarray  # [nq]
    evaluated: np.ndarray  # [nq] bool
    gts: list  # [nq] ground truth {alternative: [ids]}
    fixed: dict[str, np.ndarray]  # spec name -> [nq] recall of a spec without fitting
    pools: dict[str, Any]  # mode -> CandidatePools
    labels: dict[str, np.ndarray]  # mode -> [nq, L] int labels
    emb: Any


def _rerank_data(cond: Condition, data_dir: Any, depth: int, k: int, backend: str, emb_cache: Any,
                 say: Callable[[str], None]) -> _RerankData:  # fmt: skip
    """Pools, labels and the fixed specs' recalls of one condition."""
    from .datasets.embedded import personabench_embeddings
    from .routing import candidate_labels, question_recalls
    from .search import search, search_candidates

    emb = personabench_embeddings(data_dir, noise=cond.noise, encoder=cond.encoder, cache_dir=emb_cache, say=say)
    qs = emb.data.questions
    gts = [q.gt_segment_ids for q in qs]
    fixed = {"dense": question_recalls(search(emb.bank, emb.Q, emb.users, RFMemConfig(), mode="dense", backend=backend), gts, k)}
    for spec in RERANK_SPECS:
        if "config" in spec:
            res = search(emb.bank, emb.Q, emb.users, RFMemConfig(**spec["config"]), mode="rfmem", backend=backend)
            fixed[spec["name"]] = question_recalls(res, gts, k)
    pools, labels = {}, {}
    for mode in sorted({s["mode"] for s in RERANK_SPECS if "mode" in s}):
        pl = search_candidates(emb.bank, emb.Q, emb.users, RFMemConfig(), mode=mode, depth=depth, backend=backend)
        pools[mode], labels[mode] = pl, candidate_labels(pl.ids, pl.keep, gts)
    return _RerankData(np.asarray(emb.users), np.array([q.is_evaluated for q in qs]), gts, fixed, pools, labels, emb)


def _reranked_recalls(model: Any, d: _RerankData, mode: str, idx: np.ndarray, k: int) -> np.ndarray:
    """Recall@k of the questions ``idx`` re-ranked by ``model`` over their ``mode`` pools."""
    from .metrics import recall_at_k
    from .routing.merge import select_top

    pl = d.pools[mode]
    sc = model.score(pl.features[idx])
    order_key = np.broadcast_to(np.arange(pl.rows.shape[1])[None, :], sc.shape)
    rows, _ = select_top(sc, sc, pl.keep[idx], order_key, pl.rows[idx], k)
    out = np.zeros(len(idx))
    for n, i in enumerate(idx):
        id_of = {int(r): x for r, x in zip(pl.rows[i], pl.ids[i]) if r >= 0}
        out[n] = recall_at_k([str(id_of[int(r)]) for r in rows[n] if r >= 0], d.gts[i], k)
    return out


def rerank_cv_personabench(
    data_dir: str | os.PathLike[str],
    conditions: Sequence[tuple[str, float]],
    depth: int = 20,
    k: int = 10,
    C: float = 1.0,
    backend: str = "auto",
    emb_cache: Any = "default",
    timing: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The learned re-ranker procedure, judged by nested leave-one-user-out CV on PersonaBench.

    The procedure (applied to a set of training users): for every spec of
    :data:`RERANK_SPECS` (dense; the fixed "rescore" merge preset; linear re-rankers on
    named features of :mod:`rfmem_fast.routing.rerank`, fitted with
    :func:`rfmem_fast.routing.fit_reranker`, pairwise logistic regression with ``C``, on
    the pools of ``depth`` probe items), score it by an inner leave-one-user-out over the
    training users (each inner user re-ranked by a model fitted on the others); choose
    the spec of best objective (:mod:`rfmem_fast.tuning`'s: mean gain over dense across
    conditions plus the worst shortfall; ties to the earlier spec); refit it on all the
    training users. Every condition's questions of the training users are pooled to fit
    (one model per call, e.g. per encoder).

    Nested CV: the procedure runs on 5 users and its model re-ranks the 6th, for each
    user; the CV Recall@k pools these held-out scores. The returned model is the
    procedure on all users.

    Args:
        data_dir: folder holding ``synthetic_data/``.
        conditions: (encoder, noise) pairs pooled by the procedure.
        depth: probe items per pool (int >= 1).
        k: Recall cut-off.
        C: the logistic regression's inverse regularisation.
        backend: search backend.
        emb_cache: embedding cache folder ("default" or None).
        timing: time dense, paper RF-Mem and the chosen configuration per condition.
        progress: optional callable receiving status lines.

    Returns:
        JSON-serialisable dict: "cv" {condition: {dense, paper_rfmem, paper_oracle,
        tuned_cv}}, "folds" (held-out user, chosen spec, weights, held-out recall),
        "chosen" (the spec on all users), "model" (its LinearReranker or None),
        "in_sample" recall of the chosen on all users, "cost".

    Raises:
        ValueError: no condition, fewer than 3 users, k < 1, depth < 1.
    """
    from .datasets.embedded import default_embedding_cache_dir
    from .routing import question_recalls
    from .search import search

    say = progress or (lambda s: None)
    if not conditions:
        raise ValueError("no condition to evaluate on")
    if k < 1 or depth < 1:
        raise ValueError(f"k and depth must be >= 1, got {k}, {depth}")
    t_start = time.perf_counter()
    ecache = default_embedding_cache_dir() if emb_cache == "default" else emb_cache
    conds = [Condition(str(e), float(n)) for e, n in conditions]
    data = [_rerank_data(c, data_dir, depth, k, backend, ecache, say) for c in conds]
    users = list(dict.fromkeys(data[0].users.tolist()))
    if len(users) < 3:
        raise ValueError("nested leave-one-user-out needs at least 3 users")
    uarr = data[0].users
    ev = data[0].evaluated

    def fit(spec: dict[str, Any], train_users: Sequence[str]) -> Any:
        return _fit_spec(spec, data, train_users, depth, C)

    def recalls(spec: dict[str, Any], model: Any, ci: int, idx: np.ndarray) -> np.ndarray:
        d = data[ci]
        if model is None:
            return d.fixed[spec["name"]][idx]
        return _reranked_recalls(model, d, spec["mode"], idx, k)

    def choose(train_users: Sequence[str]) -> tuple[dict[str, Any], Any, dict[str, float]]:
        """The procedure on ``train_users``: inner leave-one-user-out per spec, best objective, refit."""
        scores = {}
        for spec in RERANK_SPECS:
            gains = np.zeros(len(conds))
            n = 0
            for v in train_users:
                model = fit(spec, [x for x in train_users if x != v])
                idx = np.flatnonzero((uarr == v) & ev)
                n += idx.size
                gains += [float((recalls(spec, model, ci, idx) - data[ci].fixed["dense"][idx]).sum()) for ci in range(len(conds))]
            g = gains / max(n, 1)
            scores[spec["name"]] = float(g.mean() + min(0.0, g.min()))
        best = max(RERANK_SPECS, key=lambda s: (round(scores[s["name"]], 12), -RERANK_SPECS.index(s)))
        return best, fit(best, train_users), scores

    held = np.zeros((len(conds), len(uarr)))
    folds = []
    for u in users:
        train = [x for x in users if x != u]
        spec, model, scores = choose(train)
        idx = np.flatnonzero((uarr == u) & ev)
        for ci in range(len(conds)):
            held[ci, idx] = recalls(spec, model, ci, idx)
        folds.append({
            "held_out_user": u, "chosen": spec["name"], "model": None if model is None else model.params(),
            "inner_objective": scores,
            "held_out_recall": {c.label: float(held[ci, idx].mean()) for ci, c in enumerate(conds)},
        })  # fmt: skip
        say(f"rerank cv: without {u}: {spec['name']}")
    spec, model, scores = choose(users)
    idx_all = np.flatnonzero(ev)
    cv, in_sample = {}, {}
    for ci, c in enumerate(conds):
        d = data[ci]
        emb = d.emb
        paper_rf = question_recalls(search(emb.bank, emb.Q, emb.users, RFMemConfig(), mode="rfmem", backend=backend), d.gts, k)
        paper_re = question_recalls(search(emb.bank, emb.Q, emb.users, RFMemConfig(), mode="recollection", backend=backend), d.gts, k)
        dense = d.fixed["dense"]
        cv[c.label] = {
            "dense": float(dense[ev].mean()), "paper_rfmem": float(paper_rf[ev].mean()),
            "paper_oracle": float(np.maximum(dense, paper_re)[ev].mean()), "tuned_cv": float(held[ci, ev].mean()),
            "gain_se": gain_se(held[ci, ev] - dense[ev]),
        }  # fmt: skip
        in_sample[c.label] = float(recalls(spec, model, ci, idx_all).mean())
    cost: dict[str, Any] = {}
    if timing:
        cost = _rerank_cost(data, conds, spec, model, backend)
    return {
        "protocol": "nested leave-one-user-out over the PersonaBench users; the procedure (inner leave-one-user-out "
        "choice among RERANK_SPECS by mean gain over dense + worst shortfall, refit on the training users) runs on 5 "
        "users and re-ranks the 6th",
        "conditions": [c.label for c in conds], "users": users, "k": k, "depth": depth, "C": C,
        "specs": RERANK_SPECS, "cv": cv, "folds": folds, "chosen": spec["name"], "chosen_objective": scores,
        "model": None if model is None else model.params(), "in_sample": in_sample, "cost": cost,
        "seconds": time.perf_counter() - t_start,
    }  # fmt: skip


def _fit_spec(spec: dict[str, Any], data: list, train_users: Sequence[str], depth: int, C: float) -> Any:
    """A spec's re-ranker fitted on the scored questions of ``train_users`` over every condition
    (None for a spec without a model). The one place :func:`rerank_cv_personabench` fits."""
    from .routing import concat_pools, fit_reranker

    if "features" not in spec:
        return None
    mode = spec["mode"]
    parts = []
    for d in data:
        mask = np.isin(d.users, list(train_users)) & d.evaluated
        parts.append((d.pools[mode].features[mask], d.pools[mode].keep[mask], d.labels[mode][mask]))
    F, K, Y = concat_pools(parts)
    return fit_reranker(F, K, Y, spec["features"], depth, C)


def rerank_config(spec_name: str, model_file: str | None) -> RFMemConfig:
    """The RFMemConfig of a :data:`RERANK_SPECS` entry (``model_file``: its fitted re-ranker file)."""
    spec = next((s for s in RERANK_SPECS if s["name"] == spec_name), None)
    if spec is None:
        raise ValueError(f"unknown spec {spec_name!r}; known: {[s['name'] for s in RERANK_SPECS]}")
    if "config" in spec:
        return RFMemConfig(**spec["config"])
    if "features" not in spec:
        return RFMemConfig(**NEVER)
    return RFMemConfig(reranker=model_file, **(ALWAYS if spec["mode"] == "recollection" else NEVER))


def _rerank_cost(data: list, conds: list, spec: dict[str, Any], model: Any, backend: str) -> dict[str, Any]:
    """ms per query (whole batch, median of 3) and fraction recollecting of dense, paper RF-Mem and the chosen spec."""
    import tempfile

    from .routing import save_reranker

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_reranker(model, Path(tmp) / "reranker.json") if model is not None else None
        runs = (("dense", RFMemConfig(), "dense"), ("paper_rfmem", RFMemConfig(), "rfmem"),
                ("chosen", rerank_config(spec["name"], path), "rfmem"))  # fmt: skip
        for ci, c in enumerate(conds):
            out[c.label] = _time_configs(data[ci].emb, runs, backend)
    return out


def _time_configs(emb: Any, runs: Sequence[tuple[str, RFMemConfig, str]], backend: str) -> dict[str, dict[str, float]]:
    """{name: {"ms_per_query", "fraction_recollecting"}}: one whole-batch search of every question
    per (name, config, mode), after a warm-up; median of 3."""
    from .search import search

    out = {}
    for name, cfg, mode in runs:
        search(emb.bank, emb.Q[:8], emb.users[:8], cfg, mode=mode, backend=backend)  # warm-up
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            res = search(emb.bank, emb.Q, emb.users, cfg, mode=mode, backend=backend)
            ts.append(time.perf_counter() - t0)
        out[name] = {"ms_per_query": 1e3 * float(np.median(ts)) / len(emb.users), "fraction_recollecting": float(np.mean(res.route == 1))}
    return out


def format_rerank_cv(res: dict[str, Any]) -> str:
    """:func:`rerank_cv_personabench`'s result as plain-text tables."""
    lines = [
        f"learned re-ranker procedure: {len(res['specs'])} specs, {len(res['conditions'])} conditions pooled, "
        f"{len(res['users'])} users, Recall@{res['k']}, pool depth {res['depth']}, {res['seconds']:.0f} s",
        "",
        f"Nested leave-one-user-out CV (each user re-ranked by the procedure run on the other {len(res['users']) - 1}):",
        f"{'condition':<34}{'dense':>9}{'paper RF-Mem':>14}{'procedure (CV)':>16}{'gain':>8}{'+- SE':>7}{'paper oracle':>14}",
    ]
    for label, v in res["cv"].items():
        lines.append(
            f"{label:<34}{v['dense']:>9.4f}{v['paper_rfmem']:>14.4f}{v['tuned_cv']:>16.4f}"
            f"{100 * (v['tuned_cv'] - v['dense']):>+8.2f}{100 * v['gain_se']:>7.2f}{v['paper_oracle']:>14.4f}"
        )
    lines += ["", "Chosen per fold:"]
    for f in res["folds"]:
        w = f["model"]
        ws = "" if w is None else " " + ", ".join(f"{n}={x:+.3g}" for n, x in zip(w["features"], w["weights"]))
        lines.append(f"  without {f['held_out_user']}: {f['chosen']}{ws}")
    lines += ["", f"On all users: {res['chosen']} (inner-CV objectives: "
              + ", ".join(f"{n} {v:+.4f}" for n, v in res["chosen_objective"].items()) + ")"]  # fmt: skip
    if res["model"]:
        lines.append("  model: " + ", ".join(f"{n}={x:+.4g}" for n, x in zip(res["model"]["features"], res["model"]["weights"])))
    if res["cost"]:
        lines.append(f"{'condition':<34}{'dense ms/q':>12}{'paper ms/q':>12}{'chosen ms/q':>13}{'chosen reco %':>15}")
        for label, c in res["cost"].items():
            lines.append(
                f"{label:<34}{c['dense']['ms_per_query']:>12.3f}{c['paper_rfmem']['ms_per_query']:>12.3f}"
                f"{c['chosen']['ms_per_query']:>13.3f}{100 * c['chosen']['fraction_recollecting']:>15.1f}"
            )
    return "\n".join(lines)
