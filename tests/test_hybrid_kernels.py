"""The native backend's lexical-channel kernels (``bm25_hits``, ``hybrid_probe``, ``fused_topk``).

Pins: the BM25 hits equal :class:`rfmem_fast.lexical.UserPostings` bit for bit; a native
hybrid search (one scan: dense probe + fused top-k; "zscore" through the recorded scan
scores) equals the host numpy fusion of the torch backend and the full-scan oracle in rows,
scores, dense / lexical hit scores, probe lists and familiarity signals, also where the
fused heap overflows with exact ties (the rescan path), on every SIMD level; the probe's
own fused lists (``probe(kf=)``, boosts given or from their per-query factors) equal
``fused_topk``'s on every path, copy, level and thread count, and the hits never change a
dense list; bad arrays get ValueError / TypeError naming the argument.
"""
from __future__ import annotations

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends
from rfmem_fast.search import search

from _lexical_oracle import fused_topk

pytest.importorskip("bm25s")
if "native" not in available_backends():
    pytest.skip("the native backend is not built", allow_module_level=True)

from rfmem_fast import _native  # noqa: E402

WORDS = "apple banana cherry dog eagle fox grape house island jungle kite lemon mango night ocean piano".split()
FUSIONS = [
    dict(fusion="convex", lexical_norm="raw", lexical_weight=0.05),
    dict(fusion="convex", lexical_norm="max", lexical_weight=0.3),
    dict(fusion="convex", lexical_norm="max", lexical_weight=40.0),  # lexical dominates
    dict(fusion="adaptive", lexical_weight=0.5),
    dict(fusion="zscore", lexical_weight=0.1),
    dict(fusion="zscore", lexical_weight=20.0),
]


def _bank(seed, n=300, d=24, users=("u0", "u1", "u2")):
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    for j, u in enumerate(users):
        m = n + 37 * j
        V = rng.normal(size=(m, d))
        T = [None if rng.random() < 0.1 else " ".join(rng.choice(WORDS, int(rng.integers(1, 9)))) for _ in range(m)]
        # a block of exact ties: identical vectors and texts (overflows any heap of k + 8)
        V[40:70] = V[40]
        for i in range(40, 70):
            T[i] = "kite lemon mango"
        bank.add(u, V, ids=[f"{u}-{i}" for i in range(m)], texts=T)
    return bank, rng


def _queries(bank, rng, users, b):
    snap = bank.snapshot()
    Q = rng.normal(size=(b, snap.vectors.shape[1]))
    Q[0] = snap.vectors[snap.offsets[0] + 40]  # on the tied block
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(1, 5)))) for _ in range(b)]
    texts[0] = "kite lemon mango"
    texts[1] = "zzz"  # no known token
    texts[2] = None
    return Q, [users[i % len(users)] for i in range(b)], texts


FIELDS = ("rows", "scores", "dense_scores", "lexical_scores", "probe_ids", "probe_scores", "route", "rounds")
SIGNALS = ("mean", "entropy", "route", "rule")  # the dense probe's: as without the lexical channel


@pytest.mark.parametrize("fz", FUSIONS, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("mode", ["dense", "rfmem"])
def test_native_hybrid_equals_host_fusion_and_oracle(fz, mode):
    bank, rng = _bank(1)
    users = ["u0", "u1", "u2"]
    Q, qu, texts = _queries(bank, rng, users, 12)
    for out_k, probe_k in ((10, 10), (4, 9), (25, 3)):
        cfg = RFMemConfig(out_k=out_k, probe_k=probe_k, **fz)
        nat = search(bank, Q, qu, cfg, mode=mode, backend="native", query_texts=texts)
        host = search(bank, Q, qu, cfg, mode=mode, backend="torch", query_texts=texts)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(nat, f), getattr(host, f), err_msg=f)
        plain = search(bank, Q, qu, cfg.replace(lexical_weight=0.0), mode=mode, backend="native")
        for f in SIGNALS:
            np.testing.assert_array_equal(getattr(nat, f), getattr(plain, f), err_msg=f)
        if mode == "dense":
            kf = max(out_k, probe_k)
            want_rows, want_sc = fused_topk(bank, Q, qu, texts, cfg, kf)
            assert nat.rows.tolist() == want_rows[:, :out_k].tolist()
            np.testing.assert_array_equal(nat.scores, want_sc[:, :out_k].astype(np.float32))


