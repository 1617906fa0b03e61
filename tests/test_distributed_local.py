"""Scale-out pieces that need no Ray: the user -> shard hash, the gather of
per-shard results, a shard's durable home (write-ahead log + checkpoint), the manifest,
and the ImportError that names the ``[ray]`` extra. Ray itself: test_distributed_ray.py."""
from __future__ import annotations

import dataclasses
import hashlib
import sys

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, SearchResult, StoreError, search
from rfmem_fast.distributed import HASH_SCHEME, ShardServer, shard_of
from rfmem_fast.distributed import sharded as sharded_mod
from rfmem_fast.distributed.gather import gather_results
from rfmem_fast.distributed.manifest import MANIFEST_FILE, make_manifest, read_manifest, write_manifest
from rfmem_fast.distributed.sharding import jump_hash, shards_of, user_digest
from rfmem_fast.distributed.wal import WAL_FILE, WriteAheadLog

D = 8


# ---------------------------------------------------------------------------- hash
def test_user_digest_is_blake2b_of_the_documented_bytes():
    for user, raw in [("alice", b"s:alice"), ("\u00e9lan", "s:\u00e9lan".encode()), (1, b"i:1"), (-7, b"i:-7"),
                      ("1", b"s:1"), (np.int64(5), b"i:5"), (np.str_("x"), b"s:x")]:  # fmt: skip
        expect = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        assert user_digest(user) == expect, user
    assert user_digest("1") != user_digest(1)  # "1" and 1 are different users, as in the bank


def test_shard_of_pinned_values():
    # pinned: a change of these values is a change of the on-disk shard map (HASH_SCHEME)
    assert HASH_SCHEME == "blake2b64-jump-v1"
    got = {repr(u): [shard_of(u, n) for n in (1, 2, 3, 4, 8, 1000)] for u in ["alice", "bob", "1", 1, -7, 2**70]}
    assert got == {
        "'alice'": [0, 0, 0, 0, 5, 246],
        "'bob'": [0, 0, 0, 0, 4, 601],
        "'1'": [0, 1, 1, 1, 7, 22],
        "1": [0, 1, 1, 1, 5, 997],
        "-7": [0, 0, 0, 3, 4, 582],
        "1180591620717411303424": [0, 0, 2, 2, 2, 624],
    }


def test_jump_hash_is_consistent_and_balanced():
    keys = [user_digest(f"user-{i}") for i in range(4000)]
    prev = [0] * len(keys)
    for n in range(1, 9):
        cur = [jump_hash(k, n) for k in keys]
        moved = [c for p, c in zip(prev, cur) if c != p]
        assert all(c == n - 1 for c in moved)  # growing N -> N+1 only moves users onto the new shard
        counts = np.bincount(cur, minlength=n)
        assert counts.sum() == len(keys) and (np.abs(counts - len(keys) / n) < 5 * np.sqrt(len(keys) / n)).all()
        if n > 1:
            assert abs(len(moved) - len(keys) / n) < 5 * np.sqrt(len(keys) / n)
        prev = cur


def test_shards_of_and_errors():
    keys, sh = shards_of(["a", np.int64(3), "a", 3], 4)
    assert keys == ["a", 3, "a", 3] and type(keys[1]) is int
    assert sh.tolist() == [shard_of("a", 4), shard_of(3, 4)] * 2
    with pytest.raises(TypeError, match=r"users\[1\]"):
        shards_of(["a", 1.5], 2)
    with pytest.raises(TypeError, match=r"users\[0\]"):
        shards_of([True], 2)
    with pytest.raises(TypeError, match="sequence"):
        shards_of("abc", 2)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="num_shards"):
            shard_of("a", bad)


# ---------------------------------------------------------------------------- gather
def _bank(rng, n_users=12):
    bank = MemoryBank(D)
    for u in range(n_users):
        n = int(rng.integers(1, 30))
        bank.add(f"u{u}", rng.normal(size=(n, D)), ids=[f"u{u}-{i}" for i in range(n)])
    return bank


