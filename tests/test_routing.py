"""Routers: probe features, the threshold router, learned routers
against scikit-learn, router files (round trip and every kind of bad file), and routing
inside search."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.routing.base import RULE_NAMES
from rfmem_fast.routing.threshold import route
from rfmem_fast.routing import (
    FEATURE_NAMES,
    LogisticRouter,
    ProbeSettings,
    ProbeSignals,
    RouterFileError,
    ThresholdRouter,
    calibrate,
    fit_learned_router,
    fit_router,
    load_router,
    path_labels,
    save_router,
)
from rfmem_fast.routing.calibrate import fit_threshold_router
from rfmem_fast.routing.files import resolve_router


def random_signals(seed=0, b=200, k=10):
    rng = np.random.default_rng(seed)
    s = -np.sort(-rng.uniform(-0.1, 0.9, size=(b, k)), axis=1)
    cnt = np.full(b, k)
    cnt[:5] = [0, 1, 2, 3, 7]
    for i, c in enumerate(cnt[:5]):
        s[i, c:] = -np.inf
    mean = np.array([s[i, : cnt[i]].mean() if cnt[i] else 0.0 for i in range(b)])
    ent = rng.uniform(0.0, 0.23, b)
    ent[cnt == 0] = 0.0
    return ProbeSignals.from_arrays(s, mean, ent, cnt)


def test_probe_features_match_their_definitions():
    sig = random_signals()
    F = sig.features()
    assert F.shape == (200, len(FEATURE_NAMES))
    for i in range(200):
        s = [x for x in sig.scores[i] if np.isfinite(x)]
        want = {
            "mean": sig.mean[i],
            "entropy": sig.entropy[i],
            "top1": s[0] if s else 0.0,
            "gap12": s[0] - s[1] if len(s) > 1 else 0.0,
            "spread": s[0] - s[-1] if len(s) > 1 else 0.0,
            "count": len(s),
        }
        np.testing.assert_allclose(F[i], [want[n] for n in FEATURE_NAMES], atol=1e-12)
    np.testing.assert_array_equal(sig.features(["count", "top1"]), F[:, [5, 2]])
    with pytest.raises(ValueError, match="unknown probe feature"):
        sig.features(["mean", "magic"])


def test_threshold_router_equals_the_spec_router():
    sig = random_signals(1)
    cfg = RFMemConfig(theta_high=0.5, theta_low=0.25, tau=0.12)
    r1, rule1 = ThresholdRouter.from_config(cfg).route(sig)
    r2, rule2 = route(sig.mean, sig.entropy, sig.count, cfg)
    np.testing.assert_array_equal(r1, r2)
    np.testing.assert_array_equal(rule1, rule2)
    assert RULE_NAMES[rule1[0]] == "no_hits" and r1[0] == 1
    with pytest.raises(ValueError, match="theta_low"):
        ThresholdRouter(0.2, 0.5, 0.1)
    with pytest.raises(ValueError, match="tau"):
        ThresholdRouter(0.6, 0.2, float("nan"))


def test_one_query_routes_as_the_batch():
    """A one-query call (its rules on Python numbers) routes as the same query inside a
    batch (the array rules), on every rule, at each threshold and for NaN signals; the
    spec's rules written out here are the independent reference."""
    th, tl, tau = 0.5, 0.25, 0.12
    means = [0.9, 0.5, 0.4999, 0.3, 0.25, 0.2, float("nan")]
    ents = [0.0, 0.11, 0.12, 0.5, float("nan")]
    grid = [(m, h, c) for m in means for h in ents for c in (0, 3)]
    mean = np.array([g[0] for g in grid])
    ent = np.array([g[1] for g in grid])
    cnt = np.array([g[2] for g in grid], dtype=np.int64)
    cfg = RFMemConfig(theta_high=th, theta_low=tl, tau=tau)
    batch_r, batch_rule = route(mean, ent, cnt, cfg)
    for i, (m, h, c) in enumerate(grid):
        r, rule = route(mean[i : i + 1], ent[i : i + 1], cnt[i : i + 1], cfg)
        assert r.dtype == rule.dtype == np.int64 and r.shape == rule.shape == (1,)
        want = ("no_hits" if c == 0 else "mean_high" if m >= th else "mean_low" if m <= tl
                else "entropy_low" if h < tau else "entropy_high")  # fmt: skip
        assert RULE_NAMES[rule[0]] == want == RULE_NAMES[batch_rule[i]], (m, h, c)
        assert r[0] == batch_r[i] == (0 if want in ("mean_high", "entropy_low") else 1)


