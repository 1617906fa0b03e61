"""The profile prior and the learned re-ranker: per-query
references, identical results on every backend, files, fitting, and a nested CV that never
fits on the held-out user."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends, search, search_candidates
from rfmem_fast.routing import (
    RERANK_FEATURES,
    LinearReranker,
    RerankerFileError,
    candidate_features,
    candidate_labels,
    concat_pools,
    fit_reranker,
    load_reranker,
    save_reranker,
    user_profiles,
)
from rfmem_fast.routing.files import resolve_reranker

ALWAYS = dict(theta_high=1.0, theta_low=1.0, tau=0.0)


def _bank(seed: int = 3, d: int = 16, sizes=(40, 25, 3, 60)):
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    for u, n in enumerate(sizes):
        bank.add(f"u{u}", rng.normal(size=(n, d)), [f"{u}.{i}" for i in range(n)])
    Q = rng.normal(size=(24, d))
    users = [f"u{i % len(sizes)}" for i in range(24)]
    return bank, Q, users


def _unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _parity_backends() -> list[str]:
    names = [b for b in ("reference", "torch", "native") if b in available_backends()]
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in available_backends():
        names.append("triton")
    return names


# ------------------------------------------------------------------ profile prior


def test_user_profiles_are_unit_segment_means():
    import torch

    rng = np.random.default_rng(0)
    X = rng.normal(size=(10, 4))
    off = np.array([0, 3, 3, 10])
    P = user_profiles(torch.from_numpy(X), torch.from_numpy(off)).numpy()
    np.testing.assert_allclose(P[0], _unit(X[:3].mean(0)), atol=1e-12)
    np.testing.assert_array_equal(P[1], 0.0)  # a user without items
    np.testing.assert_allclose(P[2], _unit(X[3:].mean(0)), atol=1e-12)
    with pytest.raises(ValueError, match="offsets"):
        user_profiles(torch.from_numpy(X), torch.tensor([0, 5, 3, 10]))


def test_profile_prior_equals_searching_the_folded_queries():
    bank, Q, users = _bank()
    snap = bank.snapshot()
    w = 0.4
    cfg = RFMemConfig(profile_weight=w)
    for mode in ("dense", "rfmem"):
        got = search(bank, Q, users, cfg, mode=mode, backend="torch")
        # reference: fold each query by hand with its user's mean vector, search without the prior
        seg = bank.segments_for(users, snapshot=snap)
        folded = np.stack([
            _unit(_unit(Q[i]) + w * _unit(snap.vectors[snap.offsets[s]: snap.offsets[s + 1]].astype(np.float64).mean(0)))
            for i, s in enumerate(seg)
        ])  # fmt: skip
        want = search(bank, folded, users, RFMemConfig(), mode=mode, backend="torch")
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_array_equal(got.route, want.route)
        np.testing.assert_allclose(got.scores, want.scores, atol=1e-6)
    assert (search(bank, Q, users, RFMemConfig(), mode="dense").rows != got.rows).any()  # the prior changes lists
    with pytest.raises(ValueError, match="profile_weight"):
        RFMemConfig(profile_weight=-0.1)


# ------------------------------------------------------------------ re-ranker: batched vs per query


def reference_rerank(features, weights, probe, hits, q, p, X, out_k):
    """One query at a time with Python lists: pool, features by definition, sort."""
    pool = []
    for it in list(probe) + list(hits):
        if it >= 0 and int(it) not in pool:
            pool.append(int(it))
    H = [int(h) for h in hits if h >= 0]
    c = np.zeros(X.shape[1])
    for h in H:
        c += X[h]
    c = c / (np.linalg.norm(c) + 1e-12)
    q64, p64 = np.asarray(q, np.float64), np.asarray(p, np.float64)
    feats = {
        it: {"cos": float(X[it] @ q64), "profile": float(X[it] @ p64), "support": float(X[it] @ c),
             "recollected": 1.0 if it in H else 0.0}
        for it in pool
    }  # fmt: skip
    score = {it: sum(w * feats[it][f] for f, w in zip(features, weights)) for it in pool}
    ranked = sorted(pool, key=lambda it: (-score[it], pool.index(it)))[:out_k]
    return ranked, [score[it] for it in ranked], feats


def test_rerank_matches_per_query_reference():
    rng = np.random.default_rng(11)
    n, d, r, kp, m, out_k = 70, 12, 30, 9, 15, 10
    X = _unit(rng.normal(size=(n, d))).astype(np.float32)
    Q = _unit(rng.normal(size=(r, d)))
    P = _unit(rng.normal(size=(r, d)))
    P[3] = 0.0  # a user without a profile
    probe = np.full((r, kp), -1, np.int64)
    hits = np.full((r, m), -1, np.int64)
    for i in range(r):
        perm = rng.permutation(n)
        npb, nh = int(rng.integers(0, kp + 1)), int(rng.integers(0, m + 1))
        probe[i, :npb] = perm[:npb]
        hits[i, :nh] = rng.permutation(np.r_[perm[: npb // 2], perm[kp : kp + m]])[:nh]  # overlaps the probe
    model = LinearReranker(["cos", "profile", "support", "recollected"], [1.0, 0.3, -0.2, 0.05], depth=kp)
    rows, scores = model.rerank(probe, hits, Q, P, X, out_k)
    cand, keep, feats = candidate_features(probe, hits, Q, P, X)
    for i in range(r):
        want, want_sc, want_f = reference_rerank(model.features, model.weights, probe[i], hits[i], Q[i], P[i], X.astype(np.float64), out_k)
        got = [int(x) for x in rows[i] if x >= 0]
        assert got == want, i
        np.testing.assert_allclose(scores[i, : len(want)], want_sc, rtol=1e-6)
        assert np.all(np.isneginf(scores[i, len(want):]))
        kept = {int(c): feats[i, j] for j, c in enumerate(cand[i]) if keep[i, j]}
        assert set(kept) == set(want_f)
        for it, f in kept.items():
            np.testing.assert_allclose(f, [want_f[it][name] for name in RERANK_FEATURES], atol=1e-12)
    # blocks of queries (a tiny block size) give the same result
    import rfmem_fast.routing.merge as merge_mod

    orig = merge_mod.in_blocks
    try:
        merge_mod.in_blocks = lambda fn, rr, width, dd: orig(fn, rr, width, 1 << 22)  # ~1 query per block
        import rfmem_fast.routing.rerank as rerank_mod

        rerank_mod.in_blocks = merge_mod.in_blocks
        rows2, scores2 = model.rerank(probe, hits, Q, P, X, out_k)
    finally:
        merge_mod.in_blocks = orig
        rerank_mod.in_blocks = orig
    np.testing.assert_array_equal(rows2, rows)
    np.testing.assert_array_equal(scores2, scores)


def test_search_candidates_are_probe_plus_hits():
    bank, Q, users = _bank()
    cfg = RFMemConfig(max_rounds=3)
    pools = search_candidates(bank, Q, users, cfg, mode="recollection", depth=7, backend="torch")
    dense = search(bank, Q, users, RFMemConfig(out_k=7), mode="dense", backend="torch")
    reco = search(bank, Q, users, cfg, mode="recollection", backend="torch")
    assert (pools.route == 1).all()
    for i in range(len(users)):
        kept = [int(x) for x, k in zip(pools.rows[i], pools.keep[i]) if k]
        top = [int(x) for x in dense.rows[i] if x >= 0]
        assert kept[: len(top)] == top  # the probe's top-depth first, best first
        assert set(int(x) for x in reco.rows[i] if x >= 0) <= set(kept)  # the recollection's output is in the pool
        np.testing.assert_allclose(pools.features[i, : len(top), 0], dense.scores[i, : len(top)], atol=1e-6)
    only_probe = search_candidates(bank, Q, users, cfg, mode="dense", depth=7, backend="torch")
    assert (only_probe.features[:, :, 3] == 0).all() and (only_probe.features[:, :, 2] == 0).all()
    with pytest.raises(ValueError, match="depth"):
        search_candidates(bank, Q, users, cfg, depth=0)


def test_reranker_in_search_equals_reranking_the_pools(tmp_path):
    bank, Q, users = _bank()
    model = LinearReranker(["cos", "profile", "support", "recollected"], [1.0, 0.5, 0.2, 0.01], depth=12)
    path = save_reranker(model, tmp_path / "m.json")
    for mode in ("rfmem", "dense", "recollection"):
        cfg = RFMemConfig(max_rounds=4, reranker=path)
        got = search(bank, Q, users, cfg, mode=mode, backend="torch")
        pools = search_candidates(bank, Q, users, RFMemConfig(max_rounds=4), mode=mode, depth=12, backend="torch")
        sc = model.score(pools.features)
        for i in range(len(users)):
            order = sorted((j for j in range(pools.rows.shape[1]) if pools.keep[i, j]), key=lambda j: (-sc[i, j], j))
            want = [int(pools.rows[i, j]) for j in order[:10]]
            assert [int(x) for x in got.rows[i] if x >= 0] == want, (mode, i)
        n_items = np.diff(bank.snapshot().offsets)[bank.segments_for(users)]
        assert ((got.rows >= 0).sum(axis=1) == np.minimum(10, n_items)).all()


@pytest.mark.parametrize("what", ["profile", "reranker"])
def test_identical_on_every_backend(what, tmp_path):
    bank, Q, users = _bank(5)
    if what == "profile":
        cfg = RFMemConfig(profile_weight=0.3, max_rounds=3)
    else:
        path = save_reranker(LinearReranker(["cos", "profile", "support", "recollected"], [1.0, 0.3, 0.4, 0.02], 15), tmp_path / "m.json")
        cfg = RFMemConfig(max_rounds=3, reranker=path, **ALWAYS)
    runs = {b: search(bank, Q, users, cfg, mode="rfmem", backend=b) for b in _parity_backends()}
    ref = runs.pop("reference")
    for name, res in runs.items():
        np.testing.assert_array_equal(res.rows, ref.rows, err_msg=name)
        np.testing.assert_array_equal(res.route, ref.route, err_msg=name)
        if what == "reranker":  # scored on the host in float64 from the bank's vectors: bit-identical
            np.testing.assert_array_equal(res.scores, ref.scores, err_msg=name)
        else:
            np.testing.assert_allclose(res.scores, ref.scores, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------ fitting


def test_fit_reranker_matches_an_explicit_pairwise_logistic_regression():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(2)
    r, L = 40, 9
    F = rng.normal(size=(r, L, 4))
    keep = rng.random((r, L)) < 0.9
    true_w = np.array([2.0, 1.0, 0.0, -1.0])
    Y = ((F @ true_w + rng.normal(scale=0.5, size=(r, L))) > 1.0).astype(np.int64) * keep
    model = fit_reranker(F, keep, Y, ["cos", "profile", "recollected"], depth=5, C=0.7)
    # reference: every (relevant, non-relevant) pair with loops, standardised, mirrored
    cols = [0, 1, 3]
    D = [F[i, a, cols] - F[i, b, cols] for i in range(r) for a in range(L) for b in range(L)
         if keep[i, a] and keep[i, b] and Y[i, a] == 1 and Y[i, b] == 0]  # fmt: skip
    D = np.array(D)
    sd = D.std(axis=0)
    clf = LogisticRegression(C=0.7, fit_intercept=False, max_iter=5000).fit(
        np.r_[D / sd, -D / sd], np.r_[np.ones(len(D)), np.zeros(len(D))]
    )
    np.testing.assert_allclose(model.weights, clf.coef_[0] / sd, rtol=1e-6)
    assert model.depth == 5 and model.features == ("cos", "profile", "recollected")
    assert np.corrcoef(model.weights, true_w[cols])[0, 1] > 0.95  # recovers the generating direction
    with pytest.raises(ValueError, match="nothing to learn"):
        fit_reranker(F, keep, np.zeros_like(Y))
    with pytest.raises(ValueError, match="features"):
        fit_reranker(F, keep, Y, ["cosine"])


def test_candidate_labels_and_concat_pools():
    ids = np.array([["a", "b", None], ["c", "a", "d"]], dtype=object)
    keep = np.array([[True, True, False], [True, False, True]])
    lab = candidate_labels(ids, keep, [["b"], {"x": ["a"], "y": ["d"]}])
    np.testing.assert_array_equal(lab, [[0, 1, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="entries"):
        candidate_labels(ids, keep, [["b"]])
    F, K, Y = concat_pools([(np.ones((2, 3, 4)), keep, lab), (np.ones((1, 5, 4)), np.ones((1, 5), bool), np.ones((1, 5), int))])
    assert F.shape == (3, 5, 4) and K[:2, 3:].sum() == 0 and Y.shape == (3, 5)


# ------------------------------------------------------------------ files and config


def _write(path, doc):
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_reranker_file_round_trip_and_bad_files(tmp_path):
    model = LinearReranker(["cos", "profile"], [17.0, 3.5], depth=20, meta={"fitted_on": "test"})
    path = save_reranker(model, tmp_path / "m.json")
    back = load_reranker(path)
    assert back.features == model.features and back.depth == 20 and back.meta == {"fitted_on": "test"}
    np.testing.assert_array_equal(back.weights, model.weights)
    assert resolve_reranker(RFMemConfig(reranker=path)).depth == 20
    good = json.loads((tmp_path / "m.json").read_text())
    cases = {
        "not valid JSON": "{oops",
        "not a reranker file": {**good, "format": "rfmem_fast.router"},
        "newer than this": {**good, "version": 2},
        "bad version": {**good, "version": "1"},
        "unknown reranker kind": {**good, "kind": "forest"},
        "missing key 'params'": {k: v for k, v in good.items() if k != "params"},
        "lack": {**good, "params": {"features": ["cos"], "weights": [1.0]}},
        "features must be distinct": {**good, "params": {**good["params"], "features": ["cos", "cos"]}},
        "weights must be a list of 2": {**good, "params": {**good["params"], "weights": [1.0, "x"]}},
        "not all be zero": {**good, "params": {**good["params"], "weights": [0.0, 0.0]}},
        "depth must be": {**good, "params": {**good["params"], "depth": 0}},
        "expected a JSON object": [1],
    }
    for i, (msg, doc) in enumerate(cases.items()):
        bad = _write(tmp_path / f"bad{i}.json", doc)
        with pytest.raises(RerankerFileError, match=msg) as e:
            load_reranker(bad)
        assert f"bad{i}.json" in str(e.value)
        with pytest.raises(ValueError, match="RFMemConfig.reranker"):  # resolved by search / Memory, not the config
            resolve_reranker(RFMemConfig(reranker=bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_reranker(RFMemConfig(reranker=str(tmp_path / "absent.json")))
    with pytest.raises(TypeError, match="reranker"):
        RFMemConfig(reranker=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="merge='none'"):
        RFMemConfig(reranker=path, merge="rescore")
    with pytest.raises(ValueError, match="without a reranker"):
        bank, Q, users = _bank()
        search_candidates(bank, Q, users, RFMemConfig(reranker=path))


# ------------------------------------------------------------------ nested CV on PersonaBench


@pytest.fixture(scope="module")
def data_dir(pb_embedded):  # pb_embedded fills the session's embedding cache
    from _shared import shared_dir

    return str(shared_dir() / "data" / "personabench" / "eval_data_v1")


def test_rerank_cv_never_fits_on_the_held_out_user(data_dir, pb_cache_dir, monkeypatch, tmp_path, capsys):
    """``rfmem tune --grid rerank``: every fit inside outer fold u excludes u; the model file
    written is the procedure's pick on all users, with its nested-CV figure in meta."""
    import rfmem_fast.cli as cli
    import rfmem_fast.tuning as tuning
    from rfmem_fast.cli import main

    monkeypatch.setenv("RFMEM_CACHE", str(pb_cache_dir))
    calls: list[tuple[int, list[str]]] = []
    folds: list[str] = []
    real = tuning._fit_spec

    def spy(spec, data, train_users, depth, C):
        calls.append((len(folds), list(train_users)))
        return real(spec, data, train_users, depth, C)

    monkeypatch.setattr(tuning, "_fit_spec", spy)
    monkeypatch.setattr(cli, "_say", lambda s: folds.append(s) if s.startswith("rerank cv: without") else None)
    figs, model = tmp_path / "cv.json", tmp_path / "model.json"
    rc = main(["tune", "personabench", "--data", data_dir, "--grid", "rerank", "--conditions", "minilm:0.0", "--no-timing",
               "--backend", "torch", "--json", str(figs), "--model-out", str(model)])  # fmt: skip
    assert rc == 0 and "Nested leave-one-user-out" in capsys.readouterr().out
    res = json.loads(figs.read_text())
    assert len(res["users"]) == 6 and len(res["folds"]) == 6 and len(folds) == 6
    assert {f["chosen"] for f in res["folds"]} <= {s["name"] for s in res["specs"]}
    for fold_index, train in calls:
        if fold_index < 6:  # inside outer fold `fold_index`: never its held-out user
            held_out = res["folds"][fold_index]["held_out_user"]
            assert held_out not in train and len(train) in (4, 5)
    assert any(fi == 6 and len(t) == 5 for fi, t in calls)  # the procedure on all users: inner fits on 5
    cv = res["cv"]["minilm noise 0.0"]
    assert cv["dense"] == pytest.approx(0.5385, abs=1e-3)
    # the pooled CV figure is the question-weighted mean of the held-out users' figures
    qs = _questions(data_dir)
    n = np.array([sum(1 for q in qs if q.user_key == f["held_out_user"] and q.is_evaluated) for f in res["folds"]])
    held = np.array([f["held_out_recall"]["minilm noise 0.0"] for f in res["folds"]])
    assert cv["tuned_cv"] == pytest.approx(float((held * n).sum() / n.sum()), abs=1e-9)
    if res["model"] is not None:
        m = load_reranker(model)
        assert list(m.features) == res["model"]["features"]
        assert m.meta["nested_cv_recall"]["minilm noise 0.0"]["nested_cv"] == pytest.approx(cv["tuned_cv"])
        assert m.meta["fitted_on"]["users"] == res["users"]


