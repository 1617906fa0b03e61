"""pytest-benchmark suite of the four primitives, for every available backend.

    python -m pytest bench/test_primitives_bench.py                       # time them
    python -m pytest bench/test_primitives_bench.py --benchmark-disable   # run each once
    RFMEM_BENCH_SMOKE=1 python -m pytest bench/test_primitives_bench.py --benchmark-disable

Primitives (DESIGN.md, "The primitives every backend provides"), each parametrised over
``rfmem_fast.available_backends()`` (the reference included):

* ``segmented_topk``: b queries, each against a random user's segment of a multi-tenant
  bank (U users x n items, d = 384), k = 10, on the float32 bank and its float16 /
  bfloat16 twins (half-precision scan copies); and a batch against one shared segment,
  for the native backend also on each forced path (scan, GEMM tiles) and bank dtype;
* ``probe``: the same top-k fused with the familiarity signals (probe_k 10, lam 20);
* ``batched_kmeans``: m KMeans problems of up to (B + R - 1) * F candidate points,
  B = 4 clusters, scikit-learn's iteration cap and tolerance, seed 42;
* ``alpha_mix``: m branch queries x B centroids.

Sizes shrink under ``RFMEM_BENCH_SMOKE=1`` (what tests/test_bench_smoke.py runs, so that
the suite cannot rot). CI's test command does not collect this folder.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rfmem_fast import available_backends, get_backend
from rfmem_fast.bench.workloads import SyntheticSpec, synthetic_bank
from rfmem_fast.config import RFMemConfig

SMOKE = os.environ.get("RFMEM_BENCH_SMOKE", "") not in ("", "0")
D = 384
USERS, ITEMS, QUERIES = (4, 128, 16) if SMOKE else (64, 4096, 256)
SHARED_ITEMS, SHARED_QUERIES = (2000, 8) if SMOKE else (100_000, 64)
PROBLEMS = 16 if SMOKE else 256
CFG = RFMemConfig()
BACKENDS = available_backends()
DTYPES = ("float32", "float16", "bfloat16")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """One backend instance per available backend name."""
    return get_backend(request.param)


@pytest.fixture(scope="module")
def tenants_f32():
    """A seeded multi-tenant bank and queries (each to a random user)."""
    sb = synthetic_bank(USERS, ITEMS, SyntheticSpec(dim=D), seed=1)
    Q, qseg, _ = sb.queries(QUERIES, seed=2)
    return sb.bank, Q, qseg


@pytest.fixture(scope="module", params=DTYPES)
def tenants(request, tenants_f32):
    """The multi-tenant bank as a float32, float16 and bfloat16 bank (same rows)."""
    bank, Q, qseg = tenants_f32
    return bank.astype(request.param), Q, qseg


@pytest.fixture(scope="module")
def shared_f32():
    """A seeded one-user bank of SHARED_ITEMS vectors and a batch of queries."""
    sb = synthetic_bank(1, SHARED_ITEMS, SyntheticSpec(dim=D), seed=3, clusters=max(8, SHARED_ITEMS // 512))
    Q, qseg, _ = sb.queries(SHARED_QUERIES, seed=4)
    return sb.bank, Q, qseg


@pytest.fixture(scope="module", params=("float32", "float16"))
def shared(request, shared_f32):
    """The shared bank as a float32 and a float16 bank."""
    bank, Q, qseg = shared_f32
    return bank.astype(request.param), Q, qseg


def _on(backend, Q, qseg):
    dev = backend.device
    return torch.from_numpy(Q).to(dev), torch.from_numpy(qseg).to(dev)


def _kmeans_inputs(dev: torch.device):
    rng = np.random.default_rng(5)
    n = CFG.max_candidates()
    counts = rng.integers(CFG.beam_width, n + 1, PROBLEMS)
    V = rng.standard_normal((PROBLEMS, n, D), dtype=np.float32)
    V /= np.linalg.norm(V, axis=2, keepdims=True)
    V[np.arange(n)[None, :] >= counts[:, None]] = 0.0
    clusters = np.minimum(counts, CFG.beam_width)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    return t(V), t(counts.astype(np.int64)), t(clusters.astype(np.int64))



def _bench_synced(benchmark, device, fn, *args):
    """``benchmark`` one call of ``fn(*args)``, waiting for the device before the clock stops."""

    def call():
        out = fn(*args)
        _sync(device)
        return out

    return benchmark(call)

@pytest.mark.benchmark(group="segmented_topk multi-tenant")
def test_segmented_topk_multitenant(benchmark, backend, tenants):
    bank, Q, qseg = tenants
    if bank.dtype != "float32" and not backend.scans_half:
        pytest.skip(f"{backend.name} scans the float32 rows of every bank")
    view = backend.view(bank)
    q, s = _on(backend, Q, qseg)

    scores, rows = _bench_synced(benchmark, backend.device, backend.segmented_topk, view, q, s, CFG.out_k)
    assert tuple(scores.shape) == (QUERIES, CFG.out_k) and tuple(rows.shape) == (QUERIES, CFG.out_k)


@pytest.mark.benchmark(group="segmented_topk shared")
def test_segmented_topk_shared(benchmark, backend, shared):
    bank, Q, qseg = shared
    if bank.dtype != "float32" and not backend.scans_half:
        pytest.skip(f"{backend.name} scans the float32 rows of every bank")
    view = backend.view(bank)
    q, s = _on(backend, Q, qseg)

    scores, rows = _bench_synced(benchmark, backend.device, backend.segmented_topk, view, q, s, CFG.out_k)
    assert tuple(rows.shape) == (SHARED_QUERIES, CFG.out_k)


@pytest.mark.skipif("native" not in BACKENDS, reason="native backend not built")
@pytest.mark.parametrize("path", ["scan", "gemm"])
@pytest.mark.benchmark(group="segmented_topk shared, native paths")
def test_segmented_topk_shared_native_path(benchmark, path, shared):
    """The native kernel on each forced path (the cost rule picks GEMM for this batch)."""
    from rfmem_fast.backends.native import NativeBackend

    bank, Q, qseg = shared
    be = NativeBackend(topk_path=path)
    view = be.view(bank)
    q, s = _on(be, Q, qseg)

    scores, rows = benchmark(be.segmented_topk, view, q, s, CFG.out_k)
    auto = NativeBackend().segmented_topk(view, q, s, CFG.out_k)
    assert torch.equal(rows, auto[1]) and torch.equal(scores, auto[0])


@pytest.mark.benchmark(group="probe multi-tenant")
def test_probe(benchmark, backend, tenants_f32):
    bank, Q, qseg = tenants_f32
    view = backend.view(bank)
    q, s = _on(backend, Q, qseg)

    scores, rows, mean, ent, count = _bench_synced(benchmark, backend.device, backend.probe, view, q, s, CFG.out_k, CFG.probe_k, CFG.temperature, CFG.entropy)
    assert tuple(mean.shape) == (QUERIES,) and bool((count == CFG.probe_k).all())


@pytest.mark.benchmark(group="batched_kmeans")
def test_batched_kmeans(benchmark, backend):
    V, counts, clusters = _kmeans_inputs(backend.device)

    labels, cents = _bench_synced(benchmark, backend.device, backend.batched_kmeans, V, counts, clusters, CFG.kmeans_iters, CFG.kmeans_tol, CFG.kmeans_seed)
    assert tuple(labels.shape) == tuple(V.shape[:2])
    assert int(labels.max()) < CFG.beam_width


@pytest.mark.benchmark(group="alpha_mix")
def test_alpha_mix(benchmark, backend):
    dev = backend.device
    g = torch.Generator().manual_seed(6)
    qb = torch.nn.functional.normalize(torch.randn(PROBLEMS, D, generator=g), dim=1).to(dev)
    q0 = torch.nn.functional.normalize(torch.randn(PROBLEMS, D, generator=g), dim=1).to(dev)
    cents = torch.randn(PROBLEMS, CFG.beam_width, D, generator=g).to(dev)

    out = _bench_synced(benchmark, dev, backend.alpha_mix, qb, cents, q0, CFG.alpha)
    assert tuple(out.shape) == (PROBLEMS, CFG.beam_width, D)
    assert torch.allclose(out.norm(dim=2).cpu(), torch.ones(PROBLEMS, CFG.beam_width), atol=1e-4)
