"""The float32 scan kernel of the scan path (csrc/cpu/simd_impl.inc scan_rows_f32).

At SIMD levels 1 and 2 the scan path scores float32 rows with register blocks of rows x
queries and fused multiply-adds (level 0 keeps the older kernel); its scores must stay
within the scan path's error bound, so the exact top-k does not change. Pinned: for
dimensions with and without a tail chunk (1 .. 384), 1 .. 17 queries of one segment
(every remainder of the query blocks, and more than one scan group), segments shorter
and longer than a row block, at every supported level: rows equal a float64 brute force
and scores equal the exact RN32 of an independent oracle (tests/_exact_oracle.py);
the kept scan scores (probe keep_scan_scores) are within the bound of the exact ones.
"""
from __future__ import annotations

import numpy as np
import pytest

from _exact_oracle import exact_f32

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

LEVELS = [lv for lv in (0, 1, 2) if lv <= _native.simd_level()]


@pytest.fixture(autouse=True)
def _uncap():
    _native.set_simd_cap(-1)
    yield
    _native.set_simd_cap(-1)


def _brute_rows(X, a, e, q, k):
    s = X[a:e].astype(np.float64) @ q.astype(np.float64)
    return a + np.lexsort((np.arange(e - a), -s))[:k]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d", [1, 5, 16, 17, 31, 40, 384])
def test_scan_path_exact_at_every_level(level, d):
    rng = np.random.default_rng(1000 * level + d)
    n = 203 if d < 384 else 97
    X = rng.standard_normal((n, d)).astype(np.float32)
    off = np.array([0, 3, 3, n], dtype=np.int64)  # a 3-row segment, an empty one, the rest
    k = 7
    _native.set_simd_cap(level)
    for nq in (1, 2, 3, 4, 5, 8, 17):
        Q = rng.standard_normal((nq, d)).astype(np.float32)
        seg = np.where(np.arange(nq) % 3 == 0, 2, 0).astype(np.int64)
        seg[-1] = 2
        s, r = _native.segmented_topk(X, off, Q, seg, k, 1, path="scan")
        for i in range(nq):
            a, e = off[seg[i]], off[seg[i] + 1]
            want = _brute_rows(X, a, e, Q[i], k)
            got = r[i][r[i] >= 0]
            np.testing.assert_array_equal(got, want, err_msg=f"level {level} d {d} nq {nq} query {i}")
            for j, row in enumerate(got):
                assert s[i, j] == exact_f32(Q[i], X[row])
            assert (r[i][len(got):] == -1).all() and np.isneginf(s[i][len(got):]).all()
    empty_q = rng.standard_normal((2, d)).astype(np.float32)
    s, r = _native.segmented_topk(X, off, empty_q, np.array([1, 1], np.int64), k, 1, path="scan")
    assert (r == -1).all() and np.isneginf(s).all()


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv >= 1])
def test_kept_scan_scores_are_within_the_scan_bound(level):
    rng = np.random.default_rng(5 + level)
    n, d = 1200, 384
    X = rng.standard_normal((n, d)).astype(np.float32)
    X /= np.linalg.norm(X.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
    off = np.array([0, 700, n], dtype=np.int64)
    Q = rng.standard_normal((3, d)).astype(np.float32)
    Q /= np.linalg.norm(Q.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
    seg = np.array([0, 1, 1], np.int64)
    _native.set_simd_cap(level)
    out = _native.probe(X, off, Q, seg, 10, 10, 20.0, "mean", 1, -1.0, keep_scan_scores=True)
    kept, written = out[5], out[6]
    assert written.all() and kept.shape == (3, 700)
    depth = (d + 15) // 16 + 4
    u = 2.0**-24
    bound = (depth * u / (1 - depth * u) + u) * 1.01 + (d + 2) * 2.0**-149  # |x| = |q| = 1 (to ~1e-7)
    for i in range(3):
        a, e = off[seg[i]], off[seg[i] + 1]
        exact = X[a:e].astype(np.float64) @ Q[i].astype(np.float64)
        assert np.abs(kept[i, : e - a] - exact).max() <= bound * 1.01
