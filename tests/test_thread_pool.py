"""The native kernels' thread pool (csrc/cpu/pool.h).

Pinned: a parallel region gives the same results in every pool mode ('auto', 'always',
'per-call') and thread count, alone, from several Python threads at once (one region
holds the pool, the others run alone) and in a forked child (a fresh pool); the pool's
helpers are few (at most the threads a call asked for, minus the caller), named
``rfmem-pool``, and asleep between calls: their CPU time does not grow while the
process idles (a helper spins at most HELPER_SPIN_SECONDS, 400 us, after a region, then
sleeps, and not at all after a region that followed an idle gap); the mode setting is
validated; idle_cpus() is a count of this machine's CPUs. Every expected result is the single-threaded kernel's, itself
checked against a brute-force float64 top-k.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

LINUX_PROC = Path("/proc/self/task").exists()


@pytest.fixture(autouse=True)
def _restore_mode():
    prev = _native.set_thread_pool("auto")
    yield
    _native.set_thread_pool(prev)


def _case(seed: int = 0, n: int = 24000, d: int = 64, b: int = 24):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    off = np.array([0, n // 3, n], dtype=np.int64)
    Q = rng.standard_normal((b, d)).astype(np.float32)
    seg = rng.integers(0, 2, size=b).astype(np.int64)
    return X, off, Q, seg


def _brute(X, off, Q, seg, k):
    """Top-k by float64 scores (rows ascending on ties); the bank is random, so the
    float64 order is the exact order here."""
    rows = np.empty((Q.shape[0], k), dtype=np.int64)
    for i in range(Q.shape[0]):
        a, e = off[seg[i]], off[seg[i] + 1]
        s = X[a:e].astype(np.float64) @ Q[i].astype(np.float64)
        rows[i] = a + np.lexsort((np.arange(e - a), -s))[:k]
    return rows


def test_results_equal_in_every_mode_and_thread_count():
    X, off, Q, seg = _case()
    ref_s, ref_r = _native.segmented_topk(X, off, Q, seg, 10, 1)
    np.testing.assert_array_equal(ref_r, _brute(X, off, Q, seg, 10))
    for mode in ("always", "per-call", "auto"):
        _native.set_thread_pool(mode)
        for threads in (2, 3, 4):
            for sl in (slice(0, 1), slice(0, 3), slice(None)):  # one query: its rows in parts
                s, r = _native.segmented_topk(X, off, Q[sl], seg[sl], 10, threads)
                np.testing.assert_array_equal(r, ref_r[sl], err_msg=f"{mode} {threads}")
                np.testing.assert_array_equal(s.view(np.uint32), ref_s[sl].view(np.uint32))


def test_no_spin_after_an_idle_gap():
    """A region that begins long after the previous one ended (an idle gap: 20 ms here,
    the spin window is HELPER_SPIN_SECONDS, 400 us) tells its helpers to sleep at once after it: the spin is
    for callers that call back to back (pool_counters()['spin_regions'] counts the regions
    that spin). Whether back-to-back regions spin depends on the machine's timing, so only
    the gap's side is pinned."""
    X, off, Q, seg = _case(4)
    assert 0.0 < _native.HELPER_SPIN_SECONDS <= 0.002  # (the gap below is 10x longer)
    _native.set_thread_pool("always")
    ran = 0
    for _ in range(3):
        time.sleep(0.02)
        before = _native.pool_counters()
        _native.segmented_topk(X, off, Q, seg, 10, 2)  # (its first region follows the gap)
        after = _native.pool_counters()
        regions = after["regions"] - before["regions"]
        ran += regions
        # (a call's later regions may follow its first one closely and spin: at most those)
        assert after["spin_regions"] - before["spin_regions"] <= max(0, regions - 1)
    assert ran > 0, "no call ran on the pool"


def test_a_small_call_after_an_idle_gap_runs_alone():
    """In the default mode a call of fewer than ALONE_AFTER_GAP_WORK multiply-adds that
    finds the helpers asleep after an idle gap runs on its caller alone (no region: a
    woken helper's vCPU starts late after a gap, pool.h kAloneAfterGapWork), with the
    single-threaded result (fails when such a call wakes the helpers on an idle machine)."""
    rng = np.random.default_rng(6)
    X = rng.standard_normal((6000, 384)).astype(np.float32)
    off = np.array([0, 6000], dtype=np.int64)
    q1, s1 = rng.standard_normal((1, 384)).astype(np.float32), np.zeros(1, np.int64)
    # one query over 6,000 x 384 rows: 2.3M multiply-adds, enough for two threads
    assert 2 * _native.MIN_WORK_PER_THREAD <= 6000 * 384 < _native.ALONE_AFTER_GAP_WORK
    ref_s, ref_r = _native.segmented_topk(X, off, q1, s1, 10, 1)
    prev = _native.set_thread_pool("auto")
    try:
        for _ in range(3):
            time.sleep(0.02)  # the helpers asleep, no region for 20 ms (the spin window: 400 us)
            before = _native.pool_counters()["regions"]
            s, r = _native.segmented_topk(X, off, q1, s1, 10, 2)
            assert _native.pool_counters()["regions"] == before
            np.testing.assert_array_equal(r, ref_r)
            np.testing.assert_array_equal(s.view(np.uint32), ref_s.view(np.uint32))
    finally:
        _native.set_thread_pool(prev)


