"""The int8 scan copy (``MemoryBank(dim, dtype="int8")``; csrc/cpu/topk.cpp "int8 scan").

Pinned here (the cases shared with the half-precision banks are parametrized in
tests/test_half_banks.py):

* the copy: codes and scales equal an independent quantisation (exact rationals), the
  two per-row norm bounds hold and are tight;
* the bound: ``_native.int8_bounds`` brackets the exact score RN32(q.x) of every pair
  (the oracle of tests/_exact_oracle.py), at every SIMD level, on rows built to sit AT
  the bound (their residual parallel to the query: the Cauchy-Schwarz step is an
  equality), with large and tiny norms, and its width stays within a few per cent of the
  rows' residual norms;
* the keys are the same bits at every level and int8 kernel (baseline, AVX2, and at
  level 2 AVX-512BW and AVX512_VNNI where the CPU has them), on the scan path's dots and
  the GEMM micro-kernel's, for d not a multiple of 16 / 32 (and d = 1), codes at +-127
  against queries at +-QMAX (int32 sums near 2^31), and enough queries and rows that
  the last panel and micro-tile are partial; the same for the GEMM units' byte queries
  (avx512_vnni's vpdpbusd kernel against the plain dots of the same codes), whose top-k
  equals the oracle's with byte queries on and off (re-keyed finish, rescans, threads);
* the top-k over the int8 copy equals the oracle's ids and scores at every SIMD level,
  on the scan and GEMM paths, for d = 1, 3, 17, 31, 33, 384, 385: rows at the bound whose
  int8 order is the reverse of their exact order, rows sharing their codes (the scan sees
  only ties: the kept list overflows and the segment is rescanned), exact and 1-ulp
  duplicates, non-unit rows (norms 2^+-40), several segments (shared and multi-tenant
  batches), row lists and masks (filters), threads splitting one segment;
* the kernels read the int8 copy (a copy that lies changes the answer);
* banks: add / update / delete / compact keep the copy that of the live rows, and
  searches (dense, rfmem, filtered) equal the float32 bank's.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
from _exact_oracle import exact_f32, oracle_topk

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available
from rfmem_fast.precision import int8_scan_copy

NATIVE = "native" in available()
pytestmark = pytest.mark.skipif(not NATIVE, reason="native backend not built")
if NATIVE:
    from rfmem_fast import _native

    # (level cap, int8 cap, the int8 kernels that gives): every level, and at level 2 every
    # int8 variant this CPU has (simd.h: avx2 = level 1's, avx512bw, avx512_vnni)
    _TOP = _native.set_simd_cap(-1)
    KERNELS = [(lv, -1, ("baseline", "avx2")[lv]) for lv in range(min(_TOP, 1) + 1)]
    if _TOP >= 2:
        KERNELS += [(2, v, ("avx2", "avx512bw", "avx512_vnni")[v]) for v in range(_native.simd_int8_supported() + 1)]
else:
    KERNELS = [(0, -1, "baseline")]
DIMS = (1, 3, 17, 31, 33, 384, 385)


def _use(cap: int, int8_cap: int, name: str) -> None:
    assert _native.set_simd_cap(cap, int8_cap) == cap
    assert _native.simd_int8_kernel() == name


@pytest.fixture(params=KERNELS, ids=[f"{lv}-{name}" for lv, _, name in KERNELS])
def level(request):
    _use(*request.param)
    yield request.param[0]
    _native.set_simd_cap(-1)


def _xnorm(meta: np.ndarray) -> float:
    return float(meta[:, 2].max()) if meta.shape[0] else 0.0


def _topk(X, off, Q, qseg, k, path="auto", threads=1, **sel):
    codes, meta = int8_scan_copy(X)
    return _native.segmented_topk(X, off, Q, qseg, k, threads, _xnorm(meta), scan=codes, scan_meta=meta,
                                  scan_type="int8", path=path, **sel)  # fmt: skip


# ------------------------------------------------------------------ the copy
def test_codes_scales_and_bounds_equal_an_independent_quantisation():
    rng = np.random.default_rng(0)
    X = np.concatenate([
        rng.normal(size=(6, 9)).astype(np.float32),
        np.float32([[0.5, -0.25, 1.0, 0, 0, 0, 0, 0, 0], [0] * 9, [1e-30] + [0] * 8, [3e30, -1e30] + [0] * 7]),
        (rng.normal(size=(2, 9)) * 2.0**-140).astype(np.float32),  # subnormals: the scale underflows
    ]).astype(np.float32)
    codes, meta = int8_scan_copy(X)
    for r, x in enumerate(X):
        xs = [Fraction(float(v)) for v in x]
        s = np.float32(float(max(abs(v) for v in xs) / 127))  # numpy rounds a float64 once to float32
        assert meta[r, 0] == s
        want = []
        for v in xs:
            t = v / Fraction(float(s)) if s != 0 else Fraction(0)
            fl = math.floor(t)
            c = fl + 1 if (t - fl > Fraction(1, 2) or (t - fl == Fraction(1, 2) and fl % 2)) else fl
            want.append(max(-127, min(127, c)))
        assert codes[r].tolist() == want, r
        res2 = sum((v - Fraction(float(s)) * c) ** 2 for v, c in zip(xs, want))
        nrm2 = sum(v * v for v in xs)
        for col, exact2 in ((1, res2), (2, nrm2)):
            b = Fraction(float(meta[r, col]))
            assert b * b >= exact2, (r, col)  # an upper bound ...
            assert float(b) <= math.sqrt(float(exact2)) * (1 + 2.0**-20) + 2.0**-149, (r, col)  # ... and a tight one


def test_copy_refuses_non_finite_rows():
    with pytest.raises(ValueError, match="NaN or Inf"):
        int8_scan_copy(np.float32([[1.0, np.inf]]))


# ------------------------------------------------------------------ adversarial banks
def _at_bound_rows(rng, q: np.ndarray, n: int, scale: float) -> np.ndarray:
    """Rows s c + alpha q (c int codes, |c| <= 120, coordinate 0 at 127 where q is 0), the
    residual alpha q parallel to the query (|alpha q_i| < s / 2 keeps the codes): the int8
    error of q.x is ||q|| ||r||, the Cauchy-Schwarz bound itself. Half the rows share one
    code vector (their int8 scores tie), the other half move one code up by k while the
    residual takes the score down, so the int8 order is the exact order reversed."""
    d = q.shape[0]
    s = 2.0**-7 * scale  # a power of two: 127 s and s c are exact
    amax = 0.49 * s / float(np.abs(q).max())
    base = rng.integers(-40, 41, size=d)
    base[0] = 127
    p = 1 + int(np.argmax(np.abs(q[1:])))
    rows = []
    for j in range(n):
        c = base.astype(np.float64).copy()
        if j % 2 == 0:  # shared codes, residual anywhere in [-amax, amax] along q
            alpha = amax * (2 * rng.random() - 1)
        else:  # one code up (in the direction of q_p), the residual cancels it and a bit more
            kk = j % 7
            c[p] += kk * np.sign(q[p])
            alpha = -min(amax, (kk * s * abs(q[p]) + j * 1e-7 * s) / float(q @ q))
        rows.append(s * c + alpha * q.astype(np.float64))
    return np.asarray(rows, dtype=np.float32)


def _bank(seed: int, d: int, scale: float = 1.0):
    """(X, offsets, Q, qseg): segment 0 at the bound for Q[0] (and near-duplicates), segment
    1 random rows with duplicates, segment 2 empty; queries with q_0 = 0."""
    rng = np.random.default_rng(seed)
    Q = rng.normal(size=(5, d)).astype(np.float32) * np.float32(scale)
    if d >= 3:
        Q[:, 0] = 0
    if d >= 3:
        seg0 = _at_bound_rows(rng, Q[0].astype(np.float64) / scale, 200, scale)
    else:
        seg0 = (rng.normal(size=(200, d)) * scale).astype(np.float32)
    dup = seg0[rng.integers(0, seg0.shape[0], size=20)].copy()
    for row in dup[::2]:  # 1-ulp neighbours
        j = int(rng.integers(0, d))
        row[j] = np.nextafter(row[j], np.float32(np.inf))
    seg1 = (rng.normal(size=(60, d)) * scale).astype(np.float32)
    seg1 = np.concatenate([seg1, seg1[:8], seg1[:4] * np.float32(1 + 2.0**-23)])
    X = np.concatenate([seg0, dup, seg1]).astype(np.float32)
    off = np.array([0, seg0.shape[0] + dup.shape[0], X.shape[0], X.shape[0]], dtype=np.int64)
    Q = np.concatenate([Q, X[[3, 140, 170]] + np.float32(1e-3 * scale)]).astype(np.float32)
    qseg = np.array([0, 0, 1, 0, 1, 0, 0, 1], dtype=np.int64)
    return X, off, Q, qseg


@pytest.mark.parametrize("scale", [1.0, 2.0**40, 2.0**-40])
def test_bounds_bracket_the_exact_score_and_sit_at_it(level, scale):
    """lower <= RN32(q.x) <= upper for every pair; on the rows built at the bound the true
    int8 error reaches ~the bound's own residual term, and the width of every bracket
    stays within 2 (||q|| rho + small terms)."""
    d = 48
    X, off, Q, _ = _bank(3, d, scale)
    codes, meta = int8_scan_copy(X)
    lo, up = _native.int8_bounds(codes, meta, Q, _xnorm(meta))
    at_bound = 0
    for i in range(Q.shape[0]):
        qn = float(np.linalg.norm(Q[i].astype(np.float64)))
        for r in range(X.shape[0]):
            e = float(exact_f32(Q[i], X[r]))
            assert lo[i, r] <= e <= up[i, r], (i, r, lo[i, r], e, up[i, r])
            width = float(up[i, r]) - float(lo[i, r])
            assert width <= 2 * qn * float(meta[r, 1]) * 1.01 + 2e-4 * qn * float(meta[r, 2]), (i, r)
            # the int8 score's midpoint against the exact score: how much of the bound is used
            err = abs((float(up[i, r]) + float(lo[i, r])) / 2 - e)
            at_bound += r < 200 and i == 0 and err >= 0.9 * qn * float(meta[r, 1])
    assert at_bound >= 40  # the constructed rows do sit at the bound (their residual is along q)


def _extreme_bank(seed: int, d: int):
    """(X [173, d], Q [70, d]): Gaussian rows and queries, rows of +-1 (codes +-127) equal
    to or opposite the sign pattern of +-1 queries (int16 codes +-QMAX: |I| = 127 QMAX d,
    near 2^31 - 1 for d > 516), rows with one large coordinate (the rest coded 0), a zero
    row, rows of 2^-60 and 2^60, queries with one coordinate and near copies of rows. 173 =
    14 x 12 + 5 rows and 70 = 2 x 32 + 6 queries: partial micro-tiles and panels."""
    rng = np.random.default_rng(seed)
    signs = np.where(rng.random(size=(4, d)) < 0.5, -1.0, 1.0)
    X = rng.normal(size=(173, d))
    X[:4], X[4:8] = signs, -signs
    X[8:12] = signs * (1 + rng.integers(0, 2, size=(4, d)))  # +-1 and +-2: codes +-64 and +-127
    X[12] = 0
    X[13, :] = 1e-3
    X[13, 0] = 1.0
    X[14] *= 2.0**-60
    X[15] *= 2.0**60 / np.sqrt(d)
    Q = rng.normal(size=(70, d))
    Q[:4], Q[4] = signs, -signs[0]
    Q[5] = 0
    Q[5, d // 2] = 3.0
    Q[6:12] = X[rng.integers(16, 173, size=6)] + 0.01 * rng.normal(size=(6, d))
    return X.astype(np.float32), Q.astype(np.float32)


def _assert_brackets(X, Q, lo, up, d: int) -> None:
    """The oracle's RN32(q.x) inside [lo, up] for the extreme bank's first rows and
    queries and 60 pairs drawn with seed d."""
    rng = np.random.default_rng(d)
    pairs = [(i, r) for i in range(6) for r in range(16)]
    pairs += [(int(i), int(r)) for i, r in zip(rng.integers(0, 70, 60), rng.integers(0, 173, 60))]
    for i, r in pairs:
        e = exact_f32(Q[i], X[r])
        assert lo[i, r] <= e <= up[i, r], (d, i, r, lo[i, r], e, up[i, r])


@pytest.mark.parametrize("d", (1, 2, 15, 16, 17, 31, 32, 33, 63, 65, 385, 600))
def test_keys_are_the_same_bits_at_every_level_and_int8_kernel(d):
    """int8_bounds on the scan path (i8_dots) and the GEMM path (i8_gemm_panel's keys) at
    every level and int8 kernel: the same bits as the baseline's plain C++ (exact int32
    dots), and the oracle's RN32(q.x) inside every sampled bracket, the extreme pairs
    included."""
    X, Q = _extreme_bank(40 + d, d)
    codes, meta = int8_scan_copy(X)
    assert np.abs(codes[:4]).min() == 127
    qmax = min(32767, (2**31 - 1) // (127 * d))
    if d == 600:
        assert 127 * qmax * d > 2**31 - 2**22  # the +-1 pairs' |I| is within 0.2 % of the int32 range
    xn = _xnorm(meta)
    ref = None
    try:
        for cap, int8_cap, name in KERNELS:
            _use(cap, int8_cap, name)
            for path in ("scan", "gemm"):
                lo, up = _native.int8_bounds(codes, meta, Q, xn, path=path)
                got = (lo.view(np.uint32), up.view(np.uint32))
                if ref is None:
                    ref = got
                    want = (lo, up)
                np.testing.assert_array_equal(got[0], ref[0], err_msg=f"lower, {name} {path}")
                np.testing.assert_array_equal(got[1], ref[1], err_msg=f"upper, {name} {path}")
    finally:
        _native.set_simd_cap(-1)
    lo, up = want
    _assert_brackets(X, Q, lo, up, d)
    assert up[0, 0] > 0.999 * float(Q[0] @ X[0]) and lo[0, 4] < -0.999 * float(Q[0] @ X[0])  # I at +-127 QMAX d


@pytest.mark.parametrize("d", (4, 36, 64, 384, 388, 600, 33))
def test_byte_query_keys_are_the_same_bits_at_every_kernel(d):
    """The GEMM units' byte queries (|code| <= 127; avx512_vnni's vpdpbusd kernel, the row's
    code sum subtracted from the sum of (q + 128) x): int8_bounds "gemm-bytes" equals the
    plain int32 dots of the same codes ("bytes", i8_dots) bit for bit at every level and
    int8 kernel, on the extreme bank (codes +-127 against byte codes +-127, partial panels
    and micro-tiles), and the oracle's RN32(q.x) lies inside every sampled bracket; the
    brackets are wider than the int16 queries' (the query's rounding joins the bound).
    d = 33: not a multiple of 4, no byte kernel (the int16 GEMM keys)."""
    X, Q = _extreme_bank(70 + d, d)
    codes, meta = int8_scan_copy(X)
    xn = _xnorm(meta)
    ref = None
    try:
        for cap, int8_cap, name in KERNELS:
            _use(cap, int8_cap, name)
            assert _native.int8_byte_queries(d) == (name == "avx512_vnni" and d % 4 == 0)
            for path in ("bytes", "gemm-bytes"):
                lo, up = _native.int8_bounds(codes, meta, Q, xn, path=path)
                if ref is None:
                    ref, want = (lo.view(np.uint32), up.view(np.uint32)), (lo, up)
                np.testing.assert_array_equal(lo.view(np.uint32), ref[0], err_msg=f"lower, {name} {path}")
                np.testing.assert_array_equal(up.view(np.uint32), ref[1], err_msg=f"upper, {name} {path}")
    finally:
        _native.set_simd_cap(-1)
    lo, up = want
    _assert_brackets(X, Q, lo, up, d)
    lo16, up16 = _native.int8_bounds(codes, meta, Q, xn, path="scan")
    assert float(np.median(up - lo)) > 1.5 * float(np.median(up16 - lo16))  # byte codes: a coarser query


@functools.lru_cache(maxsize=1)
def _byte_bank():
    """(X, off, Q, qseg, oracle rows, oracle scores) of the byte-query top-k test (its
    oracle computed once for every kernel and thread count)."""
    rng = np.random.default_rng(31)
    d = 64
    q0 = rng.normal(size=d).astype(np.float32)
    q0[0] = 0
    X = np.concatenate([
        _at_bound_rows(rng, q0, 100, 1.0),
        rng.normal(size=(2200, d)) * 0.05,
        np.repeat(rng.normal(size=(1, d)) * 0.05, 300, axis=0) + rng.normal(size=(300, d)) * 1e-6,
    ]).astype(np.float32)
    X[500:520] = X[500]
    off = np.array([0, X.shape[0]], dtype=np.int64)
    Q = np.concatenate([q0[None], X[rng.integers(0, X.shape[0], 59)] + 0.02 * rng.normal(size=(59, d)),
                        X[2300:2340] + 1e-4 * rng.normal(size=(40, d))]).astype(np.float32)  # fmt: skip
    qseg = np.zeros(Q.shape[0], dtype=np.int64)
    return (X, off, Q, qseg) + tuple(oracle_topk(X, off, Q, qseg, 10))


@pytest.mark.parametrize("threads", (1, 2))
def test_byte_queries_give_the_int16_and_oracle_top_k(level, threads):
    """A segment of 2,600 rows scored by units of 100 queries on the GEMM path, byte queries
    on (from 0 rows: by default they start at INT8_BYTE_MIN_ROWS) and off: ids and scores equal the oracle's either way, at every kernel and with the
    segment's rows split over two threads (partial lists merged, then re-keyed): 100 rows
    at the bound for the first query (int8 order = exact order reversed; they fit the kept
    list, so its top 10 comes from the re-keyed candidates), 300 rows sharing
    one code vector (the byte keys tie: the kept list overflows and the segment is
    rescanned with the int16 query), exact duplicates, and queries near rows."""
    X, off, Q, qseg, want_r, want_s = _byte_bank()
    assert _native.int8_byte_min_rows() == _native.INT8_BYTE_MIN_ROWS > X.shape[0]  # (by default: int16 here)
    prev = _native.set_int8_byte_queries(True, 0)  # byte queries from 0 rows: this segment takes them
    try:
        for on in (True, False):
            _native.set_int8_byte_queries(on, 0)
            s, r = _topk(X, off, Q, qseg, 10, "gemm", threads)
            np.testing.assert_array_equal(r, want_r, err_msg=f"bytes {on}")
            np.testing.assert_array_equal(s, want_s, err_msg=f"bytes {on}")
    finally:
        _native.set_int8_byte_queries(prev)
    assert _native.int8_byte_min_rows() == _native.INT8_BYTE_MIN_ROWS


def test_byte_and_int16_gemm_units_in_one_call(level):
    """One call whose GEMM units are of both kinds: two long segments on byte queries and a
    short one on int16 queries (INT8_BYTE_MIN_ROWS set between them), on one and two
    threads, with and without the hits' keys: the per-thread scratch holds either kind of
    unit (sized for the byte units only, an int16 unit once wrote past it and corrupted
    the heap), and the result is the float32 rows' top-k."""
    rng = np.random.default_rng(17)
    d = 64
    X = rng.normal(size=(3000 + 700 + 3000, d)).astype(np.float32)
    off = np.array([0, 3000, 3700, 6700], dtype=np.int64)
    qseg = np.repeat(np.arange(3), 40).astype(np.int64)
    Q = (X[off[qseg] + rng.integers(0, 700, 120)] + 0.3 * rng.normal(size=(120, d))).astype(np.float32)
    hp = np.arange(0, 121 * 5, 5, dtype=np.int64)  # 5 hits a query: rows 0, 100, .., 400 of its segment
    hr = np.tile(np.arange(0, 500, 100, dtype=np.int32), 120)
    prev = _native.set_int8_byte_queries(True, 2000)
    try:
        for threads in (1, 2):
            want = _native.segmented_topk(X, off, Q, qseg, 10, threads)
            for _ in range(3):
                got = _topk(X, off, Q, qseg, 10, "gemm", threads)
                np.testing.assert_array_equal(got[1], want[1])
                np.testing.assert_array_equal(got[0], want[0])
            codes, meta = int8_scan_copy(X)
            out = _native.probe(X, off, Q, qseg, 10, 5, 0.1, "mean", threads, _xnorm(meta), path="gemm",
                                hit_ptr=hp, hit_rows=hr, scan=codes, scan_meta=meta, scan_type="int8")  # fmt: skip
            np.testing.assert_array_equal(out[1], want[1])
            exact = np.array([[exact_f32(Q[i], X[off[qseg[i]] + r]) for r in hr[hp[i] : hp[i + 1]]]
                              for i in range(120)], dtype=np.float32)  # fmt: skip
            rec = np.isfinite(out[6])  # the queries whose pass recorded keys (every one but at level 0)
            assert rec.all() == (level > 0)
            keys = out[5].reshape(120, 5).astype(np.float64) + out[6][:, None]
            assert (keys[rec] >= exact[rec]).all()  # the keys bound the hits' exact scores
    finally:
        _native.set_int8_byte_queries(prev)


