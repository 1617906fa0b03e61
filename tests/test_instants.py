"""Creation times (``created_at``) at their edges.

* An instant outside 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z (what Python's
  datetime holds in UTC) is refused at every door that takes one: ``Memory.add``,
  ``add_many``, ``rfmem import``, the HTTP bodies (422) and ``MemoryBank.add`` / ``update`` /
  ``from_arrays``, naming the argument, the range and, for epoch milli- / micro-seconds,
  what to divide by; nothing is written.
* A time outside that range already stored (by an older version: a crafted store, a crafted
  write-ahead-log record) reads as unknown: the user still loads, lists, gets, searches,
  exports (``rfmem export`` says how many times are unknown) and imports back.
* Hits carry their item's creation time (Python ``Hit.created_at``, HTTP ``hits[].created_at``),
  read from the searched snapshot, chunk hits and cached answers included.
* A datetime in metadata is refused with the ``.isoformat()`` advice.

(The MCP server's side, ``search_memories`` hits with ``created_at`` and one blank-text message
on the three surfaces: tests/test_mcp_server.py.)
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import re
import zlib
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from _serving_helpers import HashEncoder, WordChunkEncoder

from rfmem_fast import Memory, MemoryBank
from rfmem_fast.cli import main as rfmem_main
from rfmem_fast.serving.transfer import ImportLineError, export_line, import_jsonl
from rfmem_fast.store import write_store

UTC = timezone.utc
RANGE = "0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z"
SECONDS = "-62135596800 <= seconds since the Unix epoch < 253402300800"
T0 = datetime(2026, 3, 29, 1, 30, tzinfo=UTC)  # = 1774747800 s (date -u -d @1774747800)
FIRST = datetime(1, 1, 1, tzinfo=UTC)
LAST = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
# (a value outside the range, the hint its message must give; None: no unit hint). The dates
# of the hints were read off `date -u -d @SECONDS`, not off this package.
BAD = [
    (1774747800000, "1774747800000 looks like milliseconds since the epoch: divide by 1000 (2026-03-29T01:30:00Z)"),
    (1e15, "1000000000000000 looks like microseconds since the epoch: divide by 1000000 (2001-09-09T01:46:40Z)"),
    (-1e12, "-1000000000000 looks like milliseconds since the epoch: divide by 1000 (1938-04-24T22:13:20Z)"),
    (253402300800, None),  # 10000-01-01T00:00:00Z, just past the end: no unit reads it as a plausible time
]


def _check_refusal(msg: str, where: str, hint: str | None) -> None:
    assert msg.startswith(f"{where}: "), msg
    assert RANGE in msg and SECONDS in msg, msg
    if hint is None:
        assert "looks like" not in msg, msg
    else:
        assert hint in msg, msg


# ----------------------------------------------------------------------------- the doors
@pytest.mark.parametrize("bad, hint", BAD)
def test_memory_add_refuses_an_instant_outside_the_range_and_logs_nothing(tmp_path, bad, hint):
    mem = Memory(tmp_path / "m", encoder=False, dim=8)
    v = np.eye(8)[:2]
    for created, where, rows in ((bad, "created_at", v[:1]), (np.float64(bad), "created_at", v[:1]),
                                 ([T0, bad], "created_at[1]", v)):
        with pytest.raises(ValueError) as err:
            mem.add(None, "u", vectors=rows, created_at=created)
        _check_refusal(str(err.value), where, hint)
    wal = tmp_path / "m" / "wal.jsonl"
    assert not wal.exists() or wal.stat().st_size == 0  # refused before the log
    assert mem.get_all("u") == [] and mem.count("u") == 0
    mem.add(None, "u", vectors=v[:1], ids=["ok"], created_at=T0)  # the user is fine
    assert [i.created_at for i in mem.get_all("u")] == [T0]
    mem.close()


def test_memory_bank_refuses_it_at_add_update_and_from_arrays():
    bank = MemoryBank(4)
    with pytest.raises(ValueError) as err:
        bank.add("u", np.eye(2, 4), ["a", "b"], created_at=1774747800000)
    _check_refusal(str(err.value), "created_at", BAD[0][1])
    with pytest.raises(ValueError) as err:
        bank.add("u", np.eye(2, 4), ["a", "b"], created_at=np.array([0.0, 1e15]))
    _check_refusal(str(err.value), "created_at[1]", BAD[1][1])
    assert "u" not in bank
    bank.add("u", np.eye(2, 4), ["a", "b"], created_at=[-62135596800.0, 0.0])  # the first instant is in range
    with pytest.raises(ValueError) as err:
        bank.update("u", ["a"], np.eye(1, 4), created_at=-1e12)
    _check_refusal(str(err.value), "created_at", BAD[2][1])
    assert bank.created_at_of("u").tolist() == [-62135596800.0, 0.0]  # unchanged
    with pytest.raises(ValueError) as err:
        MemoryBank.from_arrays(np.eye(2, 4), [0, 2], created_at=[0.0, 253402300800.0])
    _check_refusal(str(err.value), "created_at[1]", None)
    with pytest.raises(ValueError, match=r"^created_at must be finite \(or NaN: unknown\), got -inf"):
        bank.add("u", np.eye(1, 4), ["x"], created_at=-(10**400))  # an int beyond float64: no OverflowError
    bank.add("u", np.eye(1, 4), ["nan"], created_at=float("nan"))  # NaN stays "unknown"
    assert np.isnan(bank.created_at_of("u", ["nan"])[0])


def test_the_ends_of_the_range_are_accepted_and_read_back():
    mem = Memory(None, encoder=False, dim=8)
    ids = mem.add(None, "u", vectors=np.eye(8)[:5],
                  created_at=[FIRST, LAST, "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999+00:00", -62135596800])
    got = [i.created_at for i in mem.get(ids, "u")]
    assert got[0] == got[2] == got[4] == FIRST
    for t in (got[1], got[3]):  # float seconds hold ~30 us there: the last float before year 10000
        assert t.year == 9999 and timedelta(0) <= LAST - t < timedelta(microseconds=31)
    bulk = mem.add_many([{"user_id": "u", "vector": np.eye(8)[5], "created_at": "9999-12-31T23:59:59.999999"},
                         {"user_id": "u", "vector": np.eye(8)[6], "created_at": "0001-01-01T00:00:00Z"}])
    times = [i.created_at for i in mem.get(bulk, "u")]
    assert times[0].year == 9999 and times[1] == FIRST
    hit = mem.search(np.eye(8)[1], "u", k=1, mode="dense")[0]
    assert hit.id == ids[1] and hit.created_at == got[1]
    assert [x.get("created_at") for x in mem.export_items()][:3] == [
        "0001-01-01T00:00:00+00:00", got[1].isoformat(), "0001-01-01T00:00:00+00:00"]
    mem.close()


@pytest.mark.parametrize("bad, hint", BAD)
def test_a_filter_on_created_at_refuses_a_number_outside_the_range(bad, hint):
    """A bound in milliseconds would match every item or none, silently: it is refused as
    a write's is (an ISO-8601 string or a datetime is always in range)."""
    mem = Memory(None, encoder=False, dim=8)
    mem.add(None, "u", vectors=np.eye(8)[:2], created_at=T0)
    for flt, where in (({"created_at": {"$gte": bad}}, "filters['created_at']['$gte']"),
                       ({"created_at": bad}, "filters['created_at']"),
                       ({"created_at": {"$in": [T0, bad]}}, "filters['created_at']['$in'][1]")):
        with pytest.raises(ValueError) as e:
            mem.search(np.eye(8)[0], "u", k=2, mode="dense", filters=flt)
        _check_refusal(str(e.value), where, hint)
    hits = mem.search(np.eye(8)[0], "u", k=2, mode="dense", filters={"created_at": {"$gte": 1774747800, "$lte": LAST}})
    assert len(hits) == 2
    mem.close()


