// Segmented top-k (one pass over each query's own segment) and the familiarity signals.
//
// Layout of the work:
//   1. queries are stably sorted by segment; the queries of one segment take one of two
//      paths, by the cost rule of gemm_pays (kernels.h):
//      * scan path: groups of at most kGroup queries; each group scans its segment once,
//        in tiles of rows small enough to stay in L1/L2 while every query of the group
//        scores them (4 rows per kernel call, inner loop over d on 16 float lanes; float32
//        rows at SIMD levels 1, 2: register blocks of rows x queries, simd_impl.inc
//        scan_rows_f32, which may also skip rows that provably miss the top-k:
//        TopkOptions::prune_ref, scan_pruned below);
//      * GEMM path (many queries of one long segment: a shared bank, a few large users):
//        units of up to ~160 queries (kGemmPanelBytes), packed into panels of NR queries
//        (simd.h); each unit reads its segment once in tiles of rows that stay in L2
//        while every panel scores them with a register-blocked micro-kernel (MR rows x NR
//        queries of accumulators, fused multiply-adds where the CPU has them); every
//        score is compared with its query's heap threshold straight from the MR x NR
//        micro-tile, so no [b, n] (or even [unit, tile]) score matrix is ever written;
//   2. each query keeps a bounded min-heap of its k + kScanMargin best float32 scores
//      (worst at the root); a score touches the heap only when it beats the current
//      worst kept one;
//   3. when there are fewer groups than threads (b = 1, or one user), each group's rows
//      are also split into parts whose partial lists are merged exactly;
//   4. exact re-scoring (rfmem_fast/backends/exact.py has the derivation): the float32
//      scan score f of any row is within B(q) = (c R + a_in) ||q|| + (d + 2) 2^-149 of its
//      exact score e = RN32(q.x), with c = (1 + u_in) (1 + gamma_n(2^-24)) - 1 + 2^-24
//      and n the depth of the kernel (roundings a product term goes through):
//        scan path  n = ceil(d / 16) + 4  (each of the 16 lanes adds its ceil(d / 16)
//                   products in order, then a 4-level tree; fused multiply-adds at
//                   SIMD levels 1, 2, none at level 0: fewer roundings, the same bound),
//        GEMM path  n = min(d, Kc) + ceil(d / Kc) - 1, Kc = kGemmKc = 64 (simd.h
//                   gemm_depth: blocks of Kc terms summed from zero, then added to the
//                   running sum),
//      R the largest row norm of the float32 bank, and for a half-precision scan copy
//      (ScanType kF16 / kBF16, the scan reading x' = round(x) instead of x) the input
//      rounding u_in = 2^-11 / 2^-8 plus a_in = sqrt(d) 2^-25 (float16 subnormals) /
//      sqrt(d) 2^-134 (bfloat16), scaled by (1 + gamma_n); u_in = a_in = 0 for float32.
//      With t the k-th best scan score, every row of the exact top-k has f >= t - 2B:
//      those candidates are re-scored exactly from the float32 rows (exact_score) and
//      the top k of (e desc, row asc) is the answer. When the heap was full and its
//      worst kept score is still >= t - 2B, rows may have been dropped: the query's
//      segment is rescanned (scan kernel, its own bound B') and every row with
//      f' >= t - B - B' is re-scored into a running exact top-k (rescan_query).
//
// int8 scan copy (TopkOptions::scan_i8, section "int8 scan" below; the proof is in
// docs/internals/exactness.md and rfmem_fast/backends/exact.py): the queries quantised to
// int16 once per call, exact int32 dots of int8 rows (simd.h i8_dots on the scan path,
// i8_gemm_panel on the GEMM path), a proven bound per (query, row) from the row's
// residual and norm bounds; the heaps keep upper keys U >= e, and step 4 becomes: L = the
// k-th largest lower key of the kept rows, re-score the kept rows with U >= L, rescan
// when the heap's worst kept U >= L.
//
// Filtered search (kernels.h SelTable, rfmem_fast/filters.py): a query of a mask-mode
// selection runs in its group like any other, its heap refusing the unselected rows
// (heap.h; the rescan of step 4 too), so its kept list and its k-th scan score are
// those of the selected rows; a query of a list-mode selection (at most a quarter of
// its segment, or any share when its queries would not take the GEMM path) is taken out
// of the groups and runs steps 2 and 4 over its listed rows only, with the scan path's lanes
// (gathered 4 at a time), in groups of up to kGroup queries of one selection sharing
// each tile of its rows (the rescan goes over the list too). Either way the result is the exact top-k of the
// selected rows, in the same order as an unfiltered search over a bank of only them.
//
// Ties: the final list is sorted by (exact score desc, row asc), i.e. the order of a
// stable sort by descending score. Determinism: the exact scores do not depend on the
// order of any computation, so a query's result does not depend on the rest of its
// batch, the path, the thread count, the scan copy's precision or the CPU, and a top-k
// is a prefix of every wider top-k.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "common.h"
#include "exact.h"
#include "heap.h"
#include "kernels.h"
#include "lexical.h"
#include "simd.h"

namespace rfmem {
namespace {

constexpr int kGroup = 16;                 // queries of one segment scored per tile (scan path)
constexpr int64_t kTileBytes = 64 << 10;   // bytes of X per tile (scan path)
// smallest row range worth an item of its own (parts), by whether the pool's helpers are
// awake (pool_awake_helpers: spinning after a recent region) or asleep: one query over
// 4,096 x 384 rows on 2 threads with awake helpers took 57-61 us in 8 parts of 512 rows,
// 48 us in 4, 44.5 us in 2 (AMD EPYC Zen 5: the small parts added more than the balance
// they bought); an asleep helper starts tens of us late, and then small parts leave its
// share to the caller instead of making the caller wait for its half
constexpr int64_t kMinPartRows = 2048;
constexpr int64_t kMinPartRowsAsleep = 512;
// Extra float32 candidates kept beyond k per scan copy type (the over-fetch; exact.py
// SCAN_MARGINS): float32 8, float16 16, bfloat16 32, int8 64, so that the kept list
// usually holds every row within the wider bound of a half-precision or int8 scan (2B ~
// 1e-3 / 8e-3 / 3e-2 of a cosine) and the segment is rarely rescanned; the re-scored set
// is decided by the error bound, not by this.
constexpr int64_t kScanMargin[4] = {8, 16, 32, 64};

std::atomic<int64_t> g_i8_min_rows{kI8MinRows};  // set_int8_min_rows

// The over-fetch of a call whose longest segment (or selection) has max_len rows: that
// of kScanMargin, and for the int8 copy max_len / 256 within [64, 128]: the rows whose
// int8 bracket reaches the k-th score grow with the segment (bench/bench_int8.py's
// clustered d = 384 rows, k = 10: up to ~95 at 1e5 rows, ~140 at 1e6), and a kept list
// that overflows costs a rescan of the whole segment for its query (a pass over n d
// bytes), while a longer list costs more keys kept and int8 dots re-done in the finish
// (k + 256 measured 8 % slower than k + 128 at 1e5 rows and no faster at 1e6).
int64_t scan_margin(ScanType t, int64_t max_len) {
  if (t != ScanType::kI8) return kScanMargin[static_cast<int>(t)];
  return std::min<int64_t>(128, std::max<int64_t>(kScanMargin[static_cast<int>(t)], max_len / 256));
}

// The over-fetch of a call whose GEMM units take byte queries (i8_gemm_panel_b): their
// keys' brackets are about twice as wide (the query's own rounding joins the row's), so
// the kept list must hold every row whose byte key reaches L, the k-th lower key of the
// int16 query (the finish re-keys its kept rows with it, i8_kth_lower), or the query's
// segment is rescanned. bench_int8.py's clustered d = 384 rows, k = 10 (64 queries each,
// a float64 model of the keys): p99 76 such rows at 4,096 rows, 172 at 1e5, 319 at 1e6
// (max 87, 180, 398). 128 rows, doubled for every tenfold rows past 1e4, within [128, 512]:
// at 1e5 rows 256 gave 3,311 q/s, 128 1,812 (rescans), 384 2,982 (a longer kept list);
// at 1e6 512 gave 452 q/s, 384 438, 256 280 (one thread, Zen 4).
int64_t byte_margin(int64_t max_len) {
  const double m = 128.0 * std::pow(2.0, std::log10(std::max<double>(1.0, static_cast<double>(max_len)) / 1e4));
  return std::min<int64_t>(512, std::max<int64_t>(128, std::llround(m)));
}

std::atomic<bool> g_i8_bytes{true};                   // set_int8_byte_queries
std::atomic<int64_t> g_i8_bytes_min{kI8ByteMinRows};  // (its min_rows)
constexpr int64_t kGemmPanelBytes = 256 << 10;  // packed query panels of one GEMM unit (L2)
constexpr int64_t kGemmTileBytes = 128 << 10;   // float32 rows of one GEMM tile (L2)

#if defined(__GNUC__)
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
#define RFMEM_INLINE inline __attribute__((always_inline))
RFMEM_INLINE v8 ld8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
RFMEM_INLINE float hsum16(v8 lo, v8 hi) {
  v8 s = lo + hi;  // lane l holds lanes l and l + 8 of the 16
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// Inner products of q with 4 rows, on 16 lanes: element j of d goes to lane j % 16,
// each lane accumulates in order of j, the lanes are reduced in a fixed tree.
// ``prefetch(j)`` is called at each step of 16 elements (the next rows' lines).
template <class Prefetch>
RFMEM_INLINE void dot4_p(const float* q, const float* x0, const float* x1, const float* x2, const float* x3,
                         int64_t d, float* out, const Prefetch& prefetch) {
  const v8 z = {0, 0, 0, 0, 0, 0, 0, 0};
  v8 a0l = z, a0h = z, a1l = z, a1h = z, a2l = z, a2h = z, a3l = z, a3h = z;
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
    prefetch(j);
    const v8 ql = ld8(q + j), qh = ld8(q + j + 8);
    a0l += ld8(x0 + j) * ql;
    a0h += ld8(x0 + j + 8) * qh;
    a1l += ld8(x1 + j) * ql;
    a1h += ld8(x1 + j + 8) * qh;
    a2l += ld8(x2 + j) * ql;
    a2h += ld8(x2 + j + 8) * qh;
    a3l += ld8(x3 + j) * ql;
    a3h += ld8(x3 + j + 8) * qh;
  }
  if (j < d) {  // tail: zero-padded to 16 lanes (adding +0 leaves a lane unchanged)
    const int64_t rem = d - j;
    float qt[16] = {0}, t0[16] = {0}, t1[16] = {0}, t2[16] = {0}, t3[16] = {0};
    std::memcpy(qt, q + j, rem * sizeof(float));
    std::memcpy(t0, x0 + j, rem * sizeof(float));
    std::memcpy(t1, x1 + j, rem * sizeof(float));
    std::memcpy(t2, x2 + j, rem * sizeof(float));
    std::memcpy(t3, x3 + j, rem * sizeof(float));
    const v8 ql = ld8(qt), qh = ld8(qt + 8);
    a0l += ld8(t0) * ql;
    a0h += ld8(t0 + 8) * qh;
    a1l += ld8(t1) * ql;
    a1h += ld8(t1 + 8) * qh;
    a2l += ld8(t2) * ql;
    a2h += ld8(t2 + 8) * qh;
    a3l += ld8(t3) * ql;
    a3h += ld8(t3 + 8) * qh;
  }
  out[0] = hsum16(a0l, a0h);
  out[1] = hsum16(a1l, a1h);
  out[2] = hsum16(a2l, a2h);
  out[3] = hsum16(a3l, a3h);
}

RFMEM_INLINE void dot4(const float* q, const float* x0, const float* x1, const float* x2,
                       const float* x3, int64_t d, float* out) {
  // the next 4 rows (contiguous in a segment scan): 16 d bytes over d / 16 steps, 256 B
  // per step (a prefetch never faults, past the end of the rows too)
  const char* next = reinterpret_cast<const char*>(x0 + 4 * d);
  dot4_p(q, x0, x1, x2, x3, d, out, [next](int64_t j) {
    __builtin_prefetch(next + j * 16);
    __builtin_prefetch(next + j * 16 + 64);
    __builtin_prefetch(next + j * 16 + 128);
    __builtin_prefetch(next + j * 16 + 192);
  });
}

// dot4 for 4 gathered rows, prefetching the 4 gathered rows n[0..3] that come next.
RFMEM_INLINE void dot4_gather(const float* q, const float* x0, const float* x1, const float* x2, const float* x3,
                              int64_t d, float* out, const float* const* n) {
  dot4_p(q, x0, x1, x2, x3, d, out, [n](int64_t j) {
    __builtin_prefetch(n[0] + j);
    __builtin_prefetch(n[1] + j);
    __builtin_prefetch(n[2] + j);
    __builtin_prefetch(n[3] + j);
  });
}
#else
#define RFMEM_INLINE inline
// Portable version with the same lane structure (same results).
RFMEM_INLINE void dot4(const float* q, const float* x0, const float* x1, const float* x2,
                       const float* x3, int64_t d, float* out) {
  const float* xs[4] = {x0, x1, x2, x3};
  for (int i = 0; i < 4; ++i) {
    float a[16] = {0};
    for (int64_t j = 0; j < d; ++j) a[j % 16] += xs[i][j] * q[j];
    float s[8];
    for (int l = 0; l < 8; ++l) s[l] = a[l] + a[l + 8];
    out[i] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  }
}
RFMEM_INLINE void dot4_gather(const float* q, const float* x0, const float* x1, const float* x2, const float* x3,
                              int64_t d, float* out, const float* const*) {
  dot4(q, x0, x1, x2, x3, d, out);
}
#endif

// Score rows [r0, r1) of X against nq queries; heaps[i] collects query i's top-k.
RFMEM_MULTIVERSION
void scan_rows(const float* X, int64_t d, int64_t r0, int64_t r1, const float* const* qs, int nq,
               Heap* heaps, int64_t tile_rows) {
  float sc[4];
  for (int64_t t0 = r0; t0 < r1; t0 += tile_rows) {
    const int64_t t1 = std::min(r1, t0 + tile_rows);
    for (int qi = 0; qi < nq; ++qi) {
      const float* q = qs[qi];
      Heap& hp = heaps[qi];
      float thr = hp.threshold();
      for (int64_t r = t0; r < t1; r += 4) {
        const int64_t cnt = std::min<int64_t>(4, t1 - r);
        const float* x0 = X + r * d;
        // rows past the tile end re-read the last valid row; their scores are unused
        const float* x1 = cnt > 1 ? x0 + d : x0;
        const float* x2 = cnt > 2 ? x0 + 2 * d : x0;
        const float* x3 = cnt > 3 ? x0 + 3 * d : x0;
        dot4(q, x0, x1, x2, x3, d, sc);
        for (int64_t i = 0; i < cnt; ++i) {
          if (sc[i] > thr) {
            hp.push(sc[i], r + i);
            thr = hp.threshold();
          }
        }
      }
    }
  }
}

// The copy of the bank a scan reads: the float32 rows, or their float16 / bfloat16 copy.
struct ScanSrc {
  const float* f32;
  const uint16_t* half;  // nullptr: scan the float32 rows
  ScanType type;
  const int8_t* i8 = nullptr;    // the int8 copy (type kI8), or nullptr
  const float* meta = nullptr;   // its per-row data [n, 3] (simd.h i8_score)
};

// Scan scores of 4 rows of the scan copy (the scan path's lanes, any precision).
inline void scan4(const ScanSrc& src, const SimdKernels& K, const float* q, int64_t r, int64_t cnt, int64_t d,
                  float* sc) {
  const int64_t o1 = cnt > 1 ? d : 0, o2 = cnt > 2 ? 2 * d : 0, o3 = cnt > 3 ? 3 * d : 0;
  if (src.half) {
    const uint16_t* x0 = src.half + r * d;
    K.dot4_half(q, x0, x0 + o1, x0 + o2, x0 + o3, d, src.type, sc);
  } else {
    const float* x0 = src.f32 + r * d;
    dot4(q, x0, x0 + o1, x0 + o2, x0 + o3, d, sc);
  }
}

// Error bound of one scan kernel: B(q) = (coef R + ain) ||q|| + abs (file comment, 4).
struct Bound {
  double coef;
  double ain;
};

Bound make_bound(int64_t depth, ScanType t, int64_t d) {
  double u_in = 0.0, a = 0.0;
  if (t == ScanType::kF16) {
    u_in = 4.8828125e-04;  // 2^-11
    a = 2.9802322387695312e-08;  // 2^-25: half the spacing of float16 subnormals
  } else if (t == ScanType::kBF16) {
    u_in = 3.90625e-03;  // 2^-8
    a = 4.591774807899561e-41;  // 2^-134
  }
  const double g = gamma_n(static_cast<double>(depth < 1 ? 1 : depth), kU32);
  return Bound{scan_coef(depth, u_in), std::sqrt(static_cast<double>(d)) * a * (1.0 + g) * kSlack};
}

// The bound B of a scan score (Bound b, rows of norm <= xnorm, a query of norm qnorm,
// absb = abs_bound(d)): |f - RN32(q.x)| <= B.
inline double bound_at(const Bound& b, double xnorm, double qnorm, double absb) {
  return (b.coef * xnorm + b.ain) * qnorm * kSlack + absb;
}

// What the exact re-scoring of one query needs.
struct ExactCtx {
  const float* X;  // float32 rows (the exact scores always read these)
  int64_t d;
  int64_t k;
  Bound scan;    // scan path (and rescans)
  Bound gemm;    // GEMM path
  double xnorm;  // upper bound of the row norms
  double absb;   // abs_bound(d)
  double g64;    // gamma_d(2^-53) * (1 + 2^-30), for exact_score

