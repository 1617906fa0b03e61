"""Triton kernels of the ``triton`` backend (DESIGN.md, "Kernels worth fusing").

This module is imported lazily by :mod:`rfmem_fast.backends.triton_backend`, never at
package import: ``triton.jit`` decides at decoration time whether a kernel runs
compiled (GPU) or in Triton's CPU interpreter (``TRITON_INTERPRET=1``), so the backend
loads one private copy of this file per mode (see ``triton_backend._kernels``).

Kernels:

* :func:`segtopk_kernel`: fused score + running top-k (+ familiarity signals) over a
  segmented (CSR) bank; one program per tile of ``BLOCK_M`` queries of one segment;
  no ``[b, n]`` score matrix is ever written.
* :func:`kmeans_kernel`: Lloyd assign/update for one small KMeans problem per program,
  iterated inside the kernel with a per-problem early exit.
* :func:`alpha_mix_kernel`: ``normalise(alpha qb + (1 - alpha) normalise(c) + q0)``
  for every (branch, cluster) pair.

Top-k keys. A (score, row) pair is packed into one int64 whose signed order is the
spec's order (score descending, then row ascending, RFMEM_SPEC.md "Vectors and
scores"): the high 32 bits are the float's bits mapped to an order-preserving int32
(``b ^ ((b >> 31) & 0x7fffffff)``, after ``s + 0.0`` folds -0.0 into +0.0), the low 32
bits are ``0xffffffff - (row - segment start)``. Padding is ``INT64_MIN``. Because the
key is unique per row, sorting keys gives the exact tie order, whatever sort network
the compiler emits. The running top-k is a sorted ``[BLOCK_M, K]`` key block; a tile's
top-K (``tl.topk`` or ``tl.sort``) is merged with the classic bitonic trick
``sort(max(run, flip(tile_top)))`` (the elementwise max of a descending and an
ascending list holds exactly the K largest of their union).
"""
from __future__ import annotations

import triton
import triton.language as tl

#: int64 key of an empty slot (below every real key).
MINKEY = -9223372036854775808


