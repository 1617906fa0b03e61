"""Bulk writes of a Memory: add_many / update_many / delete_many.

Many users' items in one call: one encoder call, one write-ahead-log record (a group),
all-or-nothing (a bad item names its index and nothing is written, also after a
reopen), and a torn or damaged group replays as a whole or not at all. The reference
is the same writes made one item at a time through add / update / delete.
"""
from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from _serving_helpers import HashEncoder, WordChunkEncoder

from rfmem_fast import Memory, StoreError
from rfmem_fast.serving.memory import WAL_FILE

DIM = 16


def state(mem: Memory) -> dict:
    """Everything a caller can read back: per user, (id, text, metadata) of its items
    and its bank rows (bytes: bit-exact), chunk rows included."""
    snap = mem.bank.snapshot()
    out = {}
    for u, user in enumerate(snap.users):
        a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
        out[user] = ([(i.id, i.text, i.metadata) for i in mem.get_all(user)], list(snap.item_ids[a:b]),
                     snap.vectors[a:b].tobytes())
    return out


def crash(mem: Memory) -> None:
    """Drop ``mem`` as a killed process would (no close, no checkpoint)."""
    mem._lock_file.close()


def log_ops(path) -> list[str]:
    return [json.loads(line.split(b" ", 1)[1])["op"] for line in (path / WAL_FILE).read_bytes().splitlines()]


def mixed_items(rng) -> list[dict]:
    """Items of three users, interleaved: text only, vector only, both, given / new ids."""
    return [
        {"user_id": "alice", "text": "alice likes tea", "id": "a1", "metadata": {"src": "chat"}},
        {"user_id": "bob", "text": "bob plays chess"},
        {"user_id": "alice", "vector": rng.normal(size=DIM), "id": "a2"},
        {"user_id": 7, "text": "user seven", "id": 70, "metadata": None, "created_at": "2024-05-01T12:00:00Z"},
        {"user_id": "bob", "text": "bob has a cat", "vector": rng.normal(size=DIM).tolist(), "metadata": {"n": [1, 2]}},
        {"user_id": "alice", "text": "alice moved to Lyon", "id": "a3"},
    ]


def one_by_one(mem: Memory, items: list[dict], ids: list[str]) -> None:
    """The reference: each item added alone with add()."""
    for it, iid in zip(items, ids):
        v = it.get("vector")
        mem.add([it["text"]] if "text" in it else None, it["user_id"], ids=[iid],
                metadata=[it.get("metadata")], vectors=None if v is None else np.asarray(v, np.float64)[None])


# ----------------------------------------------------------------------------- add_many
def test_add_many_equals_one_by_one_adds_with_one_encoder_call():
    rng = np.random.default_rng(0)
    items = mixed_items(rng)
    enc = HashEncoder(DIM)
    mem = Memory(encoder=enc, batching=False)
    ids = mem.add_many(items)
    assert ids[0] == "a1" and ids[2] == "a2" and ids[3] == "70" and ids[5] == "a3"
    assert len(set(ids)) == 6 and all(isinstance(i, str) and i for i in ids)
    assert enc.calls == [4]  # the four texts without a vector, in ONE call
    ref = Memory(encoder=HashEncoder(DIM), batching=False)
    one_by_one(ref, items, ids)
    assert state(mem) == state(ref)
    assert mem.users() == ["alice", "bob", "7"]
    for q in ("alice likes tea", "chess", "seven"):
        for mode in ("rfmem", "dense", "recollection"):
            for user in ("alice", "bob", "7"):
                got = mem.search(q, user, k=3, mode=mode)
                want = ref.search(q, user, k=3, mode=mode)
                assert [(h.id, h.score, h.text, h.metadata) for h in got] == [(h.id, h.score, h.text, h.metadata) for h in want]
    assert mem.get("a1", "alice")[0].metadata == {"src": "chat"}


def test_add_many_chunks_long_texts_as_add_does():
    words = " ".join(f"w{i}" for i in range(14))  # 3 chunks of 6 tokens, overlap 2
    items = [{"user_id": "u", "text": words, "id": "long"}, {"user_id": "v", "text": "short text", "id": "s"},
             {"user_id": "v", "text": words + " more", "id": "long2", "metadata": {"m": 1}}]
    enc = WordChunkEncoder(DIM)
    mem = Memory(encoder=enc, chunk_overlap=2, batching=False)
    mem.add_many(items)
    assert enc.calls == [3 + 1 + 4]  # every chunk of every text in one call (15 words: 4 chunks)
    ref = Memory(encoder=WordChunkEncoder(DIM), chunk_overlap=2, batching=False)
    one_by_one(ref, items, ["long", "s", "long2"])
    assert state(mem) == state(ref)
    assert mem.count("u") == 1 and mem.count("v") == 2 and mem.bank.user_size("v") == 5
    assert mem.search("w8 w9 w10 w11 w12 w13", "u", k=1, mode="dense")[0].id == "long"