@pytest.mark.parametrize("level", [0, 1, 2])
def test_native_hybrid_is_the_same_on_every_simd_level(level):
    bank, rng = _bank(2, n=120)
    Q, qu, texts = _queries(bank, rng, ["u0", "u1", "u2"], 9)
    cfg = RFMemConfig(**FUSIONS[1])
    want = search(bank, Q, qu, cfg, mode="dense", backend="torch", query_texts=texts)
    old = _native.set_simd_cap(level)
    try:
        got = search(bank, Q, qu, cfg, mode="dense", backend="native", query_texts=texts)
    finally:
        _native.set_simd_cap(-1)
    assert old >= 0
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_array_equal(got.scores, want.scores)


def test_native_hybrid_batch_invariant_with_many_queries_per_user():
    bank, rng = _bank(3, n=200)
    Q, qu, texts = _queries(bank, rng, ["u1"], 40)  # 40 queries of one user: groups of 16 share tiles
    cfg = RFMemConfig(out_k=7, probe_k=7, **FUSIONS[3])
    wide = search(bank, Q, qu, cfg, mode="dense", backend="native", query_texts=texts)
    for i in (0, 15, 16, 39):
        one = search(bank, Q[i : i + 1], qu[i : i + 1], cfg, mode="dense", backend="native", query_texts=texts[i : i + 1])
        assert one.rows[0].tolist() == wide.rows[i].tolist()
        np.testing.assert_array_equal(one.scores[0], wide.scores[i])


@pytest.mark.parametrize("fusion", ["convex", "adaptive", "zscore", "rrf"])
def test_single_hybrid_query_touches_torch_only_for_rrf(monkeypatch, fusion):
    """A host hybrid search on the native backend through its one-pass kernels (the
    score-based fusions, unfiltered) runs no torch operation (a TorchDispatchMode records no
    aten op) and calls no torch function, nor the torch thread setting
    (``search_chunk.chunk_threads``: a torch call after a kernel's scan costs 10-20 us, the
    thread setting and back 20-50 us a query); "rrf" (fused on the host with torch) keeps the one-thread
    limit. Each result equals the same search with the torch thread limit forced."""
    import sys

    import torch

    from rfmem_fast import search_chunk
    from rfmem_fast.backends.native import NativeBackend

    be = NativeBackend(num_threads=1)
    bank, rng = _bank(5)
    Q, qu, texts = _queries(bank, rng, ["u0", "u1"], 4)
    cfg = RFMemConfig(out_k=5, probe_k=5, fusion=fusion, lexical_weight=0.2)
    for mode in ("dense", "recollection", "rfmem"):  # the view, its memos and the driver's draws built
        search(bank, Q[:1], qu[:1], cfg, mode=mode, backend=be, query_texts=texts[:1])
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # every aten operation run inside it
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.append(str(func))
            return func(*args, **(kwargs or {}))

    touched = []
    for name in ("from_numpy", "set_num_threads", "get_num_threads", "full", "where"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _f=real, **k: touched.append(_n) or _f(*a, **k))
    with Ops() as ops:
        got = {mode: search(bank, Q[3:4], qu[3:4], cfg, mode=mode, backend=be, query_texts=texts[3:4])
               for mode in ("dense", "recollection", "rfmem")}  # fmt: skip
    assert (touched == [] and ops.ran == []) == (fusion != "rrf"), (touched, ops.ran[:5])
    # every chunk under the one-thread limit, as before the rule: the same results
    monkeypatch.setattr(sys.modules["rfmem_fast.search"], "chunk_threads", lambda *a: search_chunk.limit_torch_threads(1.0))
    for mode, res in got.items():
        want = search(bank, Q[3:4], qu[3:4], cfg, mode=mode, backend=be, query_texts=texts[3:4])
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(res, f), getattr(want, f), err_msg=f"{mode} {f}")


