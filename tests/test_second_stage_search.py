"""The second stage inside a search (``RFMemConfig.second_stage``).

The reference is :func:`rfmem_fast.second_stage.rerank_result` applied to the same search
without the stage, taken ``depth`` deep (``out_k = 50``): a query on the Familiarity path
must get exactly the model's ``out_k`` best of that list, every per-hit field permuted
alike (a query without a text keeps the first stage's list); a query the router sends to the Recollection path keeps that path's hits; both
array kits (numpy on the host, tensors) agree; and the errors name the field.
"""
from __future__ import annotations

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends, search
from rfmem_fast.second_stage import builtin_stage_path, rerank_result, resolve_stage

D = 24
VOC = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
       "upsilon phi chi psi omega 1999 2023 march monday Paris Alice").split()  # fmt: skip
FIELDS = ("ids", "rows", "scores", "dense_scores", "lexical_scores", "context_scores")
BACKENDS = [b for b in ("native", "torch", "reference") if b in available_backends()]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    bank = MemoryBank(dim=D, lexical_stemmer=None)
    for u, n in enumerate([300, 90, 7, 120]):
        centres = rng.normal(size=(5, D))
        V = centres[rng.integers(0, 5, n)] + 0.4 * rng.normal(size=(n, D))
        texts = [" ".join(rng.choice(VOC, size=rng.integers(3, 9))) if i % 6 else None for i in range(n)]
        bank.add(f"u{u}", V, [f"u{u}-{i}" for i in range(n)], texts=texts, threads=[f"s{i // 20}" for i in range(n)],
                 positions=[i % 20 for i in range(n)], created_at=[1.7e9 + 3600.0 * i for i in range(n)])  # fmt: skip
    Q = rng.normal(size=(24, D))
    users = [f"u{j % 4}" for j in range(24)]
    qtexts = [" ".join(rng.choice(VOC, size=4)) if j % 7 else None for j in range(24)]
    return bank, Q, users, qtexts


def _same(a, b, fields=FIELDS, rows=slice(None)):
    for f in fields:
        x, y = getattr(a, f)[rows], getattr(b, f)[rows]
        assert x.shape == y.shape and x.dtype == y.dtype, f
        if x.dtype == object:
            assert x.tolist() == y.tolist(), f
        else:
            np.testing.assert_array_equal(x, y, err_msg=f)