def test_add_many_ints_in_a_vector_are_floats_and_one_user_is_a_plain_record(tmp_path):
    mem = Memory(tmp_path / "m", encoder=False, dim=4, batching=False)
    mem.add_many([{"user_id": "u", "vector": [1, 0, 0, 0], "id": "x"}, {"user_id": "u", "vector": [0.0, 2.0, 0, 0]}])
    assert log_ops(tmp_path / "m") == ["add"]  # one user: the record add() writes
    mem.add_many([{"user_id": "u", "vector": [0, 0, 1, 0]}, {"user_id": "w", "vector": [0, 0, 0, 1]}])
    assert log_ops(tmp_path / "m") == ["add", "group"]  # two users: ONE line
    assert mem.search(np.array([1.0, 0, 0, 0]), "u", k=1)[0].id == "x"
    mem.close()


BAD_ADDS = [  # (items after one good item, exception, message, index, field)
    ([{"user_id": "b", "text": "   "}], ValueError, r"items\[1\]\.text is empty or whitespace only", 1, "text"),
    ([{"user_id": "b", "txt": "x"}], ValueError, r"items\[1\] has the unknown field 'txt'", 1, None),
    ([{"text": "x"}], ValueError, r"items\[1\]\.user_id is required", 1, "user_id"),
    ([{"user_id": "b", "id": "q"}], ValueError, r"items\[1\]: an item needs a text or a vector", 1, None),
    ([{"user_id": "b", "vector": [1.0] * 3}], ValueError, r"items\[1\]\.vector must have dimension 16, got 3", 1, "vector"),
    ([{"user_id": "b", "vector": [float("nan")] * DIM}], ValueError, r"items\[1\]\.vector holds NaN or Inf", 1, "vector"),
    ([{"user_id": "b", "vector": [0.0] * DIM}], ValueError, r"items\[1\]\.vector row 0 has zero norm", 1, "vector"),
    ([{"user_id": "b", "vector": [[1.0] * DIM]}], ValueError, r"items\[1\]\.vector must be a 1-D vector", 1, "vector"),
    ([{"user_id": "b", "vector": "1,2"}], TypeError, r"items\[1\]\.vector must be a list of 16 floats", 1, "vector"),
    ([{"user_id": "b", "text": "x", "id": "d"}, {"user_id": "b", "text": "y", "id": "d"}], ValueError,
     r"items\[2\]\.id: item 'd' of user 'b' is given twice in this call \(also items\[1\]\)", 2, "id"),
    ([{"user_id": "a", "text": "y", "id": "held"}], ValueError, r"items\[1\]\.id: user 'a' already holds item id 'held'", 1, "id"),
    ([{"user_id": "b", "text": "y", "metadata": {"k": float("nan")}}], ValueError,
     r"items\[1\]\.metadata is not JSON-serialisable", 1, "metadata"),
    ([{"user_id": "b", "text": "y", "metadata": ["x"]}], TypeError, r"items\[1\]\.metadata must be a dict", 1, "metadata"),
    ([{"user_id": "b", "text": "y", "created_at": "last tuesday"}], ValueError,
     r"items\[1\]\.created_at: 'last tuesday' is not an ISO-8601 date-time", 1, "created_at"),
    ([{"user_id": "b", "text": "y", "created_at": True}], TypeError,
     r"items\[1\]\.created_at: expected a number of seconds since the Unix epoch, a datetime or an ISO-8601 string, "
     r"got bool", 1, "created_at"),
    ([{"user_id": "b", "text": "y", "created_at": 1774747800000}], ValueError,
     r"items\[1\]\.created_at: 1774747800000 is outside .* looks like milliseconds", 1, "created_at"),
    ([{"user_id": "b", "text": "y", "created_at": datetime(2026, 1, 1)}], ValueError,
     r"items\[1\]\.created_at: naive datetime", 1, "created_at"),
    (["just a text"], TypeError, r"items\[1\] must be a dict, got str", 1, None),
    ([{"user_id": "b\x1f", "text": "y"}], ValueError, r"items\[1\]\.user_id holds the character U\+001F", 1, "user_id"),
    ([{"user_id": True, "text": "y"}], TypeError, r"items\[1\]\.user_id must be a str or an int", 1, "user_id"),
    ([{"user_id": "b", "text": "y", "id": ""}], ValueError, r"items\[1\]\.id must be a non-empty str", 1, "id"),
    ([{"user_id": "b", "text": "fine"}, {"user_id": "c", "text": "ZERO"}], ValueError,
     r"items\[2\]\.text 'ZERO': the encoder returned a zero or non-finite embedding", 2, "text"),
    ([{"user_id": "b", "text": "x" * 100_001}], ValueError, r"items\[1\]\.text is 100001 characters long", 1, "text"),
]


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("bad, exc, match, index, field", BAD_ADDS)
def test_a_bad_item_rejects_the_whole_call_naming_its_index(tmp_path, durable, bad, exc, match, index, field):
    enc = HashEncoder(DIM)
    enc.overrides["ZERO"] = np.zeros(DIM, np.float32)
    path = tmp_path / "m" if durable else None
    mem = Memory(path, encoder=enc, batching=False)
    mem.add(["held item"], "a", ids=["held"])
    before, log = state(mem), (path / WAL_FILE).read_bytes() if durable else None
    calls = len(enc.calls)
    with pytest.raises(exc, match=match) as info:
        mem.add_many([{"user_id": "a", "text": "good one", "id": "g"}] + bad)
    assert info.value.index == index and info.value.field == field
    assert state(mem) == before and mem.count("b") == 0 and mem.counts() == (1, 1)
    if "ZERO" not in str(bad):
        assert len(enc.calls) == calls  # refused before the encoder ran
    if durable:
        assert (path / WAL_FILE).read_bytes() == log  # not even an aborted record
        crash(mem)
        again = Memory(path, encoder=HashEncoder(DIM), batching=False)
        assert state(again) == before
        again.close()


