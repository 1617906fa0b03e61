"""ShardedMemory on a local Ray cluster: equivalence with single-process
``search``, faults (a shard killed mid-batch, restart from its store), persistence.

The module starts its own cluster with ``ray.init(num_cpus=2)`` and shuts it down at
the end; shard actors reserve ``num_cpus=0`` so that three shards fit on two CPUs.
Skipped when Ray is not installed (``pip install "rfmem_fast[ray]"``).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason='ray is not installed (pip install "rfmem_fast[ray]")')

import rfmem_fast  # noqa: E402
from rfmem_fast import MemoryBank, RFMemConfig, StoreError, search  # noqa: E402
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank  # noqa: E402
from rfmem_fast.distributed import ShardedMemory, ShardUnavailableError  # noqa: E402
from rfmem_fast.distributed import sharded as sharded_mod  # noqa: E402

BACKENDS = [b for b in ("reference", "torch", "native") if b in rfmem_fast.available_backends()]
MODES = ["rfmem", "dense", "recollection"]
#: fields of SearchResult that a sharded search must reproduce exactly (rows are shard-local);
#: every other array field of the dataclass (e.g. texts) is compared too, see compared_fields()
REQUIRED = ("ids", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids", "probe_scores")


def compared_fields(res) -> list[str]:
    names = [f.name for f in dataclasses.fields(res) if isinstance(getattr(res, f.name), np.ndarray) and f.name != "rows"]
    assert set(REQUIRED) <= set(names)
    return names
#: the reference backend (one query at a time) runs on every REF_STRIDE-th query only
REF_STRIDE = 8
SHARD_OPTS = dict(num_cpus=0, ready_timeout_s=120)


@pytest.fixture(scope="module")
def ray_cluster():
    # workers import the same rfmem_fast as this process (the checkout under test)
    root = str(Path(rfmem_fast.__file__).resolve().parents[1])
    path = os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )  # fmt: skip
    yield
    ray.shutdown()


# ---------------------------------------------------------------------------- data
class Data:
    """Both data sets (PersonaBench when the shared data is there), their single-process
    banks, and the sharded memories' content."""

    def __init__(self, pb):
        self.pb = pb
        spec = SyntheticSpec(dim=384)  # MiniLM's dimension, as PersonaBench's
        syn = synthetic_bank(200, 24, spec, seed=13)
        self.syn_queries, uidx, _ = syn.queries(240, seed=5)
        self.syn_users = [syn.users[i] for i in uidx]
        self.syn = syn.bank
        # all users of both sets in one bank: the sharded memories start from this
        snaps = ([pb.bank.snapshot()] if pb is not None else []) + [syn.bank.snapshot()]
        starts = np.cumsum([0] + [sn.num_items for sn in snaps])
        self.initial = MemoryBank.from_arrays(
            np.concatenate([sn.vectors for sn in snaps]),
            np.concatenate([[0]] + [sn.offsets[1:] + a for sn, a in zip(snaps, starts)]),
            users=[u for sn in snaps for u in sn.users],
            item_ids=[i for sn in snaps for i in sn.item_ids],
            texts=[t for sn in snaps for t in sn.texts],
        )
        # then a seeded script of writes on synthetic users, replayed on both sides:
        # users grow, shrink, change, one is emptied, new int / str users appear
        rng = np.random.default_rng(17)
        self.writes = []
        for k in range(60):
            u = f"u{int(rng.integers(0, 200))}"
            r = rng.random()
            if r < 0.4:
                m = int(rng.integers(1, 20))
                self.writes.append(("add", (u, rng.normal(size=(m, spec.dim)), [f"n{k}-{j}" for j in range(m)])))
            elif r < 0.7:
                self.writes.append(("delete", (u, list(range(k % 3, 24, 7)))))  # ids below 24 of that user
            else:
                self.writes.append(("update", (u, [k % 24], rng.normal(size=(1, spec.dim)), [f"upd{k}"])))
        self.writes += [
            ("add", (7, rng.normal(size=(3, spec.dim)), [0, 1, 2])),  # an int user with 3 items
            ("add", ("7", rng.normal(size=(12, spec.dim)), list(range(12)))),  # and the str user "7"
            ("add", ("u3", rng.normal(size=(1, spec.dim)), ["last"])),
        ]
        self.writes = self._feasible(self.writes)
        self.writes.append(("delete", ("u3", self.syn.item_ids_of("u3"))))  # u3 -> 0 items
        self.syn.delete(*self.writes[-1][1])
        extra = ["u3", 7, "7", "u3"]
        self.syn_users += extra
        self.syn_queries = np.concatenate([self.syn_queries, rng.normal(size=(len(extra), spec.dim)).astype(np.float32)])

    def _feasible(self, writes):
        """Keep the writes that the single-process bank accepts (applied to it as they go)."""
        kept = []
        for op, args in writes:
            try:
                getattr(self.syn, op)(*args)
            except KeyError:  # e.g. deleting an id deleted before
                continue
            kept.append((op, args))
        return kept

    def sets(self):
        out = {"synthetic200": (self.syn, self.syn_queries, self.syn_users)}
        if self.pb is not None:
            out["personabench"] = (self.pb.bank, self.pb.queries, self.pb.users)
        return out

    def banks(self):
        return [self.syn] + ([self.pb.bank] if self.pb is not None else [])


