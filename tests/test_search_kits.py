"""The two array kits of a search chunk give the same results, field by field.

``rfmem_fast.search_chunk.run_chunk`` is the search's one implementation of a chunk; it runs
over numpy arrays (``HostKit``: a host chunk whose results go to the host, ``output="numpy"``)
or torch tensors (``DeviceKit``: ``output="torch"``, device batches). Pinned here for every
mode, every CPU backend, the thresholds of the config and a router object that sends half of
the batch each way, with and without filters, on users short and long (the native driver
prunes the rounds of the long one). The device kit leaves the dense score of a hit that only
the Recollection path found NaN unless a host step ran (no host synchronisation); the host
kit's score there must be the exact ``RN32(q . x)``, checked against a float64 oracle.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from rfmem_fast import RFMemConfig, search
from rfmem_fast import available_backends
from rfmem_fast._validate import unit_rows
from rfmem_fast.routing.base import ProbeSettings
from rfmem_fast.routing.threshold import ThresholdRouter
from test_filters import make_bank

search_mod = sys.modules["rfmem_fast.search"]

D = 24
SIZES = [1200, 90, 7, 300]  # 1200 >= the native driver's pruning size
BACKENDS = [b for b in ("native", "torch", "reference") if b in available_backends()]
if "native" in BACKENDS:  # the native kernels under the portable Python beam driver (the host path's other branch)
    BACKENDS.append("native/python-driver")
FIELDS = ("ids", "texts", "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids",
          "probe_texts", "probe_scores", "dense_scores", "lexical_scores")  # fmt: skip
CFG = RFMemConfig(out_k=8, probe_k=8, beam_width=3, max_rounds=4)


@pytest.fixture(scope="module")
def bank():
    return make_bank(5, SIZES, d=D)


def _queries(n: int, seed: int):
    rng = np.random.default_rng(seed)
    users = [f"u{j % len(SIZES)}" for j in range(n)]
    return rng.normal(size=(n, D)), users


def _backend(name):
    if name == "native/python-driver":
        from rfmem_fast.backends.native import NativeBackend

        return NativeBackend(beam_driver="python")
    return name


def _both(monkeypatch, bank, *args, **kw):
    """(host-kit result, device-kit result as a SearchResult, the unit queries) of one search."""
    if "backend" in kw:
        kw["backend"] = _backend(kw["backend"])
    host = search(bank, *args, **kw)
    device = search(bank, *args, output="torch", **kw).to_result()
    return host, device, unit_rows(args[0], "queries")  # (the queries as the search holds them)


def _assert_same(host, device, Q, bank=None):
    for f in FIELDS:
        x, y = getattr(host, f), getattr(device, f)
        assert x.shape == y.shape and x.dtype == y.dtype, f
        assert x.flags.c_contiguous, f  # (the host kit cuts columns: never a strided view)
        if x.dtype == object:
            assert x.tolist() == y.tolist(), f
        elif f == "dense_scores":  # the device kit: NaN for a hit only the Recollection path found
            unknown = np.isnan(y) & (host.rows >= 0)
            np.testing.assert_array_equal(np.where(unknown, np.nan, x), y, err_msg=f)
            qi, ci = np.nonzero(unknown)
            if qi.shape[0]:
                assert bank is not None and (host.route[qi] == 1).all()
                X = bank.snapshot().vectors[host.rows[qi, ci]].astype(np.float64)
                oracle = np.einsum("ij,ij->i", X, Q[qi].astype(np.float64)).astype(np.float32)
                np.testing.assert_array_equal(x[qi, ci], oracle)
        else:
            np.testing.assert_array_equal(x, y, err_msg=f)  # NaN equals NaN here


def _half_router(bank, Q, users):
    """A ThresholdRouter whose thresholds sit at the batch's median probe mean: about half
    of the queries recollect, the others keep the probe."""
    mean = search(bank, Q, users, CFG, mode="dense", backend="reference").mean
    m = float(np.median(mean))
    return ThresholdRouter(m, m, 0.0, probe=ProbeSettings.of(CFG))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["dense", "recollection", "rfmem"])
@pytest.mark.parametrize("filtered", [False, True])
def test_fast_path_equals_general_path(monkeypatch, bank, backend, mode, filtered):
    Q, users = _queries(24, seed=3)
    fs = [{"rank": {"$lt": 40 + 30 * (j % 4)}} if j % 3 else None for j in range(len(users))] if filtered else None
    fast, general, Q_unit = _both(monkeypatch, bank, Q, users, CFG, mode=mode, backend=backend, filters=fs)
    _assert_same(fast, general, Q_unit, bank)
    if mode == "recollection":
        assert (fast.rounds > 0).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_object_mixed_routes(monkeypatch, bank, backend):
    Q, users = _queries(32, seed=8)
    router = _half_router(bank, Q, users)
    fast, general, Q_unit = _both(monkeypatch, bank, Q, users, CFG, mode="rfmem", backend=backend, router=router)
    _assert_same(fast, general, Q_unit, bank)
    assert 0 < int(fast.route.sum()) < len(users)  # both paths taken in one chunk


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_query_and_small_chunks(monkeypatch, bank, backend):
    """One query (the latency case the fast path exists for), and a batch split in chunks."""
    Q, users = _queries(9, seed=12)
    for q, u in [(Q[:1], users[:1]), (Q[3:4], users[3:4]), (Q[2:3], users[2:3])]:  # u2: 7 items, a padded tail
        for mode in ("dense", "recollection", "rfmem"):
            _assert_same(*_both(monkeypatch, bank, q, u, CFG, mode=mode, backend=backend), bank)
    _assert_same(*_both(monkeypatch, bank, Q, users, CFG, mode="rfmem", backend=backend, max_batch=4), bank)


def test_kit_chosen_by_output(monkeypatch, bank):
    """A host search (output="numpy" on a CPU backend) runs the host kit; results kept as
    tensors (output="torch") the device kit; both through the one run_chunk."""
    chunk_mod = sys.modules["rfmem_fast.search_chunk"]
    kits = []
    real = chunk_mod.run_chunk
    monkeypatch.setattr(search_mod, "run_chunk", lambda kit, *a, **k: kits.append(type(kit).__name__) or real(kit, *a, **k))
    Q, users = _queries(4, seed=1)
    search(bank, Q, users, CFG, mode="rfmem", backend="torch")
    search(bank, Q, users, CFG, mode="rfmem", backend="torch", output="torch")
    assert kits == ["HostKit", "DeviceKit"]


def test_single_query_runs_no_torch_operation(monkeypatch, bank):
    """On the native backend with its C++ driver, a host search's single query touches no
    torch function on its way (a torch call right after a kernel's scan costs 10-20 us:
    the caches are cold), nor the torch thread setting."""
    if "native" not in available_backends():
        pytest.skip("the native backend is not built")
    import torch

    from rfmem_fast.backends.native import NativeBackend

    be = NativeBackend(num_threads=1)
    Q, users = _queries(2, seed=4)
    for mode in ("dense", "recollection", "rfmem"):
        search(bank, Q[:1], users[:1], CFG, mode=mode, backend=be)  # the view built, memos filled
    touched = []
    for name in ("from_numpy", "set_num_threads", "get_num_threads", "device", "full", "where"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _f=real, **k: touched.append(_n) or _f(*a, **k))
    for mode in ("dense", "recollection", "rfmem"):
        res = search(bank, Q[1:2], users[1:2], CFG, mode=mode, backend=be)
        assert res.rows.shape == (1, CFG.out_k)
    assert touched == []
