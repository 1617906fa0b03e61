"""MemoryBank: CSR layout, conversion, normalisation and bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rfmem_fast import MemoryBank


def unit(rng, n, d):
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_add_builds_csr_segments_in_user_order():
    rng = np.random.default_rng(0)
    bank = MemoryBank(8)
    bank.add("a", unit(rng, 3, 8), ["a0", "a1", "a2"])
    bank.add(7, unit(rng, 2, 8), [10, 11])
    bank.add("a", unit(rng, 1, 8), ["a3"])  # appends to an existing user
    snap = bank.snapshot()
    assert snap.offsets.tolist() == [0, 4, 6]
    assert snap.item_ids.tolist() == ["a0", "a1", "a2", "a3", 10, 11]
    assert bank.users == ["a", 7] and bank.num_items == 6 and bank.user_size("a") == 4
    assert snap.vectors.dtype == np.float32 and snap.vectors.flags.c_contiguous
    assert bank.snapshot() is snap  # cached until the next write
    bank.add(7, unit(rng, 1, 8), [12])
    assert bank.snapshot() is not snap and bank.snapshot().offsets.tolist() == [0, 4, 7]


def test_rows_are_l2_normalised_and_float64_noncontiguous_accepted():
    rng = np.random.default_rng(1)
    raw = rng.normal(size=(8, 5)) * 3.0  # float64
    bank = MemoryBank(4)
    bank.add("u", raw[::2, :4], list(range(4)), texts=["x", None, "z", "w"])  # strided view
    v = bank.snapshot().vectors
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(v, raw[::2, :4] / np.linalg.norm(raw[::2, :4], axis=1, keepdims=True), atol=1e-6)
    assert bank.texts_of("u") == ["x", None, "z", "w"]
    bank.add("t", torch.ones(2, 4, dtype=torch.float16), ["p", "q"])  # torch + half
    assert bank.user_size("t") == 2


def test_from_arrays_with_empty_user():
    rng = np.random.default_rng(2)
    bank = MemoryBank.from_arrays(unit(rng, 5, 3), [0, 2, 2, 5], users=["x", "y", "z"])
    assert bank.user_size("y") == 0 and bank.item_ids_of("z") == [0, 1, 2]


@pytest.mark.parametrize(
    "vectors, ids, exc, match",
    [
        (np.ones((2, 3), np.float32), ["a", "b"], ValueError, "dimension 4"),
        (np.ones((2, 4), np.int64), ["a", "b"], TypeError, "floating"),
        (np.array([[1, np.nan, 0, 0], [1, 0, 0, 0]], np.float32), ["a", "b"], ValueError, "NaN or Inf"),
        (np.array([[1, np.inf, 0, 0]], np.float32), ["a"], ValueError, "NaN or Inf"),
        (np.zeros((1, 4), np.float32), ["a"], ValueError, "zero norm"),
        (np.ones((2, 4), np.float32), ["a"], ValueError, "ids has 1 entries"),
        (np.ones((2, 4), np.float32), ["a", "a"], ValueError, "duplicate"),
        (np.ones((1, 4), np.float32), [1.5], TypeError, "ids"),
        (np.ones(4, np.float32), ["a"], ValueError, "2-D"),
        (np.ones((0, 4), np.float32), [], ValueError, "at least one row"),
    ],
)
def test_add_rejects_bad_input(vectors, ids, exc, match):
    bank = MemoryBank(4)
    with pytest.raises(exc, match=match):
        bank.add("u", vectors, ids)
    assert bank.num_items == 0  # nothing half-written


def test_add_rejects_existing_id_bad_texts_and_user():
    bank = MemoryBank(2)
    bank.add("u", np.eye(2, dtype=np.float32), ["a", "b"])
    with pytest.raises(ValueError, match="already holds"):
        bank.add("u", np.eye(2, dtype=np.float32)[:1], ["a"])
    with pytest.raises(ValueError, match="texts has 1"):
        bank.add("u", np.eye(2, dtype=np.float32), ["c", "d"], texts=["x"])
    with pytest.raises(TypeError, match="user"):
        bank.add(1.5, np.eye(2, dtype=np.float32), ["c", "d"])
    with pytest.raises(KeyError, match="unknown user 'nobody'"):
        bank.user_index("nobody")
    with pytest.raises(ValueError, match="dim"):
        MemoryBank(0)
    for bad in ("384", 3.5, True, None):
        with pytest.raises(TypeError, match="dim must be an int"):
            MemoryBank(bad)
    assert bank.num_items == 2


def test_from_arrays_rejects_bad_offsets():
    v = np.eye(3, dtype=np.float32)
    with pytest.raises(ValueError, match="offsets"):
        MemoryBank.from_arrays(v, [0, 2, 1, 3])
    with pytest.raises(ValueError, match="offsets"):
        MemoryBank.from_arrays(v, [0, 2])
    with pytest.raises(ValueError, match="users has"):
        MemoryBank.from_arrays(v, [0, 3], users=["a", "b"])