  double bound(const Bound& b, const float* q) const {
    double qq = 0.0;
    for (int64_t j = 0; j < d; ++j) qq += static_cast<double>(q[j]) * static_cast<double>(q[j]);
    return bound_at(b, xnorm, std::sqrt(qq), absb);
  }
};

constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// Prefetch (into L1) the cache lines of p[0:bytes].
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* b = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(b + o);
}

// Write the k best of cand[0:m] (exact scores) by (score desc, row asc), padded.
void emit(Entry* cand, int64_t m, int64_t k, float* out_s, int64_t* out_r) {
  const int64_t kk = std::min(k, m);
  std::partial_sort(cand, cand + kk, cand + m, better);
  write_padded(cand, kk, k, out_s, out_r);
}

// Lower bound of the k-th exact score of a query: t - B with t the k-th best scan score
// of its candidates (reorders cand); -inf when there are fewer than k finite ones.
double kth_lower(Entry* cand, int64_t nc, int64_t k, double B) {
  if (nc < k) return kNegInfD;
  std::nth_element(cand, cand + (k - 1), cand + nc, [](const Entry& x, const Entry& y) { return x.s > y.s; });
  const double t = cand[k - 1].s;
  if (!(t > kNegInfD)) return kNegInfD;
  return t - B;
}

// lower - B rounded down: the scan score every row of the exact top-k reaches
inline double cut_below(double lower, double B) { return std::nextafter(lower - B, kNegInfD); }

// Re-score exactly the candidates whose scan score reaches the cut; emit the top k.
// ``up``: every candidate's exact score is at most its key + up (the scan bound B for
// float32 scan scores, 0 for the int8 keys, upper bounds themselves). Beyond k of them,
// the candidates go in descending key order and the re-scoring stops at the first whose
// key + up is below the k-th best exact score found so far: every later one scores
// strictly below it (neither in the top k nor tied with it), so the result is that of
// re-scoring them all.
void rescore(const ExactCtx& c, const float* q, Entry* cand, int64_t nc, double cut, double up, float* out_s,
             int64_t* out_r) {
  int64_t n = 0;  // the candidates to re-score, in their order, first
  for (int64_t j = 0; j < nc; ++j)
    if (static_cast<double>(cand[j].s) >= cut) cand[n++] = cand[j];
  if (n > c.k) std::sort(cand, cand + n, better);  // descending keys
  // their rows are scattered over X (a cache miss each): prefetched kAhead rows ahead
  constexpr int64_t kAhead = 8;
  const int64_t bytes = c.d * static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) prefetch_bytes(c.X + cand[j].r * c.d, bytes);
  // the k best exact scores so far: a min-heap in out_s (emit overwrites it)
  float* hs = out_s;
  int64_t hn = 0;
  const auto gt = std::greater<float>();
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (hn == c.k) {
      const double key = static_cast<double>(cand[j].s);
      const double ub = up > 0.0 ? std::nextafter(key + up, std::numeric_limits<double>::infinity()) : key;
      if (ub < static_cast<double>(hs[0])) break;
    }
    if (j + kAhead < n) prefetch_bytes(c.X + cand[j + kAhead].r * c.d, bytes);
    const float e = exact_score(q, c.X + cand[j].r * c.d, c.d, c.g64);
    if (!(e > kNegInf)) continue;  // NaN and -inf are dropped
    cand[m++] = Entry{e, cand[j].r};
    if (hn < c.k) {
      hs[hn++] = e;
      std::push_heap(hs, hs + hn, gt);
    } else if (e > hs[0]) {
      std::pop_heap(hs, hs + hn, gt);
      hs[hn - 1] = e;
      std::push_heap(hs, hs + hn, gt);
    }
  }
  emit(cand, m, c.k, out_s, out_r);
}

// Rescan rows [a, e) for one query with the scan kernel: every row whose scan score
// reaches the cut is re-scored exactly into a running top-k (heap of capacity k at store).
RFMEM_MULTIVERSION
void rescan_query(const ExactCtx& c, const ScanSrc& src, const SimdKernels& K, const float* q, int64_t a,
                  int64_t e, double cut, Entry* store, float* out_s, int64_t* out_r, const uint8_t* mask) {
  Heap hp;
  hp.h = store;
  hp.k = c.k;
  hp.size = 0;
  hp.mask = mask;  // filtered search: the selected rows only
  hp.mask_base = a;
  const int64_t d = c.d;
  float sc[4];
  for (int64_t r = a; r < e; r += 4) {
    const int64_t cnt = std::min<int64_t>(4, e - r);
    scan4(src, K, q, r, cnt, d, sc);
    for (int64_t i = 0; i < cnt; ++i) {
      if (static_cast<double>(sc[i]) >= cut) {
        const float ex = exact_score(q, c.X + (r + i) * d, d, c.g64);
        if (ex > hp.threshold() || hp.size < hp.k) hp.push(ex, r + i);
      }
    }
  }
  emit(hp.h, hp.size, c.k, out_s, out_r);
}

// ---------------------------------------------------------------------------------------
// int8 scan (TopkOptions::scan_i8; the derivation is rfmem_fast/backends/exact.py, "int8
// scan copies"). Row x is stored as x8 = round(x / s_x) (int8, |x8| <= 127, s_x = max|x| /
// 127) with meta (s_x, rho_x >= ||x - s_x x8||, N_x >= ||x||); query q is quantised here
// to q16 = round(q / s) (int16, s = max|q| / i8_qmax(d)). The integer I = q16 . x8 is
// exact (simd.h i8_dots), and with a, b per query (i8_prepare) every row's upper key
// U = i8_upper(...) >= RN32(q.x) >= i8_lower(...) = lo. The heaps keep the k + 64 best
// keys U; with L the k-th largest lo of the kept rows (a lower bound of the k-th exact
// score T), a row of the exact top-k has U >= e >= T >= L: the kept rows with U >= L are
// re-scored exactly, and when a heap dropped rows whose U may reach L (its worst kept U
// >= L) the segment (or list) is rescanned, every row with U >= L re-scored. So
// ``cut`` on this path is L itself, in the same key space as the heaps (finish_query).

/// Most queries whose int32 dots one i8_dots call takes (the rest in further calls).
constexpr int kI8Chunk = 64;

/// The queries of a call as the int8 scan reads them (codes[i * dq ..], dq = d rounded up
/// to 16, zero beyond d; |code| <= min(i8_qmax(d), qcap): qcap 127 gives the byte queries
/// of i8_gemm_panel_b, the bound's derivation unchanged); false when the int8 scan cannot
/// bound them (d too large, a non-finite query, ||q|| xnorm >= 2^100: then the call scans
/// the float32 rows).
bool i8_prepare(const float* Q, int64_t b, int64_t d, double xnorm, std::vector<int16_t>& codes,
                std::vector<I8Query>& out, int32_t qcap = 32767) {
  const int32_t qmax = std::min(i8_qmax(d), qcap);
  if (qmax < 1 || !(xnorm >= 0.0) || !(xnorm < 1e30)) return false;
  const int64_t dq = (d + 15) / 16 * 16;
  codes.assign(static_cast<size_t>(b * dq), 0);
  out.resize(static_cast<size_t>(b));
  const double inv = 1.0 / (1.0 - gamma_n(static_cast<double>(d + 3), kU64));  // sums of d squares
  const double f16 = 1.0 + 16.0 * kU32;
  const double big = 1.2676506002282294e+30;  // 2^100
  auto up32 = [](double v) {  // the float32 >= v nearest v
    float f = static_cast<float>(v);
    if (static_cast<double>(f) < v) f = std::nextafter(f, std::numeric_limits<float>::infinity());
    return f;
  };
  for (int64_t i = 0; i < b; ++i) {
    const float* q = Q + i * d;
    int16_t* c = codes.data() + i * dq;
    double mx = 0.0, qq = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      const double v = static_cast<double>(q[j]);
      mx = std::max(mx, std::fabs(v));
      qq += v * v;
    }
    if (!std::isfinite(qq) || !(mx < 3.5e38)) return false;
    const double qn = std::sqrt(qq * inv) * kSlack;  // >= ||q||
    if (qn * xnorm >= big) return false;
    float s = static_cast<float>(mx / static_cast<double>(qmax));
    double rr = 0.0, S = 0.0;
    if (s > 0.0f) {
      const double sd = static_cast<double>(s);
      for (int64_t j = 0; j < d; ++j) {
        // nearbyint (round half to even) of |v| <= qmax < 2^51 without the libm call (one per
        // element, most of this function's time): adding and taking away 1.5 * 2^52 leaves
        // v rounded to an integer by the addition's own rounding, the same value
        double t = (static_cast<double>(q[j]) / sd + 6755399441055744.0) - 6755399441055744.0;
        t = std::min<double>(qmax, std::max<double>(-qmax, t));
        c[j] = static_cast<int16_t>(t);
        S += t * t;  // an exact integer (< 2^53)
        const double r = static_cast<double>(q[j]) - sd * t;  // sd * t exact; one rounding
        rr += r * r;
      }
    } else {
      s = 0.0f;
      rr = qq;
    }
    const double qt = std::sqrt(S) * static_cast<double>(s) * kSlack;  // >= ||s q16||
    const double rq = std::sqrt(rr * inv) * kSlack;                      // >= ||q - s q16||
    const double av = qt * f16 * kSlack;
    const double bv = ((rq + kU32 * qn) * f16 + 16.0 * kU32 * qt) * kSlack;
    out[static_cast<size_t>(i)] = I8Query{c, s, up32(av), up32(bv)};
  }
  return true;
}

// The int8 scan's keys of the rows xr[0:cnt] (global rows ids[0:cnt], increasing) for
// the queries qs[0:nq], pushed into heaps[0:nq].
RFMEM_MULTIVERSION
void i8_push(const ScanSrc& src, const SimdKernels& K, int64_t d, const int8_t* const* xr, const int64_t* ids,
             int cnt, const I8Query* const* qs, int nq, Heap* heaps) {
  const int16_t* qc[kI8Chunk];
  int32_t dots[4 * kI8Chunk];
  for (int q0 = 0; q0 < nq; q0 += kI8Chunk) {
    const int m = std::min(kI8Chunk, nq - q0);
    for (int j = 0; j < m; ++j) qc[j] = qs[q0 + j]->q;
    K.i8_dots(xr, cnt, qc, m, d, dots);
    for (int j = 0; j < m; ++j) {
      const I8Query& iq = *qs[q0 + j];
      Heap& hp = heaps[q0 + j];
      float thr = hp.threshold();
      for (int i = 0; i < cnt; ++i) {
        const float key = i8_upper(iq, src.meta + 3 * ids[i], dots[i * m + j]);
        if (key > thr) {
          hp.push(key, ids[i]);
          thr = hp.threshold();
        }
      }
    }
  }
}

// The keys i8_upper of ``cnt`` <= kI8Block contiguous rows (meta: the first one's, dots:
// their int32 dots with stride m) for one query; vectorised, the same float32 operations
// as i8_upper, so the same bits.
constexpr int kI8Block = 16;
RFMEM_MULTIVERSION
void i8_keys(const I8Query& iq, const float* meta, const int32_t* dots, int m, int cnt, float* key) {
  for (int i = 0; i < cnt; ++i) key[i] = i8_upper(iq, meta + 3 * i, dots[i * m]);
}

// The int8 scan of rows [r0, r1) (contiguous) for nq queries into the heaps[0:nq] (added to
// what they hold: a scan in tiles), each holding capacity 2 k in its storage: blocks of
// kI8Block rows, 4 rows per i8_dots call, every query of the group (or GEMM unit) scoring
// them while they are in L1; a block's keys are computed at once (i8_keys) and only those above the threshold go, in
// row order, to a Reservoir over the heap's storage (heap.h: the heap's set, without a
// sift per replacement; the int8 keys' wide margin keeps k + 16 .. k + 128 rows), made the
// heap at the end. With ``sout``, query j's key of row x is written at sout[j][x - r0]
// (TopkOptions::scores_out: upper bounds of RN32(q.x)).
void i8_scan(const ScanSrc& src, const SimdKernels& K, int64_t d, int64_t r0, int64_t r1,
             const I8Query* const* qs, int nq, Heap* heaps, Reservoir* res, float* const* sout = nullptr) {
  for (int i = 0; i < nq; ++i) res[i] = Reservoir::over(heaps[i]);
  const int8_t* xr[4];
  const int16_t* qc[kI8Chunk];
  int32_t dots[kI8Block * kI8Chunk];
  float key[kI8Block];
  // the rows 16 on are prefetched, 4 per step (contiguous; a prefetch past the copy's end
  // never faults): one query's scan at batch 1 runs at about twice the bandwidth
  constexpr int64_t kAhead = 16;
  for (int64_t r = r0; r < r1; r += kI8Block) {
    const int cnt = static_cast<int>(std::min<int64_t>(kI8Block, r1 - r));
    for (int q0 = 0; q0 < nq; q0 += kI8Chunk) {
      const int m = std::min(kI8Chunk, nq - q0);
      for (int j = 0; j < m; ++j) qc[j] = qs[q0 + j]->q;
      for (int t = 0; t < cnt; t += 4) {
        const int c4 = std::min(4, cnt - t);
        for (int i = 0; i < c4; ++i) xr[i] = src.i8 + (r + t + i) * d;
        if (q0 == 0) prefetch_bytes(src.i8 + (r + t + kAhead) * d, 4 * d);
        K.i8_dots(xr, c4, qc, m, d, dots + t * m);
      }
      for (int j = 0; j < m; ++j) {
        Reservoir& rs = res[q0 + j];
        i8_keys(*qs[q0 + j], src.meta + 3 * r, dots + j, m, cnt, key);
        if (sout != nullptr) std::copy(key, key + cnt, sout[q0 + j] + (r - r0));
        const float thr = rs.threshold();
        uint32_t pass = 0;
        for (int i = 0; i < cnt; ++i) pass |= static_cast<uint32_t>(key[i] > thr) << i;
        while (pass != 0) {
          const int i = __builtin_ctz(pass);
          pass &= pass - 1;
          if (key[i] > rs.threshold()) rs.push(key[i], r + i);
        }
      }
    }
  }
  for (int i = 0; i < nq; ++i) res[i].to_heap(heaps[i]);
}

