"""The lean entry of one host query (rfmem_fast.search_single) equals the general path
(rfmem_fast.search_chunk.run_chunk) field by field, and serves only the calls it may."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available
from rfmem_fast.backends.native import NativeBackend

search_module = importlib.import_module("rfmem_fast.search")  # (the package exports the function search)
pytestmark = pytest.mark.skipif("native" not in available(), reason="the native backend is not built")

D = 48


def _bank() -> MemoryBank:
    """Users of 3 (fewer rows than out_k), 40 and 700 rows (long enough for the driver's
    pruned rounds, recollect.h kPruneMinRows), a user whose items were all deleted, and
    items with and without texts, ids of two types; clustered rows so that both routes
    occur."""
    rng = np.random.default_rng(11)
    bank = MemoryBank(dim=D)
    centres = rng.standard_normal((6, D))
    for u, n in (("small", 3), ("mid", 40), ("long", 700), ("gone", 5)):
        x = centres[rng.integers(0, 6, n)] + 0.6 * rng.standard_normal((n, D))
        ids = [f"{u}-{i}" if i % 3 else i for i in range(n)]
        texts = [None if i % 4 == 0 else f"note {u} {i}" for i in range(n)]
        bank.add(u, x.astype(np.float32), ids, texts=texts)
    bank.delete("gone", [f"gone-{i}" if i % 3 else i for i in range(5)])
    return bank


def _equal(a, b, where: str) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, (where, f.name)
            if x.dtype.kind == "O":
                assert x.tolist() == y.tolist(), (where, f.name)
            else:  # bit for bit, NaN padding included
                assert x.tobytes() == y.tobytes(), (where, f.name, x, y)
        else:
            assert x == y, (where, f.name)


CONFIGS = [
    RFMemConfig(),
    RFMemConfig(out_k=3, probe_k=7),
    RFMemConfig(out_k=25, probe_k=30, beam_width=2, fanout=3, max_rounds=4),
    RFMemConfig(mmr_lambda=0.7, alpha=0.3, entropy="normalized", temperature=5.0),
    RFMemConfig(theta_high=0.99, theta_low=0.98, tau=0.0),  # every probe unfamiliar: the Recollection path
    RFMemConfig(theta_high=-1.0, theta_low=-1.0),  # every probe with hits familiar
]


def _lean_and_general(monkeypatch, *args, **kw):
    """(the search through the lean entry, asserting that it was taken; the same search
    through the general path) for search(*args, **kw)."""
    taken = []
    lean = search_module.single_query
    monkeypatch.setattr(search_module, "single_query", lambda *a, **k: taken.append(1) or lean(*a, **k))
    got = search(*args, **kw)
    assert taken == [1], "the lean entry was not taken"
    monkeypatch.setattr(search_module, "lean_applies", lambda *a: False)
    ref = search(*args, **kw)
    monkeypatch.undo()
    return got, ref


HYBRID_CONFIGS = [
    RFMemConfig(lexical_weight=0.03, fusion="convex", lexical_norm="raw"),
    RFMemConfig(lexical_weight=0.3, fusion="convex", out_k=3, probe_k=7),
    RFMemConfig(lexical_weight=0.2, fusion="adaptive", theta_high=0.99, theta_low=0.98, tau=0.0),
    RFMemConfig(lexical_weight=0.5, fusion="zscore", out_k=25, probe_k=30, beam_width=2, fanout=3),
]
TEXTS = ["note long 7 mid", "note", "small 1", "nothing known here", None]


@pytest.mark.parametrize("cfg", CONFIGS + HYBRID_CONFIGS, ids=lambda c: f"lexical{c.lexical_weight}-out{c.out_k}")
def test_one_query_equals_the_general_path(cfg, monkeypatch):
    """Every mode, users of every kind, both routes: without a text (float32 and float64
    queries of any norm), or with one (the one-pass hybrid probe's fused list and its exact
    dense and lexical scores on the Familiarity path; the driver's hits, exact dense
    scores and BM25 looked up on the Recollection path), field by field."""
    bank = _bank()
    rng = np.random.default_rng(int(cfg.out_k * 100 + cfg.lexical_weight * 1000 + cfg.theta_high * 10))
    be = NativeBackend()
    variants = [(j, {}) for j in range(3)] if cfg.lexical_weight == 0 else [(0, {"query_texts": [t]}) for t in TEXTS]
    routes = set()
    for user in ("small", "mid", "long", "gone"):
        for mode in ("rfmem", "dense", "recollection"):
            for j, kw in variants:
                q = (rng.standard_normal((1, D)) * (1 + j)).astype(np.float64 if j == 2 else np.float32)
                got, ref = _lean_and_general(monkeypatch, bank, q, [user], cfg, mode=mode, backend=be, **kw)
                _equal(got, ref, f"{user} {mode} {j} {kw}")
                routes.add(int(got.route[0]))
    assert routes == {0, 1}  # both paths compared (the forced modes give both)


class _NoDenseDriver(NativeBackend):
    """The native backend with a host driver that gives no dense scores of its hits."""

    def recollect_host(self, *a, **k):
        rows, scores, rounds, _ = super().recollect_host(*a, **k)
        return rows, scores, rounds, None


def test_a_driver_without_dense_scores_gets_them_re_scored(monkeypatch):
    bank = _bank()
    rng = np.random.default_rng(5)
    for user in ("small", "long"):
        q = rng.standard_normal((1, D)).astype(np.float32)
        got, ref = _lean_and_general(monkeypatch, bank, q, [user], mode="recollection", backend=_NoDenseDriver())
        _equal(got, ref, user)
        plain = search(bank, q, [user], mode="recollection", backend=NativeBackend())
        np.testing.assert_array_equal(got.dense_scores, plain.dense_scores)  # exact either way


def test_the_lean_entry_serves_only_plain_host_queries(monkeypatch):
    bank = _bank()
    calls = []
    lean = search_module.single_query
    monkeypatch.setattr(search_module, "single_query", lambda *a, **k: calls.append(1) or lean(*a, **k))
    q = np.random.default_rng(3).standard_normal((1, D)).astype(np.float32)
    be = NativeBackend()
    search(bank, q, ["mid"], backend=be)
    assert calls == [1]
    search(bank, np.vstack([q, q]), ["mid", "long"], backend=be)  # two queries
    search(bank, q, ["mid"], backend=be, output="torch")
    hyb = RFMemConfig(lexical_weight=0.1)
    search(bank, q, ["mid"], RFMemConfig(lexical_weight=0.1, fusion="rrf"), mode="dense", backend=be,
           query_texts=["note"])
    search(bank, q, ["mid"], mode="dense", backend=be, query_texts=["note"])  # weight 0: the texts' scores only
    search(bank, q, ["mid"], backend=be, filters={"created_at": {"$gte": 0}})
    search(bank, q, ["mid"], RFMemConfig(merge="rrf"), backend=be)
    search(bank, q, ["mid"], backend=NativeBackend(beam_driver="python"), mode="recollection")
    search(bank, q, ["mid"], hyb, backend=NativeBackend(beam_driver="python"), query_texts=["note"])
    if "torch" in available():
        search(bank, q, ["mid"], backend="torch")
    assert calls == [1]
    search(bank, q, ["mid"], backend=NativeBackend(beam_driver="python"), mode="dense")  # no driver needed
    search(bank, q, ["mid"], hyb, mode="dense", backend=be, query_texts=["note"])  # the one-pass hybrid probe
    search(bank, q, ["mid"], hyb, backend=be, query_texts=["note"])  # and mode "rfmem"
    assert calls == [1, 1, 1, 1]


def test_the_lean_entry_raises_the_search_errors():
    bank = _bank()
    be = NativeBackend()
    with pytest.raises(ValueError, match="dimension"):
        search(bank, np.ones((1, D + 1), np.float32), ["mid"], backend=be)
    with pytest.raises(ValueError, match="zero norm"):
        search(bank, np.zeros((1, D), np.float32), ["mid"], backend=be)
    with pytest.raises(ValueError, match="NaN"):
        search(bank, np.full((1, D), np.nan, np.float32), ["mid"], backend=be)
    with pytest.raises(KeyError, match="unknown user"):
        search(bank, np.ones((1, D), np.float32), ["nobody"], backend=be)
    with pytest.raises(ValueError, match="mode"):
        search(bank, np.ones((1, D), np.float32), ["mid"], mode="fast", backend=be)
