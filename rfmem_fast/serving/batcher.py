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
    """Gather concurrent requests into batches run by one worker thread.

    Args:
        run_batch: ``f(items) -> results``: called with a list of 1..max_batch
            submitted items, returns a sequence of the same length; an entry that is
            an exception instance is raised to that item's caller only. If the call
            itself raises, every caller of the batch gets that exception.
        max_batch: the most items per batch (int >= 1).
        max_wait_ms: how long (ms, float >= 0) the worker waits for more requests
            after the first one of a batch arrived; requests already queued are taken
            without waiting.
        max_queue: the most requests waiting (int >= 1); beyond it, submit raises
            :class:`QueueFullError`.
        timeout: default seconds a caller waits for its result (float > 0, or None for
            no limit).
        name: the worker thread's name.

    Raises:
        ValueError / TypeError: an argument out of range or of the wrong type.

    The worker thread starts on the first submit and stops on :meth:`close`. Counters:
    :meth:`stats`.
    """

    def __init__(
        self,
        run_batch: Callable[[list], Sequence[Any]],
        max_batch: int = 64,
        max_wait_ms: float = 2.0,
        max_queue: int = 1024,
        timeout: float | None = 30.0,
        name: str = "rfmem-batcher",
    ) -> None:
        if not callable(run_batch):
            raise TypeError("run_batch must be callable")
        for arg, val in (("max_batch", max_batch), ("max_queue", max_queue)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {val!r}")
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {max_wait_ms!r}")
        _check_timeout(timeout)
        self._run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait = float(max_wait_ms) / 1000.0
        self.max_queue = max_queue
        self.timeout = timeout
        self._name = name
        # waiting (item, future) pairs; a cancelled one is removed at once (its done callback)
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats_lock = threading.Lock()
        self.batches = 0
        self.requests = 0
        self.rejected = 0
        self.timeouts = 0
        self.largest_batch = 0

    # ------------------------------------------------------------------ submitting
    def submit(self, item: Any) -> cf.Future:
        """Queue ``item``; returns a concurrent.futures.Future of its result.

        Cancelling the future before the worker takes it removes the request from the
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
            if self._thread is None:
                t = threading.Thread(target=self._loop, name=self._name, daemon=True)
                t.start()
                self._thread = t
            self._cond.notify()
        fut.add_done_callback(lambda f, e=entry: self._forget(e) if f.cancelled() else None)
        return fut

    def _forget(self, entry: tuple) -> None:
        """Drop a cancelled request from the queue (no-op once the worker took it)."""
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
            Any exception ``run_batch`` produced for this item.
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
        fut.cancel()  # dropped from the queue unless the worker already started it
        with self._stats_lock:
            self.timeouts += 1
        return RequestTimeoutError(f"no result within timeout={timeout} s (server overloaded?)")

    # ------------------------------------------------------------------ worker
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

    def _loop(self) -> None:
        while True:
            batch, stop = self._collect()
            if stop:
                return
            live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            with self._stats_lock:
                self.batches += 1
                self.requests += len(live)
                self.largest_batch = max(self.largest_batch, len(live))
            try:
                results = self._run_batch([item for item, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(live)} items")
            except BaseException as exc:  # every caller of the batch learns why
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            for (_, fut), res in zip(live, results):
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, finish the queued ones, stop the worker (idempotent).

        A submit racing with close either gets queued before it (and is finished) or
        raises :class:`BatcherClosedError`. Requests still queued when the worker did
        not finish within ``timeout`` seconds get :class:`BatcherClosedError`."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)
        with self._cond:
            left = list(self._queue) if (thread is None or thread.is_alive()) else []
            if left:
                self._queue.clear()
        for _, fut in left:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(BatcherClosedError("the micro-batcher closed before this request ran"))

    # ------------------------------------------------------------------ stats
    @property
    def queue_depth(self) -> int:
        """Requests waiting now (cancelled ones are not counted: they left the queue)."""
        return len(self._queue)

    def stats(self) -> dict[str, Any]:
        """{"batches", "requests", "mean_batch", "largest_batch", "queue_depth", "rejected", "timeouts"}."""
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
            }


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number > 0 (seconds) or None, got {timeout!r}")
    return float(timeout)
