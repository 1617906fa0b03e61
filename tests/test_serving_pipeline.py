"""The encode / search pipeline of the micro-batcher.

:class:`MicroBatcher` with a ``prepare`` stage runs it on ``workers`` threads and
``run_batch`` on one run thread; :class:`Memory` puts its encoder in the first stage and
``rfmem_fast.search`` in the second. These tests drive both stages with events (no
timing assumptions): the stages really overlap, run in the order the batches were
taken, keep micro-batching's guarantees (each caller its own unbatched result, bounded
queue and hand-off, timeouts / cancellation free slots, a failure fails its own callers,
close drains or fails every waiter) and keep reads consistent with writes.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _serving_helpers import HashEncoder, clustered_memory_data

from rfmem_fast import Memory, RFMemConfig, search
from rfmem_fast.serving import BatcherClosedError, QueueFullError, RequestTimeoutError
from rfmem_fast.serving.batcher import MicroBatcher
from rfmem_fast.serving.memory import default_encoder_workers, encoder_threads

DIM = 16
WAIT = 10.0  # seconds an event may take before a test fails (never reached when it passes)


def wait_for(cond, what: str) -> None:
    """Poll ``cond()`` (a state another thread reaches) until true; fail after WAIT s."""
    ev = threading.Event()
    for _ in range(int(WAIT / 0.005)):
        if cond():
            return
        ev.wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class Stages:
    """A two-stage batch job whose stages log what they do and can be held by events.

    ``prepare(items)`` logs ("prep+", items) / ("prep-", items) and, for a batch whose
    first item is in ``hold_prepare``, waits for that event; ``run(state)`` logs
    ("run+", items) / ("run-", items) and waits for ``hold_run[first item]`` likewise.
    Results: item * 10; a negative item gets a ValueError of its own.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple]] = []
        self.lock = threading.Lock()
        self.hold_prepare: dict[int, threading.Event] = {}
        self.hold_run: dict[int, threading.Event] = {}
        self.entered: dict[tuple[str, int], threading.Event] = {}
        self.fail_prepare: set[int] = set()

    def _note(self, what: str, items: list) -> None:
        with self.lock:
            self.log.append((what, tuple(items)))
            self.entered.setdefault((what, items[0]), threading.Event()).set()

    def entered_ev(self, what: str, first: int) -> threading.Event:
        with self.lock:
            return self.entered.setdefault((what, first), threading.Event())

    def prepare(self, items: list) -> tuple:
        self._note("prep+", items)
        ev = self.hold_prepare.get(items[0])
        if ev is not None:
            assert ev.wait(WAIT), "prepare held too long"
        if self.fail_prepare & set(items):
            self._note("prep-", items)
            raise RuntimeError(f"prepare failed on {sorted(self.fail_prepare & set(items))}")
        self._note("prep-", items)
        return ("state", tuple(items))

    def run(self, state: tuple) -> list:
        assert state[0] == "state"  # run_batch gets what prepare returned
        items = list(state[1])
        self._note("run+", items)
        ev = self.hold_run.get(items[0])
        if ev is not None:
            assert ev.wait(WAIT), "run held too long"
        self._note("run-", items)
        return [ValueError(f"bad {x}") if x < 0 else x * 10 for x in items]

    def index(self, what: str, first: int) -> int:
        return next(i for i, (w, items) in enumerate(self.log) if w == what and items[0] == first)


def batcher(stages: Stages, **kw) -> MicroBatcher:
    kw.setdefault("max_wait_ms", 0.0)
    kw.setdefault("timeout", WAIT)
    return MicroBatcher(stages.run, prepare=stages.prepare, **kw)


