"""Per-item metadata of MemoryBank: add / update / get / delete, validation, store round trip."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rfmem_fast import MemoryBank, StoreError, search
from rfmem_fast.store import CURRENT, MANIFEST


def nested(depth):
    """{"a": {"a": ... 1}} with ``depth`` dicts."""
    out = 1
    for _ in range(depth):
        out = {"a": out}
    return out


def vecs(n, d=8, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d))


def make_bank():
    bank = MemoryBank(8)
    bank.add("alice", vecs(4), ["a0", "a1", "a2", "a3"], texts=["t0", "t1", "t2", "t3"],
             metadata=[{"src": "chat", "tags": ["x", "y"]}, None, {"n": 1.5, "deep": {"k": [1, {"z": None}]}}, {}])
    bank.add(7, vecs(2, seed=1), [10, 11], metadata=[{"who": "int user"}, None])
    return bank


def test_add_get_update_delete_metadata():
    bank = make_bank()
    assert bank.get_metadata("alice") == [
        {"src": "chat", "tags": ["x", "y"]}, None, {"n": 1.5, "deep": {"k": [1, {"z": None}]}}, {}
    ]
    assert bank.get_metadata(7, [11, 10]) == [None, {"who": "int user"}]
    v0 = bank.version
    bank.set_metadata("alice", ["a1", "a0"], [{"new": True}, None])  # None clears
    assert bank.version == v0  # searches never read metadata: no new snapshot
    assert bank.get_metadata("alice", ["a0", "a1"]) == [None, {"new": True}]
    bank.update("alice", ["a2"], vecs(1, seed=5))  # metadata kept when not given
    assert bank.get_metadata("alice", ["a2"])[0]["n"] == 1.5
    bank.update("alice", ["a3"], vecs(1, seed=6), texts=["changed"], metadata=[{"m": 3}])
    assert bank.texts_of("alice")[3] == "changed" and bank.get_metadata("alice", ["a3"]) == [{"m": 3}]
    assert bank.version == v0 + 2
    bank.delete("alice", ["a1"])
    bank.add("alice", vecs(1, seed=9), ["a1"])  # a reused id starts without metadata
    assert bank.get_metadata("alice", ["a1"]) == [None]


def test_metadata_is_copied_in_and_out():
    bank = MemoryBank(8)
    meta = {"tags": ["a"]}
    bank.add("u", vecs(1), ["x"], metadata=[meta])
    meta["tags"].append("mutated by the caller")
    got = bank.get_metadata("u", ["x"])[0]
    assert got == {"tags": ["a"]}
    got["tags"].append("mutated by the reader")
    assert bank.get_metadata("u", ["x"])[0] == {"tags": ["a"]}


@pytest.mark.parametrize(
    "metadata, exc, match",
    [
        ({"a": 1}, TypeError, "sequence of dicts"),  # a dict, not one per item
        ([{"a": 1}], ValueError, "metadata has 1 entries"),
        ([["a"], None], TypeError, r"metadata\[0\] must be a dict"),
        ([{1: "int key"}, None], ValueError, r"metadata\[0\] does not survive a JSON round trip"),
        ([None, {"t": (1, 2)}], ValueError, r"metadata\[1\] does not survive"),
        ([{"x": float("nan")}, None], ValueError, r"metadata\[0\] is not JSON"),
        ([{"x": object()}, None], ValueError, r"metadata\[0\] is not JSON"),
        ([None, {"a": [{"b": 1}] * 2}], None, None),  # fine: shared sub-objects are copied
        ([None, nested(65)], ValueError, r"metadata\[1\] nests deeper than 64 levels"),
    ],
)
def test_bad_metadata_is_refused_and_nothing_written(metadata, exc, match):
    bank = MemoryBank(8)
    if exc is None:
        bank.add("u", vecs(2), ["p", "q"], metadata=metadata)
        assert bank.get_metadata("u") == metadata
        return
    with pytest.raises(exc, match=match):
        bank.add("u", vecs(2), ["p", "q"], metadata=metadata)
    assert "u" not in bank and bank.version == 0


def test_set_metadata_checks_ids():
    bank = make_bank()
    with pytest.raises(KeyError, match="holds no item id 'zz'"):
        bank.set_metadata("alice", ["a0", "zz"], [{"a": 1}, None])
    assert bank.get_metadata("alice", ["a0"]) == [{"src": "chat", "tags": ["x", "y"]}]  # nothing written
    with pytest.raises(ValueError, match="metadata has 1 entries"):
        bank.set_metadata("alice", ["a0", "a1"], [{"a": 1}])
    with pytest.raises(ValueError, match="at least one item id"):
        bank.set_metadata("alice", [], [])
    with pytest.raises(KeyError, match="holds no item id 'zz'"):
        bank.get_metadata("alice", ["zz"])
    with pytest.raises(KeyError, match="unknown user"):
        bank.get_metadata("nobody")


def test_metadata_survives_save_load_and_is_checksummed(tmp_path):
    bank = make_bank()
    bank.delete("alice", ["a1"])
    bank.save(tmp_path / "s")
    loaded = MemoryBank.load(tmp_path / "s")
    for user in ("alice", 7):
        assert loaded.get_metadata(user) == bank.get_metadata(user)
        assert loaded.item_ids_of(user) == bank.item_ids_of(user)
    q = vecs(2, seed=3)
    a, b = search(bank, q, ["alice", 7]), search(loaded, q, ["alice", 7])
    assert a.ids.tolist() == b.ids.tolist()
    # the file is covered by the manifest's checksums
    d = tmp_path / "s" / json.loads((tmp_path / "s" / CURRENT).read_text())["dir"]
    assert "metadata.json" in json.loads((d / MANIFEST).read_text())["files"]
    raw = (d / "metadata.json").read_bytes()
    (d / "metadata.json").write_bytes(raw.replace(b"chat", b"chaT"))
    with pytest.raises(StoreError, match="metadata.json.*sha256"):
        MemoryBank.load(tmp_path / "s")


def test_store_without_metadata_has_no_file_and_loads(tmp_path):
    bank = MemoryBank(8)
    bank.add("u", vecs(3), ["a", "b", "c"])
    bank.save(tmp_path / "s")
    d = tmp_path / "s" / json.loads((tmp_path / "s" / CURRENT).read_text())["dir"]
    assert not (d / "metadata.json").exists()  # as written before metadata existed
    loaded = MemoryBank.load(tmp_path / "s")
    assert loaded.get_metadata("u") == [None, None, None]
