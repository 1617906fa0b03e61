"""The GEMM tile path of the native top-k.

Pinned here, at every SIMD level this CPU runs (the AVX-512, AVX2 + FMA and baseline
micro-kernels, capped with ``_native.set_simd_cap``):
* ids and scores of the forced GEMM path, the forced scan path and the cost rule's
  choice all equal the exact oracle (tests/_exact_oracle.py) on banks of exact and
  1-ulp near duplicates (ties broken by the smaller row), for every k, prefixes agree,
  and a query's result is the same alone and inside batches of 1..256;
* shapes where the cost rule takes each path (many queries of one long segment: GEMM;
  one query, or short segments: scan), d not a multiple of the block Kc = 64 or of
  the panel width, partial micro-tiles, and the threaded path whose row parts are
  merged;
* the cost rule itself and the GEMM depth of the error bound (exact.gemm_depth).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _exact_oracle import check_backend, near_duplicate_bank, oracle_topk, perturb, unit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

from rfmem_fast import MemoryBank, RFMemConfig, search  # noqa: E402
from rfmem_fast.backends import exact  # noqa: E402
from rfmem_fast.backends.native import NativeBackend  # noqa: E402
from rfmem_fast.backends.reference import ReferenceBackend  # noqa: E402

SUPPORTED = _native.set_simd_cap(-1)
LEVELS = list(range(SUPPORTED + 1))
_ORACLE: dict = {}  # expected results shared by the levels


@pytest.fixture(params=LEVELS, ids=lambda lv: ("baseline", "avx2", "avx512")[lv])
def level(request):
    assert _native.set_simd_cap(request.param) == request.param
    yield request.param
    _native.set_simd_cap(-1)


def _many_queries(seed: int, d: int, n: int, extra: int):
    """near_duplicate_bank plus ``extra`` more queries of the near-duplicate user (near
    duplicates of its rows and random vectors), so that one segment has many queries."""
    bank, Q, qseg = near_duplicate_bank(seed, d, n)
    rng = np.random.default_rng(seed + 1)
    X = bank.snapshot().vectors
    more = [perturb(X[int(rng.integers(0, n))], rng, 1) if i % 2 else unit(rng.normal(size=d)) for i in range(extra)]
    Q = np.concatenate([Q, np.stack(more).astype(np.float32)]) if extra else Q
    return bank, Q, np.zeros(Q.shape[0], dtype=np.int64)


def test_cost_rule():
    """Many queries of a long segment take the GEMM path at the SIMD levels that have a
    fused multiply-add micro-kernel; one query, a short segment or the baseline level
    (no faster than the scan there) take the scan path."""
    for lv in (1, 2):
        assert _native.gemm_pays(1024, 100_000, 384, lv)
        assert _native.gemm_pays(24, 4096, 384, lv)
        assert not _native.gemm_pays(1, 100_000, 384, lv)
        assert not _native.gemm_pays(4, 4096, 384, lv)
        # the measured crossover (bench/results/gemm-rates-crossover-amd-epyc.json): 18 queries at AVX-512, 10 at AVX2
        assert [n for n in range(1, 80) if _native.gemm_pays(n, 4096, 384, lv)] == list(range(18 if lv == 2 else 10, 80))
        assert not _native.gemm_pays(1024, 64, 384, lv)  # shorter than the 128-row minimum
    assert not any(_native.gemm_pays(nq, 100_000, 384, 0) for nq in range(1, 300))
    assert _native.gemm_pays(1024, 100_000, 384) == (SUPPORTED >= 1)  # level -1: the one in use


def test_gemm_depth():
    """Depth of the GEMM path (blocks of Kc = 64 terms, then one rounding per later block)
    and the C++ constant it mirrors; its bound for d = 384 (~4.2e-6) between the scan
    path's (1.7e-6) and a sequential float32 sum's (2.3e-5)."""
    assert _native.GEMM_KC == exact.GEMM_KC == 64
    assert [exact.gemm_depth(d) for d in (1, 63, 64, 65, 128, 129, 384)] == [1, 63, 64, 65, 65, 66, 69]
    c = exact.scan_error_coef(exact.gemm_depth(384))
    assert exact.scan_error_coef(384 // 16 + 4) < c < exact.scan_error_coef(384)
    assert c == pytest.approx(70 * 2.0**-24, rel=1e-3)


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the level stays set
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.one_of(st.sampled_from([1, 7, 16, 63, 64, 65, 129]), st.integers(1, 160)),
    n=st.integers(2, 80),
)
def test_forced_gemm_path_equals_oracle(level, seed, d, n):
    """Near-duplicate banks: the forced GEMM path returns the oracle's ids and scores for
    every k (prefixes agree), alone and in batches; so does the forced scan path."""
    bank, Q, qseg = near_duplicate_bank(seed, d, n)
    ks = sorted({1, 3, min(10, n), n + 2})
    for path in ("gemm", "scan"):
        check_backend(NativeBackend(topk_path=path), bank, Q, qseg, ks, seed)


@pytest.mark.parametrize("d, n, extra", [(64, 300, 40), (130, 257, 70), (17, 600, 33)])
def test_auto_takes_gemm_for_many_queries_and_equals_oracle(level, d, n, extra):
    """One near-duplicate segment of 257-600 rows with 39-76 queries: the cost rule takes
    the GEMM path (levels 1, 2) and the ids / scores equal the oracle, as for the scan."""
    key = ("many", d, n, extra)
    if key not in _ORACLE:  # the same at every level
        bank, Q, qseg = _many_queries(d + n, d, n, extra)
        snap = bank.snapshot()
        _ORACLE[key] = (bank, Q, qseg, oracle_topk(snap.vectors, snap.offsets, Q, qseg, 12))
    bank, Q, qseg, (want_r, want_s) = _ORACLE[key]
    if level >= 1:
        assert _native.gemm_pays(Q.shape[0], n, d)
    for path in ("auto", "gemm", "scan"):
        be = NativeBackend(topk_path=path)
        s, r = be.segmented_topk(be.view(bank), torch.from_numpy(Q), torch.from_numpy(qseg), 12)
        np.testing.assert_array_equal(r.numpy(), want_r, err_msg=path)
        np.testing.assert_array_equal(s.numpy(), want_s, err_msg=path)


def test_threaded_gemm_parts_are_merged_exactly(level):
    """5,000 rows of 20 distinct near duplicates (every kept list full of ties): with two
    threads the GEMM path splits the rows into parts whose lists are merged and, lists
    being full, rescans; ids equal the reference backend's (exact) with 1 and 2 threads."""
    rng = np.random.default_rng(11)
    d = 48
    u = unit(rng.normal(size=d))
    distinct = np.stack([u] + [perturb(u, rng, int(rng.integers(1, 4))) for _ in range(19)])
    X = np.concatenate([distinct[rng.integers(0, 20, size=5000)], rng.normal(size=(300, d)).astype(np.float32)])
    bank = MemoryBank.from_arrays(X, [0, 5000, 5300])
    Q = np.stack([u, perturb(u, rng, 2)] + [unit(rng.normal(size=d)) for _ in range(38)]).astype(np.float32)
    qseg = torch.zeros(40, dtype=torch.int64)
    Qt = torch.from_numpy(Q)
    ref = ReferenceBackend().segmented_topk(ReferenceBackend().view(bank), Qt, qseg, 7)
    assert _native.threads_for(2, 40 * 5000 * d, 1 << 30) == 2  # the work pays for two threads
    for threads in (1, 2):
        for path in ("gemm", "scan"):
            be = NativeBackend(num_threads=threads, topk_path=path)
            s, r = be.segmented_topk(be.view(bank), Qt, qseg, 7)
            assert r.tolist() == ref[1].tolist(), (threads, path)
            assert s.tolist() == ref[0].tolist(), (threads, path)


