"""The learned second stage: features against a plain-Python oracle on a hand-made bank,
model files, input errors, and re-ranked lists that are subsets of the candidates."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.lexical import STOPWORDS_EN
from rfmem_fast.second_stage import (
    LINEAR_FEATURES,
    STAGE_FEATURES,
    LinearStage,
    StageFileError,
    TreeStage,
    features_from_result,
    fit_linear_stage,
    fit_tree_stage,
    load_stage,
    query_terms,
    rerank_result,
    save_stage,
    stage_features,
    stage_labels,
)

D = 8
NEVER = dict(theta_high=-1.0, theta_low=-1.0, tau=0.0)
# user "a": a conversation of two sessions (threads, positions), creation times out of row order
A_TEXTS = [
    "Caroline went to the LGBTQ support group on 7 May 2023.",
    "Melanie painted a sunrise in 2022, she loves painting.",
    "Caroline: I moved from Sweden 4 years ago.",
    "Melanie: my kids love the beach, we camp every summer.",
    "Caroline researched adoption agencies in June.",
    "The weather is nice today.",
    "Melanie ran a charity race on Saturday for mental health.",
    None,
]
A_THREADS = ["s1", "s1", "s1", "s2", "s2", "s2", None, "s1"]
A_POS = [0, 2, 1, 0, 1, None, None, 3]
A_TIMES = [100.0, 300.0, 200.0, 500.0, 400.0, 600.0, 50.0, 700.0]
B_TEXTS = ["Caroline has a dog named Oscar.", "Nothing about anyone here.", "Painting in May 2023 with Oscar."]
QUERIES = ["When did Caroline go to the support group in May 2023?", "What did Melanie paint in 2022?",
           "How many years ago did Caroline move from Sweden?", "what about painting"]  # fmt: skip
QUSERS = ["a", "a", "a", "b"]


def _bank():
    rng = np.random.default_rng(7)
    bank = MemoryBank(D)  # no stemmer: the oracle tokenises with the plain regex
    bank.add("a", rng.normal(size=(len(A_TEXTS), D)), [f"a{i}" for i in range(len(A_TEXTS))], texts=A_TEXTS,
             created_at=A_TIMES, threads=A_THREADS, positions=A_POS)  # fmt: skip
    bank.add("b", rng.normal(size=(len(B_TEXTS), D)), [f"b{i}" for i in range(len(B_TEXTS))], texts=B_TEXTS)
    Q = rng.normal(size=(len(QUERIES), D))
    return bank, Q


def _cfg(n: int) -> RFMemConfig:
    return RFMemConfig(**NEVER, lexical_weight=0.03, lexical_norm="raw", context_weight=0.5, context_radius=1,
                       thread_weight=0.3, out_k=n)  # fmt: skip


# ------------------------------------------------------------------ the oracle


def _toks(text):
    return [t for t in re.findall(r"\w\w+", text.lower()) if t not in STOPWORDS_EN]


def _oracle(bank, Q, texts_q, users, n):
    """Per query, per candidate: a dict feature -> value, from the texts and the bank's arrays only."""
    res = search(bank, Q, users, _cfg(n), mode="rfmem", query_texts=texts_q)
    snap = bank.snapshot()
    out = []
    for i, (qt, u) in enumerate(zip(texts_q, users)):
        ui = snap.users.index(u)
        a, b = int(snap.offsets[ui]), int(snap.offsets[ui + 1])
        utexts = list(snap.texts[a:b])
        docs = [set(_toks(t)) for t in utexts if t is not None]
        Nd = len(docs)
        qset = set(_toks(qt))

        def idf(t):
            df = sum(t in d for d in docs)
            return math.log(1 + (Nd - df + 0.5) / (df + 0.5))

        total = sum(idf(t) for t in qset)
        rows = [r for r in res.rows[i] if r >= 0]
        dense = [float(x) for x in res.dense_scores[i][: len(rows)]]
        lex = [float(x) for x in res.lexical_scores[i][: len(rows)]]
        fused = [float(x) for x in res.scores[i][: len(rows)]]
        ctx = [float(x) for x in res.context_scores[i][: len(rows)]]

        def rank(v):
            order = sorted(range(len(v)), key=lambda j: (-v[j], j))
            return {j: float(order.index(j)) for j in range(len(v))}

        rd, rl, rf = rank(dense), rank(lex), rank(fused)
        times = list(snap.created_at[a:b])
        by_time = sorted(range(b - a), key=lambda j: (times[j], j))
        names, nums, dates = _oracle_query_terms(qt)
        cands = []
        for j, r in enumerate(rows):
            loc = r - a
            t = snap.texts[r]
            words = set() if t is None else {str(int(w)) if w.isdigit() else w for w in re.findall(r"\w+", t.lower())}
            cdates = {w[:3] for w in words if w[:3] in MONTHS and (w in MONTHS or w in FULL_MONTHS)}
            cdates |= {w for w in words if w.isdigit() and 1900 <= int(w) <= 2099}
            dset = set(_toks(t)) if t is not None else set()
            matched = qset & dset
            th = snap.threads[r] if snap.threads is not None else None
            if th is None:
                sp = 0.0
            else:
                members = [k for k in range(b - a) if snap.threads[a + k] == th]
                key = lambda k: (0 if snap.positions[a + k] >= 0 else 1, snap.positions[a + k], k)  # noqa: E731
                ordered = sorted(members, key=key)
                sp = ordered.index(loc) / (len(members) - 1) if len(members) > 1 else 0.0
            lmax = max(lex)
            lrel = lex[j] / lmax if lmax > 0 else 0.0
            cands.append({
                "dense": dense[j], "dense_gap": dense[j] - max(dense), "dense_rank": math.log1p(rd[j]),
                "lexical": lex[j], "lexical_rel": lrel, "lexical_rank": math.log1p(rl[j]),
                "fused": fused[j], "fused_gap": fused[j] - max(fused), "fused_rank": math.log1p(rf[j]),
                "context": ctx[j], "context_gap": ctx[j] - max(ctx), "list_rank": math.log1p(j),
                "coverage": len(matched) / len(qset) if qset else 0.0,
                "idf_mass": sum(idf(t) for t in matched), "idf_frac": sum(idf(t) for t in matched) / total if total else 0.0,
                "num_match": len(nums & words), "name_match": len(names & words), "date_match": len(dates & cdates),
                "recency": by_time.index(loc) / (b - a - 1), "session_pos": sp,
                "mean_x_dense": res.mean[i] * dense[j], "entropy_x_dense": res.entropy[i] * dense[j],
                "mean_x_lexical": res.mean[i] * lrel, "entropy_x_lexical": res.entropy[i] * lrel,
            })  # fmt: skip
        out.append(cands)
    return res, snap, out


