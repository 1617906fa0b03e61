"""bench/bench_fused_recollection.py: its context score of every row equals the definition
(tests/test_context.py's oracle), its signals and routes are the engine's, and its fused
beam follows the spec's loop (discovery order, no item twice, stops at out_k)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fused_recollection as b  # noqa: E402
from test_context import context_oracle  # noqa: E402

from rfmem_fast import RFMemConfig  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_context_scores_equal_the_definition(seed, r):
    rng = np.random.default_rng(seed)
    n, lo = 40, 7  # the user's rows are [lo, lo + n) of a larger snapshot
    threads = np.array([None] * lo + [rng.choice(["a", "b", "c", None]) for _ in range(n)], dtype=object)
    positions = np.concatenate([np.full(lo, -1), rng.integers(-1, 6, size=n)])  # -1: no position; ties
    snap = SimpleNamespace(threads=threads, positions=positions)
    base = rng.normal(size=n)
    got = b.context_scores(base, b.thread_order(snap, lo, lo + n), r, 0.5, 0.3)
    pos = [None if p < 0 else int(p) for p in positions[lo:]]
    want = context_oracle(base, np.arange(n), list(threads[lo:]), pos, np.ones(n, bool), 0.5, 0.3, r)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_signals_and_routes_are_the_engines():
    sc = np.array([[0.9, 0.8, 0.1], [0.3, 0.29, -np.inf], [-np.inf] * 3])
    mean, ent, cnt = b.signals(sc, 20.0)
    np.testing.assert_allclose(mean, [0.6, 0.295, 0.0])
    assert cnt.tolist() == [3, 2, 0]
    # theta_high 0.5: query 0 is familiar; query 1 recollects (mean <= theta_low 0.3); no hits: recollects
    assert b.routes(mean, ent, cnt, (0.5, 0.3, 0.2)).tolist() == [False, True, True]
    assert not b.routes(mean, ent, cnt, (-1.0, -1.0, 0.0))[:2].any()  # the recommended thresholds: never


def test_fused_beam_discovers_distinct_rows_in_order():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 8))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    q = X[0] + 0.1 * rng.normal(size=8)
    q /= np.linalg.norm(q)
    cfg = RFMemConfig(out_k=10, context_weight=0.0, thread_weight=0.0, score_floor=-1.0)
    start_rows = np.argsort(-(X @ q))[:10]
    got = b.fused_beam(X, q, np.zeros(60), [np.array([i]) for i in range(60)], cfg, (start_rows, (X @ q)[start_rows]))
    assert len(got) == 10 and len(set(got)) == 10
    assert set(got[: cfg.beam_width]) == set(start_rows[: cfg.beam_width].tolist())  # round 0: the start's top B
    # a boost that dwarfs the cosines makes the later rounds find the boosted rows first
    beta = np.zeros(60)
    beta[50:] = 10.0
    got2 = b.fused_beam(X, q, beta, [np.array([i]) for i in range(60)], cfg, (start_rows, (X @ q)[start_rows]))
    assert set(got2[cfg.beam_width :]) <= set(range(50, 60))
