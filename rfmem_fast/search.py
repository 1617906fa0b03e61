"""Entry points: RF-Mem, dense and recollection search over a multi-tenant bank (RFMEM_SPEC.md section 5).

``search(bank, queries, users, config, mode, backend)`` runs, for the whole batch:

1. one probe: a segmented top-k of width ``max(probe_k, out_k, beam_width * fanout)``
   of every query within its own user's segment, and the familiarity signals of its
   first ``probe_k`` scores (section 1);
2. the router (section 2) in mode "rfmem"; mode "dense" sends every query to the
   Familiarity path and mode "recollection" every query to the Recollection path;
3. the Familiarity path (the probe's first ``out_k``, section 3) and the Recollection
   path (:func:`rfmem_fast.recollection.recollect`, section 4, whose first round reuses
   the probe) for the queries routed there.

Every call works on ONE immutable bank snapshot (taken once, see
:class:`rfmem_fast.bank.MemoryBank`), so concurrent writes never tear a search. A
large batch is cut into chunks of ``max_batch`` queries run one after the other
(intermediate memory bounded by the chunk, results concatenated; identical to one
call per query since the backends are batch-invariant). Top-k widths are capped by
the longest user segment in the chunk, so a huge ``out_k`` / ``probe_k`` over a small
bank costs only its padded output, not an absurd intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from ._validate import as_float_matrix, l2_normalize_rows
from .backends import Backend, get_backend
from .bank import MemoryBank
from .config import RFMemConfig
from .expansion import fold_expansions
from .recollection import recollect
from .router import (
    FAMILIARITY,
    RECOLLECTION,
    ROUTE_NAMES,
    RULE_FORCED_DENSE,
    RULE_FORCED_RECOLLECTION,
    RULE_NAMES,
)
from .routing import ProbeSignals, Router, merge_paths

MODES = ("rfmem", "dense", "recollection")
#: default number of queries per internal chunk of :func:`search`
DEFAULT_MAX_BATCH = 8192


@dataclass
class SearchResult:
    """Results of a batch of b queries.

    Attributes:
        ids: object ndarray [b, out_k], the caller's item ids; ``None`` pads a row
            whose user has fewer than ``out_k`` items (or whose recollection ran dry).
        rows: int64 ndarray [b, out_k], global bank rows (-1 padding).
        scores: float32 ndarray [b, out_k]: inner-product scores on the Familiarity
            path; on the Recollection path the (MMR-adjusted when mmr_lambda < 1) score
            each item was discovered with, in discovery order; ``-inf`` padding.
        route: int64 ndarray [b], 0 = familiarity, 1 = recollection (``route_names``).
        mean: float64 ndarray [b], mean probe score (0 for an empty bank).
        entropy: float64 ndarray [b], probe entropy in the config's convention.
        rule: int64 ndarray [b], index into ``rfmem_fast.router.RULE_NAMES``.
        rounds: int64 ndarray [b], recollection rounds used (0 on the Familiarity path).
        probe_ids: object ndarray [b, probe_k], the probe's item ids (None padding).
        probe_scores: float32 ndarray [b, probe_k], the probe's scores (-inf padding).
        mode, backend: how the batch was run.
    """

    ids: np.ndarray
    rows: np.ndarray
    scores: np.ndarray
    route: np.ndarray
    mean: np.ndarray
    entropy: np.ndarray
    rule: np.ndarray
    rounds: np.ndarray
    probe_ids: np.ndarray
    probe_scores: np.ndarray
    mode: str = "rfmem"
    backend: str = ""
    config: RFMemConfig = field(default_factory=RFMemConfig)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def route_names(self) -> list[str]:
        """Route of each query as "familiarity" / "recollection"."""
        return [ROUTE_NAMES[r] for r in self.route]

    @property
    def rule_names(self) -> list[str]:
        """Rule that fired for each query, as a name from RULE_NAMES."""
        return [RULE_NAMES[r] for r in self.rule]

    def ids_list(self, i: int) -> list[Hashable]:
        """The item ids of query ``i`` without padding."""
        return [x for x, r in zip(self.ids[i], self.rows[i]) if r >= 0]


def _as_queries(queries: Any, dim: int) -> np.ndarray:
    q = as_float_matrix(queries, "queries", dim)
    return l2_normalize_rows(q, "queries")


def search(
    bank: MemoryBank,
    queries: Any,
    users: Sequence[Hashable],
    config: RFMemConfig | None = None,
    mode: str = "rfmem",
    backend: str | Backend = "auto",
    device: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    expansions: Any = None,
    router: Router | None = None,
) -> SearchResult:
    """RF-Mem retrieval for a batch of queries, each within its own user's memory.

    Args:
        bank: the memory bank (at least one item overall).
        queries: [b, d] floating array (float16/32/64, numpy or torch, any strides);
            rows are L2-normalised here.
        users: b user keys; query i searches only ``users[i]``'s items.
        config: RFMemConfig (default: the spec's defaults).
        mode: "rfmem" (probe, route, routed path), "dense" (always familiarity) or
            "recollection" (always recollection).
        backend: "auto" | "reference" | "torch" or a Backend instance.
        device: torch device for device-capable backends (default: CUDA if present).
        max_batch: queries per internal chunk (int >= 1, default 8192); bounds the
            intermediate memory of a huge batch. Results do not depend on it.
        expansions: optional extra vectors per query (the query-expansion hook, e.g.
            HyDE pseudo-document embeddings): a float array [b, m, d] or a sequence of
            b arrays [m_i, d] / None; folded into each query as
            ``normalise(q + config.expansion_weight * sum_j e_j)`` before the probe, so
            the probe, the routing, the Recollection path's original query and the
            merges all use the expanded query (:mod:`rfmem_fast.expansion`).
        router: a :class:`rfmem_fast.routing.Router` to route with in mode "rfmem"
            (default: ``config.resolved_router()``, i.e. the file of ``config.router``
            or the spec's thresholds). On the Recollection path ``config.merge``
            combines the hits with the probe's top-k (:mod:`rfmem_fast.routing.merge`).

    Returns:
        SearchResult. A user with fewer than ``out_k`` items gets padded rows (id
        None, row -1, score -inf); a user with no items gets an all-padding row,
        mean 0, entropy 0 and the rule "no_hits" (route recollection in mode "rfmem").

    Raises:
        ValueError: unknown mode; an empty bank (no live item in the snapshot);
            queries not 2-D, of the wrong dimension, with NaN / Inf or a zero row;
            ``users`` not of length b; ``max_batch`` < 1.
        TypeError: non-floating queries; a config that is not an RFMemConfig; a
            user key that is not a str / int.
        KeyError: an unknown user (the message names it and its position).
        ValueError / TypeError: bad ``expansions`` (the message names the entry); a
            ``router`` that is not a Router or was made for another probe.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if config is None:
        config = RFMemConfig()
    if not isinstance(config, RFMemConfig):
        raise TypeError(f"config must be an RFMemConfig, got {type(config).__name__}")
    if not isinstance(bank, MemoryBank):
        raise TypeError(f"bank must be a MemoryBank, got {type(bank).__name__}")
    if isinstance(max_batch, (bool, np.bool_)) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    max_batch = int(max_batch)
    q = _as_queries(queries, bank.dim)
    if isinstance(users, (str, bytes)) or not hasattr(users, "__len__"):
        raise TypeError("users must be a sequence of user keys, one per query")
    if len(users) != q.shape[0]:
        raise ValueError(f"users has {len(users)} entries but queries has {q.shape[0]} rows")
    q = fold_expansions(q, expansions, config.expansion_weight)
    if mode != "rfmem":
        router = None
    elif router is None:
        router = config.resolved_router()
    elif not isinstance(router, Router):
        raise TypeError(f"router must be a rfmem_fast.routing.Router, got {type(router).__name__}")
    else:
        router.check_config(config)
    be = get_backend(backend, device)
    view = be.view(bank)  # one immutable snapshot for the whole call
    snap = view.snapshot
    if snap.vectors.shape[0] == 0:
        raise ValueError("bank is empty: add items before searching")
    seg = bank.segments_for(users, snapshot=snap)
    b = q.shape[0]
    out: dict[str, np.ndarray] = {}
    for c0 in range(0, max(b, 1), max_batch):
        part = _search_chunk(be, view, q[c0 : c0 + max_batch], seg[c0 : c0 + max_batch], config, mode, router)
        if b <= max_batch:
            out = part
            break
        if not out:  # results are written in place: no second copy of a huge batch
            out = {key: np.empty((b,) + a.shape[1:], dtype=a.dtype) for key, a in part.items()}
        for key, a in part.items():
            out[key][c0 : c0 + a.shape[0]] = a
    return SearchResult(mode=mode, backend=be.name, config=config, **out)


def _pad(a: np.ndarray, width: int, value: Any) -> np.ndarray:
    if a.shape[1] >= width:
        return a
    out = np.full((a.shape[0], width), value, dtype=a.dtype)
    out[:, : a.shape[1]] = a
    return out


def _search_chunk(
    be: Backend, view: Any, q: np.ndarray, seg: np.ndarray, config: RFMemConfig, mode: str, router: Router | None
) -> dict[str, np.ndarray]:
    """One chunk of :func:`search`: the SearchResult arrays of ``q`` [c, d] (unit rows)."""
    dev = be.device
    b = q.shape[0]
    Q = torch.from_numpy(q).to(dev)
    qseg = torch.from_numpy(seg).to(dev)

    # widths: never wider than the longest segment queried (a wider top-k is padding only)
    off = view.snapshot.offsets
    max_len = int((off[seg + 1] - off[seg]).max()) if b else 0
    bf = config.beam_width * config.fanout
    k0 = max(config.probe_k, config.out_k, bf)
    k0 = max(min(k0, max_len), bf)
    probe_k = min(config.probe_k, k0)
    out_k = min(config.out_k, k0)
    p_sc, p_rows, mean, ent, count = be.probe(
        view, Q, qseg, k0, probe_k, config.temperature, config.entropy
    )
    # host-side bookkeeping in numpy: a handful of cheap calls on the Familiarity path
    p_rows_np, p_sc_np = p_rows.cpu().numpy(), p_sc.cpu().numpy()
    if router is not None:  # mode "rfmem"
        routes, rule = router.route(ProbeSignals.from_arrays(p_sc_np[:, :probe_k], mean, ent, count))
    elif mode == "dense":
        routes, rule = np.full(b, FAMILIARITY, np.int64), np.full(b, RULE_FORCED_DENSE, np.int64)
    else:
        routes, rule = np.full(b, RECOLLECTION, np.int64), np.full(b, RULE_FORCED_RECOLLECTION, np.int64)
    rows = p_rows_np[:, :out_k].copy()
    scores = p_sc_np[:, :out_k].astype(np.float32)
    rounds = np.zeros(b, dtype=np.int64)
    reco = np.flatnonzero(routes == RECOLLECTION)
    if reco.size:
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        ri = torch.from_numpy(reco).to(dev)
        out = recollect(be, view, Q[ri], qseg[ri], cfg, level0=(p_sc[ri], p_rows[ri]))
        if config.merge == "none":  # the authors' output
            rows[reco] = out.rows.cpu().numpy()
            scores[reco] = out.scores.cpu().numpy()
        else:
            rows[reco], scores[reco] = merge_paths(
                config.merge, p_rows_np[reco], out.hit_rows.cpu().numpy(), q[reco], view.snapshot.vectors,
                out_k, config.rrf_k, config.rescore_weight,
            )  # fmt: skip
        rounds[reco] = out.rounds.cpu().numpy()

    rows = _pad(rows, config.out_k, -1)
    probe_rows = _pad(p_rows_np[:, :probe_k], config.probe_k, -1)
    item_ids = view.snapshot.item_ids
    return dict(
        ids=_lookup(item_ids, rows),
        rows=rows,
        scores=_pad(scores, config.out_k, -np.inf),
        route=routes,
        mean=mean.cpu().numpy().astype(np.float64),
        entropy=ent.cpu().numpy().astype(np.float64),
        rule=rule,
        rounds=rounds,
        probe_ids=_lookup(item_ids, probe_rows),
        probe_scores=_pad(p_sc_np[:, :probe_k].astype(np.float32), config.probe_k, -np.inf),
    )


def _lookup(item_ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = np.empty(rows.shape, dtype=object)
    ok = rows >= 0
    out[ok] = item_ids[rows[ok]]
    return out
