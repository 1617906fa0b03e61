// Instruction-set specific kernels of the segmented top-k, compiled three times
// (simd.cpp includes simd_impl.inc once per level) and picked at run time:
//
//   level 2  AVX-512F (+ AVX2, FMA, F16C)   GEMM micro-tile 12 rows x 32 queries
//   level 1  AVX2 + FMA + F16C              GEMM micro-tile  6 rows x 16 queries
//   level 0  baseline (any CPU, plain C++)  GEMM micro-tile  4 rows x 16 queries
//
// The int8 kernels (i8_dots, i8_gemm_panel) of level 2 are picked apart, by the CPU's
// AVX-512 extensions (simd.cpp; simd_i8_avx512.inc):
//
//   avx512_vnni  AVX-512F/BW/VL + AVX512_VNNI   vpdpwssd, int8 micro-tile 12 rows x 32 queries;
//                                               GEMM units with byte queries: vpdpbusd
//                                               (i8_gemm_panel_b)
//   avx512bw     AVX-512F/BW/VL                 vpmaddwd + vpaddd, the same blocks
//   avx2         AVX-512F without BW            level 1's kernels (6 rows x 16 queries)
//
//   * gemm_panel: the float32 scores of a tile of bank rows against a packed panel of
//     NR queries, register-blocked (MR rows x NR queries of accumulators, one broadcast
//     of a row element per MR x NR / W fused multiply-adds), the reduction over d cut
//     into blocks of kGemmKc terms, each summed from zero in the accumulators and then
//     added to the running sums; every score is compared at once with its query's heap
//     threshold, so no score matrix is written beyond one MR x NR micro-tile. Depth of
//     a product term (roundings it goes through, exact.py): kGemmKc + ceil(d / kGemmKc)
//     - 1 at most (gemm_depth), whether the multiply-add is fused (levels 1, 2) or not
//     (level 0).
//   * dot4_half / scan_rows_half: the scan path over float16 / bfloat16 rows, converted
//     exactly to float32 (F16C / a 16-bit shift) and reduced on the same 16 lanes as the
//     float32 scan of topk.cpp (lane j % 16 accumulates in order of j, then a balanced
//     4-level tree), so its depth is at most ceil(d / 16) + 4. Levels 1 and 2 fuse each
//     multiply-add (one rounding per term instead of two; level 2 scans 8 rows per step)
//     and prefetch the rows ahead, level 0 multiplies then adds: their scan scores may
//     differ in the last bits, the exact results never do.
//   * to_f32: float16 / bfloat16 -> float32, exact.
//   * i8_dots: the int32 inner products of up to 4 int8 rows with int16 queries (the int8
//     scan copy, ScanType kI8): exact integers, so every level (and both paths) gives the
//     same value. The row's bytes are sign-extended to int16 (vpmovsxbw) and multiplied
//     pairwise with the query's int16 codes into int32 lanes: at level 2 on 32 elements
//     per zmm, vpdpwssd (AVX512_VNNI, the two products and the accumulation in one
//     instruction) or vpmaddwd + vpaddd (AVX-512BW), register blocks of 4 rows x 4
//     queries, the tail by masked loads; at level 1 vpmaddwd + vpaddd on 16 elements per
//     ymm, register blocks of 4 rows x 2 queries; level 0: plain C++. i8_gemm_panel (the
//     GEMM path) multiplies the same pairs, a row's pair broadcast against a packed panel
//     of queries. Ranges: |x| <= 127, |q| <= QMAX(d) with d * 127 * QMAX(d) <= 2^31 - 1
//     (i8_qmax), so no product, pair sum (<= 2 * 127 * 32767) or lane sum overflows an
//     int32, at any level, in any order of the sums.
#pragma once

#include <cstdint>

#include "heap.h"