MONTHS = {"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"}
FULL_MONTHS = {"january", "february", "march", "april", "june", "july", "august", "september", "october",
               "november", "december", "sept"}  # fmt: skip


def _oracle_query_terms(q):
    words = re.findall(r"\w+", q)
    names = set()
    for k, w in enumerate(words):
        lw = w.lower()
        if k == 0 or not w[0].isupper() or lw in {"i", "what", "when", "how", "did"} or lw[:3] in MONTHS:
            continue
        names.add(lw)
    low = {str(int(w)) if w.isdigit() else w for w in (x.lower() for x in words)}
    nums = {w for w in low if w.isdigit()}
    dates = {w[:3] for w in low if w in MONTHS or w in FULL_MONTHS} | {w for w in nums if 1900 <= int(w) <= 2099}
    return names, nums, dates


# ------------------------------------------------------------------ features


def test_query_terms_on_examples():
    names, nums, dates = query_terms("When did Caroline go to the support group in May 2023?")
    assert names == {"caroline"} and nums == {"2023"} and dates == {"may", "2023"}
    assert query_terms("What is Ms. Clara Hall's dream job on 09 Oct?") == (
        frozenset({"clara", "hall"}), frozenset({"9"}), frozenset({"oct"})
    )


@pytest.mark.parametrize("n", [4, 8])
def test_features_match_the_plain_python_oracle(n):
    bank, Q = _bank()
    res, snap, want = _oracle(bank, Q, QUERIES, QUSERS, n)
    F, V = features_from_result(res, snap, QUERIES)
    assert F.shape == (len(QUERIES), n, len(STAGE_FEATURES)) and F.dtype == np.float64
    for i, cands in enumerate(want):
        assert V[i].sum() == len(cands) and not V[i, len(cands):].any()
        assert np.all(F[i, len(cands):] == 0.0)
        for j, c in enumerate(cands):
            got = {f: F[i, j, k] for k, f in enumerate(STAGE_FEATURES)}
            for f in STAGE_FEATURES:
                assert got[f] == pytest.approx(c[f], rel=1e-9, abs=1e-12), (i, j, f)
    # the hand-made bank exercises the text features (not all zero)
    for f in ("coverage", "num_match", "name_match", "date_match", "session_pos"):
        assert F[:, :, STAGE_FEATURES.index(f)].max() > 0, f


