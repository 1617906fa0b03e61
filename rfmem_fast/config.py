"""The one configuration object of RF-Mem retrieval (RFMEM_SPEC.md, all sections).

Every knob of the algorithm is a field of :class:`RFMemConfig`; the defaults are the
configuration of the authors' PersonaBench script, the one the golden values and the
reference numbers of RFMEM_SPEC.md section 7 were measured with.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

ENTROPY_CONVENTIONS = ("mean", "sum", "normalized")
#: RFMemConfig.merge values (rfmem_fast.routing.merge documents them)
MERGE_MODES = ("none", "interleave", "rrf", "rescore")
#: RFMemConfig.fusion values (rfmem_fast.fusion documents them)
FUSION_MODES = ("convex", "rrf", "adaptive", "zscore")
#: RFMemConfig.lexical_norm values
LEXICAL_NORMS = ("raw", "max")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"RFMemConfig.{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"RFMemConfig.{name} must be in {rng}, got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"RFMemConfig.{name} must be a float, got {type(value).__name__}")
    v = float(value)
    bad = not math.isfinite(v) or v > hi or (v <= lo if lo_open else v < lo)
    if bad:
        left = "(" if lo_open else "["
        raise ValueError(f"RFMemConfig.{name} must be in {left}{lo}, {hi}], got {value}")


_NEVER_RECOLLECT = {"theta_high": -1.0, "theta_low": -1.0, "tau": 0.0}
#: :meth:`RFMemConfig.recommended`'s pick per encoder (the fields it changes from the defaults)
#: the second-stage models shipped with the package (``RFMemConfig.second_stage = "builtin:<name>"``,
#: the files ``rfmem_fast/data/second_stage_<name>.json``)
BUILTIN_STAGES = ("minilm", "mpnet")

_RECOMMENDED_PICKS: dict[str, dict[str, Any]] = {
    "minilm": {"fusion": "convex", "lexical_norm": "raw", "lexical_weight": 0.03,
               "context_weight": 0.5, "context_radius": 2, "thread_weight": 0.3, **_NEVER_RECOLLECT,
               "second_stage": "builtin:minilm"},
    "mpnet": {"fusion": "convex", "lexical_norm": "raw", "lexical_weight": 0.04,
              "context_weight": 0.2, "context_radius": 2, "thread_weight": 0.5, **_NEVER_RECOLLECT,
              "second_stage": "builtin:mpnet"},
}


@dataclass(frozen=True)
class RFMemConfig:
    """All knobs of RF-Mem retrieval, validated on construction.

    Fields (spec section in brackets):

    * ``probe_k`` (int >= 1, default 10) [1]: size K of the familiarity probe.
    * ``out_k`` (int >= 1, default 10) [3, 4]: number of items returned per query.
    * ``temperature`` (float in (0, 1e4], default 20.0) [1]: softmax temperature ``lam``.
    * ``entropy`` ("mean" | "sum" | "normalized", default "mean") [1]: entropy convention.
    * ``theta_high`` / ``theta_low`` (floats in [-1, 1], defaults 0.6 / 0.2, with
      ``theta_low <= theta_high``) [2]: mean-score thresholds of the router.
    * ``tau`` (float in [0, 1e3], default 0.2) [2]: entropy threshold of the router.
    * ``alpha`` (float in [0, 1], default 0.5) [4]: weight of the branch query in the mix.
    * ``beam_width`` (int in [1, 64], default 4) [4]: beam width B (also clusters per branch).
    * ``fanout`` (int in [1, 64], default 1) [4]: fanout F; a branch retrieves (B + level) * F.
    * ``max_rounds`` (int in [1, 64], default 10) [4]: rounds R (the paper text uses 3).
    * ``mmr_lambda`` (float in [0, 1], default 0.9) [4]: MMR weight; 1.0 turns MMR off.
    * ``score_floor`` (float in [-1, 1], default 0.0) [4]: candidates scoring below are dropped.
    * ``kmeans_seed`` (int >= 0, default 42) [4]: seed of every KMeans.
    * ``kmeans_iters`` (int in [1, 1000], default 300) [4]: Lloyd iteration cap.
    * ``kmeans_tol`` (float in [0, 1], default 1e-4) [4]: convergence tolerance (relative
      centre shift, as scikit-learn's ``tol``).

    Beyond the paper (:mod:`rfmem_fast.routing`, README "Retrieval quality"); the
    defaults keep the authors' behaviour:

    * ``merge`` ("none" | "interleave" | "rrf" | "rescore", default "none"): how the
      Recollection path combines its hits with the probe's top-k
      (:mod:`rfmem_fast.routing.merge`); "none" is the authors' output.
    * ``rrf_k`` (float in (0, 1e6], default 60.0): the reciprocal-rank-fusion constant.
    * ``rescore_weight`` (float in [0, 100], default 0.5): weight of the cluster support
      in ``merge="rescore"``.
    * ``router`` (None or the path of a router file, default None): None routes by
      ``theta_high`` / ``theta_low`` / ``tau`` (spec section 2); a path loads a
      calibrated router (:mod:`rfmem_fast.routing.files`, made by ``rfmem calibrate``).
      The config holds the path only (plain data, no I/O): the search loads the file
      (:func:`rfmem_fast.routing.files.resolve_router`), and :class:`rfmem_fast.Memory`
      and the CLI load it when they open, so a missing, corrupt or mismatched file fails
      there, with the same errors as before.
    * ``expansion_weight`` (float in [0, 1e3], default 1.0): weight ``w`` of the extra
      vectors of the query-expansion hook (:mod:`rfmem_fast.expansion`).
    * ``profile_weight`` (float in [0, 100], default 0.0): the profile prior: each query
      ``q`` of user ``u`` is searched as ``normalise(q + profile_weight * p_u)``, ``p_u``
      the unit mean of the user's vectors (:mod:`rfmem_fast.routing.profile`); 0 is off.
    * ``reranker`` (None or the path of a re-ranker file, default None): re-rank every
      query's candidates (the probe's top ``depth`` plus, when it recollected, the
      recollection's hits) with a learned linear model
      (:mod:`rfmem_fast.routing.rerank`, made by ``rfmem calibrate --kind reranker``),
      a path resolved like ``router``'s (:func:`rfmem_fast.routing.files.resolve_reranker`);
      it replaces the merge, so ``merge`` must be "none".

    The lexical (BM25) channel (:mod:`rfmem_fast.lexical`, :mod:`rfmem_fast.fusion`,
    README "Hybrid retrieval"); ``lexical_weight=0`` keeps the dense-only behaviour exactly:

    * ``lexical_weight`` (float in [0, 1e6], default 0.0): weight ``w`` of the lexical
      channel; > 0 turns it on (``search`` then needs ``query_texts``).
    * ``fusion`` ("convex" | "rrf" | "adaptive" | "zscore", default "convex"): "convex" ranks by
      ``cosine + w * f``; "rrf" by ``1/(lexical_rrf_k + dense rank) + 1/(lexical_rrf_k +
      lexical rank)`` (each list cut at ``lexical_depth``; ``w`` only switches it on);
      "adaptive" by ``cosine + w * c(q) * bm25 / max bm25``, ``c(q)`` the lexical
      channel's confidence (sharpness, :func:`rfmem_fast.fusion.sharpness`); "zscore" by
      ``cosine + w * g(q) / sigma(q) * bm25``, the channels on one scale (``sigma`` the
      query's BM25 standard deviation over the user's items, ``g`` the dense top-1 score
      minus the mean dense score over them: :func:`rfmem_fast.fusion.zscore_boost`).
    * ``lexical_norm`` ("raw" | "max", default "max"): convex's ``f``: raw BM25, or BM25
      divided by the query's largest BM25 over the user's items.
    * ``lexical_rrf_k`` (float in (0, 1e6], default 10.0): the rank constant of fusion "rrf".
    * ``lexical_depth`` (int in [1, 2^20], default 100): fusion "rrf" cuts each channel's
      ranked list at ``max(lexical_depth, out_k, probe_k)``.

    The lexical channel does not combine with ``reranker`` (ValueError).

    * ``second_stage`` (None, ``"builtin:<name>"`` or the path of a second-stage file,
      default None): re-rank each Familiarity-path query's first-stage list (its top
      ``depth`` by the config's score: dense, fused or context) with a learned model over
      cheap per-candidate features and return the model's ``out_k`` best, in its order
      (:mod:`rfmem_fast.second_stage`; ``SearchResult.scores`` keep each hit's first-stage
      score); a query that recollects keeps the Recollection path's hits. Its features read
      the query's text (``search(query_texts=)``): a query without one keeps its
      first-stage list; ``"builtin:minilm"`` is the model shipped
      with the package (fitted for the MiniLM encoder under :meth:`recommended`, made by
      ``rfmem tune second-stage``). It does not combine with ``reranker`` or fusion
      "rrf" (ValueError).

    The context score (items that know their conversation, :mod:`rfmem_fast.context`,
    docs "Conversations"); both weights 0 keep today's results exactly:

    * ``context_weight`` (float in [0, 1e6], default 0.0): ``w_n``, weight of the best
      neighbour in the item's thread.
    * ``context_radius`` (int in [1, 64], default 2): ``r``, how many ranks on each side
      of an item count as its neighbours.
    * ``thread_weight`` (float in [0, 1e6], default 0.0): ``w_s``, weight of the best item
      of the item's thread.

    Definition. Let ``b_i`` be item ``i``'s base score under the config: its exact dense
    score ``RN32(q . x_i)``, or its fused dense + lexical score when the lexical channel is
    on (:mod:`rfmem_fast.fusion`; an item stored as several chunk rows has its best row's
    score, as the fusion scores it). Among the VISIBLE items of ``i``'s thread (those the
    query's filters keep; deleted items are gone), ordered by (position, row; an item
    without a position after those with one), the neighbours ``N(i)`` are those at most
    ``r`` ranks from ``i`` (``i`` excluded), and ``T(i) = max_{j visible in thread(i)} b_j``
    (``i`` included). The context score is, in float64 in this order,

        c_i = b_i + w_n * max_{j in N(i)} b_j + w_s * T(i)

    with the middle term 0 when ``N(i)`` is empty; an item without a thread is a thread of
    its own (``T(i) = b_i``, no neighbours). A row of a chunked item scores its own base
    score plus its item's two terms (so its best row scores ``c`` of the item). The
    Familiarity path returns the exact top ``out_k`` rows by ``c`` (ties by the smaller
    row), ``SearchResult.scores`` holding each hit's base score and
    ``SearchResult.context_scores`` its ``c``. With the context on (either weight > 0),
    a query of mode "recollection", or one that mode "rfmem" routes to the Recollection
    path, returns that path's hits unchanged (its ``context_scores`` NaN), and fusion
    "rrf" and ``reranker`` are refused
    here (ValueError): neither has a per-row base score to give the neighbours.

    Construction validates the fields' types and ranges only: a config is plain data
    and reads no file.

    Raises:
        TypeError: a field has the wrong type (the message names the field).
        ValueError: a field is outside its allowed range (the message names the field
            and the range).
    """

    probe_k: int = 10
    out_k: int = 10
    temperature: float = 20.0
    entropy: str = "mean"
    theta_high: float = 0.6
    theta_low: float = 0.2
    tau: float = 0.2
    alpha: float = 0.5
    beam_width: int = 4
    fanout: int = 1
    max_rounds: int = 10
    mmr_lambda: float = 0.9
    score_floor: float = 0.0
    kmeans_seed: int = 42
    kmeans_iters: int = 300
    kmeans_tol: float = 1e-4
    merge: str = "none"
    rrf_k: float = 60.0
    rescore_weight: float = 0.5
    router: str | None = None
    expansion_weight: float = 1.0
    profile_weight: float = 0.0
    reranker: str | None = None
    lexical_weight: float = 0.0
    fusion: str = "convex"
    lexical_norm: str = "max"
    lexical_rrf_k: float = 10.0
    lexical_depth: int = 100
    context_weight: float = 0.0
    context_radius: int = 2
    thread_weight: float = 0.0
    second_stage: str | None = None

    def __post_init__(self) -> None:
        _check_int("probe_k", self.probe_k, 1, 1 << 20)
        _check_int("out_k", self.out_k, 1, 1 << 20)
        _check_float("temperature", self.temperature, 0.0, 1e4, lo_open=True)
        if self.entropy not in ENTROPY_CONVENTIONS:
            raise ValueError(
                f"RFMemConfig.entropy must be one of {ENTROPY_CONVENTIONS}, got {self.entropy!r}"
            )
        _check_float("theta_high", self.theta_high, -1.0, 1.0)
        _check_float("theta_low", self.theta_low, -1.0, 1.0)
        if self.theta_low > self.theta_high:
            raise ValueError(
                "RFMemConfig.theta_low must be <= theta_high, got "
                f"theta_low={self.theta_low}, theta_high={self.theta_high}"
            )
        _check_float("tau", self.tau, 0.0, 1e3)
        _check_float("alpha", self.alpha, 0.0, 1.0)
        _check_int("beam_width", self.beam_width, 1, 64)
        _check_int("fanout", self.fanout, 1, 64)
        _check_int("max_rounds", self.max_rounds, 1, 64)
        _check_float("mmr_lambda", self.mmr_lambda, 0.0, 1.0)
        _check_float("score_floor", self.score_floor, -1.0, 1.0)
        _check_int("kmeans_seed", self.kmeans_seed, 0, (1 << 31) - 1)
        _check_int("kmeans_iters", self.kmeans_iters, 1, 1000)
        _check_float("kmeans_tol", self.kmeans_tol, 0.0, 1.0)
        if self.merge not in MERGE_MODES:
            raise ValueError(f"RFMemConfig.merge must be one of {MERGE_MODES}, got {self.merge!r}")
        _check_float("rrf_k", self.rrf_k, 0.0, 1e6, lo_open=True)
        _check_float("rescore_weight", self.rescore_weight, 0.0, 100.0)
        _check_float("expansion_weight", self.expansion_weight, 0.0, 1e3)
        _check_float("profile_weight", self.profile_weight, 0.0, 100.0)
        _check_float("lexical_weight", self.lexical_weight, 0.0, 1e6)
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"RFMemConfig.fusion must be one of {FUSION_MODES}, got {self.fusion!r}")
        if self.lexical_norm not in LEXICAL_NORMS:
            raise ValueError(f"RFMemConfig.lexical_norm must be one of {LEXICAL_NORMS}, got {self.lexical_norm!r}")
        _check_float("lexical_rrf_k", self.lexical_rrf_k, 0.0, 1e6, lo_open=True)
        _check_int("lexical_depth", self.lexical_depth, 1, 1 << 20)
        _check_float("context_weight", self.context_weight, 0.0, 1e6)
        _check_int("context_radius", self.context_radius, 1, 64)
        _check_float("thread_weight", self.thread_weight, 0.0, 1e6)
        if self.context_on:
            if self.reranker is not None:
                raise ValueError(
                    "RFMemConfig.context_weight / thread_weight > 0 do not combine with a reranker "
                    "(it replaces the final list the context score ranks)"
                )
            if self.lexical_weight > 0 and self.fusion == "rrf":
                raise ValueError(
                    "RFMemConfig.context_weight / thread_weight > 0 do not combine with fusion 'rrf' (rank fusion "
                    "gives no per-item base score): use 'convex', 'adaptive' or 'zscore'"
                )
        if self.lexical_weight > 0 and self.reranker is not None:
            raise ValueError("RFMemConfig.lexical_weight > 0 does not combine with a reranker (set one of them off)")
        if self.second_stage is not None:
            if isinstance(self.second_stage, os.PathLike):
                object.__setattr__(self, "second_stage", os.fspath(self.second_stage))
            if not isinstance(self.second_stage, str) or not self.second_stage:
                raise TypeError("RFMemConfig.second_stage must be None, 'builtin:<name>' or a second-stage file path, "
                                f"got {self.second_stage!r}")
            if self.second_stage.startswith("builtin:") and self.second_stage[8:] not in BUILTIN_STAGES:
                raise ValueError(f"RFMemConfig.second_stage: unknown builtin second stage {self.second_stage[8:]!r}: "
                                 f"the package ships {list(BUILTIN_STAGES)}")
            if self.reranker is not None:
                raise ValueError("RFMemConfig.second_stage does not combine with a reranker (both replace the final "
                                 "list: set one of them off)")
            if self.lexical_weight > 0 and self.fusion == "rrf":
                raise ValueError("RFMemConfig.second_stage does not combine with fusion 'rrf' (rank fusion leaves "
                                 "some hits without a dense score): use 'convex', 'adaptive' or 'zscore'")
        if self.reranker is not None:
            if isinstance(self.reranker, os.PathLike):
                object.__setattr__(self, "reranker", os.fspath(self.reranker))
            if not isinstance(self.reranker, str) or not self.reranker:
                raise TypeError(f"RFMemConfig.reranker must be None or a re-ranker file path, got {self.reranker!r}")
            if self.merge != "none":
                raise ValueError(
                    f"RFMemConfig.reranker replaces the merge: set merge='none' (got merge={self.merge!r})"
                )
        if self.router is not None:
            if isinstance(self.router, os.PathLike):
                object.__setattr__(self, "router", os.fspath(self.router))
            if not isinstance(self.router, str) or not self.router:
                raise TypeError(f"RFMemConfig.router must be None or a router file path, got {self.router!r}")

    @classmethod
    def paper(cls, **overrides: Any) -> "RFMemConfig":
        """The authors' RF-Mem: their PersonaBench script's configuration (the defaults).

        probe_k 10, temperature 20, entropy "mean", theta_high 0.6, theta_low 0.2, tau
        0.2, alpha 0.5, B 4, F 1, R 10, MMR 0.9, threshold router, merge "none" (spec
        section 7; the golden parity tests run it).

        Returns:
            ``RFMemConfig(**overrides)``.
        """
        return cls(**overrides)

    @classmethod
    def recommended(cls, encoder: str = "minilm", **overrides: Any) -> "RFMemConfig":
        """The configuration chosen by nested leave-one-user-out CV across datasets (docs "Hybrid retrieval", "Conversations").

        What ``rfmem tune context`` (:func:`rfmem_fast.tuning_datasets.tune_context`) picks
        on all users of PersonaBench (noise 0.0 / 0.3 /
        0.5 / 0.7) and the five development LoCoMo conversations, per encoder, with the
        objective "mean gain + gain on the worst dataset / noise level":
        **hybrid dense + lexical retrieval**, ``fusion="convex"``, ``lexical_norm="raw"``,
        ``lexical_weight=0.03`` (each item's base score is ``cosine + 0.03 * BM25``), with
        **the conversation context** for MiniLM: ``context_weight=0.5``,
        ``context_radius=2``, ``thread_weight=0.3`` (an item scores its base score plus
        0.5 x the best of the two turns on each side of it in its thread plus 0.3 x the
        best of its thread: :mod:`rfmem_fast.context`; items without a thread rank as
        without it), never recollecting (theta_high = theta_low = -1: every query takes
        the Familiarity path); for MPNet ``lexical_weight=0.04`` with ``context_weight=0.2``,
        ``context_radius=2``, ``thread_weight=0.5`` (below). Then a **second stage**
        re-ranks each text query's top 50 (MiniLM: ``second_stage="builtin:minilm"``,
        :mod:`rfmem_fast.second_stage`: a linear pairwise model over the first stage's
        scores and ranks, query-term coverage and idf mass, exact number / name / date
        matches, recency and the session position; ``rfmem tune second-stage``, nested CV
        on top of the context pick: +2.74 / +0.96 / +3.02 / +1.64 on PersonaBench 0.0 / 0.3
        / 0.5 / 0.7 and +4.90 on LoCoMo, ``bench/results/second-stage-minilm.json``; about
        0.4-0.6 ms per single query, ``bench/results/second-stage-cost-amd-epyc-zen4.json``);
        MPNet: ``"builtin:mpnet"``, its own fit by the same procedure (top 30; nested +0.21 /
        +4.57 / +0.49 / +3.90 on PersonaBench, +2.60 on LoCoMo,
        ``bench/results/second-stage-mpnet.json``). It was tuned on banks whose lexical index stems with PyStemmer's English
        stemmer (``MemoryBank(lexical_stemmer="english")``, what :class:`rfmem_fast.Memory`
        and the evaluations build); ``search`` then needs the query texts
        (``query_texts=``). It is the default of the text facades
        (:class:`rfmem_fast.Memory`, ``rfmem serve``, ``rfmem mcp``:
        :func:`rfmem_fast.models.recommended_alias` picks the encoder); ``RFMemConfig()``
        stays the paper's.

        The whole pipeline (first stage and second stage chosen and fitted inside ONE nested
        leave-one-user-out CV, ``rfmem tune pipeline``, :mod:`rfmem_fast.tuning_pipeline`),
        Recall@10 gain over dense in points, PersonaBench 0.0 / 0.3 / 0.5 / 0.7 and LoCoMo:
        MiniLM +4.73 / +3.41 / +4.83 / +6.25, +22.01
        (``bench/results/tune-pipeline-minilm.json``); MPNet +5.25 / +4.84 / +4.73 / +7.04,
        +17.20 (``bench/results/tune-pipeline-mpnet.json``). Routing some queries to the
        Recollection path, even one whose rounds are scored like the first stage, does not
        pay on top of it (``bench/bench_fused_recollection.py``, docs "Retrieval quality").

        First-stage figures (MiniLM, Recall@10 gain over dense in points, nested CV of the
        whole procedure, ``bench/results/tune-context-minilm.json``; a PersonaBench user is
        one fold at every noise level, a LoCoMo conversation one fold): PersonaBench +1.52
        / +2.45 / +2.09 / +4.36 at noise 0.0 / 0.3 / 0.5 / 0.7, LoCoMo +16.31 (the hybrid
        fusion alone: the same on PersonaBench, whose items carry no thread, and +10.34 on
        LoCoMo); the pick itself on all users: +2.10 / +2.45 / +1.80 / +4.36, LoCoMo
        +16.93. For MPNet (``bench/results/tune-context-mpnet.json``): nested CV +4.26 /
        +0.36 / +3.90 / +2.18 on PersonaBench 0.0 / 0.3 / 0.5 / 0.7, LoCoMo +14.25 (the
        fusion alone +10.20; the ``zscore`` fusion of ``rfmem tune hybrid``, the MPNet
        recommendation before the context: +4.23 / +0.50 / +1.75 / +1.32, LoCoMo +10.60). The profile prior (``profile_weight=0.3``) is -4.4 points on LoCoMo with
        either encoder and stays available as a field.

        Args:
            encoder: "minilm" (the package's default encoder) or "mpnet".
            overrides: RFMemConfig fields to change on top (``lexical_weight=0`` gives
                the dense-only variant for vector-only searches).

        Returns:
            RFMemConfig.

        Raises:
            ValueError: an unknown encoder (the message lists the known ones), or an
                invalid override.
        """
        if encoder not in _RECOMMENDED_PICKS:
            raise ValueError(f"RFMemConfig.recommended: encoder must be one of {sorted(_RECOMMENDED_PICKS)}, "
                             f"got {encoder!r}")
        return cls(**{**_RECOMMENDED_PICKS[encoder], **overrides})

    @classmethod
    def paper_text(cls, **overrides: Any) -> "RFMemConfig":
        """The configuration as the paper's text states it: 3 rounds, MMR off.

        Returns:
            RFMemConfig with ``max_rounds=3`` and ``mmr_lambda=1.0`` (spec section 4),
            other fields at their defaults unless overridden.
        """
        base = {"max_rounds": 3, "mmr_lambda": 1.0}
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes: Any) -> "RFMemConfig":
        """A copy with some fields changed (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @property
    def context_on(self) -> bool:
        """Whether the context score is on (``context_weight > 0`` or ``thread_weight > 0``)."""
        return self.context_weight > 0 or self.thread_weight > 0

    def max_candidates(self) -> int:
        """Largest candidate count of one branch: (B + R - 1) * F (spec section 4)."""
        return (self.beam_width + self.max_rounds - 1) * self.fanout

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    def preset(self) -> str:
        """The name of the preset this configuration is, found by comparing it with them.

        Every field but ``out_k`` is compared (``out_k`` is the default number of hits,
        which each search may set with its ``k``), exactly (floats by value).

        Returns:
            "recommended" (:meth:`recommended` for an encoder it knows, "minilm" or
            "mpnet": what ``--preset recommended`` and the text facades pick), "paper"
            (:meth:`paper`, ``RFMemConfig()``), "paper_text" (:meth:`paper_text`), or
            "custom" (any other: a field changed, a router or re-ranker file).
        """
        mine = {**self.to_dict(), "out_k": None}
        candidates = [("recommended", RFMemConfig.recommended(e)) for e in _RECOMMENDED_PICKS]
        candidates += [("paper", RFMemConfig.paper()), ("paper_text", RFMemConfig.paper_text())]
        for name, cfg in candidates:
            if {**cfg.to_dict(), "out_k": None} == mine:
                return name
        return "custom"

    def summary(self) -> dict[str, Any]:
        """The configuration by name and its main fields, for a status report (the HTTP
        service's ``/health`` "config"): ``{"preset": :meth:`preset`, "out_k",
        "lexical_weight", "fusion", "probe_k", "theta_high", "theta_low", "tau",
        "max_rounds", "score_floor", "merge", "context_weight", "context_radius",
        "thread_weight", "router", "reranker", "second_stage"}``, ``router`` /
        ``reranker`` / ``second_stage`` as booleans (whether a model file is used; its path is not shown).

        Returns:
            dict of JSON values.
        """
        out: dict[str, Any] = {"preset": self.preset()}
        out.update({f: getattr(self, f) for f in _SUMMARY_FIELDS})
        out.update(router=self.router is not None, reranker=self.reranker is not None,
                   second_stage=self.second_stage is not None)
        return out


#: the fields :meth:`RFMemConfig.summary` reports besides the preset's name
_SUMMARY_FIELDS = ("out_k", "lexical_weight", "fusion", "probe_k", "theta_high", "theta_low", "tau", "max_rounds",
                   "score_floor", "merge", "context_weight", "context_radius", "thread_weight")