@triton.jit
def segtopk_kernel(
    Q,  # float32 [b, d]
    X,  # float32 [n, d]
    OFF,  # int64 [U + 1]
    PERM,  # int64 [b] query indices grouped by segment
    TILE_SEG,  # int64 [T] segment of each tile
    TILE_Q0,  # int64 [T] first position in PERM of each tile
    TILE_LEN,  # int64 [T] queries in each tile (1 .. BLOCK_M)
    OUT_S,  # float32 [b, k]
    OUT_R,  # int64 [b, k]
    OUT_MEAN,  # float64 [b]
    OUT_ENT,  # float32 [b]
    OUT_CNT,  # int64 [b]
    d,
    k,
    stride_q,
    stride_x,
    probe_k,
    lam,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    SIGNALS: tl.constexpr,
    CONVENTION: tl.constexpr,
):
    """One program = up to BLOCK_M queries of one segment; see the module docstring.

    Requires BLOCK_N >= K (powers of two). CONVENTION: 0 "mean", 1 "sum",
    2 "normalized". With SIGNALS the first ``probe_k`` valid scores give mean
    (float64 accumulation), entropy (float32) and the count.
    """
    pid = tl.program_id(0)
    seg = tl.load(TILE_SEG + pid)
    p0 = tl.load(TILE_Q0 + pid)
    qn = tl.load(TILE_LEN + pid)
    m_ar = tl.arange(0, BLOCK_M)
    m_ok = m_ar < qn
    qidx = tl.load(PERM + p0 + m_ar, mask=m_ok, other=0)
    start = tl.load(OFF + seg)
    end = tl.load(OFF + seg + 1)
    n_ar = tl.arange(0, BLOCK_N)
    d_ar = tl.arange(0, BLOCK_D)

    run = tl.full([BLOCK_M, K], MINKEY, tl.int64)
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + n_ar
        r_ok = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dd = d0 + d_ar
            d_ok = dd < d
            x = tl.load(
                X + rows[:, None] * stride_x + dd[None, :],
                mask=r_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            q = tl.load(
                Q + qidx[:, None] * stride_q + dd[None, :],
                mask=m_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if USE_DOT:
                acc += tl.dot(q, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.sum(q[:, None, :] * x[None, :, :], axis=2)
        s = acc + 0.0  # -0.0 -> +0.0, so that equal scores give equal high words
        bits = s.to(tl.int32, bitcast=True)
        hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        lo = 0xFFFFFFFF - (rows - start).to(tl.int64)
        key = (hi.to(tl.int64) << 32) | lo[None, :]
        key = tl.where(r_ok[None, :], key, MINKEY)
        # merge only when some key of the tile beats some query's current K-th key
        beat = tl.max(key, axis=1) > tl.min(run, axis=1)
        if tl.max(beat.to(tl.int32), axis=0) > 0:
            if BLOCK_N > K:
                top = tl.topk(key, K, dim=1)
            else:
                top = tl.sort(key, dim=1, descending=True)
            run = tl.sort(tl.maximum(run, tl.flip(top, 1)), dim=1, descending=True)

    # ---- decode the keys
    valid = run != MINKEY
    hi2 = (run >> 32).to(tl.int32)
    sbits = hi2 ^ ((hi2 >> 31) & 0x7FFFFFFF)
    score = sbits.to(tl.float32, bitcast=True)
    row = start + (0xFFFFFFFF - (run & 0xFFFFFFFF))
    score = tl.where(valid, score, float("-inf"))
    row = tl.where(valid, row, -1)
    cols = tl.arange(0, K)
    omask = m_ok[:, None] & (cols[None, :] < k)
    optr = qidx[:, None] * k + cols[None, :]
    tl.store(OUT_S + optr, score, mask=omask)
    tl.store(OUT_R + optr, row, mask=omask)

    if SIGNALS:
        pv = valid & (cols[None, :] < probe_k)
        cnt = tl.sum(pv.to(tl.int32), axis=1)
        has = cnt > 0
        s0 = tl.where(pv, score, 0.0)
        tot = tl.sum(s0.to(tl.float64), axis=1)
        cntf = tl.maximum(cnt, 1).to(tl.float64)
        mean = tl.where(has, tot / cntf, 0.0)
        s1 = tl.max(tl.where(pv, score, float("-inf")), axis=1)
        s1 = tl.where(has, s1, 0.0)
        z = tl.where(pv, lam * (s0 - s1[:, None]), float("-inf"))
        e = tl.exp(z)
        zsum = tl.sum(e, axis=1)
        zsum = tl.where(has, zsum, 1.0)
        p = e / zsum[:, None]
        plogp = tl.where(p > 0.0, p * tl.log(tl.maximum(p, 1e-38)), 0.0)
        shannon = -tl.sum(plogp, axis=1)
        cf = tl.maximum(cnt, 1).to(tl.float32)
        if CONVENTION == 0:
            ent = shannon / cf
        elif CONVENTION == 1:
            ent = shannon
        else:
            ent = tl.where(cnt > 1, shannon / tl.log(tl.maximum(cf, 2.0)), 0.0)
        ent = tl.where(has, ent, 0.0)
        tl.store(OUT_MEAN + qidx, mean, mask=m_ok)
        tl.store(OUT_ENT + qidx, ent, mask=m_ok)
        tl.store(OUT_CNT + qidx, cnt.to(tl.int64), mask=m_ok)


@triton.jit
def _km_assign(Vb, Cb, sq, p_ok, c_ok, d, stride_vn, stride_cc, NP: tl.constexpr, CP: tl.constexpr,
               BLOCK_D: tl.constexpr, c_all):
    """Labels [NP] (int32) of the points under the centres stored at ``Cb``.

    ``dist = |v|^2 - 2 v.c + |c|^2`` clamped at 0, as the torch backend computes it;
    clusters beyond ``clusters[i]`` get +max; ties go to the smaller cluster.
    """
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    d_ar = tl.arange(0, BLOCK_D)
    dot = tl.zeros([NP, CP], dtype=tl.float32)
    cc = tl.zeros([CP], dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        d_ok = dd < d
        v = tl.load(Vb + p_ar[:, None] * stride_vn + dd[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        c = tl.load(Cb + c_ar[:, None] * stride_cc + dd[None, :], mask=c_all[:, None] & d_ok[None, :], other=0.0)
        dot += tl.dot(v, tl.trans(c), input_precision="ieee")
        cc += tl.sum(c * c, axis=1)
    dist = sq[:, None] - 2.0 * dot + cc[None, :]
    dist = tl.maximum(dist, 0.0)
    dist = tl.where(c_ok[None, :], dist, 3.4028234663852886e38)
    return tl.argmin(dist, axis=1, tie_break_left=True)


@triton.jit
def _km_update(Vb, Cb, lab, p_ok, c_all, d, stride_vn, stride_cc, NP: tl.constexpr, CP: tl.constexpr,
               BLOCK_D: tl.constexpr, KEEP_OLD: tl.constexpr):
    """Replace the centres at ``Cb`` by the member means; returns the squared shift.

    An empty cluster keeps its old centre (KEEP_OLD) or becomes 0 (final pass).
    """
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    d_ar = tl.arange(0, BLOCK_D)
    onehot = ((lab[:, None] == c_ar[None, :]) & p_ok[:, None]).to(tl.float32)  # [NP, CP]
    cnt = tl.sum(onehot, axis=0)  # [CP]
    denom = tl.maximum(cnt, 1.0)
    shift = 0.0
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        d_ok = dd < d
        v = tl.load(Vb + p_ar[:, None] * stride_vn + dd[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        cm = c_all[:, None] & d_ok[None, :]
        cptr = Cb + c_ar[:, None] * stride_cc + dd[None, :]
        c_old = tl.load(cptr, mask=cm, other=0.0)
        sums = tl.dot(tl.trans(onehot), v, input_precision="ieee")  # [CP, BLOCK_D]
        means = sums / denom[:, None]
        if KEEP_OLD:
            c_new = tl.where(cnt[:, None] > 0.0, means, c_old)
        else:
            c_new = tl.where(cnt[:, None] > 0.0, means, 0.0)
        diff = c_new - c_old
        shift += tl.sum(tl.sum(diff * diff, axis=1), axis=0)
        tl.debug_barrier()  # every lane has read the old tile before any lane overwrites it
        tl.store(cptr, c_new, mask=cm)
    tl.debug_barrier()  # the new centres are visible to the whole program
    return shift


@triton.jit
def kmeans_kernel(
    V,  # float32 [m, n, d]
    COUNTS,  # int64 [m]
    CLUSTERS,  # int64 [m]
    TOL,  # float32 [m] absolute tolerance of each problem
    C,  # float32 [m, c, d] in: k-means++ seeds; out: member means
    LABELS,  # int64 [m, n] out
    n,
    c,
    d,
    iters,
    stride_vm,
    stride_vn,
    stride_cm,
    stride_cc,
    NP: tl.constexpr,
    CP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one KMeans problem: Lloyd from the given centres, then final labels.

    Iteration (as TorchBackend.batched_kmeans): labels <- assign(C); C <- means (empty
    cluster keeps its centre); stop after ``iters`` or once the squared centre shift is
    <= TOL[i]. Then labels <- assign(C), C <- member means (0 when empty), and padding
    labels are -1.
    """
    pid = tl.program_id(0)
    cnt = tl.load(COUNTS + pid)
    kc = tl.load(CLUSTERS + pid)
    tol = tl.load(TOL + pid)
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    d_ar = tl.arange(0, BLOCK_D)
    p_ok = p_ar < cnt
    c_ok = c_ar < kc
    c_all = c_ar < c
    Vb = V + pid * stride_vm
    Cb = C + pid * stride_cm
    sq = tl.zeros([NP], dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        v = tl.load(Vb + p_ar[:, None] * stride_vn + dd[None, :], mask=p_ok[:, None] & (dd < d)[None, :], other=0.0)
        sq += tl.sum(v * v, axis=1)
    it = 0
    done = 0
    while (it < iters) & (done == 0):
        lab = _km_assign(Vb, Cb, sq, p_ok, c_ok, d, stride_vn, stride_cc, NP, CP, BLOCK_D, c_all)
        shift = _km_update(Vb, Cb, lab, p_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D, True)
        done = (shift <= tol).to(tl.int32)
        it += 1
    lab = _km_assign(Vb, Cb, sq, p_ok, c_ok, d, stride_vn, stride_cc, NP, CP, BLOCK_D, c_all)
    _km_update(Vb, Cb, lab, p_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D, False)
    out = tl.where(p_ok, lab.to(tl.int64), -1)
    tl.store(LABELS + pid.to(tl.int64) * n + p_ar, out, mask=p_ar < n)


@triton.jit
def alpha_mix_kernel(
    QB,  # float32 [m, d]
    CEN,  # float32 [m, c, d]
    Q0,  # float32 [m, d]
    OUT,  # float32 [m, c, d]
    c,
    d,
    alpha,
    BLOCK_D: tl.constexpr,
):
    """One program = one (branch, cluster): ``normalise(alpha qb + (1-alpha) normalise(cen) + q0)``.

    ``normalise(v) = v / (||v|| + 1e-12)``; three passes over d in BLOCK_D tiles (norm of
    the centroid, norm of the mix, write), so any d works.
    """
    pid = tl.program_id(0)
    i = pid // c
    d_ar = tl.arange(0, BLOCK_D)
    cbase = CEN + pid.to(tl.int64) * d
    qbase = QB + i.to(tl.int64) * d
    q0base = Q0 + i.to(tl.int64) * d
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        x = tl.load(cbase + dd, mask=dd < d, other=0.0)
        acc += x * x
    cnorm = tl.sqrt(tl.sum(acc, axis=0)) + 1e-12
    acc2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        ok = dd < d
        v = alpha * tl.load(qbase + dd, mask=ok, other=0.0) + (1.0 - alpha) * (
            tl.load(cbase + dd, mask=ok, other=0.0) / cnorm
        ) + tl.load(q0base + dd, mask=ok, other=0.0)
        acc2 += v * v
    vnorm = tl.sqrt(tl.sum(acc2, axis=0)) + 1e-12
    obase = OUT + pid.to(tl.int64) * d
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        ok = dd < d
        v = alpha * tl.load(qbase + dd, mask=ok, other=0.0) + (1.0 - alpha) * (
            tl.load(cbase + dd, mask=ok, other=0.0) / cnorm
        ) + tl.load(q0base + dd, mask=ok, other=0.0)
        tl.store(obase + dd, v / vnorm, mask=ok)