def test_features_without_query_texts_or_context():
    bank, Q = _bank()
    res = search(bank, Q, QUSERS, RFMemConfig(**NEVER, out_k=5), mode="rfmem")
    F, V = stage_features(bank.snapshot(), res.rows, None, res.dense_scores, res.lexical_scores, res.scores)
    c = {f: F[:, :, k] for k, f in enumerate(STAGE_FEATURES)}
    for f in ("lexical", "coverage", "idf_mass", "num_match", "name_match", "date_match", "mean_x_dense"):
        assert np.all(c[f] == 0.0), f
    np.testing.assert_array_equal(c["context"][V], c["fused"][V])


def test_feature_input_errors():
    bank, Q = _bank()
    snap = bank.snapshot()
    res = search(bank, Q, QUSERS, _cfg(4), mode="rfmem", query_texts=QUERIES)
    args = (res.dense_scores, res.lexical_scores, res.scores)
    with pytest.raises(ValueError, match="rows must be an int array"):
        stage_features(snap, res.rows.astype(float), QUERIES, *args)
    with pytest.raises(ValueError, match="dense must have shape"):
        stage_features(snap, res.rows, QUERIES, res.dense_scores[:, :2], *args[1:])
    bad = res.rows.copy()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="valid row follows padding"):
        stage_features(snap, bad, QUERIES, *args)
    mixed = res.rows.copy()
    mixed[0, 0] = res.rows[3, 0]  # a row of user b in a list of user a
    with pytest.raises(ValueError, match="several users"):
        stage_features(snap, mixed, QUERIES, *args)
    with pytest.raises(ValueError, match="must be < the snapshot"):
        stage_features(snap, res.rows + 1000, QUERIES, *args)
    with pytest.raises(ValueError, match="query_texts must have 4"):
        stage_features(snap, res.rows, QUERIES[:2], *args)
    with pytest.raises(TypeError, match=r"query_texts\[1\]"):
        stage_features(snap, res.rows, [QUERIES[0], 3, None, None], *args)
    with pytest.raises(ValueError, match="mean must be 4 finite"):
        stage_features(snap, res.rows, QUERIES, *args, mean=np.zeros(3))
    with pytest.raises(ValueError, match="depth must be an int in"):
        features_from_result(res, snap, QUERIES, depth=5)
    bank.add("a", np.ones((1, D)), ["new"], texts=["x"])  # another snapshot: rows moved
    with pytest.raises(ValueError, match="do not hold the result's ids"):
        features_from_result(res, bank.snapshot(), QUERIES)


# ------------------------------------------------------------------ models


def _synthetic(seed=0, b=60, n=12):
    """Random features where relevance follows ``coverage + 0.5 dense`` (plus noise)."""
    rng = np.random.default_rng(seed)
    F = rng.normal(size=(b, n, len(STAGE_FEATURES)))
    V = np.ones((b, n), bool)
    V[::7, n - 3 :] = False
    s = F[:, :, STAGE_FEATURES.index("coverage")] + 0.5 * F[:, :, STAGE_FEATURES.index("dense")]
    Y = (s + 0.3 * rng.normal(size=s.shape) > 1.0) & V
    return F, V, Y.astype(np.int64)


