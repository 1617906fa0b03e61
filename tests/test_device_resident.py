"""Device-resident batches, checked on the CPU with the same code path.

* ``search(..., output="torch")`` on torch queries equals the numpy path field by field
  (native, torch and reference backends), and ``to_result()`` gives the same ids;
* torch queries are checked where they live, with the numpy path's errors;
* the device router (:func:`rfmem_fast.routing.threshold.route_tensor`) equals the spec's router on
  every rule and exactly at the thresholds;
* a bank too large for the device's free memory is refused before any copy (the free
  memory query monkeypatched on the CPU), and the view is built once per bank version;
* the host-synchronisation budget: the beam driver makes exactly one synchronising call
  per round, and a dense search on torch queries one in all (the CPU audit of
  :func:`rfmem_fast.device.count_host_syncs`; tests/test_gpu.py checks the same budget
  with ``torch.cuda.set_sync_debug_mode`` on a GPU).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _shared import paused_backend

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available, get_backend
from rfmem_fast.backends.torch_backend import TorchBackend
from rfmem_fast.device import DeviceMemoryError, count_host_syncs, to_device, view_from_tensors
from rfmem_fast.recollection import recollect
from rfmem_fast.routing.base import RULE_NAMES
from rfmem_fast.routing.threshold import route, route_tensor
from rfmem_fast.search import TensorSearchResult, search_tensors

CFG = RFMemConfig(max_rounds=4, tau=0.12)


def clustered_bank(users=5, per=40, d=24, seed=0):
    """Users whose items gather around 3 centres, and one user with 3 items."""
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    owners, Q = [], []
    for u in range(users):
        c = rng.normal(size=(3, d))
        n = per if u else 3
        X = c[rng.integers(0, 3, n)] + 0.35 * rng.normal(size=(n, d))
        bank.add(f"u{u}", X, [f"{u}:{i}" for i in range(n)], texts=[f"t{u}:{i}" for i in range(n)])
        for i in range(4):
            owners.append(f"u{u}")
            Q.append(c[i % 3] if i % 2 else rng.normal(size=d))  # vague / unfamiliar
    return bank, np.asarray(Q, dtype=np.float32), owners


BACKENDS = [b for b in ("native", "torch", "reference") if b in available()]
FIELDS = ("rows", "scores", "route", "mean", "entropy", "rule", "rounds")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["dense", "recollection", "rfmem"])
def test_torch_output_equals_numpy_output(backend, mode):
    bank, Q, owners = clustered_bank()
    ref = search(bank, Q, owners, CFG, mode=mode, backend=backend)
    res = search(bank, torch.from_numpy(Q), owners, CFG, mode=mode, backend=backend, output="torch")
    assert isinstance(res, TensorSearchResult) and res.device == torch.device("cpu") and len(res) == len(owners)
    for f in FIELDS:
        got = getattr(res, f)
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), getattr(ref, f), err_msg=f)
    np.testing.assert_array_equal(res.probe_rows.numpy() >= 0, [[x is not None for x in r] for r in ref.probe_ids])
    np.testing.assert_array_equal(res.probe_scores.numpy(), ref.probe_scores)
    host = res.to_result()
    assert host.ids.tolist() == ref.ids.tolist() and host.texts.tolist() == ref.texts.tolist()
    assert host.probe_ids.tolist() == ref.probe_ids.tolist()
    # torch queries with the default numpy output: the same SearchResult
    again = search(bank, torch.from_numpy(Q).double(), owners, CFG, mode=mode, backend=backend)
    assert again.ids.tolist() == ref.ids.tolist()
    np.testing.assert_array_equal(again.scores, ref.scores)
    if mode == "rfmem":
        assert set(ref.route.tolist()) == {0, 1}  # both paths exercised


def test_search_tensors_on_a_view_built_from_tensors():
    bank, Q, owners = clustered_bank(seed=3)
    snap = bank.snapshot()
    be = get_backend("torch", "cpu")
    view = view_from_tensors(torch.from_numpy(snap.vectors.copy()), snap.offsets)
    qseg = torch.from_numpy(bank.segments_for(owners))
    Qn = torch.nn.functional.normalize(torch.from_numpy(Q).double(), dim=1).float()
    out = search_tensors(be, view, Qn, qseg, CFG, "rfmem", max_batch=7)  # several chunks
    ref = search(bank, Q, owners, CFG, mode="rfmem", backend="torch")
    np.testing.assert_array_equal(out.rows.numpy(), ref.rows)
    np.testing.assert_array_equal(out.route.numpy(), ref.route)
    assert out.snapshot is None
    with pytest.raises(ValueError, match="no bank snapshot"):
        out.to_result()
    with pytest.raises(ValueError, match="offsets"):
        view_from_tensors(torch.ones(3, 2), [0, 4])
    with pytest.raises(TypeError, match="floating"):
        view_from_tensors(torch.ones(3, 2, dtype=torch.int64), [0, 3])


@pytest.mark.parametrize(
    "q, exc, match",
    [
        (torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), ValueError, "NaN or Inf"),
        (torch.zeros(1, 4), ValueError, "zero norm"),
        (torch.ones(1, 4, dtype=torch.int64), TypeError, "floating"),
        (torch.ones(4), ValueError, "2-D"),
        (torch.ones(1, 5), ValueError, "dimension 4"),
        (torch.tensor([[1e300, 1.0, 1.0, 1.0]], dtype=torch.float64), ValueError, "float32 range"),
    ],
)
def test_torch_queries_are_checked_like_numpy_ones(q, exc, match):
    bank = MemoryBank(4)
    bank.add("a", np.eye(4), ["x", "y", "z", "w"])
    users = ["a"] * (q.shape[0] if q.ndim == 2 else 4)
    for output in ("torch", "numpy"):
        with pytest.raises(exc, match=match):
            search(bank, q, users, output=output, backend="torch")
    with pytest.raises(ValueError, match="output must be"):
        search(bank, torch.ones(1, 4), ["a"], output="cupy")


def test_route_tensor_equals_route():
    cfg = RFMemConfig()
    rng = np.random.default_rng(1)
    n = 400
    mean = rng.uniform(0.0, 0.8, n)
    ent = rng.uniform(0.0, 0.3, n)
    count = rng.integers(0, 11, n)
    mean[:6] = [cfg.theta_high, cfg.theta_low, np.nextafter(cfg.theta_high, 0), np.nextafter(cfg.theta_low, 1), 0.4, 0.4]
    ent[4:6] = [cfg.tau, np.nextafter(cfg.tau, 0)]
    count[6] = 0
    r_ref, rule_ref = route(mean, ent, count, cfg)
    r_t, rule_t = route_tensor(torch.from_numpy(mean), torch.from_numpy(ent), torch.from_numpy(count), cfg)
    assert r_t.dtype == torch.int64 and rule_t.dtype == torch.int64
    np.testing.assert_array_equal(r_t.numpy(), r_ref)
    np.testing.assert_array_equal(rule_t.numpy(), rule_ref)
    assert {RULE_NAMES[i] for i in rule_ref} == {"mean_high", "mean_low", "entropy_low", "entropy_high", "no_hits"}
    with pytest.raises(TypeError, match="mean"):
        route_tensor(mean, torch.from_numpy(ent), torch.from_numpy(count), cfg)


def test_bank_too_large_for_the_device_is_refused_before_copying(monkeypatch):
    import rfmem_fast.device as device

    bank, Q, owners = clustered_bank()
    need = bank.snapshot().vectors.nbytes
    asked = []

    def tiny_free(dev):
        asked.append(str(dev))
        return need // 2

    monkeypatch.setattr(device, "free_device_memory", tiny_free)
    be = TorchBackend("cpu")
    with pytest.raises(DeviceMemoryError, match=r"needs .* GiB .* only .* GiB .* free") as info:
        search(bank, Q, owners, CFG, backend=be)
    assert info.value.need_bytes >= need and info.value.free_bytes == need // 2
    assert f"{need // 2:,} bytes" in str(info.value) and "x 24 float32" in str(info.value)
    assert asked == ["cpu"] and ("view", be.name, "cpu") not in bank._cache  # nothing cached
    monkeypatch.setattr(device, "free_device_memory", lambda dev: 100 * need)
    assert search(bank, Q, owners, CFG, backend=be).ids.shape == (len(owners), CFG.out_k)


def test_view_is_built_once_per_bank_version():
    bank, Q, owners = clustered_bank()
    be = TorchBackend("cpu")
    v1 = be.view(bank)
    assert be.view(bank) is v1 and v1.X.dtype == torch.float32
    bank.add("u1", np.ones((1, 24)), ["new"])
    v2 = be.view(bank)
    assert v2 is not v1 and v2.X.shape[0] == v1.X.shape[0] + 1


def test_to_device_keeps_values():
    a = np.arange(6, dtype=np.int64)
    t = to_device(a, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == list(range(6))


def test_beam_driver_synchronises_once_per_round():
    bank, Q, owners = clustered_bank(seed=5)
    be = paused_backend(TorchBackend, "cpu")
    view = be.view(bank)
    qseg = torch.from_numpy(bank.segments_for(owners))
    q0 = torch.nn.functional.normalize(torch.from_numpy(Q), dim=1)
    cfg = RFMemConfig(max_rounds=6)
    active = torch.zeros(len(owners), dtype=torch.bool)
    active[::2] = True  # half of the batch recollects, selected on the device
    with count_host_syncs("cpu") as c:
        be.counter = c
        out = recollect(be, view, q0, qseg, cfg, active=active)
    assert c.method == "cpu-audit"
    assert set(c.events) == {"nonzero"}, c.events
    iterations = c.count
    assert int(out.rounds.max()) <= iterations <= cfg.max_rounds + 1
    assert (out.rounds[~active] == 0).all() and (out.rows[~active] == -1).all()
    # the same queries recollected alone give the same rows (the mask changes nothing)
    alone = recollect(TorchBackend("cpu"), view, q0[active], qseg[active], cfg)
    assert torch.equal(alone.rows, out.rows[active]) and torch.equal(alone.rounds, out.rounds[active])


@pytest.mark.parametrize("mode", ["dense", "rfmem"])
def test_search_on_torch_queries_sync_budget(mode):
    bank, Q, owners = clustered_bank(seed=7)
    be = paused_backend(TorchBackend, "cpu")
    with count_host_syncs("cpu") as warm:
        be.counter = warm
        search(bank, torch.from_numpy(Q), owners, CFG, mode=mode, backend=be, output="torch")
    with count_host_syncs("cpu") as c:
        be.counter = c
        res = search(bank, torch.from_numpy(Q), owners, CFG, mode=mode, backend=be, output="torch")
    # one to validate the queries, then one per recollection round of the beam driver
    assert c.events[0] == "__bool__"
    if mode == "dense":
        assert c.count == 1, c.events
    else:
        assert c.events[1:] == ["nonzero"] * (c.count - 1)
        assert int(res.rounds.max()) + 1 <= c.count <= 1 + CFG.max_rounds + 1