@pytest.fixture(scope="module")
def data(request):
    try:
        pb = request.getfixturevalue("pb_embedded")
    except pytest.skip.Exception:  # no shared data here: the synthetic bank only
        pb = None
    return Data(pb)


@pytest.fixture(scope="module")
def expected(data):
    """Single-process search results per (data set, backend, mode)."""
    out = {}
    for name, (bank, Q, users) in data.sets().items():
        for be in BACKENDS:
            idx = np.arange(0, len(users), REF_STRIDE if be == "reference" else 1)
            for mode in MODES:
                out[name, be, mode] = search(bank, Q[idx], [users[i] for i in idx], mode=mode, backend=be)
    return out


# one shard (the whole bank behind one actor) is the degenerate case of 2 and 3: with -m slow only
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 2, 3], ids=lambda n: f"{n}shard")
def sharded(request, ray_cluster, data):
    mem = ShardedMemory.from_bank(data.initial, request.param, **SHARD_OPTS)
    for op, args in data.writes:
        getattr(mem, op)(*args)
    yield mem
    mem.close()


# ---------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dataset", ["personabench", "synthetic200"])
def test_sharded_search_equals_single_process(sharded, data, expected, dataset, backend, mode):
    if dataset not in data.sets():
        pytest.skip("PersonaBench data absent (set RFMEM_SHARED or place shared/ beside the checkout)")
    bank, Q, users = data.sets()[dataset]
    idx = np.arange(0, len(users), REF_STRIDE if backend == "reference" else 1)
    got = sharded.search(Q[idx], [users[i] for i in idx], mode=mode, backend=backend)
    ref = expected[dataset, backend, mode]
    assert got.mode == mode and got.backend == backend and len(got) == len(idx)
    for f in compared_fields(ref):
        a, b = getattr(got, f), getattr(ref, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        np.testing.assert_array_equal(a, b, err_msg=f"{dataset} {backend} {mode} {f} ({sharded.num_shards} shards)")
    # rows: shard-local, but padding is where the single process pads
    np.testing.assert_array_equal(got.rows < 0, ref.rows < 0)
    if dataset == "synthetic200" and backend == BACKENDS[-1]:
        routes = set(got.route_names)
        assert mode != "rfmem" or routes == {"familiarity", "recollection"}  # both paths exercised


def test_sharded_state_matches_the_writes(sharded, data):
    stats = sharded.stats()
    assert [s["shard"] for s in stats] == list(range(sharded.num_shards))
    assert sharded.num_users == data.initial.num_users + 2  # + users 7 and "7"
    assert sharded.num_items == sum(b.num_items for b in data.banks())
    assert sorted(map(repr, sharded.users)) == sorted(repr(u) for b in data.banks() for u in b.users)
    for bank in data.banks():
        for u in bank.users[:3] + [u for u in ("u3", 7, "7") if u in bank]:
            assert sharded.item_ids_of(u) == bank.item_ids_of(u) and sharded.texts_of(u) == bank.texts_of(u)
            assert sharded.user_size(u) == bank.user_size(u) and u in sharded
    assert "nobody" not in sharded and 7.5 not in sharded


# ---------------------------------------------------------------------------- errors, persistence, faults
D = 16


def _users_on_both_shards(n_per_shard=4):
    from rfmem_fast.distributed import shard_of

    by = {0: [], 1: []}
    for i in range(100):
        u = f"user{i}"
        if len(by[shard_of(u, 2)]) < n_per_shard:
            by[shard_of(u, 2)].append(u)
    return by[0] + by[1]


@pytest.fixture(scope="module")
def durable(ray_cluster, tmp_path_factory):
    """A 2-shard memory with a durable home, its single-process mirror, and the home."""
    home = tmp_path_factory.mktemp("sharded") / "mem"
    mem = ShardedMemory(2, D, path=home, max_restarts=1, **SHARD_OPTS)
    mirror = MemoryBank(D)
    rng = np.random.default_rng(23)
    for u in _users_on_both_shards():
        for k in range(3):
            m = int(rng.integers(4, 15))
            args = (u, rng.normal(size=(m, D)), [f"{u}-{k}-{j}" for j in range(m)], [f"text {k} {j}" for j in range(m)])
            mem.add(*args)
            mirror.add(*args)
    yield mem, mirror, home
    mem.close()


def _assert_same_search(mem, mirror, rng, n=40):
    users = [mirror.users[i] for i in rng.integers(0, mirror.num_users, n)]
    Q = rng.normal(size=(n, D))
    for mode in MODES:
        got, ref = mem.search(Q, users, mode=mode), search(mirror, Q, users, mode=mode)
        for f in compared_fields(ref):
            np.testing.assert_array_equal(getattr(got, f), getattr(ref, f), err_msg=f"{mode} {f}")
    for u in mirror.users:
        assert mem.item_ids_of(u) == mirror.item_ids_of(u) and mem.texts_of(u) == mirror.texts_of(u)


def test_errors_name_the_argument_and_write_nothing(durable, tmp_path):
    mem, mirror, _ = durable
    bad = tmp_path / "bad"
    with pytest.raises(ValueError, match=r"shard 0: backend 'nope' is not a backend name: backend must be one of"):
        ShardedMemory(1, D, path=bad, backend="nope", **SHARD_OPTS)  # raised inside the actor, type kept
    assert not any(bad.iterdir())  # a failed start leaves the directory empty (no manifest)
    u = mirror.users[0]
    before = mem.stats()
    with pytest.raises(KeyError, match=r"users\[2\]: unknown user 'ghost'"):
        mem.search(np.ones((3, D)), [u, u, "ghost"])
    with pytest.raises(TypeError, match=r"users\[1\]"):
        mem.search(np.ones((2, D)), [u, 1.5])
    with pytest.raises(ValueError, match="queries row 1 has zero norm"):
        mem.search(np.stack([np.ones(D), np.zeros(D)]), [u, u])
    with pytest.raises(ValueError, match="dimension"):
        mem.search(np.ones((1, D + 1)), [u])
    with pytest.raises(ValueError, match="users has 1 entries"):
        mem.search(np.ones((2, D)), [u])
    with pytest.raises(ValueError, match="mode"):
        mem.search(np.ones((1, D)), [u], mode="fast")
    with pytest.raises(ValueError, match="already holds item id"):
        mem.add(u, np.ones((1, D)), [mirror.item_ids_of(u)[0]])
    with pytest.raises(ValueError, match="NaN"):
        mem.add(u, np.full((1, D), np.nan), ["nan"])
    with pytest.raises(KeyError, match="holds no item id"):
        mem.delete(u, ["missing"])
    with pytest.raises(TypeError, match="missing_ok"):
        mem.delete(u, ["missing"], missing_ok="yes")
    mem.delete(u, ["missing"], missing_ok=True)  # skipped: nothing deleted, nothing logged
    with pytest.raises(KeyError, match="unknown user"):
        mem.update("ghost", [0], np.ones((1, D)))
    with pytest.raises(StoreError, match="not an empty directory"):
        ShardedMemory(2, D, path=mem.path, **SHARD_OPTS)
    assert [(s["items"], s["version"]) for s in mem.stats()] == [(s["items"], s["version"]) for s in before]
    res = mem.search(np.ones((0, D)), [])
    assert len(res) == 0 and res.ids.shape == (0, 10)


def test_kill_shard_mid_batch_then_restart_from_its_store(durable, tmp_path):
    mem, mirror, home = durable
    rng = np.random.default_rng(29)
    users = mirror.users
    # acknowledged writes of every kind, some before and some after a checkpoint
    for k, u in enumerate(users[:4]):
        mem.delete(u, mirror.item_ids_of(u)[:2])
        mirror.delete(u, mirror.item_ids_of(u)[:2])
    mem.save()  # checkpoint into the home: stores written, logs truncated
    assert all(s["wal_records"] == 0 for s in mem.stats())
    for k, u in enumerate(users):
        v = rng.normal(size=(2, D))
        mem.update(u, mirror.item_ids_of(u)[:1], v[:1], ["changed"])
        mirror.update(u, mirror.item_ids_of(u)[:1], v[:1], ["changed"])
        mem.add(u, v, [f"late-{k}-0", f"late-{k}-1"])
        mirror.add(u, v, [f"late-{k}-0", f"late-{k}-1"])
    assert all(s["wal_records"] > 0 for s in mem.stats())  # these live in the logs only

    # 1) SIGKILL of shard 1's process while its part of a batch is in flight
    victim = 1
    pid = mem.stats()[victim]["pid"]
    flag = tmp_path / "searching"
    ray.get(mem._actor(victim)._pause_next_search.remote(60, str(flag)))
    batch = users * 3
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(mem.search, rng.normal(size=(len(batch), D)), batch)
        t0 = time.monotonic()
        while not flag.exists():
            assert time.monotonic() - t0 < 60, "the shard never started its part of the batch"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShardUnavailableError, match=rf"shard {victim} is unavailable") as err:
            fut.result(timeout=120)
    assert err.value.shard == victim
    # Ray restarts the actor (max_restarts=1); it re-opens its home: every write is back
    mem.wait_ready()
    _assert_same_search(mem, mirror, rng)
    assert mem.stats()[victim]["pid"] != pid

    # 2) an actor killed for good (no Ray restart): calls name the shard until restart_shard
    doomed = mem._actor(0)
    ray.kill(doomed, no_restart=True)
    sharded_mod._wait_until_dead(ray, doomed, 60.0, 0)  # ray.kill is asynchronous: a call sent at once may still be served
    u0 = next(u for u in users if mem.shard_of(u) == 0)
    with pytest.raises(ShardUnavailableError, match="shard 0"):
        mem.search(np.ones((2, D)), [users[-1], u0])
    with pytest.raises(ShardUnavailableError, match="shard 0"):
        mem.add(u0, np.ones((1, D)), ["never"])
    info = mem.restart_shard(0)
    assert info["wal_records"] > 0  # recovered from checkpoint + log
    _assert_same_search(mem, mirror, rng)