# ----------------------------------------------------------------------------- overlap
@pytest.mark.parametrize("workers", [1, 2])
def test_the_next_batch_is_prepared_while_the_current_one_runs(workers):
    """Batch 1's run waits until batch 2's prepare has started: it can only end because
    the stages overlap; then batch 2 runs after batch 1 (run order = take order)."""
    st = Stages()
    st.hold_run[1] = threading.Event()
    b = batcher(st, workers=workers)
    f1 = b.submit(1)
    assert st.entered_ev("run+", 1).wait(WAIT)
    f2 = b.submit(2)  # taken and prepared while batch 1 is still running
    assert st.entered_ev("prep-", 2).wait(WAIT)
    assert not f1.done() and not f2.done()
    st.hold_run[1].set()
    assert f1.result(WAIT) == 10 and f2.result(WAIT) == 20
    assert st.index("prep+", 2) < st.index("run-", 1) < st.index("run+", 2)
    assert b.stats()["overlapped"] >= 1 and b.stats()["pipeline"] is True
    b.close()


def test_without_the_pipeline_a_batch_is_prepared_only_after_the_previous_run():
    """pipeline=False: run_batch(prepare(items)) on one thread, nothing overlaps."""
    st = Stages()
    st.hold_run[1] = threading.Event()
    b = batcher(st, pipeline=False)
    f1 = b.submit(1)
    assert st.entered_ev("run+", 1).wait(WAIT)
    f2 = b.submit(2)
    assert not st.entered_ev("prep+", 2).wait(0.2)  # the only thread is inside run(1)
    st.hold_run[1].set()
    assert f1.result(WAIT) == 10 and f2.result(WAIT) == 20
    assert [w for w, _ in st.log] == ["prep+", "prep-", "run+", "run-"] * 2
    assert b.stats()["overlapped"] == 0 and b.stats()["pipeline"] is False
    b.close()


def test_two_workers_prepare_two_batches_at_once_and_runs_keep_the_take_order():
    """workers=2: batch 1's prepare is held until batch 2's prepare has ended (both in
    the prepare stage at once); batch 2, ready first, still runs after batch 1, and its
    callers get their results only then."""
    st = Stages()
    st.hold_prepare[1] = threading.Event()
    b = batcher(st, workers=2)
    f1 = b.submit(1)
    assert st.entered_ev("prep+", 1).wait(WAIT)
    f2 = b.submit(2)
    assert st.entered_ev("prep-", 2).wait(WAIT)  # the second worker prepared batch 2 meanwhile
    assert not st.entered_ev("run+", 2).wait(0.1) and not f2.done()  # but it waits for batch 1
    st.hold_prepare[1].set()
    assert f2.result(WAIT) == 20 and f1.done() and f1.result() == 10
    assert st.index("prep+", 2) < st.index("prep-", 1) < st.index("run+", 1) < st.index("run+", 2)
    b.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_in_flight_batches_are_bounded_and_the_queue_fills_behind_them(workers):
    """At most workers + 1 batches between take and the end of their run: with the run
    stage held, further requests stay in the queue (counted in queue_depth), and a
    full queue refuses at once."""
    st = Stages()
    st.hold_run[1] = threading.Event()
    b = batcher(st, workers=workers, max_batch=1, max_queue=3)
    futs = [b.submit(1)]
    assert st.entered_ev("run+", 1).wait(WAIT)
    for x in range(2, 2 + workers):  # taken and prepared: the hand-off holds them
        futs.append(b.submit(x))
        assert st.entered_ev("prep-", x).wait(WAIT)
    futs += [b.submit(x) for x in (10, 11, 12)]  # queued: no free slot
    wait_for(lambda: b.queue_depth == 3, "three queued requests")
    assert not st.entered_ev("prep+", 10).wait(0.1)
    with pytest.raises(QueueFullError, match="queue is full"):
        b.submit(13)
    st.hold_run[1].set()
    assert [f.result(WAIT) for f in futs] == [10 * x for x in [1, *range(2, 2 + workers), 10, 11, 12]]
    runs = [items[0] for w, items in st.log if w == "run+"]
    assert runs == [1, *range(2, 2 + workers), 10, 11, 12]  # the order they were taken
    assert b.stats()["rejected"] == 1
    b.close()


