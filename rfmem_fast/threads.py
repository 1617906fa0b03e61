"""Threads of rfmem_fast's CPU kernels: safe defaults for a serving process (docs/internals/threads.md).

The native backend's kernels (csrc/cpu) run their parallel regions on a small pool of
helper threads that sleep on a condition variable between regions (nothing spins
between calls), and a call uses more than one thread only when its work pays for it:
at least :data:`MIN_WORK_PER_THREAD` multiply-adds per thread (0.5 million, ~10-30 us
of a core: one query over a 4,096 x 384 memory is split over 2 threads), only for the
cores that were idle at the last sample of the machine's running tasks (so with
CPU-bound processes on every core a call runs on its own thread), and only when no
other call of this process holds the pool. The caller never waits for a helper to be
scheduled. One rule for every native kernel and every entry point
(``_native.threads_for``, ``_native.set_thread_pool``). The number below is the most
threads one call may use:

1. :func:`set_num_threads` (this process, rfmem_fast's kernels only), else
2. the environment variable ``RFMEM_NUM_THREADS`` (read at each call), else
3. ``torch.get_num_threads()`` (which follows ``OMP_NUM_THREADS`` and
   ``torch.set_num_threads``), as the caller set it: inside :func:`limit_torch_threads`
   (a small ``search`` chunk runs torch on one thread) the native kernels keep the
   caller's count, so a single query can still use an idle core.

``NativeBackend(num_threads=n)`` fixes it per backend instance. Nothing here changes
an environment variable.

torch's intra-op pool (OpenMP + MKL) serves the torch backend and the tensor
operations of the beam driver on every backend. Its threads busy-wait after each
parallel region and a region waits for all of them, so on a busy machine a small call
that opens regions (a 4,096 x 384 matmul, the beam driver's batched Gram matrices)
becomes 10-100x slower. :func:`search` therefore runs a chunk whose scan work is below
``2 * TORCH_MIN_WORK_PER_THREAD`` multiply-adds with ONE torch thread
(:func:`limit_torch_threads`): ``torch.set_num_threads`` applies to the calling thread
(its OpenMP and MKL settings) and is restored on exit, so other threads keep theirs;
a thread that makes its first torch call during that window starts with one thread
(torch copies a process-wide default into new threads). Big batches keep torch's
threads. A serving process that runs big torch batches on a shared machine can set
``OMP_WAIT_POLICY=passive`` itself before it starts (read once by the OpenMP runtime).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from ._validate import check_positive_int

#: the environment variable read at each call when set_num_threads was not called
ENV_VAR = "RFMEM_NUM_THREADS"
#: multiply-adds a thread must get before a native kernel call uses it (csrc/cpu/common.h
#: kMinWorkPerThread, ``_native.MIN_WORK_PER_THREAD``)
MIN_WORK_PER_THREAD = 500_000
#: the same for torch's intra-op threads (:func:`limit_torch_threads`): OpenMP's threads
#: busy-wait after each region, so torch gets threads only for much larger work
TORCH_MIN_WORK_PER_THREAD = 4_000_000

_LOCK = threading.Lock()
_SETTING: list[int | None] = [None]
# per thread: torch's thread count before limit_torch_threads lowered it (the caller's
# setting, which the native kernels keep following inside the block)
_OUTER = threading.local()


def set_num_threads(n: int | None) -> None:
    """Set the most threads one rfmem_fast kernel call may use, for this process.

    Args:
        n: int >= 1, or None to go back to the default (``RFMEM_NUM_THREADS``, else
            ``torch.get_num_threads()``).

    Raises:
        TypeError: ``n`` is not an int (or None).
        ValueError: ``n`` < 1.
    """
    value = None if n is None else check_positive_int(n, "n")
    with _LOCK:
        _SETTING[0] = value


@contextmanager
def using_num_threads(n: int | None) -> Iterator[None]:
    """Run a block with :func:`set_num_threads` ``(n)`` and restore the previous setting
    (explicit or unset) afterwards. Process-wide, like :func:`set_num_threads`.

    Raises:
        TypeError / ValueError: as :func:`set_num_threads`.
    """
    value = None if n is None else check_positive_int(n, "n")
    with _LOCK:
        prev = _SETTING[0]
        _SETTING[0] = value
    try:
        yield
    finally:
        with _LOCK:
            _SETTING[0] = prev


def get_num_threads() -> int:
    """The most threads one native kernel call may use now (see the module docstring).

    Returns:
        int >= 1.

    Raises:
        ValueError: ``RFMEM_NUM_THREADS`` is set but is not an int >= 1 (the message
            names the variable).
    """
    value = _SETTING[0]
    if value is not None:
        return value
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            return check_positive_int(int(env), ENV_VAR)
        except (TypeError, ValueError):
            raise ValueError(f"{ENV_VAR} must be an int >= 1, got {env!r}") from None
    outer = getattr(_OUTER, "value", None)  # inside limit_torch_threads: the caller's torch setting
    return max(1, outer if outer is not None else torch.get_num_threads())


def threads_for_work(work: float, limit: int | None = None, per_thread: float = MIN_WORK_PER_THREAD) -> int:
    """Threads worth using for ``work`` multiply-adds: at most one per ``per_thread``
    (default :data:`MIN_WORK_PER_THREAD`, the native kernels' rule, as
    ``_native.threads_for``), at most ``limit`` (default :func:`get_num_threads`), >= 1."""
    cap = get_num_threads() if limit is None else int(limit)
    return max(1, min(cap, int(work // per_thread)))


@contextmanager
def limit_torch_threads(work: float, device: torch.device | str = "cpu") -> Iterator[int]:
    """Run a block with the torch intra-op threads its ``work`` pays for (CPU only).

    Below ``2 * TORCH_MIN_WORK_PER_THREAD`` multiply-adds the block runs with one torch
    thread; the calling thread's setting is restored on exit (see the module docstring
    for what this does and does not touch). On a non-CPU device, or when the work pays
    for the current threads, nothing changes.

    Args:
        work: multiply-adds of the block (an estimate).
        device: where the block's tensors live.

    Yields:
        the number of torch threads in effect inside the block.
    """
    prev = torch.get_num_threads()
    want = threads_for_work(work, prev, TORCH_MIN_WORK_PER_THREAD)
    if torch.device(device).type != "cpu" or want >= prev:
        yield prev
        return
    outer = getattr(_OUTER, "value", None)
    _OUTER.value = prev if outer is None else outer
    torch.set_num_threads(want)
    try:
        yield want
    finally:
        torch.set_num_threads(prev)
        _OUTER.value = outer


__all__ = [
    "ENV_VAR",
    "MIN_WORK_PER_THREAD",
    "TORCH_MIN_WORK_PER_THREAD",
    "get_num_threads",
    "limit_torch_threads",
    "set_num_threads",
    "threads_for_work",
    "using_num_threads",
]