@pytest.mark.parametrize("kind", ["logistic", "mlp"])
def test_learned_router_reproduces_scikit_learn(kind):
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    sig = random_signals(2, b=300)
    X = sig.features()
    y = ((X[:, 0] + 0.5 * X[:, 3] + np.random.default_rng(0).normal(0, 0.05, 300)) < 0.45).astype(int)
    w = np.random.default_rng(1).uniform(0.1, 1.0, 300)
    router = fit_learned_router(kind, sig, y, w, seed=3)
    clf = (
        LogisticRegression(max_iter=1000)
        if kind == "logistic"
        else MLPClassifier((16,), alpha=1e-3, solver="lbfgs", max_iter=2000, random_state=3)
    )
    pipe = make_pipeline(StandardScaler(), clf).fit(X, y, **{f"{type(clf).__name__.lower()}__sample_weight": w / w.mean()})
    np.testing.assert_allclose(router.probability(sig), pipe.predict_proba(X)[:, 1], atol=1e-9)
    routes, rules = router.route(sig)
    assert routes[0] == 1 and RULE_NAMES[rules[0]] == "no_hits"
    learned = {RULE_NAMES[r] for r in rules[1:]}
    assert learned <= {"learned_familiarity", "learned_recollection"}
    assert (routes[1:] == (pipe.predict_proba(X[1:])[:, 1] >= 0.5)).all()
    assert (routes[1:] == y[1:]).mean() > 0.8  # it learned the rule


def test_learned_router_needs_both_labels():
    sig = random_signals(3)
    with pytest.raises(ValueError, match="both labels"):
        fit_learned_router("logistic", sig, np.ones(200, int))
    with pytest.raises(ValueError, match="kind"):
        fit_router("forest", sig, np.zeros(200), np.ones(200))


def test_path_labels_and_threshold_fit_pick_the_best_grid_point():
    labels, weights = path_labels([0.5, 1.0, 0.2], [0.5, 0.0, 0.7])
    assert labels.tolist() == [0, 0, 1] and weights.tolist() == pytest.approx([0.0, 1.0, 0.5])
    # questions with a low mean score gain from recollection, the others lose: a
    # theta_low between the groups routes every question to its better path
    rng = np.random.default_rng(4)
    mean = np.concatenate([rng.uniform(0.1, 0.3, 50), rng.uniform(0.45, 0.7, 50)])
    sig = ProbeSignals.from_arrays(np.repeat(mean[:, None], 10, 1), mean, np.full(100, 0.22), np.full(100, 10))
    d = np.where(mean < 0.35, 0.2, 0.8)
    r = np.where(mean < 0.35, 0.9, 0.1)
    rt = fit_threshold_router(sig, d, r)
    routes, _ = rt.route(sig)
    np.testing.assert_array_equal(routes, (mean < 0.35).astype(int))


