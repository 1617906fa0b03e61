"""Determinism and batch invariance on every CPU backend.

Same inputs give bit-identical outputs (ids AND scores, every field) across calls, fresh
banks, batch compositions and orders, chunk sizes, and a separate process with another
hash seed; a query's result never depends on which queries share its batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search

CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
MODES = ["dense", "recollection", "rfmem"]
FIELDS = ["ids", "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids", "probe_scores"]
HERE = Path(__file__).resolve().parent
# a route split on both sides: mmr on, scores can go below 0
CFG = RFMemConfig(out_k=6, probe_k=5, max_rounds=3, theta_high=0.8, theta_low=0.0, tau=0.1, score_floor=-1.0)


def build_bank(seed: int = 0) -> MemoryBank:
    """Clustered unit vectors; users of 1, 3, 12, 40 and 60 items, some edits applied."""
    rng = np.random.default_rng(seed)
    d = 16
    centers = rng.normal(size=(5, d))
    bank = MemoryBank(d)
    for u, n in enumerate([40, 1, 12, 3, 60]):
        lab = rng.integers(0, 5, size=n)
        v = centers[lab] + 0.35 * rng.normal(size=(n, d))
        bank.add(f"user{u}", v, [f"{u}:{i}" for i in range(n)])
    bank.delete("user0", ["0:3", "0:7"])
    bank.update("user4", ["4:0", "4:5"], rng.normal(size=(2, d)))
    bank.add("user2", rng.normal(size=(2, d)), ["2:x", "2:y"])
    return bank


def queries(backend: str = "torch", seed: int = 1):
    """18 queries (the first 6 for the slow scikit-learn reference backend)."""
    b = 18
    rng = np.random.default_rng(seed)
    bank = build_bank()
    X = bank.snapshot().vectors
    Q = X[rng.integers(0, X.shape[0], size=b)] + 0.3 * rng.normal(size=(b, X.shape[1]))
    users = [f"user{int(u)}" for u in rng.integers(0, 5, size=b)]
    n = 6 if backend == "reference" else b
    return Q[:n].astype(np.float32), users[:n]


def as_dict(res, rows=None) -> dict:
    sel = slice(None) if rows is None else rows
    return {f: getattr(res, f)[sel] for f in FIELDS}


def assert_same(a: dict, b: dict, what: str) -> None:
    for f in FIELDS:
        if a[f].dtype == object:
            assert a[f].tolist() == b[f].tolist(), (what, f)
        else:
            np.testing.assert_array_equal(a[f], b[f], err_msg=f"{what}: {f}")


def run_all(bank=None) -> dict:
    bank = bank or build_bank()
    out = {}
    for be in CPU_BACKENDS:
        Q, users = queries(be)
        for mode in MODES:
            out[(be, mode)] = as_dict(search(bank, Q, users, CFG, mode=mode, backend=be))
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_repeat_calls_and_fresh_banks_agree(backend, mode):
    Q, users = queries(backend)
    bank = build_bank()
    first = as_dict(search(bank, Q, users, CFG, mode=mode, backend=backend))
    assert_same(first, as_dict(search(bank, Q, users, CFG, mode=mode, backend=backend)), "same bank")
    assert_same(first, as_dict(search(build_bank(), Q, users, CFG, mode=mode, backend=backend)), "fresh bank")
    if mode == "rfmem" and backend != "reference":
        assert 0 < first["route"].sum() < len(users), "both routes should be exercised"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_batch_invariance(backend, mode):
    Q, users = queries(backend)
    bank = build_bank()
    full = search(bank, Q, users, CFG, mode=mode, backend=backend)
    b = len(users)
    for i in range(b):  # alone
        one = search(bank, Q[i : i + 1], users[i : i + 1], CFG, mode=mode, backend=backend)
        assert_same(as_dict(one), as_dict(full, slice(i, i + 1)), f"query {i} alone")
    perm = np.random.default_rng(3).permutation(b)  # shuffled
    shuf = search(bank, Q[perm], [users[p] for p in perm], CFG, mode=mode, backend=backend)
    assert_same(as_dict(shuf), as_dict(full, perm), "shuffled")
    chunked = search(bank, Q, users, CFG, mode=mode, backend=backend, max_batch=4)  # internal chunks
    assert_same(as_dict(chunked), as_dict(full), "max_batch=4")
    # other company: the same queries next to many queries of the largest user
    extra = np.random.default_rng(4).normal(size=(3, Q.shape[1])).astype(np.float32)
    mixed = search(bank, np.concatenate([extra, Q]), ["user4"] * 3 + users, CFG, mode=mode, backend=backend)
    assert_same(as_dict(mixed, slice(3, None)), as_dict(full), "with other queries")
    # a single-user batch takes the torch backend's one-matmul path
    same_user = [i for i, u in enumerate(users) if u == "user0"]
    if same_user:
        only = search(bank, Q[same_user], ["user0"] * len(same_user), CFG, mode=mode, backend=backend)
        assert_same(as_dict(only), as_dict(full, same_user), "one-user batch")


def test_save_load_gives_identical_results(tmp_path):
    bank = build_bank()
    bank.save(tmp_path / "s")
    before = run_all(bank)
    for mmap in (False, True):
        after = run_all(MemoryBank.load(tmp_path / "s", mmap=mmap))
        for key in before:
            assert_same(before[key], after[key], f"{key} mmap={mmap}")


_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {here!r})
sys.path.insert(0, {root!r})
import test_determinism as T
out = {{}}
for (be, mode), d in T.run_all().items():
    out[be + "/" + mode] = {{f: (v.tolist() if v.dtype == object else [v.dtype.str, v.tobytes().hex(), list(v.shape)]) for f, v in d.items()}}
json.dump(out, sys.stdout)
"""


def test_identical_in_another_process():
    env = dict(os.environ, PYTHONHASHSEED="12345")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(here=str(HERE), root=str(HERE.parent))],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = json.loads(proc.stdout)
    mine = run_all()
    assert sorted(other) == sorted(f"{be}/{mode}" for be, mode in mine)
    for (be, mode), d in mine.items():
        o = other[f"{be}/{mode}"]
        for f, v in d.items():
            if v.dtype == object:
                assert v.tolist() == o[f], (be, mode, f)
            else:
                dt, hexdata, shape = o[f]
                got = np.frombuffer(bytes.fromhex(hexdata), dtype=np.dtype(dt)).reshape(shape)
                np.testing.assert_array_equal(v, got, err_msg=f"{be}/{mode}/{f}")