def test_calibrate_reranker_cli_on_custom_data(tmp_path, capsys):
    from rfmem_fast.cli import main

    from _shared import write_custom_questions

    bank, queries, users, _ = write_custom_questions(tmp_path, seed=1, n=30, noise=0.3)
    out = tmp_path / "rr.json"
    rc = main(["calibrate", "custom", "--store", str(tmp_path / "store"), "--queries", str(tmp_path / "q.npy"),
               "--labels", str(tmp_path / "labels.jsonl"), "--kind", "reranker", "--features", "cos,support,recollected",
               "--pool", "recollection", "--depth", "12", "--out", str(out), "--backend", "torch"])  # fmt: skip
    assert rc == 0 and "wrote the re-ranker" in capsys.readouterr().out
    m = load_reranker(out)
    assert m.features == ("cos", "support", "recollected") and m.depth == 12 and m.weights[0] > 0
    assert m.meta["pool_mode"] == "recollection" and m.meta["fitted_on"]["questions"] == 30
    res = search(bank, queries, users, RFMemConfig(reranker=str(out), **ALWAYS))
    assert (res.rows >= 0).all()
    with pytest.raises(SystemExit):
        main(["calibrate", "custom", "--store", str(tmp_path / "store"), "--queries", str(tmp_path / "q.npy"),
              "--labels", str(tmp_path / "labels.jsonl"), "--kind", "reranker", "--features", "cos,bm25", "--out", str(out)])
    assert "--features must be a comma list" in capsys.readouterr().err


