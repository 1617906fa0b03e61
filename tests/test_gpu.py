"""GPU tests: run by ``bench/gpu_check.py`` on a lent GPU (``pytest -m gpu``).

Every test here is marked ``gpu`` and skips cleanly without CUDA, so CI collects them and
they cannot rot at import time; ``bench/gpu_check.py --dry-run`` (tests/test_gpu_check_dryrun.py)
runs the same command on the CPU.

* the triton, cuda and torch-on-CUDA backends against the authors' golden PersonaBench
  values: ids of every mode and the routes, 263 / 263 (the golden file and embeddings
  come from ``../shared`` or from the pack of ``gpu_check.py --prepare``, $RFMEM_PB_PACK);
* the same backends against the reference backend (CPU) on random property cases
  (segment lengths 0, 1, < k, longer than a tile; duplicated rows: exact ties);
* device-resident batches: CUDA queries in, tensors out on the same device, the same
  results as the numpy path, and the host-synchronisation budget measured with
  ``torch.cuda.set_sync_debug_mode``; the bank-size refusal on a real device.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _shared import paused_backend
from hypothesis import given, settings
from hypothesis import strategies as st

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import get_backend
from rfmem_fast.backends.reference import ReferenceBackend
from rfmem_fast.backends.torch_backend import TorchBackend
from rfmem_fast.device import DeviceMemoryError, count_host_syncs
from rfmem_fast.routing.threshold import route_tensor
from rfmem_fast.search import TensorSearchResult

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_BACKENDS = ["triton", "cuda", "torch"]
GOLD_KEY = {"dense": "dense_ids", "recollection": "recollection_ids", "rfmem": "rfmem_ids"}


def gpu_backend(name: str):
    """The backend on CUDA; skipped when it is not installed here (a build failure is an error)."""
    try:
        return get_backend(name, "cuda")
    except (ValueError, ImportError) as e:
        pytest.skip(f"{name} backend not available: {e}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_golden_personabench_ids_and_routes_263_of_263(pb_embedded, backend):
    be = gpu_backend(backend)
    pb = pb_embedded
    cfg = RFMemConfig()
    assert len(pb.golden) == 263
    for mode, key in GOLD_KEY.items():
        res = search(pb.bank, pb.queries, pb.users, cfg, mode=mode, backend=be)
        bad = [i for i, g in enumerate(pb.golden) if [str(x) for x in res.ids_list(i)] != g[key]]
        assert not bad, f"{backend} {mode}: {len(bad)} of 263 questions differ from the golden ids (first {bad[:5]})"
        if mode == "rfmem":
            assert res.route_names == [g["route"] for g in pb.golden]
            np.testing.assert_allclose(res.mean, [g["mean_score"] for g in pb.golden], atol=1e-4)
            np.testing.assert_allclose(res.entropy, [g["entropy"] for g in pb.golden], atol=1e-4)
    # device-resident: CUDA queries in, tensors out, the same ids
    Qd = torch.from_numpy(pb.queries).cuda()
    out = search(pb.bank, Qd, pb.users, cfg, mode="rfmem", backend=be, output="torch")
    assert isinstance(out, TensorSearchResult) and out.rows.is_cuda and out.route.is_cuda
    host = out.to_result()
    assert [[str(x) for x in host.ids_list(i)] for i in range(263)] == [g["rfmem_ids"] for g in pb.golden]


def _random_bank(seed: int, d: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(sum(lens), d, generator=g)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    u = int(np.argmax(lens))
    if lens[u] >= 6:  # exact ties: duplicated rows in the longest segment
        a = int(off[u])
        X[a + 3] = X[a + 1]
        X[a + 5] = X[a + 1]
    return MemoryBank.from_arrays(X.numpy(), off), off, g


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@settings(max_examples=12)
@given(
    seed=st.integers(0, 10**6),
    d=st.sampled_from([3, 37, 384]),
    k=st.integers(1, 40),
    lens=st.lists(st.sampled_from([0, 1, 5, 37, 70, 300]), min_size=1, max_size=6),
)
def test_primitives_match_the_reference(backend, seed, d, k, lens):
    be = gpu_backend(backend)
    if sum(lens) == 0:
        lens = lens + [4]
    bank, off, g = _random_bank(seed, d, lens)
    U = len(lens)
    qseg = torch.randint(0, U, (17,), generator=g)
    Q = torch.nn.functional.normalize(torch.randn(17, d, generator=g), dim=1)
    X = torch.from_numpy(bank.snapshot().vectors)
    long_u = int(np.argmax(lens))
    if lens[long_u] >= 6:
        Q[0] = X[int(off[long_u]) + 1]
        qseg[0] = long_u
    ref = ReferenceBackend()
    s, r = be.segmented_topk(be.view(bank), Q.cuda(), qseg.cuda(), k)
    s2, r2 = ref.segmented_topk(ref.view(bank), Q, qseg, k)
    assert torch.equal(r.cpu(), r2), (backend, k)
    torch.testing.assert_close(s.cpu(), s2, atol=1e-5, rtol=0)
    out = be.probe(be.view(bank), Q.cuda(), qseg.cuda(), max(k, 10), 10 if k >= 10 else k, 20.0, "mean")
    cpu = TorchBackend("cpu").probe(TorchBackend("cpu").view(bank), Q, qseg, max(k, 10), 10 if k >= 10 else k, 20.0, "mean")
    assert torch.equal(out[1].cpu(), cpu[1])
    torch.testing.assert_close(out[2].cpu(), cpu[2], atol=1e-9, rtol=0)
    torch.testing.assert_close(out[3].cpu(), cpu[3], atol=1e-9, rtol=0)
    # KMeans: the problems of a recollection round (13 points, 4 clusters)
    m = 32
    V = torch.nn.functional.normalize(torch.randn(m, 13, d, generator=g), dim=2)
    counts = torch.randint(1, 14, (m,), generator=g)
    clusters = torch.minimum(torch.randint(1, 5, (m,), generator=g), counts)
    lab, cen = be.batched_kmeans(V.cuda(), counts.cuda(), clusters.cuda(), 300, 1e-4, 42)
    lab2, cen2 = TorchBackend("cpu").batched_kmeans(V, counts, clusters, 300, 1e-4, 42)
    assert torch.equal(lab.cpu(), lab2)
    torch.testing.assert_close(cen.cpu(), cen2, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("mode", ["dense", "recollection", "rfmem"])
def test_search_matches_cpu_torch_and_device_output(backend, mode):
    be = gpu_backend(backend)
    rng = np.random.default_rng(4)
    bank = MemoryBank(48)
    owners, Q = [], []
    for u in range(6):
        c = rng.normal(size=(3, 48))
        n = [3, 40, 90, 1, 200, 64][u]
        bank.add(f"u{u}", c[rng.integers(0, 3, n)] + 0.4 * rng.normal(size=(n, 48)), list(range(n)))
        for i in range(5):
            owners.append(f"u{u}")
            Q.append(c[i % 3] if i % 2 else rng.normal(size=48))
    Q = np.asarray(Q, dtype=np.float32)
    cfg = RFMemConfig(max_rounds=4, tau=0.12)
    ref = search(bank, Q, owners, cfg, mode=mode, backend="torch", device="cpu")
    res = search(bank, Q, owners, cfg, mode=mode, backend=be)
    assert res.ids.tolist() == ref.ids.tolist() and res.route.tolist() == ref.route.tolist()
    np.testing.assert_array_equal(res.scores, ref.scores)
    out = search(bank, torch.from_numpy(Q).cuda(), owners, cfg, mode=mode, backend=be, output="torch")
    for f in ("rows", "route", "rule", "rounds", "scores"):
        t = getattr(out, f)
        assert t.device.type == "cuda", f
        np.testing.assert_array_equal(t.cpu().numpy(), getattr(ref, f), err_msg=f)


def test_router_runs_on_the_device_without_a_sync():
    mean = torch.rand(1000, device="cuda")
    ent = torch.rand(1000, device="cuda") * 0.3
    count = torch.randint(0, 11, (1000,), device="cuda")
    cfg = RFMemConfig()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        r, rule = route_tensor(mean, ent, count, cfg)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    assert r.is_cuda and rule.is_cuda
    from rfmem_fast.routing.threshold import route

    r2, rule2 = route(mean.cpu().numpy(), ent.cpu().numpy(), count.cpu().numpy(), cfg)
    assert r.cpu().numpy().tolist() == r2.tolist() and rule.cpu().numpy().tolist() == rule2.tolist()


@pytest.mark.parametrize("mode", ["dense", "rfmem"])
def test_host_sync_budget_with_sync_debug_mode(mode):
    """One sync to validate the queries, one per recollection round (README "GPU"), counted by
    torch.cuda.set_sync_debug_mode("warn"); the backend primitives' own syncs are excluded."""
    rng = np.random.default_rng(8)
    bank = MemoryBank(32)
    owners = []
    for u in range(4):
        bank.add(f"u{u}", rng.normal(size=(60, 32)), list(range(60)))
        owners += [f"u{u}"] * 6
    Q = torch.from_numpy(rng.normal(size=(len(owners), 32)).astype(np.float32)).cuda()
    cfg = RFMemConfig(max_rounds=5)
    be = paused_backend(TorchBackend, "cuda")
    with count_host_syncs("cuda") as warm:  # the first call copies the bank to the device
        be.counter = warm
        search(bank, Q, owners, cfg, mode=mode, backend=be, output="torch")
    with count_host_syncs("cuda") as c:
        be.counter = c
        res = search(bank, Q, owners, cfg, mode=mode, backend=be, output="torch")
        torch.cuda.synchronize()
    assert c.method == "cuda-sync-debug-mode"
    if mode == "dense":
        assert c.count == 1, c.events
    else:
        rounds = int(res.rounds.max().item())
        assert rounds + 1 <= c.count <= 1 + cfg.max_rounds + 1, (c.count, rounds)


def test_bank_too_large_for_the_gpu_is_refused_before_allocating(monkeypatch):
    import rfmem_fast.device as device

    bank = MemoryBank(64)
    bank.add("a", np.random.default_rng(0).normal(size=(500, 64)), list(range(500)))
    free = bank.snapshot().vectors.nbytes // 3
    monkeypatch.setattr(device, "free_device_memory", lambda dev: free)
    before = torch.cuda.memory_allocated()
    with pytest.raises(DeviceMemoryError, match="free"):
        search(bank, np.ones((1, 64), np.float32), ["a"], backend="torch", device="cuda")
    assert torch.cuda.memory_allocated() == before
    monkeypatch.undo()
    real_free, _ = torch.cuda.mem_get_info()
    assert device.free_device_memory("cuda") == pytest.approx(real_free, rel=0.2)


def test_view_is_copied_once_per_version_in_the_bank_dtype():
    bank = MemoryBank(16)
    bank.add("a", np.random.default_rng(1).normal(size=(50, 16)), list(range(50)))
    be = get_backend("torch", "cuda")
    v = be.view(bank)
    assert v.X.is_cuda and v.X.dtype == torch.from_numpy(bank.snapshot().vectors).dtype
    assert be.view(bank) is v
