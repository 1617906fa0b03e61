"""The lexical (BM25) channel: bm25s parity, exactness after writes, tenant isolation, fused search = oracle.

Pins (README "Hybrid retrieval"): the tokenizer and BM25 equal bm25s's; the index stays
exact through add / update / delete / compact / save / load; a user's lexical scores
depend on its own texts only; the fused ids equal a full-scan float64 oracle on every
CPU backend, batch-invariant and prefix-consistent; lexical_weight 0 changes nothing;
the familiarity signals stay those of the dense probe.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends
from rfmem_fast.lexical import STOPWORDS_EN, Analyzer
from rfmem_fast.search import search, search_candidates

from _lexical_oracle import bm25_scores, bm25s_library_scores, bm25s_tokens, fused_topk

pytest.importorskip("bm25s")

WORDS = (
    "apple banana cherry dog eagle fox grape house island jungle kite lemon mango night ocean piano "
    "running runs runner the of and paris london tuesday meeting doctor sister birthday"
).split()
BACKENDS = [b for b in ("reference", "torch", "native") if b in available_backends()]


def _texts(rng, n, p_none=0.15):
    out = []
    for _ in range(n):
        r = rng.random()
        if r < p_none:
            out.append(None)
        elif r < p_none + 0.05:
            out.append(rng.choice(["", "the of and", "a"]))
        else:
            out.append(" ".join(rng.choice(WORDS, int(rng.integers(1, 12)))).capitalize() + "!")
    return out


def _bank(seed=0, users=("a", "b", 7), n=40, d=16, stemmer=None, ties=True):
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d, lexical_stemmer=stemmer)
    for j, u in enumerate(users):
        m = n + 5 * j
        V = rng.normal(size=(m, d))
        T = _texts(rng, m)
        if ties:  # exact near-ties: duplicated vectors, with the same and with other texts
            V[5] = V[4]
            T[5] = T[4]
            V[7] = V[6]
        bank.add(u, V, ids=[f"{u}-{i}" for i in range(m)], texts=T)
    bank.add("notext", rng.normal(size=(12, d)), ids=list(range(12)))  # a user without any text
    return bank, rng


def _user_scores(bank, user, query):
    snap = bank.snapshot()
    u = bank.user_index(user)
    vec = snap.lexical.scores(u, query)
    n = int(snap.offsets[u + 1] - snap.offsets[u])
    return np.zeros(n) if vec is None else vec


QUERIES = ["apple dog dog", "The running of the bulls in Paris", "zzz unknown", "", None, "the of and",
           "Piano OCEAN piano night", "sister birthday tuesday meeting"]  # fmt: skip


# ------------------------------------------------------------------ tokenizer and BM25 = bm25s
@pytest.mark.parametrize("stemmer", [None, "english"])
def test_tokenizer_equals_bm25s(stemmer):
    if stemmer:
        pytest.importorskip("Stemmer")
    an = Analyzer(stemmer)
    texts = ["The cat's running, RUNS & ran: naïve café x y zz 42 4 a_b", "", "the of", "Ünïcode wörds—dash"]
    assert [an.tokens(t) for t in texts] == bm25s_tokens(texts, stemmer)
    import bm25s.stopwords

    assert STOPWORDS_EN == frozenset(bm25s.stopwords.STOPWORDS_EN)


@pytest.mark.parametrize("stemmer", [None, "english"])
def test_bm25_equals_bm25s_per_user(stemmer):
    """Each user's BM25 equals bm25s over that user's texts alone (idf, tf part, repeated
    and unknown query tokens, empty / stopword-only documents, items without text)."""
    if stemmer:
        pytest.importorskip("Stemmer")
    bank, _ = _bank(1, stemmer=stemmer)
    for user in ("a", "b", 7, "notext"):
        texts = bank.texts_of(user)
        for q in QUERIES:
            got = _user_scores(bank, user, q)
            want = bm25_scores(texts, q, stemmer)
            np.testing.assert_array_equal(got, want)  # the documented float64 formula, bit for bit
            if q is not None:
                np.testing.assert_allclose(got, bm25s_library_scores(texts, q, stemmer), rtol=2e-6, atol=1e-6)
            assert not got[[t is None for t in texts]].any()  # no text: never a lexical score


# ------------------------------------------------------------------ exact after every kind of write
def test_index_exact_after_add_update_delete_compact(tmp_path):
    bank, rng = _bank(2, n=70)

    def check():
        for user in bank.users:
            texts = bank.texts_of(user)
            for q in QUERIES[:3] + QUERIES[6:]:
                np.testing.assert_array_equal(_user_scores(bank, user, q), bm25_scores(texts, q))

    check()
    bank.add("a", rng.normal(size=(3, 16)), ids=["n1", "n2", "n3"], texts=["apple apple pie", None, "dog house"])
    check()
    bank.update("a", ["a-0", "n2"], rng.normal(size=(2, 16)), texts=["brand new apple", "now with text dog"])
    check()
    bank.update("b", ["b-1"], rng.normal(size=(1, 16)))  # vectors only: the text stays
    check()
    bank.update("b", ["b-2"], rng.normal(size=(1, 16)), texts=[None])  # the text removed
    check()
    bank.delete("a", ["a-1", "n1"])
    check()
    bank.delete("b", [f"b-{i}" for i in range(3, 44)])  # on-the-spot compaction of b... not reached (< 64)
    check()
    big = [f"x{i}" for i in range(140)]
    bank.add("c", rng.normal(size=(140, 16)), ids=big, texts=_texts(rng, 140))
    bank.snapshot()
    bank.delete("c", big[:100])  # tombstones >= 64 and > live: compacted on the spot
    check()
    assert bank.compact() == 0 or True
    check()
    bank.save(tmp_path / "s")
    for mmap in (False, True):
        back = MemoryBank.load(tmp_path / "s", mmap=mmap)
        for user in bank.users:
            for q in QUERIES[:3]:
                np.testing.assert_array_equal(_user_scores(back, user, q), _user_scores(bank, user, q))
        back.add("a", rng.normal(size=(1, 16)), ids=["after"], texts=["apple after load"])
        np.testing.assert_array_equal(_user_scores(back, "a", "apple"), bm25_scores(back.texts_of("a"), "apple"))


def test_unchanged_users_keep_their_postings_and_are_not_retokenised(monkeypatch):
    bank, rng = _bank(3)
    s1 = bank.snapshot()
    pa, pb = s1.lexical.postings(bank.user_index("a")), s1.lexical.postings(bank.user_index("b"))
    calls = []
    orig = Analyzer.tokens
    monkeypatch.setattr(Analyzer, "tokens", lambda self, t: calls.append(t) or orig(self, t))
    bank.add("b", rng.normal(size=(1, 16)), ids=["new"], texts=["fresh text"])
    s2 = bank.snapshot()
    assert calls == ["fresh text"]  # one tokenisation: the new item's
    assert s2.lexical.postings(bank.user_index("a")) is pa  # carried over: a did not change
    assert s2.lexical.postings(bank.user_index("b")) is not pb


# ------------------------------------------------------------------ tenant isolation
def test_tenant_isolation_scores_and_results_do_not_depend_on_other_users():
    """User a's BM25 (bit for bit) and fused results are the same whatever the other users hold."""
    bank, rng = _bank(4)
    cfgs = [RFMemConfig(lexical_weight=0.2, fusion=f, out_k=8, probe_k=8) for f in ("convex", "adaptive", "rrf")]
    Q = rng.normal(size=(len(QUERIES), 16))
    before = {q: _user_scores(bank, "a", q) for q in QUERIES}
    res = [search(bank, Q, ["a"] * len(QUERIES), c, mode="dense", backend="torch", query_texts=QUERIES) for c in cfgs]
    # other users: new vocabulary, the same tokens as a's in other frequencies, deletions
    bank.add("b", rng.normal(size=(30, 16)), ids=[f"z{i}" for i in range(30)], texts=["apple " * 9 + "dog"] * 30)
    bank.add("other", rng.normal(size=(20, 16)), ids=list(range(20)), texts=["running paris piano ocean"] * 20)
    bank.delete(7, ["7-0", "7-1"])
    for q in QUERIES:
        np.testing.assert_array_equal(_user_scores(bank, "a", q), before[q])
    for c, r in zip(cfgs, res):
        got = search(bank, Q, ["a"] * len(QUERIES), c, mode="dense", backend="torch", query_texts=QUERIES)
        assert got.ids.tolist() == r.ids.tolist()
        np.testing.assert_array_equal(got.scores, r.scores)
        np.testing.assert_array_equal(got.lexical_scores, r.lexical_scores)


