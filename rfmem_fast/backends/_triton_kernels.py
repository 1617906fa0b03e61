"""Triton kernels of the ``triton`` backend (DESIGN.md, "Kernels worth fusing").

This module is imported lazily by :mod:`rfmem_fast.backends.triton_backend`, never at
package import: ``triton.jit`` decides at decoration time whether a kernel runs
compiled (GPU) or in Triton's CPU interpreter (``TRITON_INTERPRET=1``), so the backend
executes this file into a private module for the mode in use (see
``triton_backend._kernels``). No ``from __future__ import annotations`` here: the
``tl.constexpr`` annotations are read by Triton.

Kernels:

* :func:`segtopk_kernel`: fused score + running top-k (+ familiarity signals) over a
  segmented (CSR) bank; one program per tile of ``BLOCK_M`` queries of one segment;
  no ``[b, n]`` score matrix is ever written.
* :func:`kmeans_kernel`: Lloyd assign/update for one small KMeans problem per program,
  iterated inside the kernel with a per-problem early exit (the semantics of
  :func:`rfmem_fast.kmeans.lloyd`).
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
import triton
import triton.language as tl

#: int64 key of an empty slot (below every real key).
MINKEY = tl.constexpr(-9223372036854775808)


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
    OUT_ENT,  # float64 [b]
    OUT_CNT,  # int64 [b]
    d,
    k,
    stride_q,
    stride_x,
    probe_k,
    LAM,  # float64 [1] softmax temperature
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    SIGNALS: tl.constexpr,
    CONVENTION: tl.constexpr,
):
    """One program = up to BLOCK_M queries of one segment; see the module docstring.

    Requires BLOCK_N >= K (powers of two). EXACT: products and sums in float64, the
    score rounded once to float32 (the torch backend's exact re-scoring, so scores do
    not depend on tiling or batch); else float32 accumulation (``tl.dot`` with IEEE
    precision when USE_DOT). CONVENTION: 0 "mean", 1 "sum", 2 "normalized". With
    SIGNALS the first ``probe_k`` valid scores give mean, entropy (both float64, as
    :func:`rfmem_fast.signals.familiarity_signals`) and the count.
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
        if EXACT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
        else:
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
            if EXACT:
                acc += tl.sum(q.to(tl.float64)[:, None, :] * x.to(tl.float64)[None, :, :], axis=2)
            elif USE_DOT:
                acc += tl.dot(q, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.sum(q[:, None, :] * x[None, :, :], axis=2)
        s = acc.to(tl.float32) + 0.0  # -0.0 -> +0.0, so that equal scores give equal high words
        bits = s.to(tl.int32, bitcast=True)
        hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        lo = 0xFFFFFFFF - (rows - start).to(tl.int64)
        key = (hi.to(tl.int64) << 32) | lo[None, :]
        key = tl.where(m_ok[:, None] & r_ok[None, :], key, MINKEY)  # padding rows / query slots
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
        s64 = tl.where(pv, score, 0.0).to(tl.float64)
        cntf = tl.maximum(cnt, 1).to(tl.float64)
        mean = tl.where(has, tl.sum(s64, axis=1) / cntf, 0.0)
        lam = tl.load(LAM)
        s1 = tl.max(tl.where(pv, s64, float("-inf")), axis=1)  # the top score (s is sorted)
        s1 = tl.where(has, s1, 0.0)
        z = tl.where(pv, lam * (s64 - s1[:, None]), 0.0)
        e = tl.where(pv, tl.exp(z), 0.0)
        zsum = tl.sum(e, axis=1)
        zsum = tl.where(has, zsum, 1.0)
        p = e / zsum[:, None]
        plogp = tl.where(p > 0.0, p * tl.log(tl.maximum(p, 1.0e-300)), 0.0)
        shannon = -tl.sum(plogp, axis=1)
        if CONVENTION == 0:
            ent = shannon / cntf
        elif CONVENTION == 1:
            ent = shannon
        else:
            ent = tl.where(cnt > 1, shannon / tl.log(tl.maximum(cntf, 2.0)), 0.0)
        ent = tl.where(has, ent, 0.0)
        tl.store(OUT_MEAN + qidx, mean, mask=m_ok)
        tl.store(OUT_ENT + qidx, ent, mask=m_ok)
        tl.store(OUT_CNT + qidx, cnt.to(tl.int64), mask=m_ok)


@triton.jit
def _km_assign(Vb, Cb, p_ok, c_ok, c_all, d, stride_vn, stride_cc, NP: tl.constexpr, CP: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Labels [NP] (int32, -1 on padding) of the points under the float64 centres at ``Cb``.

    ``dist = |c|^2 - 2 v.c`` in float64 (the point's own norm does not change the
    argmin), as :func:`rfmem_fast.kmeans.lloyd`; clusters beyond ``clusters[i]`` get
    +inf; ties go to the smaller cluster (first minimum).
    """
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    d_ar = tl.arange(0, BLOCK_D)
    dot = tl.zeros([NP, CP], dtype=tl.float64)
    cc = tl.zeros([CP], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        d_ok = dd < d
        v = tl.load(Vb + p_ar[:, None] * stride_vn + dd[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        c = tl.load(Cb + c_ar[:, None] * stride_cc + dd[None, :], mask=c_all[:, None] & d_ok[None, :], other=0.0)
        v = v.to(tl.float64)
        dot += tl.sum(v[:, None, :] * c[None, :, :], axis=2)
        cc += tl.sum(c * c, axis=1)
    dist = cc[None, :] - 2.0 * dot
    dist = tl.where(c_ok[None, :], dist, float("inf"))
    lab = tl.argmin(dist, axis=1, tie_break_left=True).to(tl.int32)
    return tl.where(p_ok, lab, -1)


@triton.jit
def _km_update(Vb, Cb, lab, p_ok, c_all, d, stride_vn, stride_cc, NP: tl.constexpr, CP: tl.constexpr,
               BLOCK_D: tl.constexpr, KEEP_OLD: tl.constexpr):
    """Replace the float64 centres at ``Cb`` by the member means; returns the squared shift.

    An empty cluster keeps its old centre (KEEP_OLD) or becomes 0 (final pass).
    """
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    d_ar = tl.arange(0, BLOCK_D)
    onehot = ((lab[:, None] == c_ar[None, :]) & p_ok[:, None]).to(tl.float64)  # [NP, CP]
    cnt = tl.sum(onehot, axis=0)  # [CP]
    denom = tl.maximum(cnt, 1.0)
    shift = tl.zeros([CP], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        d_ok = dd < d
        v = tl.load(Vb + p_ar[:, None] * stride_vn + dd[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        v = v.to(tl.float64)
        cm = c_all[:, None] & d_ok[None, :]
        cptr = Cb + c_ar[:, None] * stride_cc + dd[None, :]
        c_old = tl.load(cptr, mask=cm, other=0.0)
        sums = tl.sum(onehot[:, :, None] * v[:, None, :], axis=0)  # [CP, BLOCK_D]
        means = sums / denom[:, None]
        if KEEP_OLD:
            c_new = tl.where(cnt[:, None] > 0.0, means, c_old)
        else:
            c_new = tl.where(cnt[:, None] > 0.0, means, 0.0)
        diff = c_new - c_old
        shift += tl.sum(diff * diff, axis=1)
        tl.debug_barrier()  # every lane has read the old tile before any lane overwrites it
        tl.store(cptr, c_new, mask=cm)
    tl.debug_barrier()  # the new centres are visible to the whole program
    return tl.sum(shift, axis=0)


@triton.jit
def kmeans_kernel(
    V,  # float32 [m, n, d]
    COUNTS,  # int64 [m]
    CLUSTERS,  # int64 [m]
    TOL,  # float64 [m] absolute tolerance of each problem
    C,  # float64 [m, c, d] in: k-means++ seeds; out: member means
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

    Float64 throughout, as :func:`rfmem_fast.kmeans.lloyd`: new labels <- assign(C);
    C <- member means (an empty cluster keeps its centre); stop after ``iters``, when
    the labels repeat ("strict" convergence: they are final) or once the squared centre
    shift is <= TOL[i] (then the labels are recomputed from the final centres).
    Finally C <- member means of the final labels (0 when empty); padding labels -1.
    """
    pid = tl.program_id(0)
    cnt = tl.load(COUNTS + pid)
    kc = tl.load(CLUSTERS + pid)
    tol = tl.load(TOL + pid)
    p_ar = tl.arange(0, NP)
    c_ar = tl.arange(0, CP)
    p_ok = p_ar < cnt
    c_ok = c_ar < kc
    c_all = c_ar < c
    Vb = V + pid.to(tl.int64) * stride_vm
    Cb = C + pid.to(tl.int64) * stride_cm
    lab = tl.full([NP], -1, tl.int32)
    it = 0
    done = 0
    strict = 0
    while (it < iters) & (done == 0):
        new = _km_assign(Vb, Cb, p_ok, c_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D)
        shift = _km_update(Vb, Cb, new, p_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D, True)
        same = tl.sum((new != lab).to(tl.int32), axis=0) == 0
        lab = new
        strict = same.to(tl.int32)
        done = (same | (shift <= tol)).to(tl.int32)
        it += 1
    if strict == 0:
        lab = _km_assign(Vb, Cb, p_ok, c_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D)
    _km_update(Vb, Cb, lab, p_ok, c_all, d, stride_vn, stride_cc, NP, CP, BLOCK_D, False)
    tl.store(LABELS + pid.to(tl.int64) * n + p_ar, lab.to(tl.int64), mask=p_ar < n)


@triton.jit
def alpha_mix_kernel(
    QB,  # float32 [m, d]
    CEN,  # float32 [m, c, d]
    Q0,  # float32 [m, d]
    OUT,  # float32 [m, c, d]
    PARAMS,  # float64 [3]: alpha, 1 - alpha, eps (= 1e-12), exact as the host computes them
    c,
    d,
    BLOCK_D: tl.constexpr,
):
    """One program = one (branch, cluster): ``normalise(alpha qb + (1-alpha) normalise(cen) + q0)``.

    ``normalise(v) = v / (||v|| + 1e-12)``, computed in float64 and rounded once to
    float32 (as the torch backend); three passes over d in BLOCK_D tiles (norm of the
    centroid, norm of the mix, write), so any d works.
    """
    pid = tl.program_id(0)
    i = pid // c
    d_ar = tl.arange(0, BLOCK_D)
    cbase = CEN + pid.to(tl.int64) * d
    qbase = QB + i.to(tl.int64) * d
    q0base = Q0 + i.to(tl.int64) * d
    a64 = tl.load(PARAMS)
    b64 = tl.load(PARAMS + 1)
    eps = tl.load(PARAMS + 2)
    acc = tl.zeros([BLOCK_D], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        x = tl.load(cbase + dd, mask=dd < d, other=0.0).to(tl.float64)
        acc += x * x
    cnorm = tl.sqrt(tl.sum(acc, axis=0)) + eps
    acc2 = tl.zeros([BLOCK_D], dtype=tl.float64)
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        ok = dd < d
        v = a64 * tl.load(qbase + dd, mask=ok, other=0.0).to(tl.float64) + b64 * (
            tl.load(cbase + dd, mask=ok, other=0.0).to(tl.float64) / cnorm
        ) + tl.load(q0base + dd, mask=ok, other=0.0).to(tl.float64)
        acc2 += v * v
    vnorm = tl.sqrt(tl.sum(acc2, axis=0)) + eps
    obase = OUT + pid.to(tl.int64) * d
    for d0 in range(0, d, BLOCK_D):
        dd = d0 + d_ar
        ok = dd < d
        v = a64 * tl.load(qbase + dd, mask=ok, other=0.0).to(tl.float64) + b64 * (
            tl.load(cbase + dd, mask=ok, other=0.0).to(tl.float64) / cnorm
        ) + tl.load(q0base + dd, mask=ok, other=0.0).to(tl.float64)
        tl.store(obase + dd, (v / vnorm).to(tl.float32), mask=ok)


#: Argument types of each kernel for ahead-of-time compilation (``triton.compile`` with
#: an explicit target, no GPU needed): see ``triton_backend.compile_kernels``.
SIGNATURES = {
    "segtopk_kernel": {
        "Q": "*fp32", "X": "*fp32", "OFF": "*i64", "PERM": "*i64", "TILE_SEG": "*i64", "TILE_Q0": "*i64",
        "TILE_LEN": "*i64", "OUT_S": "*fp32", "OUT_R": "*i64", "OUT_MEAN": "*fp64", "OUT_ENT": "*fp64",
        "OUT_CNT": "*i64", "d": "i32", "k": "i32", "stride_q": "i32", "stride_x": "i32", "probe_k": "i32",
        "LAM": "*fp64", "K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
        "BLOCK_D": "constexpr", "EXACT": "constexpr", "USE_DOT": "constexpr", "SIGNALS": "constexpr",
        "CONVENTION": "constexpr",
    },
    "kmeans_kernel": {
        "V": "*fp32", "COUNTS": "*i64", "CLUSTERS": "*i64", "TOL": "*fp64", "C": "*fp64", "LABELS": "*i64",
        "n": "i32", "c": "i32", "d": "i32", "iters": "i32", "stride_vm": "i32", "stride_vn": "i32",
        "stride_cm": "i32", "stride_cc": "i32", "NP": "constexpr", "CP": "constexpr", "BLOCK_D": "constexpr",
    },
    "alpha_mix_kernel": {
        "QB": "*fp32", "CEN": "*fp32", "Q0": "*fp32", "OUT": "*fp32", "PARAMS": "*fp64", "c": "i32", "d": "i32",
        "BLOCK_D": "constexpr",
    },
}