def test_bulk_writes_and_import_refuse_it_naming_the_item_and_the_line():
    mem = Memory(None, encoder=False, dim=4)
    items = [{"user_id": "u", "vector": [1.0, 0, 0, 0], "created_at": "2026-01-01T00:00:00Z"},
             {"user_id": "u", "vector": [0, 1.0, 0, 0], "created_at": "9999-12-31T23:00:00-05:00"}]
    with pytest.raises(ValueError) as err:
        mem.add_many(items)
    # 9999-12-31T23:00-05:00 is 10000-01-01T04:00Z: 253402300800 + 4 * 3600 seconds
    _check_refusal(str(err.value), "items[1].created_at", None)
    assert "'9999-12-31T23:00:00-05:00' (253402315200 seconds since the Unix epoch)" in str(err.value)
    assert err.value.index == 1 and err.value.field == "created_at"
    lines = [json.dumps({"user_id": "u", "vector": [0, 0, 1.0, 0]}),
             json.dumps({"user_id": "u", "vector": [0, 0, 0, 1.0], "created_at": "0001-01-01T00:00:00+00:01"})]
    with pytest.raises(ImportLineError) as err:
        import_jsonl(mem, io.StringIO("\n".join(lines) + "\n"))
    assert str(err.value).startswith("line 2: created_at: '0001-01-01T00:00:00+00:01' (-62135596860 seconds")
    assert RANGE in str(err.value)
    assert mem.counts() == (0, 0)  # all or nothing