def test_int8_bounds_path_is_checked():
    X, Q = _extreme_bank(1, 8)
    codes, meta = int8_scan_copy(X)
    with pytest.raises(ValueError, match="path must be 'scan', 'gemm', 'bytes' or 'gemm-bytes'"):
        _native.int8_bounds(codes, meta, Q, _xnorm(meta), path="fast")


@pytest.mark.parametrize("d", DIMS)
def test_topk_equals_oracle_every_level_and_path(level, d):
    X, off, Q, qseg = _bank(10 + d, d)
    want_r, want_s = oracle_topk(X, off, Q, qseg, 12)
    for path in ("scan", "gemm"):
        for k in (1, 5, 12):
            s, r = _topk(X, off, Q, qseg, k, path)
            np.testing.assert_array_equal(r, want_r[:, :k], err_msg=f"level {level} d {d} {path} k {k}")
            np.testing.assert_array_equal(s, want_s[:, :k], err_msg=f"level {level} d {d} {path} k {k}")


@pytest.mark.parametrize("scale", [2.0**40, 2.0**-40])
def test_topk_with_large_and_tiny_norms(level, scale):
    X, off, Q, qseg = _bank(21, 33, scale)
    want_r, want_s = oracle_topk(X, off, Q, qseg, 9)
    for path in ("scan", "gemm"):
        s, r = _topk(X, off, Q, qseg, 9, path)
        np.testing.assert_array_equal(r, want_r)
        np.testing.assert_array_equal(s, want_s)