def test_linear_fit_learns_the_direction_and_reranks_subsets():
    F, V, Y = _synthetic()
    m = fit_linear_stage(F, V, Y, depth=12)
    w = dict(zip(m.features, m.weights))
    assert w["coverage"] > 0 and w["dense"] > 0
    assert w["coverage"] > 2 * max(abs(w[f]) for f in LINEAR_FEATURES if f not in ("coverage", "dense"))
    order, sc = m.rerank(F, V, 5)
    assert order.shape == (60, 5) and sc.shape == (60, 5)
    for i in range(60):
        kept = order[i][order[i] >= 0]
        assert len(set(kept.tolist())) == len(kept) == min(5, V[i].sum())
        assert V[i, kept].all()
        # the scores are the largest of the valid candidates, in descending order
        full = m.score(F[i : i + 1], V[i : i + 1])[0]
        np.testing.assert_allclose(sc[i][: len(kept)], np.sort(full[V[i]])[::-1][: len(kept)])


def test_rerank_pads_short_lists_and_cuts_to_depth():
    F, V, Y = _synthetic(b=3, n=6)
    V[0, :] = True
    V[1, 2:] = False
    V[2, :] = False
    m = LinearStage(["dense"], [1.0], depth=4)
    order, sc = m.rerank(F, V, 5)
    assert (order[0, :4] >= 0).all() and (order[0, 4:] == -1).all()  # depth 4: columns 4, 5 dropped
    assert (order[0, :4] < 4).all()
    assert (order[1, :2] >= 0).all() and (order[1, 2:] == -1).all() and np.isneginf(sc[1, 2:]).all()
    assert (order[2] == -1).all()
    np.testing.assert_array_equal(order[0, :4], np.argsort(-F[0, :4, 0], kind="stable"))


def test_tree_stage_equals_sklearn_and_round_trips(tmp_path):
    from sklearn.ensemble import HistGradientBoostingClassifier

    F, V, Y = _synthetic(seed=1)
    m = fit_tree_stage(F, V, Y, depth=12, max_iter=20, max_leaf_nodes=5, min_samples_leaf=5)
    cols = [STAGE_FEATURES.index(f) for f in m.features]
    clf = HistGradientBoostingClassifier(max_iter=20, max_leaf_nodes=5, min_samples_leaf=5, l2_regularization=1.0,
                                         early_stopping=False, random_state=0)  # fmt: skip
    x, y = F[V][:, cols], Y[V]
    w = (1.0 / V.sum(1))[:, None].repeat(V.shape[1], 1)[V]
    clf.fit(x, y, sample_weight=w * (w.size / w.sum()))
    got = m.score(F, V)[V]
    np.testing.assert_allclose(got, clf.decision_function(x), rtol=1e-10, atol=1e-10)
    p = save_stage(m, tmp_path / "t.json", meta={"note": "x"})
    m2 = load_stage(p)
    assert isinstance(m2, TreeStage) and m2.meta == {"note": "x"} and m2.depth == 12
    np.testing.assert_array_equal(m2.score(F, V), m.score(F, V))


