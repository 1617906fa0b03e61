"""The context score (RFMemConfig.context_weight / context_radius / thread_weight) against an
independent oracle: every row's exact base score (math.fsum dense scores, a Counter-based
BM25), then the definition evaluated item by item in plain Python, then a full sort.

Covers every backend that runs here, batch sizes, filters that split threads, chunked
items, deletes, near-ties, half and int8 banks, the fusions, the recollection route and
the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _exact_oracle import exact_f32, perturb, unit
from _lexical_oracle import bm25_scores, sharpness

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.lexical import CHUNK_SEP

D = 16
BACKENDS = [b for b in ("native", "torch", "reference") if b in rfmem_fast.available_backends()]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


# --------------------------------------------------------------------------- the oracle
def context_oracle(base, item_of, threads, positions, visible, w_n, w_s, r):
    """float64 [n]: each visible row's c (the definition, item by item), -inf elsewhere.

    base: float64 [n] exact base score of each row; item_of: [n] the row of each row's
    item; threads / positions: [n] per row (read at the item's row); visible: bool [n]."""
    n = len(base)
    ib = {}
    for row in range(n):
        if visible[row]:
            it = int(item_of[row])
            ib[it] = max(ib.get(it, -np.inf), float(base[row]))
    groups = {}
    for it in sorted(ib):
        if threads[it] is not None:
            groups.setdefault(threads[it], []).append(it)
    rank = {}
    for t, its in groups.items():
        its.sort(key=lambda j: (positions[j] is None, positions[j] or 0, j))
        for q, j in enumerate(its):
            rank[j] = (t, q)
    out = np.full(n, -np.inf)
    for row in range(n):
        if not visible[row]:
            continue
        it = int(item_of[row])
        if threads[it] is None:
            m, T = 0.0, ib[it]
        else:
            t, q = rank[it]
            its = groups[t]
            nb = [ib[j] for j in its[max(0, q - r) : q] + its[q + 1 : q + 1 + r]]
            m = max(nb) if nb else 0.0
            T = max(ib[j] for j in its)
        out[row] = float(base[row]) + w_n * m + w_s * T
    return out


def item_rows_of(ids):
    """[n] the row of each row's item (an extra chunk row "<p>\\x1f<j>" maps to p's row)."""
    pos = {i: r for r, i in enumerate(ids)}
    return np.array([pos[i.split(CHUNK_SEP)[0]] if isinstance(i, str) and CHUNK_SEP in i else r
                     for r, i in enumerate(ids)])  # fmt: skip


def base_scores(snap, a, b, q, qtext, config):
    """float64 [n]: exact dense (+ the fusion boost) of rows a..b-1 (chunk rows: their item's BM25)."""
    dense = np.array([float(exact_f32(q, snap.vectors[r])) for r in range(a, b)])
    w = float(config.lexical_weight)
    if w == 0 or qtext is None:
        return dense
    ids = list(snap.item_ids[a:b])
    item_of = item_rows_of(ids)
    texts = list(snap.texts[a:b])
    items = sorted(set(item_of.tolist()))
    lex_items = bm25_scores([texts[i] for i in items], qtext)
    lex = np.zeros(b - a)
    for j, it in enumerate(items):
        lex[item_of == it] = lex_items[j]
    if config.fusion == "convex" and config.lexical_norm == "raw":
        x = w * lex
    else:  # (unchunked users only)
        mx = lex.max(initial=0.0)
        f = lex / mx if mx > 0 else np.zeros_like(lex)
        if config.fusion == "convex":
            x = w * f
        elif config.fusion == "adaptive":
            x = (w * sharpness([v for v, t in zip(lex, texts) if t is not None])) * f
        else:  # zscore
            n = float(b - a)
            mu = float(np.cumsum(lex)[-1]) / n
            sd = np.sqrt(max(float(np.cumsum(lex * lex)[-1]) / n - mu * mu, 0.0))
            mean_d = float(q.astype(np.float64) @ snap.vectors[a:b].astype(np.float64).mean(axis=0))
            gap = max(float(dense.max()) - mean_d, 0.0)
            x = (w * gap / sd) * lex if sd > 0 else np.zeros_like(lex)
    return dense + x


def oracle_search(bank, Q, users, config, texts=None, visible=None):
    """(rows [b, k], c [b, k] float64, base [b, k]) of the exact top out_k by c."""
    snap = bank.snapshot()
    k = config.out_k
    Qn = np.stack([unit(q) for q in np.asarray(Q, dtype=np.float32)])
    b = len(users)
    rows = np.full((b, k), -1, dtype=np.int64)
    cs = np.full((b, k), np.nan)  # (padding as SearchResult pads: NaN context, -inf score)
    bs = np.full((b, k), -np.inf)
    thr, pos = snap.threads_or_none, snap.positions_or_missing
    for i, user in enumerate(users):
        u = bank.user_index(user)
        a, e = int(snap.offsets[u]), int(snap.offsets[u + 1])
        base = base_scores(snap, a, e, Qn[i], None if texts is None else texts[i], config)
        vis = np.ones(e - a, dtype=bool) if visible is None else visible(i, snap, a, e)
        item_of = item_rows_of(list(snap.item_ids[a:e]))
        t = [thr[a + j] for j in range(e - a)]
        p = [None if pos[a + j] < 0 else int(pos[a + j]) for j in range(e - a)]
        c = context_oracle(base, item_of, t, p, vis, config.context_weight, config.thread_weight,
                           config.context_radius)  # fmt: skip
        ok = np.flatnonzero(vis)
        order = ok[np.lexsort((ok, -c[ok]))][:k]
        rows[i, : order.size] = order + a
        cs[i, : order.size] = c[order]
        bs[i, : order.size] = base[order]
    return rows, cs, bs


@pytest.fixture(params=[True, False], ids=["kernel", "numpy"])
def path(request, monkeypatch):
    """Run a test with the compiled context kernel (where built) and with the numpy path."""
    import rfmem_fast.context as C

    if request.param and C._KERNEL is None:
        pytest.skip("the native extension has no context kernel")
    monkeypatch.setattr(C, "USE_KERNEL", request.param)
    return request.param


def check(res, oracle):
    rows, cs, bs = oracle
    np.testing.assert_array_equal(res.rows, rows)
    np.testing.assert_array_equal(res.context_scores, cs.astype(np.float32))
    np.testing.assert_array_equal(res.scores, bs.astype(np.float32))


# --------------------------------------------------------------------------- banks
def conversation_bank(seed: int, users: int = 3, dtype: str = "float32", texts: bool = False) -> MemoryBank:
    """Users of 30-70 items: threads of 1-9 turns (positions shuffled against insertion
    order, some missing), unthreaded items, int and str thread ids."""
    rng = np.random.default_rng(seed)
    bank = MemoryBank(D, dtype=dtype)
    for u in range(users):
        n = int(rng.integers(30, 70))
        centres = rng.normal(size=(6, D))
        X = centres[rng.integers(6, size=n)] + 0.6 * rng.normal(size=(n, D))
        thr, pos, j = [], [], 0
        while j < n:
            size = int(rng.integers(1, 10))
            tid = int(rng.integers(1000)) if rng.random() < 0.3 else f"s{u}-{j}"
            order = rng.permutation(size)
            for o in order[: n - j]:
                if rng.random() < 0.15:
                    thr.append(None)
                    pos.append(None)
                else:
                    thr.append(tid)
                    pos.append(None if rng.random() < 0.1 else int(o))
                j += 1
        tx = [" ".join(rng.choice(WORDS, size=4)) for _ in range(n)] if texts else None
        meta = [{"keep": bool(rng.random() < 0.6)} for _ in range(n)]
        bank.add(f"user{u}", X, ids=[f"m{j}" for j in range(n)], texts=tx, threads=thr, positions=pos, metadata=meta)
    return bank


def queries(seed: int, b: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(b, D)).astype(np.float32)


CONFIGS = [
    dict(context_weight=0.5, context_radius=2, thread_weight=0.3),
    dict(context_weight=0.2, context_radius=1, thread_weight=0.0),
    dict(context_weight=0.0, context_radius=2, thread_weight=0.5),
    dict(context_weight=1.0, context_radius=5, thread_weight=0.1),
]


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ckw", CONFIGS)
def test_dense_matches_oracle(backend, ckw, path):
    bank = conversation_bank(1)
    Q = queries(2, 6)
    users = ["user0", "user1", "user2", "user0", "user2", "user1"]
    cfg = RFMemConfig(out_k=8, probe_k=8, **ckw)
    res = search(bank, Q, users, cfg, mode="dense", backend=backend)
    check(res, oracle_search(bank, Q, users, cfg))
    assert np.all(np.isfinite(res.dense_scores))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_and_torch_output(backend, path):
    bank = conversation_bank(3)
    Q = queries(4, 7)
    users = ["user1", "user0", "user2", "user1", "user0", "user2", "user1"]
    cfg = RFMemConfig(out_k=6, probe_k=6, context_weight=0.3, thread_weight=0.2)
    whole = search(bank, Q, users, cfg, mode="dense", backend=backend)
    for i in range(len(users)):
        one = search(bank, Q[i : i + 1], users[i : i + 1], cfg, mode="dense", backend=backend)
        np.testing.assert_array_equal(one.rows[0], whole.rows[i])
        np.testing.assert_array_equal(one.context_scores[0], whole.context_scores[i])
    chunks = search(bank, Q, users, cfg, mode="dense", backend=backend, max_batch=3)
    np.testing.assert_array_equal(chunks.rows, whole.rows)
    dev = search(bank, torch.from_numpy(Q), users, cfg, mode="dense", backend=backend, output="torch").to_result()
    np.testing.assert_array_equal(dev.rows, whole.rows)
    np.testing.assert_array_equal(dev.context_scores, whole.context_scores)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_convex_raw_matches_oracle(backend, path):
    bank = conversation_bank(5, texts=True)
    Q = queries(6, 5)
    users = ["user0", "user1", "user2", "user2", "user0"]
    qt = ["alpha beta", "gamma", "omega kappa sigma", None, "zeta"]
    cfg = RFMemConfig(out_k=8, probe_k=8, lexical_weight=0.07, fusion="convex", lexical_norm="raw",
                      context_weight=0.5, thread_weight=0.3)  # fmt: skip
    res = search(bank, Q, users, cfg, mode="dense", backend=backend, query_texts=qt)
    check(res, oracle_search(bank, Q, users, cfg, texts=qt))
    # each hit's lexical score is reported as the fusion sees it
    snap = bank.snapshot()
    u = bank.user_index("user0")
    a, e = int(snap.offsets[u]), int(snap.offsets[u + 1])
    lex = bm25_scores(list(snap.texts[a:e]), qt[0])
    np.testing.assert_allclose(res.lexical_scores[0], lex[res.rows[0] - a], rtol=1e-6)


@pytest.mark.parametrize("fusion", [dict(fusion="convex", lexical_norm="max"), dict(fusion="adaptive"),
                                    dict(fusion="zscore")])  # fmt: skip
def test_other_fusions_match_oracle_on_every_backend(fusion):
    bank = conversation_bank(7, texts=True)
    Q = queries(8, 4)
    users = ["user0", "user1", "user2", "user1"]
    qt = ["alpha beta", "gamma delta", "omega", "theta sigma"]
    cfg = RFMemConfig(out_k=7, probe_k=7, lexical_weight=0.2, context_weight=0.4, thread_weight=0.2, **fusion)
    want = oracle_search(bank, Q, users, cfg, texts=qt)
    for backend in BACKENDS:
        res = search(bank, Q, users, cfg, mode="dense", backend=backend, query_texts=qt)
        np.testing.assert_array_equal(res.rows, want[0])
        np.testing.assert_allclose(res.context_scores, want[1].astype(np.float32), rtol=2e-7, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_split_threads(backend):
    bank = conversation_bank(9, texts=True)
    Q = queries(10, 6)
    users = ["user0", "user1", "user2", "user0", "user1", "user2"]
    flt = [{"keep": True}, None, {"keep": True}, {"$not": {"keep": True}}, {"keep": True}, None]
    snap = bank.snapshot()
    keep_of = {}
    for u in snap.users:
        keep_of[u] = np.array([m["keep"] for m in bank.get_metadata(u)])

    def visible(i, snap, a, e):
        f = flt[i]
        k = keep_of[users[i]]
        if f is None:
            return np.ones(e - a, dtype=bool)
        return k if "keep" in f else ~k

    for ckw in CONFIGS[:2]:
        cfg = RFMemConfig(out_k=9, probe_k=9, **ckw)
        res = search(bank, Q, users, cfg, mode="dense", backend=backend, filters=flt)
        check(res, oracle_search(bank, Q, users, cfg, visible=visible))
        cfg = cfg.replace(lexical_weight=0.05, fusion="convex", lexical_norm="raw")
        qt = ["alpha", "beta gamma", None, "omega", "sigma kappa", "alpha theta"]
        res = search(bank, Q, users, cfg, mode="dense", backend=backend, filters=flt, query_texts=qt)
        check(res, oracle_search(bank, Q, users, cfg, texts=qt, visible=visible))


def test_filter_on_thread_and_padding():
    bank = conversation_bank(11)
    snap = bank.snapshot()
    u0 = bank.user_index("user0")
    a = int(snap.offsets[u0])
    t0 = next(t for t in snap.threads[a:] if t is not None)
    Q = queries(12, 2)
    users = ["user0", "user0"]
    flt = [{"thread": t0}, {"position": {"$lte": 1}}]
    cfg = RFMemConfig(out_k=12, probe_k=12, context_weight=0.5, thread_weight=0.5)

    def visible(i, snap, a, e):
        if i == 0:
            return np.array([t == t0 for t in snap.threads[a:e]])
        return np.array([0 <= p <= 1 for p in snap.positions[a:e]])

    for backend in BACKENDS:
        res = search(bank, Q, users, cfg, mode="dense", backend=backend, filters=flt)
        check(res, oracle_search(bank, Q, users, cfg, visible=visible))
        assert (res.rows[0] == -1).any() and np.isnan(res.context_scores[0][res.rows[0] == -1]).all()


def test_chunked_items():
    rng = np.random.default_rng(13)
    bank = MemoryBank(D)
    ids, thr, pos, tx, X = [], [], [], [], []
    for j in range(24):
        parent = f"p{j}"
        ids.append(parent)
        thr.append(f"t{j // 6}" if j % 7 else None)
        pos.append(j % 6 if j % 7 else None)
        tx.append(" ".join(rng.choice(WORDS, size=5)))
        X.append(rng.normal(size=D))
        for c in range(1, int(rng.integers(0, 4)) + 1):  # extra chunk rows: no text, the item's thread
            ids.append(f"{parent}{CHUNK_SEP}{c}")
            thr.append(thr[-1])
            pos.append(pos[-1])
            tx.append(None)
            X.append(rng.normal(size=D))
    meta = [{"keep": bool(rng.random() < 0.7)} for _ in ids]
    for r, i in enumerate(ids):  # a chunk row carries its item's metadata (as Memory stores it)
        if CHUNK_SEP in i:
            meta[r] = meta[ids.index(i.split(CHUNK_SEP)[0])]
    bank.add("u", np.array(X), ids=ids, texts=tx, threads=thr, positions=pos, metadata=meta)
    Q = queries(14, 4)
    users = ["u"] * 4
    qt = ["alpha", "beta gamma", "omega", None]
    keep = np.array([m["keep"] for m in meta])
    for ckw in CONFIGS:
        cfg = RFMemConfig(out_k=10, probe_k=10, lexical_weight=0.05, fusion="convex", lexical_norm="raw", **ckw)
        want = oracle_search(bank, Q, users, cfg, texts=qt)
        wantf = oracle_search(bank, Q, users, cfg, texts=qt, visible=lambda i, s, a, e: keep)
        for backend in BACKENDS:
            check(search(bank, Q, users, cfg, mode="dense", backend=backend, query_texts=qt), want)
            check(search(bank, Q, users, cfg, mode="dense", backend=backend, query_texts=qt, filters={"keep": True}),
                  wantf)  # fmt: skip


def test_deletes_updates_and_store(tmp_path, path):
    bank = conversation_bank(15)
    snap = bank.snapshot()
    ids0 = bank.item_ids_of("user0")
    bank.delete("user0", ids0[::3])
    bank.update("user1", bank.item_ids_of("user1")[:2], queries(16, 2), threads=["new", "new"], positions=[0, 1])
    Q = queries(17, 4)
    users = ["user0", "user1", "user2", "user0"]
    cfg = RFMemConfig(out_k=8, probe_k=8, context_weight=0.6, context_radius=3, thread_weight=0.2)
    want = oracle_search(bank, Q, users, cfg)
    for backend in BACKENDS:
        check(search(bank, Q, users, cfg, mode="dense", backend=backend), want)
    bank.save(tmp_path / "s")
    loaded = MemoryBank.load(tmp_path / "s")
    check(search(loaded, Q, users, cfg, mode="dense", backend=BACKENDS[0]), want)
    assert snap is not bank.snapshot()


def test_near_ties_are_exact(path):
    """Rows that are one-ulp perturbations of a few vectors: scan scores within the scan's
    bound of each other, so the order rests on the exact finish."""
    rng = np.random.default_rng(18)
    base = [unit(rng.normal(size=D).astype(np.float32)) for _ in range(3)]
    X = np.stack([perturb(base[j % 3], rng, 3) for j in range(60)])
    X[10] = X[11]  # exact duplicates: ties broken by the smaller row
    bank = MemoryBank(D)
    bank.add("u", X, ids=list(range(60)), threads=[j // 5 for j in range(60)], positions=[(7 * j) % 5 for j in range(60)])
    # a second user whose threads hold one vector each, perturbed: every neighbour and
    # thread maximum is a near-tie that only the exact scores decide
    Y = np.stack([perturb(base[(j // 6) % 3], rng, 4) for j in range(48)])
    bank.add("v", Y, ids=list(range(48)), threads=[j // 6 for j in range(48)], positions=[(5 * j) % 6 for j in range(48)])
    Q = np.stack([perturb(base[0], rng, 2), base[1], perturb(base[2], rng, 5)] * 2)
    users = ["u"] * 3 + ["v"] * 3
    for ckw in CONFIGS:
        cfg = RFMemConfig(out_k=15, probe_k=15, **ckw)
        want = oracle_search(bank, Q, users, cfg)
        for backend in BACKENDS:
            check(search(bank, Q, users, cfg, mode="dense", backend=backend), want)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_half_and_int8_banks(dtype):
    bank = conversation_bank(19, dtype=dtype)
    Q = queries(20, 4)
    users = ["user2", "user0", "user1", "user0"]
    cfg = RFMemConfig(out_k=8, probe_k=8, context_weight=0.5, thread_weight=0.3)
    want = oracle_search(bank, Q, users, cfg)
    for backend in BACKENDS:
        check(search(bank, Q, users, cfg, mode="dense", backend=backend), want)


def test_off_is_bit_for_bit_and_no_threads_is_base_plus_thread_term():
    bank = conversation_bank(21, texts=True)
    Q = queries(22, 5)
    users = ["user0", "user1", "user2", "user0", "user1"]
    qt = ["alpha", "beta", "gamma", "delta", "omega"]
    for cfg in (RFMemConfig(), RFMemConfig.recommended(context_weight=0.0, thread_weight=0.0)):
        off = cfg.replace(context_radius=4)  # the radius alone changes nothing
        for backend in BACKENDS:
            a = search(bank, Q, users, cfg, backend=backend, query_texts=qt)
            b = search(bank, Q, users, off, backend=backend, query_texts=qt)
            for f in ("rows", "scores", "dense_scores", "lexical_scores", "probe_scores", "route"):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
            assert np.isnan(a.context_scores).all()
    # a bank without threads: c = b + w_s * b, so the order is the base order
    plain = MemoryBank(D)
    plain.add("u", np.random.default_rng(23).normal(size=(40, D)), ids=list(range(40)))
    cfg = RFMemConfig(out_k=10, probe_k=10, context_weight=0.7, thread_weight=0.25)
    res = search(plain, Q, ["u"] * 5, cfg, mode="dense")
    dense = search(plain, Q, ["u"] * 5, RFMemConfig(out_k=10, probe_k=10), mode="dense")
    np.testing.assert_array_equal(res.rows, dense.rows)
    s = dense.scores.astype(np.float64)
    np.testing.assert_array_equal(res.context_scores, (s + 0.25 * s).astype(np.float32))


def test_rfmem_mode_routes_and_refusals():
    bank = conversation_bank(24)
    Q = queries(25, 6)
    users = ["user0", "user1", "user2"] * 2
    probe = search(bank, Q, users, RFMemConfig(out_k=6, probe_k=6), mode="dense")
    cut = float(np.median(probe.mean))  # half the queries at or above it: familiarity; the others recollect
    cfg = RFMemConfig(out_k=6, probe_k=6, context_weight=0.5, thread_weight=0.3, theta_high=cut, theta_low=cut)
    for backend in BACKENDS:
        res = search(bank, Q, users, cfg, mode="rfmem", backend=backend)
        plain = search(bank, Q, users, cfg.replace(context_weight=0.0, thread_weight=0.0), mode="rfmem",
                       backend=backend)  # fmt: skip
        dense = search(bank, Q, users, cfg, mode="dense", backend=backend)
        reco = res.route == 1
        assert reco.any() and (~reco).any()
        np.testing.assert_array_equal(res.rows[reco], plain.rows[reco])  # the Recollection path's hits
        assert np.isnan(res.context_scores[reco]).all()
        np.testing.assert_array_equal(res.rows[~reco], dense.rows[~reco])
        np.testing.assert_array_equal(res.context_scores[~reco], dense.context_scores[~reco])
    for backend in BACKENDS:  # mode "recollection": every query the Recollection path's hits, no context score
        res = search(bank, Q, users, cfg, mode="recollection", backend=backend)
        plain = search(bank, Q, users, cfg.replace(context_weight=0.0, thread_weight=0.0), mode="recollection",
                       backend=backend)  # fmt: skip
        np.testing.assert_array_equal(res.rows, plain.rows)
        np.testing.assert_array_equal(res.scores, plain.scores)
        assert np.isnan(res.context_scores).all()
    with pytest.raises(ValueError, match="fusion 'rrf'"):
        RFMemConfig(lexical_weight=1.0, fusion="rrf", thread_weight=0.1)
    with pytest.raises(ValueError, match="context_radius"):
        RFMemConfig(context_radius=0)
    with pytest.raises(TypeError, match="context_weight"):
        RFMemConfig(context_weight="0.5")


@pytest.mark.parametrize("ckw", CONFIGS)
def test_exact_finish_under_adversarial_scan_scores(ckw, path):
    """context_topk given scan scores off by up to a large declared bound (1e-3): the
    approximate neighbour / thread maxima and the candidates are often wrong, the exact
    finish must still give the oracle's rows and float64 scores exactly."""
    from rfmem_fast.backends.base import SegmentScores
    from rfmem_fast.context import context_topk
    from rfmem_fast.filters import compile_filters

    bank = conversation_bank(26, texts=True)
    rng = np.random.default_rng(27)
    for u in range(3):  # threads of near-duplicates: exact scores closer than the bound
        bank.delete(f"user{u}", [i for i in bank.item_ids_of(f"user{u}") if int(i[1:]) % 2])
        n = 40
        centre = rng.normal(size=(8, D))
        X = centre[np.arange(n) // 5] + 1e-4 * rng.normal(size=(n, D))
        bank.add(f"user{u}", X, ids=[f"x{j}" for j in range(n)], texts=[" ".join(rng.choice(WORDS, 3)) for _ in range(n)],
                 threads=[f"n{j // 5}" for j in range(n)], positions=[(3 * j) % 5 for j in range(n)],
                 metadata=[{"keep": bool(rng.random() < 0.7)} for _ in range(n)])  # fmt: skip
    snap = bank.snapshot()
    users = ["user0", "user1", "user2", "user1", "user0"]
    seg = np.array([bank.user_index(u) for u in users])
    raw = queries(28, len(users))
    Q = np.stack([unit(q) for q in raw])
    qt = ["alpha beta", "gamma", "omega sigma", "theta", "kappa"]
    cfg = RFMemConfig(out_k=9, probe_k=9, lexical_weight=0.02, fusion="convex", lexical_norm="raw", **ckw)
    B = 1e-3
    ptr = np.zeros(len(users) + 1, dtype=np.int64)
    fs, boosts = [], []
    for i, u in enumerate(seg):
        a, e = int(snap.offsets[u]), int(snap.offsets[u + 1])
        ex = np.array([float(exact_f32(Q[i], snap.vectors[r])) for r in range(a, e)])
        f = (ex + rng.uniform(-0.9 * B, 0.9 * B, size=e - a)).astype(np.float32)
        near = np.flatnonzero(np.abs(f.astype(np.float64) - float(f[0])) < 0.05 * B)
        f[near] = f[0]  # equal scan scores for rows whose exact scores differ (within the bound)
        fs.append(f)
        boosts.append(0.02 * bm25_scores(list(snap.texts[a:e]), qt[i]))
        ptr[i + 1] = ptr[i] + (e - a)
    scan = SegmentScores(np.concatenate(fs), ptr, 0.0, B)  # B(q) = B
    flt = [None, {"keep": True}, None, {"$not": {"keep": True}}, {"keep": True}]
    for filters in (None, flt):
        sel = compile_filters(bank, snap, seg, filters)
        rows, c, base, dense, _ = context_topk(snap, {}, Q, seg, scan, boosts, cfg, cfg.out_k, sel, 1.0)

        def visible(i, s, a, e):
            if filters is None or filters[i] is None:
                return np.ones(e - a, dtype=bool)
            keep = np.array([m["keep"] for m in bank.get_metadata(users[i])])
            return keep if "keep" in filters[i] else ~keep

        w_rows, w_c, w_b = oracle_search(bank, raw, users, cfg, texts=qt, visible=visible)
        np.testing.assert_array_equal(rows, w_rows)
        np.testing.assert_array_equal(c, w_c)  # float64, bit for bit
        np.testing.assert_array_equal(base, w_b)


def test_exact_maxima_from_items_that_are_no_candidates(path):
    """A neighbour maximum and a thread maximum held by items that are not candidates
    themselves, each a near-tie whose scan scores point to the wrong item: the exact
    finish must score both near-tied items exactly."""
    from rfmem_fast.backends.base import SegmentScores
    from rfmem_fast.context import context_topk

    def vec(cos):  # a unit vector whose cosine with e0 is about ``cos``
        v = np.zeros(D)
        v[0], v[1] = cos, np.sqrt(1.0 - cos * cos)
        return v

    # thread "a" (r = 1): X1, Y1, I, Y2, Y3, X2 by position; X1 / X2 hold the thread maximum
    # (a near-tie), I and Y2 are the top items by c. Thread "h": S1, H, S2: H's neighbour
    # maximum is the near-tie S1 / S2. Fillers: unthreaded, low.
    names = ["X1", "Y1", "I", "Y2", "Y3", "X2", "S1", "H", "S2"] + [f"f{j}" for j in range(12)]
    cos = [0.9000, 0.10, 0.8990, 0.8991, 0.10, 0.90004, 0.50000, 0.9500, 0.50003] + [0.2 + 0.01 * j for j in range(12)]
    thr = ["a"] * 6 + ["h"] * 3 + [None] * 12
    bank = MemoryBank(D)
    bank.add("u", np.stack([vec(c) for c in cos]), ids=names, threads=thr, positions=[0, 1, 2, 3, 4, 5, 0, 1, 2] + [None] * 12)
    snap = bank.snapshot()
    raw = np.zeros((1, D), dtype=np.float32)
    raw[0, 0] = 1.0
    Q = raw.copy()
    ex = np.array([float(exact_f32(Q[0], snap.vectors[r])) for r in range(len(names))])
    B = 1e-3
    f = ex.copy()
    for hi, lo in ((5, 0), (8, 6)):  # the true maximum looks lower, the other higher
        assert ex[hi] > ex[lo]
        f[hi] -= 0.45 * B
        f[lo] += 0.45 * B
    scan = SegmentScores(f.astype(np.float32), np.array([0, len(names)]), 0.0, B)
    cfg = RFMemConfig(out_k=3, probe_k=3, context_weight=0.5, context_radius=1, thread_weight=0.3)
    rows, c, base, dense, _ = context_topk(snap, {}, Q, np.array([0]), scan, None, cfg, 3, None, 1.0)
    w_rows, w_c, _ = oracle_search(bank, raw, ["u"], cfg)
    np.testing.assert_array_equal(rows, w_rows)
    np.testing.assert_array_equal(c, w_c)
    assert set(np.array(names)[rows[0]]) >= {"I", "H"}


def test_kernel_on_several_threads_equals_one_thread():
    """A hybrid context batch on two threads of the pool (mode 'always') gives the rows and
    context scores of one thread, with the helpers doing part of the work. (The kernel's
    per-thread scratch is the calling thread's vector: a helper once indexed its own empty
    thread_local one and crashed; reproduced with `rfmem tune context --encoders mpnet
    --noise 0.5`, not by this small case.)"""
    import rfmem_fast.context as C

    native = pytest.importorskip("rfmem_fast._native")
    if C._KERNEL is None or "native" not in BACKENDS:
        pytest.skip("the native extension has no context kernel")
    rng = np.random.default_rng(40)
    bank = MemoryBank(D)
    for u in range(2):  # enough rows that the kernel asks for two threads
        n = 6000
        bank.add(f"big{u}", rng.normal(size=(n, D)), ids=list(range(n)),
                 texts=[" ".join(rng.choice(WORDS, size=4)) for _ in range(n)],
                 threads=[f"t{j // 12}" for j in range(n)], positions=[j % 12 for j in range(n)])
    Q = queries(41, 512)
    users = [f"big{i % 2}" for i in range(512)]
    qt = [" ".join(rng.choice(WORDS, size=2)) for _ in range(512)]
    cfg = RFMemConfig.recommended(out_k=10, probe_k=10)
    prev = native.set_thread_pool("always")
    try:
        rfmem_fast.set_num_threads(1)
        one = search(bank, Q, users, cfg, mode="dense", backend="native", query_texts=qt)
        rfmem_fast.set_num_threads(2)
        two = search(bank, Q, users, cfg, mode="dense", backend="native", query_texts=qt)
        before = native.pool_counters()["items_helper"]
        search(bank, Q, users, cfg, mode="dense", backend="native", query_texts=qt)
        helped = native.pool_counters()["items_helper"] - before
    finally:
        rfmem_fast.set_num_threads(None)
        native.set_thread_pool(prev)
    np.testing.assert_array_equal(two.rows, one.rows)
    np.testing.assert_array_equal(two.context_scores, one.context_scores)
    assert helped > 0  # the helpers did run some of the work