def test_many_users_mixed_paths_search(level):
    """A bank where some users get many queries (GEMM) and others few (scan): one search
    gives the same ids, scores and routes on every forced path and the reference."""
    rng = np.random.default_rng(5)
    lens = [400, 3, 250, 0, 160]
    X = rng.normal(size=(sum(lens), 40)).astype(np.float32)
    X[410:420] = X[405]  # exact duplicates in the third user
    bank = MemoryBank.from_arrays(X, np.concatenate([[0], np.cumsum(lens)]))
    users = [0] * 30 + [1] * 2 + [2] * 25 + [4] * 3
    Q = rng.normal(size=(len(users), 40))
    Q[30:40] = X[405] + 1e-3 * rng.normal(size=(10, 40))
    cfg = RFMemConfig(out_k=8, probe_k=8)
    if "mixed" not in _ORACLE:
        _ORACLE["mixed"] = search(bank, Q, users, cfg, mode="rfmem", backend="reference")
    want = _ORACLE["mixed"]
    for path in ("auto", "gemm", "scan"):
        got = search(bank, Q, users, cfg, mode="rfmem", backend=NativeBackend(topk_path=path))
        assert [got.ids_list(i) for i in range(len(users))] == [want.ids_list(i) for i in range(len(users))], path
        np.testing.assert_array_equal(got.probe_scores, want.probe_scores)
        np.testing.assert_array_equal(got.route, want.route)


def test_topk_path_argument_is_checked():
    with pytest.raises(ValueError, match="topk_path"):
        NativeBackend(topk_path="blas")
    X = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="path must be one of"):
        _native.segmented_topk(X, np.array([0, 4]), X, np.zeros(4, np.int64), 2, path="fast")