def test_http_refuses_it_with_422_naming_the_field():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    mem = Memory(None, encoder=HashEncoder(16), max_wait_ms=1.0)
    with TestClient(create_app(mem, no_auth=True)) as c:
        r = c.post("/v1/users/u/memories", json={"texts": ["a"], "created_at": 1774747800000})
        assert r.status_code == 422
        [e] = r.json()["detail"]
        assert e["loc"] == ["body", "created_at"]
        _check_refusal(e["msg"].removeprefix("Value error, "), "created_at", BAD[0][1])
        r = c.post("/v1/users/u/memories", json={"texts": ["a", "b"], "created_at": ["2026-01-01T00:00:00Z", -1e12]})
        assert r.status_code == 422
        _check_refusal(r.json()["detail"][0]["msg"].removeprefix("Value error, "), "created_at[1]", BAD[2][1])
        r = c.post("/v1/memories:batch", json={"items": [{"user_id": "u", "text": "a",
                                                          "created_at": "0001-01-01T00:00:00+00:01"}]})
        assert r.status_code == 422
        [e] = r.json()["detail"]
        assert e["loc"] == ["body", "items", 0, "created_at"]
        _check_refusal(e["msg"], "items[0].created_at", None)
        assert c.get("/v1/users/u/memories").json()["items"] == []  # nothing was written
        r = c.post("/v1/users/u/memories", json={"texts": ["a", "b"], "ids": ["a", "b"],
                                                 "created_at": ["0001-01-01T00:00:00Z", -62135596800]})
        assert r.status_code == 201
        assert [i["created_at"] for i in c.get("/v1/users/u/memories").json()["items"]] == [
            "0001-01-01T00:00:00+00:00"] * 2
    mem.close()


# ----------------------------------------------------------------------------- times stored before the door
def _memory_dir(tmp_path: Path, ids: list[str]) -> Path:
    """A checkpointed Memory directory holding ``ids`` (texts "<id> text", rows e_0, e_1, ...)
    of user u, created at T0, with metadata {"n": j}."""
    path = tmp_path / "m"
    mem = Memory(path, encoder=False, dim=8)
    mem.add([f"{i} text" for i in ids], "u", ids=ids, vectors=np.eye(8)[: len(ids)],
            metadata=[{"n": j} for j in range(len(ids))], created_at=T0)
    mem.close()
    return path


