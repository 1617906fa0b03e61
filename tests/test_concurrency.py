"""Searches from many threads while another thread writes.

Model under test (rfmem_fast/bank.py): one write lock plus immutable copy-on-write
snapshots. Every vector here is a fingerprint of (item id, generation), so a reader can
tell a torn row (a vector that belongs to no version of that item) from a consistent one.
"""
from __future__ import annotations

import threading
import time
import zlib

import numpy as np

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast._validate import l2_normalize_rows

D = 16
USERS = [f"u{i}" for i in range(6)]
CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
MODES = ["dense", "rfmem", "recollection"]
TIME_CAP = 50.0


def fingerprint(item: str, gen: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{item}|{gen}".encode()))
    return l2_normalize_rows(rng.normal(size=(1, D)).astype(np.float32), "v")[0]


class Ledger:
    """What the writer has done, published in the order that makes reader checks sound."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ever = {u: set() for u in USERS}  # registered BEFORE the add starts
        self.gens: dict[str, int] = {}  # highest generation, raised BEFORE the update starts
        self.deleted = {u: set() for u in USERS}  # recorded AFTER the delete returned

    def deleted_before(self, user):
        with self.lock:
            return set(self.deleted[user])

    def candidates(self, item):
        with self.lock:
            top = self.gens.get(item, -1)
        return [fingerprint(item, g) for g in range(top + 1)]


def build() -> tuple[MemoryBank, Ledger]:
    bank, led = MemoryBank(D), Ledger()
    for u in USERS:
        ids = [f"{u}:init{i}" for i in range(10)]
        for i in ids:
            led.ever[u].add(i)
            led.gens[i] = 0
        bank.add(u, np.stack([fingerprint(i, 0) for i in ids]), ids)
    return bank, led


def writer(bank: MemoryBank, led: Ledger, n_ops: int, seed: int, errors: list, stop: threading.Event) -> None:
    rng = np.random.default_rng(seed)
    k = 0
    try:
        for _ in range(n_ops):
            if stop.is_set():
                return
            user = USERS[int(rng.integers(len(USERS)))]
            live = bank.item_ids_of(user)
            op = rng.random()
            if op < 0.4 or len(live) < 3:
                ids = [f"{user}:w{k + j}" for j in range(int(rng.integers(1, 4)))]
                k += len(ids)
                with led.lock:
                    led.ever[user].update(ids)
                    for i in ids:
                        led.gens[i] = 0
                bank.add(user, np.stack([fingerprint(i, 0) for i in ids]), ids)
            elif op < 0.7:
                ids = [str(x) for x in rng.choice(live, size=min(3, len(live) - 1), replace=False)]
                bank.delete(user, ids)
                with led.lock:
                    led.deleted[user].update(ids)
            else:
                ids = [str(x) for x in rng.choice(live, size=min(2, len(live)), replace=False)]
                with led.lock:
                    for i in ids:
                        led.gens[i] += 1
                    gens = [led.gens[i] for i in ids]
                bank.update(user, ids, np.stack([fingerprint(i, g) for i, g in zip(ids, gens)]))
            time.sleep(0.001)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(("writer", repr(exc)))


def check_result(res, Q, users, led: Ledger, deleted_before: list[set]) -> None:
    for i, user in enumerate(users):
        q = Q[i] / np.linalg.norm(Q[i])
        for ids, scores, plain in ((res.ids_list(i), res.scores[i], res.mode == "dense"),
                                   ([x for x in res.probe_ids[i] if x is not None], res.probe_scores[i], True)):
            assert len(set(ids)) == len(ids), ids
            for j, item in enumerate(ids):
                assert item.startswith(user + ":"), (user, item)  # never another user's item
                assert item in led.ever[user], item  # an item that existed
                assert item not in deleted_before[i], item  # not deleted before the search began
                if plain:  # an inner product with SOME version of that item: no torn row
                    best = min(abs(float(fingerprint_dot(q, v)) - float(scores[j])) for v in led.candidates(item))
                    assert best < 1e-5, (item, best)


def fingerprint_dot(q, v):
    return np.dot(q.astype(np.float64), v.astype(np.float64))


def check_snapshot(snap, led: Ledger) -> None:
    assert snap.offsets[0] == 0 and snap.offsets[-1] == snap.vectors.shape[0] == snap.item_ids.shape[0]
    assert snap.texts.shape[0] == snap.item_ids.shape[0] and len(snap.users) == snap.num_users
    for u in range(snap.num_users):
        a, b = snap.offsets[u], snap.offsets[u + 1]
        ids = snap.item_ids[a:b].tolist()
        assert len(set(ids)) == len(ids)
        for r, item in zip(range(a, b), ids):
            assert item.startswith(snap.users[u] + ":")
            assert any(np.array_equal(snap.vectors[r], v) for v in led.candidates(item)), item


def reader(bank, led, seed, n_searches, errors, stop) -> None:
    rng = np.random.default_rng(seed)
    cfg = RFMemConfig(max_rounds=3, out_k=5, probe_k=5, score_floor=-1.0)
    try:
        last_version = -1
        for s in range(n_searches):
            if stop.is_set():
                return
            users = [USERS[int(x)] for x in rng.integers(len(USERS), size=3)]
            Q = rng.normal(size=(3, D))
            before = [led.deleted_before(u) for u in users]
            be = CPU_BACKENDS[s % len(CPU_BACKENDS)]
            mode = MODES[(s // len(CPU_BACKENDS)) % len(MODES)]
            res = search(bank, Q, users, cfg, mode=mode, backend=be)
            check_result(res, Q, users, led, before)
            if s % 10 == 0:
                snap = bank.snapshot()
                assert snap.version >= last_version  # versions never go back
                last_version = snap.version
                check_snapshot(snap, led)
    except BaseException as exc:
        errors.append((f"reader{seed}", repr(exc)))
        stop.set()


def test_readers_see_consistent_snapshots_while_a_writer_writes():
    bank, led = build()
    errors: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(bank, led, 100, 1, errors, stop))]
    threads += [threading.Thread(target=reader, args=(bank, led, 10 + r, 50, errors, stop)) for r in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, TIME_CAP - (time.monotonic() - t0)))
    stop.set()
    alive = [t.name for t in threads if t.is_alive()]
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not alive, f"threads still running after {TIME_CAP} s: {alive}"
    check_snapshot(bank.snapshot(), led)
    for u in USERS:  # the final state: every deleted id gone, every other id present
        assert set(bank.item_ids_of(u)) == led.ever[u] - led.deleted[u]


def test_concurrent_snapshot_builds_agree_and_saves_stay_consistent(tmp_path):
    bank, led = build()
    errors: list = []
    stop = threading.Event()
    w = threading.Thread(target=writer, args=(bank, led, 60, 2, errors, stop))
    w.start()
    saved = []
    t0 = time.monotonic()
    while w.is_alive() and time.monotonic() - t0 < TIME_CAP:
        snaps: list = []
        grab = [threading.Thread(target=lambda: snaps.append(bank.snapshot())) for _ in range(4)]
        for t in grab:
            t.start()
        for t in grab:
            t.join()
        for s in snaps:
            check_snapshot(s, led)
        path = tmp_path / f"s{len(saved) % 2}"
        bank.save(path)
        saved.append(path)
        time.sleep(0.005)
    stop.set()
    w.join(timeout=30)
    assert not errors, errors
    assert saved
    for path in set(saved):  # each save is one complete snapshot
        loaded = MemoryBank.load(path)
        check_snapshot(loaded.snapshot(), led)