def test_bulk_call_shapes_are_checked():
    mem = Memory(encoder=HashEncoder(DIM), batching=False)
    with pytest.raises(ValueError, match="add_many needs at least one item"):
        mem.add_many([])
    with pytest.raises(TypeError, match="items must be a sequence of dicts"):
        mem.add_many({"user_id": "u", "text": "x"})
    with pytest.raises(TypeError, match="items must be a sequence of dicts"):
        mem.delete_many("u")
    vec_only = Memory(encoder=False, dim=DIM, batching=False)
    with pytest.raises(ValueError, match=r"items\[1\]\.text: this Memory has no text encoder"):
        vec_only.add_many([{"user_id": "u", "vector": np.ones(DIM)}, {"user_id": "u", "text": "x"}])
    assert vec_only.counts() == (0, 0)


# ----------------------------------------------------------------------------- update / delete
def test_update_many_and_delete_many_equal_the_single_calls():
    rng = np.random.default_rng(1)
    words = " ".join(f"w{i}" for i in range(14))

    def build():
        m = Memory(encoder=WordChunkEncoder(DIM), chunk_overlap=2, batching=False)
        m.add(["a one", words, "a three"], "a", ids=["1", "2", "3"], metadata=[{"k": 1}, None, {"k": 3}])
        m.add(["b one", "b two"], "b", ids=["1", "2"])
        return m

    v = rng.normal(size=DIM)
    mem, ref = build(), build()
    enc = mem.encoder
    calls = len(enc.calls)
    mem.update_many([
        {"user_id": "a", "id": "2", "text": "now short"},          # a chunked item: its chunk rows go
        {"user_id": "b", "id": "1", "metadata": {"new": True}},    # metadata only
        {"user_id": "a", "id": "3", "vector": v},                  # vector only: the text stays
        {"user_id": "a", "id": "1", "metadata": None},             # None clears
        {"user_id": "b", "id": "2", "text": words + " x", "metadata": {"m": 2}},  # long now: chunked
    ])
    assert len(enc.calls) == calls + 1 and enc.calls[-1] == 1 + 4  # 15 words: 4 chunks
    ref.update("2", "a", texts="now short")
    ref.update("1", "b", metadata={"new": True})
    ref.update("3", "a", vectors=v[None])
    ref.update("1", "a", metadata=[None])
    ref.update("2", "b", texts=words + " x", metadata={"m": 2})
    assert state(mem) == state(ref)
    assert mem.get("3", "a")[0].text == "a three" and mem.get("1", "a")[0].metadata == {}
    mem.delete_many([{"user_id": "a", "id": "2"}, {"user_id": "b", "id": "2"}, {"user_id": "b", "id": 1}])
    ref.delete("2", "a")
    ref.delete(["2", "1"], "b")
    assert state(mem) == state(ref) and mem.count("b") == 0 and mem.bank.user_size("b") == 0