def test_bm25_hits_equal_user_postings_bit_for_bit():
    bank, rng = _bank(4, n=150)
    snap = bank.snapshot()
    lex = snap.lexical
    users = []
    for u in range(snap.num_users):
        P = lex.postings(u)
        users.append((P.terms, P.ptr, P.rows, P.weight, P.n_rows))
    texts = ["apple apple dog", "kite lemon mango mango", "zzz", "ocean", "piano night fox grape house"]
    quser = np.array([0, 1, -1, 2, 0], dtype=np.int64)
    enc = [lex.encode_query(t) for t in texts]
    qptr = np.concatenate([[0], np.cumsum([e[0].shape[0] for e in enc])]).astype(np.int64)
    qterms = np.concatenate([e[0] for e in enc]).astype(np.int32)
    qcnt = np.concatenate([e[1] for e in enc])
    hptr, hrows, hval, mx, top, s1, s2 = _native.bm25_hits(users, quser, qterms, qcnt, qptr)
    for i, (t, u) in enumerate(zip(texts, quser)):
        got = np.zeros(snap.offsets[u + 1] - snap.offsets[u]) if u >= 0 else None
        if u < 0:
            assert hptr[i + 1] == hptr[i] and mx[i] == 0.0
            continue
        got[hrows[hptr[i] : hptr[i + 1]]] = hval[hptr[i] : hptr[i + 1]]
        want = lex.scores(int(u), t)
        want = np.zeros_like(got) if want is None else want
        np.testing.assert_array_equal(got, want)  # bit for bit
        assert mx[i] == want.max(initial=0.0)
        np.testing.assert_array_equal(top[i], np.pad(-np.sort(-want[want > 0])[:10], (0, max(0, 10 - (want > 0).sum()))))
        assert s1[i] == np.cumsum(want)[-1] and s2[i] == np.cumsum(want * want)[-1]


def test_kernel_arguments_are_checked():
    bank, rng = _bank(5, n=100)
    snap = bank.snapshot()
    P = snap.lexical.postings(0)
    ok_user = (P.terms, P.ptr, P.rows, P.weight, P.n_rows)
    one = (np.zeros(1, np.int64), np.array([0, 1], np.int64))
    qt = np.array([P.terms[0]], np.int32)
    with pytest.raises(TypeError, match="qterms must have dtype int32"):
        _native.bm25_hits([ok_user], one[0], qt.astype(np.int64), np.ones(1), one[1])
    with pytest.raises(ValueError, match="qptr must run from 0 to len"):
        _native.bm25_hits([ok_user], one[0], qt, np.ones(1), np.array([0, 2], np.int64))
    with pytest.raises(ValueError, match=r"quser\[0\] = 3 is not an index"):
        _native.bm25_hits([ok_user], np.array([3], np.int64), qt, np.ones(1), one[1])
    bad_rows = P.rows.copy()
    bad_rows[P.ptr[0] : P.ptr[1]] = P.n_rows + 5
    with pytest.raises(ValueError, match=r"postings of users\[0\] are malformed"):
        _native.bm25_hits([(P.terms, P.ptr, bad_rows, P.weight, P.n_rows)], one[0], qt, np.ones(1), one[1])
    X, off = snap.vectors, snap.offsets.astype(np.int64)
    Q = X[:1].copy()
    seg = np.zeros(1, np.int64)
    args = dict(hptr=np.array([0, 2], np.int64), hrows=np.array([3, 1], np.int32), hx=np.ones(2), hval=np.ones(2))
    with pytest.raises(ValueError, match="must be ascending local rows"):
        _native.hybrid_probe(X, off, Q, seg, 5, 5, 0.1, "mean", kf=5, **args)
    args["hrows"] = np.array([1, 3], np.int32)
    args["hx"] = np.array([1.0, -1.0])
    with pytest.raises(ValueError, match=r"hx\[1\] must be finite and >= 0"):
        _native.hybrid_probe(X, off, Q, seg, 5, 5, 0.1, "mean", kf=5, **args)
    args["hx"] = np.ones(2)
    with pytest.raises(ValueError, match="kf must be >= 0"):
        _native.hybrid_probe(X, off, Q, seg, 5, 5, 0.1, "mean", kf=-1, **args)
    d_sc = np.zeros((1, 4), np.float32)
    d_rows = np.array([[0, 1, 2, 10_000]], np.int64)
    with pytest.raises(ValueError, match=r"dense_rows\[0, 3\] is not -1 or a row"):
        _native.fused_topk(X, off, Q, seg, d_sc, d_rows, kf=3, **args)
    with pytest.raises(ValueError, match="hf must have one entry per hrows"):
        _native.fused_topk(X, off, Q, seg, d_sc[:, :3], d_rows[:, :3], kf=3, hf=np.zeros(5, np.float32), **args)


