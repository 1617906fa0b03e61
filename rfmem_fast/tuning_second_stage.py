"""``rfmem tune second-stage``: the learned second stage (:mod:`rfmem_fast.second_stage`) by nested CV.

The question: does re-ranking the first stage's top N (``RFMemConfig.recommended()``'s
fused + context list) with a small learned model find more of the evidence in the top k
than the first stage itself, on every dataset and noise level?

Conditions and folds are those of :mod:`rfmem_fast.tuning_datasets`: PersonaBench at
each noise level and the LoCoMo conversations (one :class:`DatasetCondition` each); a
*user* is a PersonaBench person (one fold at every noise level: the same questions and
mostly the same memories recur across levels, so a person is never both trained on and
scored) or a LoCoMo conversation.

Candidates (:func:`stage_candidates`): "off" (the first stage's own top k), linear
pairwise models (:func:`rfmem_fast.second_stage.fit_linear_stage`) over a grid of the
depth N and the regularisation C, and tree ensembles
(:func:`rfmem_fast.second_stage.fit_tree_stage`) over a grid of N and their size.

Procedure (the honest score): **nested leave-one-user-out**. For each held-out user u,
each candidate is scored by an inner leave-one-user-out CV on the other users (a model
fitted without u and without v scores v's questions, for every v != u), the selection
objective is ``mean_c g_c + min_c g_c`` over the conditions, ``g_c`` the mean Recall@k
gain over the first stage on condition c (the objective of ``rfmem tune context``); the
pick is refitted on all users but u and scores u's questions. So no question is scored by
a model fitted, or chosen, with its user. The family figures restrict the candidates
("linear": linear models only, "trees": trees only; "all": every candidate, "off"
included, so the procedure may decline the stage). The in-sample figure fits the
all-user pick on every user and scores them all (optimistic by construction).

Fits are shared: the model fitted without users {u, v} serves both the inner fold (u, v)
and (v, u).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .config import RFMemConfig
from .second_stage import LINEAR_FEATURES, TREE_FEATURES, features_from_result, fit_linear_stage, fit_tree_stage, stage_labels

__all__ = ["StageCandidate", "StageCondition", "stage_candidates", "prepare_stage_conditions", "tune_second_stage",
           "format_second_stage", "second_stage_json", "SecondStageResult", "DEPTHS", "LINEAR_CS", "TREE_SIZES"]  # fmt: skip

#: the depths N tried
DEPTHS = (20, 30, 50)
#: the linear models' C grid
LINEAR_CS = (0.01, 0.1, 1.0)
#: the tree models' (max_iter, max_leaf_nodes) grid
TREE_SIZES = ((50, 7), (150, 15))


@dataclass(frozen=True)
class StageCandidate:
    """One candidate of the grid: ``family`` ("off" | "linear" | "trees"), ``depth`` N and
    the fit's keyword arguments ``params``; ``name`` labels it in tables."""

    family: str
    depth: int = 0
    params: tuple = ()

    @property
    def name(self) -> str:
        """e.g. "linear N=50 C=0.1"."""
        if self.family == "off":
            return "off"
        return f"{self.family} N={self.depth} " + " ".join(f"{k}={v:g}" for k, v in self.params)

    def fit(self, F: np.ndarray, V: np.ndarray, Y: np.ndarray) -> Any:
        """The fitted model (:func:`fit_linear_stage` / :func:`fit_tree_stage`) on these lists."""
        kw = dict(self.params)
        if self.family == "linear":
            return fit_linear_stage(F, V, Y, LINEAR_FEATURES, depth=self.depth, **kw)
        if self.family == "trees":
            return fit_tree_stage(F, V, Y, TREE_FEATURES, depth=self.depth, **kw)
        raise ValueError(f"candidate family {self.family!r} fits nothing")


def stage_candidates(families: Sequence[str] = ("linear", "trees"), depths: Sequence[int] = DEPTHS) -> list[StageCandidate]:
    """"off" first, then the linear grid (depths x :data:`LINEAR_CS`) and the tree grid
    (depths x :data:`TREE_SIZES`) of the families asked for.

    Raises:
        ValueError: an unknown family.
    """
    bad = [f for f in families if f not in ("linear", "trees")]
    if bad:
        raise ValueError(f"families must be among ('linear', 'trees'), got {bad}")
    out = [StageCandidate("off")]
    if "linear" in families:
        out += [StageCandidate("linear", int(n), (("C", c),)) for n in depths for c in LINEAR_CS]
    if "trees" in families:
        out += [StageCandidate("trees", int(n), (("max_iter", it), ("max_leaf_nodes", lv))) for n in depths
                for it, lv in TREE_SIZES]  # fmt: skip
    return out


