"""Durable writes of a Memory on disk: the write-ahead log, replay, checkpoints, crashes."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _serving_helpers import HashEncoder

from rfmem_fast import Memory, StoreError
from rfmem_fast.serving.memory import META_FILE, WAL_FILE
from rfmem_fast.serving.wal import WriteAheadLog, decode_array, encode_array

DIM = 16


def state(mem: Memory) -> dict:
    """Everything a user can read back: per user, (id, text, metadata) and the vectors."""
    snap = mem.bank.snapshot()
    out = {}
    for u, user in enumerate(snap.users):
        a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
        out[user] = ([(i.id, i.text, i.metadata) for i in mem.get_all(user)], snap.vectors[a:b].tobytes())
    return out


def crash(mem: Memory) -> None:
    """Drop ``mem`` as a killed process would: no close(), no checkpoint; the OS
    releases the directory lock (the SIGKILL test in test_serving_http.py does it for real)."""
    mem._lock_file.close()


def writes(mem: Memory) -> None:
    rng = np.random.default_rng(0)
    mem.add(["a", "b", "c"], "alice", ids=["1", "2", "3"], metadata=[{"k": 1}, None, {"k": [3]}])
    mem.add(None, 7, vectors=rng.normal(size=(2, DIM)), ids=[10, 11])
    mem.update("2", "alice", texts="b2", metadata={"new": True})
    mem.update([10], 7, vectors=rng.normal(size=(1, DIM)))
    mem.delete("1", "alice")
    mem.add(["reused id"], "alice", ids=["1"])


def test_crash_without_close_replays_every_acknowledged_write(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    writes(mem)
    expected = state(mem)
    crash(mem)  # no close(): nothing but the fsynced log holds the writes
    assert json.loads((tmp_path / "m" / META_FILE).read_text())["store"] is None
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    assert state(again) == expected and again.stats()["replayed"] == 6
    again.add(["after restart"], "alice", ids=["4"])  # sequence numbers go on
    again.close()
    third = Memory(tmp_path / "m", encoder=False)
    assert [i.id for i in third.get_all("alice")] == ["2", "3", "1", "4"]


def test_checkpoint_folds_the_log_into_a_store(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    writes(mem)
    expected = state(mem)
    mem.save()
    meta = json.loads((tmp_path / "m" / META_FILE).read_text())
    assert meta["store"] == "store-00000001" and meta["wal_seq"] == 6
    assert (tmp_path / "m" / WAL_FILE).stat().st_size == 0
    mem.add(["d"], "alice", ids=["9"])
    mem.save()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["LOCK", META_FILE, "store-00000002", WAL_FILE]
    mem.close()
    again = Memory(tmp_path / "m", encoder=False)
    assert again.stats()["replayed"] == 0
    assert state(again)["alice"][0] == expected["alice"][0] + [("9", "d", {})]


def test_crash_between_checkpoint_and_log_truncation(tmp_path):
    """The new store is committed but the old log is still there: its records are
    skipped (seq <= wal_seq), never applied twice."""
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    writes(mem)
    expected = state(mem)
    log = (tmp_path / "m" / WAL_FILE).read_bytes()
    mem.save()
    crash(mem)
    (tmp_path / "m" / WAL_FILE).write_bytes(log)  # as if the process died before truncating
    (tmp_path / "m" / "store-00000099").mkdir()  # and a half-written later checkpoint
    again = Memory(tmp_path / "m", encoder=False)
    assert state(again) == expected and again.stats()["replayed"] == 0
    assert not (tmp_path / "m" / "store-00000099").exists()


def test_torn_last_line_is_dropped_corrupt_middle_line_refused(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    writes(mem)
    expected = state(mem)
    crash(mem)
    wal = tmp_path / "m" / WAL_FILE
    good = wal.read_bytes()
    wal.write_bytes(good + b'0badc0de {"seq":7,"op":"add","user":"alice","ids":["tor')  # a crash mid-append
    again = Memory(tmp_path / "m", encoder=False)
    assert state(again) == expected and wal.read_bytes() == good  # cut back to the last whole record
    crash(again)
    lines = good.splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"ids"', b'"IDS"')  # a flipped byte: its checksum fails
    wal.write_bytes(b"".join(lines))
    with pytest.raises(StoreError, match=r"wal.jsonl.*line 2 is damaged"):
        Memory(tmp_path / "m", encoder=False)


def test_refused_write_is_logged_as_aborted_and_not_replayed(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    mem.add(["a"], "u", ids=["x"])
    with pytest.raises(ValueError, match="already holds item id 'x'"):
        mem.add(["b"], "u", ids=["x"])  # passes the facade's checks, refused by the bank
    mem.add(["c"], "u", ids=["y"])
    ops = [json.loads(line.split(b" ", 1)[1])["op"] for line in (tmp_path / "m" / WAL_FILE).read_bytes().splitlines()]
    assert ops == ["add", "add", "abort", "add"]
    expected = state(mem)
    crash(mem)
    again = Memory(tmp_path / "m", encoder=False)
    assert state(again) == expected and again.stats()["replay_skipped"] == 0


def test_auto_checkpoint_bounds_the_log(tmp_path):
    mem = Memory(tmp_path / "m", encoder=False, dim=DIM, checkpoint_bytes=4096)
    rng = np.random.default_rng(1)
    for i in range(12):  # ~2.3 KB per logged add of 16 rows
        mem.add(None, "u", vectors=rng.normal(size=(16, DIM)), ids=[f"{i}-{j}" for j in range(16)])
    assert mem.stats()["checkpoints"] >= 4 and mem.stats()["wal_bytes"] <= 4096
    expected = state(mem)
    crash(mem)
    assert state(Memory(tmp_path / "m", encoder=False)) == expected


def test_opening_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Memory(tmp_path / "file", encoder=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a Memory"):
        Memory(tmp_path / "other", encoder=False)
    Memory(tmp_path / "m", encoder=False, dim=DIM).close()
    with pytest.raises(ValueError, match="dim=8 does not match the stored memory's dimension 16"):
        Memory(tmp_path / "m", encoder=False, dim=8)
    with pytest.raises(ValueError, match="encoder.dim=32 does not match"):
        Memory(tmp_path / "m", encoder=HashEncoder(32))
    (tmp_path / "m" / META_FILE).write_text('{"format": "something else"}')
    with pytest.raises(StoreError, match="memory.json"):
        Memory(tmp_path / "m", encoder=False)
    with pytest.raises(ValueError, match="has no path"):
        Memory(encoder=False, dim=DIM).save()


def test_one_open_memory_per_directory(tmp_path, capsys):
    from rfmem_fast.cli import main
    from rfmem_fast.serving import MemoryLockedError

    mem = Memory(tmp_path / "m", encoder=False, dim=DIM)
    with pytest.raises(MemoryLockedError, match="open in another process or Memory"):
        Memory(tmp_path / "m", encoder=False)
    # `rfmem serve` on the locked directory: a one-line error and exit code 2, no traceback
    assert main(["serve", "--path", str(tmp_path / "m"), "--encoder", "none", "--keep-omp-wait-policy", "--no-auth"]) == 2
    err = capsys.readouterr().err
    assert "rfmem serve: error:" in err and "LOCK" in err and "Traceback" not in err
    mem.close()
    Memory(tmp_path / "m", encoder=False).close()  # free again once closed


def test_closed_memory_refuses_calls(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    mem.add(["a"], "u")
    mem.close()
    mem.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        mem.add(["b"], "u")
    with pytest.raises(RuntimeError, match="closed"):
        mem.search("a", "u")


def test_log_array_encoding_is_exact_and_log_replays_in_order(tmp_path):
    a = np.random.default_rng(2).normal(size=(3, 5)).astype(np.float32)
    assert decode_array(json.loads(json.dumps(encode_array(a)))).tobytes() == a.tobytes()
    wal = WriteAheadLog(tmp_path / "w.jsonl")
    for i in range(3):
        wal.append({"seq": i + 1, "op": "delete", "user": "u", "ids": [i]})
    wal.close()
    assert [r["seq"] for r in WriteAheadLog(tmp_path / "w.jsonl").replay()] == [1, 2, 3]
    with pytest.raises(ValueError):
        wal.append({"seq": 4, "op": "add", "x": float("nan")})  # not JSON: nothing written
    assert [r["seq"] for r in WriteAheadLog(tmp_path / "w.jsonl").replay()] == [1, 2, 3]
    shutil.rmtree(tmp_path)
