"""rfmem_fast.bench.timing: cells that take turns call by call (the benchmark scripts' timers)."""
from __future__ import annotations

import time

import pytest

from rfmem_fast.bench.timing import interleaved_best, interleaved_p50


def test_interleaved_best_takes_turns_and_keeps_each_cells_fastest_call():
    order: list[str] = []
    naps = {"a": [0.05, 0.0, 0.03, 0.04], "b": [0.0, 0.03, 0.01, 0.02]}  # warm-up first

    def cell(name):
        def fn():
            order.append(name)
            time.sleep(naps[name][sum(1 for o in order if o == name) - 1])
        return fn

    best = interleaved_best({"a": cell("a"), "b": cell("b")}, reps=3)
    assert order == ["a", "b"] * 4  # one warm-up each, then turns
    # b's warm-up (0 s) is not timed: its fastest timed call slept 0.01 s; a's slept 0 s
    assert best["a"] < 0.01 <= best["b"]
    with pytest.raises(ValueError, match="reps must be >= 1"):
        interleaved_best({"a": cell("a")}, reps=0)


def test_interleaved_p50_gives_each_cells_median_in_ms():
    seen: dict[str, list[int]] = {"x": [], "y": []}
    out = interleaved_p50({"x": lambda i: seen["x"].append(i), "y": lambda i: (seen["y"].append(i), time.sleep(0.002))},
                          n=3, reps=2)  # fmt: skip
    assert seen["x"] == [0, 1, 2, 3 % 3, 4 % 3] + [0, 1, 2] * 2  # 5 warm-ups, then 2 rounds of 3
    assert out["x"] < 1.0 and out["y"] >= 2.0
    with pytest.raises(ValueError, match="n, reps and block must be >= 1"):
        interleaved_p50({"x": lambda i: None}, n=0)
    with pytest.raises(ValueError, match="block=0"):
        interleaved_p50({"x": lambda i: None}, n=2, block=0)


def test_interleaved_p50_in_blocks():
    order: list[tuple[str, int]] = []
    interleaved_p50({c: (lambda i, c=c: order.append((c, i))) for c in "ab"}, n=5, reps=1, block=2)
    timed = order[10:]  # after 5 warm-up calls each
    assert timed == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("a", 3), ("b", 2), ("b", 3), ("a", 4), ("b", 4)]