@dataclass
class StageCondition:
    """One condition's first-stage lists, features and labels at every depth.

    Attributes:
        label: e.g. "pb 0.3"; dataset: the dataset; qrows: int [nq] its scored questions.
        users: object [nq] fold key of each question ("pb:<user>", "locomo:<conv>").
        ids: object [nq, Nmax] first-stage ids (None padding).
        feats: {N: (features [nq, N, F], valid [nq, N], labels [nq, N])}.
        first: float [nq] Recall@k of the first stage; dense: float [nq] of dense retrieval.
        search_s / feature_s: seconds of the batched search (out_k = Nmax) and of the features per depth.
    """

    label: str
    dataset: Any
    qrows: np.ndarray
    users: np.ndarray
    ids: np.ndarray
    feats: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    first: np.ndarray
    dense: np.ndarray
    search_s: float = 0.0
    feature_s: dict[int, float] = field(default_factory=dict)

    def recall(self, sel: np.ndarray, order: np.ndarray | None, k: int) -> np.ndarray:
        """Recall@k float [len(sel)] of the questions ``sel`` (indices into qrows) with the
        lists re-ordered by ``order`` ([len(sel), >= k] columns, -1 padding) or the first stage's (None)."""
        ds, qs = self.dataset, self.dataset.questions
        out = np.zeros(len(sel))
        for j, i in enumerate(sel):
            row = self.ids[i]
            ids = [row[c] for c in (order[j] if order is not None else range(row.shape[0])) if c >= 0]
            ids = [str(x) for x in ids if x is not None][:k]
            out[j] = ds.score(qs[int(self.qrows[i])], ids, k)["recall"]
        return out


def prepare_stage_conditions(conditions: Sequence[Any], depths: Sequence[int] = DEPTHS, k: int = 10,
                             config: RFMemConfig | None = None, backend: str = "auto", cache_dir: Any = "default",
                             progress: Callable[[str], None] | None = None) -> list[StageCondition]:  # fmt: skip
    """Search every condition's scored questions with the first stage (``config``, default
    ``RFMemConfig.recommended()``, at ``out_k = max(depths)``) and dense retrieval, and build
    the features and labels at every depth.

    Args:
        conditions: :class:`rfmem_fast.tuning_datasets.DatasetCondition` list.
        depths: the depths N (ints >= k).
        k: Recall cut-off.
        config, backend, cache_dir, progress: the first stage, search backend, embedding
            cache ("default": the user's), status lines.

    Returns:
        list[StageCondition], one per condition.

    Raises:
        ValueError: a depth below k; as the search.
    """
    from .datasets.embedded import dataset_embeddings, default_embedding_cache_dir
    from .evaluate_datasets import score_result, search_dataset
    from .tuning_datasets import NEVER_RECOLLECT

    say = progress or (lambda s: None)
    depths = sorted({int(n) for n in depths})
    if not depths or depths[0] < k:
        raise ValueError(f"depths must be >= k = {k}, got {depths}")
    cfg = config or RFMemConfig.recommended(second_stage=None)
    ecache = default_embedding_cache_dir() if cache_dir == "default" else cache_dir
    out = []
    for cond in conditions:
        ds = cond.dataset
        emb = dataset_embeddings(ds, encoder=cond.encoder, cache_dir=ecache, say=say)
        qrows = np.array([i for i, q in enumerate(ds.questions) if q.scored], dtype=np.int64)
        t0 = time.perf_counter()
        res = search_dataset(emb, qrows, cfg.replace(out_k=max(depths)), "rfmem", backend)
        search_s = time.perf_counter() - t0
        dres = search_dataset(emb, qrows, RFMemConfig(**NEVER_RECOLLECT, out_k=k), "dense", backend)
        snap = emb.bank.snapshot()
        texts = [ds.questions[int(i)].text for i in qrows]
        rel = [ds.questions[int(i)].ground_truth for i in qrows]
        rel = [g if isinstance(g, dict) else list(getattr(g, "correct", g)) for g in rel]
        feats, fsec = {}, {}
        for n in depths:
            t0 = time.perf_counter()
            F, V = features_from_result(res, snap, texts, n)
            fsec[n] = time.perf_counter() - t0
            feats[n] = (F, V, stage_labels(np.asarray(res.ids)[:, :n], V, rel))
        sc = StageCondition(
            label=cond.label, dataset=ds, qrows=qrows,
            users=np.array([f"{cond.group}{ds.questions[int(i)].user_key}" for i in qrows], dtype=object),
            ids=np.asarray(res.ids), feats=feats, first=np.zeros(0), dense=score_result(ds, qrows, dres, k)["recall"],
            search_s=search_s, feature_s=fsec,
        )  # fmt: skip
        sc.first = sc.recall(np.arange(len(qrows)), None, k)
        say(f"second stage: {cond.label}: {len(qrows)} questions, first stage Recall@{k} {sc.first.mean():.4f}")
        out.append(sc)
    return out


