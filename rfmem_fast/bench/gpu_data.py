"""Device data and timing of the GPU benchmark (:mod:`rfmem_fast.bench.gpu`): synthetic
multi-tenant banks and their queries drawn on the device with a seeded torch generator
(the recipe of :mod:`rfmem_fast.bench.workloads`: :func:`device_bank`,
:func:`device_queries`), and timed calls that synchronise the device before and after
(:func:`sync`, :func:`timed`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .workloads import SyntheticSpec


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


@dataclass
class DeviceBank:
    """A synthetic multi-tenant bank generated on the device.

    Attributes:
        X: [U * n, d] unit rows in the requested dtype, on the device.
        offsets: int64 numpy [U + 1].
        centres: float32 [U, C, d] unit centres.
        gen_s: seconds to generate.
    """

    X: torch.Tensor
    offsets: np.ndarray
    centres: torch.Tensor
    gen_s: float

    @property
    def nbytes(self) -> int:
        """Bytes of X."""
        return self.X.numel() * self.X.element_size()


def device_bank(
    users: int, items: int, spec: SyntheticSpec, seed: int, device: torch.device,
    dtype: torch.dtype = torch.float32, clusters: int | None = None, block_rows: int = 1 << 21,
) -> DeviceBank:  # fmt: skip
    """Clustered unit vectors drawn on ``device`` (the recipe of :mod:`rfmem_fast.bench.workloads`).

    Args:
        users, items: U users of n items each.
        spec: dimension, centres per user, spread.
        seed: torch generator seed.
        device: where to draw and keep the bank.
        dtype: storage dtype of X (drawn in float32, rounded once).
        clusters: centres per user (default ``spec.clusters``).
        block_rows: rows drawn per step (bounds the float32 temporaries).

    Returns:
        DeviceBank.
    """
    t0 = time.perf_counter()
    d, c = spec.dim, int(clusters or spec.clusters)
    g = torch.Generator(device=device).manual_seed(int(seed))
    centres = _normalise(torch.randn(users, c, d, generator=g, device=device))
    n = users * items
    X = torch.empty((n, d), dtype=dtype, device=device)
    scale = spec.spread / math.sqrt(d)
    for a in range(0, n, block_rows):
        b = min(n, a + block_rows)
        rows = torch.arange(a, b, device=device)
        lab = torch.randint(0, c, (b - a,), generator=g, device=device)
        x = centres[rows // items, lab] + scale * torch.randn(b - a, d, generator=g, device=device)
        X[a:b] = _normalise(x).to(dtype)
    offsets = np.arange(users + 1, dtype=np.int64) * items
    sync(torch.device(device))
    return DeviceBank(X=X, offsets=offsets, centres=centres, gen_s=time.perf_counter() - t0)


def device_queries(
    bank: DeviceBank, nq: int, spec: SyntheticSpec, seed: int, qseg: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries near an item (specific) or a centre (vague) of a random user, on the device.

    Returns:
        (Q float32 [nq, d] unit rows, qseg int64 [nq], specific bool [nq]).
    """
    dev = bank.X.device
    g = torch.Generator(device=dev).manual_seed(int(seed) + 0x51E5)
    U = bank.offsets.shape[0] - 1
    items = int(bank.offsets[1] - bank.offsets[0]) if U else 0
    d = bank.X.shape[1]
    if qseg is None:
        qseg = torch.randint(0, U, (nq,), generator=g, device=dev)
    specific = torch.rand(nq, generator=g, device=dev) < spec.specific_frac
    item = qseg * items + torch.randint(0, max(items, 1), (nq,), generator=g, device=dev)
    cen = torch.randint(0, bank.centres.shape[1], (nq,), generator=g, device=dev)
    lo_s, hi_s = spec.specific_noise
    lo_v, hi_v = spec.vague_noise
    u = torch.rand(nq, generator=g, device=dev)
    t = torch.where(specific, lo_s + (hi_s - lo_s) * u, lo_v + (hi_v - lo_v) * u)
    base = torch.where(specific[:, None], bank.X[item].to(torch.float32), bank.centres[qseg, cen])
    Q = _normalise(base + (t / math.sqrt(d))[:, None] * torch.randn(nq, d, generator=g, device=dev))
    return Q.contiguous(), qseg.to(torch.int64), specific
