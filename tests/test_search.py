"""The search API: results, multi-tenant isolation, padding and bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search

BACKENDS = ["reference", "torch"]


def make_bank(seed=0, users=6, d=16, sizes=None):
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    sizes = sizes or [int(rng.integers(1, 40)) for _ in range(users)]
    for u, n in enumerate(sizes):
        bank.add(f"user{u}", rng.normal(size=(n, d)), [f"{u}:{i}" for i in range(n)])
    return bank, rng


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_equals_brute_force_and_never_crosses_users(backend):
    bank, rng = make_bank(1, users=8)
    owners = [f"user{int(i)}" for i in rng.integers(0, 8, 40)]
    Q = rng.normal(size=(40, 16))
    res = search(bank, Q, owners, RFMemConfig(out_k=5), mode="dense", backend=backend)
    snap = bank.snapshot()
    for i, u in enumerate(owners):
        a, b = snap.offsets[bank.user_index(u)], snap.offsets[bank.user_index(u) + 1]
        q = Q[i] / np.linalg.norm(Q[i])
        s = snap.vectors[a:b] @ q.astype(np.float32)
        order = np.argsort(-s, kind="stable")[:5]
        assert res.ids_list(i) == [snap.item_ids[a + j] for j in order]
        np.testing.assert_allclose(res.scores[i, : order.size], s[order], atol=1e-5)
        assert all(x.startswith(u[4:] + ":") for x in res.ids_list(i))
        assert res.route[i] == 0 and res.rule_names[i] == "forced_dense"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["rfmem", "recollection"])
def test_every_mode_stays_within_the_user(backend, mode):
    bank, rng = make_bank(2, users=10)
    owners = [f"user{i % 10}" for i in range(30)]
    res = search(bank, rng.normal(size=(30, 16)), owners, RFMemConfig(score_floor=-1.0), mode=mode, backend=backend)
    for i, u in enumerate(owners):
        ids = res.ids_list(i)
        assert ids and all(x.startswith(u[4:] + ":") for x in ids)
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_break_by_smaller_row(backend):
    bank = MemoryBank(3)
    v = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 1]], np.float32)
    bank.add("u", v, ["r0", "r1", "r2", "r3", "r4"])
    res = search(bank, np.array([[1.0, 0, 0]]), ["u"], RFMemConfig(out_k=2, probe_k=2), mode="dense", backend=backend)
    assert res.ids_list(0) == ["r0", "r2"]
    res = search(bank, np.array([[1.0, 0, 0]]), ["u"], RFMemConfig(out_k=4, probe_k=4), mode="dense", backend=backend)
    assert res.ids_list(0) == ["r0", "r2", "r3", "r1"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_and_empty_users_are_padded(backend):
    bank = MemoryBank.from_arrays(np.eye(4, dtype=np.float32)[:3], [0, 3, 3], users=["full", "empty"])
    res = search(bank, np.ones((2, 4)), ["full", "empty"], RFMemConfig(), mode="rfmem", backend=backend)
    assert len(res.ids_list(0)) == 3 and res.ids[0, 3:].tolist() == [None] * 7
    assert res.ids_list(1) == [] and (res.rows[1] == -1).all() and np.isneginf(res.scores[1]).all()
    assert res.rule_names[1] == "no_hits" and res.route_names[1] == "recollection"
    assert res.mean[1] == 0.0 and res.entropy[1] == 0.0 and res.rounds[1] == 0
    dense = search(bank, np.ones((1, 4)), ["full"], RFMemConfig(out_k=10), mode="dense", backend=backend)
    assert len(dense.ids_list(0)) == 3  # k larger than the bank: padded, documented


def test_result_fields_and_shapes():
    bank, rng = make_bank(3)
    cfg = RFMemConfig(out_k=6, probe_k=4)
    res = search(bank, rng.normal(size=(5, 16)), ["user0"] * 5, cfg)
    assert res.ids.shape == (5, 6) and res.rows.shape == (5, 6) and res.scores.dtype == np.float32
    assert res.probe_ids.shape == (5, 4) and res.mean.shape == (5,) and len(res) == 5
    assert set(res.route_names) <= {"familiarity", "recollection"}
    assert res.mode == "rfmem" and res.backend in rfmem_fast.available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance(backend):
    bank, rng = make_bank(4, users=5)
    Q = rng.normal(size=(12, 16))
    owners = [f"user{i % 5}" for i in range(12)]
    full = search(bank, Q, owners, mode="rfmem", backend=backend)
    for i in (0, 7, 11):
        one = search(bank, Q[i : i + 1], owners[i : i + 1], mode="rfmem", backend=backend)
        assert one.ids_list(0) == full.ids_list(i)
        np.testing.assert_array_equal(one.scores[0], full.scores[i])


def test_queries_accept_float64_noncontiguous_and_torch():
    bank, rng = make_bank(5)
    Q = rng.normal(size=(4, 32))[:, ::2]  # float64, strided
    a = search(bank, Q, ["user1"] * 4, mode="dense")
    b = search(bank, torch.from_numpy(np.ascontiguousarray(Q)).float(), ["user1"] * 4, mode="dense")
    assert [a.ids_list(i) for i in range(4)] == [b.ids_list(i) for i in range(4)]


@pytest.mark.parametrize(
    "queries, users, exc, match",
    [
        (np.ones((2, 8)), ["user0", "user0"], ValueError, "dimension 16"),
        (np.full((1, 16), np.nan), ["user0"], ValueError, "NaN or Inf"),
        (np.zeros((1, 16)), ["user0"], ValueError, "zero norm"),
        (np.ones((1, 16), np.int32), ["user0"], TypeError, "floating"),
        (np.ones((2, 16)), ["user0"], ValueError, "users has 1 entries"),
        (np.ones((1, 16)), ["nobody"], KeyError, r"users\[0\]: unknown user 'nobody'"),
        (np.ones(16), ["user0"], ValueError, "2-D"),
        (np.ones((1, 16)), "user0", TypeError, "users must be a sequence"),
    ],
)
def test_bad_queries(queries, users, exc, match):
    bank, _ = make_bank(6)
    with pytest.raises(exc, match=match):
        search(bank, queries, users)


def test_bad_mode_backend_config_and_empty_bank():
    bank, _ = make_bank(7)
    q = np.ones((1, 16))
    with pytest.raises(ValueError, match="mode"):
        search(bank, q, ["user0"], mode="fast")
    with pytest.raises(ValueError, match="backend"):
        search(bank, q, ["user0"], backend="gpu9000")
    with pytest.raises(TypeError, match="config"):
        search(bank, q, ["user0"], config={"alpha": 0.5})
    with pytest.raises(ValueError, match="empty"):
        search(MemoryBank(16), q, ["user0"])


def test_available_backends_and_auto():
    names = rfmem_fast.available_backends()
    assert "torch" in names and "reference" in names
    assert rfmem_fast.get_backend("auto").name == names[0]


@pytest.mark.parametrize("mode", ["dense", "rfmem"])
def test_torch_topk_strategies_agree(mode):
    """The torch backend's per-user (CPU default) and gather (GPU default) top-k agree exactly."""
    from rfmem_fast.backends import TorchBackend

    bank, rng = make_bank(8, users=7)
    Q = rng.normal(size=(25, 16))
    owners = [f"user{int(i)}" for i in rng.integers(0, 7, 25)]
    a = search(bank, Q, owners, RFMemConfig(score_floor=-1.0), mode=mode, backend=TorchBackend(topk_strategy="per_user"))
    b = search(bank, Q, owners, RFMemConfig(score_floor=-1.0), mode=mode, backend=TorchBackend(topk_strategy="gather"))
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.scores, b.scores)
    with pytest.raises(ValueError, match="topk_strategy"):
        TorchBackend(topk_strategy="fast")
