"""Threads of rfmem_fast's CPU kernels: safe defaults for a serving process (README "Threads").

The native backend's kernels (csrc/cpu) start their threads for one call and join them
before returning: nothing spins between calls, and a call uses more than one thread only
when its work pays for it (about 4 million multiply-adds per thread, so one query over a
4,096 x 384 memory runs on the calling thread alone and cannot be slowed down by a busy
sibling core). The number below is the most threads one call may use:

1. :func:`set_num_threads` (this process, rfmem_fast's kernels only), else
2. the environment variable ``RFMEM_NUM_THREADS`` (read at each call), else
3. ``torch.get_num_threads()`` (which follows ``OMP_NUM_THREADS`` and
   ``torch.set_num_threads``).

``NativeBackend(num_threads=n)`` fixes it per backend instance. Nothing here changes
an environment variable or torch's settings. torch's own intra-op pool (used by the
torch backend and by the small tensor operations of the beam driver) is torch's: its
elementwise operations stay on one thread below 32,768 elements, so a single query
does not wake it; a serving process that runs big torch batches on a shared machine
can call ``torch.set_num_threads`` (and set ``OMP_WAIT_POLICY=passive`` before start)
itself.
"""
from __future__ import annotations

import os
import threading

import torch

#: the environment variable read at each call when set_num_threads was not called
ENV_VAR = "RFMEM_NUM_THREADS"

_LOCK = threading.Lock()
_SETTING: list[int | None] = [None]


def _check(n: object, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return int(n)


def set_num_threads(n: int | None) -> None:
    """Set the most threads one rfmem_fast kernel call may use, for this process.

    Args:
        n: int >= 1, or None to go back to the default (``RFMEM_NUM_THREADS``, else
            ``torch.get_num_threads()``).

    Raises:
        TypeError: ``n`` is not an int (or None).
        ValueError: ``n`` < 1.
    """
    value = None if n is None else _check(n, "n")
    with _LOCK:
        _SETTING[0] = value


def get_num_threads() -> int:
    """The most threads one kernel call may use now (see the module docstring).

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
            return _check(int(env), ENV_VAR)
        except (TypeError, ValueError):
            raise ValueError(f"{ENV_VAR} must be an int >= 1, got {env!r}") from None
    return max(1, torch.get_num_threads())


__all__ = ["ENV_VAR", "get_num_threads", "set_num_threads"]