# ------------------------------------------------------------------ fused search = oracle
FUSIONS = [
    dict(fusion="convex", lexical_norm="max", lexical_weight=0.3),
    dict(fusion="convex", lexical_norm="raw", lexical_weight=0.05),
    dict(fusion="convex", lexical_norm="max", lexical_weight=50.0),  # lexical dominates: deep lexical-only hits
    dict(fusion="adaptive", lexical_weight=0.5),
    dict(fusion="rrf", lexical_weight=1.0, lexical_depth=12, lexical_rrf_k=10.0),
    dict(fusion="zscore", lexical_weight=0.1),
    dict(fusion="zscore", lexical_weight=20.0),  # lexical dominates
    dict(fusion="rrf", lexical_weight=1.0, lexical_depth=3, lexical_rrf_k=1.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fz", FUSIONS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_fused_ids_equal_the_oracle(backend, fz):
    bank, rng = _bank(5)
    users = ["a", "b", 7, "a", "b", 7, "notext", "a"]
    texts = ["apple dog", "running paris", "piano piano ocean", "zzz", None, "sister birthday", "apple", "the"]
    Q = rng.normal(size=(len(users), 16))
    Q[3] = bank.snapshot().vectors[bank.snapshot().offsets[0] + 4]  # sits on the tied pair 4 / 5
    for out_k, probe_k in ((6, 4), (3, 9)):
        cfg = RFMemConfig(out_k=out_k, probe_k=probe_k, **fz)
        res = search(bank, Q, users, cfg, mode="dense", backend=backend, query_texts=texts)
        kf = max(out_k, probe_k)
        want_rows, want_sc = fused_topk(bank, Q, users, texts, cfg, kf)
        assert res.rows.tolist() == want_rows[:, :out_k].tolist()
        np.testing.assert_array_equal(res.scores, want_sc[:, :out_k].astype(np.float32))
        assert res.probe_scores.shape == (len(users), probe_k)
        np.testing.assert_array_equal(res.probe_scores, want_sc[:, :probe_k].astype(np.float32))
        # dense / lexical per-hit scores: exact cosine and BM25 of each hit
        truth = _hit_truth(bank, Q, users, texts)
        for i in range(len(users)):
            _assert_hit_scores(res, i, *truth[i])


def _hit_truth(bank, Q, users, texts) -> list:
    """Per query: (each row's exact cosine from the reference backend's full scan, each row's
    BM25 from the oracle, the user's first row)."""
    snap = bank.snapshot()
    dense_only = search(bank, Q, users, RFMemConfig(out_k=snap.num_items, probe_k=1), mode="dense",
                        backend="reference")  # fmt: skip
    out = []
    for i, user in enumerate(users):
        u = bank.user_index(user)
        cos = {r: s for r, s in zip(dense_only.rows[i], dense_only.scores[i]) if r >= 0}
        out.append((cos, bm25_scores(list(snap.texts[snap.offsets[u] : snap.offsets[u + 1]]), texts[i]),
                    snap.offsets[u]))  # fmt: skip
    return out


def _assert_hit_scores(res, row, cos, lex, a) -> None:
    """Row ``row`` of a result: each hit's dense score its exact cosine, its lexical score its
    BM25 (float32); padding NaN in both."""
    for j, r in enumerate(res.rows[row]):
        if r < 0:
            assert np.isnan(res.dense_scores[row, j]) and np.isnan(res.lexical_scores[row, j])
            continue
        assert res.dense_scores[row, j] == cos[r]
        assert res.lexical_scores[row, j] == np.float32(lex[r - a])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fz", FUSIONS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_recollected_hits_carry_exact_dense_and_bm25_scores(backend, fz):
    """The Recollection path with the lexical channel on (one query and a batch): each
    hit's dense score is its exact cosine (the reference backend's scan) and its lexical
    score its BM25 (the oracle), whichever way the search obtained them (the beam driver's
    own exact scores, or a re-scoring)."""
    bank, rng = _bank(6)
    users = ["a", "b", 7, "a", "notext"]
    texts = ["apple dog", "running paris", "piano ocean", None, "apple"]
    Q = rng.normal(size=(len(users), 16))
    cfg = RFMemConfig(out_k=6, probe_k=4, **fz)
    truth = _hit_truth(bank, Q, users, texts)
    batch = search(bank, Q, users, cfg, mode="recollection", backend=backend, query_texts=texts)
    for i, user in enumerate(users):
        one = search(bank, Q[i : i + 1], [user], cfg, mode="recollection", backend=backend, query_texts=texts[i : i + 1])
        for res, row in ((batch, i), (one, 0)):
            assert res.rows[row, 0] >= 0
            _assert_hit_scores(res, row, *truth[i])


@pytest.mark.parametrize("fz", FUSIONS[:1] + FUSIONS[3:6], ids=["convex", "adaptive", "rrf", "zscore"])
def test_fused_search_batch_invariant_and_prefix_consistent(fz):
    bank, rng = _bank(6)
    users = ["a", "b", 7, "a", "notext", "b"]
    texts = ["apple dog", "running paris london", None, "kite lemon mango", "apple", "zzz"]
    Q = rng.normal(size=(len(users), 16))
    wide = search(bank, Q, users, RFMemConfig(out_k=9, probe_k=9, **fz), mode="dense", backend="torch", query_texts=texts)
    for i in range(len(users)):
        one = search(bank, Q[i : i + 1], users[i : i + 1], RFMemConfig(out_k=9, probe_k=9, **fz), mode="dense",
                     backend="native" if "native" in BACKENDS else "torch", query_texts=texts[i : i + 1])  # fmt: skip
        assert one.rows[0].tolist() == wide.rows[i].tolist()
    chunked = search(bank, Q, users, RFMemConfig(out_k=9, probe_k=9, **fz), mode="dense", backend="torch",
                     query_texts=texts, max_batch=2)  # fmt: skip
    assert chunked.rows.tolist() == wide.rows.tolist()
    import rfmem_fast.search_lexical as mod
    old = mod.HYBRID_MATRIX_ENTRIES
    try:  # the batched fusion in steps of one or two queries
        mod.HYBRID_MATRIX_ENTRIES = 60
        stepped = search(bank, Q, users, RFMemConfig(out_k=9, probe_k=9, **fz), mode="dense", backend="torch",
                         query_texts=texts)  # fmt: skip
    finally:
        mod.HYBRID_MATRIX_ENTRIES = old
    assert stepped.rows.tolist() == wide.rows.tolist()
    np.testing.assert_array_equal(stepped.scores, wide.scores)
    if fz["fusion"] != "rrf":  # rrf's ranked lists are cut at max(depth, out_k): its prefix rule is per depth
        narrow = search(bank, Q, users, RFMemConfig(out_k=4, probe_k=4, **fz), mode="dense", backend="torch",
                        query_texts=texts)  # fmt: skip
        assert narrow.rows.tolist() == wide.rows[:, :4].tolist()


def test_query_without_known_token_gets_the_dense_result():
    bank, rng = _bank(7)
    Q = rng.normal(size=(4, 16))
    users = ["a", "b", "notext", 7]
    dense = search(bank, Q, users, RFMemConfig(out_k=6), mode="dense", backend="torch")
    for fz in FUSIONS:
        hy = search(bank, Q, users, RFMemConfig(out_k=6, **fz), mode="dense", backend="torch",
                    query_texts=["qqq zzz", "", None, "the of and"])  # fmt: skip
        assert hy.rows.tolist() == dense.rows.tolist()
        if fz["fusion"] != "rrf":
            np.testing.assert_array_equal(hy.scores, dense.scores)
        assert (hy.lexical_scores[hy.rows >= 0] == 0).all()


# ------------------------------------------------------------------ weight 0, signals, recollection
def test_lexical_weight_zero_changes_nothing():
    bank, rng = _bank(8)
    Q = rng.normal(size=(6, 16))
    users = ["a", "b", 7, "a", "b", "notext"]
    for mode in ("rfmem", "dense", "recollection"):
        base = search(bank, Q, users, RFMemConfig(), mode=mode, backend="torch")
        with_t = search(bank, Q, users, RFMemConfig(), mode=mode, backend="torch", query_texts=["apple"] * 6)
        for f in ("rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_scores", "dense_scores"):
            np.testing.assert_array_equal(getattr(base, f), getattr(with_t, f))
        assert base.ids.tolist() == with_t.ids.tolist() and base.probe_ids.tolist() == with_t.probe_ids.tolist()
        assert np.isnan(base.lexical_scores).all()
        ok = base.rows >= 0
        assert not np.isnan(base.dense_scores[ok]).any() and np.isnan(base.dense_scores[~ok]).all()


def test_familiarity_signals_and_recollection_stay_dense():
    """With the lexical channel on, mean / entropy / routes equal the dense probe's, the
    probe list is fused, and a recollecting query returns the list of the same search without the lexical channel."""
    bank, rng = _bank(9)
    Q = rng.normal(size=(8, 16))
    users = ["a", "b", 7, "a", "b", 7, "a", "b"]
    texts = ["apple dog", "running", "piano", "zzz", "sister", "ocean night", "kite", "lemon"]
    m = float(np.median(search(bank, Q, users, RFMemConfig(), mode="dense", backend="torch").mean))
    cfg0 = RFMemConfig(theta_high=m, theta_low=m)  # half the queries recollect
    cfg = cfg0.replace(lexical_weight=2.0, fusion="convex", lexical_norm="max")
    base = search(bank, Q, users, cfg0, mode="rfmem", backend="torch")
    hy = search(bank, Q, users, cfg, mode="rfmem", backend="torch", query_texts=texts)
    for f in ("mean", "entropy", "route", "rule", "rounds"):
        np.testing.assert_array_equal(getattr(base, f), getattr(hy, f))
    reco = hy.route == 1
    assert reco.any() and (~reco).any()
    assert hy.rows[reco].tolist() == base.rows[reco].tolist()  # the Recollection path: unchanged
    np.testing.assert_array_equal(hy.scores[reco], base.scores[reco])
    want_rows, _ = fused_topk(bank, Q, users, texts, cfg, cfg.out_k)
    assert hy.rows[~reco].tolist() == want_rows[~reco].tolist()  # the Familiarity path: fused
    assert hy.probe_ids.tolist() != base.probe_ids.tolist()  # the probe list is fused
    pools = search_candidates(bank, Q, users, cfg, mode="rfmem", backend="torch", query_texts=texts)
    assert pools.rows.shape[0] == 8


# ------------------------------------------------------------------ arguments, store, extras
def test_query_texts_checks():
    bank, rng = _bank(10)
    Q = rng.normal(size=(2, 16))
    cfg = RFMemConfig(lexical_weight=0.1)
    with pytest.raises(ValueError, match="query_texts"):
        search(bank, Q, ["a", "b"], cfg)
    with pytest.raises(ValueError, match="query_texts has 1 entries"):
        search(bank, Q, ["a", "b"], cfg, query_texts=["x"])
    with pytest.raises(TypeError, match="query_texts"):
        search(bank, Q, ["a", "b"], cfg, query_texts="ab")
    with pytest.raises(TypeError, match=r"query_texts\[1\]"):
        search(bank, Q, ["a", "b"], cfg, query_texts=["x", 3])
    for bad, match in ((dict(lexical_weight=-1.0), "lexical_weight"), (dict(fusion="max"), "fusion"),
                       (dict(lexical_norm="l2"), "lexical_norm"), (dict(lexical_rrf_k=0.0), "lexical_rrf_k"),
                       (dict(lexical_depth=0), "lexical_depth")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            RFMemConfig(**bad)
    with pytest.raises(ValueError, match="lexical_stemmer"):
        MemoryBank(4, lexical_stemmer="porter")


def test_stemmer_persists_and_missing_pystemmer_names_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("Stemmer")
    bank = MemoryBank(4, lexical_stemmer="english")
    bank.add("u", np.eye(4), ids=[0, 1, 2, 3], texts=["running dogs", "ran", "runs", None])
    assert _user_scores(bank, "u", "run")[[0, 2]].all()
    bank.save(tmp_path / "s")
    man = json.loads(next((tmp_path / "s").glob("snap-*/manifest.json")).read_text())
    assert man["lexical"]["stemmer"] == "english" and man["format_version"] == 4
    back = MemoryBank.load(tmp_path / "s", mmap=True)
    assert back.lexical_stemmer == "english"
    np.testing.assert_array_equal(_user_scores(back, "u", "run"), _user_scores(bank, "u", "run"))
    monkeypatch.setitem(sys.modules, "Stemmer", None)
    with pytest.raises(ImportError, match=r"rfmem_fast\[lexical\]"):
        MemoryBank(4, lexical_stemmer="english")


def test_store_written_before_the_lexical_index_builds_it_from_texts():
    from pathlib import Path

    data = Path(__file__).parent / "data" / "store_v1_float32"
    bank = MemoryBank.load(data, mmap=True)
    snap = bank.snapshot()
    for u, user in enumerate(snap.users):
        texts = list(snap.texts[snap.offsets[u] : snap.offsets[u + 1]])
        q = next((t for t in texts if t), "nothing")
        np.testing.assert_array_equal(_user_scores(bank, user, q), bm25_scores(texts, q))


def test_bench_hybrid_script_tiny(tmp_path):
    """bench/bench_hybrid.py at tiny sizes writes every figure (so the script cannot rot)."""
    import importlib.util
    from pathlib import Path

    if "native" not in available_backends():
        pytest.skip("the native backend is not built")
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_hybrid.py"
    spec = importlib.util.spec_from_file_location("bench_hybrid", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from rfmem_fast.backends.native import NativeBackend
    from rfmem_fast.search_lexical import KernelHits

    of_before, bm25_before = KernelHits.__dict__["of"], NativeBackend.__dict__["bm25_hits"]
    out = tmp_path / "h.json"
    args = ["--users", "2", "--chunks", "64", "--queries", "5", "--batch", "16", "--reps", "1", "--words", "12",
            "--vocab", "300", "--out", str(out)]  # fmt: skip
    assert mod.main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["single_p50_ms"]) >= {"dense", "convex_max", "convex_raw", "adaptive", "zscore", "rrf"}
    assert set(doc["batch_qps"]) >= {"dense", "convex_raw", "zscore"}
    assert doc["index_batch_bank"]["bytes_per_token"] > 0 and doc["loadavg"] and doc["machine"]["cores"] >= 1
    bd = doc["batch_breakdown_ms"]  # every stage timed inside the searches (native: probe_hits, bm25_hits)
    assert set(bd) >= {"dense_search", "hybrid_search", "tokenise", "bm25_hits", "probe_dense", "probe_hybrid"}
    assert all(bd[k] > 0 for k in ("dense_search", "hybrid_search", "tokenise", "bm25_hits", "probe_hybrid"))
    assert bd["probe_hybrid"] < bd["hybrid_search"] and bd["probe_dense"] < bd["dense_search"]
    sb = doc["single_breakdown_us"]  # one query's stages (KernelHits.of wrapped too), p50 us
    assert set(sb) >= {"dense_search", "hybrid_search", "tokenise", "kernel_hits", "bm25_hits", "probe_dense",
                       "probe_hybrid", "probe_extra", "rest_extra"}  # fmt: skip
    assert all(sb[k] > 0 for k in ("dense_search", "hybrid_search", "kernel_hits", "bm25_hits", "probe_hybrid"))
    assert sb["bm25_hits"] < sb["kernel_hits"] < sb["hybrid_search"] and sb["probe_dense"] < sb["dense_search"]
    assert doc["workload"]["single_block"] == 20
    assert KernelHits.__dict__["of"] is of_before and NativeBackend.__dict__["bm25_hits"] is bm25_before  # restored


def test_hybrid_searches_of_one_user_are_stable_while_another_user_is_written():
    """Concurrent writes to b (new vocabulary, deletions, snapshot rebuilds) never change a's fused results."""
    import threading

    bank, rng = _bank(11)
    Q = rng.normal(size=(3, 16))
    cfg = RFMemConfig(lexical_weight=0.5, fusion="adaptive", out_k=6)
    texts = ["apple dog", "paris running", "piano night"]
    want = search(bank, Q, ["a"] * 3, cfg, mode="dense", backend="torch", query_texts=texts)
    stop = threading.Event()

    def writer():
        j = 0
        while not stop.is_set():
            bank.add("b", rng.normal(size=(2, 16)), ids=[f"w{j}", f"w{j + 1}"], texts=[f"apple dog {j}", "paris piano"])
            bank.delete("b", [f"w{j}"])
            j += 2

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(30):
            got = search(bank, Q, ["a"] * 3, cfg, mode="dense", backend="torch", query_texts=texts)
            assert got.ids.tolist() == want.ids.tolist()
            np.testing.assert_array_equal(got.scores, want.scores)
    finally:
        stop.set()
        t.join()
    texts_b = bank.texts_of("b")
    np.testing.assert_array_equal(_user_scores(bank, "b", "apple dog"), bm25_scores(texts_b, "apple dog"))