def test_linear_file_round_trip_and_bad_files(tmp_path):
    m = LinearStage(["dense", "coverage"], [1.5, -0.25], depth=30, meta={"fitted_on": "test"})
    p = save_stage(m, tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["format"] == "rfmem_fast.second_stage" and doc["version"] == 1 and doc["kind"] == "linear"
    assert doc["params"] == {"features": ["dense", "coverage"], "weights": [1.5, -0.25], "depth": 30}
    m2 = load_stage(p)
    assert isinstance(m2, LinearStage) and m2.features == m.features and m2.depth == 30
    np.testing.assert_array_equal(m2.weights, m.weights)
    assert m2.meta == {"fitted_on": "test"}

    def write(name, obj):
        f = tmp_path / name
        f.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        return f

    with pytest.raises(StageFileError, match="not valid JSON"):
        load_stage(write("a.json", "{"))
    with pytest.raises(StageFileError, match="not a second-stage file"):
        load_stage(write("b.json", {**doc, "format": "rfmem_fast.reranker"}))
    with pytest.raises(StageFileError, match="newer than"):
        load_stage(write("c.json", {**doc, "version": 99}))
    with pytest.raises(StageFileError, match="unknown second-stage kind"):
        load_stage(write("d.json", {**doc, "kind": "mlp"}))
    with pytest.raises(StageFileError, match="malformed linear"):
        load_stage(write("e.json", {**doc, "params": {**doc["params"], "weights": [1.0]}}))
    with pytest.raises(StageFileError, match="malformed linear"):
        load_stage(write("f.json", {**doc, "params": {**doc["params"], "features": ["dense", "nope"]}}))
    with pytest.raises(FileNotFoundError):
        load_stage(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="LinearStage or TreeStage"):
        save_stage(object(), tmp_path / "g.json")


def test_model_argument_errors():
    F, V, Y = _synthetic(b=4, n=5)
    with pytest.raises(ValueError, match="distinct names"):
        LinearStage(["dense", "dense"], [1, 2])
    with pytest.raises(ValueError, match="all be zero"):
        LinearStage(["dense"], [0.0])
    with pytest.raises(ValueError, match="depth must be"):
        LinearStage(["dense"], [1.0], depth=0)
    with pytest.raises(ValueError, match="out_k must be"):
        LinearStage(["dense"], [1.0]).rerank(F, V, 0)
    with pytest.raises(ValueError, match="features must be"):
        LinearStage(["dense"], [1.0]).rerank(F[:, :, :3], V, 2)
    with pytest.raises(ValueError, match="C must be"):
        fit_linear_stage(F, V, Y, C=0.0)
    with pytest.raises(ValueError, match="labels must have"):
        fit_linear_stage(F, V, Y[:, :2])
    with pytest.raises(ValueError, match="nothing to learn"):
        fit_linear_stage(F, V, np.zeros_like(Y))
    with pytest.raises(ValueError, match="malformed nodes"):
        TreeStage(["dense"], [{"feature": [0, -1], "threshold": [0.0, 0.0], "left": [1, -1], "right": [0, -1],
                               "missing_left": [True, True], "value": [0.0, 1.0]}], 0.0)  # fmt: skip


def test_rerank_result_is_a_subset_of_the_first_stage_list():
    bank, Q = _bank()
    res = search(bank, Q, QUSERS, _cfg(6), mode="rfmem", query_texts=QUERIES)
    snap = bank.snapshot()
    m = LinearStage(["coverage", "dense"], [1.0, 0.1], depth=6)
    out = rerank_result(m, res, snap, QUERIES, out_k=3)
    assert out.ids.shape == (4, 3) and out.rows.shape == (4, 3)
    F, V = features_from_result(res, snap, QUERIES, 6)
    order, _ = m.rerank(F, V, 3)
    for i in range(4):
        before = [x for x in res.ids[i] if x is not None]
        after = [x for x in out.ids[i] if x is not None]
        assert set(after) <= set(before) and len(after) == len(set(after)) == min(3, len(before))
        assert after == [res.ids[i][c] for c in order[i] if c >= 0]
        # every per-hit field moved with its id
        for j, x in enumerate(after):
            c = before.index(x)
            assert out.rows[i, j] == res.rows[i, c] and out.texts[i, j] == res.texts[i, c]
            assert out.dense_scores[i, j] == res.dense_scores[i, c] and out.context_scores[i, j] == res.context_scores[i, c]
    with pytest.raises(ValueError, match="search with out_k >= 6"):
        rerank_result(m, search(bank, Q, QUSERS, _cfg(4), mode="rfmem", query_texts=QUERIES), snap, QUERIES)


def test_labels_mark_relevant_candidates():
    ids = np.array([["x", "y", None], ["z", "x", "w"]], dtype=object)
    V = np.array([[True, True, False], [True, True, True]])
    Y = stage_labels(ids, V, [["y"], {"alt1": ["w"], "alt2": ["x"]}])
    np.testing.assert_array_equal(Y, [[0, 1, 0], [0, 1, 1]])


# ------------------------------------------------------------------ the nested CV


def test_nested_cv_never_scores_a_user_with_a_model_fitted_on_it(monkeypatch):
    """Every model scores only users it was not fitted on (a user's index rides in a feature)."""
    from types import SimpleNamespace

    from rfmem_fast import tuning_second_stage as T

    rng = np.random.default_rng(5)
    ucol = STAGE_FEATURES.index("recency")
    n, users = 12, ["a", "b", "c", "d"]

    class FakeData:
        def __init__(self, rel):
            self.questions = [SimpleNamespace(rel=r) for r in rel]

        def score(self, q, ids, k):
            return {"recall": len(set(ids[:k]) & q.rel) / len(q.rel)}

    conds = []
    for label in ("x", "y"):
        nq = 16
        qu = np.array([users[i % 4] for i in range(nq)], dtype=object)
        F = rng.normal(size=(nq, n, len(STAGE_FEATURES)))
        F[:, :, ucol] = np.array([users.index(u) for u in qu])[:, None]
        V = np.ones((nq, n), bool)
        Y = (F[:, :, STAGE_FEATURES.index("coverage")] > 0.8).astype(np.int64)
        Y[:, 0] = 1
        ids = np.array([[f"{i}.{j}" for j in range(n)] for i in range(nq)], dtype=object)
        rel = [{ids[i, j] for j in range(n) if Y[i, j]} for i in range(nq)]
        c = T.StageCondition(label, FakeData(rel), np.arange(nq), qu, ids, {n: (F, V, Y)}, np.zeros(0), np.zeros(nq))
        c.first = c.recall(np.arange(nq), None, 3)
        conds.append(c)

    fitted_on: dict[int, set] = {}
    fit0, rerank0 = T.StageCandidate.fit, LinearStage.rerank

    def fit(self, F, V, Y):
        m = fit0(self, F, V, Y)
        fitted_on[id(m)] = set(F[:, :, ucol][V].astype(int).tolist())
        return m

    scored = []

    def rerank(self, F, V, out_k):
        seen = set(F[:, :, ucol][V].astype(int).tolist())
        trained = fitted_on[id(self)]
        if trained == {0, 1, 2, 3}:  # the in-sample figure: the all-user pick on everyone
            insample.append(id(self))
        else:
            assert not (seen & trained), "a model scored a user it was fitted on"
            scored.append(seen)
        return rerank0(self, F, V, out_k)

    insample: list = []

    monkeypatch.setattr(T.StageCandidate, "fit", fit)
    monkeypatch.setattr(LinearStage, "rerank", rerank)
    cands = [T.StageCandidate("off"), T.StageCandidate("linear", n, (("C", 1.0),))]
    res = T.tune_second_stage(conds, cands, k=3)
    assert scored and fitted_on
    # only the all-user model saw every user, and it is the result's model (in-sample figure only)
    assert len({i for i in insample}) <= 1 and (not insample or insample[0] == id(res.model))
    assert sum(1 for t in fitted_on.values() if t == {0, 1, 2, 3}) == (res.model is not None)
    assert set(res.nested) == {"linear", "all"} and set(res.nested["linear"]) == {"x", "y"}
    # the in-sample model (all users) is fitted on every user and scores them all: done outside the check
    assert res.pick_all in ("off", "linear N=12 C=1")


def test_pipeline_scores_each_user_under_its_own_folds_picks(monkeypatch):
    """tune_pipeline: a user's questions take the values of the stage run on ITS fold's first-stage pick."""
    from types import SimpleNamespace

    from rfmem_fast import tuning_pipeline as P
    from rfmem_fast.tuning_datasets import _name, context_candidates

    names = [_name(f, c) for f, c in context_candidates()]
    a, b = names[1], names[5]
    users = ["u1", "u2", "u3"]
    picks = {"u1": a, "u2": b, "u3": a}
    monkeypatch.setattr(P, "tune_context", lambda conds, **kw: SimpleNamespace(
        users=users, picks={"all": [f"{u}: {picks[u]}" for u in users]}))  # fmt: skip
    qusers = np.array(["u1", "u2", "u3", "u1", "u2", "u3"], dtype=object)
    prepared = []

    def prepare(conds, depths, k, cfg, backend, cache_dir, progress=None):
        tag = 1.0 if _name("fusion" if not cfg.context_on else "context", cfg) == a else 2.0
        prepared.append(tag)
        return [SimpleNamespace(label="x", qrows=np.arange(6), users=qusers, dense=np.full(6, 0.1),
                                first=np.full(6, tag / 10), tag=tag)]  # fmt: skip

    def tune(data, cands, k, progress=None):
        tag = data[0].tag
        return SimpleNamespace(held={"all": {"x": np.full(6, tag)}},
                               picks={"all": [f"{u}: stage{tag:g}" for u in users]})  # fmt: skip

    monkeypatch.setattr(P, "prepare_stage_conditions", prepare)
    monkeypatch.setattr(P, "tune_second_stage", tune)
    res = P.tune_pipeline([SimpleNamespace(label="x")], ("linear",), (20,), 10)
    assert sorted(prepared) == [1.0, 2.0]  # each distinct pick prepared once
    want = np.array([1.0 if picks[u] == a else 2.0 for u in qusers])
    assert res.pipeline["x"] == pytest.approx(want.mean())
    assert res.first["x"] == pytest.approx((want / 10).mean())
    assert res.dense["x"] == pytest.approx(0.1)
    assert res.stage_picks == {"u1": "stage1", "u2": "stage2", "u3": "stage1"}
    assert res.first_picks == picks
    assert "pipeline (nested)" in P.format_pipeline(res)
    assert P.pipeline_json(res)["pipeline_gain_over_dense_points"]["x"] == pytest.approx(100 * (want.mean() - 0.1))


def test_tune_pipeline_command(monkeypatch, tmp_path, capsys):
    """``rfmem tune pipeline``: refuses without data; runs tune_pipeline on the conditions and writes its JSON."""
    from rfmem_fast import cli
    from rfmem_fast import tuning_pipeline as P

    assert cli.main(["tune", "pipeline"]) == 2
    assert "give at least one of --personabench, --locomo" in capsys.readouterr().err
    assert cli.main(["tune", "pipeline", "--locomo", str(tmp_path), "--families", "linear,forest"]) == 2
    assert "--families must be a comma list of linear, trees" in capsys.readouterr().err
    for bad in ("5,20", "x"):  # a depth below k = 10; not an int
        assert cli.main(["tune", "second-stage", "--locomo", str(tmp_path), "--depths", bad]) == 2
        assert "--depths must be a comma list of ints >= --k (10)" in capsys.readouterr().err
    seen = {}

    def fake(conds, families, depths, k, backend, progress=None):
        seen.update(labels=[c.label for c in conds], families=families, depths=depths, k=k)
        return P.PipelineTuneResult(["locomo"], ["locomo:a"], k, {"locomo": 0.5}, {"locomo": 0.6}, {"locomo": 0.7},
                                    {"locomo": 0.01}, {"locomo:a": "x"}, {"locomo:a": "off"}, 1.0)  # fmt: skip

    monkeypatch.setattr(P, "tune_pipeline", fake)
    import rfmem_fast.datasets as D

    monkeypatch.setattr(D, "load_locomo", lambda path: object())
    out = tmp_path / "p.json"
    assert cli.main(["tune", "pipeline", "--locomo", str(tmp_path), "--depths", "20,30", "--json", str(out)]) == 0
    assert seen == {"labels": ["locomo"], "families": ["linear"], "depths": [20, 30], "k": 10}
    doc = json.loads(out.read_text())
    assert doc["pipeline_gain_over_dense_points"]["locomo"] == pytest.approx(20.0)
    assert doc["encoder"] == "minilm" and "pipeline (nested)" in capsys.readouterr().out
