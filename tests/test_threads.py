"""Thread defaults safe for a serving process.

Pinned: the thread setting's precedence (set_num_threads > RFMEM_NUM_THREADS > torch)
and its validation; the native kernels use one thread for a small call and more only
when the work pays (the same rule in C++ and Python: 0.5 million multiply-adds per
thread, so one query over a 4,096 x 384 memory gets 2 threads), run their regions on a
pool whose helpers sleep between calls (tests/test_thread_pool.py: nothing spins, no
thread per call); results do not depend on the thread count; a small search runs with
one torch thread and restores the caller's setting, without touching the environment.
Latency under contention is measured by bench/bench_contention.py, not here.
"""
from __future__ import annotations

import os

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
    assert th.MIN_WORK_PER_THREAD == 500_000
    assert th.threads_for_work(4096 * 384, limit=16) == 3  # one query over a 1M-token memory
    assert th.threads_for_work(4096 * 384, limit=2) == 2
    assert th.threads_for_work(400_000, limit=16) == 1  # below one thread's worth
    assert th.threads_for_work(64 * 4096 * 384, limit=16) == 16
    assert th.threads_for_work(10 * th.MIN_WORK_PER_THREAD, limit=2) == 2
    # torch's threads (OpenMP busy-waits): one for anything below 2 x 4 million
    assert th.threads_for_work(4096 * 384, limit=16, per_thread=th.TORCH_MIN_WORK_PER_THREAD) == 1
    if NATIVE:
        from rfmem_fast import _native

        assert _native.MIN_WORK_PER_THREAD == th.MIN_WORK_PER_THREAD
        for work in (4e5, 4096 * 384, 4 * 4096 * 384, 64 * 4096 * 384):
            assert _native.threads_for(16, work, 1 << 40) == th.threads_for_work(work, limit=16)
        assert _native.threads_for(16, 64 * 4096 * 384, 3) == 3  # never more than the items
        assert _native.threads_for(0, 1e12, 1 << 40) == _native.max_threads()


@pytest.mark.skipif(not NATIVE, reason="native")
def test_native_results_do_not_depend_on_threads():
    from rfmem_fast import _native
    from rfmem_fast.backends.native import NativeBackend

    rng = np.random.default_rng(0)
    bank = MemoryBank.from_arrays(rng.normal(size=(20000, 64)).astype(np.float32), [0, 12000, 20000])
    Q = torch.from_numpy(rng.normal(size=(40, 64)).astype(np.float32))
    qseg = torch.from_numpy(rng.integers(0, 2, size=40))
    one, four = NativeBackend(num_threads=1), NativeBackend(num_threads=4)
    view = one.view(bank)
    s1, r1 = one.segmented_topk(view, Q, qseg, 10)
    for mode in ("always", "per-call", "auto"):
        prev = _native.set_thread_pool(mode)
        try:
            s4, r4 = four.segmented_topk(view, Q, qseg, 10)  # 4 groups x row parts on 4 threads
            s4b, r4b = four.segmented_topk(view, Q[:1], qseg[:1], 10)  # one query: its rows in parts
        finally:
            _native.set_thread_pool(prev)
        assert torch.equal(r1, r4) and torch.equal(s1, s4), mode
        assert torch.equal(r4b, r1[:1]) and torch.equal(s4b, s1[:1]), mode
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
        with th.limit_torch_threads(10.0) as n:  # small work: torch on one thread...
            assert n == 1 and torch.get_num_threads() == 1
            assert th.get_num_threads() == 2  # ...the native kernels keep the caller's count
            with th.limit_torch_threads(10.0):
                assert th.get_num_threads() == 2
            assert th.get_num_threads() == 2
        assert th.get_num_threads() == 2 and torch.get_num_threads() == 2
        with th.limit_torch_threads(1e12) as n:  # big work: untouched
            assert n == 2
        with th.limit_torch_threads(10.0, "cuda") as n:  # not the CPU: untouched
            assert n == 2
    finally:
        real(prev)
    assert dict(os.environ) == env  # no environment variable was set