BAD_UPDATES = [
    ("update", [{"user_id": "zed", "id": "1", "text": "x"}], KeyError, r"items\[1\]\.user_id: unknown user 'zed'", 1),
    ("update", [{"user_id": "b", "id": "9", "text": "x"}], KeyError, r"items\[1\]\.id: user 'b' holds no item id '9'", 1),
    ("update", [{"user_id": "b", "id": "1"}], ValueError, r"items\[1\]: an update needs a text, a vector, metadata, a thread or a position", 1),
    ("update", [{"user_id": "b", "text": "x"}], ValueError, r"items\[1\]\.id is required", 1),
    ("update", [{"user_id": "a", "id": "1", "text": "x"}], ValueError, r"items\[1\]\.id: item '1' of user 'a' is given twice", 1),
    ("update", [{"user_id": "b", "id": "1", "created_at": "2024-01-01"}], ValueError,
     r"items\[1\] has the unknown field 'created_at'", 1),
    ("delete", [{"user_id": "b", "id": "9"}], KeyError, r"items\[1\]\.id: user 'b' holds no item id '9'", 1),
    ("delete", [{"user_id": "b", "id": "1", "text": "x"}], ValueError, r"items\[1\] has the unknown field 'text'", 1),
    ("delete", [{"user_id": "nobody", "id": "1"}], KeyError, r"items\[1\]\.user_id: unknown user 'nobody'", 1),
]


@pytest.mark.parametrize("op, bad, exc, match, index", BAD_UPDATES)
def test_a_bad_update_or_delete_changes_nothing(tmp_path, op, bad, exc, match, index):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    mem.add(["a one"], "a", ids=["1"])
    mem.add(["b one"], "b", ids=["1"])
    before, log = state(mem), (tmp_path / "m" / WAL_FILE).read_bytes()
    first = {"user_id": "a", "id": "1", "text": "changed"} if op == "update" else {"user_id": "a", "id": "1"}
    with pytest.raises(exc, match=match) as info:
        getattr(mem, f"{op}_many")([first] + bad)
    assert info.value.index == index
    assert state(mem) == before and (tmp_path / "m" / WAL_FILE).read_bytes() == log
    crash(mem)
    assert state(Memory(tmp_path / "m", encoder=False)) == before


# ----------------------------------------------------------------------------- the log
def bulk_writes(mem: Memory) -> dict:
    """One plain write, then one bulk write (a group); returns the state after the plain one."""
    mem.add(["first"], "a", ids=["0"])
    after_first = state(mem)
    mem.add_many([{"user_id": "a", "text": f"a{i}", "id": f"a{i}"} for i in range(3)]
                 + [{"user_id": "b", "text": f"b{i}"} for i in range(3)])
    return after_first


