"""The query-expansion hook: the folding rule against numpy, search
with expansions equal to search with the folded query, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.expansion import fold_expansions


def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_fold_matches_the_documented_rule():
    rng = np.random.default_rng(0)
    q = unit(rng.normal(size=(4, 8))).astype(np.float32)
    ragged = [rng.normal(size=(2, 8)), None, np.zeros((0, 8)), rng.normal(size=(3, 8))]
    got = fold_expansions(q, ragged, weight=0.5)
    for i, e in enumerate(ragged):
        extra = unit(e).sum(0) if e is not None and len(e) else np.zeros(8)
        np.testing.assert_allclose(got[i], unit(q[i] + 0.5 * extra), atol=1e-6)
    # a [b, m, d] array (numpy or torch) with weight 1 is HyDE's mean of query and documents
    E = rng.normal(size=(4, 3, 8))
    hyde = unit((q + unit(E).sum(1)) / 4.0)
    np.testing.assert_allclose(fold_expansions(q, E), hyde, atol=1e-6)
    np.testing.assert_allclose(fold_expansions(q, torch.from_numpy(E)), hyde, atol=1e-6)
    assert fold_expansions(q, None) is q and fold_expansions(q, E, weight=0.0) is q


def test_search_with_expansions_equals_search_with_the_folded_query():
    rng = np.random.default_rng(1)
    bank = MemoryBank(16)
    for u in range(3):
        bank.add(f"u{u}", rng.normal(size=(50, 16)), [f"{u}:{i}" for i in range(50)])
    Q = rng.normal(size=(12, 16))
    users = [f"u{i % 3}" for i in range(12)]
    E = [rng.normal(size=(int(rng.integers(0, 4)), 16)) for _ in range(12)]
    cfg = RFMemConfig(expansion_weight=0.8, merge="rescore")
    folded = fold_expansions(unit(Q).astype(np.float32), E, 0.8)
    for mode in ("dense", "recollection", "rfmem"):
        a = search(bank, Q, users, cfg, mode=mode, backend="torch", expansions=E)
        b = search(bank, folded, users, cfg, mode=mode, backend="torch")
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_array_equal(a.route, b.route)
        np.testing.assert_allclose(a.mean, b.mean, atol=1e-6)
    # the expansion moves the query: pseudo-documents equal to one item pull it to the top
    snap = bank.snapshot()
    target = snap.vectors[snap.offsets[1] + 7]
    res = search(bank, Q[:1], ["u1"], RFMemConfig(expansion_weight=20.0), mode="dense", backend="torch", expansions=[target[None]])
    assert res.ids[0, 0] == "1:7"


def test_bad_expansions_are_named():
    q = unit(np.ones((2, 4))).astype(np.float32)
    with pytest.raises(ValueError, match="2 rows"):
        fold_expansions(q, [np.ones((1, 4))])
    with pytest.raises(ValueError, match=r"expansions\[1\]"):
        fold_expansions(q, [None, np.ones((1, 5))])
    with pytest.raises(ValueError, match="NaN"):
        fold_expansions(q, [np.full((1, 4), np.nan), None])
    with pytest.raises(TypeError, match="floating"):
        fold_expansions(q, [np.ones((1, 4), dtype=np.int64), None])
    with pytest.raises(ValueError, match="zero norm"):
        fold_expansions(q, [np.zeros((1, 4)), None])
    with pytest.raises(TypeError, match="expansions"):
        fold_expansions(q, "text")
    with pytest.raises(ValueError, match="expansion_weight"):
        RFMemConfig(expansion_weight=-1.0)
