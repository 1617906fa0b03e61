"""The native backend's lexical-channel kernels (``bm25_hits``, ``hybrid_probe``, ``fused_topk``).

Pins: the BM25 hits equal :class:`rfmem_fast.lexical.UserPostings` bit for bit; a native
hybrid search (one scan: dense probe + fused top-k; "zscore" through the recorded scan
scores) equals the host numpy fusion of the torch backend and the full-scan oracle in rows,
scores, dense / lexical hit scores, probe lists and familiarity signals, also where the
fused heap overflows with exact ties (the rescan path), on every SIMD level; bad arrays
get ValueError / TypeError naming the argument.
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
