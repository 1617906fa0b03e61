"""Input checks shared by the bank and the search API (clear errors, never a crash).

Hostile input and what it gets (each error names the argument):

* non-floating dtypes (int, bool, complex, object, str) -> TypeError;
* ragged nested lists, a scalar, a 1-D or 3-D array, d == 0, a wrong d -> ValueError;
* NaN / Inf, or finite float64 values beyond the float32 range -> ValueError;
* a row of zero norm (nothing to normalise) -> ValueError;
* torch tensors of any floating dtype (bfloat16 included), on any device, with or
  without grad, are accepted and copied to CPU float32.
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:  # the one-call normalisation (csrc/cpu/normalize.cpp); a build without the extension: numpy
    from ._native import unit_rows as _unit_rows_kernel
except ImportError:  # pragma: no cover - a build without the extension
    _unit_rows_kernel = None

_NORM_EPS = 1e-12
_F32 = np.dtype(np.float32)
#: False makes every call take the numpy expression (tests compare both); results never depend on it
USE_KERNEL = True


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as a Python int >= 1 (a count or a dimension).

    Args:
        value: a Python or numpy integer; bools are refused.
        name: the argument's name, for the error.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer (a bool, float, string, None, ...).
        ValueError: ``value`` < 1.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return int(value)


def as_float_matrix(x: Any, name: str, dim: int | None = None, check_finite: bool = True) -> np.ndarray:
    """Check and convert a matrix of vectors to C-contiguous float32.

    Args:
        x: array-like (numpy array, torch tensor or nested lists) of shape [n, d],
            any floating dtype (float16 / float32 / float64); non-contiguous input is
            copied.
        name: the argument's name, used in error messages.
        dim: the expected d, or None to accept any d >= 1.
        check_finite: False skips the NaN / Inf check (for a caller that checks the
            values otherwise: :func:`unit_rows`).

    Returns:
        np.ndarray float32 [n, d], C-contiguous (a copy when the input was not already so).

    Raises:
        TypeError: non-floating dtype (int, bool, object, complex, str).
        ValueError: not convertible to an array (ragged), not 2-D, d == 0, wrong d,
            NaN / Inf values, or values that overflow float32.
    """
    if not isinstance(x, np.ndarray) and hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
        x = x.detach().cpu()
        if getattr(x, "is_floating_point", lambda: False)() and x.element_size() < 4:
            x = x.float()  # bfloat16 has no numpy dtype; float16 widens exactly
        x = x.numpy()
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged nested lists and the like
        raise ValueError(f"{name} must be a 2-D array [n, d] of floats: {exc}") from None
    if arr.dtype.kind != "f":  # np.issubdtype(dtype, np.floating), without its overhead
        raise TypeError(
            f"{name} must hold floating-point values (float16/32/64), got dtype {arr.dtype}"
        )
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, d], got shape {tuple(arr.shape)}")
    if arr.shape[1] < 1:
        raise ValueError(f"{name} must have d >= 1 columns, got shape {tuple(arr.shape)}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{name} must have dimension {dim}, got {arr.shape[1]}")
    src = arr
    if arr.dtype == _F32:  # nothing to narrow: no overflow to silence
        arr = np.ascontiguousarray(arr)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            arr = np.ascontiguousarray(arr, dtype=np.float32)
    if check_finite and arr.size and not np.isfinite(arr).all():
        bad_rows = ~np.isfinite(arr).all(axis=1)
        bad = int(np.flatnonzero(bad_rows)[0])
        if src.dtype.itemsize > 4 and np.isfinite(src[bad]).all():
            raise ValueError(
                f"{name} row {bad} holds values beyond the float32 range (|x| > 3.4e38); scale it down"
            )
        raise ValueError(f"{name} holds NaN or Inf (first in row {bad})")
    return arr


def l2_normalize_rows(arr: np.ndarray, name: str) -> np.ndarray:
    """L2-normalise each row of a float32 matrix (RFMEM_SPEC.md "Vectors and scores").

    Each row is divided by its L2 norm in float64 and rounded once to float32; the norm
    is the square root of the float64 squares summed in numpy's pairwise order (the
    native kernel ``_native.unit_rows``, bit for bit the numpy expression of
    :func:`_normalized` in one call).

    Args:
        arr: float32 [n, d] with finite values.
        name: the argument's name, used in error messages.

    Returns:
        float32 [n, d], each row of unit L2 norm (a new array).

    Raises:
        ValueError: a row has zero norm, i.e. L2 norm <= 1e-12 (nothing to normalise), or
            (outside the contract) holds NaN / Inf: the message says which, and the row.
    """
    out, bad = _normalized(np.ascontiguousarray(arr, dtype=np.float32))
    if bad >= 0:
        if not np.isfinite(arr[bad]).all():  # (outside the contract: say what it is)
            raise ValueError(f"{name} holds NaN or Inf (first in row {bad})")
        raise _zero_norm(name, bad)
    return out


def unit_rows(x: Any, name: str, dim: int | None = None) -> np.ndarray:
    """:func:`as_float_matrix` then :func:`l2_normalize_rows`: the same result and the same
    errors (NaN / Inf before a zero norm), with ONE check of the rows' norms for both (a
    row is finite and nonzero iff its float64 norm is in (1e-12, inf): the squares of
    float32 values cannot overflow float64), where the two passes check the values and
    then the norms. One native call after the conversion (a single query's checks cost a
    few numpy calls less: each is several microseconds with the caches cold after a scan).

    Args:
        x, name, dim: as :func:`as_float_matrix`.

    Returns:
        float32 [n, d] unit rows (a new array).

    Raises:
        TypeError / ValueError: as :func:`as_float_matrix` and :func:`l2_normalize_rows`.
    """
    arr = as_float_matrix(x, name, dim, check_finite=False)
    out, bad = _normalized(arr)
    if bad >= 0:
        as_float_matrix(x, name, dim)  # raises its error for NaN / Inf values (in any row)
        raise _zero_norm(name, bad)
    return out


def _zero_norm(name: str, row: int) -> ValueError:
    """The error for row ``row`` of ``name`` whose L2 norm is <= 1e-12."""
    return ValueError(f"{name} row {row} has zero norm (<= {_NORM_EPS:g}); it cannot be L2-normalised")


def _normalized(arr: np.ndarray) -> tuple[np.ndarray, int]:
    """(``arr`` [n, d] float32 C-contiguous divided by its rows' L2 norms, float32 [n, d];
    -1, or the first row whose norm is not in (1e-12, inf): the rows are then unusable).
    The native kernel when built (and :data:`USE_KERNEL`), else its numpy expression
    ``(arr / np.sqrt(np.add.reduce(np.square(arr, dtype=np.float64), axis=1,
    keepdims=True))).astype(np.float32)``: the same bits (the kernel sums the squares in
    numpy's pairwise order)."""
    if _unit_rows_kernel is not None and USE_KERNEL:
        return _unit_rows_kernel(arr, _NORM_EPS)
    norms = np.sqrt(np.add.reduce(np.square(arr, dtype=np.float64), axis=1, keepdims=True))
    bad = np.flatnonzero(~((norms > _NORM_EPS) & (norms < np.inf)))  # (NaN fails both)
    if bad.size:
        return arr, int(bad[0])
    return (arr / norms).astype(np.float32), -1
