"""The native beam driver's pruned rounds (csrc/cpu/recollect.cpp).

On segments of >= 512 rows the driver scans each original query once and lets every
later round skip the rows that provably cannot reach a branch query's top-k (the scan
scores of q0 plus its scan bound and ||x|| ||q - q0||, against a lower bound of the
k-th exact score). Pinned here: the results are those of the Python driver, whose
rounds scan every row (same rows, bitwise scores, rounds), on clustered banks, banks of
exact duplicates, 1-ulp near duplicates and coarse grids (ties everywhere), for several
configs, alone and in batches of one user, at every SIMD level (level 0 does not
prune); the pruning is real (the driver's profile counts fewer scored rows than full
scans); the driver's profile counts the branch queries the Python driver scans.
"""
from __future__ import annotations

import zlib

import numpy as np
from _shared import clustered_rows
import pytest
import torch

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

from rfmem_fast import MemoryBank, RFMemConfig, search  # noqa: E402
from rfmem_fast.backends.native import NativeBackend, _draws_by_clusters  # noqa: E402
from rfmem_fast.recollection import recollect as python_driver  # noqa: E402
from rfmem_fast.recollection import recollection_capacity  # noqa: E402

NATIVE = NativeBackend(beam_driver="native")
PYTHON = NativeBackend(beam_driver="python")


def _bank(rng: np.random.Generator, d: int, lens: list[int], kind: str) -> MemoryBank:
    bank = MemoryBank(d)
    for u, n in enumerate(lens):
        bank.add(f"u{u}", clustered_rows(rng, n, d, kind), [f"u{u}-{i}" for i in range(n)])
    return bank


def _same(a, b, where: str) -> None:
    np.testing.assert_array_equal(a.rows, b.rows, err_msg=where)
    np.testing.assert_array_equal(a.scores.view(np.uint32), b.scores.view(np.uint32), err_msg=where)
    np.testing.assert_array_equal(a.rounds, b.rounds, err_msg=where)


CONFIGS = {
    "default": RFMemConfig(),
    "wide": RFMemConfig(beam_width=5, fanout=2, max_rounds=6, out_k=25, mmr_lambda=1.0, score_floor=-1.0),
    "floor": RFMemConfig(beam_width=3, max_rounds=8, out_k=15, mmr_lambda=0.5, score_floor=0.2, alpha=1.0),
}