namespace rfmem {

/// Element type of the bank copy a scan reads (the exact re-scoring always reads float32).
enum class ScanType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

/// Largest |q| of an int16-quantised query of dimension d for the int8 scan: the int32
/// sums of d products |q_j x_j| <= QMAX * 127 never overflow (min(32767, (2^31 - 1) /
/// (127 d)); 0 when d > (2^31 - 1) / 127, where the int8 scan is not used).
inline int32_t i8_qmax(int64_t d) {
  const int64_t m = d > 0 ? (int64_t{2147483647} / (127 * d)) : 32767;
  return static_cast<int32_t>(m < 32767 ? m : 32767);
}

/// One query of the int8 scan (topk.cpp i8_prepare; the derivation of a and b is in
/// rfmem_fast/backends/exact.py, "int8 scan copies"): q = s * q16 + r_q, q16 int16
/// [ceil(d / 16) * 16] (zero beyond d).
struct I8Query {
  const int16_t* q;  // the int16 codes
  float s;           // the query's scale
  float a;           // coefficient of a row's residual norm in its bound
  float b;           // coefficient of a row's norm in its bound
};

/// The absolute term of the int8 scan's bound: covers every underflow of its float32
/// evaluation (exact.py).
constexpr float kI8Abs = 4.81482486096809e-35f;  // 2^-114

/// Per-row data of the int8 scan copy, meta[3 r .. 3 r + 2]: the row's scale s_x, an upper
/// bound of its residual norm ||x - s_x x8||, an upper bound of its norm ||x||.
/// The scan score of row x: f = fl(fl(I) * fl(s * s_x)) (I = q16 . x8, exact), its bound
/// B = fl(fl(a rho) + fl(fl(b N) + kI8Abs)); |f - RN32(q.x)| <= B (1 - u)^2 with room for
/// the two float32 roundings of f + B and f - B, so i8_upper >= RN32(q.x) >= i8_lower for
/// every row (exact.py). Compiled without contraction: the same bits at every level.
inline float i8_score(const I8Query& q, const float* m, int32_t I) {
  const float c = q.s * m[0];
  return static_cast<float>(I) * c;
}
inline float i8_bound(const I8Query& q, const float* m) { return q.a * m[1] + (q.b * m[2] + kI8Abs); }
inline float i8_upper(const I8Query& q, const float* m, int32_t I) { return i8_score(q, m, I) + i8_bound(q, m); }
inline float i8_lower(const I8Query& q, const float* m, int32_t I) { return i8_score(q, m, I) - i8_bound(q, m); }

/// Terms of d summed from zero before they are added to the running sum (GEMM path).
constexpr int64_t kGemmKc = 64;

/// Roundings a product term goes through in the GEMM path: at most kGemmKc within its
/// block (one per multiply-add; the first multiply-add of a block rounds the product)
/// plus one per later block added to the running sum.
inline int64_t gemm_depth(int64_t d) {
  const int64_t blocks = (d + kGemmKc - 1) / kGemmKc;
  return (d < kGemmKc ? d : kGemmKc) + (blocks > 0 ? blocks - 1 : 0);
}

struct SimdKernels {
  int level;         // 0 baseline, 1 AVX2/FMA/F16C, 2 AVX-512F
  const char* name;  // "baseline", "avx2", "avx512"
  int mr;            // rows per GEMM micro-tile
  int nr;            // queries per packed panel

  /// Scores of rows T[0:nrows] (float32, row-major, stride d; global row of T[0] is
  /// row0) against the packed panel P (P[j * nr + q] = query q's element j, queries
  /// nq..nr-1 zero); each score of query q < nq above its heap's threshold is pushed
  /// into heaps[q]. ``thr`` is scratch of nr floats; with ``keep``, ``c`` (nrows * nr
  /// floats) keeps every score: row T[r]'s score of query q at c[r * nr + q], copied from
  /// the micro-tile summed on the stack (topk.cpp: the lexical hits' scores); else unused.
  void (*gemm_panel)(const float* T, int64_t nrows, int64_t d, const float* P, int nq, int64_t row0,
                     Heap* heaps, float* c, float* thr, bool keep);

  /// dst[0:count] = src[0:count] as float32 (exact).
  void (*to_f32)(const uint16_t* src, int64_t count, ScanType t, float* dst);

  /// The exact int32 inner products out[i * nq + j] = qs[j] . xr[i] of nr <= 4 int8 rows
  /// (stride-free pointers, d bytes each) with nq int16 queries (each zero-padded to a
  /// multiple of 16 elements); |qs[j][.]| <= i8_qmax(d).
  void (*i8_dots)(const int8_t* const* xr, int nr, const int16_t* const* qs, int nq, int64_t d, int32_t* out);

  /// The int8 GEMM micro-kernel (nullptr at level 0): rows T[0:nrows] (int16 [nrows, dp],
  /// the int8 rows sign-extended, zero past d; dp = d rounded up to even; global row of
  /// T[0] is row0, its data meta[0..]) against the packed panel P of up to i8_nr queries
  /// (int32 [dp / 2][i8_nr]: P[j * i8_nr + q] holds query q's int16 codes 2j and 2j + 1,
  /// zero past nq; 64-byte aligned), register blocks of i8_mr rows x i8_nr queries of
  /// int32 accumulators (a broadcast pair of a row multiplied pairwise with the panel);
  /// every key i8_upper (the same float32 operations, vectorised) above its query's
  /// threshold is pushed into res[q] (q < nq; heap.h Reservoir). ``kout``: null, or where
  /// every key goes (nrows * i8_nr floats: row T[r]'s key of query q at kout[r * i8_nr + q];
  /// topk.cpp: the lexical hits' keys).
  void (*i8_gemm_panel)(const int16_t* T, int64_t nrows, int64_t dp, const int32_t* P, int nq, int64_t row0,
                        const float* meta, const I8Query* const* qs, Reservoir* res, float* kout);

  /// Inner products of q with the 4 half-precision rows x0..x3 (16 lanes, as dot4).
  void (*dot4_half)(const float* q, const uint16_t* x0, const uint16_t* x1, const uint16_t* x2,
                    const uint16_t* x3, int64_t d, ScanType t, float* out);

