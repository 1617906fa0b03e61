"""The native beam driver (csrc/cpu/recollect.cpp) against its oracle, the Python driver.

The Python driver (rfmem_fast/recollection.py, checked against a plain re-statement of
spec section 4 in tests/test_recollection.py) runs over the same native primitives, so
the two must give the same rows, the same scores (bit for bit) and the same rounds:
on PersonaBench for the golden config and the two other configs of the parity tests,
and on random cases (hypothesis, derandomized): banks with exact duplicates, 1-ulp
near duplicates and coarse grids (ties everywhere), users with 0, 1 or fewer items
than out_k, every entropy convention, MMR on / off / extreme, score floors, with and
without the probe reused as the first round, alone and in batches, on 1..4 threads and
under a tiny memory budget. Also: the switch that forces the Python driver, that other
backends keep the Python driver, and input validation of ``_native.recollect``.
"""
from __future__ import annotations

import numpy as np
from _shared import nudge_one_coordinate, on_grid
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

_native = pytest.importorskip("rfmem_fast._native", reason="rfmem_fast._native is not built")

from rfmem_fast import MemoryBank, RFMemConfig, search  # noqa: E402
from rfmem_fast.backends.base import Backend  # noqa: E402
from rfmem_fast.backends.native import BEAM_DRIVER_ENV, NativeBackend, _draws_by_clusters  # noqa: E402
from rfmem_fast.backends.reference import ReferenceBackend  # noqa: E402
from rfmem_fast.backends.torch_backend import TorchBackend  # noqa: E402
from rfmem_fast.recollection import recollect as python_driver  # noqa: E402
from test_parity_personabench import CONFIGS as PB_CONFIGS  # noqa: E402  (the parity tests' configs)

NATIVE = NativeBackend(beam_driver="native")
PYTHON = NativeBackend(beam_driver="python")



def _same_results(a, b, where: str = "") -> None:
    """Identical ids, rows, scores (bitwise), rounds and routes."""
    np.testing.assert_array_equal(a.rows, b.rows, err_msg=where)
    assert (a.ids == b.ids).all(), where
    np.testing.assert_array_equal(a.scores.view(np.uint32), b.scores.view(np.uint32), err_msg=where)
    np.testing.assert_array_equal(a.rounds, b.rounds, err_msg=where)
    np.testing.assert_array_equal(a.route, b.route, err_msg=where)


# ----------------------------------------------------------------- PersonaBench
@pytest.mark.parametrize("name", list(PB_CONFIGS))
def test_personabench_native_driver_equals_python_driver(pb_embedded, name):
    cfg = PB_CONFIGS[name]
    pb = pb_embedded
    for mode in ("recollection", "rfmem"):
        a = search(pb.bank, pb.queries, pb.users, cfg, mode=mode, backend=NATIVE)
        b = search(pb.bank, pb.queries, pb.users, cfg, mode=mode, backend=PYTHON)
        assert len(a) == 263
        _same_results(a, b, f"{name} {mode}")
        if mode == "recollection":
            assert (a.rounds >= 1).all() and a.rounds.max() >= 2


