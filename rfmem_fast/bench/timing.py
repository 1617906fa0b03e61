"""Timing helpers of the benchmark scripts: cells that take turns call by call (or block by block).

A benchmark that times several configurations ("cells") of the same work runs them in
turn, call by call, so that a change of the machine's load (another process, a
frequency step) hits every cell alike and the ratios between cells stay fair; each cell
gets its warm-up calls first, so none pays a cold cache the others do not.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def interleaved_best(cells: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Fastest of ``reps`` calls of each ``cells[name]()``, the cells taking turns.

    Args:
        cells: name -> a callable with no argument; reps: calls per cell (int >= 1).

    Returns:
        name -> seconds (float) of the cell's fastest call, after one warm-up call each.

    Raises:
        ValueError: ``reps`` < 1.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for fn in cells.values():
        fn()
    best = {k: float("inf") for k in cells}
    for _ in range(reps):
        for k, fn in cells.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def interleaved_p50(cells: dict[str, Callable[[int], object]], n: int, reps: int = 1,
                    block: int = 1) -> dict[str, float]:  # fmt: skip
    """Median milliseconds of ``reps`` x ``n`` calls ``cells[name](i)`` (i = 0 .. n - 1),
    the cells taking turns every ``block`` calls, after 5 warm-up calls each.

    ``block`` = 1 alternates call by call (a change of load hits every cell alike, but
    each call runs right after another cell's, with that cell's data in the caches and its
    threads' state); a larger block times each cell in runs of ``block`` consecutive calls
    (queries i .. i + block - 1), as an application making one kind of call sees it, the
    cells still alternating block by block.

    Args:
        cells: name -> a callable of the call's index i (e.g. which query); n: calls per
            round (int >= 1); reps: rounds (int >= 1); block: calls of one cell in a row
            (int >= 1).

    Returns:
        name -> the median of the cell's call times in ms (float).

    Raises:
        ValueError: ``n``, ``reps`` or ``block`` < 1.
    """
    if n < 1 or reps < 1 or block < 1:
        raise ValueError(f"n, reps and block must be >= 1, got n={n}, reps={reps}, block={block}")
    for fn in cells.values():
        for i in range(5):
            fn(i % n)
    ts: dict[str, list[float]] = {k: [] for k in cells}
    for _ in range(reps):
        for i0 in range(0, n, block):
            for k, fn in cells.items():
                for i in range(i0, min(n, i0 + block)):
                    t = time.perf_counter()
                    fn(i)
                    ts[k].append((time.perf_counter() - t) * 1e3)
    return {k: float(np.median(v)) for k, v in ts.items()}