  /// The scan path over half-precision rows [r0, r1) of X: heaps[i] collects query i's
  /// best scores (rows in increasing order), tiles of tile_rows rows shared by the nq
  /// queries (as scan_rows of topk.cpp). With ``sout`` (levels 1, 2; ignored at level 0),
  /// query i's scan score of row x is also written at sout[i][x - r0].
  void (*scan_rows_half)(const uint16_t* X, ScanType t, int64_t d, int64_t r0, int64_t r1,
                         const float* const* qs, int nq, Heap* heaps, int64_t tile_rows, float* const* sout);

  /// The scan path over float32 rows [r0, r1) of X (levels 1, 2; nullptr at level 0,
  /// where topk.cpp's own scan runs): heaps[i] collects query i's best scores, every
  /// block of rows scored against all nq queries while it is in L1 (register blocks of
  /// rows x queries, fused multiply-adds; the lanes and depth of the scan path's bound).
  /// ``sout``: null, or per query where to write the scan score of every row (row x at
  /// sout[i][x - r0]).
  void (*scan_rows_f32)(const float* X, int64_t d, int64_t r0, int64_t r1, const float* const* qs, int nq,
                        Heap* heaps, float* const* sout);

  /// scan_rows_f32 over the rows some query may still need (levels 1, 2; nullptr at 0):
  /// row x is scored unless ref[x - r0] < min over q of (heaps[q].threshold() - off[q])
  /// (rounded down; -inf while a heap is not full); gathered rows, in increasing order.
  /// The caller guarantees that ref[x - r0] + off[q] - B_q bounds query q's exact score of x
  /// from above (B_q: the scan path's bound), so skipped rows are outside every top-k
  /// (topk.cpp, TopkOptions::prune). Returns the rows scored.
  int64_t (*scan_rows_f32_pruned)(const float* X, int64_t d, int64_t r0, int64_t r1, const float* const* qs,
                                  int nq, Heap* heaps, const float* ref, const double* off);

  /// out[q * ld + (x - r0)] = the scan score (the scan path's lanes and bound) of row x
  /// of [r0, r1) for query qs[q] (levels 1, 2; nullptr at 0).
  void (*scores_f32)(const float* X, int64_t d, int64_t r0, int64_t r1, const float* const* qs, int nq, float* out,
                     int64_t ld);

  /// The sums of an exact score (exact.h exact_score): s = the float64 sum of the d
  /// products q_j x_j (each exact in float64), a = the sum of their magnitudes, both in
  /// an order of this level's choosing (16 / 32 partial sums at levels 1 / 2, 4 at 0;
  /// exact.h's bound holds for every order, so the exact score is the same everywhere).
  void (*exact_sums)(const float* q, const float* x, int64_t d, double* s, double* a);

  const char* i8_name;  // the int8 kernels: "avx512_vnni", "avx512bw", "avx2" or "baseline"
  int i8_mr;            // rows per int8 GEMM micro-tile (0 without i8_gemm_panel)
  int i8_nr;            // queries per packed int8 panel (0 without i8_gemm_panel)

  /// The int8 GEMM micro-kernel for byte queries (|q| <= 127; nullptr except avx512_vnni):
  /// rows X[0:nrows] read in place (int8 [nrows, d], d % 4 == 0, d <= kI8ByteMaxD; global
  /// row of X[0] is row0, its data meta[0..]), rsum[i] = 128 * the sum of row i's codes,
  /// against the packed panel P of up to i8_nr queries (int32 [d / 4][i8_nr]: P[j * i8_nr
  /// + q] holds query q's codes 4j .. 4j + 3 plus 128 as unsigned bytes, 128 past nq;
  /// 64-byte aligned). vpdpbusd sums I + rsum exactly; the keys (I - the same as i8_dots
  /// with the same codes) go to res / kout as i8_gemm_panel's.
  void (*i8_gemm_panel_b)(const int8_t* X, int64_t nrows, int64_t d, const int32_t* rsum, const int32_t* P, int nq,
                          int64_t row0, const float* meta, const I8Query* const* qs, Reservoir* res,
                          float* kout) = nullptr;
};

/// Largest d of the byte-query GEMM path: a lane's sum of d products (q + 128) x, each at
/// most 255 * 127 in magnitude, stays below 2^31 (topk.cpp; larger d takes int16 queries).
constexpr int64_t kI8ByteMaxD = 2147483647 / (255 * 127);

/// Highest level this CPU (and its OS) supports.
int simd_level_supported();

/// Kernels of min(supported level, cap) (cap: set_simd_cap, default no cap).
const SimdKernels& simd_kernels();

/// Caps the level used by later calls (tests run every level on one machine); a
/// negative cap removes the cap. ``i8_cap`` caps level 2's int8 kernels the same way
/// (2 avx512_vnni, 1 avx512bw, 0 avx2: level 1's; negative: no cap; no effect below
/// level 2). Returns the level now in use.
int set_simd_cap(int cap, int i8_cap = -1);

/// Highest int8 kernel variant of level 2 this CPU supports (2 avx512_vnni, 1 avx512bw,
/// 0 avx2; 0 too where level 2 itself is not supported).
int simd_i8_supported();

}  // namespace rfmem
