"""Request micro-batching: many concurrent single requests, one batched call.

The engine's speed comes from batches (one encoder forward pass for many texts, one
:func:`rfmem_fast.search` call for many queries; DESIGN.md "batching"). A serving
stack has one request at a time per caller. :class:`MicroBatcher` gathers concurrent
requests (threads: :meth:`MicroBatcher.call`; asyncio: :meth:`MicroBatcher.acall`) into
a bounded queue; one worker thread takes the first waiting request, keeps collecting
for at most ``max_wait_ms`` or until ``max_batch`` requests are in hand, and runs them
as ONE ``run_batch(list)`` call; each caller gets exactly its own entry of the result.

Back-pressure: the queue holds at most ``max_queue`` requests; a submit to a full queue
raises :class:`QueueFullError` at once, and a caller whose result is not ready within
its timeout gets :class:`RequestTimeoutError`. A request that timed out or was
cancelled (its future cancelled, an asyncio task cancelled, e.g. a client that
disconnected) before the worker took it leaves the queue at once: it frees its slot
and is never run. Closing is atomic with submitting: a request is either queued before
:meth:`MicroBatcher.close` (and then finished by the worker) or refused with
:class:`BatcherClosedError` at once; nothing is ever left in a queue no worker reads.

Two stages (``prepare``): a batch's run may be split into ``state = prepare(items)``
(e.g. encoding the queries' texts) and ``run_batch(state)`` (e.g. the search). With
``pipeline=True`` (the default when ``prepare`` is given) the two stages run on
different threads, so the next batch is prepared while the current one runs:
``workers`` prepare threads (each takes the next batch from the queue when it is
free) hand batches to ONE run thread through a bounded hand-off (at most ``workers +
1`` batches between being taken from the queue and the end of their run). The run
thread takes the batches in the order they were taken from the queue, one at a
time, so results are set in that order and every ``run_batch`` call starts after the
previous one ended (what :class:`~rfmem_fast.serving.Memory` relies on: a search
taken after a write returned sees it). ``pipeline=False`` runs
``run_batch(prepare(items))`` on one worker thread, one batch at a time.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import threading
import time
from typing import Any, Callable, Sequence

__all__ = ["MicroBatcher", "QueueFullError", "RequestTimeoutError", "BatcherClosedError"]


class QueueFullError(RuntimeError):
    """The micro-batcher's queue is full: the server is overloaded; retry later (HTTP 503)."""


class RequestTimeoutError(TimeoutError):
    """A request got no result within its timeout (HTTP 504)."""


class BatcherClosedError(RuntimeError):
    """A request was submitted to (or left in) a closed micro-batcher."""


