"""``rfmem tune --grid hybrid``: choose the dense + lexical fusion by nested CV across datasets.

The question this answers: which fusion of the dense channel and the lexical (BM25)
channel (:mod:`rfmem_fast.fusion`, ``RFMemConfig.fusion`` / ``lexical_weight``) helps on
memories of *every* kind, not just one. PersonaBench's questions paraphrase their
memories (the lexical channel helps little and can hurt); LoCoMo's questions name
people, places and dates (it helps a lot). A choice is only trusted when it wins on
every condition.

Conditions: one per (dataset, encoder) -- PersonaBench at each noise level, the LoCoMo
conversations, a LongMemEval file -- each scored by its own protocol's Recall@k
(:mod:`rfmem_fast.datasets`). Every candidate of :data:`HYBRID_FAMILIES` is run on every
condition through :func:`rfmem_fast.evaluate_datasets.evaluate_dataset` (the real
``search``, mode "rfmem"), giving a per-question recall.

Selection objective for a set of training users: with ``g_c`` the gain in Recall@k of a
candidate over dense on condition ``c`` (those users' questions), ``objective = mean_c
g_c + min_c g_c``: the mean gain plus the gain on the worst dataset / noise level, so a
candidate that helps one dataset a lot at another's expense loses to one that helps
every condition (``objective="shortfall"`` is the objective of :mod:`rfmem_fast.tuning`,
``mean_c g_c + min(0, min_c g_c)``, which counts the worst condition only below dense).
Ties go to the earlier candidate (grid order: dense first, then the families in order).

Protocol (the honest score): **nested leave-one-user-out**, where a *user* is a
PersonaBench user (the same person at every noise level: one fold) or a LoCoMo
conversation (or a LongMemEval question's haystack). For each user the selection runs
on the other users' questions and the pick is scored on the held-out user's questions,
so every question is scored by a configuration chosen without it. The nested-CV
figure of a *family* (e.g. "convex raw") is this procedure restricted to the family's
candidates; the figure of "all" is the procedure that picks ``RFMemConfig.recommended``
(the same selection on all users, over every family).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .config import RFMemConfig

__all__ = ["HYBRID_FAMILIES", "CONTEXT_GRID", "CONTEXT_BASES", "DatasetCondition", "HybridTuneResult", "tune_hybrid",
           "tune_context", "context_candidates", "format_hybrid_tune", "hybrid_tune_json", "hybrid_candidates"]  # fmt: skip

#: selection objectives of :func:`tune_hybrid` (module docstring)
OBJECTIVES = ("mean+min", "shortfall")

#: never recollect: every query takes the Familiarity path (the probe's fused top-k)
NEVER_RECOLLECT = {"theta_high": -1.0, "theta_low": -1.0, "tau": 0.0}

#: candidate families of the hybrid grid: name -> list of RFMemConfig overrides (on top of NEVER_RECOLLECT)
HYBRID_FAMILIES: dict[str, list[dict[str, Any]]] = {
    "dense": [{}],
    "profile prior": [{"profile_weight": 0.3}],
    "convex raw": [{"fusion": "convex", "lexical_norm": "raw", "lexical_weight": w}
                   for w in (0.01, 0.015, 0.02, 0.025, 0.03, 0.04)],
    "convex max": [{"fusion": "convex", "lexical_norm": "max", "lexical_weight": w} for w in (0.05, 0.1, 0.15, 0.2)],
    "adaptive": [{"fusion": "adaptive", "lexical_weight": w} for w in (0.1, 0.15, 0.2, 0.3)],
    "rrf": [{"fusion": "rrf", "lexical_weight": 1.0, "lexical_rrf_k": k} for k in (5.0, 10.0, 20.0, 60.0)],
    "zscore": [{"fusion": "zscore", "lexical_weight": w} for w in (0.06, 0.08, 0.1, 0.12, 0.15)],
}  # fmt: skip


#: the context score's grid (``rfmem tune context``): RFMemConfig.context_weight (w_n),
#: context_radius (r), thread_weight (w_s); r matters only with w_n > 0
CONTEXT_GRID: dict[str, tuple] = {
    "context_weight": (0.0, 0.1, 0.2, 0.3, 0.5),
    "context_radius": (1, 2, 3),
    "thread_weight": (0.0, 0.1, 0.2, 0.3, 0.5),
}
#: the fusions the context grid is tried on: the "convex raw" family of the hybrid grid
#: (the MiniLM pick of ``rfmem tune hybrid``, RFMemConfig.recommended())
CONTEXT_BASES: list[dict[str, Any]] = list(HYBRID_FAMILIES["convex raw"])


def context_candidates(bases: Sequence[dict[str, Any]] | None = None) -> list[tuple[str, RFMemConfig]]:
    """The context grid as (family, RFMemConfig) pairs: "dense" first, then per base fusion
    the fusion alone (family "fusion") and the fusion with every context setting of
    :data:`CONTEXT_GRID` that turns the score on (family "context"; the radius only with
    ``context_weight > 0``).

    Args:
        bases: RFMemConfig overrides of the base fusions (default :data:`CONTEXT_BASES`).
    """
    bases = CONTEXT_BASES if bases is None else list(bases)
    out = [("dense", RFMemConfig(**NEVER_RECOLLECT))]
    g = CONTEXT_GRID
    for base in bases:
        out.append(("fusion", RFMemConfig(**{**NEVER_RECOLLECT, **base})))
        for wn in g["context_weight"]:
            for r in g["context_radius"] if wn > 0 else g["context_radius"][1:2]:
                for ws in g["thread_weight"]:
                    if wn == 0 and ws == 0:
                        continue
                    ctx = {"context_weight": wn, "context_radius": r, "thread_weight": ws}
                    out.append(("context", RFMemConfig(**{**NEVER_RECOLLECT, **base, **ctx})))
    return out


def hybrid_candidates(families: Sequence[str] | None = None) -> list[tuple[str, RFMemConfig]]:
    """The grid as (family, RFMemConfig) pairs, dense first.

    Args:
        families: names of :data:`HYBRID_FAMILIES` (default all); "dense" is always included.

    Raises:
        ValueError: an unknown family name (the message lists the known ones).
    """
    names = list(HYBRID_FAMILIES) if families is None else ["dense"] + [f for f in families if f != "dense"]
    bad = [f for f in names if f not in HYBRID_FAMILIES]
    if bad:
        raise ValueError(f"unknown hybrid families {bad}; known: {list(HYBRID_FAMILIES)}")
    return [(f, RFMemConfig(**{**NEVER_RECOLLECT, **o})) for f in names for o in HYBRID_FAMILIES[f]]


@dataclass(frozen=True)
class DatasetCondition:
    """One condition of :func:`tune_hybrid`: a loaded dataset with an encoder.

    Attributes:
        label: the condition's name in tables (e.g. "pb 0.3", "locomo").
        dataset: a dataset of the loader interface (:mod:`rfmem_fast.datasets.base`).
        encoder: the encoder argument of :func:`rfmem_fast.datasets.embedded.dataset_embeddings`.
        group: the fold prefix of its users: conditions sharing a group share users
            (PersonaBench at several noise levels: one person, one fold).
    """

    label: str
    dataset: Any
    encoder: Any = None
    group: str = ""


@dataclass
class HybridTuneResult:
    """What :func:`tune_hybrid` found (:func:`hybrid_tune_json` gives the layout)."""

    conditions: list[str]
    users: list[str]
    k: int
    recommended: RFMemConfig
    recommended_family: str
    dense: dict[str, float]
    in_sample: dict[str, dict[str, float]]  # candidate name -> condition -> recall (all users)
    nested: dict[str, dict[str, float]]  # family ("all" too) -> condition -> nested-CV recall
    nested_se: dict[str, dict[str, float]]  # family -> condition -> paired SE of the gain
    picks: dict[str, list[str]]  # family -> the candidate picked in each outer fold
    seconds: float
    objective: str = "mean+min"
    notes: list[str] = field(default_factory=list)


def _name(family: str, cfg: RFMemConfig) -> str:
    if family == "dense":
        return "dense"
    if family == "profile prior":
        return f"profile {cfg.profile_weight:g}"
    if cfg.fusion == "rrf":
        return f"rrf k={cfg.lexical_rrf_k:g}"
    norm = f" {cfg.lexical_norm}" if cfg.fusion == "convex" else ""
    name = f"{cfg.fusion}{norm} w={cfg.lexical_weight:g}" if cfg.lexical_weight > 0 else "dense"
    if cfg.context_on:
        name += f" + context w_n={cfg.context_weight:g} r={cfg.context_radius} w_s={cfg.thread_weight:g}"
    return name


def tune_hybrid(
    conditions: Sequence[DatasetCondition],
    families: Sequence[str] | None = None,
    k: int = 10,
    backend: str = "auto",
    cache_dir: Any = "default",
    progress: Callable[[str], None] | None = None,
    objective: str = "mean+min",
) -> HybridTuneResult:
    """Nested leave-one-user-out CV of the hybrid grid over several datasets (module docstring).

    Args:
        conditions: the conditions (at least one; users pooled over conditions by
            ``group`` + user key).
        families: names of :data:`HYBRID_FAMILIES` to search (default all).
        k: Recall cut-off (int >= 1).
        backend: search backend name.
        cache_dir: embedding cache ("default": the user's cache; None: none).
        progress: optional callable receiving status lines.
        objective: "mean+min" (default) or "shortfall" (module docstring).

    Returns:
        HybridTuneResult: ``recommended`` is the pick of the selection on all users.

    Raises:
        ValueError: no condition, fewer than 2 users, k < 1, an unknown family or objective.
    """
    return _tune_candidates(conditions, hybrid_candidates(families), k, backend, cache_dir, progress, objective, "hybrid")


def tune_context(
    conditions: Sequence[DatasetCondition],
    bases: Sequence[dict[str, Any]] | None = None,
    k: int = 10,
    backend: str = "auto",
    cache_dir: Any = "default",
    progress: Callable[[str], None] | None = None,
    objective: str = "mean+min",
) -> HybridTuneResult:
    """``rfmem tune context``: the context score (``RFMemConfig.context_weight`` /
    ``context_radius`` / ``thread_weight``) on top of the hybrid fusions, chosen by the
    same nested leave-one-user-out CV across datasets as :func:`tune_hybrid` (module
    docstring; the datasets' loaders give the items' threads: LoCoMo sessions,
    PersonaBench session series).

    Candidates (:func:`context_candidates`): dense, each base fusion alone (family
    "fusion"), each base fusion with each context setting of :data:`CONTEXT_GRID` (family
    "context"); "all" is the procedure over every candidate (it may pick no context).

    Args:
        conditions, k, backend, cache_dir, progress, objective: as :func:`tune_hybrid`.
        bases: the base fusions (RFMemConfig overrides; default :data:`CONTEXT_BASES`).

    Returns:
        HybridTuneResult (``recommended``: the pick on all users).

    Raises:
        ValueError: as :func:`tune_hybrid`.
    """
    return _tune_candidates(conditions, context_candidates(bases), k, backend, cache_dir, progress, objective, "context")


def _tune_candidates(conditions: Sequence[DatasetCondition], cands: list[tuple[str, RFMemConfig]], k: int, backend: str,
                     cache_dir: Any, progress: Callable[[str], None] | None, objective: str,
                     what: str) -> HybridTuneResult:  # fmt: skip
    """The nested leave-one-user-out CV of :func:`tune_hybrid` over the candidates ``cands``
    ((family, config) pairs, dense first); ``what`` names the grid in progress lines."""
    from .datasets.embedded import dataset_embeddings, default_embedding_cache_dir
    from .evaluate_datasets import evaluate_dataset
    from .tuning import gain_se

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not conditions:
        raise ValueError("conditions: no condition to tune on")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    names = [_name(f, c) for f, c in cands]
    ecache = default_embedding_cache_dir() if cache_dir == "default" else cache_dir
    rec: list[np.ndarray] = []  # per condition: [n_candidates, nq]
    qusers: list[np.ndarray] = []  # per condition: fold user of each question
    for cond in conditions:
        emb = dataset_embeddings(cond.dataset, encoder=cond.encoder, cache_dir=ecache, say=say)
        rows = []
        for f, cfg in cands:
            s = evaluate_dataset(cond.dataset, emb, cfg, mode="rfmem", k=k, backend=backend)
            rows.append(s.recall)
        rec.append(np.stack(rows))
        qusers.append(np.array([f"{cond.group}{u}" for u in s.users], dtype=object))
        say(f"tune {what}: {cond.label}: {len(cands)} candidates x {len(s.users)} questions")
    users = sorted(set(u for qu in qusers for u in qu.tolist()))
    if len(users) < 2:
        raise ValueError("leave-one-user-out needs at least 2 users")
    labels = [c.label for c in conditions]
    fam_of = np.array([f for f, _ in cands], dtype=object)

    def gains(mask_per_cond: list[np.ndarray]) -> np.ndarray:
        """[C, n_candidates] mean gain over dense on the masked questions (0 where none)."""
        out = np.zeros((len(conditions), len(cands)))
        for ci, (r, m) in enumerate(zip(rec, mask_per_cond)):
            if m.any():
                out[ci] = (r[:, m] - r[0, m]).mean(axis=1)
        return out

    def pick(train_users: set[str], allowed: np.ndarray) -> int:
        masks = [np.array([u in train_users for u in qu]) for qu in qusers]
        g = gains(masks)
        present = np.array([m.any() for m in masks])
        g = g[present]
        worst = g.min(axis=0)
        obj = g.mean(axis=0) + (worst if objective == "mean+min" else np.minimum(0.0, worst))
        obj = np.where(allowed, np.round(obj, 12), -np.inf)
        return int(np.argmax(obj))  # first maximum: grid order breaks ties

    fams = list(dict.fromkeys(fam_of.tolist())) + ["all"]
    nested: dict[str, dict[str, float]] = {}
    nested_se: dict[str, dict[str, float]] = {}
    picks: dict[str, list[str]] = {}
    for fam in fams:
        allowed = np.ones(len(cands), bool) if fam == "all" else fam_of == fam
        held = [np.zeros(r.shape[1]) for r in rec]
        chosen = []
        for u in users:
            j = pick(set(users) - {u}, allowed)
            chosen.append(f"{u}: {names[j]}")
            for ci, qu in enumerate(qusers):
                sel = qu == u
                held[ci][sel] = rec[ci][j, sel]
        nested[fam] = {lab: float(h.mean()) for lab, h in zip(labels, held)}
        nested_se[fam] = {lab: gain_se(h - r[0]) for lab, h, r in zip(labels, held, rec)}
        picks[fam] = chosen
    best = pick(set(users), np.ones(len(cands), bool))
    in_sample = {names[j]: {lab: float(r[j].mean()) for lab, r in zip(labels, rec)} for j in range(len(cands))}
    return HybridTuneResult(
        conditions=labels, users=users, k=k, recommended=cands[best][1], recommended_family=cands[best][0],
        dense={lab: float(r[0].mean()) for lab, r in zip(labels, rec)}, in_sample=in_sample, nested=nested,
        nested_se=nested_se, picks=picks, seconds=time.perf_counter() - t0, objective=objective,
    )  # fmt: skip


def format_hybrid_tune(res: HybridTuneResult, what: str = "hybrid") -> str:
    """A plain-text report: Recall@k of dense and the nested-CV gain of every family per condition,
    and the in-sample gain of the pick on all users (``what``: the grid's name in the title)."""
    labs = res.conditions
    lines = [f"{what} tuning, Recall@{res.k}, nested leave-one-user-out over {len(res.users)} users"]
    head = f"{'procedure':<16}" + "".join(f"{lab:>16}" for lab in labs)
    lines += [head, f"{'dense':<16}" + "".join(f"{res.dense[lab]:>16.4f}" for lab in labs)]
    for fam, row in res.nested.items():
        if fam == "dense":
            continue
        cells = "".join(
            f"{100 * (row[lab] - res.dense[lab]):>+9.2f} ({100 * res.nested_se[fam][lab]:.2f})" for lab in labs
        )
        lines.append(f"{fam:<16}{cells}")
    lines.append("(gains in points over dense, paired standard error in brackets)")
    pick = _name(res.recommended_family, res.recommended)
    lines.append(f"recommended (the pick on all users): {pick}")
    if pick in res.in_sample:
        row = res.in_sample[pick]
        lines.append("  its in-sample gains: " + ", ".join(f"{lab} {100 * (row[lab] - res.dense[lab]):+.2f}" for lab in labs))
    return "\n".join(lines)


def hybrid_tune_json(res: HybridTuneResult) -> dict[str, Any]:
    """The result as a JSON-serialisable dict (recommended config as its fields)."""
    return {
        "k": res.k, "objective": res.objective, "conditions": res.conditions, "users": res.users,
        "recommended": {"family": res.recommended_family, "name": _name(res.recommended_family, res.recommended),
                        "config": res.recommended.to_dict()},
        "dense": res.dense, "nested_cv": res.nested, "nested_cv_gain_se": res.nested_se, "picks": res.picks,
        "in_sample": res.in_sample, "seconds": res.seconds, "notes": res.notes,
    }  # fmt: skip