// The same over the listed rows rows[0:m] (increasing), the next rows prefetched.
void i8_scan_list(const ScanSrc& src, const SimdKernels& K, int64_t d, const int64_t* rows, int64_t m,
                  const I8Query* const* qs, int nq, Heap* heaps) {
  const int8_t* xr[4];
  for (int64_t j = 0; j < m; j += 4) {
    const int cnt = static_cast<int>(std::min<int64_t>(4, m - j));
    for (int i = 0; i < cnt; ++i) xr[i] = src.i8 + rows[j + i] * d;
    for (int64_t t = j + 4; t < std::min(m, j + 8); ++t) {
      const char* p = reinterpret_cast<const char*>(src.i8 + rows[t] * d);
      for (int64_t o = 0; o < d; o += 64) __builtin_prefetch(p + o);
    }
    i8_push(src, K, d, xr, rows + j, cnt, qs, nq, heaps);
  }
}

// L: the k-th largest lower bound lo of the kept candidates cand[0:nc] (their rows
// re-scored in int8 exactly as the scan did), -inf when there are fewer than k; ``tmp``
// holds k entries (used as a bounded heap).
// ``rekey``: the candidates' keys came from another quantisation of the query (the byte
// queries of i8_gemm_panel_b): they are taken by those keys, best first, each one's
// int32 dot recomputed with iq (the int16 query) and its key replaced by iq's upper key U
// (tighter: the exact finish re-scores by it), L the k-th largest of iq's lower keys so
// far. Every key bounds its row's exact score, so L <= the k-th exact score T; once k
// rows are re-keyed and the next kept key is below L, so is every later one: those rows
// score below T and leave the candidates (nc becomes the rows re-keyed).
double i8_kth_lower(const ExactCtx& c, const ScanSrc& src, const SimdKernels& K, const I8Query& iq, Entry* cand,
                    int64_t& nc, Entry* tmp, bool rekey = false) {
  if (!rekey && nc < c.k) return kNegInfD;
  Heap hp;
  hp.h = tmp;
  hp.k = c.k;
  hp.size = 0;
  const int16_t* qc[1] = {iq.q};
  const int8_t* xr[4];
  int32_t dots[4];
  if (rekey) std::sort(cand, cand + nc, better);
  // the candidates' rows are scattered over the copy: prefetched 16 rows ahead
  for (int64_t j = 0; j < std::min<int64_t>(nc, 16); ++j) prefetch_bytes(src.i8 + cand[j].r * c.d, c.d);
  for (int64_t j = 0; j < nc; j += 4) {
    if (rekey && hp.size == hp.k && cand[j].s < hp.h[0].s) {
      nc = j;
      break;
    }
    const int cnt = static_cast<int>(std::min<int64_t>(4, nc - j));
    for (int i = 0; i < cnt; ++i) xr[i] = src.i8 + cand[j + i].r * c.d;
    for (int64_t t = j + 16; t < std::min(nc, j + 20); ++t) prefetch_bytes(src.i8 + cand[t].r * c.d, c.d);
    K.i8_dots(xr, cnt, qc, 1, c.d, dots);
    for (int i = 0; i < cnt; ++i) {
      const float* m = src.meta + 3 * cand[j + i].r;
      if (rekey) cand[j + i].s = i8_upper(iq, m, dots[i]);
      hp.push(i8_lower(iq, m, dots[i]), j + i);
    }
  }
  return hp.size < hp.k ? kNegInfD : static_cast<double>(hp.h[0].s);
}

// Rescan of one query over the rows row_at(0 .. m-1) (increasing) with the int8 keys:
// every row whose key reaches L is re-scored exactly into a running top-k (heap of
// capacity k at store, refusing the rows ``mask`` leaves out).
template <class RowAt>
void i8_rescan(const ExactCtx& c, const ScanSrc& src, const SimdKernels& K, const I8Query& iq, const float* q,
               int64_t m, const RowAt& row_at, double L, Entry* store, float* out_s, int64_t* out_r,
               const uint8_t* mask, int64_t mask_base) {
  Heap hp;
  hp.h = store;
  hp.k = c.k;
  hp.size = 0;
  hp.mask = mask;
  hp.mask_base = mask_base;
  const int16_t* qc[1] = {iq.q};
  const int8_t* xr[4];
  int64_t ids[4];
  int32_t dots[4];
  for (int64_t j = 0; j < m; j += 4) {
    const int cnt = static_cast<int>(std::min<int64_t>(4, m - j));
    for (int i = 0; i < cnt; ++i) {
      ids[i] = row_at(j + i);
      xr[i] = src.i8 + ids[i] * c.d;
    }
    K.i8_dots(xr, cnt, qc, 1, c.d, dots);
    for (int i = 0; i < cnt; ++i) {
      if (static_cast<double>(i8_upper(iq, src.meta + 3 * ids[i], dots[i])) < L) continue;
      if (mask != nullptr && !mask[ids[i] - mask_base]) continue;
      const float ex = exact_score(q, c.X + ids[i] * c.d, c.d, c.g64);
      if (ex > hp.threshold() || hp.size < hp.k) hp.push(ex, ids[i]);
    }
  }
  emit(hp.h, hp.size, c.k, out_s, out_r);
}

// The exact top-k of one query from its kept scan candidates (cand[0:nc], disjoint rows
// of its segment [a, e)); ``dropped``(cut) says whether rows of scan score >= cut may
// have been left out, in which case the segment is rescanned. ``iq``: the query's int8
// form when the scan read the int8 copy (keys are then upper bounds, and cut is L);
// ``rekey``: the candidates' keys came from the query's byte form (a byte-query GEMM
// unit): they are re-keyed with iq first (i8_kth_lower's ``rekey``).
template <class Dropped>
void finish_query(const ExactCtx& c, const ScanSrc& src, const SimdKernels& K, bool gemm, const float* q,
                  Entry* cand, int64_t nc, int64_t a, int64_t e, Entry* store, float* out_s, int64_t* out_r,
                  const Dropped& dropped, const uint8_t* mask, const I8Query* iq = nullptr,
                  bool rekey = false) {
  if (iq != nullptr) {
    // (re-keying may sort cand and drop its tail: ``dropped`` tests the kept list's worst
    // key, which the caller took before)
    const double L = i8_kth_lower(c, src, K, *iq, cand, nc, store, rekey);
    if (dropped(L))
      i8_rescan(c, src, K, *iq, q, e - a, [a](int64_t j) { return a + j; }, L, store, out_s, out_r, mask, a);
    else
      rescore(c, q, cand, nc, L, 0.0, out_s, out_r);
    return;
  }
  const double Bp = c.bound(gemm ? c.gemm : c.scan, q);
  const double lower = kth_lower(cand, nc, c.k, Bp);
  const double cut = cut_below(lower, Bp);
  if (dropped(cut)) {
    const double Bs = gemm ? c.bound(c.scan, q) : Bp;
    rescan_query(c, src, K, q, a, e, cut_below(lower, Bs), store, out_s, out_r, mask);
  } else {
    rescore(c, q, cand, nc, cut, Bp, out_s, out_r);
  }
}

// Filtered search, list mode: scan scores of the listed rows rows[j .. j + 3] (fewer at the
// list's end: the missing ones re-read its last row, their scores unused), with the scan
// path's lanes (gathered rows: the scan path's error bound), prefetching the next 4.
RFMEM_INLINE void scan4_list(const ScanSrc& src, const SimdKernels& K, const float* q, const int64_t* rows, int64_t j,
                       int64_t m, int64_t d, float* sc) {
  const int64_t cnt = std::min<int64_t>(4, m - j);
  const int64_t r0 = rows[j], r1 = rows[j + std::min<int64_t>(1, cnt - 1)], r2 = rows[j + std::min<int64_t>(2, cnt - 1)],
                r3 = rows[j + std::min<int64_t>(3, cnt - 1)];
  if (src.half) {
    K.dot4_half(q, src.half + r0 * d, src.half + r1 * d, src.half + r2 * d, src.half + r3 * d, d, src.type, sc);
  } else {
    const float* nx[4];  // the next 4 listed rows (the last one past the end)
    for (int t = 0; t < 4; ++t) nx[t] = src.f32 + rows[std::min<int64_t>(j + 4 + t, m - 1)] * d;
    dot4_gather(q, src.f32 + r0 * d, src.f32 + r1 * d, src.f32 + r2 * d, src.f32 + r3 * d, d, sc, nx);
  }
}

// The exact top-k of nq queries of one list-mode selection over its listed rows
// rows[0:m] (increasing, in their segment): the scan of step 2 over the listed rows only,
// in tiles of rows that stay in cache while every query of the group scores them (as
// scan_rows; a heap of the kw best scan scores per query in store[i kw : (i + 1) kw]),
// then step 4 per query: the candidates that can reach the k-th exact score re-scored,
// or, when its heap may have dropped such rows, the list rescanned into a running exact
// top-k (store[nq kw : nq kw + k]).
RFMEM_MULTIVERSION
void list_group(const ExactCtx& c, const ScanSrc& src, const SimdKernels& K, const float* const* qs, int nq,
                const int64_t* rows, int64_t m, int64_t kw, int64_t tile_rows, Entry* store, float* const* out_s,
                int64_t* const* out_r, const I8Query* const* iqs) {
  const int64_t d = c.d;
  float sc[4];
  Heap hps[kGroup];
  for (int i = 0; i < nq; ++i) {
    hps[i].h = store + static_cast<size_t>(i) * kw;
    hps[i].k = kw;
    hps[i].size = 0;
  }
  if (iqs != nullptr) {  // the int8 scan of the listed rows, then its exact finish (finish_query)
    i8_scan_list(src, K, d, rows, m, iqs, nq, hps);
    Entry* ex = store + static_cast<size_t>(nq) * kw;
    for (int i = 0; i < nq; ++i) {
      Heap& hp = hps[i];
      const bool filled = hp.size == kw && m > kw;
      const float worst = hp.size ? hp.h[0].s : kNegInf;
      const double L = i8_kth_lower(c, src, K, *iqs[i], hp.h, hp.size, ex);
      if (filled && static_cast<double>(worst) >= L)
        i8_rescan(c, src, K, *iqs[i], qs[i], m, [rows](int64_t j) { return rows[j]; }, L, ex, out_s[i], out_r[i],
                  nullptr, 0);
      else
        rescore(c, qs[i], hp.h, hp.size, L, 0.0, out_s[i], out_r[i]);
    }
    return;
  }
  for (int64_t t0 = 0; t0 < m; t0 += tile_rows) {
    const int64_t t1 = std::min(m, t0 + tile_rows);
    for (int i = 0; i < nq; ++i) {
      Heap& hp = hps[i];
      float thr = hp.threshold();
      for (int64_t j = t0; j < t1; j += 4) {
        scan4_list(src, K, qs[i], rows, j, m, d, sc);
        const int64_t cnt = std::min<int64_t>(4, t1 - j);
        for (int64_t t = 0; t < cnt; ++t) {
          if (sc[t] > thr) {
            hp.push(sc[t], rows[j + t]);
            thr = hp.threshold();
          }
        }
      }
    }
  }
  for (int i = 0; i < nq; ++i) {
    Heap& hp = hps[i];
    const float* q = qs[i];
    const bool filled = hp.size == kw && m > kw;  // rows were dropped only if the heap filled up
    const float worst = hp.size ? hp.h[0].s : kNegInf;
    const double B = c.bound(c.scan, q);
    const double lower = kth_lower(hp.h, hp.size, c.k, B);
    const double cut = cut_below(lower, B);
    if (!(filled && static_cast<double>(worst) >= cut)) {
      rescore(c, q, hp.h, hp.size, cut, B, out_s[i], out_r[i]);
      continue;
    }
    Heap ex;  // the rescan: every listed row of scan score >= cut, re-scored exactly
    ex.h = store + static_cast<size_t>(nq) * kw;
    ex.k = c.k;
    ex.size = 0;
    for (int64_t j = 0; j < m; j += 4) {
      scan4_list(src, K, q, rows, j, m, d, sc);
      const int64_t cnt = std::min<int64_t>(4, m - j);
      for (int64_t t = 0; t < cnt; ++t) {
        if (static_cast<double>(sc[t]) >= cut) {
          const float e = exact_score(q, c.X + rows[j + t] * d, d, c.g64);
          if (e > ex.threshold() || ex.size < ex.k) ex.push(e, rows[j + t]);
        }
      }
    }
    emit(ex.h, ex.size, c.k, out_s[i], out_r[i]);
  }
}

struct Group {
  int64_t seg;    // segment of every query of the group
  int64_t first;  // position of its first query in the sorted order
  int nq;         // number of queries
  bool gemm;      // GEMM path (else scan path)
  bool bytes;     // an int8 GEMM unit with byte queries (i8_gemm_panel_b)
};

// Queries per GEMM unit: whole panels of K.nr whose packed copy fits kGemmPanelBytes
// (elem: bytes per packed query element, 4 for float32 panels, 2 for the int8 path's
// int16 codes).
int64_t gemm_unit_queries(const SimdKernels& K, int64_t d, int64_t elem = 4) {
  const int64_t panel = static_cast<int64_t>(K.nr) * d * elem;
  return static_cast<int64_t>(K.nr) * std::max<int64_t>(1, kGemmPanelBytes / panel);
}

// Per-thread scratch of the GEMM path (floats): packed panels, a converted tile (half
// copies only), one micro-tile and one threshold row.
struct GemmScratch {
  int64_t panels = 0, tile = 0, c = 0, thr = 0;
  int64_t total() const { return panels + tile + c + thr; }
};

// One query's lexical hits inside the rows a pass scores (TopkOptions::hit_ptr): a
// cursor over its ascending local rows, each hit's key taken as its tile's scores pass.
struct HitCursor {
  const int32_t* rows = nullptr;  // the query's hits (local rows of its segment), ascending
  int64_t p = 0, pe = 0;          // next hit, end
  int64_t a = 0;                  // the segment's first row
  float* keys = nullptr;          // TopkOptions::hit_keys (indexed like rows)
  // the keys of the hits in rows [t0, t1) (the cursor at t0 or past it): row x's score at sc[(x - t0) * stride]
  void take(int64_t t0, int64_t t1, const float* sc, int64_t stride) {
    for (; p < pe && rows[p] + a < t1; ++p) keys[p] = sc[(rows[p] + a - t0) * stride];
  }
};

// What a group's pass records of its hits (TopkOptions::hit_up): none, scan scores
// (the scan bound), GEMM scores (the GEMM bound) or int8 keys (upper bounds).
enum class HitKeys { kNone, kScan, kGemm, kI8 };