def test_save_copy_and_load(durable, tmp_path):
    mem, mirror, home = durable
    copy = mem.save(tmp_path / "copy")
    assert (copy / "rfmem_sharded.json").is_file() and (copy / "shard-0001" / "store" / "CURRENT").is_file()
    with pytest.raises(StoreError, match="in use"):
        ShardedMemory.load(home, **SHARD_OPTS)  # the home is open: one ShardedMemory per store
    with pytest.raises(StoreError, match="not a sharded store"):
        ShardedMemory.load(tmp_path / "nothing", **SHARD_OPTS)
    loaded = ShardedMemory.load(copy, **SHARD_OPTS)
    try:
        assert loaded.num_shards == 2 and loaded.path == copy.absolute()
        _assert_same_search(loaded, mirror, np.random.default_rng(31))
    finally:
        loaded.close()


def test_in_memory_shards_cannot_restart_or_checkpoint(sharded):
    with pytest.raises(ValueError, match="no home"):
        sharded.restart_shard(0)
    with pytest.raises(ValueError, match="path is required"):
        sharded.save()
    with pytest.raises(ValueError, match="shard must be"):
        sharded.restart_shard(sharded.num_shards)


def test_readme_sharded_example_runs(ray_cluster, tmp_path, monkeypatch):
    import re

    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "ray.md"
    block = re.search(r"```py\n(.*?)```", guide.read_text(encoding="utf-8"), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, str(guide), "exec"), scope)
    res = scope["res"]
    assert res.ids.shape == (3, 10) and res.route_names[0] in ("familiarity", "recollection")
    assert all(str(x).startswith("a") and x != "a2" for x in res.ids_list(0))
    store = tmp_path / "sharded-store"  # a relative path: resolved by the driver, not by each actor
    assert (store / "rfmem_sharded.json").is_file()
    assert all((store / f"shard-000{i}" / "store" / "CURRENT").is_file() for i in range(2))


