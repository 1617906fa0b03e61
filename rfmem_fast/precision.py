"""Bank precision: the element type a bank's scan copy is stored and scanned in.

A :class:`~rfmem_fast.bank.MemoryBank` keeps its unit rows in float32 (the EXACT copy:
every score is ``RN32(q . x)`` of these, RFMEM_SPEC.md "Vectors and scores") and, for
``dtype="float16"`` or ``"bfloat16"``, a SCAN copy of the same rows rounded to that type
(round to nearest, ties to even). The fast kernels read only the scan copy (half the
bytes per query); the few candidates that can reach a query's top-k are re-scored from
the float32 copy, so results are exactly those of the float32 bank. The scan's error
bound gets the input-rounding term of the half type (:func:`input_terms`, used by
:mod:`rfmem_fast.backends.exact` and csrc/cpu/topk.cpp).

Storage of the scan copy: numpy ``float16`` for float16; numpy ``uint16`` holding the
upper 16 bits of the rounded float32 for bfloat16 (numpy has no bfloat16); as torch
tensors ``torch.float16`` / ``torch.bfloat16`` (:func:`scan_tensor`).

The rounding model the error bounds build on lives here too, below the backends: the
float32 unit roundoff :data:`U32`, Higham's :func:`gamma`, the underflow term
:func:`abs_error_term` and the bounds of the rows' largest norm (:func:`row_norm_max` of
float32 rows, :func:`row_norm_bound_from_scan` of a scan copy) that a bank view caches
(:class:`rfmem_fast.device.BankView`); :mod:`rfmem_fast.backends.exact` derives the scan's
bound from them (and re-exports them under their old names there).
"""
from __future__ import annotations

import math

import numpy as np
import torch

#: float32 unit roundoff (round to nearest): the rounding model of every error bound
#: (:mod:`rfmem_fast.backends.exact` builds the scan's bound on :func:`gamma`)
U32 = 2.0**-24