# ----------------------------------------------------------------- random cases
def _random_bank(rng: np.random.Generator, d: int, lens: list[int], kind: str) -> MemoryBank:
    """Users of the given lengths; ``kind``: "gauss" (clustered), "dup" (exact duplicates),
    "near" (1-ulp near duplicates of a few vectors), "grid" (coarse grid: many exact ties)."""
    bank = MemoryBank(d)
    for u, n in enumerate(lens):
        if n == 0:
            bank.add(f"u{u}", np.ones((1, d), np.float32), ["gone"])  # a user whose only item is deleted
            bank.delete(f"u{u}", ["gone"])
            continue
        centres = rng.standard_normal((3, d))
        X = (centres[rng.integers(0, 3, n)] + 0.5 * rng.standard_normal((n, d))).astype(np.float32)
        if kind == "dup":
            X[rng.integers(0, n, n // 2)] = X[0]
        elif kind == "near":
            X = X[rng.integers(0, max(1, n // 4), n)].copy()
            nudge_one_coordinate(X, rng)
        elif kind == "grid":
            X = on_grid(X)
        bank.add(f"u{u}", X, [f"u{u}-{i}" for i in range(n)])
    return bank


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([2, 3, 8, 17, 48]),
    lens=st.lists(st.integers(0, 45), min_size=1, max_size=4),
    kind=st.sampled_from(["gauss", "dup", "near", "grid"]),
    beam=st.integers(1, 5),
    fanout=st.integers(1, 3),
    rounds=st.integers(1, 6),
    out_k=st.integers(1, 25),
    mmr=st.sampled_from([1.0, 0.9, 0.5, 0.0]),
    floor=st.sampled_from([-1.0, 0.0, 0.05, 0.3]),
    alpha=st.sampled_from([0.0, 0.5, 1.0]),
    entropy=st.sampled_from(["mean", "sum", "normalized"]),
    iters=st.sampled_from([1, 300]),
)
def test_random_cases_native_driver_equals_python_driver(
    seed, d, lens, kind, beam, fanout, rounds, out_k, mmr, floor, alpha, entropy, iters
):
    rng = np.random.default_rng(seed)
    lens = [max(1, lens[0])] + lens[1:]  # a bank with at least one item
    bank = _random_bank(rng, d, lens, kind)
    cfg = RFMemConfig(
        beam_width=beam, fanout=fanout, max_rounds=rounds, out_k=out_k, probe_k=min(out_k, 10),
        mmr_lambda=mmr, score_floor=floor, alpha=alpha, entropy=entropy, kmeans_iters=iters,
        theta_high=0.8, theta_low=0.1, tau=0.05,
    )  # fmt: skip
    users = [f"u{int(u)}" for u in rng.integers(0, len(lens), 7)]
    Q = rng.standard_normal((7, d)).astype(np.float32)
    Q[1] = bank.snapshot().vectors[0]  # a query on an item
    for mode in ("recollection", "rfmem"):
        a = search(bank, Q, users, cfg, mode=mode, backend=NATIVE)
        b = search(bank, Q, users, cfg, mode=mode, backend=PYTHON)
        _same_results(a, b, mode)
    # batch invariance: each query alone gives its row of the batch
    full = search(bank, Q, users, cfg, mode="recollection", backend=NATIVE)
    for i in (0, 3, 6):
        one = search(bank, Q[i : i + 1], users[i : i + 1], cfg, mode="recollection", backend=NATIVE)
        np.testing.assert_array_equal(one.rows[0], full.rows[i])
        np.testing.assert_array_equal(one.scores[0].view(np.uint32), full.scores[i].view(np.uint32))
        assert one.rounds[0] == full.rounds[i]
    # without the probe: the first round searched by the driver itself
    view = NATIVE.view(bank)
    qseg = torch.from_numpy(bank.segments_for(users))
    Qn = torch.from_numpy(Q / np.linalg.norm(Q, axis=1, keepdims=True)).float()
    for active in (None, torch.from_numpy(rng.random(7) < 0.5)):  # all, or the masked queries only
        o1 = NATIVE.recollect(view, Qn, qseg, cfg, active=active)
        o2 = python_driver(NATIVE, view, Qn, qseg, cfg, active=active)
        assert torch.equal(o1.rows, o2.rows) and torch.equal(o1.rounds, o2.rounds)
        assert torch.equal(o1.hit_rows, o2.hit_rows)  # every discovered item (the merges' input)
        assert torch.equal(o1.scores.view(torch.int32), o2.scores.view(torch.int32))
        if active is not None:
            assert (o1.rows[~active] == -1).all() and (o1.rounds[~active] == 0).all()


def test_short_users_and_empty_user():
    """Users with fewer items than out_k (the driver runs dry) and a user with none."""
    rng = np.random.default_rng(4)
    bank = _random_bank(rng, 6, [3, 1, 0, 12], "gauss")
    cfg = RFMemConfig(score_floor=-1.0, out_k=10)
    users = ["u0", "u1", "u2", "u3", "u0"]
    Q = rng.standard_normal((5, 6)).astype(np.float32)
    a = search(bank, Q, users, cfg, mode="recollection", backend=NATIVE)
    _same_results(a, search(bank, Q, users, cfg, mode="recollection", backend=PYTHON))
    assert sorted(a.ids_list(0)) == ["u0-0", "u0-1", "u0-2"] and a.ids_list(1) == ["u1-0"]
    assert a.ids_list(2) == [] and a.rounds[2] == 0 and (a.rows[2] == -1).all()
    assert np.isneginf(a.scores[0, 3:]).all()


# ----------------------------------------------------------------- threads and budget
def test_threads_and_memory_budget_do_not_change_results():
    rng = np.random.default_rng(8)
    bank = _random_bank(rng, 24, [300, 40, 250, 5, 120], "dup")
    snap = bank.snapshot()
    cfg = RFMemConfig(out_k=15)
    b = 64
    Q = rng.standard_normal((b, 24)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    qseg = rng.integers(0, 5, b).astype(np.int64)
    draws = _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width)

    def run(threads: int, budget: int = 256 << 20):
        return _native.recollect(
            snap.vectors, snap.offsets, Q, qseg, None, None, cfg.beam_width, cfg.fanout, cfg.max_rounds,
            cfg.out_k, cfg.alpha, cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters, cfg.kmeans_tol, draws,
            cfg.out_k, threads, -1.0, budget,
        )  # fmt: skip

    want = run(1)
    assert want[0].shape == (b, 15) and want[1].dtype == np.float32 and want[2].shape == (b,)
    for threads, budget in ((2, 256 << 20), (4, 256 << 20), (4, 1 << 20), (3, 1)):
        got = run(threads, budget)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(w, g)
    # the Python driver under a tiny budget (chunks of queries) agrees as well
    view = NativeBackend(memory_budget=1 << 20, beam_driver="python").view(bank)
    out = NativeBackend(memory_budget=1 << 20, beam_driver="python").recollect(
        view, torch.from_numpy(Q), torch.from_numpy(qseg), cfg
    )
    np.testing.assert_array_equal(out.rows.numpy(), want[0])
    np.testing.assert_array_equal(out.rounds.numpy(), want[2])


def test_python_driver_in_budget_chunks_equals_the_native_driver():
    """The search runs the Python driver for ``NativeBackend(beam_driver="python")``; under a
    1 MiB budget it cuts the batch into chunks (several here) and still returns the C++
    driver's rows, scores and rounds (the choice is the search's: Backend.fused_driver)."""
    from rfmem_fast.recollection import round_bytes_per_query

    rng = np.random.default_rng(8)
    bank = _random_bank(rng, 24, [300, 40, 250, 5, 120], "dup")
    cfg = RFMemConfig(out_k=15)
    b = 64
    Q = rng.standard_normal((b, 24)).astype(np.float32)
    users = [f"u{int(u)}" for u in rng.integers(0, 5, b)]
    assert b * round_bytes_per_query(cfg, 24) > 2 * (1 << 20)  # at least three chunks
    slow = NativeBackend(memory_budget=1 << 20, beam_driver="python")
    assert not slow.fused_driver() and NATIVE.fused_driver()
    assert not TorchBackend("cpu").fused_driver() and not ReferenceBackend().fused_driver()
    own = type("OwnDriver", (TorchBackend,), {"recollect": lambda self, *a, **k: None})("cpu")
    assert own.fused_driver()  # a backend class with a driver of its own: the search runs it
    _same_results(search(bank, Q, users, cfg, mode="recollection", backend=slow),
                  search(bank, Q, users, cfg, mode="recollection", backend=NATIVE))  # fmt: skip
    view = NATIVE.view(bank)
    Qn = torch.from_numpy(Q / np.linalg.norm(Q, axis=1, keepdims=True)).float()
    qseg = torch.from_numpy(bank.segments_for(users))
    o1, o2 = python_driver(slow, view, Qn, qseg, cfg), NATIVE.recollect(view, Qn, qseg, cfg)
    assert torch.equal(o1.rows, o2.rows) and torch.equal(o1.rounds, o2.rounds)
    assert torch.equal(o1.scores.view(torch.int32), o2.scores.view(torch.int32))


def test_width_returns_every_discovered_item():
    """width = the capacity returns every hit; its first out_k columns are the result."""
    rng = np.random.default_rng(9)
    bank = _random_bank(rng, 16, [200], "gauss")
    snap = bank.snapshot()
    cfg = RFMemConfig(out_k=5)
    Q = rng.standard_normal((6, 16)).astype(np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    qseg = np.zeros(6, np.int64)
    cap = cfg.out_k - 1 + cfg.beam_width * (cfg.beam_width + cfg.max_rounds - 1) * cfg.fanout
    args = (snap.vectors, snap.offsets, Q, qseg, None, None, cfg.beam_width, cfg.fanout, cfg.max_rounds, cfg.out_k,
            cfg.alpha, cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters, cfg.kmeans_tol,
            _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width))  # fmt: skip
    r5, s5, n5 = _native.recollect(*args, cfg.out_k)
    rc, sc, nc = _native.recollect(*args, cap)
    np.testing.assert_array_equal(rc[:, :5], r5)
    np.testing.assert_array_equal(sc[:, :5], s5)
    np.testing.assert_array_equal(nc, n5)
    assert ((rc >= 0).sum(axis=1) >= 5).all()  # a round adds several items at once
    for row in rc:
        kept = row[row >= 0]
        assert len(set(kept.tolist())) == len(kept)  # first occurrences only
    rw, _, _ = _native.recollect(*args, cap + 3)  # wider: padding
    np.testing.assert_array_equal(rw[:, :cap], rc)
    assert (rw[:, cap:] == -1).all()


# ----------------------------------------------------------------- the switch
def test_switch_forces_the_python_driver(monkeypatch):
    rng = np.random.default_rng(1)
    bank = _random_bank(rng, 8, [30], "gauss")
    Q = rng.standard_normal((2, 8)).astype(np.float32)
    calls = {"native": 0, "python": 0}
    real_native = _native.recollect

    def count_native(*a, **k):
        calls["native"] += 1
        return real_native(*a, **k)

    import rfmem_fast.backends.native as native_mod
    import rfmem_fast.recollection as rec_mod

    real_python = rec_mod.recollect

    def count_python(*a, **k):
        calls["python"] += 1
        return real_python(*a, **k)

    monkeypatch.setattr(native_mod._native, "recollect", count_native)
    monkeypatch.setattr(rec_mod, "recollect", count_python)
    monkeypatch.delenv(BEAM_DRIVER_ENV, raising=False)
    search(bank, Q, ["u0", "u0"], mode="recollection", backend="native")
    assert calls == {"native": 1, "python": 0}
    monkeypatch.setenv(BEAM_DRIVER_ENV, "python")
    search(bank, Q, ["u0", "u0"], mode="recollection", backend="native")
    assert calls == {"native": 1, "python": 1}
    search(bank, Q, ["u0", "u0"], mode="recollection", backend=NativeBackend(beam_driver="native"))
    assert calls == {"native": 2, "python": 1}  # the argument wins over the environment
    monkeypatch.setenv(BEAM_DRIVER_ENV, "fast")
    with pytest.raises(ValueError, match=BEAM_DRIVER_ENV):
        search(bank, Q, ["u0", "u0"], mode="recollection", backend="native")
    with pytest.raises(ValueError, match="beam_driver"):
        NativeBackend(beam_driver="cuda")
    # the other backends run the Python driver
    for be in (TorchBackend("cpu"), ReferenceBackend()):
        assert type(be).recollect is Backend.recollect
    monkeypatch.delenv(BEAM_DRIVER_ENV)
    search(bank, Q, ["u0", "u0"], mode="recollection", backend="torch")
    assert calls == {"native": 2, "python": 2}


# ----------------------------------------------------------------- validation
def _args(**over):
    X = np.eye(6, 4, dtype=np.float32) + 0.1
    a = dict(
        X=X, offsets=np.array([0, 4, 6], np.int64), Q0=X[:2].copy(), qseg=np.array([0, 1], np.int64),
        level0_scores=None, level0_rows=None, beam_width=2, fanout=1, max_rounds=3, out_k=4, alpha=0.5,
        mmr_lambda=0.9, score_floor=0.0, kmeans_iters=300, kmeans_tol=1e-4, draws=_draws_by_clusters(42, 2),
        width=4,
    )  # fmt: skip
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(level0_scores=np.zeros((2, 2), np.float32)), ValueError, "given together"),
        (dict(level0_scores=np.zeros((2, 1), np.float32), level0_rows=np.zeros((2, 1), np.int64)), ValueError,
         "at least beam_width"),
        (dict(level0_scores=np.zeros((2, 2), np.float32), level0_rows=np.array([[0, 1], [4, 0]])), ValueError,
         "level0_rows\\[1, 1\\] = 0"),
        (dict(level0_scores=np.zeros((2, 2), np.float64), level0_rows=np.zeros((2, 2), np.int64)), TypeError,
         "level0_scores must have dtype float32"),
        (dict(level0_scores=np.zeros((3, 2), np.float32), level0_rows=np.zeros((3, 2), np.int64)), ValueError,
         "both be \\[b, k0\\]"),
        (dict(beam_width=0), ValueError, "beam_width"),
        (dict(max_rounds=65), ValueError, "max_rounds"),
        (dict(mmr_lambda=1.5), ValueError, "mmr_lambda"),
        (dict(alpha=float("nan")), ValueError, "alpha"),
        (dict(score_floor=float("inf")), ValueError, "score_floor"),
        (dict(kmeans_tol=-1.0), ValueError, "kmeans_tol"),
        (dict(draws=np.zeros((3, 1))), ValueError, "draws must be"),
        (dict(draws=np.zeros((2, 10))), ValueError, "draws must be"),
        (dict(width=0), ValueError, "width"),
        (dict(qseg=np.array([0, 2], np.int64)), ValueError, "segment index"),
        (dict(Q0=np.zeros((2, 3), np.float32)), ValueError, "must be \\[b, 4\\]"),
        (dict(memory_budget=0), ValueError, "memory_budget"),
        (dict(num_threads=-1), ValueError, "num_threads"),
    ],
)
def test_recollect_rejects_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _native.recollect(**_args(**over))


def test_recollect_accepts_valid_level0():
    a = _args()
    rows, scores, rounds = _native.recollect(**a)
    s, r = _native.segmented_topk(a["X"], a["offsets"], a["Q0"], a["qseg"], 2)
    rows2, scores2, rounds2 = _native.recollect(**_args(level0_scores=s, level0_rows=r))
    np.testing.assert_array_equal(rows, rows2)
    np.testing.assert_array_equal(scores, scores2)
    np.testing.assert_array_equal(rounds, rounds2)


# ----------------------------------------------------------------- MMR similarity
def test_max_similarity_native_matches_default():
    """The native MMR similarity equals the default batched product (up to the float64
    summation order; exactly on small-integer data) and marks lone points with -inf."""
    rng = np.random.default_rng(12)
    V = rng.standard_normal((30, 9, 37)).astype(np.float32)
    counts = rng.integers(0, 10, 30).astype(np.int64)
    counts[:3] = [0, 1, 9]
    V[4, 1] = V[4, 0]  # a duplicate: its similarity is its squared norm
    got = NATIVE.max_similarity(torch.from_numpy(V), torch.from_numpy(counts))
    want = Backend.max_similarity(TorchBackend("cpu"), torch.from_numpy(V), torch.from_numpy(counts))
    assert got.dtype == torch.float64 and got.shape == (30, 9)
    for i in range(30):
        c = int(counts[i])
        torch.testing.assert_close(got[i, :c], want[i, :c], rtol=1e-13, atol=1e-13)
        assert torch.isneginf(got[i, c:]).all()
    assert torch.isneginf(got[1, 0])  # alone
    np.testing.assert_allclose(got[4, 0].item(), float(V[4, 0].astype(np.float64) @ V[4, 0]), rtol=1e-14)
    G = np.round(V * 2).astype(np.float32)  # exact products and sums: every order agrees
    assert torch.equal(
        NATIVE.max_similarity(torch.from_numpy(G), torch.from_numpy(counts))[:, :3][counts[:, None] > np.arange(3)],
        Backend.max_similarity(NATIVE, torch.from_numpy(G), torch.from_numpy(counts))[:, :3][
            counts[:, None] > np.arange(3)
        ],
    )
    with pytest.raises(ValueError, match="counts\\[0\\] = 10"):
        _native.max_similarity(V, np.full(30, 10, np.int64))
    with pytest.raises(TypeError, match="V must have dtype float32"):
        _native.max_similarity(V.astype(np.float64), counts)


# ----------------------------------------------------------------- merges
@pytest.mark.parametrize("merge", ["interleave", "rrf", "rescore"])
def test_merge_modes_same_on_both_drivers(merge):
    """The merges read every discovered item (``hit_rows``): the native driver returns
    them as the Python driver does, also when the Python driver cuts its batch into
    chunks of a tiny memory budget."""
    rng = np.random.default_rng(21)
    bank = _random_bank(rng, 16, [150, 60, 9], "dup")
    users = [f"u{int(u)}" for u in rng.integers(0, 3, 40)]
    Q = rng.standard_normal((40, 16)).astype(np.float32)
    cfg = RFMemConfig(merge=merge, out_k=12)
    tiny = NativeBackend(memory_budget=1 << 20, beam_driver="python")
    for mode in ("recollection", "rfmem"):
        a = search(bank, Q, users, cfg, mode=mode, backend=NATIVE)
        _same_results(a, search(bank, Q, users, cfg, mode=mode, backend=PYTHON), f"{merge} {mode}")
        _same_results(a, search(bank, Q, users, cfg, mode=mode, backend=tiny), f"{merge} {mode} chunked")
        if mode == "recollection":  # a merge returns min(out_k, user size) items
            assert ((a.rows >= 0).sum(axis=1) == np.minimum(12, [bank.user_size(u) for u in users])).all()
