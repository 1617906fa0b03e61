"""MemoryBank lifecycle: add / update / delete / compact without a full rebuild."""
from __future__ import annotations

import numpy as np
import pytest

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast._validate import l2_normalize_rows
from rfmem_fast.bank import COMPACT_MIN_DEAD

CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
MODES = ["dense", "recollection", "rfmem"]


def unit_row(v) -> np.ndarray:
    return l2_normalize_rows(np.asarray(v, dtype=np.float32)[None, :], "v")[0]


class Model:
    """Plain-dict model of a bank: {user: {id: (unit vector, text)}} in row order."""

    def __init__(self):
        self.users: dict = {}

    def add(self, user, vecs, ids, texts=None):
        rows = self.users.setdefault(user, {})
        for j, i in enumerate(ids):
            rows[i] = (unit_row(vecs[j]), None if texts is None else texts[j])

    def delete(self, user, ids):
        for i in ids:
            del self.users[user][i]

    def update(self, user, ids, vecs, texts=None):
        for j, i in enumerate(ids):
            old = self.users[user][i]
            self.users[user][i] = (unit_row(vecs[j]), old[1] if texts is None else texts[j])

    def check(self, bank: MemoryBank):
        snap = bank.snapshot()
        assert list(snap.users) == list(self.users) == bank.users
        assert snap.offsets[0] == 0 and snap.offsets[-1] == snap.vectors.shape[0] == bank.num_items
        for u, (user, rows) in enumerate(self.users.items()):
            a, b = snap.offsets[u], snap.offsets[u + 1]
            assert snap.item_ids[a:b].tolist() == list(rows), user
            assert snap.texts[a:b].tolist() == [t for _, t in rows.values()]
            assert bank.item_ids_of(user) == list(rows) and bank.user_size(user) == len(rows)
            assert bank.texts_of(user) == [t for _, t in rows.values()]
            if rows:
                np.testing.assert_array_equal(snap.vectors[a:b], np.stack([v for v, _ in rows.values()]))
        assert snap.vectors.dtype == np.float32 and snap.vectors.flags.c_contiguous
        assert snap.offsets.dtype == np.int64


def test_delete_update_basic_and_versions():
    rng = np.random.default_rng(0)
    bank, model = MemoryBank(6), Model()
    v = rng.normal(size=(5, 6))
    bank.add("a", v, ["a0", "a1", "a2", "a3", "a4"], texts=["t0", "", None, "t3", "t4"])
    model.add("a", v, ["a0", "a1", "a2", "a3", "a4"], ["t0", "", None, "t3", "t4"])
    w = rng.normal(size=(2, 6))
    bank.add(7, w, [1, "1"])  # int and str ids are different ids
    model.add(7, w, [1, "1"])
    model.check(bank)
    v0 = bank.version
    bank.delete("a", ["a1", "a3"])
    model.delete("a", ["a1", "a3"])
    assert bank.version == v0 + 1
    model.check(bank)
    nv = rng.normal(size=(2, 6))
    bank.update("a", ["a4", "a0"], nv)  # texts=None keeps the texts
    model.update("a", ["a4", "a0"], nv)
    model.check(bank)
    assert bank.item_ids_of("a") == ["a0", "a2", "a4"]  # positions kept
    u = rng.normal(size=(1, 6))
    bank.update(7, ["1"], u, texts=[""])  # "" is a valid text, distinct from None
    model.update(7, ["1"], u, [""])
    model.check(bank)
    assert bank.texts_of(7) == [None, ""]
    assert bank.version == v0 + 3


def test_update_changes_search_results_and_keeps_id():
    bank = MemoryBank(3)
    bank.add("u", np.eye(3), ["x", "y", "z"])
    q = np.array([[0.0, 0.0, 1.0]])
    for be in CPU_BACKENDS:
        assert search(bank, q, ["u"], RFMemConfig(out_k=1, probe_k=1), mode="dense", backend=be).ids_list(0) == ["z"]
    bank.update("u", ["x"], np.array([[0.0, 0.1, 1.0]]))
    bank.update("u", ["z"], np.array([[1.0, 0.0, 0.0]]))
    for be in CPU_BACKENDS:
        res = search(bank, q, ["u"], RFMemConfig(out_k=3, probe_k=3), mode="dense", backend=be)
        assert res.ids_list(0) == ["x", "y", "z"], be
        np.testing.assert_allclose(res.scores[0], [1 / np.sqrt(1.01), 0.0, 0.0], atol=1e-6)