def test_the_beam_driver_keeps_a_spinning_helper_awake():
    """The C++ beam driver runs one query's rounds on its caller, between that query's
    probe (a region) and the next one's: it restarts the spinning helpers' window
    (pool.h pool_keep_awake), so a helper that spins after back-to-back regions is still
    awake after more than HELPER_SPIN_SECONDS of driver calls (fails without it: the
    helper sleeps 400 us after its region on an idle machine)."""
    from rfmem_fast import RFMemConfig
    from rfmem_fast.backends.native import _driver_params

    rng = np.random.default_rng(8)
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    X = unit(rng.standard_normal((6000, 384)))  # (unit rows, their norm bound given: ~0.15 ms a call)
    off = np.array([0, 6000], dtype=np.int64)
    q1, s1 = unit(rng.standard_normal((1, 384))), np.zeros(1, np.int64)
    Xs = unit(rng.standard_normal((300, 32)))  # the driver's small user
    offs = np.array([0, 300], dtype=np.int64)
    qs = unit(rng.standard_normal((1, 32)))
    cfg = RFMemConfig()
    k0 = cfg.beam_width * cfg.fanout
    l0s, l0r = _native.segmented_topk(Xs, offs, qs, s1, k0, 1, 1.0)
    ref = _native.recollect(Xs, offs, qs, s1, l0s, l0r, *_driver_params(cfg), 1, 1.0)
    prev = _native.set_thread_pool("always")
    try:
        awake = []
        for _ in range(10):  # (a busy machine may deschedule the caller past the window)
            t_end = time.perf_counter() + 0.5
            while _native.pool_counters()["awake_helpers"] < 1 and time.perf_counter() < t_end:
                _native.segmented_topk(X, off, q1, s1, 10, 2, 1.0)  # back to back: the helper joins, then spins
            if _native.pool_counters()["awake_helpers"] < 1:
                continue  # the helper got no core in time (another job on it)
            t_end = time.perf_counter() + 3 * _native.HELPER_SPIN_SECONDS
            while time.perf_counter() < t_end:
                got = _native.recollect(Xs, offs, qs, s1, l0s, l0r, *_driver_params(cfg), 2, 1.0)
                for a, b in zip(got, ref):
                    np.testing.assert_array_equal(a, b)
            awake.append(_native.pool_counters()["awake_helpers"])
            if awake[-1] >= 1:
                break
        if not awake:
            pytest.skip("the pool's helper never got a core (a busy machine)")
        assert awake[-1] >= 1, f"helpers awake after the driver calls: {awake}"
    finally:
        _native.set_thread_pool(prev)


def test_one_query_equal_whether_the_helper_is_awake_or_asleep():
    """One query's rows are cut into parts of >= 2,048 rows while the pool's helper is
    awake (spinning after a region) and of >= 512 rows while it sleeps (topk.cpp
    kMinPartRows / kMinPartRowsAsleep): a call right after another and a call after the
    helper went to sleep split the segment differently, and both return the
    single-threaded result bit for bit."""
    X, off, Q, seg = _case(3)
    ref_s, ref_r = _native.segmented_topk(X, off, Q[:1], seg[:1], 10, 1)
    _native.set_thread_pool("always")
    for pause in (0.02, 0.0, 0.0, 0.02, 0.0):  # asleep (the 400 us spin long over), then awake
        time.sleep(pause)
        s, r = _native.segmented_topk(X, off, Q[:1], seg[:1], 10, 2)
        np.testing.assert_array_equal(r, ref_r)
        np.testing.assert_array_equal(s.view(np.uint32), ref_s.view(np.uint32))


def test_concurrent_callers_share_the_pool_and_stay_exact():
    X, off, Q, seg = _case(1)
    ref_s, ref_r = _native.segmented_topk(X, off, Q, seg, 10, 1)
    _native.set_thread_pool("always")
    before = _native.pool_counters()
    errors: list[str] = []

    def worker(j: int) -> None:
        for _ in range(15):
            s, r = _native.segmented_topk(X, off, Q, seg, 10, 2)
            if not (np.array_equal(r, ref_r) and np.array_equal(s.view(np.uint32), ref_s.view(np.uint32))):
                errors.append(f"worker {j}")

    ts = [threading.Thread(target=worker, args=(j,)) for j in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a caller never returned"
    assert errors == []
    after = _native.pool_counters()
    # every region of the 60 calls either held the pool or ran alone beside another
    assert (after["regions"] + after["inline_taken"]) - (before["regions"] + before["inline_taken"]) >= 60
    assert after["helpers"] <= max(3, before["helpers"])  # at most the most threads a call asked for, minus one


def _helper_tasks() -> list[Path]:
    return [t for t in Path("/proc/self/task").iterdir() if (t / "comm").read_text().strip() == "rfmem-pool"]


def _cpu_ticks(task: Path) -> int:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)