def test_a_bulk_write_is_one_log_line_replayed_after_a_crash(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    bulk_writes(mem)
    mem.update_many([{"user_id": "a", "id": "a0", "text": "new"}, {"user_id": "b", "id": mem.get_all("b")[0].id,
                                                                    "metadata": {"x": 1}}])
    mem.delete_many([{"user_id": "a", "id": "a1"}, {"user_id": "b", "id": mem.get_all("b")[1].id}])
    assert log_ops(tmp_path / "m") == ["add", "group", "group", "group"]
    expected = state(mem)
    crash(mem)
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    assert state(again) == expected and again.stats()["replayed"] == 4
    again.close()  # a checkpoint holds it too
    assert state(Memory(tmp_path / "m", encoder=False)) == expected


@pytest.mark.parametrize("damage", ["cut_half", "cut_newline", "flip_byte", "cut_to_crc"])
def test_a_torn_or_damaged_last_group_replays_not_at_all(tmp_path, damage):
    """The bulk write is the last line: cut or damaged anywhere, the whole group goes
    (it was never acknowledged as a whole), the write before it stays."""
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    after_first = bulk_writes(mem)
    crash(mem)
    wal = tmp_path / "m" / WAL_FILE
    data = wal.read_bytes()
    first_end = data.index(b"\n") + 1
    group = data[first_end:]
    if damage == "cut_half":
        data = data[:first_end + len(group) // 2]
    elif damage == "cut_newline":
        data = data[:-1]
    elif damage == "cut_to_crc":
        data = data[:first_end + 9]
    else:
        pos = first_end + len(group) // 2
        data = data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]
    wal.write_bytes(data)
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    assert state(again) == after_first and again.count("b") == 0 and again.count("a") == 1
    assert wal.read_bytes() == data[:first_end]  # the damaged tail is cut off
    again.add(["later"], "b", ids=["later"])  # and the log goes on
    crash(again)
    assert Memory(tmp_path / "m", encoder=False).count("b") == 1


def test_a_damaged_group_followed_by_an_intact_line_is_corruption(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    bulk_writes(mem)
    mem.add(["after"], "a", ids=["z"])
    crash(mem)
    wal = tmp_path / "m" / WAL_FILE
    lines = wal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"group"', b'"GROUP"')
    wal.write_bytes(b"".join(lines))
    with pytest.raises(StoreError, match=r"line 2 is damaged but later lines are intact"):
        Memory(tmp_path / "m", encoder=False)


def test_a_group_that_does_not_apply_is_skipped_whole_on_replay(tmp_path):
    """A group whose second record cannot apply (an id the user does not hold) leaves
    no trace of its first record either; old-style plain records around it replay."""
    from rfmem_fast.serving.wal import WriteAheadLog, encode_array

    mem = Memory(tmp_path / "m", encoder=False, dim=DIM, batching=False)
    crash(mem)
    rng = np.random.default_rng(3)
    v = lambda n: encode_array(rng.normal(size=(n, DIM)).astype(np.float32))  # noqa: E731
    log = WriteAheadLog(tmp_path / "m" / WAL_FILE)
    log.append({"seq": 1, "op": "add", "user": "a", "ids": ["1"], "texts": ["x"], "vectors": v(1), "metadata": None})
    log.append({"seq": 2, "op": "group", "ops": [
        {"op": "add", "user": "b", "ids": ["1", "2"], "texts": None, "vectors": v(2), "metadata": None},
        {"op": "delete", "user": "a", "ids": ["missing"]},
    ]})
    log.append({"seq": 3, "op": "group", "ops": [
        {"op": "add", "user": "c", "ids": ["1"], "texts": ["c"], "vectors": v(1), "metadata": [{"k": 1}]},
        {"op": "delete", "user": "a", "ids": ["1"]},
    ]})
    log.close()
    again = Memory(tmp_path / "m", encoder=False)
    st = again.stats()
    assert (st["replayed"], st["replay_skipped"]) == (2, 1)
    assert again.count("b") == 0 and again.count("a") == 0 and again.get_all("c")[0].metadata == {"k": 1}


def test_a_search_never_sees_half_a_bulk_write():
    """Readers racing bulk writes of 2 users x 5 items always count a multiple of 10."""
    mem = Memory(encoder=False, dim=DIM, batching=False)
    rng = np.random.default_rng(4)
    stop, seen, bad = threading.Event(), set(), []

    def reader():
        while not stop.is_set():
            n = mem.counts()[1]
            seen.add(n)
            if n % 10:
                bad.append(n)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(40):
            mem.add_many([{"user_id": u, "vector": rng.normal(size=DIM)} for u in ("a", "b") for _ in range(5)])
    finally:
        stop.set()
        t.join()
    assert not bad and mem.counts() == (2, 400)


def test_export_items_feed_add_many_back():
    rng = np.random.default_rng(5)
    dim = 64  # renormalising a unit float32 row of d >= 64 gives it back bit for bit (docs: import / export)
    mem = Memory(encoder=HashEncoder(dim), batching=False)
    mem.add_many([{"user_id": f"u{i % 3}", "text": f"fact {i}", "metadata": {"i": i} if i % 2 else None}
                  for i in range(12)] + [{"user_id": "v", "vector": rng.normal(size=dim)}])
    mem.delete_many([{"user_id": "u0", "id": mem.get_all("u0")[0].id}])
    out = list(mem.export_items(vectors=True))
    assert [(x["user_id"], x["id"]) for x in out] == [(u, i.id) for u in mem.users() for i in mem.get_all(u)]
    assert out[-1]["text"] is None and all(x["vector"].dtype == np.float32 for x in out)
    assert [x["metadata"] for x in out if x["user_id"] == "u1"] == [{"i": 1}, {}, {"i": 7}, {}]
    copy = Memory(encoder=False, dim=dim, batching=False)
    copy.add_many(out)
    assert state(copy) == state(mem)
    assert list(mem.export_items("u2")) == [{k: v for k, v in x.items() if k != "vector"} for x in out
                                            if x["user_id"] == "u2"]
    assert list(mem.export_items("nobody")) == []


def test_add_many_keeps_created_at_for_items_and_their_chunks_and_filters_see_it(tmp_path):
    """created_at of a bulk item is stored (UTC), survives a reopen, is each chunk row's
    too (a filter sees a long item in every row), and a time filter selects by it."""
    words = " ".join(f"w{i}" for i in range(20))  # over the 8-token window: chunked
    with Memory(tmp_path / "m", encoder=WordChunkEncoder(DIM), chunk_overlap=2) as mem:
        mem.add_many([
            {"user_id": "a", "id": "old", "text": "an old memory", "created_at": "2024-05-01T12:00:00+02:00"},
            {"user_id": "a", "id": "long", "text": words, "created_at": "2024-06-01T00:00:00Z"},
            {"user_id": "a", "id": "new", "text": "a new memory"},  # no created_at: the time of the write
        ])
    with Memory(tmp_path / "m", encoder=WordChunkEncoder(DIM), chunk_overlap=2) as mem:
        got = {it.id: it.created_at for it in mem.get_all("a")}
        assert got["old"].isoformat() == "2024-05-01T10:00:00+00:00"
        assert got["long"].isoformat() == "2024-06-01T00:00:00+00:00"
        assert got["new"].year >= 2026
        snap = mem.bank.snapshot()
        times = dict(zip(snap.item_ids, snap.created_at_or_nan))
        chunk_rows = [i for i in snap.item_ids if isinstance(i, str) and i.startswith("long\x1f")]
        assert chunk_rows and all(times[c] == times["long"] for c in chunk_rows)
        hits = mem.search("memory w3", "a", k=5, mode="dense",
                          filters={"created_at": {"$lt": "2025-01-01T00:00:00Z"}})
        assert sorted(h.id for h in hits) == ["long", "old"]


def test_add_many_takes_created_at_in_the_forms_of_add(tmp_path):
    """One parser for every write door: add_many stores each form Memory.add takes (epoch
    seconds as int / float / numpy number, an aware datetime, ISO-8601 strings with an
    offset) as the same instant add stores; an ISO string without an offset reads as UTC
    (the JSON item formats), which add refuses (it names no instant)."""
    t0 = datetime(2026, 3, 29, 1, 30, tzinfo=timezone.utc)
    forms = [1774747800, 1774747800.25, np.int64(1774747800), np.float32(1774747800.0), t0,
             t0.astimezone(timezone(timedelta(hours=-7))), "2026-03-29T01:30:00Z", "2026-03-29T03:30:00.5+02:00",
             -62135596800, "9999-12-31T23:59:59.999999+00:00"]
    vec = np.eye(DIM)
    added, bulk = Memory(encoder=False, dim=DIM), Memory(tmp_path / "m", encoder=False, dim=DIM)
    for j, t in enumerate(forms):
        added.add(None, "u", vectors=vec[j], ids=[f"i{j}"], created_at=t)
    bulk.add_many([{"user_id": "u", "id": f"i{j}", "vector": vec[j], "created_at": t} for j, t in enumerate(forms)])
    want = [i.created_at for i in added.get_all("u")]
    assert [i.created_at for i in bulk.get_all("u")] == want
    assert want[0] == t0 and want[1] == t0 + timedelta(seconds=0.25) and want[7] == t0 + timedelta(seconds=0.5)
    bulk.add_many([{"user_id": "v", "vector": vec[0], "created_at": "2026-03-29T01:30:00"}])  # no offset: UTC
    assert bulk.get_all("v")[0].created_at == t0
    with pytest.raises(ValueError, match="has no UTC offset"):
        added.add(None, "v", vectors=vec[0], created_at="2026-03-29T01:30:00")
    bulk.close()
    with Memory(tmp_path / "m", encoder=False) as again:
        assert [i.created_at for i in again.get_all("u")] == want
