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

Selection objective for a set of training users (the one of :mod:`rfmem_fast.tuning`):
with ``g_c`` the gain in Recall@k of a candidate over dense on condition ``c`` (those
users' questions), ``objective = mean_c g_c + min(0, min_c g_c)``: the mean gain, with a
shortfall below dense on any dataset / noise level counted twice. Ties go to the
earlier candidate (grid order: dense first, then the families in order).

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

__all__ = ["HYBRID_FAMILIES", "DatasetCondition", "HybridTuneResult", "tune_hybrid", "format_hybrid_tune",
           "hybrid_tune_json", "hybrid_candidates"]  # fmt: skip

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
    notes: list[str] = field(default_factory=list)


def _name(family: str, cfg: RFMemConfig) -> str:
    if family == "dense":
        return "dense"
    if family == "profile prior":
        return f"profile {cfg.profile_weight:g}"
    if cfg.fusion == "rrf":
        return f"rrf k={cfg.lexical_rrf_k:g}"
    norm = f" {cfg.lexical_norm}" if cfg.fusion == "convex" else ""
    return f"{cfg.fusion}{norm} w={cfg.lexical_weight:g}"


def tune_hybrid(
    conditions: Sequence[DatasetCondition],
    families: Sequence[str] | None = None,
    k: int = 10,
    backend: str = "auto",
    cache_dir: Any = "default",
    progress: Callable[[str], None] | None = None,
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

    Returns:
        HybridTuneResult: ``recommended`` is the pick of the selection on all users.

    Raises:
        ValueError: no condition, fewer than 2 users, k < 1, an unknown family.
    """
    from .datasets.embedded import dataset_embeddings, default_embedding_cache_dir
    from .evaluate_datasets import evaluate_dataset
    from .tuning import gain_se

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not conditions:
        raise ValueError("conditions: no condition to tune on")
    cands = hybrid_candidates(families)
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
        say(f"tune hybrid: {cond.label}: {len(cands)} candidates x {len(s.users)} questions")
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
        obj = g.mean(axis=0) + np.minimum(0.0, g.min(axis=0))
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
        nested_se=nested_se, picks=picks, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def format_hybrid_tune(res: HybridTuneResult) -> str:
    """A plain-text report: Recall@k of dense and the nested-CV gain of every family per condition."""
    labs = res.conditions
    lines = [f"hybrid tuning, Recall@{res.k}, nested leave-one-user-out over {len(res.users)} users"]
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
    lines.append(f"recommended (the pick on all users): {_name(res.recommended_family, res.recommended)}")
    return "\n".join(lines)


def hybrid_tune_json(res: HybridTuneResult) -> dict[str, Any]:
    """The result as a JSON-serialisable dict (recommended config as its fields)."""
    return {
        "k": res.k, "conditions": res.conditions, "users": res.users,
        "recommended": {"family": res.recommended_family, "name": _name(res.recommended_family, res.recommended),
                        "config": res.recommended.to_dict()},
        "dense": res.dense, "nested_cv": res.nested, "nested_cv_gain_se": res.nested_se, "picks": res.picks,
        "in_sample": res.in_sample, "seconds": res.seconds, "notes": res.notes,
    }  # fmt: skip
