"""bench/bench_int8_rowwise.py: its row-wise int8 ONNX graph computes what its numpy
reference says (exact integer products where the CPU has int8 dot products; on an AVX2-only
CPU, ONNX Runtime's u8 x s8 kernel saturates pairs of products in int16, which the reference
models), and its float32 graph is X @ W + b."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason='onnxruntime is not installed (pip install "rfmem_fast[onnx]")')
pytest.importorskip("onnx", reason='onnx is not installed (pip install "rfmem_fast[onnx]")')
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_int8_rowwise as b  # noqa: E402

from rfmem_fast.encoders import int8_dot  # noqa: E402


@pytest.mark.parametrize("k,n,m", [(384, 1536, 7), (64, 32, 1), (48, 16, 33)])
def test_rowwise_graph_matches_its_reference_and_float32(k, n, m):
    x = np.random.default_rng(5).standard_normal((m, k)).astype(np.float32)
    x[0, 3] = 40.0  # an outlier: the row's scale follows it
    y32 = b.session(b.linear_model(k, n, "float32", seed=2)[0]).run(None, {"X": x})[0]
    model, w, bias = b.linear_model(k, n, "rowwise", seed=2)
    y8 = b.session(model).run(None, {"X": x})[0]
    np.testing.assert_allclose(y32, x @ w + bias, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y8, b.rowwise_reference(x, w, bias, saturate=not int8_dot()), rtol=1e-5, atol=1e-6)
    # and the exact integer product is a quantisation of the float32 product: close, not equal
    err = np.abs(b.rowwise_reference(x, w, bias) - y32).max() / np.abs(y32).max()
    assert 1e-5 < err < 0.05, err


def test_the_saturating_reference_differs_only_where_a_pair_passes_int16():
    """The two references agree on small activations (no pair beyond 32767) and part on an
    outlier (the AVX2 kernel's clipping is visible, so the test above tells them apart)."""
    model, w, bias = b.linear_model(64, 32, "rowwise", seed=2)
    small = np.full((1, 64), -1.0, np.float32)  # every code -127: u = 1, pairs <= 2 * 127
    np.testing.assert_array_equal(b.rowwise_reference(small, w, bias), b.rowwise_reference(small, w, bias, saturate=True))
    big = np.random.default_rng(5).standard_normal((1, 64)).astype(np.float32)
    big[0, 3] = 40.0
    assert np.abs(b.rowwise_reference(big, w, bias) - b.rowwise_reference(big, w, bias, saturate=True)).max() > 0.1


def test_rowwise_rows_do_not_depend_on_each_other():
    model, _, _ = b.linear_model(64, 32, "rowwise")
    s = b.session(model)
    x = np.random.default_rng(1).standard_normal((9, 64)).astype(np.float32)
    together = s.run(None, {"X": x})[0]
    alone = np.concatenate([s.run(None, {"X": x[i:i + 1]})[0] for i in range(9)])
    np.testing.assert_array_equal(together, alone)


def test_bad_mode_names_the_argument():
    with pytest.raises(ValueError, match="mode must be"):
        b.linear_model(8, 8, "int4")
