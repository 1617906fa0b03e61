"""Input checks shared by the bank and the search API (clear errors, never a crash)."""
from __future__ import annotations

from typing import Any

import numpy as np

_NORM_EPS = 1e-12


def as_float_matrix(x: Any, name: str, dim: int | None = None) -> np.ndarray:
    """Check and convert a matrix of vectors to C-contiguous float32.

    Args:
        x: array-like (numpy array, torch tensor or nested lists) of shape [n, d],
            any floating dtype (float16 / float32 / float64); non-contiguous input is
            copied.
        name: the argument's name, used in error messages.
        dim: the expected d, or None to accept any d >= 1.

    Returns:
        np.ndarray float32 [n, d], C-contiguous (a copy when the input was not already so).

    Raises:
        TypeError: non-floating dtype (int, bool, object, complex).
        ValueError: not 2-D, wrong d, or NaN / Inf values.
    """
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(
            f"{name} must hold floating-point values (float16/32/64), got dtype {arr.dtype}"
        )
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, d], got shape {tuple(arr.shape)}")
    if arr.shape[1] < 1:
        raise ValueError(f"{name} must have d >= 1 columns, got shape {tuple(arr.shape)}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{name} must have dimension {dim}, got {arr.shape[1]}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.size and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
        raise ValueError(f"{name} holds NaN or Inf (first in row {bad})")
    return arr


def l2_normalize_rows(arr: np.ndarray, name: str) -> np.ndarray:
    """L2-normalise each row of a float32 matrix (RFMEM_SPEC.md "Vectors and scores").

    Args:
        arr: float32 [n, d] with finite values.
        name: the argument's name, used in error messages.

    Returns:
        float32 [n, d], each row of unit L2 norm (a new array).

    Raises:
        ValueError: a row has zero norm (nothing to normalise).
    """
    norms = np.linalg.norm(arr.astype(np.float64), axis=1)
    if arr.shape[0] and (norms <= _NORM_EPS).any():
        bad = int(np.flatnonzero(norms <= _NORM_EPS)[0])
        raise ValueError(f"{name} row {bad} has zero norm; it cannot be L2-normalised")
    return (arr / norms[:, None]).astype(np.float32)