# ----------------------------------------------------------------------------- failures
def test_a_failing_prepare_fails_its_own_batch_only_and_per_item_errors_stay_per_item():
    st = Stages()
    st.fail_prepare = {7}
    b = batcher(st, workers=2, max_batch=1)
    with ThreadPoolExecutor(6) as pool:
        futs = {x: pool.submit(b.call, x) for x in (1, 7, -3, 4, 5)}
        with pytest.raises(RuntimeError, match=r"prepare failed on \[7\]"):
            futs[7].result(WAIT)
        with pytest.raises(ValueError, match="bad -3"):
            futs[-3].result(WAIT)
        assert [futs[x].result(WAIT) for x in (1, 4, 5)] == [10, 40, 50]
    assert b.call(8) == 80  # the pipeline keeps working
    b.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_timeouts_and_cancellation_free_queue_slots_in_the_pipeline(workers):
    st = Stages()
    st.hold_run[1] = threading.Event()
    b = batcher(st, workers=workers, max_batch=1, max_queue=2)
    first = b.submit(1)
    assert st.entered_ev("run+", 1).wait(WAIT)
    held = [b.submit(x) for x in range(2, 2 + workers)]
    for x in range(2, 2 + workers):
        assert st.entered_ev("prep-", x).wait(WAIT)
    with ThreadPoolExecutor(2) as pool:
        waiters = [pool.submit(b.call, 20 + i, 0.05) for i in range(2)]
        for w in waiters:
            with pytest.raises(RequestTimeoutError, match="timeout=0.05"):
                w.result(WAIT)
    assert b.queue_depth == 0

    async def cancelled():
        tasks = [asyncio.ensure_future(b.acall(30 + i, None)) for i in range(2)]
        await asyncio.sleep(0.02)
        assert b.queue_depth == 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return b.queue_depth

    assert asyncio.run(cancelled()) == 0
    late = b.submit(40)  # queued: the slots were freed
    st.hold_run[1].set()
    assert first.result(WAIT) == 10 and [h.result(WAIT) for h in held] == [20 + 10 * i for i in range(workers)]
    assert late.result(WAIT) == 400
    ran = sorted(x for w, items in st.log if w == "run+" for x in items)
    assert ran == sorted([1, *range(2, 2 + workers), 40])  # timed-out / cancelled requests never ran
    assert b.stats()["timeouts"] == 2
    b.close()


# ----------------------------------------------------------------------------- shutdown
@pytest.mark.parametrize("workers", [1, 2])
def test_close_drains_every_batch_in_flight_and_every_queued_request(workers):
    st = Stages()
    st.hold_run[1] = threading.Event()
    b = batcher(st, workers=workers, max_batch=2)
    futs = [b.submit(1)]
    assert st.entered_ev("run+", 1).wait(WAIT)
    futs += [b.submit(x) for x in range(2, 9)]  # prepared and queued behind the held run
    closer = threading.Thread(target=b.close)
    closer.start()
    wait_for(lambda: b._closed, "close() to start")
    with pytest.raises(BatcherClosedError):
        b.submit(99)  # refused at once while closing
    st.hold_run[1].set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert [f.result(0) for f in futs] == [10 * x for x in range(1, 9)]
    assert all(not t.is_alive() for t in b._threads)


def test_close_that_gives_up_fails_every_waiter_not_yet_running_its_last_stage():
    """close(timeout) with the run stage stuck: the prepared batch and the queued
    requests get BatcherClosedError at once, a batch whose prepare ends after close
    gave up gets it then; only the stuck run's own callers wait for it, and get its
    result when it ends."""
    st = Stages()
    st.hold_run[1] = threading.Event()
    st.hold_prepare[2] = threading.Event()
    b = batcher(st, workers=2, max_batch=1)
    f1 = b.submit(1)
    assert st.entered_ev("run+", 1).wait(WAIT)
    f2 = b.submit(2)  # held in its prepare
    assert st.entered_ev("prep+", 2).wait(WAIT)
    f3 = b.submit(3)  # prepared by the other worker, waits for the run thread
    assert st.entered_ev("prep-", 3).wait(WAIT)
    f4 = b.submit(4)  # queued: no free slot
    wait_for(lambda: b.queue_depth == 1, "one queued request")
    b.close(timeout=0.1)
    for f in (f3, f4):
        with pytest.raises(BatcherClosedError, match="closed before this request ran"):
            f.result(0)
    st.hold_prepare[2].set()
    with pytest.raises(BatcherClosedError):
        f2.result(WAIT)
    assert not f1.done()
    st.hold_run[1].set()
    assert f1.result(WAIT) == 10
    assert [items[0] for w, items in st.log if w == "run+"] == [1]  # nothing ran late


