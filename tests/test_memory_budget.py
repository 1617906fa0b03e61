"""Bounded memory on every backend and path.

Each scenario runs one ``search`` in a fresh process (:func:`rfmem_fast.bench.memory.measure`:
warm-up, peak RSS reset, one call, growth of ``VmHWM``). The budget given to the
backend (``memory_budget``, a few MiB here) is far below what the unchunked
intermediates would take (the score matrix of a long user, the gathered rows of many
users, the beam driver's per-round tensors), so a path that ignored it would grow by
~10x the allowance (measured without the chunking: 666 MB, 50 MB, 50 MB, 108 MB, 42 MB for
the cases below; with it: under 9 MB each). Scenarios: one long user (100,000 items),
many users (the per-user and the gather strategies), and recollection; torch and
native (the native kernels keep no score matrix; the beam driver around them honours
the budget). Dense results are spot-checked against the exact top-k.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rfmem_fast.backends import available
from rfmem_fast.bench.memory import measure

MIB = 1 << 20

# (scenario, backends, budget, sizes); what the unbounded intermediates would take:
CASES = [
    # 512 x 100,000 float32 scores = 205 MB (plus topk's temporaries)
    ("long_user", ["torch", "native"], 4 * MIB, dict(items=100_000, queries=512)),
    # 2,000 users of 50 items, 4,096 queries: gathered rows [4096, 50, 32] = 26 MB, ...
    ("many_users", ["torch:gather", "torch:per_user", "native"], 2 * MIB, dict(items=100_000, queries=4096, users=2000)),
    # 768 branches x 2,000 rows of scores; candidates [768, 13, 256] float32 + float64
    ("recollection", ["torch", "native"], 2 * MIB, dict(items=2000, queries=192, dim=256)),
]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("scenario,backends,budget,sizes", CASES, ids=[c[0] for c in CASES])
def test_peak_memory_stays_within_the_budget(scenario, backends, budget, sizes):
    backends = [b for b in backends if b != "native" or "native" in available()]
    for out in measure(scenario, backends, budget=budget, **sizes):
        assert out["correct"] and out["budget_bytes"] == budget, out
        # the budget (x2: a block and the merge's copy) plus a fixed allowance for the
        # allocator, the outputs and torch's own bookkeeping
        assert out["growth_bytes"] < 2 * budget + 16 * MIB, out


def test_budget_is_validated():
    from rfmem_fast.backends.reference import ReferenceBackend
    from rfmem_fast.backends.torch_backend import TorchBackend

    with pytest.raises(ValueError, match="memory_budget must be >= "):
        TorchBackend("cpu", memory_budget=1000)
    with pytest.raises(TypeError, match="memory_budget must be an int"):
        ReferenceBackend(memory_budget=1.5e9)
    assert TorchBackend("cpu", block_bytes=8 * MIB).memory_budget == 8 * MIB  # the former name
