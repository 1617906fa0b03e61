"""The Recollection path: the beam driver, written once over the batched primitives.

Implements RFMEM_SPEC.md section 4 (the beam form the authors' code runs) for a whole
batch of queries at once. The state of every (query, beam slot) pair lives in tensors;
each round makes one ``segmented_topk`` call for all live branches, one
``batched_kmeans`` call for all (query, branch) problems and one ``alpha_mix`` call;
candidate filtering, MMR, child scoring, the stable beam selection and the
discovery-order de-duplication are tensor operations. Python loops run only over
rounds and over the (at most ``beam_width``) cluster slots, never over queries.

Semantics kept from the authors' code:
  * a branch retrieves the top ``(B + level) * F`` of its query and THEN drops the
    items already returned (``seen``) and those scoring below ``score_floor``;
  * with ``mmr_lambda < 1`` a candidate's score becomes
    ``lam * s - (1 - lam) * max_{other candidate j} <v, v_j>`` (0 when it is alone),
    in float64, the maximum from the backend's :meth:`Backend.max_similarity
    <rfmem_fast.backends.base.Backend.max_similarity>`; that score is what the hits
    carry and what the branch score accumulates;
  * a child's accumulated score is its parent's plus the sum of its members' scores,
    summed in candidate order;
  * children are ordered (parent beam slot, cluster label); the next beam is the
    ``B`` children of largest accumulated score, stable on ties;
  * ``seen`` is updated only after the beam is chosen, in (slot, candidate) order, so
    the output keeps discovery order; the loop stops after ``max_rounds``, when a
    query has ``>= out_k`` results, or when a round yields no child.
One documented difference: a KMeans cluster with no member (possible only with
duplicate vectors) yields no child here, where the authors' code builds a child from
a NaN centroid.

Memory: the per-round tensors grow with (queries x beam slots x candidates x d); the
batch is cut into chunks of queries whose per-round tensors fit the backend's
``memory_budget`` (:func:`round_bytes_per_query`), run one after the other. Queries are
independent, so the result does not depend on the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends.base import DEFAULT_MEMORY_BUDGET, Backend, BankView
from .config import RFMemConfig


@dataclass
class RecollectionOutput:
    """Result of :func:`recollect` for b queries.

    Attributes:
        rows: int64 [b, out_k] global bank rows in discovery order, -1 padding.
        scores: float32 [b, out_k] the (MMR-adjusted when mmr_lambda < 1) score each
            item was discovered with, -inf padding.
        rounds: int64 [b] rounds that produced a beam (0 when none did).
        hit_rows: int64 [b, m] every row the beam discovered (first occurrences, in
            discovery order, -1 padding; ``rows`` is its first ``out_k`` columns). The
            merges of :mod:`rfmem_fast.routing.merge` read it.
        dense: float32 [b, out_k] the exact dense scores ``RN32(q . x)`` of ``rows``
            (NaN padding) when the driver computed them (the native one), else None.
    """

    rows: torch.Tensor
    scores: torch.Tensor
    rounds: torch.Tensor
    hit_rows: torch.Tensor | None = None
    dense: torch.Tensor | None = None


def recollection_capacity(config: RFMemConfig) -> int:
    """Result slots one query's recollection can fill: ``out_k - 1 + B (B + R - 1) F``
    (a round adds at most ``B (B + level) F`` items and the loop stops at ``out_k``)."""
    B, F, R = config.beam_width, config.fanout, config.max_rounds
    return config.out_k - 1 + B * (B + R - 1) * F


def round_bytes_per_query(config: RFMemConfig, d: int) -> int:
    """Bytes of the beam driver's per-round tensors for one query (an upper estimate).

    Per live branch (``B`` per query) and round, with ``K = (B + R - 1) * F``
    candidates and ``cap`` result slots: the seen-mask [K, cap], the candidate vectors
    in float32 and float64 and their gather [K, d], the MMR Gram matrix [K, K], the
    cluster membership [K, B], the children [B, d]; per query the discovery-order
    de-duplication [B K, B K].

    Args:
        config: beam_width, fanout, max_rounds, out_k.
        d: vector dimension.

    Returns:
        int bytes.
    """
    B, F, R = config.beam_width, config.fanout, config.max_rounds
    K = (B + R - 1) * F
    cap = recollection_capacity(config)
    per_branch = K * (cap + d * (4 + 8 + 4) + K * (8 + 1 + 1) + B * 9 + 64) + B * d * 4 * 4
    return int(B * per_branch + (B * K) ** 2 * 2 + 1024)


def recollect(
    backend: Backend,
    view: BankView,
    q0: torch.Tensor,
    qseg: torch.Tensor,
    config: RFMemConfig,
    level0: tuple[torch.Tensor, torch.Tensor] | None = None,
    active: torch.Tensor | None = None,
) -> RecollectionOutput:
    """Run the Recollection path for a batch of queries (spec section 4).

    Args:
        backend: provides the primitives; tensors live on ``backend.device``. Its
            ``memory_budget`` (bytes) bounds the per-round tensors: the batch runs in
            chunks of ``max(1, memory_budget // round_bytes_per_query(config, d))``
            queries.
        view: the bank as that backend holds it.
        q0: float32 [b, d] original queries (unit norm).
        qseg: int64 [b] segment (user) index of each query.
        config: alpha, beam_width, fanout, max_rounds, mmr_lambda, score_floor,
            out_k and the KMeans settings.
        level0: optional (scores [b, k0], rows [b, k0]) top-k of ``q0`` already
            computed (the probe), with k0 >= beam_width * fanout; reused as the first
            round's candidates instead of searching again.
        active: optional bool [b] on the backend's device: the queries to recollect
            (default all). The others get padding rows, ``-inf`` scores and 0 rounds, and
            cost no primitive call; selecting them on the device needs no host copy of
            the route (device-resident batches).

    Returns:
        RecollectionOutput.

    Host synchronisations: ONE per round (and per chunk of the memory budget) in this
    driver (reading how many queries are still active, which sizes the round's tensors; every other step is a fixed-shape
    tensor operation: beam slots that hold no branch, and branches without candidates,
    are carried as masked pairs instead of being compacted), plus those inside the
    backend's primitives (:mod:`rfmem_fast.device`).
    """
    b, d = q0.shape
    budget = int(getattr(backend, "memory_budget", DEFAULT_MEMORY_BUDGET))
    chunk = max(1, budget // round_bytes_per_query(config, d))
    if active is not None and (
        not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (b,)
    ):
        raise ValueError(f"active must be a bool tensor of shape [{b}]")
    if b <= chunk:
        return _recollect_chunk(backend, view, q0, qseg, config, level0, active)
    parts = [
        _recollect_chunk(
            backend,
            view,
            q0[c0 : c0 + chunk],
            qseg[c0 : c0 + chunk],
            config,
            None if level0 is None else (level0[0][c0 : c0 + chunk], level0[1][c0 : c0 + chunk]),
            None if active is None else active[c0 : c0 + chunk],
        )
        for c0 in range(0, b, chunk)
    ]
    return RecollectionOutput(
        rows=torch.cat([p.rows for p in parts]),
        scores=torch.cat([p.scores for p in parts]),
        rounds=torch.cat([p.rounds for p in parts]),
        hit_rows=torch.cat([p.hit_rows for p in parts]),
    )


def _recollect_chunk(
    backend: Backend, view: BankView, q0: torch.Tensor, qseg: torch.Tensor, config: RFMemConfig, level0=None,
    active: torch.Tensor | None = None,
) -> RecollectionOutput:
    """:func:`recollect` (same arguments) for one chunk of queries: all tensors of a round at once."""
    dev = backend.device
    B, F, R = config.beam_width, config.fanout, config.max_rounds
    out_k = config.out_k
    lam = float(config.mmr_lambda)
    b, d = q0.shape
    q0 = q0.to(dev, torch.float32)
    qseg = qseg.to(dev)
    cap = recollection_capacity(config)
    # column ``cap`` is a scratch slot: masked-out writes of a round go there (never read)
    res_rows = torch.full((b, cap + 1), -1, dtype=torch.int64, device=dev)
    res_sc = torch.full((b, cap + 1), float("-inf"), dtype=torch.float64, device=dev)
    res_len = torch.zeros(b, dtype=torch.int64, device=dev)
    rounds = torch.zeros(b, dtype=torch.int64, device=dev)
    beam_q = torch.zeros((b, B, d), dtype=torch.float32, device=dev)
    beam_q[:, 0] = q0
    beam_acc = torch.zeros((b, B), dtype=torch.float64, device=dev)
    beam_ok = torch.zeros((b, B), dtype=torch.bool, device=dev)
    beam_ok[:, 0] = True
    if active is None:
        active = torch.ones(b, dtype=torch.bool, device=dev)
    else:
        active = active.to(dev).clone()
    ar_cap = torch.arange(cap, device=dev)
    ar_B = torch.arange(B, device=dev)

    for level in range(R):
        act = active.nonzero().squeeze(1)  # the round's one host synchronisation
        na = act.numel()
        if na == 0:
            break
        K = (B + level) * F
        # ---- pairs p = (query, beam slot) of the active queries: slot 0 only in round 0
        # (the beam starts with one branch), every slot afterwards; a slot that holds no
        # branch (fewer children than B) is a dead pair that yields nothing
        S = 1 if level == 0 else B
        pq_local = torch.arange(na, device=dev)[:, None].expand(na, S).reshape(-1)  # no host sync
        pslot = ar_B[:S].repeat(na)
        pq = act[pq_local]
        plive = beam_ok[pq, pslot]
        bq = beam_q[pq, pslot]  # [P, d]
        if level == 0 and level0 is not None:
            c_sc, c_rows = level0[0][pq, :K].to(dev), level0[1][pq, :K].to(dev)
        else:
            c_sc, c_rows = backend.segmented_topk(view, bq, qseg[pq], K)
        # ---- drop padding, scores under the floor and items already returned
        seen = (c_rows[:, :, None] == res_rows[pq, :cap][:, None, :]) & (ar_cap[None, None, :] < res_len[pq][:, None, None])
        valid = (c_rows >= 0) & (c_sc >= config.score_floor) & ~seen.any(dim=2) & plive[:, None]
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid first, in order
        c_rows = torch.gather(c_rows, 1, order)
        c_sc = torch.gather(c_sc, 1, order)
        valid = torch.gather(valid, 1, order)
        n_valid = valid.sum(dim=1)
        V = view.rows(c_rows.clamp(min=0)).to(torch.float32) * valid[:, :, None]  # [P, K, d] float32 rows (exact copy)
        s64 = c_sc.to(torch.float64)
        if lam < 1.0:
            mx = backend.max_similarity(V, n_valid).to(dev)  # -inf for a candidate alone
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            mmr = lam * s64 - (1.0 - lam) * mx
        else:
            mmr = s64
        mmr = torch.where(valid, mmr, torch.zeros_like(mmr))
        # ---- cluster the candidates of every pair; a pair without candidates gets one
        # dummy (zero) point whose label is masked out, so it yields no child (problems
        # are independent: the others' clusters do not depend on it)
        cnt = n_valid.clamp(min=1)
        kc = cnt.clamp(max=B)
        lab, cen = backend.batched_kmeans(V, cnt, kc, config.kmeans_iters, config.kmeans_tol, config.kmeans_seed)
        labels = torch.where(valid, lab.to(dev), torch.full_like(c_rows, -1))
        mixed = backend.alpha_mix(bq, cen.to(dev), q0[pq], config.alpha).to(dev)
        child_q = torch.zeros((pq.numel(), B, d), dtype=torch.float32, device=dev)
        child_q[:, : mixed.shape[1]] = mixed
        member = labels[:, :, None] == ar_B[None, None, :]  # [P, K, B]
        csize = member.sum(dim=1)  # [P, B]
        # each cluster's members' scores summed in candidate order (a sequential sum, as the
        # spec's `sum of member scores` and the native driver): cumsum runs in order, sum() may not
        cgain = torch.cumsum(member * mmr[:, :, None], dim=1)[:, -1]  # [P, B] float64
        child_ok = csize > 0
        child_acc = beam_acc[pq, pslot][:, None] + cgain
        # ---- children of each active query on a [na, B slots * B clusters] grid
        grid_acc = torch.full((na, B, B), float("-inf"), dtype=torch.float64, device=dev)
        grid_acc[pq_local, pslot] = torch.where(child_ok, child_acc, torch.full_like(child_acc, float("-inf")))
        grid_pair = torch.full((na, B), -1, dtype=torch.int64, device=dev)
        grid_pair[pq_local, pslot] = torch.arange(pq.numel(), device=dev)
        flat = grid_acc.reshape(na, B * B)
        sel_acc, sel = torch.sort(flat, dim=1, descending=True, stable=True)
        sel_acc, sel = sel_acc[:, :B], sel[:, :B]
        sel_ok = torch.isfinite(sel_acc)  # [na, B]
        any_child = sel_ok.any(dim=1)
        sel_slot, sel_c = sel // B, sel % B
        sel_pair = torch.gather(grid_pair, 1, sel_slot).clamp(min=0)  # [na, B]
        # ---- the new beam
        new_q = child_q[sel_pair, sel_c]  # [na, B, d]
        beam_q[act] = torch.where(sel_ok[:, :, None], new_q, torch.zeros_like(new_q))
        beam_acc[act] = torch.where(sel_ok, sel_acc, torch.zeros_like(sel_acc))
        beam_ok[act] = sel_ok
        # ---- hits of the beam in (slot, candidate) order, first occurrences only
        h_rows = c_rows[sel_pair]  # [na, B, K]
        h_sc = mmr[sel_pair]
        h_ok = (labels[sel_pair] == sel_c[:, :, None]) & sel_ok[:, :, None]
        L = B * K
        h_rows, h_sc, h_ok = h_rows.reshape(na, L), h_sc.reshape(na, L), h_ok.reshape(na, L)
        same = (h_rows[:, :, None] == h_rows[:, None, :]) & h_ok[:, None, :]
        earlier = torch.ones((L, L), dtype=torch.bool, device=dev).tril(-1)
        dup = (same & earlier[None]).any(dim=2)
        keep = h_ok & ~dup
        pos = res_len[act][:, None] + torch.cumsum(keep.to(torch.int64), dim=1) - 1
        pos = torch.where(keep, pos, torch.full_like(pos, cap))  # the rest to the scratch slot
        qi = act[:, None].expand(na, L)
        res_rows[qi, pos] = torch.where(keep, h_rows, torch.full_like(h_rows, -1))
        res_sc[qi, pos] = torch.where(keep, h_sc, torch.full_like(h_sc, float("-inf")))
        res_len[act] += keep.sum(dim=1)
        rounds[act] += any_child.to(torch.int64)
        still = any_child & (res_len[act] < out_k) & (level + 1 < R)
        active[act] = still

    out_rows = res_rows[:, : min(out_k, cap)]
    out_sc = res_sc[:, : min(out_k, cap)].to(torch.float32)
    if out_rows.shape[1] < out_k:
        pad = out_k - out_rows.shape[1]
        out_rows = torch.nn.functional.pad(out_rows, (0, pad), value=-1)
        out_sc = torch.nn.functional.pad(out_sc, (0, pad), value=float("-inf"))
    return RecollectionOutput(rows=out_rows, scores=out_sc, rounds=rounds, hit_rows=res_rows)