// Rows per float32 GEMM tile: whole micro-tiles of K.mr rows in kGemmTileBytes.
int64_t gemm_tile_rows(const SimdKernels& K, int64_t d) {
  return std::max<int64_t>(K.mr, (kGemmTileBytes / (d * 4)) / K.mr * K.mr);
}

// Score rows [r0, r1) of the scan copy against the nq queries qs on the GEMM path
// (hc: null, or the queries' hit cursors: their keys taken from each panel's scores).
void gemm_scan(const ScanSrc& src, const SimdKernels& K, int64_t d, int64_t r0, int64_t r1,
               const float* const* qs, int nq, Heap* heaps, float* scratch, const GemmScratch& sz,
               HitCursor* hc = nullptr) {
  const int NR = K.nr;
  float* P = scratch;
  float* tile = P + sz.panels;
  float* cbuf = tile + sz.tile;
  float* thr = cbuf + sz.c;
  const int npan = (nq + NR - 1) / NR;
  for (int p = 0; p < npan; ++p) {  // P[p][j][q] = query (p NR + q)'s element j, 0 past nq
    float* Pp = P + static_cast<int64_t>(p) * d * NR;
    for (int q = 0; q < NR; ++q) {
      const int qi = p * NR + q;
      if (qi < nq) {
        const float* qv = qs[qi];
        for (int64_t j = 0; j < d; ++j) Pp[j * NR + q] = qv[j];
      } else {
        for (int64_t j = 0; j < d; ++j) Pp[j * NR + q] = 0.0f;
      }
    }
  }
  const int64_t rt = gemm_tile_rows(K, d);
  for (int64_t t0 = r0; t0 < r1; t0 += rt) {
    const int64_t cnt = std::min(rt, r1 - t0);
    const float* T = src.f32 + t0 * d;
    if (src.half) {
      K.to_f32(src.half + t0 * d, cnt * d, src.type, tile);
      T = tile;
    }
    for (int p = 0; p < npan; ++p) {
      const int pq = std::min(NR, nq - p * NR);
      K.gemm_panel(T, cnt, d, P + static_cast<int64_t>(p) * d * NR, pq, t0, heaps + static_cast<int64_t>(p) * NR,
                   cbuf, thr, hc != nullptr);
      if (hc)
        for (int q = 0; q < pq; ++q) hc[p * NR + q].take(t0, t0 + cnt, cbuf + q, NR);
    }
  }
}

// Rows per int16 tile of the int8 GEMM path: whole micro-tiles of K.i8_mr rows in kGemmTileBytes.
int64_t i8_tile_rows(const SimdKernels& K, int64_t dp) {
  const int64_t mr = K.i8_mr;
  return std::max<int64_t>(mr, (kGemmTileBytes / (dp * 2)) / mr * mr);
}

// The int8 rows x[0:cnt] (d bytes each) as int16 rows of dp elements (zero past d).
RFMEM_MULTIVERSION
void i8_widen(const int8_t* x, int64_t cnt, int64_t d, int64_t dp, int16_t* tile) {
  for (int64_t i = 0; i < cnt; ++i) {
    const int8_t* xi = x + i * d;
    int16_t* t = tile + i * dp;
    for (int64_t j = 0; j < d; ++j) t[j] = xi[j];
    if (dp > d) t[d] = 0;
  }
}

// Rows per tile of the byte-query GEMM path (int8 rows read in place): whole micro-tiles
// in kGemmTileBytes.
int64_t i8b_tile_rows(const SimdKernels& K, int64_t d) {
  const int64_t mr = K.i8_mr;
  return std::max<int64_t>(mr, (kGemmTileBytes / d) / mr * mr);
}

// out[i] = 128 * the sum of row i's d codes (rows x[0:cnt], d bytes each).
RFMEM_MULTIVERSION
void i8_row_sums(const int8_t* x, int64_t cnt, int64_t d, int32_t* out) {
  for (int64_t i = 0; i < cnt; ++i) {
    const int8_t* xi = x + i * d;
    int32_t t = 0;
    for (int64_t j = 0; j < d; ++j) t += xi[j];
    out[i] = 128 * t;
  }
}

// Whether a call's GEMM units take byte queries (i8_gemm_panel_b): the kernel exists
// (avx512_vnni), d is a multiple of 4 (rows read in place, whole quads) within
// kI8ByteMaxD, and set_int8_byte_queries has not turned them off.
bool i8_bytes_apply(const SimdKernels& K, int64_t d) {
  return K.i8_gemm_panel_b != nullptr && d % 4 == 0 && d <= kI8ByteMaxD && g_i8_bytes.load(std::memory_order_relaxed);
}

// The int8 GEMM path over rows [r0, r1) for the nq queries of a unit: the queries packed
// once into panels of K.i8_nr (int16 pairs as int32, simd.h i8_gemm_panel), the rows
// converted tile by tile to int16 (zero past d) and scored against every panel while in
// L2, the keys pushed into res[0:nq] (hc: null, or the queries' hit cursors: their keys
// taken from each panel's kept keys, scratch part sz.c). ``bytes``: the queries are byte
// queries (|code| <= 127) for i8_gemm_panel_b: panels of 4 codes + 128 as unsigned bytes,
// the rows read in place and only their code sums computed per tile.
void i8_gemm_scan(const ScanSrc& src, const SimdKernels& K, int64_t d, int64_t r0, int64_t r1,
                  const I8Query* const* qs, int nq, Reservoir* res, float* scratch, const GemmScratch& sz,
                  HitCursor* hc = nullptr, bool bytes = false) {
  const int64_t dp = (d + 1) / 2 * 2;
  const int64_t np = bytes ? d / 4 : dp / 2;  // int32 lanes of a query in its panel
  const int nr = K.i8_nr;
  int32_t* P = reinterpret_cast<int32_t*>(scratch);
  const int npan = (nq + nr - 1) / nr;
  for (int p = 0; p < npan; ++p) {
    int32_t* Pp = P + static_cast<int64_t>(p) * np * nr;
    for (int q = 0; q < nr; ++q) {
      const int qi = p * nr + q;
      const int16_t* c = qi < nq ? qs[qi]->q : nullptr;  // (codes zero-padded to a multiple of 16 >= dp)
      for (int64_t j = 0; j < np; ++j) {
        uint32_t w = 0;
        if (bytes) {  // codes 4j .. 4j + 3, each + 128 as an unsigned byte (a padding query's codes are 0)
          for (int t = 3; t >= 0; --t) w = (w << 8) | static_cast<uint8_t>((c ? c[4 * j + t] : 0) + 128);
        } else {  // codes 2j, 2j + 1 as int16
          const uint32_t lo = c ? static_cast<uint16_t>(c[2 * j]) : 0u, hi = c ? static_cast<uint16_t>(c[2 * j + 1]) : 0u;
          w = lo | (hi << 16);
        }
        Pp[j * nr + q] = static_cast<int32_t>(w);
      }
    }
  }
  int16_t* tile = reinterpret_cast<int16_t*>(scratch + sz.panels);  // int16 rows, or (bytes) the row sums
  int32_t* rsum = reinterpret_cast<int32_t*>(scratch + sz.panels);
  const int64_t rt = bytes ? i8b_tile_rows(K, d) : i8_tile_rows(K, dp);
  for (int64_t t0 = r0; t0 < r1; t0 += rt) {
    const int64_t cnt = std::min(rt, r1 - t0);
    if (bytes)
      i8_row_sums(src.i8 + t0 * d, cnt, d, rsum);
    else
      i8_widen(src.i8 + t0 * d, cnt, d, dp, tile);
    // the next tile's int8 rows are read into L2 while this one is scored, a part per panel
    const int64_t nbytes = std::min(rt, r1 - t0 - cnt) * d, part = (nbytes + npan - 1) / npan;
    const char* next = reinterpret_cast<const char*>(src.i8 + (t0 + cnt) * d);
    for (int p = 0; p < npan; ++p) {
      for (int64_t o = p * part; o < std::min(nbytes, (p + 1) * part); o += 64) __builtin_prefetch(next + o, 0, 2);
      const int pq = std::min(nr, nq - p * nr);
      float* kout = hc ? scratch + sz.panels + sz.tile : nullptr;
      const int32_t* Pp = P + static_cast<int64_t>(p) * np * nr;
      if (bytes)
        K.i8_gemm_panel_b(src.i8 + t0 * d, cnt, d, rsum, Pp, pq, t0, src.meta + 3 * t0, qs + p * nr, res + p * nr, kout);
      else
        K.i8_gemm_panel(tile, cnt, dp, Pp, pq, t0, src.meta + 3 * t0, qs + p * nr, res + p * nr, kout);
      for (int q = 0; hc && q < pq; ++q) hc[p * nr + q].take(t0, t0 + cnt, kout + q, nr);
    }
  }
}

// i8_gemm_scan into the (empty) heaps[0:nq], each holding capacity 2 k in its storage:
// the kernel pushes into Reservoirs over that storage (res[0:nq], scratch), which then
// leave in every heap exactly what its own pushes would have (heap.h Reservoir).
void i8_gemm_collect(const ScanSrc& src, const SimdKernels& K, int64_t d, int64_t r0, int64_t r1,
                     const I8Query* const* qs, int nq, Heap* heaps, Reservoir* res, float* scratch,
                     const GemmScratch& sz, HitCursor* hc = nullptr, bool bytes = false) {
  for (int i = 0; i < nq; ++i) res[i] = Reservoir::over(heaps[i]);
  i8_gemm_scan(src, K, d, r0, r1, qs, nq, res, scratch, sz, hc, bytes);
  for (int i = 0; i < nq; ++i) res[i].to_heap(heaps[i]);
}

// Per-thread scratch (floats, 64-byte aligned parts) of i8_gemm_scan for units of up to
// nq queries (keep: room for a tile's keys of a panel, the lexical hits'; bytes: byte
// panels and a tile's row sums instead of int16 panels and tile).
GemmScratch i8_gemm_scratch(const SimdKernels& K, int64_t d, int64_t nq, bool keep = false, bool bytes = false) {
  const int64_t round = 16, dp = (d + 1) / 2 * 2, nr = K.i8_nr;
  const int64_t rt = bytes ? i8b_tile_rows(K, d) : i8_tile_rows(K, dp);
  GemmScratch gs;
  gs.panels = ((nq + nr - 1) / nr * nr * (bytes ? d / 4 : dp / 2) + round - 1) / round * round;
  gs.tile = ((bytes ? rt : rt * dp / 2) + round - 1) / round * round;
  gs.c = keep ? (rt * nr + round - 1) / round * round : 0;
  return gs;
}

// The pruned scan of one group's rows [r0, r1) (TopkOptions::prune_ref): query i may
// skip row x once ref[x] + rad_i < t_i - B_i, t_i its heap's worst kept scan score
// (kw >= k rows scan >= t_i, each within B_i of its exact score: t_i - B_i is a lower
// bound of the k-th exact score) and ref[x] + rad_i an upper bound of its exact score of
// x. off_i = B_i + rad_i, rounded up. Skipped rows are never candidates; the exact
// finish and its rescan test are those of a full scan. Returns the rows scored.
int64_t scan_pruned(const ExactCtx& c, const SimdKernels& K, const TopkOptions& opt, const float* X, int64_t d,
                    int64_t r0, int64_t r1, const float* const* qs, int nq, Heap* heaps, const int64_t* qidx) {
  double off[kGroup];
  for (int i = 0; i < nq; ++i)
    off[i] = std::nextafter(c.bound(c.scan, qs[i]) + opt.prune_rad[qidx[i]], std::numeric_limits<double>::infinity());
  return K.scan_rows_f32_pruned(X, d, r0, r1, qs, nq, heaps, opt.prune_ref + (r0 - opt.prune_row0), off);
}

}  // namespace

int64_t set_int8_min_rows(int64_t rows) {
  g_i8_min_rows.store(rows < 0 ? kI8MinRows : rows, std::memory_order_relaxed);
  return int8_min_rows();
}

int64_t int8_min_rows() { return g_i8_min_rows.load(std::memory_order_relaxed); }

bool set_int8_byte_queries(bool on, int64_t min_rows) {
  g_i8_bytes_min.store(min_rows < 0 ? kI8ByteMinRows : min_rows, std::memory_order_relaxed);
  return g_i8_bytes.exchange(on, std::memory_order_relaxed);
}

int64_t int8_byte_min_rows() { return g_i8_bytes_min.load(std::memory_order_relaxed); }

bool int8_byte_queries(int64_t d) { return i8_bytes_apply(simd_kernels(), d); }

// The cost rule (kernels.h gemm_pays). Multiply-adds per second of one core, measured by
// bench/bench_gemm.py ("rates": one segment of 50,000 x 384 rows, 256 queries, AMD EPYC
// with AVX-512, bench/results/gemm-rates-crossover-amd-epyc.json): the scan path (groups of 16
// queries per tile; float32 rows at levels 1, 2 in register blocks of rows x queries,
// simd_impl.inc) 39 GMAC/s at AVX-512, 18 at AVX2 + FMA, ~15 at the baseline level (its
// own clones); the GEMM micro-kernel 87 GMAC/s (AVX-512), 45 (AVX2 + FMA), 9 (baseline,
// below the scan: never taken). A unit also has a fixed cost (packing its panels,
// per-micro-tile threshold checks, partial tiles) of about kGemmFixed queries' worth of
// scan work, fitted to the measured crossover ("crossover" in the same file and a finer
// sweep of nq = 8..64 on segments of 512 and 4,096 rows: the GEMM path wins from about
// 18 queries per segment at AVX-512, 10-14 at AVX2, on segments of >= 128 rows). The
// rule is monotone in nq at both levels (scan / GEMM rate below 1/2: a query more never
// turns GEMM back into scan).
namespace {
constexpr double kScanRate[3] = {15.0, 18.0, 39.0};
constexpr double kGemmRate[3] = {9.0, 45.0, 87.0};
constexpr int64_t kPanel[3] = {16, 16, 32};
constexpr double kGemmFixed = 3.5;
constexpr int64_t kGemmMinRows = 128;
}  // namespace

bool i8_gemm_pays(int64_t nq, int64_t seg_len) { return nq >= kI8GemmMinQueries && seg_len >= kGemmMinRows; }

bool gemm_pays(int64_t nq, int64_t seg_len, int64_t d, int level) {
  if (nq < 1 || seg_len < kGemmMinRows || d < 1) return false;
  level = std::max(0, std::min(level, 2));
  const int64_t nr = kPanel[level];
  const double padded = static_cast<double>((nq + nr - 1) / nr * nr);
  return padded * kScanRate[level] / kGemmRate[level] + kGemmFixed < static_cast<double>(nq);
}

void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U, const float* Q,
                    const int64_t* qseg, int64_t b, int64_t k, float* out_scores, int64_t* out_rows,
                    int num_threads, double xnorm) {
  TopkOptions opt;
  opt.num_threads = num_threads;
  opt.xnorm = xnorm;
  segmented_topk(X, n, d, offsets, U, Q, qseg, b, k, out_scores, out_rows, opt);
}