CONFIGS = {
    "recommended": {},
    "fusion alone": {"context_weight": 0.0, "thread_weight": 0.0},
    "context on dense": {"lexical_weight": 0.0},
    "dense with texts": {"lexical_weight": 0.0, "context_weight": 0.0, "thread_weight": 0.0},
    "zscore": {"fusion": "zscore", "lexical_weight": 0.1},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_stage_reranks_the_first_stage_list(data, backend, name):
    bank, Q, users, qtexts = data
    cfg = RFMemConfig.recommended(**CONFIGS[name])
    assert cfg.second_stage == "builtin:minilm"
    stage = resolve_stage(cfg)
    got = search(bank, Q, users, cfg, backend=backend, query_texts=qtexts)
    first = search(bank, Q, users, cfg.replace(second_stage=None), backend=backend, query_texts=qtexts)
    deep = search(bank, Q, users, cfg.replace(second_stage=None, out_k=stage.depth), backend=backend,
                  query_texts=qtexts)  # fmt: skip
    _same(got, rerank_result(stage, deep, bank.snapshot(), qtexts, out_k=cfg.out_k))
    assert (got.route == 0).all()  # (recommended() never recollects)
    assert (got.rows != first.rows).any(), "the stage changed no list: the test would not see it"
    # a subset of the deep list, in a new order
    for i in range(len(users)):
        ok = got.rows[i] >= 0
        assert set(got.rows[i][ok]) <= set(deep.rows[i][deep.rows[i] >= 0])
    _same(got, search(bank, Q, users, cfg, backend=backend, query_texts=qtexts, output="torch").to_result())


@pytest.mark.parametrize("backend", BACKENDS)
def test_recollecting_queries_keep_their_hits(data, backend):
    bank, Q, users, qtexts = data
    paper = RFMemConfig()
    cfg = RFMemConfig.recommended(theta_high=paper.theta_high, theta_low=paper.theta_low, tau=paper.tau)
    got = search(bank, Q, users, cfg, backend=backend, query_texts=qtexts)
    plain = search(bank, Q, users, cfg.replace(second_stage=None), backend=backend, query_texts=qtexts)
    reco = got.route == 1
    assert 0 < int(reco.sum()) < len(users)
    _same(got, plain, FIELDS + ("rounds", "route", "probe_ids", "probe_scores", "mean", "entropy"), rows=reco)
    _same(got, plain, ("route", "probe_ids", "probe_scores", "mean", "entropy"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_without_text_keep_the_first_stage(data, backend):
    """The stage's features read the query's text: a query without one (None in
    ``query_texts``, or no ``query_texts`` at all) keeps its first-stage list."""
    bank, Q, users, qtexts = data
    cfg = RFMemConfig.recommended(lexical_weight=0.0)
    first = search(bank, Q, users, cfg.replace(second_stage=None), backend=backend)
    _same(search(bank, Q, users, cfg, backend=backend), first)
    got = search(bank, Q, users, cfg, backend=backend, query_texts=qtexts)
    none = np.array([t is None for t in qtexts])
    assert none.any() and not none.all()
    _same(got, search(bank, Q, users, cfg.replace(second_stage=None), backend=backend, query_texts=qtexts), rows=none)
    assert (got.rows[~none] != first.rows[~none]).any()


def test_filters_and_chunks_of_queries(data):
    bank, Q, users, qtexts = data
    cfg = RFMemConfig.recommended()
    fs = [{"created_at": {"$lt": 1.7e9 + 3600.0 * (20 + 15 * (j % 3))}} if j % 2 else None for j in range(len(users))]
    whole = search(bank, Q, users, cfg, query_texts=qtexts, filters=fs)
    _same(whole, search(bank, Q, users, cfg, query_texts=qtexts, filters=fs, max_batch=5))
    for i in range(len(users)):  # a filtered query's hits stay inside its filter
        if fs[i] is not None:
            kept = whole.rows[i][whole.rows[i] >= 0]
            assert (bank.snapshot().created_at[kept] < fs[i]["created_at"]["$lt"]).all()


def test_errors_name_the_field(data, tmp_path):
    bank, Q, users, qtexts = data
    cfg = RFMemConfig.recommended()
    with pytest.raises(TypeError, match="RFMemConfig.second_stage must be"):
        RFMemConfig(second_stage=3)
    with pytest.raises(ValueError, match="second_stage does not combine with fusion 'rrf'"):
        RFMemConfig(second_stage="builtin:minilm", lexical_weight=1.0, fusion="rrf")
    with pytest.raises(ValueError, match="second_stage does not combine with a reranker"):
        RFMemConfig(second_stage="builtin:minilm", reranker="r.json")
    with pytest.raises(ValueError, match="RFMemConfig.second_stage: unknown builtin second stage 'nope'"):
        cfg.replace(second_stage="builtin:nope")  # (the shipped names are known: refused on construction)
    with pytest.raises(FileNotFoundError, match="RFMemConfig.second_stage"):
        search(bank, Q, users, cfg.replace(second_stage=str(tmp_path / "missing.json")), query_texts=qtexts)
    from rfmem_fast import Memory

    with pytest.raises(FileNotFoundError, match="RFMemConfig.second_stage"):  # a facade opens with the file loaded
        Memory(encoder=False, dim=D, config=cfg.replace(second_stage=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="RFMemConfig.second_stage"):
        search(bank, Q, users, cfg.replace(second_stage=str(bad)), query_texts=qtexts)


def test_presets_and_the_shipped_file():
    rec = RFMemConfig.recommended()
    assert rec.preset() == "recommended" and rec.summary()["second_stage"] is True
    assert RFMemConfig.recommended("mpnet").second_stage == "builtin:mpnet"
    mp = resolve_stage(RFMemConfig.recommended("mpnet"))
    assert mp.kind == "linear" and mp.depth == 30 and mp is not resolve_stage(rec)
    assert RFMemConfig().summary()["second_stage"] is False
    assert rec.replace(second_stage=None).preset() == "custom"
    m = resolve_stage(rec)
    assert m.kind == "linear" and m.depth == 50 and m.meta["first_stage"] == "RFMemConfig.recommended"
    assert resolve_stage(rec.replace(second_stage=builtin_stage_path("minilm"))) is m  # (cached per file)