#: the bank dtypes (``MemoryBank(dim, dtype=...)``), the default first
BANK_DTYPES = ("float32", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")

#: (unit roundoff u_in of the rounding to the type, absolute error a of its subnormal range)
_INPUT = {"float32": (0.0, 0.0), "float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}
_NUMPY = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_dtype(dtype, name: str = "dtype") -> str:
    """The bank dtype as one of :data:`BANK_DTYPES` (str; numpy / torch dtypes accepted).

    Raises:
        ValueError: anything else (the message lists the accepted names).
    """
    if isinstance(dtype, torch.dtype):
        key = {v: k for k, v in _TORCH.items()}.get(dtype)
    elif isinstance(dtype, str):
        key = dtype if dtype in BANK_DTYPES else None
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = None
    if key not in BANK_DTYPES:
        raise ValueError(f"{name} must be one of {BANK_DTYPES}, got {dtype!r}")
    return key


def storage_dtype(dtype: str) -> np.dtype:
    """numpy dtype of a half scan copy in memory and in a store (``<f2`` / ``<u2``)."""
    return _NUMPY[dtype]


def to_scan_copy(vectors: np.ndarray, dtype: str, chunk: int = 1 << 16) -> np.ndarray:
    """The scan copy of float32 rows: each element rounded to nearest (ties to even).

    Args:
        vectors: float32 [n, d] (finite, |x| < 65504 for float16: unit rows always are).
        dtype: "float16" or "bfloat16".
        chunk: rows converted per step (bounds the temporaries).

    Returns:
        C-contiguous [n, d] of :func:`storage_dtype` (float16, or uint16 bfloat16 bits).

    Raises:
        ValueError: a value overflows float16, or ``dtype`` is not a half type.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be one of {HALF_DTYPES}, got {dtype!r}")
    n, d = vectors.shape
    out = np.empty((n, d), dtype=_NUMPY[dtype])
    for a in range(0, n, chunk):
        part = vectors[a : a + chunk]
        if dtype == "float16":
            if part.size and float(np.abs(part).max()) >= 65504.0:
                raise ValueError("vectors hold values beyond the float16 range (|x| >= 65504)")
            out[a : a + chunk] = part.astype(np.float16)
        else:  # torch rounds float32 -> bfloat16 to nearest even
            t = torch.from_numpy(np.ascontiguousarray(part, dtype=np.float32)).to(torch.bfloat16)
            out[a : a + chunk] = t.view(torch.int16).numpy().view(np.uint16)
    return out


def scan_tensor(scan: np.ndarray, dtype: str) -> torch.Tensor:
    """A zero-copy torch view of a scan copy: ``torch.float16`` / ``torch.bfloat16`` [n, d]."""
    if dtype == "float16":
        return torch.from_numpy(scan)
    return torch.from_numpy(scan.view(np.int16)).view(torch.bfloat16)


def scan_to_float32(scan: np.ndarray, dtype: str) -> np.ndarray:
    """float32 [n, d] values of a scan copy (exact)."""
    if dtype == "float16":
        return scan.astype(np.float32)
    return (scan.astype(np.uint32) << 16).view(np.float32)


def input_terms(dtype: str, d: int) -> tuple[float, float]:
    """Input-rounding terms of a scan that reads the ``dtype`` copy of the rows.

    With ``x' = round(x)`` elementwise, ``|x'_i - x_i| <= u_in |x_i| + a`` (a: half the
    spacing of the type's subnormals), so ``||x' - x|| <= u_in ||x|| + sqrt(d) a``.

    Returns:
        (u_in, row_abs): 0, 0 for float32; (2^-11, sqrt(d) 2^-25) for float16;
        (2^-8, sqrt(d) 2^-134) for bfloat16 (``row_abs`` inflated by 2^-30).
    """
    u, a = _INPUT[dtype]
    return u, math.sqrt(d) * a * (1.0 + 2.0**-30)


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` (float; requires ``n u < 1``).

    Raises:
        ValueError: ``n u >= 1`` (no bound of this form).
    """
    nu = n * u
    if nu >= 1.0:
        raise ValueError(f"no dot-product error bound for n={n} roundings at unit roundoff {u}")
    return nu / (1.0 - nu)


def abs_error_term(d: int) -> float:
    """Absolute part of the bound: underflow of the d products and of the two roundings."""
    return (d + 2) * 2.0**-149


def row_norm_max(X: np.ndarray, chunk: int = 1 << 16) -> float:
    """An upper bound of ``max_i ||X[i]||`` (float), in bounded memory.

    The squared norms are summed in float32 (``np.einsum``, any order: computed >=
    exact * (1 - gamma_d) - d 2^-150), then inflated by that bound, so the result is >=
    the exact maximum norm.

    Args:
        X: float32 [n, d].
        chunk: rows per step.

    Returns:
        float >= 0 (0 for an empty bank).
    """
    n, d = X.shape
    m = 0.0
    for a in range(0, n, chunk):
        part = X[a : a + chunk]
        if part.shape[0]:
            m = max(m, float(np.einsum("ij,ij->i", part, part).max()))
    return math.sqrt((m + abs_error_term(d)) / (1.0 - gamma(max(d, 1), U32))) * (1.0 + 2.0**-30)


def row_norm_bound_from_scan(scan: np.ndarray, dtype: str, chunk: int = 1 << 16) -> float:
    """An upper bound of the float32 rows' largest norm, read from the scan copy only.

    ``||x|| <= (||x'|| + sqrt(d) a) / (1 - u_in)`` (:func:`input_terms`), so the float32
    copy (memory-mapped from a store, say) is not read.

    Returns:
        float >= 0.
    """
    n, d = scan.shape
    m = 0.0
    for a in range(0, n, chunk):
        part = scan_to_float32(scan[a : a + chunk], dtype)
        if part.shape[0]:
            m = max(m, row_norm_max(part))
    u, row_abs = input_terms(dtype, d)
    return (m + row_abs) / (1.0 - u) * (1.0 + 2.0**-30)


__all__ = [
    "BANK_DTYPES",
    "HALF_DTYPES",
    "U32",
    "abs_error_term",
    "check_dtype",
    "gamma",
    "input_terms",
    "row_norm_max",
    "row_norm_bound_from_scan",
    "scan_tensor",
    "scan_to_float32",
    "storage_dtype",
    "to_scan_copy",
]
