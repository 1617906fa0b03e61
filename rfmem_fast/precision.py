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

``dtype="int8"``: the scan copy is one int8 code per element with a symmetric scale per
row (:func:`int8_scan_copy`): ``s = RN32(max_i |x_i| / 127)``, ``x8_i = round(x_i / s)``
(to nearest even, clipped to [-127, 127]; all zeros when ``s`` is 0), plus three float32
per row (``scan_meta``): ``s``, an upper bound ``rho`` of the residual norm ``||x - s
x8||`` and an upper bound ``N`` of ``||x||`` (both computed in float64 and rounded up).
The native scan quantises each query to int16 and bounds every (query, row) score with
``rho`` and ``N`` (:mod:`rfmem_fast.backends.exact`, "int8 scan copies"): a quarter of
the float32 bytes plus 12 bytes per row. The other backends scan the float32 rows of an
int8 bank (same results).

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
BANK_DTYPES = ("float32", "float16", "bfloat16", "int8")
HALF_DTYPES = ("float16", "bfloat16")
#: the bank dtypes with a scan copy (the half types and int8)
SCAN_DTYPES = HALF_DTYPES + ("int8",)
#: the columns of an int8 copy's per-row data (``scan_meta``, float32 [n, 3])
INT8_META_COLUMNS = ("scale", "residual_norm", "norm")
#: largest |code| of a row of the int8 copy (symmetric: -128 is never used)
INT8_MAX = 127
#: relative slack of the stored norm bounds (covers their float64 evaluation; a stored
#: bound may be checked against a recomputation within it: :func:`int8_copy_mismatch`)
_NORM_SLACK = 1.0 + 2.0**-30

#: (unit roundoff u_in of the rounding to the type, absolute error a of its subnormal range)
_INPUT = {"float32": (0.0, 0.0), "float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}
_NUMPY = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


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
    """numpy dtype of a scan copy in memory and in a store (``<f2`` / ``<u2`` / ``|i1``)."""
    return np.dtype("|i1") if dtype == "int8" else _NUMPY[dtype]


def _norm_bounds(sq: np.ndarray, d: int) -> np.ndarray:
    """float32 upper bounds of ``sqrt`` of float64 sums of d squares (each term rounded
    at most twice: one subtraction, one product; the sum within gamma_{d+1}), rounded up."""
    v = np.sqrt(sq / (1.0 - gamma(d + 3, 2.0**-53))) * _NORM_SLACK
    f = v.astype(np.float32)
    low = f.astype(np.float64) < v
    f[low] = np.nextafter(f[low], np.float32(np.inf))
    return f


def int8_scan_copy(vectors: np.ndarray, chunk: int = 1 << 15) -> tuple[np.ndarray, np.ndarray]:
    """The int8 scan copy of float32 rows: codes and per-row data (module docstring).

    Args:
        vectors: float32 [n, d], finite.
        chunk: rows converted per step (bounds the float64 temporaries).

    Returns:
        (codes int8 [n, d], meta float32 [n, 3]) with meta[r] = (scale s, rho >= ||x - s
        x8||, N >= ||x||), C-contiguous. ``rho`` and ``N`` are proven upper bounds (float64
        sums with their error bound, rounded up to float32), whatever rounding the codes
        got: the scan's bound rests on them only.

    Raises:
        ValueError: non-finite values.
    """
    n, d = vectors.shape
    codes = np.empty((n, d), dtype=np.int8)
    meta = np.empty((n, 3), dtype=np.float32)
    for a in range(0, n, chunk):
        x = np.asarray(vectors[a : a + chunk], dtype=np.float64)
        if x.size and not np.isfinite(x).all():
            raise ValueError("vectors hold NaN or Inf: an int8 scan copy needs finite rows")
        mx = np.abs(x).max(axis=1) if d else np.zeros(x.shape[0])
        s = (mx / INT8_MAX).astype(np.float32)
        sd = s.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(sd > 0, np.rint(x / np.where(sd > 0, sd, 1.0)), 0.0)
        np.clip(t, -INT8_MAX, INT8_MAX, out=t)
        r = x - sd * t  # sd * t is exact in float64: one rounding per element
        codes[a : a + chunk] = t.astype(np.int8)
        meta[a : a + chunk, 0] = s
        meta[a : a + chunk, 1] = _norm_bounds(np.einsum("ij,ij->i", r, r), d)
        meta[a : a + chunk, 2] = _norm_bounds(np.einsum("ij,ij->i", x, x), d)
    return codes, meta


def int8_copy_mismatch(vectors: np.ndarray, codes: np.ndarray, meta: np.ndarray) -> int:
    """The first row whose stored int8 copy is not that of its float32 row, or -1.

    Codes and scales must be equal; the two norm bounds within ``2^-30`` relative of a
    recomputation (the float64 sums behind them may differ in their last bits between
    numpy builds; that slack is inside the bound's own, so such a bound still holds).

    Args:
        vectors: float32 [m, d]; codes: int8 [m, d]; meta: float32 [m, 3].
    """
    want_c, want_m = int8_scan_copy(vectors)
    bad = (want_c != codes).any(axis=1) | (want_m[:, 0].view(np.uint32) != np.asarray(meta[:, 0]).view(np.uint32))
    got = np.asarray(meta[:, 1:], dtype=np.float64)
    ref = want_m[:, 1:].astype(np.float64)
    with np.errstate(invalid="ignore"):
        bad |= ~((got >= ref * (1.0 - 2.0**-30)) & (got <= ref * _NORM_SLACK * (1.0 + 2.0**-30))).all(axis=1)
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else -1


def scan_copies(vectors: np.ndarray, dtype: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The scan copy of float32 rows for a bank of ``dtype``, and its per-row data.

    Returns:
        (None, None) for float32; (:func:`to_scan_copy`, None) for a half type;
        :func:`int8_scan_copy` for int8.
    """
    if dtype == "int8":
        return int8_scan_copy(vectors)
    if dtype in HALF_DTYPES:
        return to_scan_copy(vectors, dtype), None
    return None, None


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


def row_norm_bound_from_scan(scan: np.ndarray, dtype: str, chunk: int = 1 << 16, meta: np.ndarray | None = None) -> float:
    """An upper bound of the float32 rows' largest norm, read from the scan copy only.

    ``||x|| <= (||x'|| + sqrt(d) a) / (1 - u_in)`` (:func:`input_terms`), so the float32
    copy (memory-mapped from a store, say) is not read; for int8, the largest of the
    per-row norm bounds ``meta[:, 2]`` (``meta`` required).

    Returns:
        float >= 0.
    """
    if dtype == "int8":
        return float(meta[:, 2].max()) if meta is not None and meta.shape[0] else 0.0
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
    "INT8_MAX",
    "INT8_META_COLUMNS",
    "SCAN_DTYPES",
    "int8_copy_mismatch",
    "int8_scan_copy",
    "scan_copies",
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