def test_fused_topk_scores_the_hits_itself_as_with_recorded_scores():
    """_native.fused_topk without ``hf`` (it scores the hits: the lead / row-order screening)
    gives what it gives with the scan scores hybrid_probe recorded."""
    bank, rng = _bank(7, n=200)
    snap = bank.snapshot()
    X, off = snap.vectors, snap.offsets.astype(np.int64)
    lex = snap.lexical
    P = lex.postings(0)
    Q = (X[off[0] + 40] + 0.3 * rng.normal(size=X.shape[1])).astype(np.float32)[None, :]
    Q /= np.linalg.norm(Q)
    qt, qc = lex.encode_query("kite lemon mango apple dog")
    users = [(P.terms, P.ptr, P.rows, P.weight, P.n_rows)]
    hptr, hrows, hval, *_ = _native.bm25_hits(users, np.zeros(1, np.int64), qt.astype(np.int32), qc,
                                               np.array([0, qt.shape[0]], np.int64))  # fmt: skip
    assert hval.shape[0] > 40  # enough hits for the lead and the row-order passes
    hx = 0.05 * hval
    seg = np.zeros(1, np.int64)
    s, r, *_, hf = _native.hybrid_probe(X, off, Q, seg, 10, 10, 0.1, "mean", hptr, hrows, hx, hval, 0)
    with_hf = _native.fused_topk(X, off, Q, seg, s, r, hptr, hrows, hx, hval, 10, hf=hf)
    without = _native.fused_topk(X, off, Q, seg, s, r, hptr, hrows, hx, hval, 10)
    for a, b in zip(with_hf, without):
        np.testing.assert_array_equal(a, b)
    one_pass = _native.hybrid_probe(X, off, Q, seg, 10, 10, 0.1, "mean", hptr, hrows, hx, hval, 10)
    np.testing.assert_array_equal(with_hf[0], one_pass[5])  # rows, as the one-pass fusion


# ------------------------------------------------------------------ the probe's hit keys
def _hit_case(seed, d, lens, b, dtype):
    """A bank (float32 rows, its scan copy for ``dtype``), b queries (the first 40 on
    segment 0: the GEMM path's share) and random hits per query, first and last rows included."""
    from rfmem_fast.precision import int8_scan_copy, to_scan_copy

    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    X = rng.normal(size=(int(off[-1]), d)).astype(np.float32)
    X[5:9] = X[4]  # exact ties
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    seg = rng.integers(len(lens), size=b).astype(np.int64)
    seg[:40] = 0
    Q = X[off[seg] + rng.integers(0, np.asarray(lens)[seg])] + 0.2 * rng.normal(size=(b, d)).astype(np.float32)
    Q = (Q / np.linalg.norm(Q, axis=1, keepdims=True)).astype(np.float32)
    hp, hr = [0], []
    for i in range(b):
        n = int(lens[seg[i]])
        rows = set(rng.choice(n, int(rng.integers(0, min(n, 300) + 1)), replace=False).tolist()) | {0, n - 1}
        hr += sorted(rows)
        hp.append(len(hr))
    scan = {}
    if dtype in ("float16", "bfloat16"):
        bits = to_scan_copy(X, dtype)
        scan = dict(scan=bits.view(np.uint16), scan_type=dtype)
    elif dtype == "int8":
        codes, meta = int8_scan_copy(X)
        scan = dict(scan=codes, scan_meta=meta, scan_type="int8")
    return X, off, Q, seg, np.array(hp, np.int64), np.array(hr, np.int32), scan


#: (scan copy, SIMD level cap, int8 kernel cap): every copy at every level, and the int8
#: copy on level 2's other int8 kernels (0: avx2, 1: avx512bw; -1: the best there)
_KEY_CASES = [(t, lv, -1) for t in ("float32", "float16", "bfloat16", "int8") for lv in (0, 1, 2)]
_KEY_CASES += [("int8", 2, 0), ("int8", 2, 1)]


