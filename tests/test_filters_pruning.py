"""Filtered recollection on long segments, where the native beam driver prunes its rounds.

The C++ driver (csrc/cpu/recollect.cpp) prunes the rounds of a query over a segment of
``_native.PRUNE_MIN_ROWS`` rows or more; a filtered query's rounds score its selection's
rows instead (no pruning for it), next to pruned unfiltered queries of the same user in
the same group. Pinned here, modes "recollection" and "rfmem", with the selection
applied in the rounds (fewer than ``COMPACT_MIN_QUERIES`` filtered queries) and on the
compacted copy (more): the native backend equals the reference backend (numpy +
scikit-learn: ids, rows, rounds, routes, the probe, exact dense scores; the discovery
scores within a few float32 ulps, as between any two backends: a later round's score is
that of the mixed query, which the reference mixes in another order), equals the Python driver over the native kernels
bit for bit, and never returns a row outside the filter; the unfiltered query next to
them really runs pruned rounds (the driver's profile counts its scored rows).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

from rfmem_fast import RFMemConfig, search  # noqa: E402
from rfmem_fast.backends.native import COMPACT_MIN_QUERIES, NativeBackend, _draws_by_clusters  # noqa: E402
from rfmem_fast.filters import compile_filters  # noqa: E402
from rfmem_fast.recollection import recollection_capacity  # noqa: E402
from test_filters import make_bank, matching_rows, unit_query  # noqa: E402

NATIVE = NativeBackend(beam_driver="native")
PYTHON = NativeBackend(beam_driver="python")
D = 24
LONG = 1200  # rows of user u0: above PRUNE_MIN_ROWS, so its unfiltered rounds are pruned

CONFIGS = {
    "no-mmr": RFMemConfig(out_k=8, probe_k=8, beam_width=3, max_rounds=4, mmr_lambda=1.0),
    "mmr": RFMemConfig(out_k=8, probe_k=8, beam_width=3, max_rounds=4, mmr_lambda=0.7),
}
# list mode (<= a quarter of the user), mask size (more), a tag filter, nothing matching, none
FILTERS = [{"rank": {"$lt": 100}}, {"rank": {"$lt": 900}}, None, {"tag": {"$in": ["work", "home"]}},
           {"rank": {"$gte": 5}}, {"rank": {"$lt": 40}}, {"rank": {"$lt": 0}}]  # fmt: skip
USERS = ["u0", "u0", "u0", "u0", "u0", "u1", "u0"]


@pytest.fixture(scope="module")
def bank():
    assert LONG >= _native.PRUNE_MIN_ROWS
    return make_bank(11, [LONG, 90], d=D)


def _batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    idx = [j % len(FILTERS) for j in range(n)]
    return rng.normal(size=(n, D)), [USERS[j] for j in idx], [FILTERS[j] for j in idx]


def _check(bank, Q, users, fs, cfg, mode):
    got = search(bank, Q, users, cfg, mode=mode, backend=NATIVE, filters=fs)
    ref = search(bank, Q, users, cfg, mode=mode, backend="reference", filters=fs)
    py = search(bank, Q, users, cfg, mode=mode, backend=PYTHON, filters=fs)
    assert (got.ids == ref.ids).all()
    for name in ("rows", "rounds", "route", "dense_scores", "probe_ids", "probe_scores"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=f"{name} vs reference")
    np.testing.assert_allclose(got.scores, ref.scores, rtol=0, atol=4e-7)  # a few ulps of ~1
    for name in ("rows", "rounds", "route", "dense_scores"):
        np.testing.assert_array_equal(getattr(got, name), getattr(py, name), err_msg=f"{name} vs Python driver")
    np.testing.assert_array_equal(got.scores.view(np.uint32), py.scores.view(np.uint32))
    for i, (u, f) in enumerate(zip(users, fs)):
        allowed = set(matching_rows(bank, u, f).tolist())
        hits = got.rows[i][got.rows[i] >= 0]
        assert set(hits.tolist()) <= allowed, (i, f)
        if f is not None and len(allowed) == 0:
            assert hits.size == 0
    return got


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["recollection", "rfmem"])
@pytest.mark.parametrize("n", [len(FILTERS), 2 * COMPACT_MIN_QUERIES])  # selection in the rounds / compacted
def test_filtered_recollection_native_equals_reference(bank, name, mode, n):
    cfg = CONFIGS[name]
    Q, users, fs = _batch(n, seed=n)
    filtered = sum(f is not None for f in fs)
    assert (filtered < COMPACT_MIN_QUERIES) == (n == len(FILTERS))
    got = _check(bank, Q, users, fs, cfg, mode)
    if mode == "recollection":
        assert got.rounds.max() >= 2  # later rounds ran (the pruned ones for the unfiltered queries)


def test_pruned_and_filtered_queries_share_a_group(bank):
    """The C++ driver itself, on one group of u0's queries: an unfiltered one (pruned:
    its scored rows are counted) and filtered ones (their selections' rows), with the
    probe's scan scores passed as for a search. Equal to the unfiltered driver for the
    unfiltered query, to the compacted driver for the filtered ones."""
    cfg = CONFIGS["mmr"]
    rng = np.random.default_rng(8)
    fs = [None, {"rank": {"$lt": 100}}, {"rank": {"$lt": 900}}, {"rank": {"$gte": 5}}]
    users = ["u0"] * 4
    view = NATIVE.view(bank)
    seg = bank.segments_for(users)
    sel = compile_filters(bank, view.snapshot, seg, fs)
    Q = torch.from_numpy(np.stack([unit_query(q) for q in rng.normal(size=(4, D))]))
    qseg = torch.from_numpy(seg)
    k0 = max(cfg.probe_k, cfg.beam_width * cfg.fanout)
    s0, r0, *_ = NATIVE.probe(view, Q, qseg, k0, cfg.probe_k, cfg.temperature, cfg.entropy, sel=sel)
    X, off = NATIVE._bank(view)
    width = recollection_capacity(cfg) + 1
    common = (cfg.beam_width, cfg.fanout, cfg.max_rounds, cfg.out_k, float(cfg.alpha), float(cfg.mmr_lambda),
              float(cfg.score_floor), cfg.kmeans_iters, float(cfg.kmeans_tol),
              _draws_by_clusters(int(cfg.kmeans_seed), int(cfg.beam_width)), width)  # fmt: skip
    stats = np.zeros(len(_native.recollect_stat_names))
    rows, scores, rounds = _native.recollect(
        X, off, Q.numpy(), seg, s0.numpy(), r0.numpy(), *common, 1, view.row_norm_max, NATIVE.memory_budget, None,
        **NATIVE._scan_args(view), **NATIVE._sel_args(view, sel), stats=stats,
    )  # fmt: skip
    names = list(_native.recollect_stat_names)
    assert stats[names.index("scan_rows")] > 0  # the unfiltered query's rounds were pruned
    assert stats[names.index("scan_rows")] < (rounds[0] - 1) * LONG  # ... and skipped rows
    alone = _native.recollect(X, off, Q.numpy()[:1], seg[:1], s0.numpy()[:1], r0.numpy()[:1], *common, 1,
                              view.row_norm_max, NATIVE.memory_budget, None)  # fmt: skip
    np.testing.assert_array_equal(rows[:1], alone[0])
    np.testing.assert_array_equal(scores[:1].view(np.uint32), alone[1].view(np.uint32))
    want = NATIVE._recollect_compacted(view, Q, qseg, cfg, (s0, r0), None, sel)  # the filtered rows' copy
    np.testing.assert_array_equal(rows, want.hit_rows.numpy())
    np.testing.assert_array_equal(scores[:, : cfg.out_k].view(np.uint32), want.scores.numpy().view(np.uint32))
    np.testing.assert_array_equal(rounds, want.rounds.numpy())
    assert (rounds >= 2).all()