def _rewrite_store_times(path: Path, times: dict[str, float]) -> None:
    """Rewrite the directory's store with raw creation times (as a version without the range
    check could write them), through the store writer, so checksums stay right."""
    store = path / json.loads((path / "memory.json").read_text())["store"]
    bank = MemoryBank.load(store)
    snap = bank.snapshot()
    created = np.array(snap.created_at, dtype=np.float64)
    for item, t in times.items():
        created[list(snap.item_ids).index(item)] = t
    write_store(store, dataclasses.replace(snap, created_at=created), bank.get_metadata("u"), dim=bank.dim)


def _append_add_record(path: Path, ids: list[str], rows: np.ndarray, created: list[float]) -> None:
    """Append an add record to the directory's write-ahead log as the log's format reads
    (``<crc32 hex> <json>``), holding raw creation times."""
    seq = json.loads((path / "memory.json").read_text())["wal_seq"] + 1
    f32 = np.ascontiguousarray(rows, dtype="<f4")
    rec = {"seq": seq, "op": "add", "user": "u", "ids": ids,
           "vectors": {"shape": list(f32.shape), "f32le": base64.b64encode(f32.tobytes()).decode("ascii")},
           "texts": [f"{i} text" for i in ids], "metadata": None, "created_at": created}
    body = json.dumps(rec, separators=(",", ":")).encode("ascii")
    with open(path / "wal.jsonl", "ab") as f:
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))


@pytest.mark.parametrize("where", ["store", "wal"])
def test_a_stored_time_outside_the_range_reads_as_unknown_and_breaks_nothing(tmp_path, where, caplog, capsys):
    if where == "store":
        path = _memory_dir(tmp_path, ["good", "bad", "worse"])
        _rewrite_store_times(path, {"bad": 1774747800000.0, "worse": -1e12})
    else:
        path = _memory_dir(tmp_path, ["good"])
        _append_add_record(path, ["bad", "worse"], np.eye(8)[1:3], [1774747800000.0, -1e12])
        assert "1774747800000" in (path / "wal.jsonl").read_text()
    with caplog.at_level(logging.WARNING):
        mem = Memory(path, encoder=False)
    assert ("2 items hold a creation time outside" if where == "store" else
            "a logged add holds 2 creation times outside") in caplog.text
    want = {"good": T0, "bad": None, "worse": None}
    assert {i.id: i.created_at for i in mem.get_all("u")} == want
    assert [i.created_at for i in mem.get(["worse", "good"], "u")] == [None, T0]
    assert [i.to_dict()["created_at"] for i in mem.get(["bad", "good"], "u")] == [None, T0.isoformat()]
    hits = mem.search(np.eye(8)[1], "u", k=3, mode="dense")
    assert hits[0].id == "bad" and {h.id: h.created_at for h in hits} == want
    # unknown, as a time of a store older than creation times: no comparison matches it
    unknown = mem.search(np.eye(8)[1], "u", k=3, mode="dense", filters={"created_at": {"$exists": False}})
    assert {h.id for h in unknown} == {"bad", "worse"}
    assert [h.id for h in mem.search(np.eye(8)[1], "u", k=3, mode="dense", filters={"created_at": {"$gte": 0}})] == ["good"]
    exported = list(mem.export_items())
    assert [x["id"] for x in exported] == ["good", "bad", "worse"]
    assert [x.get("created_at") for x in exported] == [T0.isoformat(), None, None]
    assert ["created_at" in x for x in exported] == [True, False, False]  # left out: import gives the time of import
    # and it imports back
    dst = Memory(None, encoder=False, dim=8)
    text = "".join(export_line(dict(x, vector=v)) + "\n" for x, v in zip(exported, np.eye(8)[:3]))
    assert import_jsonl(dst, io.StringIO(text))["imported"] == 3
    assert dst.get("good", "u")[0].created_at == T0 and dst.get("bad", "u")[0].created_at is not None
    dst.close()
    # over HTTP: the user reads (200), its unknown times as null
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    with TestClient(create_app(mem, no_auth=True)) as c:
        page = c.get("/v1/users/u/memories")
        assert page.status_code == 200 and [i["created_at"] for i in page.json()["items"]] == [T0.isoformat(), None, None]
        assert c.get("/v1/users/u/memories/bad").json()["created_at"] is None
        found = c.post("/v1/users/u/search", json={"vector": np.eye(8)[2].tolist(), "k": 3, "mode": "dense"}).json()
        assert {h["id"]: h["created_at"] for h in found["hits"]} == {"good": T0.isoformat(), "bad": None, "worse": None}
    mem.close()  # a checkpoint: the unknown times are saved as NaN, the raw values are gone
    again = Memory(path, encoder=False)
    assert {i.id: i.created_at for i in again.get_all("u")} == want
    again.close()
    # rfmem export works and says how many items have no time; rfmem import takes the file back
    capsys.readouterr()
    out = tmp_path / "out.jsonl"
    assert rfmem_main(["export", "--memory-dir", str(path), "--out", str(out), "--vectors"]) == 0
    err = capsys.readouterr().err
    assert "3 items of 1 users" in err and "2 of them without a created_at (creation time unknown" in err, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x.get("created_at") for x in lines] == [T0.isoformat(), None, None]
    assert rfmem_main(["import", "--memory-dir", str(tmp_path / "back"), "--in", str(out), "--encoder", "none",
                       "--dim", "8"]) == 0
    back = Memory(tmp_path / "back", encoder=False)
    assert [i.id for i in back.get_all("u")] == ["good", "bad", "worse"] and back.get("good", "u")[0].created_at == T0
    back.close()