def test_deleted_items_never_returned_by_any_mode_or_backend():
    rng = np.random.default_rng(1)
    bank = MemoryBank(8)
    for u in range(3):
        bank.add(f"u{u}", rng.normal(size=(30, 8)), [f"{u}:{i}" for i in range(30)])
    gone = {f"u{u}": {f"{u}:{i}" for i in range(0, 30, 2 + u)} for u in range(3)}
    for user, ids in gone.items():
        bank.delete(user, sorted(ids))
    # the deleted vectors are the best matches for these queries
    snap_users = [f"u{i % 3}" for i in range(12)]
    Q = rng.normal(size=(12, 8))
    cfg = RFMemConfig(score_floor=-1.0, out_k=12)
    for be in CPU_BACKENDS:
        for mode in MODES:
            res = search(bank, Q, snap_users, cfg, mode=mode, backend=be)
            for i, user in enumerate(snap_users):
                ids = res.ids_list(i)
                assert ids and not (set(ids) & gone[user]), (be, mode)
                assert all(x.startswith(user[1:] + ":") for x in ids)
                assert not (set(x for x in res.probe_ids[i] if x is not None) & gone[user])


def test_all_items_deleted_user_stays_and_gets_empty_row():
    bank = MemoryBank(4)
    bank.add("keep", np.eye(4), ["k0", "k1", "k2", "k3"])
    bank.add("gone", np.eye(4)[:2], ["g0", "g1"])
    bank.delete("gone", ["g0", "g1"])
    assert "gone" in bank and bank.user_size("gone") == 0 and bank.users == ["keep", "gone"]
    assert bank.snapshot().offsets.tolist() == [0, 4, 4]
    for be in CPU_BACKENDS:
        res = search(bank, np.ones((2, 4)), ["gone", "keep"], RFMemConfig(), mode="rfmem", backend=be)
        assert res.ids_list(0) == [] and (res.rows[0] == -1).all() and np.isneginf(res.scores[0]).all()
        assert res.rule_names[0] == "no_hits" and res.mean[0] == 0.0 and res.entropy[0] == 0.0
        assert len(res.ids_list(1)) == 4
        for mode in MODES:  # a batch of empty users only (the widest segment has 0 rows)
            res = search(bank, np.ones((2, 4)), ["gone", "gone"], RFMemConfig(out_k=3, probe_k=2), mode=mode, backend=be)
            assert res.ids.tolist() == [[None] * 3] * 2 and res.probe_ids.shape == (2, 2)
    bank.add("gone", np.eye(4)[:1], ["g0"])  # a deleted id may come back as a new item
    assert bank.item_ids_of("gone") == ["g0"]
    bank.delete("keep", ["k0", "k1", "k2", "k3"])
    bank.delete("gone", ["g0"])
    assert bank.num_items == 0 and bank.num_users == 2
    with pytest.raises(ValueError, match="empty"):
        search(bank, np.ones((1, 4)), ["keep"])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda b: b.delete("nobody", ["a0"]), KeyError, "unknown user 'nobody'"),
        (lambda b: b.delete("a", ["a0", "zz"]), KeyError, "holds no item id 'zz'"),
        (lambda b: b.delete("a", [0]), KeyError, "holds no item id 0"),
        (lambda b: b.delete("a", ["a0", "a0"]), ValueError, "duplicate item id 'a0'"),
        (lambda b: b.delete("a", []), ValueError, "at least one"),
        (lambda b: b.delete("a", "a0"), TypeError, "sequence"),
        (lambda b: b.delete("a", [1.5]), TypeError, "str or int"),
        (lambda b: b.delete("a", [True]), TypeError, "str or int"),
        (lambda b: b.update("nobody", ["a0"], np.ones((1, 4))), KeyError, "unknown user 'nobody'"),
        (lambda b: b.update("a", ["a0", "zz"], np.ones((2, 4))), KeyError, "holds no item id 'zz'"),
        (lambda b: b.update("a", ["a0"], np.ones((1, 3))), ValueError, "dimension 4"),
        (lambda b: b.update("a", ["a0"], np.ones((1, 4), np.int32)), TypeError, "floating"),
        (lambda b: b.update("a", ["a0"], np.full((1, 4), np.nan)), ValueError, "NaN or Inf"),
        (lambda b: b.update("a", ["a0"], np.zeros((1, 4))), ValueError, "zero norm"),
        (lambda b: b.update("a", ["a0", "a1"], np.ones((1, 4))), ValueError, "ids has 2 entries"),
        (lambda b: b.update("a", ["a0", "a0"], np.ones((2, 4))), ValueError, "duplicate"),
        (lambda b: b.update("a", ["a0"], np.ones((1, 4)), texts=["x", "y"]), ValueError, "texts has 2"),
        (lambda b: b.update("a", ["a0"], np.ones((1, 4)), texts=[3]), TypeError, "texts"),
        (lambda b: b.update("a", [], np.ones((0, 4))), ValueError, "at least one row"),
    ],
)
def test_delete_update_errors_are_named_and_write_nothing(call, exc, match):
    bank = MemoryBank(4)
    bank.add("a", np.eye(4), ["a0", "a1", "a2", "a3"], texts=["0", "1", "2", "3"])
    before = bank.snapshot()
    v = bank.version
    with pytest.raises(exc, match=match):
        call(bank)
    assert bank.version == v and bank.snapshot() is before
    assert bank.item_ids_of("a") == ["a0", "a1", "a2", "a3"] and bank.texts_of("a") == ["0", "1", "2", "3"]