def test_search_racing_close_with_two_encoder_workers_finishes_or_is_refused():
    for _ in range(10):
        mem = Memory(encoder=[HashEncoder(DIM), HashEncoder(DIM)], max_wait_ms=0.5, timeout=None, cache_size=0)
        mem.add(["x"], "u")
        go = threading.Barrier(7)

        def one(i):
            go.wait()
            try:
                return len(mem.search(f"q{i}", "u"))
            except BatcherClosedError:
                return "closed"

        with ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(one, i) for i in range(6)]
            go.wait()
            mem.close()
            outs = [f.result(WAIT) for f in futs]  # a lost request would time out here
        assert set(outs) <= {1, "closed"}
        with pytest.raises(BatcherClosedError):
            mem.search("after", "u")


# ----------------------------------------------------------------------------- Memory
def reference(mem: Memory, vec, user, k, mode):
    """The unbatched answer: one direct rfmem_fast.search call for this one query."""
    res = search(mem.bank, np.asarray(vec, np.float32)[None], [user], config=mem.config.replace(out_k=k), mode=mode)
    keep = res.rows[0] >= 0
    return dict(ids=[i for i, ok in zip(res.ids[0], keep) if ok], scores=res.scores[0][keep].tolist(),
                route=res.route_names[0], rule=res.rule_names[0], rounds=int(res.rounds[0]))


def as_dict(hits):
    return dict(ids=[h.id for h in hits], scores=[h.score for h in hits], route=hits.route, rule=hits.rule,
                rounds=hits.rounds)


class CountingEncoder(HashEncoder):
    """A HashEncoder that fails the test if two threads are inside one instance at once,
    and records which instance encoded what."""

    def __init__(self, dim: int, name: str, seen: list) -> None:
        super().__init__(dim)
        self.name, self.seen, self.inside = name, seen, 0
        self.lock = threading.Lock()

    def encode(self, texts):
        with self.lock:
            self.inside += 1
            assert self.inside == 1, "one encoder used by two threads at once"
        try:
            self.seen.append((self.name, len(texts)))
            return super().encode(texts)
        finally:
            with self.lock:
                self.inside -= 1


def test_pipelined_memory_with_two_encoder_workers_gives_each_caller_its_unbatched_result():
    items, queries = clustered_memory_data(dim=DIM)
    seen: list = []
    encs = [CountingEncoder(DIM, n, seen) for n in ("a", "b")]
    mem = Memory(encoder=encs, max_batch=8, max_wait_ms=5.0, cache_size=0, config=RFMemConfig.paper())  # both paths
    assert mem.stats()["batcher"]["workers"] == 2
    for user, X in items.items():
        mem.add([f"{user} item {i}" for i in range(len(X))], user, vectors=X)
    calls = []
    for n, (user, vec) in enumerate(queries):
        for e in encs:
            e.overrides[f"query {n}"] = vec
        for mode in ("rfmem", "dense", "recollection"):
            calls.append((f"query {n}" if n % 2 else vec, user, 3 + 4 * (n % 2), mode, vec))
    start = threading.Barrier(16, timeout=WAIT)

    def one(n):
        query, user, k, mode, _ = calls[n]
        if n < 16:
            start.wait()
        return mem.search(query, user, k=k, mode=mode)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(len(calls))))
    routes = set()
    for (query, user, k, mode, vec), hits in zip(calls, got):
        assert as_dict(hits) == reference(mem, vec, user, k, mode)
        routes.add(hits.route)
    assert routes == {"familiarity", "recollection"}
    st = mem.stats()["batcher"]
    assert st["requests"] == len(calls) and st["largest_batch"] > 1 and st["pipeline"]
    assert {name for name, _ in seen} <= {"a", "b"} and sum(n for _, n in seen) >= len(queries) // 2
    mem.close()