def test_closed_memory_and_impossible_resources_fail_at_once(ray_cluster):
    """Every call after close() raises ShardedMemoryClosedError (not
    an AttributeError on None); shards the cluster can never hold (3 x 1 CPU on this
    2-CPU cluster) fail at once with the numbers, not after ready_timeout_s."""
    from rfmem_fast.distributed import ShardedMemoryClosedError

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"can never hold 3 shard actors of num_cpus=1: they need 3 CPU .* has 2"):
        ShardedMemory(3, 8, num_cpus=1, ready_timeout_s=300)
    with pytest.raises(ValueError, match="num_gpus=1"):
        ShardedMemory(1, 8, num_cpus=0, num_gpus=1, ready_timeout_s=300)
    assert time.monotonic() - t0 < 30
    mem = ShardedMemory(2, 8, **SHARD_OPTS)
    mem.add("u", np.ones((1, 8)), ["a"])
    assert mem.num_items == 1
    mem.close()
    mem.close()  # idempotent
    calls = [lambda: mem.add("u", np.ones((1, 8)), ["b"]), lambda: mem.delete("u", ["a"]),
             lambda: mem.search(np.ones((1, 8)), ["u"]), lambda: mem.num_items, lambda: mem.users,
             lambda: mem.stats(), lambda: mem.item_ids_of("u"), lambda: mem.restart_shard(0), lambda: "u" in mem]
    for call in calls:
        with pytest.raises(ShardedMemoryClosedError, match="closed"):
            call()


