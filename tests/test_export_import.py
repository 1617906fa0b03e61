"""``rfmem export`` / ``rfmem import``: a memory directory as JSON lines.

The round trip export -> import into a fresh directory -> export again gives the same
file byte for byte (ids, users, texts, metadata, and with --vectors the vectors bit for
bit); the lines are checked against the memory itself (its items and bank rows). Bad
lines stop the import at their line number with the batches before them written; mem0
style lines import with --text-field / --ignore-extra / --user.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from _serving_helpers import WordChunkEncoder

import rfmem_fast.serving.memory as memory_mod
from rfmem_fast import Memory
from rfmem_fast.cli import main

DIM = 384  # the default encoder's: `rfmem import` opens new memories with it


@pytest.fixture(autouse=True)
def fake_default_encoder(monkeypatch):
    """Every Memory the commands open gets the deterministic encoder (no model load)."""
    monkeypatch.setattr(memory_mod, "_default_encoder", lambda **kw: WordChunkEncoder(DIM, max_tokens=40))


def build(path) -> Memory:
    rng = np.random.default_rng(0)
    mem = Memory(path, encoder=WordChunkEncoder(DIM, max_tokens=40), batching=False)
    mem.add(["I moved to Lyon", "my sister is Ana", " ".join(f"word{i}" for i in range(50))], "alice",
            ids=["a1", "a2", "long"], metadata=[{"src": "chat", "n": [1, 2.5, None]}, None, {"big": 2 ** 70}])
    mem.add_many([{"user_id": "bob", "vector": rng.normal(size=DIM), "id": "v1"},
                  {"user_id": "bob", "text": "bob: 日本語 ✓ \"quoted\"\nnewline", "metadata": {"é": "ü"}},
                  {"user_id": 7, "text": "user seven", "id": 70}])
    mem.delete("a2", "alice")
    mem.add(["after the delete"], "alice", ids=["a4"])
    mem.update("a1", "alice", metadata={"src": "edited"})
    return mem


def lines_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("vectors", [True, False])
def test_export_import_export_round_trip_is_identical(tmp_path, vectors, capsys):
    mem = build(tmp_path / "one")
    snap = mem.bank.snapshot()
    rows = {(u, i): snap.vectors[r] for k, u in enumerate(snap.users)
            for r, i in zip(range(snap.offsets[k], snap.offsets[k + 1]), snap.item_ids[snap.offsets[k]:snap.offsets[k + 1]])}
    expected = [(u, it.id, it.text, it.metadata) for u in mem.users() for it in mem.get_all(u)]
    times = [it.created_at.isoformat() for u in mem.users() for it in mem.get_all(u)]
    mem.close()
    flag = ["--vectors"] if vectors else []
    f1, f2 = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(["export", "--memory-dir", str(tmp_path / "one"), "--out", str(f1), *flag]) == 0
    assert "6 items of 3 users" in capsys.readouterr().err
    got = lines_of(f1)
    assert [(x["user_id"], x["id"], x["text"], x["metadata"]) for x in got] == expected
    assert all(set(x) == {"id", "user_id", "text", "metadata", "created_at"}
               | ({"vector"} if (vectors or x["text"] is None) and x["id"] != "long" else set()) for x in got)
    assert [x["created_at"] for x in got] == times  # each item's creation time, as Item.created_at
    for x in got:  # the stored rows, bit for bit; the chunked text has none (import re-embeds it)
        if "vector" in x:
            assert np.array_equal(np.asarray(x["vector"], np.float64).astype(np.float32), rows[(x["user_id"], x["id"])])
    assert [len(x["vector"]) for x in got if "vector" in x] == [DIM] * (5 if vectors else 1)
    assert main(["import", "--memory-dir", str(tmp_path / "two"), "--in", str(f1), "--batch", "3"]) == 0
    assert "6 items from 6 lines in 2 writes, 0 skipped" in capsys.readouterr().err
    assert main(["export", "--memory-dir", str(tmp_path / "two"), "--out", str(f2), *flag]) == 0
    assert f2.read_bytes() == f1.read_bytes()
    with Memory(tmp_path / "one", encoder=False) as one, Memory(tmp_path / "two", encoder=False) as two:
        # every bank row, chunk rows included, re-made bit for bit (texts re-embedded by the same encoder;
        # a batch puts its chunk rows after its items, so only the chunk rows' positions may differ)
        s1, s2 = one.bank.snapshot(), two.bank.snapshot()
        by_id = lambda s: {(s.users[k], s.item_ids[r]): s.vectors[r].tobytes()  # noqa: E731
                           for k in range(s.num_users) for r in range(s.offsets[k], s.offsets[k + 1])}
        assert by_id(s1) == by_id(s2) and len(by_id(s1)) == s1.num_items == 8
        assert two.count("alice") == 3 and two.bank.user_size("alice") == 3 + 2


def test_export_one_user_and_to_stdout(tmp_path, capsys):
    build(tmp_path / "m").close()
    assert main(["export", "--memory-dir", str(tmp_path / "m"), "--out", "-", "--user", "bob"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["user_id"], x["text"]) for x in out][0] == ("bob", None) and {x["user_id"] for x in out} == {"bob"}
    assert len(out) == 2


def write(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return str(path)


def test_a_bad_line_stops_the_import_at_its_number_after_whole_batches(tmp_path, capsys):
    good = [{"user_id": "u", "id": f"i{k}", "text": f"text {k}"} for k in range(5)]
    src = write(tmp_path / "in.jsonl", good[:3] + ["", good[3], {"user_id": "u", "id": "bad", "text": "  "}, good[4]])
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src, "--batch", "3"]) == 1
    err = capsys.readouterr().err
    assert "line 6: text is empty or whitespace only" in err and "3 items were imported before" in err
    with Memory(tmp_path / "m", encoder=False) as mem:
        assert [i.id for i in mem.get_all("u")] == ["i0", "i1", "i2"]  # batch 1 only: batch 2 is all or nothing
    fixed = write(tmp_path / "in.jsonl", good[:3] + ["", good[3], {"user_id": "u", "id": "bad", "text": "fixed"}, good[4]])
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", fixed, "--batch", "3"]) == 1
    assert "line 1: id: user 'u' already holds item id 'i0'" in capsys.readouterr().err
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", fixed, "--batch", "3", "--skip-existing"]) == 0
    assert "3 items from 6 lines in 1 writes, 3 skipped" in capsys.readouterr().err
    with Memory(tmp_path / "m", encoder=False) as mem:
        assert [i.id for i in mem.get_all("u")] == ["i0", "i1", "i2", "i3", "bad", "i4"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: is not JSON"),
    ("[1, 2]", "line 2: must be a JSON object (one item), got list"),
    ({"user_id": "u", "txt": "x"}, "line 2: has the unknown field 'txt'"),
    ({"text": "no user"}, "line 2: has no user_id"),
    ({"user_id": "u", "text": "x", "created_at": "yesterday"}, "line 2: created_at: 'yesterday' is not an ISO-8601 date-time"),
    ({"user_id": "u", "text": "x", "created_at": True}, "line 2: created_at: expected a number of seconds"),
    ({"user_id": "u", "text": "x", "created_at": 1774747800000}, "line 2: created_at: 1774747800000 is outside"),
    ({"user_id": "u", "vector": [1.0, 2.0]}, "line 2: vector must have dimension 384, got 2"),
    ({"user_id": "u", "id": "a", "text": "twice"}, "line 2: id: item 'a' of user 'u' is given twice in this call (also line 1)"),
    ({"user_id": "u", "text": "x", "metadata": [1]}, "line 2: metadata must be a dict or None"),
])
def test_bad_lines_are_named_and_nothing_of_their_batch_is_written(tmp_path, capsys, line, message):
    src = write(tmp_path / "in.jsonl", [{"user_id": "u", "id": "a", "text": "first"}, line])
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src]) == 1
    assert message in capsys.readouterr().err
    with Memory(tmp_path / "m", encoder=False) as mem:
        assert mem.counts() == (0, 0)


def test_mem0_style_lines_import_with_a_text_field_and_a_default_user(tmp_path, capsys):
    mem0 = [{"id": "m1", "memory": "Likes green tea", "user_id": "alice", "hash": "9f1", "metadata": None,
             "created_at": "2024-07-20T10:00:00.123456-07:00", "updated_at": None},
            {"id": "m2", "memory": "Lives in Oslo", "hash": "77a", "metadata": {"category": "home"},
             "created_at": "2024-07-21T08:30:00Z"}]
    src = write(tmp_path / "mem0.jsonl", mem0)
    argv = ["import", "--memory-dir", str(tmp_path / "m"), "--in", src, "--text-field", "memory"]
    assert main(argv) == 1
    assert "line 1: has the unknown field 'hash'" in capsys.readouterr().err
    assert main(argv + ["--ignore-extra"]) == 1
    assert "line 2: has no user_id" in capsys.readouterr().err
    assert main(argv + ["--ignore-extra", "--user", "bob"]) == 0
    assert "2 lines kept their created_at" in capsys.readouterr().err
    with Memory(tmp_path / "m", encoder=False) as mem:
        assert [(i.id, i.text, i.metadata) for i in mem.get_all("alice")] == [("m1", "Likes green tea", {})]
        assert mem.get_all("alice")[0].created_at.isoformat() == "2024-07-20T17:00:00.123456+00:00"  # kept, in UTC
        assert [(i.id, i.text, i.metadata) for i in mem.get_all("bob")] == [("m2", "Lives in Oslo", {"category": "home"})]
    both = write(tmp_path / "both.jsonl", [{"user_id": "u", "text": "a", "memory": "b"}])
    assert main(["import", "--memory-dir", str(tmp_path / "m2"), "--in", both, "--text-field", "memory"]) == 1
    assert "line 1: has both 'text' and the --text-field 'memory'" in capsys.readouterr().err


def test_vectors_only_import_and_directory_errors(tmp_path, capsys):
    rng = np.random.default_rng(1)
    vecs = rng.normal(size=(3, 8)).astype(np.float32)
    src = write(tmp_path / "v.jsonl", [{"user_id": "u", "id": str(k), "vector": v.tolist()} for k, v in enumerate(vecs)])
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src, "--encoder", "none", "--dim", "8"]) == 0
    with Memory(tmp_path / "m", encoder=False) as mem:
        want = vecs / np.linalg.norm(vecs.astype(np.float64), axis=1, keepdims=True)
        assert np.allclose(mem.bank.snapshot().vectors, want, atol=1e-7) and mem.get_all("u")[0].text is None
    capsys.readouterr()
    assert main(["export", "--memory-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "is not a Memory directory" in capsys.readouterr().err and not (tmp_path / "nothing").exists()
    with Memory(tmp_path / "m", encoder=False):  # open elsewhere: the lock is held
        assert main(["export", "--memory-dir", str(tmp_path / "m"), "--out", str(tmp_path / "x.jsonl")]) == 2
        assert "is open in another process" in capsys.readouterr().err
        assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src, "--encoder", "none"]) == 2
    assert not (tmp_path / "x.jsonl").exists()
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", str(tmp_path / "missing.jsonl"),
                 "--encoder", "none"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src, "--batch", "0"]) == 2


def test_import_takes_created_at_as_epoch_seconds_or_iso_8601(tmp_path, capsys):
    """An import line's created_at is read by the parser of Memory.add / add_many: epoch
    seconds (a JSON int or float) or ISO-8601 (an offset-less string as UTC)."""
    forms = [1774747800, 1774747800.5, "2026-03-29T03:30:00+02:00", "2026-03-29T01:30:00"]
    src = write(tmp_path / "in.jsonl", [{"user_id": "u", "id": f"i{j}", "text": f"fact {j}", "created_at": t}
                                        for j, t in enumerate(forms)])
    assert main(["import", "--memory-dir", str(tmp_path / "m"), "--in", src]) == 0
    assert "4 lines kept their created_at" in capsys.readouterr().err
    with Memory(tmp_path / "m", encoder=False) as mem:
        assert [i.created_at.isoformat() for i in mem.get_all("u")] == [
            "2026-03-29T01:30:00+00:00", "2026-03-29T01:30:00.500000+00:00", "2026-03-29T01:30:00+00:00",
            "2026-03-29T01:30:00+00:00"]