def test_gather_scatters_every_array_field_back_into_caller_order():
    rng = np.random.default_rng(1)
    bank = _bank(rng)
    users = [f"u{i}" for i in rng.integers(0, 12, 40)]
    Q = rng.normal(size=(40, D)).astype(np.float32)
    whole = search(bank, Q, users, backend="torch")
    perm = rng.permutation(40)
    parts = [(np.sort(p), None) for p in np.array_split(perm, 3)]
    parts = [(p, search(bank, Q[p], [users[i] for i in p], backend="torch")) for p, _ in parts]
    got = gather_results(40, parts)
    for f in dataclasses.fields(SearchResult):
        a, b = getattr(got, f.name), getattr(whole, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name


def test_gather_carries_fields_added_to_the_result_class():
    @dataclasses.dataclass
    class WithExtra(SearchResult):
        shard_tag: np.ndarray = None  # a per-query field some other layer adds

    rng = np.random.default_rng(4)
    bank = _bank(rng, 5)
    users = [f"u{i}" for i in rng.integers(0, 5, 5)]
    Q = rng.normal(size=(5, D)).astype(np.float32)

    def part(pos, tag):
        pos = np.asarray(pos)
        res = search(bank, Q[pos], [users[i] for i in pos], backend="torch")
        base = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
        base["backend"] = tag
        return pos, WithExtra(**base, shard_tag=np.array([[f"{tag}{p}"] * 2 for p in pos], dtype=object))

    got = gather_results(5, [part([0, 3], "x"), part([1, 2, 4], "y")])
    whole = search(bank, Q, users, backend="torch")
    assert isinstance(got, WithExtra) and got.backend == "x+y"
    assert got.shard_tag.shape == (5, 2) and got.shard_tag[:, 0].tolist() == ["x0", "y1", "y2", "x3", "y4"]
    np.testing.assert_array_equal(got.ids, whole.ids)
    with pytest.raises(ValueError, match="exactly once"):
        gather_results(5, [part([0, 3], "x"), part([1, 2, 2], "y")])
    with pytest.raises(ValueError, match="mode"):
        p, r = part([1, 2, 4], "y")
        gather_results(5, [part([0, 3], "x"), (p, dataclasses.replace(r, mode="dense"))])


# ---------------------------------------------------------------------------- shard home
def _model_bank(ops):
    bank = MemoryBank(D)
    for op, args in ops:
        getattr(bank, op)(*args)
    return bank


def _assert_same_bank(a: MemoryBank, b: MemoryBank):
    sa, sb = a.snapshot(), b.snapshot()
    assert list(sa.users) == list(sb.users)
    np.testing.assert_array_equal(sa.offsets, sb.offsets)
    assert sa.item_ids.tolist() == sb.item_ids.tolist() and sa.texts.tolist() == sb.texts.tolist()
    np.testing.assert_array_equal(sa.vectors, sb.vectors)
    assert a.version == b.version


def _ops(rng, index, num_shards, n=30):
    """A seeded script of writes for the users of one shard."""
    users = [u for u in (f"w{i}" for i in range(200)) if shard_of(u, num_shards) == index][:5]
    ops, held = [], {u: [] for u in users}
    for k in range(n):
        u = users[k % len(users)]
        r = rng.random()
        if r < 0.6 or len(held[u]) < 2:
            m = int(rng.integers(1, 4))
            ids = [f"{u}-{k}-{j}" for j in range(m)]
            ops.append(("add", (u, rng.normal(size=(m, D)), ids, [f"t{k}"] * m)))
            held[u] += ids
        elif r < 0.8:
            i = held[u].pop(int(rng.integers(len(held[u]))))
            ops.append(("delete", (u, [i])))
        else:
            ops.append(("update", (u, [held[u][0]], rng.normal(size=(1, D)), None if r < 0.9 else ["new"])))
    return ops


def test_shard_home_recovers_every_acknowledged_write(tmp_path):
    rng = np.random.default_rng(2)
    ops = _ops(rng, 1, 3)
    home = tmp_path / "shard-0001"
    srv = ShardServer(1, 3, D, home=str(home), backend="torch")
    for op, args in ops[:12]:
        getattr(srv, op)(*args)
    srv.checkpoint()  # store holds the first 12 writes, the log is empty again
    assert srv.info()["wal_records"] == 0
    for op, args in ops[12:]:
        getattr(srv, op)(*args)
    assert srv.info()["wal_records"] == len(ops) - 12
    srv.close()  # "crash": nothing saved after the checkpoint, only logged
    again = ShardServer(1, 3, D, home=str(home), backend="torch")
    _assert_same_bank(again.bank, _model_bank(ops))
    # a second open after a crash between checkpoint's save and its log truncation:
    # the store already holds versions that the log still lists; none is applied twice
    again.bank.save(home / "store")
    again.close()
    third = ShardServer(1, 3, D, home=str(home), backend="torch")
    assert len(third._wal) == len(ops) - 12
    _assert_same_bank(third.bank, _model_bank(ops))
    third.close()


def test_shard_home_is_locked_and_refuses_foreign_users(tmp_path):
    home = tmp_path / "s"
    srv = ShardServer(0, 2, D, home=str(home), backend="torch")
    with pytest.raises(StoreError, match="in use"):
        ShardServer(0, 2, D, home=str(home), backend="torch")
    u0 = next(u for u in (f"x{i}" for i in range(50)) if shard_of(u, 2) == 0)
    u1 = next(u for u in (f"x{i}" for i in range(50)) if shard_of(u, 2) == 1)
    with pytest.raises(ValueError, match="belongs to shard 1"):
        srv.add(u1, np.ones((1, D)), [0])
    srv.add(u0, np.ones((1, D)), [0])
    srv.close()
    with pytest.raises(StoreError, match="hashes to shard 0 of 2, not to shard 1"):
        ShardServer(1, 2, D, home=str(home), backend="torch")  # the same store opened as another shard
    with pytest.raises(StoreError, match="dimension"):
        ShardServer(0, 2, D + 1, home=str(home), backend="torch").close()


def test_failed_log_commit_keeps_nothing(tmp_path, monkeypatch):
    home = tmp_path / "s"
    u = next(u for u in (f"x{i}" for i in range(50)) if shard_of(u, 1) == 0)
    srv = ShardServer(0, 1, D, home=str(home), backend="torch")
    srv.add(u, np.eye(D)[:2], ["a", "b"])

    def fail(self, rec):
        raise StoreError(self.path, "disk full (simulated)")

    monkeypatch.setattr(WriteAheadLog, "append", fail)
    with pytest.raises(StoreError, match="disk full"):
        srv.add(u, np.eye(D)[2:3], ["c"])
    with pytest.raises(StoreError, match="disk full"):
        srv.delete(u, ["a"])
    assert srv.item_ids_of(u) == ["a", "b"] and srv.bank.version == 1  # memory = durable state
    srv.close()


def test_corrupt_or_gapped_log_is_refused(tmp_path):
    home = tmp_path / "s"
    u = next(u for u in (f"x{i}" for i in range(50)) if shard_of(u, 1) == 0)
    srv = ShardServer(0, 1, D, home=str(home), backend="torch")
    for k in range(3):
        srv.add(u, np.eye(D)[k : k + 1], [k])
    srv.close()
    wal = WriteAheadLog(home / WAL_FILE)
    wal._db.execute("DELETE FROM wal WHERE version = 2")
    wal.close()
    with pytest.raises(StoreError, match="record version 3"):
        ShardServer(0, 1, D, home=str(home), backend="torch")
    (home / WAL_FILE).write_bytes(b"not a database" * 100)
    for extra in ("-wal", "-shm"):
        (home / (WAL_FILE + extra)).unlink(missing_ok=True)
    with pytest.raises(StoreError, match="wal.sqlite"):
        ShardServer(0, 1, D, home=str(home), backend="torch")


def test_empty_shard_answers_like_the_engine():
    # a shard whose every user has 0 items: the engine's own empty-user rows
    rng = np.random.default_rng(3)
    users = [u for u in (f"e{i}" for i in range(60)) if shard_of(u, 2) == 0][:2]
    other = next(u for u in (f"e{i}" for i in range(60)) if shard_of(u, 2) == 1)
    srv = ShardServer(0, 2, D, backend="torch")
    whole = MemoryBank(D)
    for u in users:
        srv.add(u, np.eye(D)[:1], [0])
        srv.delete(u, [0])
        whole.add(u, np.eye(D)[:1], [0])
        whole.delete(u, [0])
    whole.add(other, rng.normal(size=(5, D)), list(range(5)))
    Q = rng.normal(size=(3, D)).astype(np.float32)
    batch = [users[0], users[1], users[0]]
    for mode in ("rfmem", "dense", "recollection"):
        got, n_items = srv.search(Q, batch, np.arange(3), RFMemConfig(), mode, None, 8192)
        ref = search(whole, Q, batch, mode=mode, backend="torch")
        assert n_items == 0
        for f in ("ids", "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids", "probe_scores"):
            np.testing.assert_array_equal(getattr(got, f), getattr(ref, f), err_msg=f"{mode} {f}")
    with pytest.raises(KeyError, match=r"users\[7\]: unknown user 'nobody'"):
        srv.search(Q[:1], ["nobody"], np.array([7]), RFMemConfig(), "rfmem", None, 8192)


# ---------------------------------------------------------------------------- manifest / extra
def test_manifest_roundtrip_and_refusals(tmp_path):
    write_manifest(tmp_path, make_manifest(3, 16))
    man = read_manifest(tmp_path)
    assert man["num_shards"] == 3 and man["dim"] == 16 and man["hash_scheme"] == HASH_SCHEME
    assert [s["dir"] for s in man["shards"]] == ["shard-0000", "shard-0001", "shard-0002"]
    path = tmp_path / MANIFEST_FILE
    for edit, msg in [
        (lambda m: m.update(hash_scheme="python-hash"), "hash_scheme"),
        (lambda m: m.update(format_version=99), "newer"),
        (lambda m: m.update(num_shards=2), "shards must list"),
        (lambda m: m.update(dim=0), "dim"),
    ]:
        m = make_manifest(3, 16)
        edit(m)
        write_manifest(tmp_path, m)
        with pytest.raises(StoreError, match=msg):
            read_manifest(tmp_path)
    path.write_text("{not json")
    with pytest.raises(StoreError, match="JSON"):
        read_manifest(tmp_path)
    with pytest.raises(StoreError, match="not a sharded store"):
        read_manifest(tmp_path / "nowhere")


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    with pytest.raises(ImportError, match=r"rfmem_fast\[ray\]"):
        sharded_mod.ShardedMemory(2, D)