@pytest.mark.parametrize("dtype,level,int8_cap", _KEY_CASES, ids=[f"{t}-{lv}-{c}" for t, lv, c in _KEY_CASES])
def test_probe_hit_keys_bound_the_exact_scores_on_every_path(dtype, level, int8_cap):
    """probe(hit_ptr=, hit_rows=) leaves the probe itself unchanged and gives every hit a
    key with keys + up >= RN32(q . x) (the float64 product rounded once: an independent
    reference), two-sided within up for the float32 scan and GEMM scores; up = inf only
    where a path records none (level 0's int8 GEMM units and float32 / half scans)."""
    if int8_cap >= 0 and (_native.set_simd_cap(-1) < 2 or int8_cap > _native.simd_int8_supported()):
        pytest.skip("an int8 kernel of level 2 this CPU lacks")
    X, off, Q, seg, hp, hr, scan = _hit_case(11 + level, 37, [700, 3, 129, 300, 1], 90, dtype)
    _native.set_simd_cap(level, int8_cap)  # (a CPU without it runs its highest level below)
    level = _native.simd_level()
    try:
        for path in ("auto", "scan", "gemm"):
            for threads in (1, 2):
                args = (X, off, Q, seg, 12, 5, 0.1, "mean", threads, -1.0)
                got = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, **scan)
                want = _native.probe(*args, path=path, **scan)
                for a, w in zip(got[:5], want):
                    np.testing.assert_array_equal(a, w)
                keys, up = got[5], got[6]
                assert keys.shape == hr.shape and up.shape == seg.shape
                for i in range(seg.shape[0]):
                    h0, h1 = hp[i], hp[i + 1]
                    exact = (X[off[seg[i]] + hr[h0:h1]].astype(np.float64) @ Q[i].astype(np.float64)).astype(np.float32)
                    if not np.isfinite(up[i]):
                        assert dtype != "float32" or level == 0, (path, i)
                        continue
                    k = keys[h0:h1].astype(np.float64)
                    assert np.all(k + up[i] >= exact), (path, threads, i)
                    if dtype == "float32":
                        assert np.all(k - up[i] <= exact), (path, threads, i)
                recorded = np.isfinite(up)
                # with every row's scan score kept (the beam driver's; segments >= 512 rows),
                # the keys come from those scores: the same values
                kept = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, keep_scan_scores=True, **scan)
                assert kept[5] is not None  # (segment 0 holds 700 rows)
                np.testing.assert_array_equal(kept[8], up)
                rec_hits = np.repeat(recorded, np.diff(hp))
                np.testing.assert_array_equal(kept[7][rec_hits], keys[rec_hits])
                if dtype == "float32" and level > 0:
                    assert recorded.all()
                if dtype == "int8" and (path == "scan" or level > 0):  # (level 0: GEMM units record none)
                    assert recorded.all() and np.all(up == 0.0)  # int8 keys are upper bounds themselves
    finally:
        _native.set_simd_cap(-1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_fused_topk_with_probe_keys_equals_scoring_every_hit(dtype):
    """fused_topk fed the probe's keys (hf / hup: hits visited by descending fused upper
    bound) gives what it gives when it scores every hit itself, and the full-scan oracle
    of the fused score fl64(RN32(q . x) + boost)."""
    X, off, Q, seg, hp, hr, scan = _hit_case(5, 40, [900, 64, 250], 70, dtype)
    rng = np.random.default_rng(1)
    hval = rng.random(hr.shape[0]) * 10
    hx = np.round(hval * 0.02, 3)  # rounded boosts: exact fused ties across rows
    kf = 10
    for path in ("scan", "gemm"):
        out = _native.probe(X, off, Q, seg, 30, 5, 0.1, "mean", 2, -1.0, path=path, hit_ptr=hp, hit_rows=hr, **scan)
        keyed = _native.fused_topk(X, off, Q, seg, out[0], out[1], hp, hr, hx, hval, kf, hf=out[5], hup=out[6])
        scored = _native.fused_topk(X, off, Q, seg, out[0], out[1], hp, hr, hx, hval, kf)
        for a, w in zip(keyed, scored):
            np.testing.assert_array_equal(a, w)
        nan_keys = out[5].copy()  # a NaN key bounds nothing: its hit is scored (first), the result unchanged
        nan_keys[::7] = np.nan
        for a, w in zip(_native.fused_topk(X, off, Q, seg, out[0], out[1], hp, hr, hx, hval, kf, hf=nan_keys,
                                           hup=out[6]), scored):  # fmt: skip
            np.testing.assert_array_equal(a, w)
        for i in range(seg.shape[0]):
            a, e = off[seg[i]], off[seg[i] + 1]
            dense = (X[a:e].astype(np.float64) @ Q[i].astype(np.float64)).astype(np.float32).astype(np.float64)
            boost = np.zeros(e - a)
            boost[hr[hp[i] : hp[i + 1]]] = hx[hp[i] : hp[i + 1]]
            fused = dense + boost
            order = np.lexsort((np.arange(e - a), -fused))[:kf]
            assert keyed[0][i].tolist() == (a + order).tolist(), (path, i)
            np.testing.assert_array_equal(keyed[1][i], fused[order])


#: (scan copy, SIMD level cap, segment lengths, queries): the scan and GEMM paths on every
#: copy and level, and one long segment with few queries (its rows split in parts over the
#: threads: the fused list taken after the parts' merge)
_FUSED_CASES = [(t, lv, (900, 64, 250), 70) for t in ("float32", "float16", "int8") for lv in (0, 1, 2)]
_FUSED_CASES += [("float32", 2, (5000,), 3), ("int8", 2, (5000,), 3)]


@pytest.mark.parametrize("dtype,level,lens,b", _FUSED_CASES, ids=[f"{c[0]}-{c[1]}-{len(c[2])}" for c in _FUSED_CASES])
def test_probe_fused_list_equals_fused_topk_and_the_oracle(dtype, level, lens, b):
    """probe(..., hx=, hval=, kf=) takes each query's fused top-kf on the scan's threads
    right after its dense list (lexical.h FusedTopk): the same four arrays as fused_topk
    fed the probe's lists and keys afterwards, bit for bit, on every path, SIMD level and
    thread count, and the full-scan oracle's rows and fused scores; the probe itself and
    its keys are unchanged."""
    X, off, Q, seg, hp, hr, scan = _hit_case(9, 40, list(lens), b, dtype)
    rng = np.random.default_rng(3)
    hval = rng.random(hr.shape[0]) * 10
    hx = np.round(hval * 0.02, 3)  # rounded boosts: exact fused ties across rows
    kf = 10
    _native.set_simd_cap(level)
    try:
        for path in ("auto", "scan", "gemm"):
            for threads in (1, 2):
                args = (X, off, Q, seg, 30, 5, 0.1, "mean", threads, -1.0)
                base = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, **scan)
                got = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hval, kf=kf, **scan)
                assert len(got) == len(base) + 4
                # the hits change no dense list (an int8 scan in tiles of 1,024 rows once
                # kept only its last tile's candidates)
                for a, w in zip(base[:5], _native.probe(*args, path=path, **scan)):
                    np.testing.assert_array_equal(a, w)
                for a, w in zip(got[: len(base)], base):
                    np.testing.assert_array_equal(a, w)
                want = _native.fused_topk(X, off, Q, seg, base[0], base[1], hp, hr, hx, hval, kf, hf=base[5],
                                          hup=base[6])  # fmt: skip
                for a, w in zip(got[len(base) :], want):
                    np.testing.assert_array_equal(a, w)
                rows, fused = got[len(base)], got[len(base) + 1]
                for i in range(seg.shape[0]):
                    a, e = off[seg[i]], off[seg[i] + 1]
                    dense = (X[a:e].astype(np.float64) @ Q[i].astype(np.float64)).astype(np.float32).astype(np.float64)
                    boost = np.zeros(e - a)
                    boost[hr[hp[i] : hp[i + 1]]] = hx[hp[i] : hp[i + 1]]
                    order = np.lexsort((np.arange(e - a), -(dense + boost)))[:kf]
                    assert rows[i].tolist() == (a + order).tolist(), (path, threads, i)
                    np.testing.assert_array_equal(fused[i], (dense + boost)[order])
    finally:
        _native.set_simd_cap(-1)


