"""The score-based fusions' boosts as per-query factors (rfmem_fast.fusion.BoostFactors).

Pins: for every fusion ("convex" raw / max, "adaptive", "zscore"), the boosts of hits held
flat (CSR over the queries: :meth:`BoostFactors.flat`, :meth:`KernelHits.boosts`) and of
single candidates (:meth:`BoostFactors.at`) equal the [b, c] boosts of
:data:`rfmem_fast.fusion.BOOSTS` bit for bit, and both equal a scalar float64 oracle of
the module docstring's formulas; also for queries without a hit, a largest BM25 of 0, a
BM25 spread of 0 and users with fewer than 10 documents.
"""
from __future__ import annotations

import numpy as np
import pytest

from rfmem_fast import RFMemConfig
from rfmem_fast.fusion import BOOST_FACTORS, BOOSTS, TOP_LEXICAL, BoostFactors, LexicalStats
from rfmem_fast.search_lexical import KernelHits

CONFIGS = {
    "convex_raw": RFMemConfig(fusion="convex", lexical_norm="raw", lexical_weight=0.03),
    "convex_max": RFMemConfig(fusion="convex", lexical_norm="max", lexical_weight=0.2),
    "adaptive": RFMemConfig(fusion="adaptive", lexical_weight=0.7),
    "zscore": RFMemConfig(fusion="zscore", lexical_weight=0.1),
}


def _hits(seed: int, b: int = 40):
    """b queries' hits (CSR) and statistics, with the edge cases of every factor."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 30, size=b)
    lens[[0, 5]] = 0  # no hit
    lens[1] = 1
    hptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    hval = rng.gamma(2.0, 3.0, size=int(hptr[-1])) + 1e-3
    n_docs = rng.integers(1, 60, size=b)
    n_docs[[1, 2, 3]] = [1, 2, 7]  # N < 10: sharpness averages ranks 2..N
    lex_max = np.zeros(b)
    top = np.zeros((b, TOP_LEXICAL))
    for i in range(b):
        v = hval[hptr[i] : hptr[i + 1]]
        if v.shape[0]:
            lex_max[i] = v.max()
            t = -np.sort(-v)[:TOP_LEXICAL]
            top[i, : t.shape[0]] = t
    lex_max[4] = 0.0  # hits with a largest BM25 of 0: the max norm gives 0
    top[4] = 0.0
    lex_std = rng.random(b) * 2.0
    lex_std[[2, 6]] = 0.0  # spread 0: zscore gives 0
    lex_std[7] = -1.0
    dense_gap = rng.random(b) * 0.3
    dense_gap[8] = -0.2  # clipped to 0
    return hptr, hval, LexicalStats(lex_max, top, n_docs, lex_std, dense_gap)


def _oracle(name: str, lex: float, i: int, stats: LexicalStats, cfg: RFMemConfig) -> float:
    """One candidate's boost by the module docstring's formulas, in Python floats (IEEE float64)."""
    w = float(cfg.lexical_weight)
    lm = float(stats.lex_max[i])
    if name == "convex_raw":
        return w * lex
    if name == "convex_max":
        return w * (lex / lm if lm > 0 else 0.0)
    if name == "adaptive":
        m = min(int(stats.n_docs[i]), TOP_LEXICAL)
        s = 0.0
        for r in range(1, m):  # ranks 2..m, left to right
            s += float(stats.top[i, r])
        mean = s / (m - 1) if m > 1 else 0.0
        t1 = float(stats.top[i, 0])
        c = (t1 - mean) / t1 if t1 > 0 else 0.0
        return (w * c) * (lex / lm if lm > 0 else 0.0)
    sd = float(stats.lex_std[i])
    wq = w * max(float(stats.dense_gap[i]), 0.0) / sd if sd > 0 else 0.0
    return wq * lex


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_flat_boosts_equal_matrix_boosts_and_oracle(name, seed):
    cfg = CONFIGS[name]
    hptr, hval, stats = _hits(seed)
    b = hptr.shape[0] - 1
    lens = np.diff(hptr)
    qi = np.repeat(np.arange(b), lens)
    col = np.arange(hval.shape[0]) - np.repeat(hptr[:-1], lens)
    M = np.zeros((b, int(lens.max()) + 2))  # padded with zeros beyond each query's hits
    M[qi, col] = hval
    want = BOOSTS[cfg.fusion](M, stats, cfg)
    fac = BOOST_FACTORS[cfg.fusion](stats, cfg)
    np.testing.assert_array_equal(fac.matrix(M), want)
    flat = fac.flat(hval, hptr)
    assert flat.dtype == np.float64 and flat.shape == hval.shape
    assert np.array_equal(flat, want[qi, col])
    assert np.array_equal(fac.at(hval, qi), want[qi, col])
    oracle = np.array([_oracle(name, float(v), int(i), stats, cfg) for v, i in zip(hval, qi)])
    assert np.array_equal(flat, oracle)
    if name in ("convex_max", "adaptive"):  # largest BM25 0: no boost
        assert qi[qi == 4].shape[0] and (flat[qi == 4] == 0).all()
    if name == "zscore":  # spread <= 0: no boost
        assert (flat[np.isin(qi, [2, 6, 7])] == 0).all() and (flat[~np.isin(qi, [2, 6, 7, 8])] > 0).all()
    kh = KernelHits(hptr, np.zeros(hval.shape[0], np.int32), hval, stats.lex_max, stats.top, np.zeros(b),
                    np.zeros(b), stats.n_docs, stats.n_docs)  # fmt: skip
    got = kh.boosts(cfg, (stats.lex_std, stats.dense_gap) if cfg.fusion == "zscore" else None)
    assert got.flags.c_contiguous and np.array_equal(got, want[qi, col])


def test_single_query_and_no_hits():
    hptr, hval = np.array([0, 5]), np.array([1.0, 2.0, 0.5, 3.0, 2.5])
    stats = LexicalStats(np.array([3.0]), np.array([[3.0, 2.5, 2.0, 1.0, 0.5] + [0.0] * 5]), np.array([5]),
                         np.array([0.9]), np.array([0.1]))  # fmt: skip
    for name, cfg in CONFIGS.items():
        fac = BOOST_FACTORS[cfg.fusion](stats, cfg)
        assert np.array_equal(fac.flat(hval, hptr), BOOSTS[cfg.fusion](hval[None, :], stats, cfg)[0])
        empty = BOOST_FACTORS[cfg.fusion](stats.take(np.array([0, 0])), cfg).flat(np.zeros(0), np.zeros(3, np.int64))
        assert empty.shape == (0,) and empty.dtype == np.float64


def test_bad_arguments_are_named():
    fac = BoostFactors(np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="ptr must be 3 pointers from 0 to 4"):
        fac.flat(np.ones(4), np.array([0, 2]))
    with pytest.raises(ValueError, match="ptr must be 3 pointers from 0 to 4"):
        fac.flat(np.ones(4), np.array([0, 2, 3]))
    _, _, stats = _hits(0)
    with pytest.raises(ValueError, match="fusion 'zscore' needs LexicalStats.lex_std"):
        BOOST_FACTORS["zscore"](LexicalStats(stats.lex_max, stats.top, stats.n_docs), CONFIGS["zscore"])