@pytest.mark.skipif(not LINUX_PROC, reason="Linux /proc")
def test_helpers_sleep_between_calls():
    X, off, Q, seg = _case(2)
    _native.set_thread_pool("always")
    for _ in range(5):
        _native.segmented_topk(X, off, Q, seg, 10, 2)
    helpers = _helper_tasks()
    assert 1 <= len(helpers) == _native.pool_counters()["helpers"]
    time.sleep(0.05)
    ticks = {t.name: _cpu_ticks(t) for t in helpers}
    time.sleep(0.5)  # a spinning helper would gain ~50 ticks here
    for t in helpers:
        assert (t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "S", "a helper is not asleep"
        assert _cpu_ticks(t) - ticks[t.name] <= 1, "a helper used CPU while the process was idle"


def _child(conn, X, off, Q, seg, ref_r) -> None:
    _native.set_thread_pool("always")
    s, r = _native.segmented_topk(X, off, Q, seg, 10, 2)
    conn.send(bool(np.array_equal(r, ref_r)))
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_forked_child_gets_a_working_pool():
    X, off, Q, seg = _case(3, n=6000)
    _native.set_thread_pool("always")
    _, ref_r = _native.segmented_topk(X, off, Q, seg, 10, 2)  # the parent's pool has a helper now
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child, X, off, Q, seg, ref_r))
    p.start()
    assert parent.poll(60), "the forked child hung (its pool must be fresh)"
    assert parent.recv() is True
    p.join(10)
    assert p.exitcode == 0


def test_mode_validation_and_idle_cpus():
    with pytest.raises(ValueError, match="mode must be one of"):
        _native.set_thread_pool("sometimes")
    assert _native.set_thread_pool("per-call") == "auto"
    assert _native.set_thread_pool("always") == "per-call"
    assert 0 <= _native.idle_cpus() <= (os.cpu_count() or 1)
    c = _native.pool_counters()
    assert set(c) == {
        "regions", "inline_taken", "inline_busy", "items_caller", "items_helper", "waits", "idle_samples",
        "spin_regions", "helpers", "awake_helpers",
    }


@pytest.mark.parametrize(
    "loadavg, cpus, own, want",
    [
        ("0.52 0.58 0.59 2/99 1234\n", 8, 0, 6),  # 8 CPUs, 2 running (the caller included)
        ("0.52 0.58 0.59 2/99 1234\n", 8, 1, 7),  # one of them the pool's own awake helper
        ("1.00 1.00 1.00 9/99 1234\n", 8, 0, 0),  # more running than CPUs: none idle
        ("1.00 1.00 1.00 1/99 1234\n", 2, 5, 2),  # never more than the CPUs
        ("0.00  0.00 0.00 12/300 7", 16, -3, 4),   # own < 0 counts as none; repeated blanks
        ("", 4, 0, 4),                              # unreadable: every CPU
        ("0.5 0.5 0.5 x/99 1", 4, 0, 4),
        ("0.5 0.5 0.5 3", 4, 0, 4),                 # no '/': not loadavg's form
    ],
)
def test_idle_count_formula(loadavg, cpus, own, want):
    """idle_cpus()'s formula on a given /proc/loadavg text: online CPUs minus the running
    tasks (the fourth field's count, the caller included) plus the pool's own awake helpers,
    clamped to [0, cpus]; every CPU when the text is not of loadavg's form."""
    assert _native._idle_count(loadavg, cpus, own) == want


def test_idle_count_rejects_no_cpus():
    with pytest.raises(ValueError, match="cpus must be >= 1"):
        _native._idle_count("0 0 0 1/1 1", 0)


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="needs /proc/loadavg (Linux)")
def test_idle_cpus_samples_afresh():
    """idle_cpus() samples the machine again once kIdleSampleSeconds (2 ms) have passed,
    the first call included: its very first sample once never happened (an overflowed time
    difference kept the initial 0 idle CPUs for ever, so mode 'auto' never added a helper).
    A fresh process is asked, so no earlier call has sampled; calls within one window reuse
    the sample (counted by pool_counters()['idle_samples'])."""
    code = (
        "import os, time, rfmem_fast._native as n\n"
        "cpus = os.sysconf('SC_NPROCESSORS_ONLN')\n"
        "s0 = n.pool_counters()['idle_samples']\n"
        "first = n.idle_cpus()\n"
        "s1 = n.pool_counters()['idle_samples']\n"
        "got = []\n"
        "for _ in range(5):\n"
        "    time.sleep(0.01)\n"
        "    got.append(n.idle_cpus())\n"
        "s2 = n.pool_counters()['idle_samples']\n"
        "assert all(0 <= g <= cpus for g in [first] + got), (first, got, cpus)\n"
        "print(s0, s1, s2)\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    s0, s1, s2 = map(int, out.stdout.split())
    assert (s0, s1) == (0, 1), "the first call must sample the machine"
    assert s2 == 6, "every call 10 ms after the last sample must sample again"