void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U, const float* Q,
                    const int64_t* qseg, int64_t b, int64_t k, float* out_scores, int64_t* out_rows,
                    const TopkOptions& opt) {
  (void)U;
  if (b == 0 || k == 0) return;
  if (opt.hit_up != nullptr)  // +inf: no keys recorded (the groups whose pass records them set theirs below)
    std::fill(opt.hit_up, opt.hit_up + b, std::numeric_limits<double>::infinity());
  const SimdKernels& K = simd_kernels();
  ScanSrc src{X, opt.scan, opt.scan ? opt.scan_type : ScanType::kF32};
  double xnorm = opt.xnorm;
  if (!(xnorm >= 0.0)) xnorm = row_norm_bound(X, n, d);
  // the int8 scan: every query quantised once (falls back to the float32 rows when the
  // int8 scan cannot bound the call's queries)
  std::vector<int16_t> i8codes, i8codes_b;
  std::vector<I8Query> i8q, i8q_b;
  bool i8_rows = false;  // the int8 copy pays: enough rows per queried segment (kI8MinRows)
  if (opt.scan_i8 != nullptr && opt.scan_meta != nullptr) {
    double rows = 0.0;
    for (int64_t i = 0; i < b; ++i) rows += static_cast<double>(offsets[qseg[i] + 1] - offsets[qseg[i]]);
    i8_rows = rows >= static_cast<double>(int8_min_rows()) * static_cast<double>(b);
  }
  if (i8_rows && i8_prepare(Q, b, d, xnorm, i8codes, i8q)) {
    src.i8 = opt.scan_i8;
    src.meta = opt.scan_meta;
    src.type = ScanType::kI8;
    src.half = nullptr;
  }
  auto iqp = [&](int64_t qi) -> const I8Query* { return src.i8 ? &i8q[static_cast<size_t>(qi)] : nullptr; };
  const ExactCtx ctx{X,
                     d,
                     k,
                     make_bound((d + 15) / 16 + 4, src.type, d),
                     make_bound(gemm_depth(d), src.type, d),
                     xnorm,
                     abs_bound(d),
                     gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64) * kSlack};

  // 0. filtered search: the queries of list-mode selections leave the groups (list_query);
  //    a mask-mode query stays, with its selection's mask on its heaps
  const SelTable* sel = opt.qsel != nullptr ? opt.sel : nullptr;
  auto qmask = [&](int64_t qi) -> const uint8_t* {
    if (sel == nullptr || opt.qsel[qi] < 0) return nullptr;
    return sel->mask + sel->mask_off[opt.qsel[qi]];
  };
  std::vector<int64_t> order, listed;
  order.reserve(static_cast<size_t>(b));
  std::vector<char> as_list;  // per selection: scored as a list (kernels.h SelTable, the rule)
  if (sel != nullptr) {
    std::vector<int64_t> users(static_cast<size_t>(sel->n), 0);
    for (int64_t i = 0; i < b; ++i)
      if (opt.qsel[i] >= 0) ++users[static_cast<size_t>(opt.qsel[i])];
    as_list.assign(static_cast<size_t>(sel->n), 0);
    for (int64_t i = 0; i < b; ++i) {
      const int64_t p = opt.qsel[i];
      if (p < 0 || as_list[static_cast<size_t>(p)]) continue;
      const int64_t len = offsets[qseg[i] + 1] - offsets[qseg[i]], m = sel->off[p + 1] - sel->off[p];
      (void)m;
      as_list[static_cast<size_t>(p)] =
          sel->mask_off[p] < 0 ||
          (opt.path != TopkPath::kGemm && !gemm_pays(users[static_cast<size_t>(p)], len, d, K.level));
    }
  }
  for (int64_t i = 0; i < b; ++i) {
    if (sel != nullptr && opt.qsel[i] >= 0 && as_list[static_cast<size_t>(opt.qsel[i])])
      listed.push_back(i);
    else
      order.push_back(i);
  }
  if (!listed.empty()) {  // groups of up to kGroup queries of one selection, sharing each tile of its rows
    std::stable_sort(listed.begin(), listed.end(), [&](int64_t x, int64_t y) { return opt.qsel[x] < opt.qsel[y]; });
    std::vector<int64_t> lstart;
    double lwork = 0.0;
    for (size_t i = 0; i < listed.size();) {
      size_t j = i + 1;
      while (j < listed.size() && j - i < static_cast<size_t>(kGroup) && opt.qsel[listed[j]] == opt.qsel[listed[i]]) ++j;
      lstart.push_back(static_cast<int64_t>(i));
      const int64_t p = opt.qsel[listed[i]];
      lwork += static_cast<double>(j - i) * static_cast<double>(sel->off[p + 1] - sel->off[p]) * static_cast<double>(d);
      i = j;
    }
    const int64_t nlg = static_cast<int64_t>(lstart.size());
    lstart.push_back(static_cast<int64_t>(listed.size()));
    const int lthreads = threads_for(opt.num_threads, lwork, nlg);
    int64_t lmax = 0;
    for (size_t i = 0; i + 1 < lstart.size(); ++i) {
      const int64_t p = opt.qsel[listed[static_cast<size_t>(lstart[i])]];
      lmax = std::max(lmax, sel->off[p + 1] - sel->off[p]);
    }
    const int64_t kwl = k + scan_margin(src.type, lmax);
    const int64_t per = kGroup * kwl + k;
    const int64_t ltile = std::max<int64_t>(4, (kTileBytes / (d * (src.half ? 2 : 4))) / 4 * 4);
    std::vector<Entry> lstore(static_cast<size_t>(lthreads) * per);  // allocated before the threads
    if (opt.after) opt.after->prepare(lthreads);
    parallel_for(nlg, lthreads, [&](int64_t t, int tid) {
      const int64_t g0 = lstart[static_cast<size_t>(t)], g1 = lstart[static_cast<size_t>(t) + 1];
      const int nq = static_cast<int>(g1 - g0);
      const int64_t p = opt.qsel[listed[static_cast<size_t>(g0)]];
      const float* qs[kGroup];
      const I8Query* iqs[kGroup];
      float* os[kGroup];
      int64_t* orr[kGroup];
      for (int i = 0; i < nq; ++i) {
        const int64_t qi = listed[static_cast<size_t>(g0 + i)];
        qs[i] = Q + qi * d;
        iqs[i] = iqp(qi);
        os[i] = out_scores + qi * k;
        orr[i] = out_rows + qi * k;
      }
      list_group(ctx, src, K, qs, nq, sel->rows + sel->off[p], sel->off[p + 1] - sel->off[p], kwl, ltile,
                 lstore.data() + static_cast<size_t>(tid) * per, os, orr, src.i8 ? iqs : nullptr);
      for (int i = 0; opt.after && i < nq; ++i) opt.after->done(listed[static_cast<size_t>(g0 + i)], tid);
    });
  }
  const int64_t nm = static_cast<int64_t>(order.size());
  if (nm == 0) return;

  // 1. queries sorted by segment (stable); each segment's queries take one path and are
  //    cut into groups (scan: kGroup queries; GEMM: balanced units of whole panels)
  std::stable_sort(order.begin(), order.end(), [qseg](int64_t a, int64_t c) { return qseg[a] < qseg[c]; });
  std::vector<Group> groups;
  double work = 0.0;  // multiply-adds of the scan
  const int64_t unit_max = gemm_unit_queries(K, d, src.i8 && K.i8_gemm_panel ? 2 : 4);
  int max_nq = 0, max_gemm_nq = 0;
  // the int8 GEMM units that take byte queries: those over segments of int8_byte_min_rows()
  // rows or more, where the kernel exists (i8_bytes_apply)
  const bool i8b_ok = src.i8 && K.i8_gemm_panel && i8_bytes_apply(K, d);
  const int64_t i8b_min = g_i8_bytes_min.load(std::memory_order_relaxed);
  auto i8b_len = [&](int64_t len) { return i8b_ok && len >= i8b_min; };
  for (int64_t i = 0; i < nm;) {
    const int64_t seg = qseg[order[i]];
    int64_t j = i;
    while (j < nm && qseg[order[j]] == seg) ++j;
    const int64_t g = j - i, len = offsets[seg + 1] - offsets[seg];
    bool gemm = len > 0 && (opt.path == TopkPath::kGemm ||
                            (opt.path == TopkPath::kAuto &&
                             (src.i8 && K.i8_gemm_panel ? i8_gemm_pays(g, len) : gemm_pays(g, len, d, K.level))));
    int64_t per = kGroup;
    if (gemm) {
      const int64_t units = (g + unit_max - 1) / unit_max;
      per = ((g + units - 1) / units + K.nr - 1) / K.nr * K.nr;  // balanced, whole panels
    }
    for (int64_t f = i; f < j; f += per) {
      const int nq = static_cast<int>(std::min(per, j - f));
      groups.push_back(Group{seg, f, nq, gemm, gemm && i8b_len(len)});
      max_nq = std::max(max_nq, nq);
      if (gemm) max_gemm_nq = std::max(max_gemm_nq, nq);
    }
    work += static_cast<double>(g) * static_cast<double>(len) * static_cast<double>(d);
    i = j;
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  // schedule the most work first (the work counter then balances the tail)
  std::vector<int64_t> gorder(ng);
  std::iota(gorder.begin(), gorder.end(), int64_t{0});
  auto gwork = [&](int64_t x) {
    return static_cast<double>(groups[x].nq) * static_cast<double>(offsets[groups[x].seg + 1] - offsets[groups[x].seg]);
  };
  std::stable_sort(gorder.begin(), gorder.end(), [&](int64_t x, int64_t y) { return gwork(x) > gwork(y); });

  // 2. threads the work pays for; row parts per group when there are too few groups
  // (kAuto: the caller alone after an idle gap or when no core is idle, pool.h PoolCall)
  const PoolCall pool_call(threads_for(opt.num_threads, work, std::numeric_limits<int64_t>::max()), work);
  int nthreads = pool_call.threads();
  int64_t max_len = 0;
  for (const Group& g : groups) max_len = std::max(max_len, offsets[g.seg + 1] - offsets[g.seg]);
  int64_t parts = 1;
  if (nthreads > 1 && ng < 4 * nthreads) {  // >= 4 items a thread: the last item leaves little idle
    parts = (4 * nthreads + ng - 1) / ng;
    const bool awake = pool_awake_helpers() >= nthreads - 1;
    parts = std::max<int64_t>(1, std::min(parts, max_len / (awake ? kMinPartRows : kMinPartRowsAsleep)));
  }
  const int64_t tile_rows = std::max<int64_t>(4, (kTileBytes / (d * 4)) / 4 * 4);

  const int64_t items = ng * parts;
  nthreads = static_cast<int>(std::min<int64_t>(nthreads, items));
  // the byte-query GEMM units (Group::bytes; twice the multiply-adds per instruction):
  // every query quantised a second time to |code| <= 127, their keys from those codes,
  // their exact finish re-keyed with the int16 codes; the kept list sized for the longest
  // such segment
  int64_t max_bytes_len = 0;
  for (const Group& g : groups)
    if (g.bytes) max_bytes_len = std::max(max_bytes_len, offsets[g.seg + 1] - offsets[g.seg]);
  const bool i8b = max_bytes_len > 0 && i8_prepare(Q, b, d, xnorm, i8codes_b, i8q_b, 127);
  auto iqg = [&](int64_t qi, const Group& g) -> const I8Query* {  // the form a group's keys come from
    return src.i8 ? (g.bytes && i8b ? &i8q_b[static_cast<size_t>(qi)] : &i8q[static_cast<size_t>(qi)]) : nullptr;
  };
  // candidates kept per query
  const int64_t kw = k + (i8b ? std::max(byte_margin(max_bytes_len), scan_margin(src.type, max_len))
                              : scan_margin(src.type, max_len));
  // per-thread scratch, allocated before the threads start: max_nq heaps of capacity kw
  // and one exact heap of capacity k (rescans); GEMM panels, tile and micro-tile
  // (the int8 paths' heaps hold 2 kw: room for their Reservoirs, i8_scan and i8_gemm_collect)
  const int64_t hstride = src.i8 ? 2 * kw : kw;
  // the lexical hits' keys (TopkOptions::hit_ptr): per query a cursor, per thread a tile of
  // kHitTile rows' scan scores for kGroup queries (scan paths without scores_out)
  const bool rec = opt.hit_ptr != nullptr && opt.hit_rows != nullptr && opt.hit_keys != nullptr && opt.hit_up != nullptr;
  constexpr int64_t kHitTile = 1024;
  std::vector<HitCursor> hit_cur(rec ? static_cast<size_t>(nthreads) * max_nq : 0);
  std::vector<float> hit_tile(rec && !opt.scores_out ? static_cast<size_t>(nthreads) * kGroup * kHitTile : 0);
  const bool pruned = !src.i8 && !src.half && K.scan_rows_f32_pruned && opt.prune_ref;
  auto hit_keys = [&](const Group& g) {  // what group g's pass records of its hits
    if (src.i8)  // (level 0's GEMM units run the scan with more than kGroup queries: none)
      return g.gemm && !K.i8_gemm_panel ? HitKeys::kNone : HitKeys::kI8;
    if (g.gemm) return HitKeys::kGemm;
    if (pruned || (src.half ? K.level < 1 : K.scan_rows_f32 == nullptr)) return HitKeys::kNone;
    return HitKeys::kScan;
  };
  const size_t per_thread = static_cast<size_t>(max_nq * hstride + k);
  std::vector<Entry> heap_store(static_cast<size_t>(nthreads) * per_thread);
  std::vector<Heap> heap_objs(static_cast<size_t>(nthreads) * max_nq);
  std::vector<Reservoir> res_objs(src.i8 ? static_cast<size_t>(nthreads) * max_nq : 0);
  std::vector<const float*> qptrs(static_cast<size_t>(nthreads) * max_nq);
  std::vector<const I8Query*> iqptrs(src.i8 ? static_cast<size_t>(nthreads) * max_nq : 0);
  GemmScratch gs;
  if (max_gemm_nq > 0 && src.i8 && K.i8_gemm_panel) {  // int8 panels (int32 pairs) and an int16 tile
    // room for both kinds of unit: a call may hold byte-query units (long segments) and
    // int16 ones (segments below int8_byte_min_rows)
    gs = i8_gemm_scratch(K, d, max_gemm_nq, rec);
    if (i8b) {
      const GemmScratch gb = i8_gemm_scratch(K, d, max_gemm_nq, rec, true);
      gs.panels = std::max(gs.panels, gb.panels);
      gs.tile = std::max(gs.tile, gb.tile);
      gs.c = std::max(gs.c, gb.c);
    }
  } else if (max_gemm_nq > 0 && !src.i8) {
    const int64_t round = 16;  // floats: keeps each part 64-byte aligned
    const int64_t rt = gemm_tile_rows(K, d);
    gs.panels = ((max_gemm_nq + K.nr - 1) / K.nr * K.nr * d + round - 1) / round * round;
    gs.tile = src.half ? (rt * d + round - 1) / round * round : 0;
    gs.c = ((rec ? rt : static_cast<int64_t>(K.mr)) * K.nr + round - 1) / round * round;  // (rec: every score kept)
    gs.thr = (K.nr + round - 1) / round * round;
  }
  std::vector<float> gemm_store(static_cast<size_t>(nthreads) * gs.total() + 16);
  float* gemm_base = gemm_store.data();
  while (reinterpret_cast<uintptr_t>(gemm_base) % 64) ++gemm_base;
  // partial lists [b (sorted position), parts, kw] when the rows are split
  std::vector<float> part_s;
  std::vector<int64_t> part_r;
  if (parts > 1) {
    part_s.resize(static_cast<size_t>(b) * parts * kw);
    part_r.resize(static_cast<size_t>(b) * parts * kw);
  }

  if (rec) {  // each query's offset: its path's bound (int8 keys: 0), before any query finishes (opt.after)
    for (const Group& g : groups) {
      const HitKeys hk = hit_keys(g);
      for (int i = 0; i < g.nq && hk != HitKeys::kNone; ++i) {
        const int64_t qi = order[g.first + i];
        opt.hit_up[qi] = hk == HitKeys::kI8 ? 0.0 : ctx.bound(hk == HitKeys::kGemm ? ctx.gemm : ctx.scan, Q + qi * d);
      }
    }
  }
  if (opt.after) opt.after->prepare(nthreads);
  std::atomic<int64_t> scored{0};  // rows the scans scored (opt.rows_scored)
  parallel_for(items, nthreads, [&](int64_t it, int tid) {
    const int64_t gi = gorder[it / parts];
    const Group& g = groups[gi];
    const int64_t p = it % parts;
    const int64_t a = offsets[g.seg], e = offsets[g.seg + 1];
    const int64_t len = e - a;
    // part p covers rows [a + len*p/parts, a + len*(p+1)/parts)
    const int64_t r0 = a + len * p / parts, r1 = a + len * (p + 1) / parts;
    Heap* heaps = heap_objs.data() + static_cast<size_t>(tid) * max_nq;
    const float** qs = qptrs.data() + static_cast<size_t>(tid) * max_nq;
    const I8Query** iqs = src.i8 ? iqptrs.data() + static_cast<size_t>(tid) * max_nq : nullptr;
    Entry* store = heap_store.data() + static_cast<size_t>(tid) * per_thread;
    for (int i = 0; i < g.nq; ++i) {
      heaps[i].h = store + static_cast<size_t>(i) * hstride;
      heaps[i].k = kw;
      heaps[i].size = 0;
      heaps[i].mask = qmask(order[g.first + i]);
      heaps[i].mask_base = a;
      qs[i] = Q + order[g.first + i] * d;
      if (iqs) iqs[i] = iqg(order[g.first + i], g);
    }
    const HitKeys hk = rec ? hit_keys(g) : HitKeys::kNone;
    HitCursor* hc = nullptr;  // the group's hit cursors, from its first hit at or past r0
    if (hk != HitKeys::kNone) {
      hc = hit_cur.data() + static_cast<size_t>(tid) * max_nq;
      for (int i = 0; i < g.nq; ++i) {
        const int64_t qi = order[g.first + i];
        const int32_t* h0 = opt.hit_rows + opt.hit_ptr[qi];
        const int32_t* h1 = opt.hit_rows + opt.hit_ptr[qi + 1];
        hc[i] = HitCursor{opt.hit_rows, std::lower_bound(h0, h1, static_cast<int32_t>(r0 - a)) - opt.hit_rows,
                          opt.hit_ptr[qi + 1], a, opt.hit_keys};
      }
    }
    if (r1 > r0) {
      int64_t rows = r1 - r0;
      Reservoir* res = src.i8 ? res_objs.data() + static_cast<size_t>(tid) * max_nq : nullptr;
      // the scan paths that can write every row's scan score (sout) or int8 key
      auto scan = [&](int64_t t0, int64_t t1, float* const* so) {
        if (src.i8)
          i8_scan(src, K, d, t0, t1, iqs, g.nq, heaps, res, so);
        else if (src.half)
          K.scan_rows_half(src.half, src.type, d, t0, t1, qs, g.nq, heaps, tile_rows, so);
        else
          K.scan_rows_f32(X, d, t0, t1, qs, g.nq, heaps, so);
      };
      if (src.i8 && g.gemm && K.i8_gemm_panel)
        i8_gemm_collect(src, K, d, r0, r1, iqs, g.nq, heaps, res, gemm_base + static_cast<size_t>(tid) * gs.total(), gs,
                        hc, g.bytes && i8b);
      else if (g.gemm && !src.i8)
        gemm_scan(src, K, d, r0, r1, qs, g.nq, heaps, gemm_base + static_cast<size_t>(tid) * gs.total(), gs, hc);
      else if (pruned)
        rows = scan_pruned(ctx, K, opt, X, d, r0, r1, qs, g.nq, heaps, order.data() + g.first);
      else if (!src.i8 && !src.half && !K.scan_rows_f32)
        scan_rows(X, d, r0, r1, qs, g.nq, heaps, tile_rows);
      else if (opt.scores_out && !g.gemm) {  // every row's scan score (int8: key) out, the hits' keys from them
        float* sout[kGroup];
        for (int i = 0; i < g.nq; ++i) sout[i] = opt.scores_out + order[g.first + i] * opt.scores_ld + (r0 - a);
        scan(r0, r1, sout);
        for (int i = 0; hc && i < g.nq; ++i) hc[i].take(r0, r1, sout[i], 1);
      } else if (hc) {  // tiles of kHitTile rows' scores in scratch, the hits' keys from them
        float* sout[kGroup];
        for (int i = 0; i < g.nq; ++i)
          sout[i] = hit_tile.data() + (static_cast<size_t>(tid) * kGroup + i) * static_cast<size_t>(kHitTile);
        for (int64_t t0 = r0; t0 < r1; t0 += kHitTile) {
          const int64_t t1 = std::min(r1, t0 + kHitTile);
          scan(t0, t1, sout);
          for (int i = 0; i < g.nq; ++i) hc[i].take(t0, t1, sout[i], 1);
        }
      } else {
        scan(r0, r1, nullptr);
      }
      if (opt.rows_scored) scored.fetch_add(rows, std::memory_order_relaxed);
    }
    for (int i = 0; i < g.nq; ++i) {
      Heap& hp = heaps[i];
      if (parts == 1) {
        const int64_t qi = order[g.first + i];
        // rows were dropped only if the heap filled up; they all scored <= its root
        const bool filled = hp.size == kw && len > kw;
        const float worst = hp.size ? hp.h[0].s : kNegInf;
        finish_query(ctx, src, K, g.gemm, qs[i], hp.h, hp.size, a, e, store + max_nq * hstride, out_scores + qi * k,
                     out_rows + qi * k, [&](double cut) { return filled && static_cast<double>(worst) >= cut; },
                     hp.mask, iqp(qi), g.bytes && i8b);
        hp.size = 0;
        if (opt.after) opt.after->done(qi, tid);
      } else {
        const size_t off = ((static_cast<size_t>(g.first) + i) * parts + p) * kw;
        hp.drain(part_s.data() + off, part_r.data() + off);  // the root (worst) first
      }
    }
  });

  if (opt.rows_scored) *opt.rows_scored += scored.load();
  if (opt.scores_out && opt.scores_written && (src.i8 || K.scan_rows_f32) && !opt.prune_ref)
    for (const Group& g : groups)  // the queries whose scan wrote every row's score
      if (!g.gemm)
        for (int i = 0; i < g.nq; ++i) opt.scores_written[order[g.first + i]] = 1;
  if (parts > 1) {  // merge of the partial lists (disjoint rows), then the exact re-scoring
    // candidate buffers per thread, allocated here so that nothing throws in the threads
    std::vector<std::vector<Entry>> cands(static_cast<size_t>(nthreads));
    for (auto& c : cands) c.reserve(static_cast<size_t>(parts * kw));
    parallel_for(ng, nthreads, [&](int64_t gi, int tid) {
      const Group& g = groups[gi];
      const int64_t a = offsets[g.seg], e = offsets[g.seg + 1];
      const int64_t len = e - a;
      std::vector<Entry>& cand = cands[static_cast<size_t>(tid)];
      for (int i = 0; i < g.nq; ++i) {
        cand.clear();
        const size_t base = (static_cast<size_t>(g.first) + i) * parts * kw;
        for (int64_t p = 0; p < parts; ++p) {
          const size_t off = base + p * kw;
          for (int64_t j = 0; j < kw && part_r[off + j] >= 0; ++j) cand.push_back(Entry{part_s[off + j], part_r[off + j]});
        }
        const int64_t qi = order[g.first + i];
        auto dropped = [&](double cut) {  // a part whose list filled up may have dropped rows >= cut
          for (int64_t p = 0; p < parts; ++p) {
            const size_t off = base + p * kw;
            const int64_t prows = len * (p + 1) / parts - len * p / parts;
            if (part_r[off + kw - 1] >= 0 && prows > kw && static_cast<double>(part_s[off]) >= cut) return true;
          }
          return false;
        };
        Entry* store = heap_store.data() + static_cast<size_t>(tid) * per_thread + max_nq * hstride;
        finish_query(ctx, src, K, g.gemm, Q + qi * d, cand.data(), static_cast<int64_t>(cand.size()), a, e, store,
                     out_scores + qi * k, out_rows + qi * k, dropped, qmask(qi), iqp(qi), g.bytes && i8b);
        if (opt.after) opt.after->done(qi, tid);
      }
    });
  }
}

