"""Exact top-k: a proven error bound of the fast scan and the exact re-scoring of the candidates.

What every backend returns (RFMEM_SPEC.md "Vectors and scores"). The score of row
``x`` for query ``q`` is ``e = RN32(q . x)``: the real inner product of the two float32
vectors rounded ONCE to float32 (round to nearest, ties to even), i.e. "the float64
score rounded once to float32" made independent of the float64 summation order. The
top-k is the k largest ``e``, ties broken by the smaller row. So a top-k is a prefix of
every wider top-k, and a query's result does not depend on the other queries of its
batch, on the kernel a batch shape picks, on tiling or on threads.

How it is computed fast. Each backend first scans a segment with a fast kernel
(float32 BLAS, SIMD lanes, or float64 tiles rounded to float32) and keeps its best
``k + SCAN_MARGIN`` rows by scan score ``f``. The error of ``f`` is bounded:

**The bound.** Let ``u = 2^-24`` (float32 unit roundoff), ``gamma_n(u) = n u / (1 - n u)``,
``p_i = q_i x_i``. Standard forward error analysis (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., section 3.1) of a dot product in which each product
term passes through at most ``n`` roundings (one multiplication plus the additions on
its path through the summation tree; an FMA only removes roundings) gives, with
gradual underflow (a product may lose at most ``2^-150`` absolutely; additions are
exact in the subnormal range):

    |f - q.x| <= [(1 + u_in)^2 (1 + gamma_n(u_acc)) - 1] * sum|p_i|  +  d 2^-150

where ``u_acc`` is the unit roundoff of the accumulation (``2^-24`` float32, ``2^-53``
float64) and ``u_in`` that of an input conversion (0 for float32 inputs; ``2^-11`` for
TF32 and ``2^-8`` for bfloat16 matmuls). A float64 sum rounded to float32 adds
``u |s| + 2^-150``. The exact score itself is ``e = RN32(q.x)``, ``|e - q.x| <= u |q.x| +
2^-150``. With ``sum|p_i| <= ||q|| ||x||`` (Cauchy-Schwarz) and ``R`` the largest row
norm of the bank, for EVERY row of the bank

    |f - e| <= B(q) = c * ||q|| * R + (d + 2) 2^-149,    c = scan term + u

(:func:`scan_error_coef` gives ``c``; it is inflated by ``2^-30`` relative to cover the
float64 evaluation of the bound). The depth ``n`` per kernel:

* torch / BLAS matmuls and Triton's ``tl.sum`` / ``tl.dot``: any order, ``n = d``;
* the native kernel's scan path (csrc/cpu/topk.cpp): 16 SIMD lanes each accumulating
  ``m = ceil(d / 16)`` products in order, then a 4-level tree, ``n = m + 4``;
* the native kernel's GEMM path (csrc/cpu/simd_impl.inc): each score is accumulated
  along d in blocks of ``Kc = 64`` terms, every block summed from zero (one rounding
  per multiply-add, fused or not) and then added to the running sum, so a term goes
  through at most ``Kc`` roundings in its block and one per later block:
  ``n = min(d, Kc) + ceil(d / Kc) - 1`` (:func:`gemm_depth`; 69 for d = 384, where a
  plain sequential sum over d would give 384);
* float64 accumulation (Triton ``exact=True``, the CUDA warp kernel): ``n = d`` at
  ``u_acc = 2^-53``, plus the rounding of the sum to float32.

For d = 384 and unit vectors: ``B`` = 2.3e-5 (BLAS), 1.7e-6 (native scan), 4.2e-6
(native GEMM), 1.2e-7 (float64).

**Half-precision scan copies** (:mod:`rfmem_fast.precision`). A float16 / bfloat16 bank
is scanned in its rounded copy ``x'`` (``|x'_i - x_i| <= u_in |x_i| + a``: ``u_in =
2^-11``, ``a = 2^-25`` for float16; ``2^-8``, ``2^-134`` for bfloat16; the conversion
back to float32 is exact). With the matmul's own input rounding ``u_mm`` as above,

    |f - q.x| <= [(1 + u_mm)^2 (1 + u_in) (1 + gamma_n) - 1] ||q|| R
                 + (1 + u_mm)^2 (1 + gamma_n) sqrt(d) a ||q||  +  d 2^-150

(``sum |q_i x'_i| <= ||q|| ||x'||``, ``||x' - x|| <= u_in ||x|| + sqrt(d) a``), i.e.
:func:`scan_error_coef` with ``row_unit = u_in`` and the extra per-query term
``row_abs ||q||`` of :func:`query_bounds` (:func:`scan_bound_terms`). ``R`` is still
the float32 rows' largest norm, bounded from the scan copy as ``(max ||x'|| +
sqrt(d) a) / (1 - u_in)``. For d = 384 and unit vectors ``B`` ~ 4.9e-4 (float16) and
3.9e-3 (bfloat16): wider windows, so the scan keeps more candidates
(:data:`SCAN_MARGINS`, the over-fetch) and the certified rule below stays unchanged.

**int8 scan copies** (``dtype="int8"``, native backend; docs/internals/exactness.md
"int8 scan copies" has the full derivation). Row ``x`` is stored as ``x8 = round(x /
s_x)`` (int8, ``s_x = RN32(max|x| / 127)``) with ``rho_x >= ||x - s_x x8||`` and ``N_x >=
||x||`` (:func:`rfmem_fast.precision.int8_scan_copy`); the kernel quantises each query to
``q16 = round(q / s)`` (int16, ``|q16| <= Q = min(32767, (2^31 - 1) / (127 d))``, so the
integer ``I = q16 . x8`` is exact in int32). From ``q.x = s s_x I + (s q16).r_x + r_q.x``
(``r_x = x - s_x x8``, ``r_q = q - s q16``) and Cauchy-Schwarz,
``|q.x - s s_x I| <= Qt rho_x + Rq N_x`` (``Qt >= ||s q16||``, ``Rq >= ||r_q||``); the
float32 score ``f = RN32(RN32(I) RN32(s s_x))`` and ``e = RN32(q.x)`` add
``gamma_3 Qt (N_x + rho_x) + u Qn N_x + 2^-118``, so

    |f - e| <= rho_x Qt (1 + gamma_3) + N_x (Rq + u Qn + gamma_3 Qt) + 2^-118.

The scan evaluates ``B = RN32(RN32(a rho_x) + RN32(RN32(b N_x) + 2^-114))`` with ``a >= Qt
(1 + 16u)``, ``b >= (Rq + u Qn)(1 + 16u) + 16u Qt`` (float32, rounded up), which leaves
room for its own four roundings and for the rounding of ``f +- B``: ``lo = RN32(f - B) <=
e <= U = RN32(f + B)`` for every pair (csrc/cpu/simd.h ``i8_upper`` / ``i8_lower``). The
rule then works on these per-row keys: the heaps keep the ``k + 64`` largest ``U``
(:data:`SCAN_MARGINS`), ``L`` is the k-th largest ``lo`` of the kept rows (``<=`` the k-th
exact score), every kept row with ``U >= L`` is re-scored exactly, and a heap whose worst
kept ``U`` is still ``>= L`` has its segment rescanned (every row with ``U >= L``
re-scored). For unit rows at d = 384, ``U - lo`` is about 0.018.

**The rule.** Let ``t`` be the k-th largest scan score of a query. The k rows of largest
scan score each have ``e >= t - B``, so the k-th largest exact score ``T >= t - B``, and
a row of the exact top-k has ``f >= e - B >= T - B >= t - 2B``. Every row with
``f >= cut = t - 2B`` is therefore re-scored exactly, and the top-k of those exact
scores (ties by the smaller row) is the answer. When the kept list is full and its
last scan score is still ``>= cut``, rows may have been dropped: the backend rescans
that query's segment and re-scores every row whose scan score (of the rescan, with
its own bound ``B'``) is ``>= t - B - B'`` (:meth:`TorchBackend.rescan_topk`; the
native kernel does the same in C++). Normally the re-scored set is about k rows;
with many near-ties it is exactly the near-tied rows.

**The exact score** (:func:`exact_pair_scores`): ``s = sum p_i`` in float64 (each
product of two float32 is exact in float64) with ``|s - q.x| <= gamma_d(2^-53) sum|p_i|``;
when both ends of that interval round to the same float32, that float32 is
``RN32(q.x)`` (rounding is monotone). Otherwise (about once in 10^6 scores, or for
scores within ~1e-13 of 0) the score is rounded exactly: the float32 neighbours are
walked until ``q.x`` lies between the two midpoints, each comparison with a midpoint
done exactly by ``math.fsum`` (Shewchuk's exact summation), ties to even.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..precision import U32, abs_error_term, gamma, input_terms, row_norm_max

#: float64 unit roundoff (float32's, U32, is defined with the rounding model in rfmem_fast.precision)
U64 = 2.0**-53
#: extra scan candidates kept beyond k (the re-scored set is decided by the bound, not by this)
SCAN_MARGIN = 8
#: the same per scan-copy type (the over-fetch of half-precision scans, whose bound is wider)
SCAN_MARGINS = {"float32": SCAN_MARGIN, "float16": 16, "bfloat16": 32, "int8": 64}
#: terms of d summed from zero per block on the native GEMM path (csrc/cpu/simd.h kGemmKc)
GEMM_KC = 64
#: input rounding unit of float32 matmuls under torch.get_float32_matmul_precision()
_MATMUL_INPUT_UNIT = {"highest": 0.0, "high": 2.0**-11, "medium": 2.0**-8}


def gemm_depth(d: int) -> int:
    """Roundings a product term goes through on the native GEMM path (module docstring)."""
    blocks = -(-int(d) // GEMM_KC)
    return min(int(d), GEMM_KC) + max(blocks - 1, 0)


def scan_error_coef(depth: int, acc_unit: float = U32, input_unit: float = 0.0, row_unit: float = 0.0) -> float:
    """Relative coefficient ``c`` of the bound ``|f - RN32(q.x)| <= c ||q|| ||x|| + abs_term``.

    Args:
        depth: most roundings one product term goes through in the scan kernel
            (multiplication + additions on its summation path), see the module docstring.
        acc_unit: unit roundoff of the accumulation (:data:`U32` or :data:`U64`); with
            :data:`U64` the float64 sum is taken to be rounded to float32 afterwards.
        input_unit: unit roundoff of an input conversion of both operands inside the
            kernel (0 for none; TF32 / bfloat16 matmuls).
        row_unit: unit roundoff of the rows' scan copy (0 for float32 rows; ``2^-11``
            float16, ``2^-8`` bfloat16: :func:`rfmem_fast.precision.input_terms`).

    Returns:
        float ``c`` (already inflated by ``2^-30`` relative for its own evaluation).
    """
    scan = (1.0 + input_unit) ** 2 * (1.0 + row_unit) * (1.0 + gamma(max(1, int(depth)), acc_unit)) - 1.0
    if acc_unit < U32:  # the float64 sum is rounded to float32 by the kernel
        scan = scan + U32 * (1.0 + scan)
    return (scan + U32) * (1.0 + 2.0**-30)


def matmul_input_unit(device: torch.device | str = "cpu") -> float:
    """Input rounding unit of torch float32 matmuls on ``device`` under the current settings.

    The most pessimistic of the legacy ``torch.get_float32_matmul_precision()`` ("highest"
    0, "high" TF32 ``2^-11``, "medium" bfloat16 ``2^-8``), ``allow_tf32`` on CUDA, and the
    newer per-backend ``fp32_precision`` ("tf32" / "bf16") of CUDA matmuls or of oneDNN
    (CPU); torch raises on the legacy getter when both APIs were used, then the
    per-backend settings decide. Unknown values count as bfloat16.
    """
    units = [0.0]
    try:
        units.append(_MATMUL_INPUT_UNIT.get(torch.get_float32_matmul_precision(), 2.0**-8))
    except RuntimeError:  # legacy and new precision APIs mixed
        pass
    fp32 = {"tf32": 2.0**-11, "bf16": 2.0**-8}
    if torch.device(device).type == "cuda":
        if torch.backends.cuda.matmul.allow_tf32:
            units.append(2.0**-11)
        units.append(fp32.get(str(getattr(torch.backends.cuda.matmul, "fp32_precision", "none")), 0.0))
    else:
        mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
        units.append(fp32.get(str(getattr(mkldnn, "fp32_precision", "none")), 0.0))
    return max(units)


def query_bounds(Q: torch.Tensor, coef: float, xnorm: float, row_abs: float = 0.0) -> torch.Tensor:
    """``B(q) = (coef R + row_abs) ||q|| + abs_term`` for each query (float64 [b], Q's device).

    ``row_abs``: the absolute input-rounding term of a half-precision scan copy
    (:func:`scan_bound_terms`; 0 for float32 rows).
    """
    qn = Q.to(torch.float64).norm(dim=1) * (1.0 + 2.0**-30)
    return (coef * xnorm + row_abs) * qn + abs_error_term(Q.shape[1])


def scan_bound_terms(
    depth: int, dtype: str, d: int, acc_unit: float = U32, input_unit: float = 0.0
) -> tuple[float, float]:
    """``(coef, row_abs)`` of a scan of depth ``depth`` over rows stored in ``dtype``.

    Args:
        depth: roundings per product term of the kernel (module docstring).
        dtype: "float32", "float16" or "bfloat16": the copy of the rows the scan reads.
        d: the dimension.
        acc_unit, input_unit: as :func:`scan_error_coef`.

    Returns:
        (coef for :func:`query_bounds`, row_abs for :func:`query_bounds`).
    """
    u_in, row_abs = input_terms(dtype, d)
    coef = scan_error_coef(depth, acc_unit, input_unit, u_in)
    return coef, row_abs * (1.0 + coef)


# --------------------------------------------------------------------------- exact scores
_NEG_INF: dict = {}  # device -> float64 tensor -inf (torch.nextafter needs a tensor)


def _neg_inf(device: torch.device) -> torch.Tensor:
    t = _NEG_INF.get(device)
    if t is None:
        t = _NEG_INF[device] = torch.tensor(-math.inf, dtype=torch.float64, device=device)
    return t


def _fsum_sign(products: list[float], minus: float) -> int:
    """Sign of ``sum(products) - minus``, computed exactly (math.fsum is exact up to its
    final rounding, which keeps the sign: every term is a multiple of 2^-1074)."""
    r = math.fsum(products + [-minus])
    return (r > 0) - (r < 0)


def round32_exact(q: np.ndarray, x: np.ndarray) -> np.float32:
    """``RN32(q . x)`` exactly, for float32 vectors (the slow path of :func:`exact_pair_scores`).

    Walks from the float32 nearest the float64 sum to the neighbour whose rounding
    interval holds the exact value; each comparison with a midpoint is exact.

    Args:
        q, x: float32 [d].

    Returns:
        np.float32, round to nearest, ties to even.
    """
    products = (q.astype(np.float64) * x.astype(np.float64)).tolist()  # exact products
    f = np.float32(math.fsum(products))
    inf = np.float32(np.inf)
    while True:
        up = np.nextafter(f, inf)
        c = _fsum_sign(products, (float(f) + float(up)) / 2.0)
        if c > 0 or (c == 0 and int(up.view(np.int32)) % 2 == 0):
            f = up
            continue
        dn = np.nextafter(f, -inf)
        c = _fsum_sign(products, (float(f) + float(dn)) / 2.0)
        if c < 0 or (c == 0 and int(dn.view(np.int32)) % 2 == 0):
            f = dn
            continue
        return f


def exact_pair_scores(
    X: torch.Tensor, Q: torch.Tensor, qi: torch.Tensor, rows: torch.Tensor, memory_budget: int
) -> torch.Tensor:
    """Exact scores ``RN32(Q[qi[j]] . X[rows[j]])`` of m (query, row) pairs.

    Float64 sums certified by their error bound (module docstring); the rare uncertain
    ones are rounded exactly on the CPU (:func:`round32_exact`). Works in chunks of
    pairs so that the float64 temporaries stay within ``memory_budget`` bytes.

    Args:
        X: float32 [n, d] bank rows (on Q's device, or on the host: the rows of the
            pairs are gathered there and moved); Q: float32 [b, d] queries.
        qi: int64 [m] query index of each pair; rows: int64 [m] row of each pair (Q's
            device).
        memory_budget: bytes for the temporaries (>= 1).

    Returns:
        float32 [m] on Q's device.
    """
    m, d = int(rows.shape[0]), int(X.shape[1])
    dev = Q.device
    out = torch.empty(m, dtype=torch.float32, device=dev)
    if m == 0:
        return out
    g = gamma(max(d, 1), U64) * (1.0 + 2.0**-30)
    step = max(1, int(memory_budget) // max(1, 4 * 8 * d))  # ~4 float64 [step, d] temporaries
    inf = -_neg_inf(dev)
    for a in range(0, m, step):
        r, qq = rows[a : a + step], qi[a : a + step]
        xr = X[r.to(X.device)].to(dev)
        p = xr.to(torch.float64) * Q[qq].to(torch.float64)
        s = p.sum(dim=1)
        e = g * p.abs().sum(dim=1)
        del p
        lo = torch.nextafter(s - e, _neg_inf(dev)).to(torch.float32)
        hi = torch.nextafter(s + e, inf).to(torch.float32)
        out[a : a + r.shape[0]] = lo
        unsure = (lo != hi).nonzero().squeeze(1)
        if unsure.numel():
            xs = xr[unsure].cpu().numpy()
            qs = Q[qq[unsure]].to(torch.float32).cpu().numpy()
            fix = np.array([round32_exact(qs[j], xs[j]) for j in range(xs.shape[0])], dtype=np.float32)
            out[a + unsure] = torch.from_numpy(fix).to(dev)
    return out


def exact_pair_scores_np(X: np.ndarray, Q: np.ndarray, qi: np.ndarray, rows: np.ndarray, step: int = 4096) -> np.ndarray:
    """:func:`exact_pair_scores` on host numpy arrays (the same certified float64 sums, the
    same exact fallback): ``RN32(Q[qi[j]] . X[rows[j]])`` of m pairs, float32 [m].

    Args:
        X: float32 [n, d] rows (may be memory-mapped: only the pairs' rows are read);
        Q: float32 [b, d]; qi, rows: int64 [m]; step: pairs per chunk.
    """
    m, d = int(rows.shape[0]), int(X.shape[1])
    out = np.empty(m, dtype=np.float32)
    g = gamma(max(d, 1), U64) * (1.0 + 2.0**-30)
    for a in range(0, m, step):
        r, qq = rows[a : a + step], qi[a : a + step]
        xr = X[r]
        p = xr.astype(np.float64) * Q[qq].astype(np.float64)
        s = p.sum(axis=1)
        e = g * np.abs(p).sum(axis=1)
        lo = np.nextafter(s - e, -np.inf).astype(np.float32)
        hi = np.nextafter(s + e, np.inf).astype(np.float32)
        out[a : a + r.shape[0]] = lo
        for j in np.flatnonzero(lo != hi):
            out[a + j] = round32_exact(Q[qq[j]].astype(np.float32), xr[j].astype(np.float32))
    return out


def order_by_score_row(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of each row of (scores, rows) by (score descending, row ascending).

    Args:
        scores: float32 [b, c]; rows: int64 [b, c]; an entry is a candidate where
            its row is >= 0 and its score > -inf.
        k: output width (may exceed c: padded).

    Returns:
        (scores float32 [b, k], rows int64 [b, k]), ``-inf`` / -1 padding.
    """
    big = torch.iinfo(torch.int64).max
    ok = (rows >= 0) & (scores > -math.inf)
    key = torch.where(ok, rows, big)
    key, perm = torch.sort(key, dim=1)
    sc = torch.gather(torch.where(ok, scores, -math.inf), 1, perm)
    sc, perm = torch.sort(sc, dim=1, descending=True, stable=True)
    key = torch.gather(key, 1, perm)
    b, c = sc.shape
    if c < k:
        sc = torch.nn.functional.pad(sc, (0, k - c), value=-math.inf)
        key = torch.nn.functional.pad(key, (0, k - c), value=big)
    sc, key = sc[:, :k], key[:, :k]
    return sc.contiguous(), torch.where(key == big, -1, key).contiguous()


def cut_scores(t: torch.Tensor, lower_gap: torch.Tensor, scan_gap: torch.Tensor) -> torch.Tensor:
    """``t - lower_gap - scan_gap`` rounded down (float64; -inf where ``t`` is -inf).

    ``t - lower_gap`` is a lower bound of the k-th exact score; a scan with bound
    ``scan_gap`` must re-score every row whose scan score reaches the returned cut.
    """
    return torch.nextafter(t.to(torch.float64) - lower_gap - scan_gap, _neg_inf(t.device))


def refine(
    X: torch.Tensor,
    Q: torch.Tensor,
    k: int,
    cand_scores: torch.Tensor,
    cand_rows: torch.Tensor,
    bound: torch.Tensor,
    memory_budget: int,
    seg_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact top-k from a scan's candidate lists, and the queries that need a rescan.

    Args:
        X: float32 [n, d] bank; Q: float32 [b, d] queries.
        k: top-k width (>= 1).
        cand_scores: float32 [b, w] scan scores sorted descending (ties in any order),
            ``-inf`` exactly where there is no candidate; w > k unless the list holds
            the whole segment.
        cand_rows: int64 [b, w] their rows (-1 where no candidate). A list is "full"
            when it has no padding: rows of the segment may have been left out.
        bound: float64 [b] the scan's ``B(q)`` (module docstring).
        memory_budget: bytes for the temporaries of the exact scores.
        seg_len: optional int64 [b] segment lengths: a list that holds all of its
            segment's rows is never "full".

    Returns:
        (scores float32 [b, k], rows int64 [b, k], need bool [b], lower float64 [b]):
        the exact top-k of every query whose candidates are provably sufficient;
        ``need`` marks the others (full list whose last scan score reaches the cut),
        whose rows must come from a rescan keeping the rows of scan score
        ``>= lower - B'`` (``lower = t - B`` bounds the k-th exact score from below).
    """
    b, w = cand_scores.shape
    if w >= k:
        t = cand_scores[:, k - 1]
    else:
        t = torch.full((b,), -math.inf, dtype=cand_scores.dtype, device=cand_scores.device)
    lower = t.to(torch.float64) - bound  # -inf where t is -inf
    cut = torch.nextafter(lower - bound, _neg_inf(t.device))
    s64 = cand_scores.to(torch.float64)
    sel = s64 >= cut[:, None]
    if w:
        full = cand_rows[:, -1] >= 0
        if seg_len is not None:
            full &= seg_len.to(full.device) > w
        need = full & sel[:, -1]
        sel &= ~need[:, None]
    else:
        need = torch.zeros(b, dtype=torch.bool, device=cand_scores.device)
    sel &= cand_rows >= 0
    qi, ci = sel.nonzero(as_tuple=True)
    ex = torch.full((b, w), -math.inf, dtype=torch.float32, device=cand_scores.device)
    rows = torch.full((b, w), -1, dtype=torch.int64, device=cand_scores.device)
    if qi.numel():
        r = cand_rows[qi, ci]
        ex[qi, ci] = exact_pair_scores(X, Q, qi, r, memory_budget)
        rows[qi, ci] = r
    scores, rows = order_by_score_row(ex, rows, k)
    return scores, rows, need, lower


__all__ = [
    "GEMM_KC",
    "SCAN_MARGIN",
    "SCAN_MARGINS",
    "U32",
    "U64",
    "abs_error_term",
    "cut_scores",
    "exact_pair_scores",
    "exact_pair_scores_np",
    "gamma",
    "gemm_depth",
    "matmul_input_unit",
    "order_by_score_row",
    "query_bounds",
    "refine",
    "round32_exact",
    "row_norm_max",
    "scan_bound_terms",
    "scan_error_coef",
]
