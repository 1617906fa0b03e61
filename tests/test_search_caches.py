"""What a single query's search caches between calls never goes stale.

A one-query search reuses, from one call to the next: the bank view and its memo (the
native arrays, the row-norm bound, the segment lengths as Python ints:
``search._segment_lengths``), each config object's beam-driver arguments
(``backends.native._driver_params``) and each backend's device facts
(``Backend.placement``). These tests write to the bank between searches (add, delete,
update, a new user), alternate two configs on one backend, and check every result
against an independent reference: a FRESH bank holding the same items in the same order,
searched by a fresh backend with a fresh config object (the same rows, so every field is
compared exactly).
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends, search
from rfmem_fast.backends import get_backend

search_mod = sys.modules["rfmem_fast.search"]

D = 12
BACKENDS = [b for b in ("native", "torch", "reference") if b in available_backends()]
MODES = ("dense", "recollection", "rfmem")
FIELDS = ("ids", "texts", "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids",
          "probe_texts", "probe_scores", "dense_scores", "lexical_scores")  # fmt: skip
CFG = RFMemConfig(out_k=6, probe_k=6, beam_width=3, max_rounds=3)


class Model:
    """The bank's content as plain Python (user -> list of [id, vector, text]), in row order."""

    def __init__(self) -> None:
        self.users: dict[str, list] = {}

    def add(self, bank, user, vecs, ids):
        bank.add(user, vecs, ids, texts=[f"t {i}" for i in ids])
        self.users.setdefault(user, []).extend([i, v, f"t {i}"] for i, v in zip(ids, vecs))

    def delete(self, bank, user, ids):
        bank.delete(user, ids)
        self.users[user] = [e for e in self.users[user] if e[0] not in set(ids)]

    def update(self, bank, user, ids, vecs):
        bank.update(user, ids, vecs)
        new = dict(zip(ids, vecs))
        for e in self.users[user]:
            if e[0] in new:
                e[1] = new[e[0]]

    def fresh(self) -> MemoryBank:
        """An independent bank with the same items in the same order."""
        bank = MemoryBank(D)
        for u, items in self.users.items():
            bank.add(u, np.array([e[1] for e in items]), [e[0] for e in items], texts=[e[2] for e in items])
        return bank


def _same(a, b, what):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.shape == y.shape and x.dtype == y.dtype, (what, f)
        if x.dtype == object:
            assert x.tolist() == y.tolist(), (what, f)
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{what}: {f}")


def _check(bank, model, be, rng, users, what):
    """One query per user (the single-query path) and one batch of all: against the fresh bank."""
    ref_bank = model.fresh()
    Q = rng.normal(size=(len(users), D))
    for mode in MODES:
        fresh_be = get_backend(be.name)
        cfg = RFMemConfig(**CFG.to_dict())  # a fresh config object (its own driver arguments)
        for i, u in enumerate(users):
            _same(search(bank, Q[i : i + 1], [u], CFG, mode=mode, backend=be),
                  search(ref_bank, Q[i : i + 1], [u], cfg, mode=mode, backend=fresh_be), f"{what} {mode} {u}")  # fmt: skip
        _same(search(bank, Q, users, CFG, mode=mode, backend=be),
              search(ref_bank, Q, users, cfg, mode=mode, backend=fresh_be), f"{what} {mode} batch")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_between_searches_match_a_fresh_bank(backend):
    rng = np.random.default_rng(21)
    bank, model = MemoryBank(D), Model()
    sizes = {"a": 40, "b": 9, "c": 25}
    for u, n in sizes.items():
        model.add(bank, u, rng.normal(size=(n, D)), [f"{u}{j}" for j in range(n)])
    be = get_backend(backend)  # ONE backend across the writes: its view and memos are reused
    _check(bank, model, be, rng, ["a", "b", "c"], "initial")
    model.add(bank, "b", rng.normal(size=(20, D)), [f"b+{j}" for j in range(20)])  # b grows past out_k's padding
    _check(bank, model, be, rng, ["a", "b", "c"], "after add")
    model.delete(bank, "a", [f"a{j}" for j in range(0, 40, 3)])
    _check(bank, model, be, rng, ["a", "b", "c"], "after delete")
    model.update(bank, "c", ["c0", "c7", "c24"], rng.normal(size=(3, D)))
    _check(bank, model, be, rng, ["a", "b", "c"], "after update")
    model.add(bank, "new", rng.normal(size=(4, D)), ["n0", "n1", "n2", "n3"])  # a new user, shorter than out_k
    _check(bank, model, be, rng, ["new", "a", "b", "c"], "after a new user")
    model.delete(bank, "b", [f"b{j}" for j in range(9)] + [f"b+{j}" for j in range(16)])  # b shrinks to 4 items
    _check(bank, model, be, rng, ["b", "new", "a"], "after b shrank")


def _uncached(monkeypatch, fn):
    """``fn()`` with the per-config cache of the native driver's arguments empty (the
    reference computes them anew), the cache restored afterwards."""
    native = sys.modules.get("rfmem_fast.backends.native")
    if native is None:
        return fn()
    with monkeypatch.context() as m:
        m.setattr(native, "_DRIVER_PARAMS", {})
        return fn()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_configs_alternating(monkeypatch, backend):
    """Configs that differ in every argument the beam driver takes, in turns on one backend:
    each result equals that of a fresh backend and a fresh equal config, computed with no
    cached driver arguments."""
    rng = np.random.default_rng(5)
    bank = MemoryBank(D)
    for u, n in (("x", 300), ("y", 30)):
        bank.add(u, rng.normal(size=(n, D)), [f"{u}{j}" for j in range(n)])
    cfgs = [RFMemConfig(out_k=5, probe_k=5, beam_width=2, max_rounds=2, alpha=0.3, kmeans_seed=1),
            RFMemConfig(out_k=9, probe_k=7, beam_width=4, max_rounds=5, alpha=0.7, mmr_lambda=0.6, fanout=2,
                        kmeans_seed=7)]  # fmt: skip
    be = get_backend(backend)
    Q = rng.normal(size=(6, D))
    users = ["x", "y", "x", "x", "y", "x"]
    for turn in range(4):
        cfg = cfgs[turn % 2]
        for mode in MODES:
            for i in range(len(users)):
                got = search(bank, Q[i : i + 1], users[i : i + 1], cfg, mode=mode, backend=be)
                ref = _uncached(monkeypatch, lambda: search(bank, Q[i : i + 1], users[i : i + 1],
                                                            RFMemConfig(**cfg.to_dict()), mode=mode,
                                                            backend=get_backend(backend)))  # fmt: skip
                _same(got, ref, f"turn {turn} {mode} {i}")
                if mode == "recollection":
                    assert got.rounds[0] > 0


def test_backend_by_name_each_call():
    """``backend="native"`` (a new backend per call) and one instance give the same results."""
    if "native" not in available_backends():
        pytest.skip("the native backend is not built")
    rng = np.random.default_rng(9)
    bank = MemoryBank(D)
    bank.add("u", rng.normal(size=(50, D)), [f"i{j}" for j in range(50)])
    be = get_backend("native")
    for mode in MODES:
        q = rng.normal(size=(1, D))
        _same(search(bank, q, ["u"], CFG, mode=mode, backend="native"),
              search(bank, q, ["u"], CFG, mode=mode, backend=be), mode)  # fmt: skip