# ----------------------------------------------------------------------------- hits show their time
def test_hits_carry_their_items_creation_time_in_python_and_over_http(monkeypatch):
    enc = WordChunkEncoder(16)
    mem = Memory(None, encoder=enc, chunk_overlap=2, max_wait_ms=1.0)
    long_text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"  # several chunk rows
    mem.add(["a one", "b two", long_text], "u", ids=["a", "b", "long"],
            created_at=["2026-01-01T00:00:00Z", "2026-02-01T12:00:00+02:00", T0])
    mem.add(["c three"], "u", ids=["c"])  # now
    assert mem.bank.user_size("u") > 4
    items = {i.id: i.created_at for i in mem.get_all("u")}
    assert items["a"] == datetime(2026, 1, 1, tzinfo=UTC) and items["b"] == datetime(2026, 2, 1, 10, tzinfo=UTC)
    assert items["long"] == T0 and abs(items["c"] - datetime.now(UTC)) < timedelta(minutes=1)

    def no_lookup(*a, **k):  # hits read their times off the searched snapshot, not item by item
        raise AssertionError("created_at_of called by a search")

    monkeypatch.setattr(mem.bank, "created_at_of", no_lookup)
    chunk = mem.search("kappa lambda", "u", k=4, mode="dense")  # the long text's best row is a later chunk
    assert chunk[0].id == "long" and chunk[0].text == long_text and chunk[0].created_at == T0
    for q in ("a one", "kappa lambda"):
        for mode in ("dense", "rfmem", "recollection"):
            hits = mem.search(q, "u", k=4, mode=mode)
            assert hits and all(h.created_at == items[h.id] for h in hits), (q, mode)
    again = mem.search("a one", "u", k=4, mode="dense")
    assert again.cached and {h.id: h.created_at for h in again} == items
    assert again[0].to_dict()["created_at"] == "2026-01-01T00:00:00+00:00"
    batch = mem.search_batch(["b two", "kappa lambda"], "u", k=2, mode="dense", filters=[None, {"n": {"$exists": False}}])
    assert [b[0].id for b in batch] == ["b", "long"] and [b[0].created_at for b in batch] == [items["b"], T0]
    monkeypatch.undo()

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    app = create_app(mem, no_auth=True)
    props = app.openapi()["components"]["schemas"]["HitOut"]["properties"]
    assert "created_at" in props
    iso = {k: v.isoformat() for k, v in items.items()}
    with TestClient(app) as c:
        for body in ({"query": "kappa lambda", "k": 4, "mode": "dense"},  # the fast path
                     {"query": "kappa lambda", "k": 4, "mode": "dense", "filters": {"n": {"$exists": False}}},
                     {"vector": enc.vector("b two").tolist(), "k": 4}):
            hits = c.post("/v1/users/u/search", json=body).json()["hits"]
            assert len(hits) == 4 and {h["id"]: h["created_at"] for h in hits} == iso, body
        res = c.post("/v1/users/u/search/batch", json={"queries": ["a one", "c three"], "k": 1, "mode": "dense"}).json()
        assert [r["hits"][0]["created_at"] for r in res["results"]] == [iso["a"], iso["c"]]
        assert c.get("/v1/users/u/memories/long").json()["created_at"] == iso["long"]  # as the item's
    mem.close()