def test_threads_and_positions_reach_the_shards_and_the_context_score(ray_cluster, tmp_path):
    """from_bank carries the items' threads / positions, add / update forward them (logged:
    a reopened store holds them), and a search with the context score on equals the
    single-process one, context_scores included."""
    rng = np.random.default_rng(41)
    d = 8
    single = MemoryBank(d)
    for u in range(5):
        single.add(f"c{u}", rng.normal(size=(9, d)), [f"m{j}" for j in range(9)], threads=["a"] * 4 + [u] * 3 + [None] * 2,
                   positions=[3, 2, 1, 0, None, 1, 0, None, None])
    mem = ShardedMemory.from_bank(single, 2, path=tmp_path / "s", **SHARD_OPTS)
    try:
        X = rng.normal(size=(3, d))
        for bank in (mem, single):
            bank.add("c9", X, ["x", "y", "z"], threads="t", positions=[0, 1, 2])
            bank.update("c9", ["z"], None, threads=["q"], positions=[0])
            bank.update("c0", ["m8"], None, threads=["a"], positions=[9])
        cfg = RFMemConfig(out_k=5, probe_k=5, context_weight=0.5, thread_weight=0.3)
        Q = rng.normal(size=(7, d)).astype(np.float32)
        users = ["c0", "c1", "c2", "c3", "c4", "c9", "c0"]
        ref = search(single, Q, users, config=cfg, mode="dense")
        res = mem.search(Q, users, config=cfg, mode="dense")
        assert np.array_equal(res.ids, ref.ids)
        assert np.array_equal(res.context_scores, ref.context_scores, equal_nan=True)  # (NaN: padding of c9's 3 items)
        assert np.isfinite(res.context_scores[res.rows >= 0]).all() and (res.rows[5] >= 0).sum() == 3
    finally:
        mem.close()
    again = ShardedMemory.load(tmp_path / "s", **SHARD_OPTS)  # the logged writes replay with their threads
    try:
        res = again.search(Q, users, config=cfg, mode="dense")
        assert np.array_equal(res.ids, ref.ids)
        assert np.array_equal(res.context_scores, ref.context_scores, equal_nan=True)
    finally:
        again.close()