def test_shared_and_multi_tenant_batches_and_threads(level):
    """Many queries of one long segment (auto takes the GEMM path at levels >= 1: an int8
    unit of up to ~320 queries at d = 384), many users at once, and one query whose segment is split
    over threads (partial lists merged, then the exact finish): the float32 bank's result."""
    rng = np.random.default_rng(5)
    d = 64
    X = rng.normal(size=(3000, d)).astype(np.float32)
    X[1000:1100] = X[1000]  # a block of exact duplicates (scan ties across parts)
    off = np.array([0, 2048, 2048, 2600, 3000], dtype=np.int64)
    Q = np.concatenate([X[rng.integers(0, 3000, size=60)] + 0.1 * rng.normal(size=(60, d)),
                        rng.normal(size=(40, d))]).astype(np.float32)  # fmt: skip
    qseg = np.where(np.arange(100) < 70, 0, rng.choice([1, 2, 3], size=100)).astype(np.int64)
    for threads in (1, 4):
        want = _native.segmented_topk(X, off, Q, qseg, 10, threads)
        got = _topk(X, off, Q, qseg, 10, "auto", threads)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])
    one = _topk(X, off, Q[:1], qseg[:1], 10, "scan", 4)  # parts > 1 for one query
    np.testing.assert_array_equal(one[1], _native.segmented_topk(X, off, Q[:1], qseg[:1], 10, 1)[1])