bool int8_bounds(const int8_t* codes, const float* meta, int64_t n, int64_t d, const float* Q, int64_t b, double xnorm,
                 float* lower, float* upper, bool gemm, bool bytes) {
  std::vector<int16_t> qc;
  std::vector<I8Query> iq;
  if (!i8_prepare(Q, b, d, xnorm, qc, iq, bytes ? 127 : 32767)) return false;
  const SimdKernels& K = simd_kernels();
  const int8_t* xr[4];
  const int16_t* qp[kI8Chunk];
  int32_t dots[4 * kI8Chunk];
  for (int64_t q0 = 0; q0 < b; q0 += kI8Chunk) {  // the queries in chunks, as i8_push
    const int m = static_cast<int>(std::min<int64_t>(kI8Chunk, b - q0));
    for (int j = 0; j < m; ++j) qp[j] = iq[static_cast<size_t>(q0 + j)].q;
    for (int64_t r = 0; r < n; r += 4) {
      const int cnt = static_cast<int>(std::min<int64_t>(4, n - r));
      for (int t = 0; t < cnt; ++t) xr[t] = codes + (r + t) * d;
      K.i8_dots(xr, cnt, qp, m, d, dots);
      for (int j = 0; j < m; ++j) {
        const I8Query& q = iq[static_cast<size_t>(q0 + j)];
        for (int t = 0; t < cnt; ++t) {
          lower[(q0 + j) * n + r + t] = i8_lower(q, meta + 3 * (r + t), dots[t * m + j]);
          upper[(q0 + j) * n + r + t] = i8_upper(q, meta + 3 * (r + t), dots[t * m + j]);
        }
      }
    }
  }
  const bool i8b = bytes && i8_bytes_apply(K, d);
  if (!gemm || !K.i8_gemm_panel || (bytes && !i8b) || n == 0 || b == 0) return true;
  // the GEMM path's keys: every query's heap holds all n rows (never full before the
  // last row, so every key is pushed), all b queries in one unit
  ScanSrc src{nullptr, nullptr, ScanType::kI8};
  src.i8 = codes;
  src.meta = meta;
  std::vector<Entry> store(static_cast<size_t>(2 * b * n));
  std::vector<Heap> heaps(static_cast<size_t>(b));
  std::vector<Reservoir> res(static_cast<size_t>(b));
  std::vector<const I8Query*> qs(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    heaps[static_cast<size_t>(i)].h = store.data() + 2 * i * n;
    heaps[static_cast<size_t>(i)].k = n;
    qs[static_cast<size_t>(i)] = &iq[static_cast<size_t>(i)];
  }
  const GemmScratch gs = i8_gemm_scratch(K, d, b, false, i8b);
  std::vector<float> scratch(static_cast<size_t>(gs.total()) + 16);
  float* base = scratch.data();
  while (reinterpret_cast<uintptr_t>(base) % 64) ++base;
  for (int64_t i = 0; i < b * n; ++i) upper[i] = std::numeric_limits<float>::quiet_NaN();  // a NaN key: not pushed
  i8_gemm_collect(src, K, d, 0, n, qs.data(), static_cast<int>(b), heaps.data(), res.data(), base, gs, nullptr, i8b);
  for (int64_t i = 0; i < b; ++i) {
    const Heap& hp = heaps[static_cast<size_t>(i)];
    for (int64_t e = 0; e < hp.size; ++e) upper[i * n + hp.h[e].r] = hp.h[e].s;
  }
  return true;
}

double scan_bound(int64_t d, ScanType type, double xnorm, double qnorm) {
  return bound_at(make_bound((d + 15) / 16 + 4, type, d), xnorm, qnorm, abs_bound(d));
}

double row_norm_bound(const float* X, int64_t n, int64_t d) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += static_cast<double>(X[i * d + j]) * static_cast<double>(X[i * d + j]);
    m = std::max(m, s);
  }
  // float64 sum of exact squares: relative error <= gamma_d(2^-53)
  return std::sqrt(m * (1.0 + gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64))) * kSlack;
}

void probe_signals(const float* scores, int64_t b, int64_t k, int64_t probe_k, double temperature,
                   Entropy convention, double* mean, double* ent, int64_t* count, int num_threads) {
  const int64_t K = std::min(probe_k, k);
  // about 64 flops per probe score (exp, log): parallel only for very large batches
  const int nthreads = threads_for(num_threads, 64.0 * static_cast<double>(b) * static_cast<double>(K), b);
  parallel_for(b, nthreads, [&](int64_t i, int) {
    const float* s = scores + i * k;
    int64_t c = 0;
    double sum = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      if (std::isfinite(s[j])) {
        ++c;
        sum += static_cast<double>(s[j]);
      }
    }
    count[i] = c;
    if (c == 0) {
      mean[i] = 0.0;
      ent[i] = 0.0;
      return;
    }
    mean[i] = sum / static_cast<double>(c);
    // z_j = lam * (s_j - s_first) over the valid scores; p = softmax(z)
    const double top = std::isfinite(s[0]) ? static_cast<double>(s[0]) : 0.0;
    double zmax = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < K; ++j)
      if (std::isfinite(s[j])) zmax = std::max(zmax, temperature * (static_cast<double>(s[j]) - top));
    double den = 0.0;
    for (int64_t j = 0; j < K; ++j)
      if (std::isfinite(s[j])) den += std::exp(temperature * (static_cast<double>(s[j]) - top) - zmax);
    double shannon = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      if (!std::isfinite(s[j])) continue;
      const double p = std::exp(temperature * (static_cast<double>(s[j]) - top) - zmax) / den;
      if (p > 0.0) shannon -= p * std::log(std::max(p, 1e-300));
    }
    const double kf = static_cast<double>(c);
    switch (convention) {
      case Entropy::kMean:
        ent[i] = shannon / kf;
        break;
      case Entropy::kSum:
        ent[i] = shannon;
        break;
      case Entropy::kNormalized:
        ent[i] = c > 1 ? shannon / std::max(std::log(kf), 1e-300) : 0.0;
        break;
    }
  });
}

}  // namespace rfmem