def test_probe_fused_list_with_byte_query_keys():
    """The same with the int8 GEMM units on byte queries (forced from 0 rows: the hits'
    keys come from vpdpbusd's sums where the CPU has avx512_vnni, and the dense lists
    from the re-keyed finish): still fused_topk's arrays and the oracle's."""
    prev = _native.set_int8_byte_queries(True, 0)
    try:
        test_probe_fused_list_equals_fused_topk_and_the_oracle("int8", 2, (900, 64, 250), 70)
    finally:
        _native.set_int8_byte_queries(prev)


@pytest.mark.parametrize("den", ["none", "max", "zeros"])
def test_probe_fused_list_from_boost_factors_equals_flat_boosts(den):
    """probe(hscale=, hden=) applies the boost factors on the scan's threads: the same four
    arrays as probe(hx=BoostFactors.flat(hval, hit_ptr)) (rfmem_fast.fusion), bit for bit,
    with per-query scales, max-normalised BM25 and a zero denominator (boost 0)."""
    from rfmem_fast.fusion import BoostFactors

    X, off, Q, seg, hp, hr, _ = _hit_case(4, 40, [900, 64, 250], 70, "float32")
    rng = np.random.default_rng(8)
    hval = rng.random(hr.shape[0]) * 10
    b = seg.shape[0]
    scale = rng.random(b) * 0.2
    lex_max = np.array([hval[hp[i] : hp[i + 1]].max() if hp[i + 1] > hp[i] else 0.0 for i in range(b)])
    dens = {"none": None, "max": lex_max, "zeros": np.where(np.arange(b) % 3 == 0, 0.0, lex_max)}
    f = BoostFactors(scale, dens[den])
    hx = np.ascontiguousarray(f.flat(hval, hp))
    for path in ("scan", "gemm"):
        args = (X, off, Q, seg, 30, 5, 0.1, "mean", 2, -1.0)
        want = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hval, kf=10)
        got = _native.probe(*args, path=path, hit_ptr=hp, hit_rows=hr, hval=hval, kf=10, hscale=scale, hden=dens[den])
        for a, w in zip(got, want):
            np.testing.assert_array_equal(a, w)
    bad = scale.copy()
    bad[5] = np.inf
    with pytest.raises(ValueError, match="boosts of query 5 from hscale / hden and hval must be finite and >= 0"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hval=hval, kf=10, hscale=bad)
    with pytest.raises(ValueError, match="give hx or hscale, not both"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hval, kf=10, hscale=scale)
    with pytest.raises(ValueError, match="hden goes with hscale"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hval, kf=10, hden=lex_max)
    with pytest.raises(ValueError, match="hscale must have one entry per query"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hval=hval, kf=10, hscale=scale[:-1])


