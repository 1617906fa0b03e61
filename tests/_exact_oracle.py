"""An exact top-k oracle and near-duplicate banks, written independently of the package.

The score of row x for query q is the real inner product of the two float32 vectors
rounded once to float32 (ties to even). Here it is computed with ``math.fsum`` (the
correctly rounded float64 of the exact sum), and when that float64 lies exactly on a
float32 midpoint (the one case where rounding twice can differ from rounding once) with
``fractions.Fraction``. The top-k is the k largest scores, ties by the smaller row.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from rfmem_fast import MemoryBank


def exact_f32(q: np.ndarray, x: np.ndarray) -> np.float32:
    """RN32(q . x) for float32 vectors q, x [d]."""
    prods = [float(a) * float(b) for a, b in zip(q.astype(np.float64), x.astype(np.float64))]  # exact
    s = math.fsum(prods)
    f = np.float32(s)
    if float(f) != s:
        lo, hi = (f, np.nextafter(f, np.float32(np.inf))) if float(f) < s else (np.nextafter(f, np.float32(-np.inf)), f)
        if s == (float(lo) + float(hi)) / 2:  # a float32 midpoint: decide exactly
            exact = sum((Fraction(a) * Fraction(b) for a, b in zip(q.tolist(), x.tolist())), Fraction(0))
            mid = (Fraction(float(lo)) + Fraction(float(hi))) / 2
            if exact != mid:
                return hi if exact > mid else lo
    return f


def oracle_topk(X: np.ndarray, offsets: np.ndarray, Q: np.ndarray, qseg: np.ndarray, k: int):
    """(rows int64 [b, k], scores float32 [b, k]) of the exact top-k, -1 / -inf padding."""
    b = Q.shape[0]
    rows = np.full((b, k), -1, dtype=np.int64)
    scores = np.full((b, k), -np.inf, dtype=np.float32)
    for i in range(b):
        a, e = int(offsets[qseg[i]]), int(offsets[qseg[i] + 1])
        sc = [(exact_f32(Q[i], X[r]), r) for r in range(a, e)]
        sc.sort(key=lambda t: (-float(t[0]), t[1]))
        for j, (s, r) in enumerate(sc[:k]):
            rows[i, j], scores[i, j] = r, s
    return rows, scores


def perturb(v: np.ndarray, rng: np.random.Generator, n_coords: int) -> np.ndarray:
    """``v`` with ``n_coords`` random coordinates moved by one float32 ulp (up or down)."""
    w = v.copy()
    for j in rng.choice(v.shape[0], size=min(n_coords, v.shape[0]), replace=False):
        w[j] = np.nextafter(w[j], np.float32(np.inf if rng.random() < 0.5 else -np.inf))
    return w


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)


def near_duplicate_bank(seed: int, d: int, n: int):
    """A bank whose first user holds exact and 1-ulp near duplicates of one unit vector u
    (plus a second cluster and a few unrelated rows), a second user of random rows, and
    queries: u, near duplicates of u and of the second cluster, and random vectors.

    Returns:
        (bank, Q float32 [m, d], qseg int64 [m] (segment 0 = the near-duplicate user)).
    """
    rng = np.random.default_rng(seed)
    u = unit(rng.normal(size=d))
    v = unit(u + np.float32(0.01) * unit(rng.normal(size=d)))
    rows = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.2:
            rows.append(u.copy())
        elif kind < 0.75:
            rows.append(perturb(u, rng, int(rng.integers(1, 4))))
        elif kind < 0.92:
            rows.append(perturb(v, rng, int(rng.integers(0, 3))))
        else:
            rows.append(unit(rng.normal(size=d)))
    bank = MemoryBank(d)
    bank.add("dups", np.stack(rows), ids=list(range(n)))
    bank.add("other", rng.normal(size=(7, d)), ids=list(range(n, n + 7)))
    queries = [u, perturb(u, rng, 1), perturb(u, rng, 2), v, perturb(v, rng, 1), unit(rng.normal(size=d))]
    Q = np.stack(queries).astype(np.float32)
    qseg = np.zeros(len(queries), dtype=np.int64)
    return bank, Q, qseg


def check_backend(be, bank, Q: np.ndarray, qseg: np.ndarray, ks, seed: int, batch_sizes=(1, 2, 8, 256)) -> None:
    """Assert, for backend ``be``: ids (and scores) equal the oracle for every k in ``ks``
    (segmented_topk; probe at the widest k), a top-k is a prefix of every wider one, and
    each query's result is identical alone and inside batches of ``batch_sizes`` (other
    queries of both users around it)."""
    snap = bank.snapshot()
    view = be.view(bank)
    X, off = snap.vectors, snap.offsets
    Qt, st = torch.from_numpy(Q), torch.from_numpy(qseg)
    kmax = max(ks)
    want_r, want_s = oracle_topk(X, off, Q, qseg, kmax)
    got = {}
    for k in sorted(ks):
        s, r = be.segmented_topk(view, Qt, st, k)
        s, r = s.cpu().numpy(), r.cpu().numpy()
        got[k] = r
        np.testing.assert_array_equal(r, want_r[:, :k], err_msg=f"{be.name}: ids, k={k}")
        np.testing.assert_array_equal(s, want_s[:, :k], err_msg=f"{be.name}: scores, k={k}")
    s2, r2, *_ = be.probe(view, Qt, st, kmax, min(kmax, 3), 20.0, "mean")
    np.testing.assert_array_equal(r2.cpu().numpy(), want_r, err_msg=f"{be.name}: probe ids, k={kmax}")
    np.testing.assert_array_equal(s2.cpu().numpy(), want_s, err_msg=f"{be.name}: probe scores, k={kmax}")
    for k in got:  # a top-k is a prefix of every wider top-k
        np.testing.assert_array_equal(got[k], got[kmax][:, :k], err_msg=f"{be.name}: prefix, k={k}")
    rng = np.random.default_rng(seed)
    k = ks[len(ks) // 2]
    alone = [tuple(t.cpu().numpy() for t in be.segmented_topk(view, Qt[i : i + 1], st[i : i + 1], k)) for i in range(Q.shape[0])]
    others = rng.normal(size=(max(batch_sizes), Q.shape[1])).astype(np.float32)
    for m in batch_sizes:
        i = int(rng.integers(0, Q.shape[0]))
        pos = int(rng.integers(0, m))
        Bq = np.concatenate([Q[rng.integers(0, Q.shape[0], size=m)], others[:m]])[:m].copy()
        Bseg = rng.integers(0, 2, size=m).astype(np.int64)
        Bq[pos], Bseg[pos] = Q[i], qseg[i]
        s, r = be.segmented_topk(view, torch.from_numpy(Bq), torch.from_numpy(Bseg), k)
        np.testing.assert_array_equal(r[pos].cpu().numpy(), alone[i][1][0], err_msg=f"{be.name}: batch of {m}")
        np.testing.assert_array_equal(s[pos].cpu().numpy(), alone[i][0][0], err_msg=f"{be.name}: batch of {m}")
