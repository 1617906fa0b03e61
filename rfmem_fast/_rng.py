"""Counter-based random numbers (splitmix64) as tensor ops.

Each KMeans problem draws from its own stream keyed by (seed, round, beam slot), so a
query's result does not depend on which other queries share its batch, and every
backend can reproduce the same draws. Arithmetic is on int64 with two's-complement
wrap-around, which is what splitmix64's uint64 arithmetic gives bit for bit.
"""
from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 viewed as uint64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of ``x + golden`` (int64 in, int64 out, elementwise)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def stream_key(seed: int, round_index: int, slot: torch.Tensor) -> torch.Tensor:
    """int64 [m]: key of the stream of each problem (seed, round, beam slot)."""
    base = splitmix64(torch.tensor([seed * 1_000_003 + round_index], dtype=torch.int64))
    return splitmix64(base.to(slot.device) ^ (slot.to(torch.int64) * 0x2545F491))


def uniform(key: torch.Tensor, draw: int) -> torch.Tensor:
    """float64 [m] in [0, 1): the ``draw``-th number of each stream."""
    z = splitmix64(key + draw * 0x632BE59BD9B4E019 % (1 << 62))
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))