def test_probe_fused_list_arguments_are_checked():
    X, off, Q, seg, hp, hr, _ = _hit_case(2, 16, [50], 3, "float32")
    hx = np.zeros(hr.shape[0])
    args = (X, off, Q, seg, 10, 5, 0.1, "mean")
    with pytest.raises(ValueError, match="kf must be <= k"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hx, kf=11)
    with pytest.raises(ValueError, match="kf must be >= 0"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hx, kf=-1)
    with pytest.raises(ValueError, match="kf > 0 needs hit_ptr and hit_rows"):
        _native.probe(*args, hx=hx, hval=hx, kf=5)
    with pytest.raises(ValueError, match="hx and hval go with kf > 0"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hx)
    with pytest.raises(ValueError, match="hx and hval must have one entry per hrows entry"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx[:-1], hval=hx[:-1], kf=5)
    bad = hx.copy()
    bad[0] = np.inf
    with pytest.raises(ValueError, match=r"hx\[0\] must be finite and >= 0"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=bad, hval=hx, kf=5)
    with pytest.raises(ValueError, match="kf > 0 takes no row selection"):
        _native.probe(*args, hit_ptr=hp, hit_rows=hr, hx=hx, hval=hx, kf=5, qsel=np.zeros(3, np.int64),
                      sel_seg=np.zeros(1, np.int64), sel_off=np.array([0, 50], np.int64), sel_rows=np.arange(50),
                      sel_mask=np.ones(50, np.uint8), sel_mask_off=np.zeros(1, np.int64))  # fmt: skip


