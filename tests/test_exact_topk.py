"""Exact top-k under near-ties, on every CPU backend.

The score is RN32(q . x), the exact inner product rounded once to float32, and the
top-k is ordered by (score desc, row asc); the oracle (tests/_exact_oracle.py) computes
it independently (math.fsum, Fraction at float32 midpoints). Pinned here: three reported
near-tie cases verbatim, property tests on banks of exact and 1-ulp near duplicates
(d from 1 to 512) for the reference, torch (both strategies) and native backends (ids
and scores equal the oracle for every k, prefix consistency, identical alone and in
batches of 1..256), the exact rounding of scores whose float64 sum is too close to a
float32 midpoint to decide, and the scan error bound against torch's float32 matmul.
The triton backend runs the same property test in tests/test_triton.py (interpreter).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _exact_oracle import check_backend, exact_f32, near_duplicate_bank, oracle_topk, perturb, unit
from hypothesis import given, settings
from hypothesis import strategies as st

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available, get_backend
from rfmem_fast.backends import exact
from rfmem_fast.backends.base import BankView
from rfmem_fast.backends.reference import ReferenceBackend
from rfmem_fast.backends.torch_backend import TorchBackend
from rfmem_fast.bank import BankSnapshot

NATIVE = "native" in available()


def _cpu_backends():
    out = [ReferenceBackend(), TorchBackend("cpu"), TorchBackend("cpu", topk_strategy="gather")]
    if NATIVE:
        out.append(get_backend("native"))
    return out


def _near_tie_bank(v: list[float], j: int, up: bool) -> tuple[MemoryBank, np.ndarray]:
    """14 rows: row 0 is v with v[j] moved one float32 ulp, rows 1..13 are v."""
    v32 = np.array(v, dtype=np.float32)
    v0 = v32.copy()
    v0[j] = np.nextafter(v0[j], np.float32(np.inf if up else -np.inf))
    bank = MemoryBank(8)
    bank.add("u", np.stack([v0] + [v32] * 13), ids=list(range(14)))
    return bank, v32


V1 = [0.3455841839313507, 0.8216181397438049, 0.3304370641708374, -1.3031572103500366,
      0.9053558707237244, 0.4463745653629303, -0.5369532108306885, 0.581118106842041]
V2 = [0.18905338644981384, -0.5227484703063965, -0.41306355595588684, -2.44146728515625,
      1.7997074127197266, 1.1441658735275269, -0.32542282342910767, 0.7738065719604492]


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
def test_near_tie_top1_is_the_same_alone_and_in_batches(backend):
    """A 1-ulp near tie: top-1 of v is id 0 alone and in batches of 2 and 8."""
    if backend not in available():
        pytest.skip(f"{backend} not built")
    bank, v = _near_tie_bank(V1, 5, up=True)
    cfg = RFMemConfig(out_k=1, probe_k=1)
    for n in (1, 2, 8):
        res = search(bank, np.stack([v] * n), ["u"] * n, cfg, mode="dense", backend=backend)
        assert [row[0] for row in res.ids] == [0] * n, (backend, n)


@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
def test_near_tie_top1_is_the_prefix_of_top14(backend):
    """A 1-ulp near tie: top-1 is [0] and top-14 starts [0, 1, 2, ...]."""
    if backend not in available():
        pytest.skip(f"{backend} not built")
    bank, v = _near_tie_bank(V2, 4, up=False)
    top1 = search(bank, v[None], ["u"], RFMemConfig(out_k=1, probe_k=1), mode="dense", backend=backend)
    top14 = search(bank, v[None], ["u"], RFMemConfig(out_k=14, probe_k=14), mode="dense", backend=backend)
    assert top1.ids_list(0) == [0]
    assert top14.ids_list(0) == list(range(14))


def test_80_near_duplicates_d384_exact_top10():
    """~80 near duplicates at d = 384 whose exact scores differ by
    ~1e-8; the exact top-10 (an item higher by ~1e-8 is never dropped for a lower one)."""
    rng = np.random.default_rng(8)
    u = unit(rng.normal(size=384))
    # every coordinate moved by -8..8 float32 ulps: exact scores spread over ~1e-8
    steps = rng.integers(-8, 9, size=(80, 384))
    ulp = np.spacing(np.abs(u)).astype(np.float32)
    rows = (u[None, :] + steps.astype(np.float32) * ulp[None, :]).astype(np.float32)
    bank = MemoryBank(384)
    bank.add("u", rows, ids=list(range(80)))
    snap = bank.snapshot()
    q = unit(u + np.float32(0.3) * unit(rng.normal(size=384)))[None]
    want_r, want_s = oracle_topk(snap.vectors, snap.offsets, q, np.zeros(1, np.int64), 10)
    ex = np.array([exact_f32(q[0], x) for x in snap.vectors])
    assert len(np.unique(ex)) >= 3, "the bank must hold distinct exact scores"
    assert np.ptp(ex) < 1e-6
    for be in _cpu_backends():
        res = search(bank, q, ["u"], RFMemConfig(out_k=10, probe_k=10), mode="dense", backend=be)
        assert res.rows[0].tolist() == want_r[0].tolist(), be.name
        np.testing.assert_array_equal(res.scores[0], want_s[0])


@settings(max_examples=14)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.one_of(st.sampled_from([1, 2, 3, 8, 16, 17, 384, 512]), st.integers(1, 512)),
    n=st.integers(2, 90),
)
def test_near_duplicates_exact_prefix_batch_invariant(seed, d, n):
    """Banks of exact and 1-ulp near duplicates: every CPU backend returns the oracle's
    ids and scores for every k, prefixes agree, and a query's result is the same alone
    and in batches of 1, 2, 8 and 256."""
    bank, Q, qseg = near_duplicate_bank(seed, d, n)
    ks = sorted({1, 3, min(10, n), n + 2})
    for be in _cpu_backends():
        check_backend(be, bank, Q, qseg, ks, seed)


def _raw_view(X: np.ndarray) -> BankView:
    """A one-user view of raw (not normalised) rows."""
    off = np.array([0, X.shape[0]], dtype=np.int64)
    snap = BankSnapshot(X, off, np.arange(X.shape[0], dtype=object), 0)
    t = torch.from_numpy(off)
    return BankView(torch.from_numpy(X), t, t, snap)


def test_exact_rounding_where_float64_cannot_decide():
    """1 + 2^-24 + 2^-60 lies just above a float32 midpoint: its float64 sum is the midpoint
    (which rounds to even, 1.0); the exact score is 1 + 2^-23. An exact midpoint rounds to
    even. Rows are ranked by these exact scores on every backend."""
    t24, t60 = np.float32(2.0**-24), np.float32(2.0**-60)
    X = np.array([[1, 0, 0], [1, t24, 0], [1, t24, t60], [1, t24, -t60]], dtype=np.float32)
    q = np.ones((1, 3), dtype=np.float32)
    want = [exact_f32(q[0], x) for x in X]
    assert want == [np.float32(1), np.float32(1), np.nextafter(np.float32(1), np.float32(2)), np.float32(1)]
    assert np.float32(X[2].astype(np.float64).sum()) == np.float32(1)  # rounding twice is wrong here
    r = torch.arange(4)
    got = exact.exact_pair_scores(torch.from_numpy(X), torch.from_numpy(q), torch.zeros_like(r), r, 1 << 20)
    assert got.tolist() == [float(w) for w in want]
    assert exact.round32_exact(q[0], X[2]) == want[2]
    for be in [TorchBackend("cpu"), ReferenceBackend()] + ([get_backend("native")] if NATIVE else []):
        s, rows = be.segmented_topk(_raw_view(X), torch.from_numpy(q), torch.zeros(1, dtype=torch.int64), 4)
        assert rows[0].tolist() == [2, 0, 1, 3], be.name
        assert s[0].tolist() == [float(want[2]), 1.0, 1.0, 1.0], be.name
    if NATIVE:
        from rfmem_fast import _native

        s, rows = _native.segmented_topk(X, np.array([0, 4]), q, np.zeros(1, np.int64), 4)
        assert rows[0].tolist() == [2, 0, 1, 3]


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31 - 1), d=st.integers(1, 512))
def test_scan_bound_holds_for_torch_matmul(seed, d):
    """|f - RN32(q.x)| <= B(q) for torch's float32 matmul, on random and cancelling data."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(40, d)).astype(np.float32)
    X[:20] *= rng.choice([1e-3, 1.0, 1e3], size=(20, d)).astype(np.float32)  # wide dynamic range
    X /= np.linalg.norm(X.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
    Q = X[rng.integers(0, 40, size=5)] + np.float32(1e-3) * rng.normal(size=(5, d)).astype(np.float32)
    f = (torch.from_numpy(Q) @ torch.from_numpy(X).T).numpy()
    R = exact.row_norm_max(X)
    B = exact.query_bounds(torch.from_numpy(Q), TorchBackend("cpu").scan_coef(d), R).numpy()
    for i in range(5):
        e = np.array([exact_f32(Q[i], x) for x in X], dtype=np.float64)
        assert np.all(np.abs(f[i].astype(np.float64) - e) <= B[i])
    assert R >= np.linalg.norm(X.astype(np.float64), axis=1).max()


def test_bound_coefficients():
    """The documented figures: for d = 384 and unit vectors, B ~ 2.3e-5 (BLAS),
    1.7e-6 (native lanes) and 1.2e-7 (float64 accumulation)."""
    assert exact.scan_error_coef(384) == pytest.approx(384 * 2.0**-24 + 2.0**-24, rel=1e-3)
    assert exact.scan_error_coef(384 // 16 + 4) == pytest.approx(29 * 2.0**-24, rel=1e-3)
    assert exact.scan_error_coef(384, exact.U64) == pytest.approx(2 * 2.0**-24, rel=1e-3)
    assert exact.scan_error_coef(384, exact.U32, 2.0**-11) > 2.0**-10  # TF32 inputs
    with pytest.raises(ValueError, match="no dot-product error bound"):
        exact.gamma(2**25, exact.U32)


def test_reduced_precision_matmuls_widen_the_bound_and_stay_exact():
    """With bfloat16 float32-matmuls allowed (torch.set_float32_matmul_precision), the
    torch backend's bound includes the input rounding, and the result stays exact."""
    prev = torch.get_float32_matmul_precision()
    bank, Q, qseg = near_duplicate_bank(5, 64, 40)
    want, _ = oracle_topk(bank.snapshot().vectors, bank.snapshot().offsets, Q, qseg, 5)
    try:
        torch.set_float32_matmul_precision("medium")
        assert exact.matmul_input_unit("cpu") == 2.0**-8
        be = TorchBackend("cpu")
        assert be.scan_coef(64) > 2.0**-7
        s, r = be.segmented_topk(be.view(bank), torch.from_numpy(Q), torch.from_numpy(qseg), 5)
        assert r.tolist() == want.tolist()
    finally:
        torch.set_float32_matmul_precision(prev)
    assert exact.matmul_input_unit("cpu") == 0.0


def test_chunked_scan_and_rescan_under_a_tiny_budget():
    """100,000 rows drawn from 20 near duplicates of one vector: every query's kept list
    is full of near-ties, so the torch backend rescans the segment in row blocks under a
    1 MiB budget (and the native kernel rescans too); ids equal the oracle."""
    rng = np.random.default_rng(3)
    u = unit(rng.normal(size=8))
    distinct = np.stack([u] + [perturb(u, rng, int(rng.integers(1, 3))) for _ in range(19)])
    bank = MemoryBank(8)
    bank.add("u", distinct[rng.integers(0, 20, size=100_000)], ids=list(range(100_000)))
    snap = bank.snapshot()
    uniq, inv = np.unique(snap.vectors, axis=0, return_inverse=True)
    Q = np.stack([u, perturb(u, rng, 1), unit(rng.normal(size=8))]).astype(np.float32)
    qseg = torch.zeros(3, dtype=torch.int64)
    backends = [TorchBackend("cpu", memory_budget=1 << 20)] + ([get_backend("native")] if NATIVE else [])
    for i in range(3):
        ex = np.array([exact_f32(Q[i], x) for x in uniq])[inv.ravel()]
        want = np.lexsort((np.arange(ex.size), -ex.astype(np.float64)))[:5]
        for be in backends:
            s, r = be.segmented_topk(be.view(bank), torch.from_numpy(Q[i : i + 1]), qseg[:1], 5)
            assert r[0].tolist() == want.tolist(), be.name
            np.testing.assert_array_equal(s[0].numpy(), ex[want])


def test_zero_query_takes_the_first_rows_without_a_rescan(monkeypatch):
    """A zero query (what the recollection driver scans for a beam slot that holds no
    branch) ties every row at exactly 0: its top-k is the segment's first k rows, on
    every backend, and the torch backend knows it without rescanning the segment
    (before: a full rescan with exact re-scoring of every row, ~50 ms per call at
    4,096 x 384 and 2x the memory budget)."""
    rng = np.random.default_rng(3)
    bank = MemoryBank.from_arrays(rng.normal(size=(300, 16)).astype(np.float32), [0, 4, 300, 300])
    Q = torch.zeros(4, 16)
    Q[1] = torch.from_numpy(rng.normal(size=16).astype(np.float32))
    qseg = torch.tensor([0, 1, 1, 2])
    snap = bank.snapshot()
    want_r, want_s = oracle_topk(snap.vectors, snap.offsets, Q.numpy(), qseg.numpy(), 7)
    monkeypatch.setattr(TorchBackend, "rescan_topk", lambda *a, **k: pytest.fail("zero query rescanned"))
    for be in _cpu_backends():
        s, r = be.segmented_topk(be.view(bank), Q, qseg, 7)
        r = np.asarray(r)
        assert r[0].tolist() == [0, 1, 2, 3, -1, -1, -1] and r[2].tolist() == list(range(4, 11)), type(be).__name__
        np.testing.assert_array_equal(r, want_r, err_msg=type(be).__name__)
        np.testing.assert_array_equal(np.asarray(s), want_s, err_msg=type(be).__name__)


@pytest.mark.skipif(not NATIVE, reason="rfmem_fast._native is not built")
@pytest.mark.parametrize("d", [1, 3, 7, 8, 9, 16, 31, 32, 33, 100, 384, 385])
def test_native_exact_scores_equal_the_oracle_at_every_simd_level(d):
    """Every SIMD level's exact-score sums (simd.h exact_sums: 4 scalar, 16 or 32 vector
    partial sums, any order) give RN32(q . x) exactly: all scores of a bank whose rows
    mix magnitudes 2^-40 .. 2^40, cancel to near 0 and sit within one ulp of float32
    midpoints (the float64 interval cannot decide: the exact fallback), against the
    oracle's math.fsum / Fraction rounding, for d around every vector width."""
    from rfmem_fast import _native

    rng = np.random.default_rng(d)
    q = rng.normal(size=d).astype(np.float32)
    rows = [rng.normal(size=d) * 2.0 ** rng.integers(-40, 40, size=d) for _ in range(6)]
    base = rng.normal(size=d).astype(np.float32)
    cancel = base.copy()  # against the all-ones query: +-2^40 pairs that cancel exactly, a small rest
    h = d // 3
    cancel[:h] = base[:h] * 2.0**40
    cancel[h : 2 * h] = -cancel[:h]
    rows.append(cancel)
    if d >= 3:  # q = 1: 1 + 2^-24 + 2^-60 (just past a midpoint), and its cancelling twins
        for t in (2.0**-60, -(2.0**-60), 0.0):
            x = np.zeros(d)
            x[:3] = [1.0, 2.0**-24, t]
            rows.append(x)
    X = np.stack(rows).astype(np.float32)
    Q = np.ones((3, d), dtype=np.float32)
    Q[1] = q
    if d >= 3:
        Q[0, 3:] = 0.0
    want = [sorted(((exact_f32(Q[i], x), -r) for r, x in enumerate(X)), reverse=True) for i in range(3)]
    off = np.array([0, X.shape[0]], dtype=np.int64)
    top = _native.set_simd_cap(-1)
    try:
        for lv in range(top + 1):
            assert _native.set_simd_cap(lv) == lv
            s, r = _native.segmented_topk(X, off, Q, np.zeros(3, dtype=np.int64), X.shape[0])
            for i in range(3):
                assert [(np.float32(a), -int(b)) for a, b in zip(s[i], r[i])] == want[i], (lv, i)
    finally:
        _native.set_simd_cap(-1)