def _write(path, doc):
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def test_router_file_round_trip_and_search_uses_it(tmp_path):
    rng = np.random.default_rng(5)
    bank = MemoryBank(16)
    for u in range(3):
        bank.add(f"u{u}", rng.normal(size=(40, 16)), [f"{u}.{i}" for i in range(40)])
    Q = rng.normal(size=(30, 16))
    users = [f"u{i % 3}" for i in range(30)]
    dense = search(bank, Q, users, RFMemConfig(), mode="dense", backend="torch")
    sig = ProbeSignals.from_result(dense)
    y = (sig.mean < np.median(sig.mean)).astype(int)
    router = fit_learned_router("logistic", sig, y, probe=ProbeSettings())
    path = save_router(router, tmp_path / "r.json", meta={"note": "test"})
    back, meta = load_router(path, with_meta=True)
    assert isinstance(back, LogisticRouter) and meta == {"note": "test"}
    np.testing.assert_array_equal(back.probability(sig), router.probability(sig))
    cfg = RFMemConfig(router=path)
    res = search(bank, Q, users, cfg, mode="rfmem", backend="torch")
    want, _ = router.route(sig)
    np.testing.assert_array_equal(res.route, want)
    assert set(res.rule_names) <= {"learned_familiarity", "learned_recollection"}
    # the same router passed directly, and a threshold router file
    res2 = search(bank, Q, users, RFMemConfig(), mode="rfmem", backend="torch", router=back)
    np.testing.assert_array_equal(res2.rows, res.rows)
    tpath = save_router(ThresholdRouter(0.3, 0.1, 0.1), tmp_path / "t.json")
    res3 = search(bank, Q, users, RFMemConfig(router=tpath), mode="rfmem", backend="torch")
    res4 = search(bank, Q, users, RFMemConfig(theta_high=0.3, theta_low=0.1, tau=0.1), mode="rfmem", backend="torch")
    np.testing.assert_array_equal(res3.rows, res4.rows)
    np.testing.assert_array_equal(res3.rule, res4.rule)