@pytest.mark.parametrize("kind", ["gauss", "dup", "near", "grid"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_rounds_equal_the_python_driver(kind, name):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{name}".encode()))
    d = 48 if kind != "grid" else 17
    bank = _bank(rng, d, [1500, 600], kind)
    cfg = CONFIGS[name]
    vec = bank.snapshot().vectors
    Q = np.concatenate([vec[rng.integers(0, 1500, 3)], rng.standard_normal((3, d)).astype(np.float32)])
    Q[4] = vec[:1500].mean(axis=0)  # a query between the clusters: a low k-th score, little to prune
    users = ["u0", "u0", "u1", "u0", "u0", "u1"]
    a = search(bank, Q, users, cfg, mode="recollection", backend=NATIVE)
    b = search(bank, Q, users, cfg, mode="recollection", backend=PYTHON)
    _same(a, b, f"{kind} {name}")
    assert a.rounds.max() >= 2
    for i in (0, 4):  # alone (a group of one) as in the batch (groups of one user's queries)
        one = search(bank, Q[i : i + 1], users[i : i + 1], cfg, mode="recollection", backend=NATIVE)
        np.testing.assert_array_equal(one.rows[0], a.rows[i])
        assert one.rounds[0] == a.rounds[i]


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_every_simd_level_and_the_pruning_is_real(cap):
    _native.set_simd_cap(-1)
    if cap > _native.simd_level():
        pytest.skip(f"SIMD level {cap} not supported here")
    rng = np.random.default_rng(7)
    bank = _bank(rng, 384, [4096], "gauss")
    snap = bank.snapshot()
    cfg = RFMemConfig()
    Q = rng.standard_normal((3, 384)).astype(np.float32)
    Q[0] = snap.vectors[5]
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    qseg = np.zeros(3, np.int64)
    draws = _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width)
    width = recollection_capacity(cfg) + 1
    view = NATIVE.view(bank)
    ref = python_driver(NATIVE, view, torch.from_numpy(Q), torch.from_numpy(qseg), cfg)
    _native.set_simd_cap(cap)
    try:
        for i in range(3):  # one query per call: a group of one
            st = np.zeros(len(_native.recollect_stat_names))
            rows, scores, rounds = _native.recollect(
                snap.vectors, snap.offsets, Q[i : i + 1], qseg[:1], None, None, cfg.beam_width, cfg.fanout,
                cfg.max_rounds, cfg.out_k, cfg.alpha, cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters,
                cfg.kmeans_tol, draws, width, 1, -1.0, 256 << 20, stats=st,
            )  # fmt: skip
            np.testing.assert_array_equal(rows, ref.hit_rows[i : i + 1].numpy())
            np.testing.assert_array_equal(rounds, ref.rounds[i : i + 1].numpy())
            np.testing.assert_array_equal(scores[:, : cfg.out_k].view(np.uint32),
                                          ref.scores[i : i + 1].numpy().view(np.uint32))  # fmt: skip
            s = dict(zip(_native.recollect_stat_names, st))
            scanned_queries = s["scan_queries"]  # branch queries of the rounds that scan (levels >= 1)
            if cap == 0:
                assert s["scan_rows"] == 0  # no float32 SIMD kernels: full scans, no pruning
            elif scanned_queries > 0:
                assert 0 < s["scan_rows"] < 0.5 * 4096 * (s["rounds"] - 1)  # far fewer than full scans
    finally:
        _native.set_simd_cap(-1)


def test_profile_counts_the_branch_queries_of_the_python_driver():
    rng = np.random.default_rng(3)
    bank = _bank(rng, 32, [900], "gauss")
    snap = bank.snapshot()
    cfg = RFMemConfig()
    Q = snap.vectors[[3, 400]].copy()
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    qseg = np.zeros(2, np.int64)
    seen: list[int] = []

    class Spy(NativeBackend):
        def segmented_topk(self, view, Qb, qs, k):
            seen.append(int(Qb.shape[0]))
            return super().segmented_topk(view, Qb, qs, k)

    spy = Spy(beam_driver="python")
    python_driver(spy, spy.view(bank), torch.from_numpy(Q), torch.from_numpy(qseg), cfg)
    st = np.zeros(len(_native.recollect_stat_names))
    _native.recollect(snap.vectors, snap.offsets, Q, qseg, None, None, cfg.beam_width, cfg.fanout, cfg.max_rounds,
                      cfg.out_k, cfg.alpha, cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters, cfg.kmeans_tol,
                      _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width), cfg.out_k, 1, -1.0, 256 << 20,
                      stats=st)  # fmt: skip
    s = dict(zip(_native.recollect_stat_names, st))
    assert s["scan_queries"] == sum(seen[1:])  # the first call: the original queries (level 0)
    assert s["total_s"] > 0 and all(st[i] >= 0 for i in range(len(st)))
    with pytest.raises(ValueError, match="stats must be float64"):
        _native.recollect(snap.vectors, snap.offsets, Q, qseg, None, None, 4, 1, 10, 10, 0.5, 0.9, 0.0, 300, 1e-4,
                          _draws_by_clusters(42, 4), 10, 1, -1.0, 256 << 20, stats=np.zeros(3))  # fmt: skip