def test_http_hit_times_are_written_alike_by_orjson_and_by_the_standard_library_fallback():
    """A hit's time is ISO-8601 as ``datetime.isoformat()`` (microseconds kept) whether the
    answer is written by orjson or, for metadata orjson refuses (an int beyond 64 bits), by
    the standard library."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    mem = Memory(None, encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add(["plain", "huge"], "u", ids=["plain", "huge"], metadata=[{"n": 1}, {"n": 2**70}],
            created_at=["2026-03-29T01:30:00.000100Z", "0001-01-01T00:00:00Z"])
    with TestClient(create_app(mem, no_auth=True)) as c:
        for q, want in (("plain", "2026-03-29T01:30:00.000100+00:00"), ("huge", "0001-01-01T00:00:00+00:00")):
            r = c.post("/v1/users/u/search", json={"query": q, "k": 1, "mode": "dense"})
            assert r.status_code == 200 and r.json()["hits"][0]["created_at"] == want, r.text
        assert c.post("/v1/users/u/search", json={"query": "huge", "k": 1, "mode": "dense"}).json()["hits"][0][
            "metadata"] == {"n": 2**70}
    mem.close()


# ----------------------------------------------------------------------------- clear errors
def test_a_datetime_in_metadata_is_refused_with_the_isoformat_advice():
    mem = Memory(None, encoder=False, dim=4)
    with pytest.raises(ValueError) as err:
        mem.add(None, "u", vectors=np.eye(1, 4), metadata={"source": "chat", "when": T0})
    assert str(err.value).startswith("metadata[0]['when'] is a datetime, which JSON cannot hold: store it as a "
                                     "string, value.isoformat() ('2026-03-29T01:30:00+00:00')")
    with pytest.raises(ValueError, match=re.escape("metadata[1]['trip'][1] is a date, which JSON cannot hold: "
                                                   "store it as a string, value.isoformat() ('2026-05-01')")):
        mem.add(None, "u", vectors=np.eye(2, 4), metadata=[None, {"trip": ["Lyon", date(2026, 5, 1)]}])
    with pytest.raises(ValueError, match=re.escape("items[0].metadata['when'] is a datetime")):
        mem.add_many([{"user_id": "u", "vector": [1.0, 0, 0, 0], "metadata": {"when": T0}}])
    with pytest.raises(ValueError, match=re.escape("metadata[0]['when'] is a datetime")):
        MemoryBank(4).add("u", np.eye(1, 4), ["x"], metadata=[{"when": T0}])
    with pytest.raises(ValueError, match=r"metadata\[0\] is not JSON-serialisable: .*set"):  # other values: as before
        mem.add(None, "u", vectors=np.eye(1, 4), metadata={"s": {1, 2}})
    assert mem.count("u") == 0
    # the advice works: the string is kept, and a datetime bound compares it as an instant
    mem.add(None, "u", vectors=np.eye(1, 4), ids=["x"], metadata={"when": T0.isoformat()})
    hits = mem.search(np.eye(1, 4)[0], "u", k=1, filters={"when": {"$gte": datetime(2026, 1, 1, tzinfo=UTC)}})
    assert [h.id for h in hits] == ["x"] and hits[0].metadata == {"when": "2026-03-29T01:30:00+00:00"}
    mem.close()