def _questions(data_dir):
    from rfmem_fast.datasets.personabench import load_personabench

    return load_personabench(data_dir, 0.0).questions


def test_tune_profile_grid_scores_each_user_with_a_weight_chosen_without_it(data_dir, pb_cache_dir, monkeypatch):
    from rfmem_fast.routing import question_recalls
    from rfmem_fast.tuning import tune_personabench

    monkeypatch.setenv("RFMEM_CACHE", str(pb_cache_dir))
    res = tune_personabench(data_dir, grid="profile", timing=False, backend="torch", emb_cache=pb_cache_dir, cache_dir=None)
    from rfmem_fast.datasets.embedded import personabench_embeddings

    pb = personabench_embeddings(data_dir, 0.0, cache_dir=pb_cache_dir)
    gts = [q.gt_segment_ids for q in pb.data.questions]
    ev = np.array([q.is_evaluated for q in pb.data.questions])
    users = np.asarray(pb.users)
    dense = question_recalls(search(pb.bank, pb.Q, pb.users, RFMemConfig(), mode="dense", backend="torch"), gts, 10)
    held = np.zeros(len(users))
    for f in res.folds:
        w = f["chosen"].get("profile_weight", 0.0)
        assert f["chosen"]["theta_high"] == -1.0  # the profile grid never recollects
        sel = (users == f["held_out_user"]) & ev
        got = search(pb.bank, pb.Q, pb.users, RFMemConfig(profile_weight=w), mode="dense", backend="torch")
        held[sel] = question_recalls(got, gts, 10)[sel]
        assert f["held_out_recall"]["minilm noise 0.0"] == pytest.approx(held[sel].mean(), abs=1e-12)
    cv = res.cv["minilm noise 0.0"]
    assert cv["tuned_cv"] == pytest.approx(held[ev].mean(), abs=1e-12)
    diff = (held - dense)[ev]
    assert cv["gain_se"] == pytest.approx(diff.std(ddof=1) / np.sqrt(ev.sum()), rel=1e-9)
    from rfmem_fast.tuning import PROFILE_WEIGHTS

    assert res.recommended.profile_weight in PROFILE_WEIGHTS[1:]  # noise 0.0 alone: the prior helps (0.1)