def test_probe_scan_scores_feed_the_driver_and_dense_scores_are_exact():
    """search on the native backend: the probe keeps its scan scores (scan path) and the
    driver prunes with them; a batch of 16 queries of one user takes the GEMM path in
    the probe (no scan scores: the driver scans q0 itself); the hits' dense scores come
    from the driver and equal the Python driver's re-scored ones."""
    rng = np.random.default_rng(11)
    bank = _bank(rng, 64, [2000], "gauss")
    vec = bank.snapshot().vectors
    Q = vec[rng.integers(0, 2000, 16)] + 0.05 * rng.standard_normal((16, 64)).astype(np.float32)
    cfg = RFMemConfig()
    for b in (1, 3, 16):
        a = search(bank, Q[:b], ["u0"] * b, cfg, mode="recollection", backend=NATIVE)
        p = search(bank, Q[:b], ["u0"] * b, cfg, mode="recollection", backend=PYTHON)
        _same(a, p, f"batch {b}")
        np.testing.assert_array_equal(a.dense_scores, p.dense_scores)
        ok = a.rows >= 0
        Qn = (Q[:b] / np.linalg.norm(Q[:b].astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
        want = np.einsum("id,ijd->ij", Qn.astype(np.float64), vec[np.where(ok, a.rows, 0)].astype(np.float64))
        np.testing.assert_allclose(a.dense_scores[ok], want[ok].astype(np.float32), rtol=1e-6, atol=1e-7)
    view = NATIVE.view(bank)
    X, off = NativeBackend._bank(view)
    Qn = torch.from_numpy(Q / np.linalg.norm(Q, axis=1, keepdims=True)).float()
    seg = np.zeros(16, np.int64)
    out = _native.probe(X, off, Qn.numpy(), seg, 10, 10, 20.0, "mean", 1, view.row_norm_max, keep_scan_scores=True)
    assert out[5].shape == (16, 2000)
    assert bool(out[6].all()) == (not _native.gemm_pays(16, 2000, 64) and _native.simd_level() >= 1)
    one = _native.probe(X, off, Qn.numpy()[:1], seg[:1], 10, 10, 20.0, "mean", 1, view.row_norm_max,
                        keep_scan_scores=True)  # fmt: skip
    if _native.simd_level() >= 1:
        assert one[6][0]
        exact = X.astype(np.float64) @ Qn.numpy()[0].astype(np.float64)
        np.testing.assert_allclose(one[5][0], exact, atol=1e-5)  # scan scores, within the scan bound
    short = _native.probe(X, np.array([0, 100], np.int64), Qn.numpy()[:1], seg[:1], 10, 10, 20.0, "mean", 1,
                          view.row_norm_max, keep_scan_scores=True)  # fmt: skip
    assert short[5] is None and short[6] is None  # below PRUNE_MIN_ROWS rows: nothing kept
    assert len(_native.probe(X, off, Qn.numpy()[:1], seg[:1], 10, 10, 20.0, "mean", 1, view.row_norm_max)) == 5


def test_recollect_rejects_bad_ref_scores():
    rng = np.random.default_rng(12)
    X = rng.standard_normal((600, 8)).astype(np.float32)
    off = np.array([0, 600], np.int64)
    Q = X[:2] / np.linalg.norm(X[:2], axis=1, keepdims=True)
    seg = np.zeros(2, np.int64)
    args = (X, off, Q, seg, None, None, 4, 1, 10, 10, 0.5, 0.9, 0.0, 300, 1e-4, _draws_by_clusters(42, 4), 10)
    with pytest.raises(ValueError, match="must be given together"):
        _native.recollect(*args, ref_scores=np.zeros((2, 600), np.float32))
    with pytest.raises(ValueError, match=r"ref_scores must be \[b, >= 600\]"):
        _native.recollect(*args, ref_scores=np.zeros((2, 599), np.float32), ref_ok=np.ones(2, bool))
    with pytest.raises(TypeError):
        _native.recollect(*args, ref_scores=np.zeros((2, 600)), ref_ok=np.ones(2, bool))
    rows, _, rounds, dense = _native.recollect(*args, dense=True)
    assert dense.shape == (2, 10) and np.isnan(dense[rows[:, :10] < 0]).all()