@dataclass
class SecondStageResult:
    """What :func:`tune_second_stage` measured (:func:`second_stage_json` gives the layout)."""

    conditions: list[str]
    users: list[str]
    k: int
    dense: dict[str, float]
    first: dict[str, float]
    nested: dict[str, dict[str, float]]
    nested_se: dict[str, dict[str, float]]
    picks: dict[str, list[str]]
    pick_all: str
    in_sample: dict[str, float]
    fixed: dict[str, dict[str, float]]
    model: Any
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: family -> condition -> float [nq]: each question's held-out Recall@k (the nested figures' values)
    held: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


def tune_second_stage(data: Sequence[StageCondition], candidates: Sequence[StageCandidate], k: int = 10,
                      progress: Callable[[str], None] | None = None) -> SecondStageResult:  # fmt: skip
    """Nested leave-one-user-out CV of the second stage over prepared conditions (module docstring).

    Args:
        data: :func:`prepare_stage_conditions`' output (every candidate's depth among its depths).
        candidates: :func:`stage_candidates`' output ("off" first).
        k: Recall cut-off.
        progress: status lines.

    Returns:
        SecondStageResult (``model``: the all-user pick fitted on every user, or None for "off").

    Raises:
        ValueError: fewer than 2 users, a candidate depth that was not prepared.
    """
    from .tuning import gain_se

    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    users = sorted({u for c in data for u in c.users.tolist()})
    if len(users) < 2:
        raise ValueError("leave-one-user-out needs at least 2 users")
    for cand in candidates:
        if cand.family != "off" and any(cand.depth not in c.feats for c in data):
            raise ValueError(f"candidate {cand.name}: depth {cand.depth} was not prepared")
    labels = [c.label for c in data]
    by_user = [{u: np.flatnonzero(c.users == u) for u in users} for c in data]
    models: dict[tuple[int, frozenset], Any] = {}
    scores: dict[tuple[int, frozenset, str], list[np.ndarray]] = {}

    def model(ci: int, excl: frozenset) -> Any:
        key = (ci, excl)
        if key not in models:
            cand = candidates[ci]
            parts = []
            for c, bu in zip(data, by_user):
                sel = np.concatenate([bu[u] for u in users if u not in excl] or [np.zeros(0, np.int64)])
                F, V, Y = c.feats[cand.depth]
                parts.append((F[sel], V[sel], Y[sel]))
            models[key] = cand.fit(*(np.concatenate([p[j] for p in parts]) for j in range(3)))
        return models[key]

    def user_recall(ci: int, excl: frozenset, u: str) -> list[np.ndarray]:
        """Per condition: Recall@k of user u's questions under candidate ci fitted without ``excl``."""
        key = (ci, excl, u)
        if key not in scores:
            cand = candidates[ci]
            out = []
            for c, bu in zip(data, by_user):
                sel = bu[u]
                if cand.family == "off" or sel.size == 0:
                    out.append(c.first[sel])
                    continue
                F, V, _ = c.feats[cand.depth]
                order, _ = model(ci, excl).rerank(F[sel], V[sel], k)
                out.append(c.recall(sel, order, k))
            scores[key] = out
        return scores[key]

    def objective(ci: int, train: Sequence[str], outer: frozenset) -> float:
        """Inner LOUO objective of candidate ci over the users ``train`` (each scored by a
        fit without itself and ``outer``)."""
        gains = []
        for cidx, c in enumerate(data):
            got = [user_recall(ci, outer | {v}, v)[cidx] - c.first[by_user[cidx][v]] for v in train]
            g = np.concatenate(got)
            if g.size:
                gains.append(g.mean())
        g = np.array(gains)
        return float(np.round(g.mean() + g.min(), 12))

    fams = {"linear": [i for i, c in enumerate(candidates) if c.family == "linear"],
            "trees": [i for i, c in enumerate(candidates) if c.family == "trees"],
            "all": list(range(len(candidates)))}  # fmt: skip
    fams = {f: ix for f, ix in fams.items() if ix and (f == "all" or len(ix) > 0)}
    nested, nested_se, picks, held_all = {}, {}, {}, {}
    for fam, idx in fams.items():
        held = [c.first.copy() for c in data]
        chosen = []
        for u in users:
            train = [v for v in users if v != u]
            obj = [objective(ci, train, frozenset({u})) for ci in idx]
            ci = idx[int(np.argmax(obj))]  # first maximum: grid order ("off" first) breaks ties
            chosen.append(f"{u}: {candidates[ci].name}")
            got = user_recall(ci, frozenset({u}), u)
            for cidx in range(len(data)):
                held[cidx][by_user[cidx][u]] = got[cidx]
            say(f"second stage {fam}: held out {u}: {candidates[ci].name} ({len(models)} fits so far)")
        held_all[fam] = dict(zip(labels, held))
        nested[fam] = {lab: float(h.mean()) for lab, h in zip(labels, held)}
        nested_se[fam] = {lab: gain_se(h - c.first) for lab, h, c in zip(labels, held, data)}
        picks[fam] = chosen
    # the all-user pick (LOUO objective over every user) fitted on every user; its in-sample figure
    obj = [objective(ci, users, frozenset()) for ci in fams["all"]]
    best = fams["all"][int(np.argmax(obj))]
    fixed = {}
    for ci, cand in enumerate(candidates):  # plain LOUO (not nested) of every candidate, for reference
        if cand.family == "off":
            continue
        fixed[cand.name] = {}
        for cidx, (lab, c) in enumerate(zip(labels, data)):
            r = c.first.copy()
            for u in users:
                r[by_user[cidx][u]] = user_recall(ci, frozenset({u}), u)[cidx]
            fixed[cand.name][lab] = float(r.mean())
    in_sample = {lab: float(c.first.mean()) for lab, c in zip(labels, data)}
    fitted = None
    if candidates[best].family != "off":
        fitted = model(best, frozenset())
        for cidx, (lab, c) in enumerate(zip(labels, data)):
            F, V, _ = c.feats[candidates[best].depth]
            order, _ = fitted.rerank(F, V, k)
            in_sample[lab] = float(c.recall(np.arange(len(c.qrows)), order, k).mean())
    return SecondStageResult(
        conditions=labels, users=users, k=k, dense={lab: float(c.dense.mean()) for lab, c in zip(labels, data)},
        first={lab: float(c.first.mean()) for lab, c in zip(labels, data)}, nested=nested, nested_se=nested_se,
        picks=picks, pick_all=candidates[best].name, in_sample=in_sample, fixed=fixed, model=fitted,
        seconds=time.perf_counter() - t0, held=held_all,
    )  # fmt: skip