def test_fused_topk_checks_hup():
    X, off, Q, seg, hp, hr, _ = _hit_case(2, 16, [50], 3, "float32")
    out = _native.probe(X, off, Q, seg, 10, 5, 0.1, "mean", hit_ptr=hp, hit_rows=hr)
    hx = np.zeros(hr.shape[0])
    with pytest.raises(ValueError, match="hup needs hf"):
        _native.fused_topk(X, off, Q, seg, out[0], out[1], hp, hr, hx, hx, 5, hup=out[6])
    with pytest.raises(ValueError, match=r"hup\[1\] must be >= 0"):
        _native.fused_topk(X, off, Q, seg, out[0], out[1], hp, hr, hx, hx, 5, hf=out[5], hup=np.array([0.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match="hit_ptr and hit_rows go together"):
        _native.probe(X, off, Q, seg, 10, 5, 0.1, "mean", hit_ptr=hp)
    with pytest.raises(ValueError, match="must be ascending local rows"):
        _native.probe(X, off, Q, seg, 10, 5, 0.1, "mean", hit_ptr=hp, hit_rows=hr[::-1].copy())


def test_bm25_hits_sparse_read_off_and_threads():
    """A large user read through few postings takes the sorted read-off (not the row
    bitmap); the hits equal UserPostings.scores bit for bit, whatever the thread count."""
    rng = np.random.default_rng(8)
    n = 6000
    bank = MemoryBank(8)
    texts = [" ".join(rng.choice(WORDS, 3)) for _ in range(n)]
    for i in rng.choice(n, 5, replace=False):
        texts[i] += " zebra"  # a rare term: 5 postings against 94 bitmap words
    bank.add("u", rng.normal(size=(n, 8)), ids=[str(i) for i in range(n)], texts=texts)
    lex = bank.snapshot().lexical
    P = lex.postings(0)
    qs = ["zebra"] * 3 + ["apple dog zebra", "kite"] * 20
    enc = [lex.encode_query(t) for t in qs]
    qptr = np.concatenate([[0], np.cumsum([e[0].shape[0] for e in enc])]).astype(np.int64)
    qterms = np.concatenate([e[0] for e in enc]).astype(np.int32)
    qcnt = np.concatenate([e[1] for e in enc])
    quser = np.zeros(len(qs), np.int64)
    user = [(P.terms, P.ptr, P.rows, P.weight, P.n_rows)]
    outs = [_native.bm25_hits(user, quser, qterms, qcnt, qptr, t) for t in (1, 2)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    hptr, hrows, hval = outs[0][:3]
    for i, t in enumerate(qs):
        got = np.zeros(n)
        got[hrows[hptr[i] : hptr[i + 1]]] = hval[hptr[i] : hptr[i + 1]]
        np.testing.assert_array_equal(got, lex.scores(0, t))
    assert hptr[1] - hptr[0] == 5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_native_hybrid_on_scan_copies_equals_the_float32_bank(dtype):
    """The hybrid probe scans the bank's own scan copy (its keys feed the fusion): the
    results equal those of the float32 bank of the same rows, GEMM units included."""
    bank, rng = _bank(9, n=260)
    snap = bank.snapshot()
    other = MemoryBank(snap.vectors.shape[1], dtype=dtype)
    for u in ("u0", "u1", "u2"):
        i = bank.user_index(u)
        a, e = snap.offsets[i], snap.offsets[i + 1]
        other.add(u, snap.vectors[a:e], ids=[f"{u}-{j}" for j in range(e - a)], texts=list(snap.texts[a:e]))
    Q, qu, texts = _queries(bank, rng, ["u0", "u1"], 48)  # 24 queries per user: GEMM units
    for fz in (FUSIONS[0], FUSIONS[3], FUSIONS[4]):
        cfg = RFMemConfig(out_k=9, probe_k=9, **fz)
        want = search(bank, Q, qu, cfg, mode="dense", backend="native", query_texts=texts)
        got = search(other, Q, qu, cfg, mode="dense", backend="native", query_texts=texts)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f"{dtype} {fz} {f}")
