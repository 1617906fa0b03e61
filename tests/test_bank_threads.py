"""Conversation structure of bank items: ``threads`` / ``positions`` (MemoryBank.add), their
checks, their life through update / delete / compact / save / load, and the reserved
filter fields ``thread`` / ``position``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from rfmem_fast import MemoryBank
from rfmem_fast.bank import NO_POSITION
from rfmem_fast.filters import parse_filter
from rfmem_fast.store import read_store

D = 8


def _vecs(rng: np.random.Generator, m: int) -> np.ndarray:
    return rng.normal(size=(m, D)).astype(np.float32)


def _bank(rng: np.random.Generator) -> MemoryBank:
    b = MemoryBank(D)
    b.add("u", _vecs(rng, 5), ids=["a", "b", "c", "d", "e"], threads=["s1", "s1", 7, None, "s1"],
          positions=[2, 0, None, None, 1])  # fmt: skip
    b.add("v", _vecs(rng, 2), ids=[1, 2])
    return b


def test_snapshot_arrays_and_readers():
    b = _bank(np.random.default_rng(0))
    s = b.snapshot()
    assert s.threads.tolist() == ["s1", "s1", 7, None, "s1", None, None]
    assert s.positions.tolist() == [2, 0, NO_POSITION, NO_POSITION, 1, NO_POSITION, NO_POSITION]
    assert b.threads_of("u") == ["s1", "s1", 7, None, "s1"]
    assert b.positions_of("u", ["e", "c"]) == [1, None]
    assert b.threads_of("v") == [None, None]
    with pytest.raises(KeyError, match="holds no item id 'zz'"):
        b.threads_of("u", ["zz"])


def test_no_threads_means_none_arrays():
    b = MemoryBank(D)
    b.add("u", _vecs(np.random.default_rng(1), 3), ids=[0, 1, 2])
    s = b.snapshot()
    assert s.threads is None and s.positions is None
    assert s.threads_or_none.tolist() == [None] * 3 and s.positions_or_missing.tolist() == [NO_POSITION] * 3


def test_one_thread_for_all_items_and_numpy_scalars():
    b = MemoryBank(D)
    b.add("u", _vecs(np.random.default_rng(2), 3), ids=[0, 1, 2], threads=np.str_("t"),
          positions=np.array([3, 1, 2]))  # fmt: skip
    assert b.threads_of("u") == ["t", "t", "t"] and b.positions_of("u") == [3, 1, 2]
    assert all(type(p) is int for p in b.positions_of("u"))
    b.add("u", _vecs(np.random.default_rng(3), 1), ids=[3], threads=np.int64(5))
    assert b.threads_of("u", [3]) == [5] and type(b.threads_of("u", [3])[0]) is int


@pytest.mark.parametrize(
    "kw, exc, msg",
    [
        (dict(threads=[True, "x"]), TypeError, r"threads\[0\] must be a str or an int"),
        (dict(threads=[1.5, "x"]), TypeError, r"threads\[0\]"),
        (dict(threads=["x"]), ValueError, "threads has 1 entries but there are 2 items"),
        (dict(threads=b"xy"), TypeError, "threads must be None"),
        (dict(positions=[0, 1]), ValueError, r"positions\[0\] is 0 but threads\[0\] is None"),
        (dict(threads="t", positions=[0]), ValueError, "positions has 1 entries"),
        (dict(threads="t", positions=[-1, 0]), ValueError, r"positions\[0\] must be an int in \[0, 2\*\*63 - 1\]"),
        (dict(threads="t", positions=[0, 2**63]), ValueError, r"positions\[1\]"),
        (dict(threads="t", positions=[0, 1.0]), TypeError, r"positions\[1\] must be an int >= 0"),
        (dict(threads="t", positions=[True, 1]), TypeError, r"positions\[0\]"),
        (dict(threads="t", positions=3), TypeError, "positions must be None or a sequence"),
    ],
)
def test_bad_threads_and_positions_are_refused(kw, exc, msg):
    b = _bank(np.random.default_rng(4))
    v0 = b.version
    with pytest.raises(exc, match=msg):
        b.add("u", _vecs(np.random.default_rng(5), 2), ids=["x", "y"], **kw)
    assert b.version == v0 and b.user_size("u") == 5  # nothing written


def test_update_keeps_replaces_and_checks():
    rng = np.random.default_rng(6)
    b = _bank(rng)
    b.update("u", ["a"], _vecs(rng, 1))  # threads / positions kept
    assert b.threads_of("u", ["a"]) == ["s1"] and b.positions_of("u", ["a"]) == [2]
    b.update("u", ["c"], _vecs(rng, 1), threads=["s2"], positions=[4])
    assert b.threads_of("u", ["c"]) == ["s2"] and b.positions_of("u", ["c"]) == [4]
    b.update("u", ["c"], _vecs(rng, 1), positions=[9])  # thread kept
    assert b.threads_of("u", ["c"]) == ["s2"] and b.positions_of("u", ["c"]) == [9]
    with pytest.raises(ValueError, match="a position orders an item within its thread"):
        b.update("u", ["a"], _vecs(rng, 1), threads=[None])  # its position 2 would stay
    with pytest.raises(ValueError, match=r"the item's threads\[0\] is None"):
        b.update("u", ["d"], _vecs(rng, 1), positions=[1])  # d has no thread
    b.update("u", ["a"], _vecs(rng, 1), threads=[None], positions=[None])
    assert b.threads_of("u", ["a"]) == [None] and b.positions_of("u", ["a"]) == [None]


def test_delete_compact_and_auto_compaction_keep_alignment():
    rng = np.random.default_rng(7)
    b = MemoryBank(D)
    n = 200
    ids = list(range(n))
    b.add("u", _vecs(rng, n), ids=ids, threads=[f"t{i % 7}" for i in ids], positions=[i // 7 for i in ids])
    b.snapshot()
    gone = [i for i in ids if i % 3]  # 133 deletions: the user is compacted on the spot
    b.delete("u", gone)
    keep = [i for i in ids if i % 3 == 0]
    assert b.item_ids_of("u") == keep
    assert b.threads_of("u") == [f"t{i % 7}" for i in keep] and b.positions_of("u") == [i // 7 for i in keep]
    b.add("u", _vecs(rng, 1), ids=[999], threads=["new"], positions=[0])
    b.compact()
    s = b.snapshot()
    assert s.threads.tolist() == [f"t{i % 7}" for i in keep] + ["new"]
    assert s.positions.tolist() == [i // 7 for i in keep] + [0]


def test_save_load_format_6_and_older_formats(tmp_path):
    rng = np.random.default_rng(8)
    b = _bank(rng)
    b.save(tmp_path / "s")
    c = read_store(tmp_path / "s")
    man = json.loads(next((tmp_path / "s").glob("snap-*/manifest.json")).read_text())
    assert man["format_version"] == 6 and "threads.json" in man["files"] and "positions.npy" in man["files"]
    assert c.threads.tolist() == b.snapshot().threads.tolist()
    assert c.positions.tolist() == b.snapshot().positions.tolist()
    for mmap in (False, True):
        got = MemoryBank.load(tmp_path / "s", mmap=mmap)
        assert got.threads_of("u") == b.threads_of("u") and got.positions_of("u") == b.positions_of("u")
        assert got.threads_of("v") == [None, None]
        assert type(got.threads_of("u")[2]) is int  # JSON keeps str vs int
    # a bank without threads is written in the format older versions read, and loads with none
    plain = MemoryBank(D)
    plain.add("u", _vecs(rng, 2), ids=[0, 1])
    plain.save(tmp_path / "p")
    man = json.loads(next((tmp_path / "p").glob("snap-*/manifest.json")).read_text())
    assert man["format_version"] == 4 and "threads.json" not in man["files"]
    got = MemoryBank.load(tmp_path / "p")
    assert got.snapshot().threads is None and got.threads_of("u") == [None, None]
    i8 = plain.astype("int8")
    i8.save(tmp_path / "i")
    assert json.loads(next((tmp_path / "i").glob("snap-*/manifest.json")).read_text())["format_version"] == 5


def test_astype_and_from_arrays_carry_threads():
    rng = np.random.default_rng(9)
    b = _bank(rng)
    for dt in ("float16", "int8"):
        assert b.astype(dt).threads_of("u") == b.threads_of("u")
    s = b.snapshot()
    c = MemoryBank.from_arrays(s.vectors, s.offsets, list(s.users), list(s.item_ids), threads=s.threads.tolist(),
                               positions=[None if p < 0 else int(p) for p in s.positions])  # fmt: skip
    assert c.snapshot().threads.tolist() == s.threads.tolist()
    assert c.snapshot().positions.tolist() == s.positions.tolist()
    with pytest.raises(ValueError, match="positions"):
        MemoryBank.from_arrays(s.vectors, s.offsets, positions=[0] * s.num_items)


def test_reserved_filter_fields():
    rng = np.random.default_rng(10)
    b = _bank(rng)
    b.set_metadata("u", ["a"], [{"thread": "shadowed", "position": 99}])
    s = b.snapshot()
    u = b.user_index("u")

    def rows(f):
        return np.flatnonzero(parse_filter(f).mask(b, s, u)).tolist()

    assert rows({"thread": "s1"}) == [0, 1, 4]
    assert rows({"thread": 7}) == [2]
    assert rows({"thread": "7"}) == []
    assert rows({"thread": {"$in": ["s1", 7]}}) == [0, 1, 2, 4]
    assert rows({"thread": {"$ne": "s1"}}) == [2]  # an item without a thread matches no comparison
    assert rows({"thread": {"$exists": False}}) == [3]
    assert rows({"position": {"$gte": 1}}) == [0, 4]
    assert rows({"position": {"$exists": True}}) == [0, 1, 4]
    assert rows({"thread": "s1", "position": {"$lt": 2}}) == [1, 4]
    assert rows({"$not": {"thread": "s1"}}) == [2, 3]
    # the same filter through a search: only matching items come back
    from rfmem_fast import RFMemConfig, search

    q = _vecs(rng, 1)
    res = search(b, q, ["u"], RFMemConfig(out_k=5, probe_k=5), mode="dense", backend="reference",
                 filters={"thread": "s1"})  # fmt: skip
    assert sorted(res.ids_list(0)) == ["a", "b", "e"]