def format_second_stage(res: SecondStageResult) -> str:
    """Plain-text table: Recall@k of dense and the first stage, and the nested-CV gain of each
    family over the first stage per condition (paired standard error in brackets)."""
    labs = res.conditions
    w = 17
    lines = [f"second stage, Recall@{res.k}, nested leave-one-user-out over {len(res.users)} users",
             f"{'procedure':<22}" + "".join(f"{lab:>{w}}" for lab in labs),
             f"{'dense':<22}" + "".join(f"{res.dense[lab]:>{w}.4f}" for lab in labs),
             f"{'first stage':<22}" + "".join(f"{res.first[lab]:>{w}.4f}" for lab in labs)]  # fmt: skip
    for fam, row in res.nested.items():
        lines.append(f"{'+ ' + fam + ' (nested)':<22}" + "".join(f"{row[lab]:>{w}.4f}" for lab in labs))
        lines.append(f"{'  gain, points':<22}" + "".join(
            f"{100 * (row[lab] - res.first[lab]):>+10.2f} ({100 * res.nested_se[fam][lab]:.2f})" for lab in labs))
    lines.append(f"{'in-sample: ' + res.pick_all:<22}")
    lines.append(f"{'':<22}" + "".join(f"{res.in_sample[lab]:>{w}.4f}" for lab in labs))
    return "\n".join(lines)


def second_stage_json(res: SecondStageResult, data: Sequence[StageCondition] = ()) -> dict[str, Any]:
    """The result as a JSON-serialisable dict (the all-user model as its file document)."""
    from .second_stage import stage_document

    return {
        "k": res.k, "conditions": res.conditions, "users": res.users, "dense": res.dense, "first_stage": res.first,
        "nested_cv": res.nested, "nested_cv_gain_se": res.nested_se, "picks": res.picks, "pick_all_users": res.pick_all,
        "in_sample": res.in_sample, "plain_louo_per_candidate": res.fixed,
        "model_all_users": None if res.model is None else stage_document(res.model),
        "search_s": {c.label: c.search_s for c in data}, "feature_s": {c.label: c.feature_s for c in data},
        "seconds": res.seconds, "notes": res.notes,
    }  # fmt: skip