// ---------------------------------------------------------------------------------------
// The exact fused top-k of the lexical channel (lexical.h fused_topk; the proof is the
// docstring of rfmem_fast/fusion.py, whose host twin is rfmem_fast.search._hybrid_batched).
namespace rfmem {
namespace {

struct Fused {
  double f;   // fused score
  int64_t r;  // global row
  float dense;
  int64_t h;  // its lexical hit (hval[h] its BM25), -1 for none
};

inline bool fused_better(const Fused& a, const Fused& b) { return a.f > b.f || (a.f == b.f && a.r < b.r); }

// Scan scores of 4 gathered rows (the scan path's dot4, in its AVX2 clone where the CPU has it).
RFMEM_MULTIVERSION
void dot4_rows(const float* q, const float* const* xr, int64_t d, float* sc) { dot4(q, xr[0], xr[1], xr[2], xr[3], d, sc); }

// Upper bound u of a hit's fused score from its recorded key f (fused_topk step 3; NaN
// for a NaN key).
inline double key_bound(float f, double x, double B, double Mq) {
  const double v = (static_cast<double>(f) + B) + x;
  return v + (std::fabs(v) + Mq) * 0x1p-50;
}

// key_bound, +inf for a NaN key (such a hit is scored first).
inline double key_upper(float f, double x, double B, double Mq) {
  return f == f ? key_bound(f, x, B, Mq) : std::numeric_limits<double>::infinity();
}

// pass[h] = 1 where hit h of [0, n) may enter the fused top-k (fused_topk step 3 with
// recorded keys): outside the dense list (mark 0), s_last + x >= t and not u < t (u =
// key_bound: a NaN key passes). No branch on the data, so the loop vectorises (AVX2 clone).
RFMEM_MULTIVERSION
void keys_reaching(const float* hf, const double* hx, const char* mark, int64_t n, double B, double Mq,
                   double s_last, double t, char* pass) {
  for (int64_t h = 0; h < n; ++h) {
    const double x = hx[h];
    pass[h] = static_cast<char>(!(key_bound(hf[h], x, B, Mq) < t) & (s_last + x >= t) & (mark[h] == 0));
  }
}

}  // namespace

// FusedTopk's state: the call's arrays, the exact context of its re-scoring, per-thread
// scratch and the first bad boost found.
struct FusedTopk::Impl {
  FusedArgs args;
  ExactCtx ctx;
  std::atomic<int64_t> bad{-1};  // the first query whose computed boosts are not all finite and >= 0
  struct Scratch {
    std::vector<Fused> cand;
    std::vector<char> mark;
    std::vector<int64_t> extra;
    std::vector<double> best;
    std::vector<std::pair<double, int64_t>> ub;
    std::vector<char> pass;
    std::vector<double> xq;  // a query's boosts computed from args.hscale / hden (hx null)
    // room for any query of the call, so that nothing allocates (or throws) on the threads
    void reserve(int64_t hits, int64_t K, int64_t kf) {
      const size_t h = static_cast<size_t>(hits);
      cand.reserve(static_cast<size_t>(K) + h);
      mark.reserve(h);
      extra.reserve(h);
      best.reserve(static_cast<size_t>(kf));
      ub.resize(std::max(ub.size(), h));
      pass.resize(std::max(pass.size(), h + 8));
      xq.reserve(h);
    }
  };
  std::vector<Scratch> scratch;
  int64_t max_hits = 0;  // the most hits of one query (prepare sizes the scratch for it)
  void one(int64_t i, Scratch& s);
};

// Query i's fused top-kf (fused_topk's steps 1-4).
void FusedTopk::Impl::one(int64_t i, Scratch& s) {
  const float* X = args.X;
  const float* Q = args.Q;
  const int64_t d = args.d, K = args.K, kf = args.kf;
  const int64_t* offsets = args.offsets;
  const int64_t* qseg = args.qseg;
  const int64_t* hptr = args.hptr;
  const int64_t* drows = args.drows;
  const float* dsc = args.dsc;
  const int32_t* hrows = args.hrows;
  const double* hval = args.hval;
  const float* hf_all = args.hf;
  const double* hup = args.hup;
  const double xnorm = args.xnorm;
  int64_t* out_rows = args.out_rows;
  double* out_fused = args.out_fused;
  float* out_dense = args.out_dense;
  double* out_lex = args.out_lex;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<Fused>& cand = s.cand;
  std::vector<char>& mark = s.mark;
  std::vector<int64_t>& ex = s.extra;
  cand.clear();
  ex.clear();
  const int64_t a = offsets[qseg[i]];
  const int64_t h0 = hptr[i], h1 = hptr[i + 1];
  mark.assign(static_cast<size_t>(h1 - h0), 0);
  const float* q = Q + i * d;
  // the boosts from the query's factors (rfmem_fast.fusion.apply_boost: scale * (lex / den),
  // 0 where den <= 0, or scale * lex; the same float64 operations, so the same bits), and
  // the largest (the keys' bound below)
  double xmax = 0.0;
  const double* xq = args.hx != nullptr ? args.hx + h0 : nullptr;  // xq[h - h0]: hit h's boost
  if (args.hx == nullptr) {
    s.xq.resize(static_cast<size_t>(h1 - h0));  // (within the room prepare made)
    xq = s.xq.data();
    const double sc = args.hscale[i];
    const double den = args.hden != nullptr ? args.hden[i] : 1.0;
    bool ok = true;
    for (int64_t h = h0; h < h1; ++h) {
      const double v = args.hden == nullptr ? hval[h] : (den > 0.0 ? hval[h] / den : 0.0);
      const double x = sc * v;
      s.xq[static_cast<size_t>(h - h0)] = x;
      ok &= x >= 0.0 && x <= std::numeric_limits<double>::max();
      xmax = std::max(xmax, x);
    }
    if (!ok) {
      int64_t none = -1;
      bad.compare_exchange_strong(none, i);
    }
  } else {
    for (int64_t h = h0; h < h1; ++h) xmax = std::max(xmax, xq[h - h0]);
  }
  // 1. the dense list, each with its boost (0 without a lexical hit): the rows' hits
  //    looked up first, their boosts on their way from memory while the lookups go on
  int64_t nS = 0;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t r = drows[i * K + j];
    if (r < 0) continue;
    ++nS;
    const int32_t loc = static_cast<int32_t>(r - a);
    const int32_t* it = lower_bound_i32(hrows + h0, h1 - h0, loc);
    int64_t h = -1;
    if (it != hrows + h1 && *it == loc) {
      h = it - hrows;
      mark[static_cast<size_t>(h - h0)] = 1;
      __builtin_prefetch(xq + (h - h0));
    }
    const float ds = dsc[i * K + j];
    cand.push_back(Fused{static_cast<double>(ds), r, ds, h});
  }
  for (Fused& c : cand) c.f = static_cast<double>(c.dense) + (c.h >= 0 ? xq[c.h - h0] : 0.0);  // (-0 + 0 = +0)
  // tau: the kf-th best fused score among the candidates so far (-inf while fewer):
  // a min-heap of the kf best, raised as re-scored hits join (a row of the fused top-kf
  // scores >= the kf-th best of any candidate set)
  std::vector<double>& best = s.best;
  best.clear();
  auto offer = [&](double f) {
    if (static_cast<int64_t>(best.size()) < kf) {
      best.push_back(f);
      std::push_heap(best.begin(), best.end(), std::greater<double>());
    } else if (f > best.front()) {
      std::pop_heap(best.begin(), best.end(), std::greater<double>());
      best.back() = f;
      std::push_heap(best.begin(), best.end(), std::greater<double>());
    }
  };
  for (const Fused& c : cand) offer(c.f);
  auto tau = [&]() { return static_cast<int64_t>(best.size()) < kf ? -inf : best.front(); };
  const double s_last = (K > 0 && drows[i * K + K - 1] >= 0) ? static_cast<double>(dsc[i * K + K - 1]) : -inf;
  // 2. the hits outside the dense list that pass fl(s_K + x) >= tau (with recorded
  //    scores or keys: in step 3's loop)
  const float* hf = hf_all != nullptr && (hup == nullptr || hup[i] < inf) ? hf_all : nullptr;
  if (!hf) {
    const double t = tau();
    for (int64_t h = h0; h < h1; ++h)
      if (!mark[static_cast<size_t>(h - h0)] && s_last + xq[h - h0] >= t) ex.push_back(h);
  }
  // 3. screening: float32 scan score f, |f - RN32(q.x)| <= B (or a recorded key f with
  //    f + hup[i] >= RN32(q.x): B = hup[i]); fl(up(f + B) + x) < tau cannot enter. First
  //    the kLead largest boosts (they raise tau the most), then the rest, in row order,
  //    against the raised tau.
  double B = 0.0;  // recorded keys: their offset; float32 scores to screen: the scan bound
  if (hf != nullptr && hup != nullptr)
    B = hup[i];
  else if (hf != nullptr || !ex.empty())
    B = ctx.bound(ctx.scan, q);
  auto take = [&](int64_t h) {  // hit h re-scored exactly, a candidate
    const int64_t r = a + hrows[h];
    const float es = exact_score(q, X + r * d, d, ctx.g64);
    const double f = static_cast<double>(es) + xq[h - h0];
    cand.push_back(Fused{f, r, es, h});
    offer(f);
  };
  auto screen = [&](const int64_t* hs, size_t n) {
    float sc[4];
    for (size_t e = 0; e < n; e += 4) {
      const size_t cnt = std::min<size_t>(4, n - e);
      const float* xr[4];
      for (size_t t = 0; t < 4; ++t) xr[t] = X + (a + hrows[hs[e + std::min(t, cnt - 1)]]) * d;
      dot4_rows(q, xr, d, sc);
      for (size_t t = 0; t < cnt; ++t)
        if (!(std::nextafter(static_cast<double>(sc[t]) + B, inf) + xq[hs[e + t] - h0] < tau())) take(hs[e + t]);
    }
  };
  constexpr size_t kLead = 16;
  if (hf) {
    // recorded keys (screening costs no dot product): u bounds a hit's fused score F =
    // fl(e + x) from above, e = RN32(q.x) <= f + B: with v = fl(fl(f + B) + x), F <= v +
    // 2^-53 (|fl(f + B)| + |v| + |F|) <= v + 2^-51 (|v| + Mq) (|F|, x <= Mq), and u = v +
    // 2^-50 (|v| + Mq) covers that with its own roundings. The hits by descending u, a
    // block at a time, until one's u < tau (every later one's too: none can enter).
    std::vector<std::pair<double, int64_t>>& ub = s.ub;
    ub.clear();
    double qa[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};  // ||q||^2 (8 sums: no dependence chain)
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
      for (int l = 0; l < 8; ++l) qa[l] += static_cast<double>(q[j + l]) * static_cast<double>(q[j + l]);
    for (; j < d; ++j) qa[0] += static_cast<double>(q[j]) * static_cast<double>(q[j]);
    const double qq = ((qa[0] + qa[1]) + (qa[2] + qa[3])) + ((qa[4] + qa[5]) + (qa[6] + qa[7]));
    const double Mq = xnorm * std::sqrt(qq) * (1.0 + 1e-6) + 2.0 * B + xmax;  // (qq: sums of exact squares)
    const double t = tau();
    const size_t nh = static_cast<size_t>(h1 - h0);
    std::vector<char>& pass = s.pass;
    keys_reaching(hf + h0, xq, mark.data(), h1 - h0, B, Mq, s_last, t, pass.data());  // (step 2 too)
    std::fill(pass.begin() + static_cast<std::ptrdiff_t>(nh), pass.begin() + static_cast<std::ptrdiff_t>(nh) + 8, 0);
    size_t m = 0;
    for (size_t e = 0; e < nh; e += 8) {  // few hits pass (about 2 % on bench_hybrid's texts): 8 flags a test
      uint64_t w;
      std::memcpy(&w, pass.data() + e, sizeof w);
      for (; w; w &= w - 1) {
        const int64_t h = h0 + static_cast<int64_t>(e) + (__builtin_ctzll(w) >> 3);
        ub[m++] = {key_upper(hf[h], xq[h - h0], B, Mq), h};
      }
    }
    auto desc = [](const std::pair<double, int64_t>& x, const std::pair<double, int64_t>& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    const size_t block = std::max<size_t>(static_cast<size_t>(kf), 8);
    const auto ub_end = ub.begin() + static_cast<std::ptrdiff_t>(m);  // ub[0:m]: the hits that can enter
    for (size_t done = 0; done < m;) {
      const size_t c = std::min(block, m - done);
      if (done + c < m) std::nth_element(ub.begin() + done, ub.begin() + done + c, ub_end, desc);
      std::sort(ub.begin() + done, ub.begin() + done + c, desc);
      for (size_t e = done; e < std::min(done + c, done + 4); ++e)  // the likeliest rows on their way from memory
        prefetch_bytes(X + (a + hrows[ub[e].second]) * d, d * static_cast<int64_t>(sizeof(float)));
      size_t e = done;
      for (; e < done + c && !(ub[e].first < tau()); ++e) take(ub[e].second);
      done = e < done + c ? m : done + c;
    }
  } else if (ex.size() > 2 * kLead) {
    auto by_boost = [&](int64_t x, int64_t y) {
      return xq[x - h0] > xq[y - h0] || (xq[x - h0] == xq[y - h0] && x < y);
    };
    std::nth_element(ex.begin(), ex.begin() + kLead, ex.end(), by_boost);
    screen(ex.data(), kLead);
    size_t m = 0;
    for (size_t e = kLead; e < ex.size(); ++e)
      if (s_last + xq[ex[e] - h0] >= tau()) ex[m++] = ex[e];
    std::sort(ex.begin(), ex.begin() + m);  // row order: the gathers walk the segment forwards
    screen(ex.data(), m);
  } else {
    screen(ex.data(), ex.size());
  }
  // 4. the kf best by (fused desc, row asc)
  const int64_t m = static_cast<int64_t>(cand.size());
  const int64_t kk = std::min(kf, m);
  std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), fused_better);
  int64_t w = 0;
  for (int64_t j = 0; j < kk; ++j) {
    const Fused& c = cand[static_cast<size_t>(j)];
    if (!(c.f > -inf)) continue;  // -inf / NaN fused scores are no hits
    out_rows[i * kf + w] = c.r;
    out_fused[i * kf + w] = c.f;
    out_dense[i * kf + w] = c.dense;
    out_lex[i * kf + w] = c.h >= 0 ? hval[c.h] : 0.0;
    ++w;
  }
  for (; w < kf; ++w) {
    out_rows[i * kf + w] = -1;
    out_fused[i * kf + w] = -inf;
    out_dense[i * kf + w] = std::numeric_limits<float>::quiet_NaN();
    out_lex[i * kf + w] = std::numeric_limits<double>::quiet_NaN();
  }
}

FusedTopk::FusedTopk(const FusedArgs& args) : impl_(new Impl) {
  impl_->args = args;
  const Bound scan = make_bound((args.d + 15) / 16 + 4, ScanType::kF32, args.d);
  impl_->ctx = ExactCtx{args.X, args.d, args.kf, scan, scan, args.xnorm, abs_bound(args.d),
                        gamma_n(static_cast<double>(std::max<int64_t>(args.d, 1)), kU64) * kSlack};
  for (int64_t i = 0; i < args.b; ++i) impl_->max_hits = std::max(impl_->max_hits, args.hptr[i + 1] - args.hptr[i]);
}

int64_t FusedTopk::bad_boost() const { return impl_->bad.load(); }

FusedTopk::~FusedTopk() = default;

void FusedTopk::prepare(int nthreads) {
  if (static_cast<int>(impl_->scratch.size()) >= nthreads || impl_->args.kf == 0) return;
  impl_->scratch.resize(static_cast<size_t>(nthreads));
  for (Impl::Scratch& s : impl_->scratch) s.reserve(impl_->max_hits, impl_->args.K, impl_->args.kf);
}

void FusedTopk::done(int64_t i, int tid) {
  if (impl_->args.kf > 0) impl_->one(i, impl_->scratch[static_cast<size_t>(tid)]);
}

void fused_topk(const float* X, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg, int64_t b,
                const float* dsc, const int64_t* drows, int64_t K, const int64_t* hptr, const int32_t* hrows,
                const double* hx, const double* hval, int64_t kf, double xnorm, int num_threads, int64_t* out_rows,
                double* out_fused, float* out_dense, double* out_lex, const float* hf_all, const double* hup) {
  if (b == 0 || kf == 0) return;
  double work = 0.0;  // multiply-adds of the screening (every hit outside the dense list, at most)
  for (int64_t i = 0; i < b; ++i) work += static_cast<double>(hptr[i + 1] - hptr[i]) * static_cast<double>(d);
  const int nthreads = threads_for(num_threads, work, (b + 15) / 16);
  FusedTopk fz(FusedArgs{X, d, offsets, Q, qseg, b, dsc, drows, K, hptr, hrows, hx, hval, kf, xnorm, out_rows,
                         out_fused, out_dense, out_lex, hf_all, hup});
  fz.prepare(nthreads);
  constexpr int64_t kBlock = 16;  // queries per item: neighbours' output rows on one thread
  parallel_for((b + kBlock - 1) / kBlock, nthreads, [&](int64_t blk, int tid) {
    for (int64_t i = blk * kBlock; i < std::min(b, (blk + 1) * kBlock); ++i) fz.done(i, tid);
  });
}

