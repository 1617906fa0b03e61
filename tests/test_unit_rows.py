"""The one-call normalisation of query and item vectors (``_native.unit_rows``, used by
rfmem_fast._validate) equals its numpy expression bit for bit, and keeps the errors."""
from __future__ import annotations

import numpy as np
import pytest

from rfmem_fast import _validate

kernel = pytest.importorskip("rfmem_fast._native").unit_rows


def _numpy(x: np.ndarray) -> np.ndarray:
    """The independent reference: numpy's float64 norms (pairwise sums) and division."""
    norms = np.sqrt(np.add.reduce(np.square(x, dtype=np.float64), axis=1, keepdims=True))
    return (x / norms).astype(np.float32)


@pytest.mark.parametrize("n", [1, 3, 33])
def test_bit_for_bit_the_numpy_expression(n):
    """Every d from 1 to 300 (below 8, the 8 running sums, their remainder, the pairwise
    halves above 128) and the encoders' widths, rows of scales from 1e-6 to 1e6."""
    rng = np.random.default_rng(n)
    for d in [*range(1, 301), 384, 512, 768, 1024, 1536, 3072]:
        x = (rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-6, 6, (n, 1))).astype(np.float32)
        out, bad = kernel(x, 1e-12)
        assert bad == -1 and out.dtype == np.float32 and out.shape == x.shape
        assert out.tobytes() == _numpy(x).tobytes(), d


def test_threads_change_nothing():
    x = np.random.default_rng(1).standard_normal((3000, 384)).astype(np.float32)
    one, _ = kernel(x, 1e-12, num_threads=1)
    two, _ = kernel(x, 1e-12, num_threads=2)
    assert one.tobytes() == two.tobytes() == _numpy(x).tobytes()


def test_the_first_bad_row():
    x = np.ones((6, 10), np.float32)
    assert kernel(x, 1e-12)[1] == -1
    x[4, 3] = np.nan
    assert kernel(x, 1e-12)[1] == 4
    x[2] = 0.0
    assert kernel(x, 1e-12)[1] == 2
    x[1, 0] = np.inf
    assert kernel(x, 1e-12)[1] == 1
    tiny = np.full((2, 4), 1e-30, np.float32)  # norm 2e-30: below eps
    assert kernel(tiny, 1e-12)[1] == 0
    assert kernel(np.zeros((0, 5), np.float32), 1e-12)[1] == -1


@pytest.mark.parametrize("bad, exc, msg", [
    (np.ones((2, 3)), TypeError, "float32"),  # float64
    (np.ones(3, np.float32), ValueError, "2-D"),
    (np.ones((3, 4), np.float32)[:, ::2], ValueError, "C-contiguous"),
    ([[1.0, 2.0]], TypeError, "numpy.ndarray"),
])  # fmt: skip
def test_the_binding_refuses_bad_arrays(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        kernel(bad, 1e-12)
    with pytest.raises(ValueError, match="eps"):
        kernel(np.ones((1, 2), np.float32), float("nan"))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_validate_takes_either_path_with_the_same_results_and_errors(use_kernel, monkeypatch):
    monkeypatch.setattr(_validate, "USE_KERNEL", use_kernel)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((4, 384))
    np.testing.assert_array_equal(_validate.unit_rows(q, "queries", 384), _numpy(q.astype(np.float32)))
    x = rng.standard_normal((5, 20)).astype(np.float32)
    assert _validate.l2_normalize_rows(x, "v").tobytes() == _numpy(x).tobytes()
    q[2] = 0.0
    with pytest.raises(ValueError, match="queries row 2 has zero norm"):
        _validate.unit_rows(q, "queries")
    q[3, 5] = np.nan  # NaN / Inf before a zero norm, wherever it is
    with pytest.raises(ValueError, match=r"holds NaN or Inf \(first in row 3\)"):
        _validate.unit_rows(q, "queries")
    x[1] = 0.0
    with pytest.raises(ValueError, match="v row 1 has zero norm"):
        _validate.l2_normalize_rows(x, "v")
    x[1, 0] = np.inf
    with pytest.raises(ValueError, match=r"v holds NaN or Inf \(first in row 1\)"):
        _validate.l2_normalize_rows(x, "v")