def test_bad_router_files_fail_clearly(tmp_path):
    good = json.loads(json.dumps(
        {"format": "rfmem_fast.router", "version": 1, "kind": "threshold",
         "probe": ProbeSettings().to_dict(), "params": {"theta_high": 0.6, "theta_low": 0.2, "tau": 0.2}}
    ))  # fmt: skip
    assert isinstance(load_router(_write(tmp_path / "ok.json", good)), ThresholdRouter)
    cases = {
        "not valid JSON": "{not json",
        "not a router file": {**good, "format": "something-else"},
        "newer than this": {**good, "version": 99},
        "unknown router kind": {**good, "kind": "forest"},
        "missing key 'params'": {k: v for k, v in good.items() if k != "params"},
        "malformed 'probe'": {**good, "probe": {"probe_k": 10}},
        "malformed threshold parameters": {**good, "params": {"theta_high": 0.1, "theta_low": 0.5, "tau": 0.2}},
        "malformed logistic parameters": {
            **good, "kind": "logistic",
            "params": {"features": ["mean"], "center": [0.0], "scale": [1.0], "layers": [{"W": [[1.0, 2.0]], "b": [0.0]}], "threshold": 0.5},
        },  # fmt: skip
        "expected a JSON object": [1, 2],
    }
    for i, (msg, doc) in enumerate(cases.items()):
        path = _write(tmp_path / f"bad{i}.json", doc)
        with pytest.raises(RouterFileError, match=msg):
            load_router(path)
        with pytest.raises(ValueError, match="RFMemConfig.router"):  # resolved by search / Memory, not the config
            resolve_router(RFMemConfig(router=path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_router(RFMemConfig(router=str(tmp_path / "absent.json")))
    with pytest.raises(TypeError, match="router"):
        RFMemConfig(router=3)  # type: ignore[arg-type]
    # a router made for another probe (temperature 30) does not fit the default config
    other = _write(tmp_path / "t30.json", {**good, "probe": {**good["probe"], "temperature": 30.0}})
    with pytest.raises(ValueError, match="temperature"):
        resolve_router(RFMemConfig(router=other))
    assert resolve_router(RFMemConfig(router=other, temperature=30.0)).probe.temperature == 30.0


def test_config_holds_paths_search_memory_and_cli_resolve_them(tmp_path):
    """RFMemConfig reads no file: a bad router / re-ranker path is a field value;
    search, Memory (on opening) and the CLI's --set refuse it with the errors (type and
    message) the config raised on construction before."""
    from rfmem_fast import Memory
    from rfmem_fast._cliargs import config_from_sets

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "rfmem_fast.router", "version": 1')
    absent = str(tmp_path / "absent.json")
    cfg = RFMemConfig(router=bad)  # no I/O: constructs, and keeps the path (as a str)
    assert cfg.router == str(bad) and RFMemConfig(reranker=absent).reranker == absent
    rng = np.random.default_rng(0)
    bank = MemoryBank(4)
    bank.add("u", rng.normal(size=(6, 4)), list(range(6)))
    q = rng.normal(size=(2, 4))
    with pytest.raises(ValueError, match="RFMemConfig.router: router file .*not valid JSON"):
        search(bank, q, ["u", "u"], cfg, mode="rfmem", backend="torch")
    with pytest.raises(FileNotFoundError, match="RFMemConfig.reranker: reranker file .*does not exist"):
        search(bank, q, ["u", "u"], RFMemConfig(reranker=absent), mode="rfmem", backend="torch")
    with pytest.raises(ValueError, match="RFMemConfig.router: router file .*not valid JSON"):
        Memory(encoder=False, dim=4, config=cfg)
    with pytest.raises(FileNotFoundError, match="RFMemConfig.router: router file .*does not exist"):
        Memory(encoder=False, dim=4, config=RFMemConfig(router=absent))
    with pytest.raises(SystemExit, match="--set / --preset: RFMemConfig.router: .*not valid JSON"):
        config_from_sets([f"router={bad}"])
    # a good file: the same routes whether search resolves it or gets the router
    path = save_router(ThresholdRouter(0.3, 0.1, 0.1), tmp_path / "t.json")
    a = search(bank, q, ["u", "u"], RFMemConfig(router=path), mode="rfmem", backend="torch")
    b = search(bank, q, ["u", "u"], RFMemConfig(), mode="rfmem", backend="torch", router=resolve_router(RFMemConfig(router=path)))
    np.testing.assert_array_equal(a.rule, b.rule)
    np.testing.assert_array_equal(a.rows, b.rows)
    assert isinstance(resolve_router(RFMemConfig()), ThresholdRouter)


def test_calibrate_fits_on_own_labelled_data():
    rng = np.random.default_rng(6)
    d = 16
    bank = MemoryBank(d)
    centres = rng.normal(size=(5, d))
    for u in range(4):
        lab = rng.integers(0, 5, 60)
        bank.add(f"u{u}", centres[lab] + 0.7 * rng.normal(size=(60, d)), [f"{u}/{i}" for i in range(60)])
    snap = bank.snapshot()
    Q, users, relevant = [], [], []
    for i in range(80):
        u = int(rng.integers(0, 4))
        a = snap.offsets[bank.user_index(f"u{u}")]
        picks = rng.choice(60, 3, replace=False)
        Q.append(snap.vectors[a + picks].sum(0) + 0.3 * rng.normal(size=d))
        users.append(f"u{u}")
        relevant.append([f"{u}/{p}" for p in picks])
    cal = calibrate(bank, np.array(Q), users, relevant, RFMemConfig(merge="interleave"), kind="threshold", backend="torch")
    s = cal.summary()
    assert s["questions"] == 80 and s["ties"] + s["recollection_better"] + s["familiarity_better"] == 80
    # in-sample, the fitted thresholds are at least as good as either fixed path
    assert s["routed_recall_in_sample"] >= max(s["dense_recall"], s["recollection_recall"]) - 1e-12
    assert s["routed_recall_in_sample"] <= s["oracle_recall"] + 1e-12
    with pytest.raises(ValueError, match="relevant"):
        calibrate(bank, np.array(Q), users, relevant[:-1], backend="torch")