def test_snapshots_are_immutable_under_later_writes():
    rng = np.random.default_rng(2)
    bank = MemoryBank(5)
    bank.add("a", rng.normal(size=(6, 5)), list(range(6)))
    bank.add("b", rng.normal(size=(3, 5)), list(range(3)))
    old = bank.snapshot()
    copies = (old.vectors.copy(), old.offsets.copy(), old.item_ids.copy(), old.texts.copy())
    bank.update("a", [0, 5], rng.normal(size=(2, 5)))  # rows backed by the old snapshot
    bank.delete("b", [1])
    bank.add("a", rng.normal(size=(2, 5)), [10, 11])
    new = bank.snapshot()
    bank.update("a", [10], rng.normal(size=(1, 5)))  # a tail row of the last build
    bank.add("c", rng.normal(size=(1, 5)), ["c"])
    bank.compact()
    for arr, copy in zip((old.vectors, old.offsets, old.item_ids, old.texts), copies):
        np.testing.assert_array_equal(arr, copy)
    assert old.version < new.version < bank.version
    assert not np.shares_memory(new.vectors, bank.snapshot().vectors)


def test_compact_reclaims_tombstones_without_changing_results():
    rng = np.random.default_rng(3)
    bank = MemoryBank(8)
    bank.add("u", rng.normal(size=(40, 8)), list(range(40)))
    bank.snapshot()
    bank.delete("u", list(range(0, 40, 3)))
    v = bank.version
    assert bank.compact() == 14
    snap = bank.snapshot()
    assert bank.version == v and bank.compact() == 0 and bank.snapshot() is snap
    assert bank.item_ids_of("u") == [i for i in range(40) if i % 3]


def test_auto_compaction_and_tail_growth():
    rng = np.random.default_rng(4)
    bank, model = MemoryBank(4), Model()
    n = 3 * COMPACT_MIN_DEAD
    for i in range(n):  # one row at a time: amortised tail growth, no snapshot in between
        v = rng.normal(size=(1, 4))
        bank.add("u", v, [i])
        model.add("u", v, [i])
    r = bank._rows[0]
    assert r.tail.shape[0] < 2 * n and r.n_tail == n  # capacity doubling
    for start in range(0, n - 10, 10):  # delete most of them, in small batches
        ids = list(range(start, start + 9))
        bank.delete("u", ids)
        model.delete("u", ids)
    assert bank._rows[0].n_dead < COMPACT_MIN_DEAD + 9  # compacted on the way
    model.check(bank)


def test_random_interleaving_matches_a_model():
    rng = np.random.default_rng(5)
    bank, model = MemoryBank(6), Model()
    next_id = 0
    for step in range(400):
        user = ["a", "b", 3, "d"][int(rng.integers(4))]
        op = rng.random()
        live = list(model.users.get(user, {}))
        if op < 0.4 or not live:
            m = int(rng.integers(1, 5))
            ids = list(range(next_id, next_id + m))
            next_id += m
            v = rng.normal(size=(m, 6))
            tx = [f"t{i}" if i % 2 else None for i in ids]
            bank.add(user, v, ids, tx)
            model.add(user, v, ids, tx)
        elif op < 0.7:
            pick = list(rng.choice(live, size=min(len(live), int(rng.integers(1, 4))), replace=False))
            pick = [int(x) for x in pick]
            bank.delete(user, pick)
            model.delete(user, pick)
        else:
            pick = [int(x) for x in rng.choice(live, size=min(len(live), int(rng.integers(1, 4))), replace=False)]
            v = rng.normal(size=(len(pick), 6))
            tx = None if rng.random() < 0.5 else [f"u{step}"] * len(pick)
            bank.update(user, pick, v, tx)
            model.update(user, pick, v, tx)
        if rng.random() < 0.3:
            model.check(bank)
        if rng.random() < 0.05:
            bank.compact()
    model.check(bank)


def test_cache_follows_snapshots():
    bank = MemoryBank(2)
    bank.add("u", np.eye(2), ["a", "b"])
    calls = []
    val = bank.cached("k", lambda: calls.append(1) or len(calls))
    assert bank.cached("k", lambda: 99) == val == 1
    bank.compact()  # no change of content: cache stays valid
    assert bank.cached("k", lambda: 99) == 1
    bank.delete("u", ["a"])
    assert bank.cached("k", lambda: 42) == 42


def test_user_keys_are_checked():
    bank = MemoryBank(2)
    bank.add(np.int64(5), np.eye(2), ["a", "b"])
    bank.add(np.str_("s"), np.eye(2), ["a", "b"])
    assert bank.users == [5, "s"] and type(bank.users[0]) is int and type(bank.users[1]) is str
    for bad in (True, 1.0, None, (1,)):
        with pytest.raises(TypeError, match="user"):
            bank.add(bad, np.eye(2), ["x", "y"])
        with pytest.raises(KeyError, match="unknown user"):
            bank.delete(bad, ["a"])
    assert True not in bank and 5 in bank and 5.0 not in bank