// ---------------------------------------------------------------------------------------
// The dense and the fused top-k of each query in ONE pass over its segment (lexical.h
// hybrid_probe). Every row's float32 scan score f feeds two bounded heaps: the dense one
// (by f, as segmented_topk's scan path) and the fused one, by A = fl64(f + x), x the row's
// boost (the query's hits, merged in row order as the scan walks the segment). With F =
// fl64(e + x) the exact fused score (e = RN32(q.x)): |A - F| <= B + 2 u64 M =: B', M >=
// |f| + |x|, |e| + |x| (B the scan bound, u64 = 2^-53, one rounding of each sum). So with
// t the kf-th best A kept, every row of the exact fused top-kf has A >= t - 2 B': those
// kept rows are re-scored exactly; when the fused heap filled up and its worst kept A
// reaches that cut, the segment is rescanned (every row of A >= cut re-scored).
namespace {

struct FEntry {
  double a;     // fused scan score A (then the exact fused score F)
  int64_t r;    // global row
  int64_t h;    // index of the row's hit (-1: no lexical hit)
};

inline bool fworse(const FEntry& x, const FEntry& y) { return x.a < y.a || (x.a == y.a && x.r > y.r); }
inline bool fbetter(const FEntry& x, const FEntry& y) { return x.a > y.a || (x.a == y.a && x.r < y.r); }

// Bounded min-heap of the best fused entries (rows arrive in increasing order).
struct FHeap {
  FEntry* h = nullptr;
  int64_t k = 0, size = 0;
  double threshold() const { return size < k ? -std::numeric_limits<double>::infinity() : h[0].a; }
  void push(const FEntry& e) {
    if (!(e.a == e.a)) return;
    if (size < k) {
      int64_t i = size++;
      h[i] = e;
      while (i > 0) {
        const int64_t p = (i - 1) >> 1;
        if (!fworse(h[i], h[p])) break;
        std::swap(h[i], h[p]);
        i = p;
      }
    } else if (e.a > h[0].a) {
      h[0] = e;
      int64_t i = 0;
      for (;;) {
        const int64_t l = 2 * i + 1, rr = l + 1;
        int64_t w = i;
        if (l < size && fworse(h[l], h[w])) w = l;
        if (rr < size && fworse(h[rr], h[w])) w = rr;
        if (w == i) break;
        std::swap(h[i], h[w]);
        i = w;
      }
    }
  }
};

// The scan of rows [t0, t1) for the nq queries of one segment (first row a): each
// query's dense heap by f and fused heap by A; hp[qi] walks its hits in row order across
// the tiles of the segment.
RFMEM_MULTIVERSION
void hybrid_scan_tile(const float* X, int64_t d, int64_t a, int64_t t0, int64_t t1, const float* const* qs, int nq,
                      const int32_t* hrows, const double* hx, int64_t* hp, const int64_t* hend, Heap* dh, FHeap* fh,
                      bool fused, float* hf) {
  float sc[4];
  for (int qi = 0; qi < nq; ++qi) {
    const float* q = qs[qi];
    int64_t p = hp[qi];
    const int64_t pe = hend[qi];
    float dthr = dh[qi].threshold();
    double fthr = fh[qi].threshold();
    for (int64_t r = t0; r < t1; r += 4) {
      const int64_t cnt = std::min<int64_t>(4, t1 - r);
      const float* x0 = X + r * d;
      dot4(q, x0, cnt > 1 ? x0 + d : x0, cnt > 2 ? x0 + 2 * d : x0, cnt > 3 ? x0 + 3 * d : x0, d, sc);
      for (int64_t i = 0; i < cnt; ++i) {
        const int64_t loc = r + i - a;
        double x = 0.0;
        int64_t hi = -1;
        if (p < pe && hrows[p] == loc) {
          hi = p;
          hf[p] = sc[i];
          x = hx[p++];
        }
        if (sc[i] > dthr) {
          dh[qi].push(sc[i], r + i);
          dthr = dh[qi].threshold();
        }
        const double A = static_cast<double>(sc[i]) + x;
        if (fused && A > fthr) {
          fh[qi].push(FEntry{A, r + i, hi});
          fthr = fh[qi].threshold();
        }
      }
    }
    hp[qi] = p;
  }
}

// hybrid_scan_tile's fused part from scores already taken: sout[qi][r - t0] is query qi's
// scan score of row r of [t0, t1) (K.scan_rows_f32 scored the tile and pushed the dense
// heaps: the scan path's lanes, depth and bound, as dot4's). Records the hits' scores and
// feeds the fused heaps (fused) in row order.
void hybrid_fuse_tile(int64_t a, int64_t t0, int64_t t1, const float* const* sout, int nq, const int32_t* hrows,
                      const double* hx, int64_t* hp, const int64_t* hend, FHeap* fh, bool fused, float* hf) {
  for (int qi = 0; qi < nq; ++qi) {
    const float* sc = sout[qi];
    int64_t p = hp[qi];
    const int64_t pe = hend[qi];
    if (!fused) {  // the hits' scan scores only
      for (; p < pe && hrows[p] < t1 - a; ++p) hf[p] = sc[hrows[p] + a - t0];
      hp[qi] = p;
      continue;
    }
    double fthr = fh[qi].threshold();
    for (int64_t r = t0; r < t1; ++r) {
      const float f = sc[r - t0];
      double x = 0.0;
      int64_t hi = -1;
      if (p < pe && hrows[p] == r - a) {
        hi = p;
        hf[p] = f;
        x = hx[p++];
      }
      const double A = static_cast<double>(f) + x;
      if (A > fthr) {
        fh[qi].push(FEntry{A, r, hi});
        fthr = fh[qi].threshold();
      }
    }
    hp[qi] = p;
  }
}

}  // namespace

void hybrid_probe(const float* X, int64_t n, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg,
                  int64_t b, int64_t k, const int64_t* hptr, const int32_t* hrows, const double* hx,
                  const double* hval, int64_t kf, double xnorm, int num_threads, float* out_scores,
                  int64_t* out_rows, int64_t* f_rows, double* f_fused, float* f_dense, double* f_lex, float* hf) {
  if (b == 0) return;
  if (!(xnorm >= 0.0)) xnorm = row_norm_bound(X, n, d);
  const SimdKernels& K = simd_kernels();
  const ScanSrc src{X, nullptr, ScanType::kF32};
  const Bound scan = make_bound((d + 15) / 16 + 4, ScanType::kF32, d);
  const ExactCtx ctx{X, d, k, scan, scan, xnorm, abs_bound(d),
                     gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64) * kSlack};
  double work = 0.0;
  for (int64_t i = 0; i < b; ++i)
    work += static_cast<double>(offsets[qseg[i] + 1] - offsets[qseg[i]]) * static_cast<double>(d);
  // queries sorted by segment (stable), in groups of at most kGroup of one segment that
  // share each tile of its rows (segmented_topk's scan path)
  std::vector<int64_t> order(b);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [qseg](int64_t x, int64_t y) { return qseg[x] < qseg[y]; });
  std::vector<std::pair<int64_t, int>> groups;  // (first position in order, queries)
  for (int64_t i = 0; i < b;) {
    int64_t j = i;
    while (j < b && qseg[order[j]] == qseg[order[i]] && j - i < kGroup) ++j;
    groups.emplace_back(i, static_cast<int>(j - i));
    i = j;
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  const int nthreads = threads_for(num_threads, work, ng);
  const int64_t kw = k + kScanMargin[0];
  const int64_t fw = kf + kScanMargin[0];
  const int64_t tile_rows = std::max<int64_t>(4, (kTileBytes / (d * 4)) / 4 * 4);
  const size_t dper = static_cast<size_t>(kGroup * kw + k), fper = static_cast<size_t>(kGroup * fw);
  std::vector<Entry> dstore(static_cast<size_t>(nthreads) * dper);
  std::vector<FEntry> fstore(static_cast<size_t>(nthreads) * fper);
  std::vector<std::vector<FEntry>> fcand(static_cast<size_t>(nthreads));
  // the tiles' scores of the register-blocked scan (SIMD levels 1, 2): kGroup x tile_rows per thread
  const bool blocked = K.scan_rows_f32 != nullptr;
  std::vector<float> tstore(blocked ? static_cast<size_t>(nthreads) * kGroup * static_cast<size_t>(tile_rows) : 0);
  const double inf = std::numeric_limits<double>::infinity();
  parallel_for(ng, nthreads, [&](int64_t gi, int tid) {
    const int64_t first = groups[static_cast<size_t>(gi)].first;
    const int nq = groups[static_cast<size_t>(gi)].second;
    const int64_t seg = qseg[order[first]];
    const int64_t a = offsets[seg], e = offsets[seg + 1];
    const int64_t len = e - a;
    Entry* ds = dstore.data() + static_cast<size_t>(tid) * dper;
    FEntry* fs = fstore.data() + static_cast<size_t>(tid) * fper;
    Heap dhs[kGroup];
    FHeap fhs[kGroup];
    const float* qs[kGroup];
    int64_t hp[kGroup], hend[kGroup];
    for (int g = 0; g < nq; ++g) {
      const int64_t i = order[first + g];
      dhs[g].h = ds + static_cast<size_t>(g) * kw;
      dhs[g].k = kw;
      dhs[g].size = 0;
      fhs[g].h = fs + static_cast<size_t>(g) * fw;
      fhs[g].k = fw;
      fhs[g].size = 0;
      qs[g] = Q + i * d;
      hp[g] = hptr[i];
      hend[g] = hptr[i + 1];
    }
    float* sout[kGroup];
    for (int g = 0; g < nq && blocked; ++g)
      sout[g] = tstore.data() + (static_cast<size_t>(tid) * kGroup + g) * static_cast<size_t>(tile_rows);
    for (int64_t t0 = a; t0 < e; t0 += tile_rows) {
      const int64_t t1 = std::min(e, t0 + tile_rows);
      if (blocked) {  // every query of the group scores the tile in register blocks, then fuses from the scores
        K.scan_rows_f32(X, d, t0, t1, qs, nq, dhs, sout);
        hybrid_fuse_tile(a, t0, t1, sout, nq, hrows, hx, hp, hend, fhs, kf > 0, hf);
      } else {
        hybrid_scan_tile(X, d, a, t0, t1, qs, nq, hrows, hx, hp, hend, dhs, fhs, kf > 0, hf);
      }
    }
    for (int g = 0; g < nq; ++g) {
    const int64_t i = order[first + g];
    const float* q = qs[g];
    const int64_t h0 = hptr[i], h1 = hptr[i + 1];
    Heap& dh = dhs[g];
    FHeap& fh = fhs[g];
    // the dense top-k: segmented_topk's exact finish (scan path)
    {
      const bool filled = dh.size == kw && len > kw;
      const float worst = dh.size ? dh.h[0].s : kNegInf;
      finish_query(ctx, src, K, false, q, dh.h, dh.size, a, e, ds + kGroup * kw, out_scores + i * k, out_rows + i * k,
                   [&](double cut) { return filled && static_cast<double>(worst) >= cut; },
                   nullptr);  // (no row selection: a filtered batch fuses on the host)
    }
    if (kf == 0) continue;
    // the fused top-kf
    double qq = 0.0;
    for (int64_t j = 0; j < d; ++j) qq += static_cast<double>(q[j]) * static_cast<double>(q[j]);
    const double B = ctx.bound(ctx.scan, q);
    double xmax = 0.0;
    for (int64_t h = h0; h < h1; ++h) xmax = std::max(xmax, hx[h]);
    const double M = xnorm * std::sqrt(qq) * (1.0 + 1e-6) + B + xmax;
    const double Bp = (B + 2.0 * kU64 * M * (1.0 + 1e-6)) * kSlack;
    std::vector<FEntry>& cand = fcand[static_cast<size_t>(tid)];
    cand.assign(fh.h, fh.h + fh.size);
    double cut = -inf;
    if (fh.size >= kf) {
      std::nth_element(cand.begin(), cand.begin() + (kf - 1), cand.end(),
                       [](const FEntry& x, const FEntry& y) { return x.a > y.a; });
      const double t = cand[static_cast<size_t>(kf - 1)].a;
      if (t > -inf) cut = std::nextafter(t - 2.0 * Bp, -inf);
    }
    const bool dropped = fh.size == fw && len > fw && fh.h[0].a >= cut;
    auto exact_of = [&](int64_t r, int64_t hi, FEntry& out, float& es) {
      es = exact_score(q, X + r * d, d, ctx.g64);
      out = FEntry{static_cast<double>(es) + (hi >= 0 ? hx[hi] : 0.0), r, hi};
    };
    std::vector<float> dens;
    if (dropped) {  // rescan: every row whose A reaches the cut (rare)
      cand.clear();
      float sc[4];
      int64_t hp = h0;
      for (int64_t r = a; r < e; r += 4) {
        const int64_t cnt = std::min<int64_t>(4, e - r);
        const float* xr[4];
        for (int64_t t = 0; t < 4; ++t) xr[t] = X + (r + std::min<int64_t>(t, cnt - 1)) * d;
        dot4_rows(q, xr, d, sc);
        for (int64_t t = 0; t < cnt; ++t) {
          const int64_t loc = r + t - a;
          int64_t hi = -1;
          double x = 0.0;
          if (hp < h1 && hrows[hp] == loc) {
            hi = hp;
            x = hx[hp++];
          }
          if (static_cast<double>(sc[t]) + x >= cut) cand.push_back(FEntry{0.0, r + t, hi});
        }
      }
    } else {
      size_t m = 0;
      for (const FEntry& c : cand)
        if (c.a >= cut) cand[m++] = c;
      cand.resize(m);
    }
    dens.resize(cand.size());
    size_t m = 0;
    for (size_t j = 0; j < cand.size(); ++j) {
      FEntry f;
      float es;
      exact_of(cand[j].r, cand[j].h, f, es);
      if (!(f.a > -inf)) continue;  // NaN / -inf: no hit
      cand[m] = f;
      dens[m] = es;
      ++m;
    }
    std::vector<size_t> idx(m);
    std::iota(idx.begin(), idx.end(), size_t{0});
    const int64_t kk = std::min<int64_t>(kf, static_cast<int64_t>(m));
    std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(),
                      [&](size_t x, size_t y) { return fbetter(cand[x], cand[y]); });
    for (int64_t j = 0; j < kf; ++j) {
      if (j < kk) {
        const FEntry& c = cand[idx[static_cast<size_t>(j)]];
        f_rows[i * kf + j] = c.r;
        f_fused[i * kf + j] = c.a;
        f_dense[i * kf + j] = dens[idx[static_cast<size_t>(j)]];
        f_lex[i * kf + j] = c.h >= 0 ? hval[c.h] : 0.0;
      } else {
        f_rows[i * kf + j] = -1;
        f_fused[i * kf + j] = -inf;
        f_dense[i * kf + j] = std::numeric_limits<float>::quiet_NaN();
        f_lex[i * kf + j] = std::numeric_limits<double>::quiet_NaN();
      }
    }
    }
  });
}

}  // namespace rfmem