def test_probe_keys_are_the_upper_bounds_and_feed_the_pruned_rounds(level):
    """The probe over the int8 copy keeps every row's key (its upper bound of RN32(q.x),
    the same bits as ``int8_bounds``) for the queries on the scan path, and the beam
    driver prunes its rounds with them (over the float32 rows): rows, bitwise scores and
    rounds equal the Python driver's on the float32 bank, for clustered rows, exact and
    1-ulp duplicates and a coarse grid; the pruning is real (far fewer rows scored than
    full scans)."""
    import torch
    from _shared import clustered_rows

    from rfmem_fast.backends.native import NativeBackend, _draws_by_clusters
    from rfmem_fast.recollection import recollect as python_driver
    from rfmem_fast.recollection import recollection_capacity

    rng = np.random.default_rng(21)
    d, n = 48, 2048
    cfg = RFMemConfig()
    for kind in ("gauss", "dup", "near", "grid"):
        X = clustered_rows(rng, n, d, kind)
        bank, b8 = MemoryBank(d), MemoryBank(d, dtype="int8")
        for bk in (bank, b8):
            bk.add("u", X, list(range(n)))
        X = bank.snapshot().vectors  # the bank's rows (unit norm)
        off = np.array([0, n], np.int64)
        codes, meta = int8_scan_copy(X)
        Q = np.concatenate([X[rng.integers(0, n, 3)], rng.standard_normal((2, d)).astype(np.float32)])
        Q = (Q / np.linalg.norm(Q.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
        qseg = np.zeros(len(Q), np.int64)
        xn = _xnorm(meta)
        out = _native.probe(X, off, Q, qseg, 10, 10, 20.0, "mean", 1, xn, keep_scan_scores=True, scan=codes,
                            scan_meta=meta, scan_type="int8", path="scan")  # fmt: skip
        kept, written = out[5], out[6]
        assert written.all(), kind
        _, up = _native.int8_bounds(codes, meta, Q, xn, "scan")
        assert kept.tobytes() == up.tobytes(), kind  # the keys, bit for bit
        exact = np.array([[exact_f32(q, x) for x in X[:64]] for q in Q], np.float32)
        assert (kept[:, :64] >= exact).all(), kind
        draws = _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width)
        width = recollection_capacity(cfg) + 1
        st = np.zeros(len(_native.recollect_stat_names))
        rows, scores, rounds = _native.recollect(
            X, off, Q, qseg, out[0], out[1], cfg.beam_width, cfg.fanout, cfg.max_rounds, cfg.out_k, cfg.alpha,
            cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters, cfg.kmeans_tol, draws, width, 1, xn, 256 << 20,
            stats=st, scan=codes, scan_meta=meta, scan_type="int8", ref_scores=kept, ref_ok=written,
        )[:3]  # fmt: skip
        py = NativeBackend(beam_driver="python")
        ref = python_driver(py, py.view(bank), torch.from_numpy(Q), torch.from_numpy(qseg), cfg,
                            level0=(torch.from_numpy(out[0]), torch.from_numpy(out[1])))  # fmt: skip
        np.testing.assert_array_equal(rows, ref.hit_rows.numpy(), err_msg=kind)
        np.testing.assert_array_equal(rounds, ref.rounds.numpy(), err_msg=kind)
        np.testing.assert_array_equal(scores[:, : cfg.out_k].view(np.uint32), ref.scores.numpy().view(np.uint32))
        s = dict(zip(_native.recollect_stat_names, st))
        if level >= 1:  # level 0: no float32 SIMD kernels, no pruning
            # a query's round holds <= B branches: full scans would score >= n * scan_queries / B rows
            assert s["scan_queries"] > 0, kind
            assert 0 < s["scan_rows"] < 0.5 * n * s["scan_queries"] / cfg.beam_width, (kind, s)
        # the same through search: the int8 bank's probe feeds its driver
        got = search(b8, Q, ["u"] * len(Q), cfg, mode="recollection", backend="native")
        want = search(bank, Q, ["u"] * len(Q), cfg, mode="recollection", backend="native")
        np.testing.assert_array_equal(got.rows, want.rows, err_msg=kind)
        np.testing.assert_array_equal(got.scores.view(np.uint32), want.scores.view(np.uint32), err_msg=kind)
        np.testing.assert_array_equal(got.dense_scores, want.dense_scores, err_msg=kind)


@pytest.mark.parametrize("d", (31, 32))
def test_filters_lists_and_masks(level, d):
    """Row selections of the kernel (list mode: only the listed rows scored; mask mode: a
    GEMM batch over the segment with a mask on its heaps): the exact top-k of the selected
    rows, as the oracle over a bank of only them. d = 32: the GEMM units on byte queries
    (forced from 0 rows) where the kernel has them, their re-keyed finish under a mask."""
    prev = _native.set_int8_byte_queries(True, 0)
    try:
        _filters_case(d)
    finally:
        _native.set_int8_byte_queries(prev)


def _filters_case(d: int) -> None:
    X, off, Q, qseg = _bank(7, d)
    rng = np.random.default_rng(8)
    a, e = int(off[0]), int(off[1])
    rows0 = np.sort(rng.choice(np.arange(a, e), size=100, replace=False)).astype(np.int64)  # > 1/4: a mask too
    rows1 = np.arange(int(off[1]), int(off[2]), 3, dtype=np.int64)
    mask = np.zeros(e - a, np.uint8)
    mask[rows0 - a] = 1
    tab = {"sel_seg": np.array([0, 1], np.int64), "sel_off": np.array([0, 100, 100 + rows1.size], np.int64),
           "sel_rows": np.concatenate([rows0, rows1]), "sel_mask": mask, "sel_mask_off": np.array([0, -1], np.int64)}
    qsel = np.where(qseg == 0, 0, 1).astype(np.int64)
    qsel[3] = -1
    for path in ("scan", "gemm"):
        s, r = _topk(X, off, Q, qseg, 8, path, qsel=qsel, **tab)
        for i in range(Q.shape[0]):
            rows = np.arange(int(off[qseg[i]]), int(off[qseg[i] + 1])) if qsel[i] < 0 else (rows0 if qsel[i] == 0 else rows1)
            wr, ws = oracle_topk(X[rows], np.array([0, rows.size]), Q[i : i + 1], np.zeros(1, np.int64), 8)
            np.testing.assert_array_equal(r[i], np.where(wr[0] >= 0, rows[np.maximum(wr[0], 0)], -1), err_msg=f"{path} {i}")
            np.testing.assert_array_equal(s[i], ws[0], err_msg=f"{path} {i}")


def test_small_segments_scan_the_float32_rows():
    """Below INT8_MIN_ROWS rows per queried segment (mean over the call's queries) a call
    scans the float32 rows, where the int8 copy does not pay: a copy that lies leaves the
    answer right there, and turns it around from the threshold on (the suite runs with the
    threshold at 0, tests/conftest.py)."""
    rng = np.random.default_rng(3)
    d, n = 16, 600
    X = rng.normal(size=(n, d)).astype(np.float32)
    codes, meta = int8_scan_copy(X)
    lying = meta.copy()
    lying[:, 1] = 0
    Q = X[:4] + np.float32(0.01)
    seg = np.zeros(4, np.int64)

    def top(off):
        want = _native.segmented_topk(X, off, Q, seg, 5)
        liar = _native.segmented_topk(X, off, Q, seg, 5, xnorm=_xnorm(meta), scan=-codes, scan_meta=lying,
                                      scan_type="int8")  # fmt: skip
        return np.array_equal(liar[1], want[1])

    assert _native.INT8_MIN_ROWS == 512
    assert _native.set_int8_min_rows(-1) == 512 == _native.int8_min_rows()
    try:
        assert top(np.array([0, 511], np.int64))  # 511 rows: the float32 rows, right
        assert not top(np.array([0, 512], np.int64))  # 512 rows: the (lying) int8 copy
        mixed = np.array([0, 100, 600], np.int64)  # mean of 100 and 500 rows: below 512
        want = _native.segmented_topk(X, mixed, Q, np.array([0, 1, 1, 1]), 5)
        liar = _native.segmented_topk(X, mixed, Q, np.array([0, 1, 1, 1]), 5, xnorm=_xnorm(meta), scan=-codes,
                                      scan_meta=lying, scan_type="int8")  # fmt: skip
        np.testing.assert_array_equal(liar[1], want[1])
        assert _native.set_int8_min_rows(100) == 100
        assert not top(np.array([0, 511], np.int64))
    finally:
        assert _native.set_int8_min_rows(0) == 0


def test_the_kernels_read_the_int8_copy():
    """A copy whose codes are negated but whose bounds claim to be tight (a broken caller
    contract) turns the answer around: the top-k reads the int8 rows, not X."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(400, 16)).astype(np.float32)
    off = np.array([0, 400], np.int64)
    Q = X[:4] + np.float32(0.01)
    codes, meta = int8_scan_copy(X)
    lying = meta.copy()
    lying[:, 1] = 0
    want = _native.segmented_topk(X, off, Q, np.zeros(4, np.int64), 5)
    honest = _native.segmented_topk(X, off, Q, np.zeros(4, np.int64), 5, xnorm=_xnorm(meta), scan=codes,
                                    scan_meta=meta, scan_type="int8")  # fmt: skip
    liar = _native.segmented_topk(X, off, Q, np.zeros(4, np.int64), 5, xnorm=_xnorm(meta), scan=-codes,
                                  scan_meta=lying, scan_type="int8")  # fmt: skip
    np.testing.assert_array_equal(honest[1], want[1])
    assert not np.array_equal(liar[1], want[1])


def test_queries_the_int8_scan_cannot_bound_scan_the_float32_rows():
    """A query of norm ~1e30 against rows of norm ~1e30 (||q|| xnorm >= 2^100): the call
    scans X instead (same result as float32); int8_bounds says why."""
    rng = np.random.default_rng(4)
    X = (rng.normal(size=(50, 8)) * 1e30).astype(np.float32) / np.float32(1e15)
    Q = (rng.normal(size=(2, 8)) * 1e20).astype(np.float32)
    codes, meta = int8_scan_copy(X)
    with pytest.raises(ValueError, match="cannot bound"):
        _native.int8_bounds(codes, meta, Q, _xnorm(meta))
    off = np.array([0, 50], np.int64)
    np.testing.assert_array_equal(_topk(X, off, Q, np.zeros(2, np.int64), 5)[1],
                                  _native.segmented_topk(X, off, Q, np.zeros(2, np.int64), 5)[1])  # fmt: skip


# ------------------------------------------------------------------ banks
def test_writes_and_compact_keep_the_copy_of_the_live_rows():
    rng = np.random.default_rng(9)
    banks = [MemoryBank(40), MemoryBank(40, dtype="int8")]
    for b in banks:
        r = np.random.default_rng(1)
        b.add("a", r.normal(size=(400, 40)), ids=list(range(400)), metadata=[{"t": i % 3} for i in range(400)])
        b.add("b", r.normal(size=(50, 40)), ids=list(range(50)))
        b.delete("a", list(range(0, 400, 3)))
        b.update("a", [1, 2, 4], r.normal(size=(3, 40)))
        b.update("b", [5], r.normal(size=(1, 40)))
        b.add("a", r.normal(size=(30, 40)), ids=list(range(1000, 1030)), metadata=[{"t": 1}] * 30)
    snap = banks[1].snapshot()
    codes, meta = int8_scan_copy(snap.vectors)
    assert np.array_equal(snap.scan, codes) and snap.scan_meta.tobytes() == meta.tobytes()
    users = ["a"] * 10 + ["b"] * 3
    Q = rng.normal(size=(13, 40))
    for step in ("writes", "compact"):
        if step == "compact":
            for b in banks:
                b.compact()
            assert banks[1].snapshot().scan.tobytes() == int8_scan_copy(banks[1].snapshot().vectors)[0].tobytes()
        for mode, flt in (("dense", None), ("rfmem", None), ("dense", {"t": 1})):
            kw = {} if flt is None else {"filters": flt}
            want = search(banks[0], Q, users, RFMemConfig(), mode=mode, backend="native", **kw)
            got = search(banks[1], Q, users, RFMemConfig(), mode=mode, backend="native", **kw)
            assert [got.ids_list(i) for i in range(13)] == [want.ids_list(i) for i in range(13)], (step, mode, flt)
            np.testing.assert_array_equal(got.scores, want.scores)


def test_bench_int8_script_tiny(tmp_path):
    """bench/bench_int8.py at tiny sizes writes every figure (so the script cannot rot): the
    int8 copy equals float32 on each bank, and where byte queries apply the int16-query
    system runs beside it with the byte keys' statistics."""
    import json

    from _shared import load_bench_script

    mod = load_bench_script("bench_int8")
    out = tmp_path / "i8.json"
    args = ["--shared-rows", "3000", "--users", "2", "--per-user", "600", "--batch", "64", "--queries", "2",
            "--repeats", "1", "--sample", "4", "--out", str(out)]  # fmt: skip
    assert mod.main(args) == 0
    doc = json.loads(out.read_text())
    for bank in ("shared_3000", "tenants"):
        r = doc["results"][bank]
        assert r["int8_equals_float32"], bank
        assert r["batch_64"]["native_int8"]["qps"] > 0 and r["int8"]["rescored_rows_per_query"] >= 10
        if doc["int8_byte_queries"]:
            assert r["batch_64"]["native_int8_int16q"]["qps"] > 0
            assert r["int8"]["byte_keys_reaching_L_per_query"] >= r["int8"]["rescored_rows_per_query"]
    assert mod.byte_margin(4096) == 128 and mod.byte_margin(100_000) == 256 and mod.byte_margin(10**6) == 512
    if doc["int8_byte_queries"]:  # the sweep behind INT8_BYTE_MIN_ROWS
        cross = tmp_path / "cross.json"
        assert mod.main(["--byte-crossover", "600", "--batch", "64", "--repeats", "1", "--out", str(cross)]) == 0
        (row,) = json.loads(cross.read_text())["results"]["byte_crossover"]
        assert row["rows_per_segment"] == 600 and row["qps_byte_queries"] > 0 and row["byte_over_int16"] > 0
        assert _native.int8_byte_min_rows() == _native.INT8_BYTE_MIN_ROWS  # restored