def test_a_search_taken_after_a_write_returned_sees_it_while_an_earlier_batch_encodes():
    """Batch 1 is held in one encoder; an add returns meanwhile; a search sent after it
    is encoded by the other encoder but searched after batch 1, and sees the new item;
    so does batch 1 (its snapshot is taken in the search stage, after the add)."""
    seen: list = []
    a, b = CountingEncoder(DIM, "a", seen), CountingEncoder(DIM, "b", seen)
    mem = Memory(encoder=[a, b], max_wait_ms=0.0, cache_size=0, timeout=WAIT)
    mem.add(None, "u", ids=["old"], vectors=np.eye(DIM, dtype=np.float32)[0])
    new = np.eye(DIM, dtype=np.float32)[1]
    gate = threading.Event()
    for e in (a, b):
        e.overrides["find new"] = e.overrides["find new again"] = new
        e.entered.clear()
        e.gate = gate
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(mem.search, "find new", "u", 2, "dense")
        wait_for(lambda: a.entered.is_set() or b.entered.is_set(), "batch 1 in an encoder")
        free = b if a.entered.is_set() else a
        free.gate = None
        mem.add(None, "u", ids=["new"], vectors=new)  # vectors: no encoder needed
        second = pool.submit(mem.search, "find new again", "u", 2, "dense")
        wait_for(lambda: free.entered.is_set(), "batch 2 in the free encoder")
        assert not second.done() and not first.done()  # batch 2 encoded, its search waits for batch 1's
        gate.set()
        assert first.result(WAIT)[0].id == "new" and second.result(WAIT)[0].id == "new"
    assert [h.id for h in mem.search(new, "u", k=2, mode="dense")] == ["new", "old"]
    mem.close()


def test_memory_pipeline_options_are_checked():
    enc = HashEncoder(DIM)
    for bad in (0, -1, 1.5, True, "two"):
        with pytest.raises(ValueError, match="encoder_workers must be an int >= 1, 'auto' or None"):
            Memory(encoder=enc, encoder_workers=bad)
    with pytest.raises(ValueError, match="encoder_workers=2 needs one encoder per worker"):
        Memory(encoder=enc, encoder_workers=2)
    with pytest.raises(ValueError, match="encoder_workers=2 needs a text encoder"):
        Memory(encoder=False, dim=DIM, encoder_workers=2)
    with pytest.raises(ValueError, match="encoder_workers=2 needs batching=True and pipeline=True"):
        Memory(encoder=[enc, HashEncoder(DIM)], encoder_workers=2, pipeline=False)
    with pytest.raises(ValueError, match="encoder_workers=3 but encoder is a list of 2"):
        Memory(encoder=[enc, HashEncoder(DIM)], encoder_workers=3)
    with pytest.raises(ValueError, match=r"encoder\[1\].dim=8 differs from encoder\[0\].dim=16"):
        Memory(encoder=[enc, HashEncoder(8)])
    with pytest.raises(ValueError, match="empty list"):
        Memory(encoder=[])
    with pytest.raises(TypeError, match=r"encoder\[1\] must have an encode"):
        Memory(encoder=[enc, object()])
    with pytest.raises(TypeError, match="pipeline must be a bool"):
        Memory(encoder=enc, pipeline="yes")
    assert Memory(encoder=[enc, HashEncoder(DIM)]).stats()["batcher"]["workers"] == 2  # the list's length
    assert Memory(encoder=enc, encoder_workers="auto").stats()["batcher"]["workers"] == 1  # one encoder
    off = Memory(encoder=enc, pipeline=False).stats()["batcher"]
    assert off["pipeline"] is False and off["workers"] == 1
    for bad in ({"workers": 0}, {"workers": 2}, {"workers": 2, "prepare": len, "pipeline": False}):
        with pytest.raises(ValueError, match="workers"):
            MicroBatcher(len, **bad)
    with pytest.raises(TypeError, match="prepare must be callable"):
        MicroBatcher(len, prepare=3)