class MicroBatcher:
    """Gather concurrent requests into batches run by worker threads.

    Args:
        run_batch: ``f(items) -> results`` (or ``f(prepare(items)) -> results`` when
            ``prepare`` is given): called with a list of 1..max_batch submitted items,
            returns a sequence of the same length; an entry that is an exception
            instance is raised to that item's caller only. If the call itself raises,
            every caller of the batch gets that exception.
        max_batch: the most items per batch (int >= 1).
        max_wait_ms: how long (ms, float >= 0) a worker waits for more requests
            after the first one of a batch arrived; requests already queued are taken
            without waiting.
        max_queue: the most requests waiting (int >= 1); beyond it, submit raises
            :class:`QueueFullError`. Requests taken by a worker (at most ``max_batch``
            per batch in flight) no longer count.
        timeout: default seconds a caller waits for its result (float > 0, or None for
            no limit).
        name: the worker threads' name (prefix).
        prepare: optional first stage ``g(items) -> state`` (any object, passed to
            ``run_batch``); if it raises, every caller of the batch gets that
            exception. None: one stage, ``run_batch(items)``.
        workers: threads running ``prepare`` at once (int >= 1; more than 1 needs
            ``prepare`` and ``pipeline``). ``prepare`` must then be safe to call from
            several threads at once.
        pipeline: with ``prepare``, run the two stages on different threads (module
            docstring; default True); False runs ``run_batch(prepare(items))`` on one
            thread, one batch at a time (no overlap). Ignored without ``prepare``.

    Raises:
        ValueError / TypeError: an argument out of range or of the wrong type.

    The worker threads start on the first submit and stop on :meth:`close`. Counters:
    :meth:`stats`.
    """

    def __init__(
        self,
        run_batch: Callable[[Any], Sequence[Any]],
        max_batch: int = 64,
        max_wait_ms: float = 2.0,
        max_queue: int = 1024,
        timeout: float | None = 30.0,
        name: str = "rfmem-batcher",
        *,
        prepare: Callable[[list], Any] | None = None,
        workers: int = 1,
        pipeline: bool = True,
    ) -> None:
        if not callable(run_batch):
            raise TypeError("run_batch must be callable")
        if prepare is not None and not callable(prepare):
            raise TypeError(f"prepare must be callable or None, got {type(prepare).__name__}")
        for arg, val in (("max_batch", max_batch), ("max_queue", max_queue), ("workers", workers)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {val!r}")
        if not isinstance(pipeline, bool):
            raise TypeError(f"pipeline must be a bool, got {type(pipeline).__name__}")
        if workers > 1 and (prepare is None or not pipeline):
            raise ValueError(f"workers={workers} needs a prepare stage and pipeline=True "
                             "(only the prepare stage runs on several threads)")
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
        _check_timeout(timeout)
        self._run_batch = run_batch
        self._prepare = prepare
        self.max_batch = max_batch
        self.max_wait = float(max_wait_ms) / 1000.0
        self.max_queue = max_queue
        self.timeout = timeout
        self.workers = workers
        self.pipelined = prepare is not None and pipeline
        self._name = name
        # waiting (item, future) pairs; a cancelled one is removed at once (its done callback)
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._closed = False
        # pipeline: one collector at a time; batches in flight (taken .. run ended) <=
        # workers + 1; prepared batches by sequence number, run in that order
        self._collect_lock = threading.Lock()
        self._slots = threading.Semaphore(workers + 1)
        self._hcond = threading.Condition(threading.Lock())
        self._ready: dict[int, tuple] = {}
        self._next_seq = 0
        self._preparers_left = workers
        self._abandoned = False
        self._stats_lock = threading.Lock()
        self.batches = 0
        self.requests = 0
        self.rejected = 0
        self.timeouts = 0
        self.largest_batch = 0
        self.prepare_seconds = 0.0
        self.run_seconds = 0.0
        self.overlapped = 0  # runs before whose end a later batch had been taken

    # ------------------------------------------------------------------ submitting
    def submit(self, item: Any) -> cf.Future:
        """Queue ``item``; returns a concurrent.futures.Future of its result.

        Cancelling the future before a worker takes it removes the request from the
        queue (its slot is free at once).

        Raises:
            QueueFullError: ``max_queue`` requests are already waiting.
            BatcherClosedError: after (or racing with) :meth:`close`.
        """
        fut: cf.Future = cf.Future()
        entry = (item, fut)
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the micro-batcher is closed")
            if len(self._queue) >= self.max_queue:
                with self._stats_lock:
                    self.rejected += 1
                raise QueueFullError(
                    f"the request queue is full ({self.max_queue} requests waiting); retry later"
                )
            self._queue.append(entry)
            if not self._threads:
                self._start_threads()
            self._cond.notify()
        fut.add_done_callback(lambda f, e=entry: self._forget(e) if f.cancelled() else None)
        return fut

    def _start_threads(self) -> None:
        """Start the worker thread(s) (called once, under ``self._cond``)."""
        if self.pipelined:
            targets = [(self._prepare_loop, f"{self._name}-prepare-{i}") for i in range(self.workers)]
            targets.append((self._run_loop, f"{self._name}-run"))
        else:
            targets = [(self._loop, self._name)]
        for target, name in targets:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _forget(self, entry: tuple) -> None:
        """Drop a cancelled request from the queue (no-op once a worker took it)."""
        with self._cond:
            for j, e in enumerate(self._queue):  # by identity: items need not compare
                if e is entry:
                    del self._queue[j]
                    break

    def call(self, item: Any, timeout: float | None | str = "default") -> Any:
        """Submit ``item`` and wait for its result (thread callers).

        Args:
            item: the request.
            timeout: seconds to wait (None: no limit; default: the batcher's ``timeout``).

        Raises:
            QueueFullError, BatcherClosedError: as :meth:`submit`.
            RequestTimeoutError: no result within ``timeout`` (the request leaves the
                queue if it had not started).
            Any exception ``prepare`` / ``run_batch`` produced for this item.
        """
        timeout = self.timeout if timeout == "default" else _check_timeout(timeout)
        fut = self.submit(item)
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise self._timed_out(fut, timeout) from None
        except BaseException:  # KeyboardInterrupt etc.: do not leave the request queued
            fut.cancel()
            raise

    async def acall(self, item: Any, timeout: float | None | str = "default") -> Any:
        """Asyncio version of :meth:`call`: awaits the result without blocking the loop.

        A cancelled awaiting task (e.g. a client that disconnected) cancels its request:
        it leaves the queue and frees its slot."""
        timeout = self.timeout if timeout == "default" else _check_timeout(timeout)
        fut = self.submit(item)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise self._timed_out(fut, timeout) from None
        except BaseException:  # CancelledError: wrap_future cancels fut too; be explicit
            fut.cancel()
            raise

    def _timed_out(self, fut: cf.Future, timeout: float | None) -> RequestTimeoutError:
        fut.cancel()  # dropped from the queue unless a worker already started it
        with self._stats_lock:
            self.timeouts += 1
        return RequestTimeoutError(f"no result within timeout={timeout} s (server overloaded?)")

    # ------------------------------------------------------------------ workers
    def _collect(self) -> tuple[list, bool]:
        """Wait for one request, then gather up to max_batch within max_wait.

        Returns (batch, stop): stop once closed and the queue is drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return [], True
                self._cond.wait()
            batch = [self._queue.popleft()]
            deadline = time.monotonic() + self.max_wait
            while len(batch) < self.max_batch:
                if self._queue:
                    batch.append(self._queue.popleft())
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            return batch, False

    def _take(self, batch: list) -> list:
        """The requests of a collected batch still wanted (now running: a cancel
        fails from here on), counted."""
        live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
        if live:
            with self._stats_lock:
                self.batches += 1
                self.requests += len(live)
                self.largest_batch = max(self.largest_batch, len(live))
        return live

    def _finish(self, live: list, arg: Any, error: BaseException | None) -> None:
        """Run ``run_batch(arg)`` (unless the first stage failed with ``error``) and
        set every caller's future: its own result or exception."""
        if error is None:
            t0 = time.perf_counter()
            try:
                results = self._run_batch(arg)
                if len(results) != len(live):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(live)} items")
            except BaseException as exc:  # every caller of the batch learns why
                error = exc
            finally:
                with self._stats_lock:
                    self.run_seconds += time.perf_counter() - t0
        if error is not None:
            for _, fut in live:
                fut.set_exception(error)
            return
        for (_, fut), res in zip(live, results):
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    def _prepared(self, live: list) -> tuple[Any, BaseException | None]:
        """(``prepare(items)`` or the items themselves, None) or (None, its exception)."""
        items = [item for item, _ in live]
        if self._prepare is None:
            return items, None
        t0 = time.perf_counter()
        try:
            return self._prepare(items), None
        except BaseException as exc:
            return None, exc
        finally:
            with self._stats_lock:
                self.prepare_seconds += time.perf_counter() - t0

    def _loop(self) -> None:
        """One thread, one batch at a time: collect, prepare, run."""
        while True:
            batch, stop = self._collect()
            if stop:
                return
            live = self._take(batch)
            if live:
                self._finish(live, *self._prepared(live))

    def _prepare_loop(self) -> None:
        """A prepare thread of the pipeline: take a slot, collect a batch (one
        collector at a time: batches fill as they would with one worker), number it,
        prepare it, hand it to the run thread."""
        try:
            while True:
                self._slots.acquire()
                with self._collect_lock:
                    batch, stop = self._collect()
                    live = [] if stop else self._take(batch)
                    seq = self._next_seq
                    if live:
                        self._next_seq += 1
                if not live:
                    self._slots.release()
                    if stop:
                        return
                    continue
                state, error = self._prepared(live)
                with self._hcond:
                    if not self._abandoned:
                        self._ready[seq] = (live, state, error)
                        self._hcond.notify_all()
                        continue
                self._slots.release()  # close() gave up waiting: fail, never run late
                for _, fut in live:
                    fut.set_exception(BatcherClosedError("the micro-batcher closed before this request ran"))
        finally:
            with self._hcond:
                self._preparers_left -= 1
                self._hcond.notify_all()

    def _run_loop(self) -> None:
        """The run thread of the pipeline: the prepared batches in sequence order."""
        seq = 0
        while True:
            with self._hcond:
                while seq not in self._ready:
                    if self._abandoned or (self._preparers_left == 0 and seq >= self._next_seq):
                        return
                    self._hcond.wait()
                live, state, error = self._ready.pop(seq)
            seq += 1
            try:
                self._finish(live, state, error)
            finally:
                if self._next_seq > seq:  # a later batch was taken before this run ended
                    with self._stats_lock:
                        self.overlapped += 1
                self._slots.release()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, finish the queued ones, stop the workers (idempotent).

        A submit racing with close either gets queued before it (and is finished) or
        raises :class:`BatcherClosedError`. When the workers did not finish within
        ``timeout`` seconds, every request not yet running its last stage (queued,
        or prepared and waiting for the run thread) gets :class:`BatcherClosedError`
        now, and a batch whose prepare stage ends later gets it then."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = any(t.is_alive() for t in threads)
        left: list = []
        with self._cond:
            if stuck or not threads:
                left = list(self._queue)
                self._queue.clear()
        if stuck:
            with self._hcond:
                self._abandoned = True
                for seq in sorted(self._ready):
                    live, _, _ = self._ready.pop(seq)
                    left.extend(live)
                self._hcond.notify_all()
        for _, fut in left:
            if fut.running() or fut.set_running_or_notify_cancel():
                fut.set_exception(BatcherClosedError("the micro-batcher closed before this request ran"))

    # ------------------------------------------------------------------ stats
    @property
    def queue_depth(self) -> int:
        """Requests waiting now (cancelled ones are not counted: they left the queue)."""
        return len(self._queue)

    def stats(self) -> dict[str, Any]:
        """{"batches", "requests", "mean_batch", "largest_batch", "queue_depth",
        "rejected", "timeouts", "max_batch", "max_wait_ms", "max_queue", "pipeline"
        (bool: two stages on different threads), "workers" (prepare threads),
        "prepare_seconds" / "run_seconds" (wall time summed over batches of each
        stage), "overlapped" (runs before whose end a later batch had been taken from
        the queue: its prepare stage overlapped the run)}."""
        with self._stats_lock:
            return {
                "batches": self.batches,
                "requests": self.requests,
                "mean_batch": self.requests / self.batches if self.batches else 0.0,
                "largest_batch": self.largest_batch,
                "queue_depth": self.queue_depth,
                "rejected": self.rejected,
                "timeouts": self.timeouts,
                "max_batch": self.max_batch,
                "max_wait_ms": self.max_wait * 1000.0,
                "max_queue": self.max_queue,
                "pipeline": self.pipelined,
                "workers": self.workers,
                "prepare_seconds": self.prepare_seconds,
                "run_seconds": self.run_seconds,
                "overlapped": self.overlapped,
            }


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number > 0 (seconds) or None, got {timeout!r}")
    return float(timeout)
