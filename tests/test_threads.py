"""Thread defaults safe for a serving process (issue 8, item 5).

Pinned: the thread setting's precedence (set_num_threads > RFMEM_NUM_THREADS > torch)
and its validation; the native kernels use one thread for a small call and more only
when the work pays (the same rule in C++ and Python), start their threads per call and
leave none behind (nothing can spin between calls); results do not depend on the
thread count; a small search runs with one torch thread and restores the caller's
setting, without touching the environment. Latency under contention is measured by
bench/bench_contention.py, not here.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import rfmem_fast
from rfmem_fast import MemoryBank, search
from rfmem_fast import threads as th
from rfmem_fast.backends import available

NATIVE = "native" in available()


@pytest.fixture(autouse=True)
def _reset():
    yield
    th.set_num_threads(None)


def test_precedence_and_validation(monkeypatch):
    monkeypatch.delenv(th.ENV_VAR, raising=False)
    assert th.get_num_threads() == max(1, torch.get_num_threads())
    monkeypatch.setenv(th.ENV_VAR, "3")
    assert th.get_num_threads() == 3
    th.set_num_threads(1)
    assert th.get_num_threads() == 1  # the call wins over the variable
    th.set_num_threads(None)
    assert th.get_num_threads() == 3
    monkeypatch.setenv(th.ENV_VAR, "zero")
    with pytest.raises(ValueError, match="RFMEM_NUM_THREADS must be an int >= 1, got 'zero'"):
        th.get_num_threads()
    with pytest.raises(ValueError, match="n must be >= 1"):
        th.set_num_threads(0)
    with pytest.raises(TypeError, match="n must be an int"):
        th.set_num_threads(2.0)
    assert rfmem_fast.set_num_threads is th.set_num_threads


def test_work_threshold():
    assert th.threads_for_work(4096 * 384, limit=16) == 1  # one query over a 1M-token memory
    assert th.threads_for_work(64 * 4096 * 384, limit=16) == 16
    assert th.threads_for_work(10 * th.MIN_WORK_PER_THREAD, limit=2) == 2
    if NATIVE:
        from rfmem_fast import _native

        assert _native.MIN_WORK_PER_THREAD == th.MIN_WORK_PER_THREAD
        assert _native.threads_for(16, 4096 * 384, 1 << 40) == 1
        assert _native.threads_for(16, 64 * 4096 * 384, 1 << 40) == 16
        assert _native.threads_for(16, 64 * 4096 * 384, 3) == 3  # never more than the items
        assert _native.threads_for(0, 1e12, 1 << 40) == _native.max_threads()


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not NATIVE or not Path("/proc/self/task").exists(), reason="native + Linux /proc")
def test_native_threads_live_for_one_call_and_results_do_not_depend_on_them():
    from rfmem_fast.backends.native import NativeBackend

    rng = np.random.default_rng(0)
    bank = MemoryBank.from_arrays(rng.normal(size=(20000, 64)).astype(np.float32), [0, 12000, 20000])
    Q = torch.from_numpy(rng.normal(size=(40, 64)).astype(np.float32))
    qseg = torch.from_numpy(rng.integers(0, 2, size=40))
    one, four = NativeBackend(num_threads=1), NativeBackend(num_threads=4)
    view = one.view(bank)
    base = _task_count()
    s1, r1 = one.segmented_topk(view, Q, qseg, 10)
    s4, r4 = four.segmented_topk(view, Q, qseg, 10)  # 4 groups x 2 row parts on 4 threads
    s4b, r4b = four.segmented_topk(view, Q[:1], qseg[:1], 10)  # one query: one thread
    assert _task_count() == base  # every thread was joined: nothing left to spin
    assert torch.equal(r1, r4) and torch.equal(s1, s4)
    assert torch.equal(r4b, r1[:1]) and torch.equal(s4b, s1[:1])
    th.set_num_threads(1)
    assert NativeBackend()._threads() == 1


def test_small_search_runs_with_one_torch_thread_and_restores_it(monkeypatch):
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    env = dict(os.environ)
    prev = torch.get_num_threads()
    try:
        real(2)
        bank = MemoryBank(8)
        bank.add("a", np.random.default_rng(0).normal(size=(30, 8)), ids=list(range(30)))
        search(bank, np.ones((1, 8)), ["a"], mode="rfmem", backend="torch")
        assert seen == [1, 2]  # one thread inside, the caller's two restored
        assert torch.get_num_threads() == 2
        with th.limit_torch_threads(1e12) as n:  # big work: untouched
            assert n == 2
        with th.limit_torch_threads(10.0, "cuda") as n:  # not the CPU: untouched
            assert n == 2
    finally:
        real(prev)
    assert dict(os.environ) == env  # no environment variable was set