def test_default_encoder_workers_rule_and_threads_per_worker(monkeypatch):
    assert [default_encoder_workers(c) for c in (1, 2, 3, 4, 7, 8, 16)] == [1, 1, 1, 1, 1, 2, 4]
    for bad in (0, 1.0, None.__class__):
        with pytest.raises(ValueError, match="cores must be an int >= 1"):
            default_encoder_workers(bad)
    import torch

    n = torch.get_num_threads()
    assert encoder_threads(1) == n and encoder_threads(2) == max(1, n // 2)
    assert encoder_threads(2, cores=2) == max(1, min(n, 2) // 2) and encoder_threads(8, cores=2) == 1


def test_the_default_encoder_is_loaded_once_per_worker_with_its_share_of_threads(monkeypatch):
    """encoder_workers=2 with the default encoder: two encoders, each built with
    num_threads = encoder_threads(2), each used by one thread at a time; with one
    worker the default encoder is built as before (no num_threads)."""
    import rfmem_fast.serving.memory as memory_module

    made, seen = [], []

    def fake_default(**kwargs):
        made.append(kwargs)
        return CountingEncoder(DIM, f"e{len(made)}", seen)

    monkeypatch.setattr(memory_module, "_default_encoder", fake_default)
    mem = Memory(dim=DIM, encoder_workers=2, encoder_backend="onnx")
    assert made == []  # loaded on first use
    mem.add(["a text"], "u")
    threads = encoder_threads(2, memory_module.usable_cores())
    assert made == [{"backend": "onnx", "num_threads": threads}] * 2
    with ThreadPoolExecutor(8) as pool:
        assert all(len(h) == 1 for h in pool.map(lambda i: mem.search(f"q{i}", "u", mode="dense"), range(40)))
    assert {n for n, _ in seen} <= {"e1", "e2"}
    mem.close()
    made.clear()
    Memory(dim=DIM).add(["a text"], "u")
    assert made == [{}]


def test_serve_options_resolve_and_refuse_bad_combinations(tmp_path, monkeypatch, capsys):
    import rfmem_fast.serving.memory as memory_module
    from rfmem_fast.cli import main
    from rfmem_fast.serving.app import serve
    from rfmem_fast.serving.cli import open_memory, resolve_encoder_workers

    auto = default_encoder_workers()
    assert resolve_encoder_workers("auto", "default", True, True) == auto
    assert resolve_encoder_workers("auto", "none", True, True) == 1
    assert resolve_encoder_workers("auto", "default", True, False) == 1
    assert resolve_encoder_workers("auto", "default", False, True) == 1
    assert resolve_encoder_workers(3, "default", True, True) == 3
    with pytest.raises(ValueError, match="does not go with --no-pipeline"):
        resolve_encoder_workers(2, "default", True, False)
    with pytest.raises(ValueError, match="does not go with --encoder none"):
        resolve_encoder_workers(2, "none", True, True)
    with pytest.raises(ValueError, match="encoder_workers must be an int >= 1 or 'auto'"):
        resolve_encoder_workers(0, "default", True, True)
    for argv in (["--encoder-workers", "0"], ["--encoder-workers", "many"], ["--switch-interval-ms", "0"],
                 ["--switch-interval-ms", "fast"]):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--path", str(tmp_path / "m"), *argv])
        assert exc.value.code == 2 and argv[0] in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not go with --no-pipeline"):
        serve(str(tmp_path / "m"), no_auth=True, pipeline=False, encoder_workers=2)
    assert not (tmp_path / "m").exists()  # refused before anything was opened
    made = []
    monkeypatch.setattr(memory_module, "_default_encoder", lambda **kw: made.append(kw) or HashEncoder(384))
    mem = open_memory(str(tmp_path / "m2"), encoder_backend="onnx", encoder_dtype="float32", encoder_workers=2)
    try:
        assert len(made) == 2 and all(kw["num_threads"] >= 1 for kw in made)  # loaded before the first request
        assert mem.stats()["batcher"]["workers"] == 2 and mem.stats()["batcher"]["pipeline"]
    finally:
        mem.close()
    mem = open_memory(str(tmp_path / "m3"), encoder="none", dim=DIM, pipeline=False)
    try:
        assert mem.stats()["batcher"]["pipeline"] is False and mem.stats()["batcher"]["workers"] == 1
    finally:
        mem.close()


def test_text_encoder_num_threads_is_checked_before_loading():
    from rfmem_fast.encoders import TextEncoder

    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        TextEncoder(model="/nonexistent", num_threads=0)
    with pytest.raises(TypeError, match="num_threads must be an int >= 1 or None"):
        TextEncoder(model="/nonexistent", num_threads=1.5)


def test_a_lone_batch_is_shared_out_over_the_idle_encoders_and_never_waits_for_a_busy_one():
    """Work sharing: with two encoders and nothing else encoding, one batch of 7 texts is
    split 4 + 3 (balanced by length) over both; while one encoder is held busy, a batch
    is encoded by the other alone, at once. Answers equal a direct search either way."""
    seen: list = []
    a, b = CountingEncoder(DIM, "a", seen), CountingEncoder(DIM, "b", seen)
    mem = Memory(encoder=[a, b], cache_size=0, timeout=WAIT, config=RFMemConfig.paper())  # dense: reference() below
    rng = np.random.default_rng(3)
    X = rng.normal(size=(30, DIM)).astype(np.float32)
    mem.add(None, "u", ids=[f"i{j}" for j in range(30)], vectors=X)
    texts = [f"question {'x' * j}" for j in range(7)]
    got = mem.search_batch(texts, "u", k=3, mode="dense")
    assert sorted(n for _, n in seen) == [3, 4] and {name for name, _ in seen} == {"a", "b"}
    for t, hits in zip(texts, got):
        assert as_dict(hits) == reference(mem, a.vector(t), "u", 3, "dense")
    seen.clear()
    gate = threading.Event()
    for e in (a, b):
        e.gate, e.entered = gate, threading.Event()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(mem.search_batch, ["held"], "u", 3, "dense")
        wait_for(lambda: a.entered.is_set() or b.entered.is_set(), "one encoder busy")
        busy, free = (a, b) if a.entered.is_set() else (b, a)
        free.gate = None
        alone = mem.search_batch(texts[:5], "u", k=3, mode="dense")  # does not wait for the busy one
        assert seen[-1] == (free.name, 5) and not held.done()
        gate.set()
        assert len(held.result(WAIT)[0]) == 3
    for t, hits in zip(texts, alone):
        assert as_dict(hits) == reference(mem, a.vector(t), "u", 3, "dense")
    mem.close()


def test_switch_interval_is_set_in_ms_and_checked():
    import sys

    from rfmem_fast.serving.cli import DEFAULT_SWITCH_INTERVAL_MS, set_switch_interval

    before = sys.getswitchinterval()
    try:
        set_switch_interval(DEFAULT_SWITCH_INTERVAL_MS)
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_MS / 1000)
        set_switch_interval(5)
        assert sys.getswitchinterval() == pytest.approx(0.005)
        for bad in (0, -1, 1001, float("nan"), True, "1"):
            with pytest.raises(ValueError, match=r"switch interval must be a number of ms in \(0, 1000\]"):
                set_switch_interval(bad)
    finally:
        sys.setswitchinterval(before)
