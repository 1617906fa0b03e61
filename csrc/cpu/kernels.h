// CPU kernels of rfmem_fast (RFMEM_SPEC.md; DESIGN.md "The primitives every backend
// provides"). Pure C++17 on raw, C-contiguous buffers; the pybind11 layer
// (bindings.cpp) validates shapes and dtypes before calling these, so the functions
// below assume well-formed input and never throw on the hot path.
#pragma once

#include <cstdint>

#include "simd.h"

namespace rfmem {

/// Which kernel scores a segment's queries (segmented_topk): kAuto = the cost rule of
/// gemm_pays per segment; kScan / kGemm force one path (tests, benchmarks).
enum class TopkPath : int { kAuto = 0, kScan = 1, kGemm = 2 };

/// The row selections of a filtered top-k (rfmem_fast/filters.py RowSelection): P
/// selections, each a set of rows of one segment, given as its increasing rows
/// rows[off[p] : off[p + 1]] and, for a selection holding more than a quarter of its
/// segment (the "mask mode"), also as a mask over the segment's rows
/// (mask[mask_off[p] + r - segment start] == 1 exactly for its rows; mask_off[p] == -1
/// in list mode). A query of a mask-mode selection is scanned with its group as usual,
/// its heap refusing unselected rows (heap.h); a query of a list-mode selection scores
/// only its listed rows (every one of them kept, then the exact re-scoring). The rule
/// (segmented_topk): list mode when no mask is given, and also for a masked selection
/// whose queries in the call would not take the GEMM path (gemm_pays; not when the GEMM
/// path is forced): a listed row costs what a scanned one does (the same lanes, the
/// next rows prefetched), so the list reads fewer rows for the same work; only a GEMM
/// batch (many queries of one long segment) keeps the mask, inside the GEMM scan.
struct SelTable {
  int64_t n = 0;                      ///< P, the number of selections
  const int64_t* off = nullptr;       ///< [P + 1]
  const int64_t* rows = nullptr;      ///< [off[P]] global rows
  const uint8_t* mask = nullptr;      ///< masks of the mask-mode selections
  const int64_t* mask_off = nullptr;  ///< [P]
};

/// Per-query work that segmented_topk runs on its own worker threads once a query's
/// results are final (TopkOptions::after): prepare(n) is called before threads 0 .. n - 1
/// start (it allocates their scratch; it may be called again, with a larger n, before a
/// later phase); done(i, tid) on thread tid once query i's exact top-k (out_scores /
/// out_rows row i) and, when the pass records them, its hits' keys (hit_keys, hit_up[i])
/// are written, while the query's segment is still warm in the caches. done must not throw.
struct QueryHook {
  virtual ~QueryHook() = default;
  virtual void prepare(int nthreads) = 0;
  virtual void done(int64_t i, int tid) = 0;
};

/// Options of segmented_topk beyond its arrays.
struct TopkOptions {
  /// A float16 / bfloat16 copy of X (uint16 [n, d], C-contiguous; element i of row r is
  /// round(X[r, i]) to nearest even) that the scan reads instead of X; nullptr: scan X.
  /// The exact re-scoring reads X either way, for the candidates only.
  const uint16_t* scan = nullptr;
  ScanType scan_type = ScanType::kF32;  ///< type of ``scan`` (kF16 or kBF16 when given; kI8 with scan_i8)
  /// An int8 copy of X (int8 [n, d], C-contiguous) and its per-row data scan_meta (float32
  /// [n, 3]: the row's scale s, an upper bound of ||X[r] - s x8||, an upper bound of
  /// ||X[r]||; rfmem_fast.precision.to_scan_copy) that the scan reads instead of X
  /// (scan_type kI8; ``scan`` must then be null). The queries are quantised to int16 per
  /// query, every row gets its own proven bound, and the rows that can reach the top-k
  /// are re-scored exactly from X (topk.cpp "int8 scan"). Queries or dimensions the int8
  /// scan cannot bound (d > (2^31 - 1) / 127, a query norm times xnorm >= 2^100, a
  /// non-finite query), and calls whose queried segments hold fewer than int8_min_rows()
  /// rows on average, make the call scan X instead; results never depend on it.
  const int8_t* scan_i8 = nullptr;
  const float* scan_meta = nullptr;
  TopkPath path = TopkPath::kAuto;
  int num_threads = 0;  ///< most threads to use (0 = the machine's); fewer for small work
  double xnorm = -1.0;  ///< an upper bound of the row norms of X (< 0: computed, O(n d))
  /// Filtered search: the selections (nullptr: none) and the selection of each query of
  /// the call (qsel[i] in [-1, P), -1: the whole segment; the selection's rows lie in
  /// the query's segment). recollect() reads qsel per query of its batch and passes
  /// each round's top-k call the selection of every branch's query.
  const SelTable* sel = nullptr;
  const int64_t* qsel = nullptr;
  /// Row pruning (optional; used by the float32 scan path at SIMD levels >= 1, ignored
  /// elsewhere): prune_ref (float32, indexed by global row, valid for the rows of every
  /// queried segment) and prune_rad (float64 [b]) with prune_ref[x] + prune_rad[i] >=
  /// RN32(Q[i] . X[x]) for every row x of query i's segment (e.g. the scan scores of a
  /// nearby query r plus its scan bound and ||X[x]|| ||Q[i] - r||: recollect.cpp). A row
  /// is then scored only while it can still reach a proven lower bound of the query's
  /// k-th exact score; results never depend on it.
  const float* prune_ref = nullptr;  ///< prune_ref[x - prune_row0] for the rows x of the queried segments
  int64_t prune_row0 = 0;
  const double* prune_rad = nullptr;
  int64_t* rows_scored = nullptr;  ///< if given: += the rows the scans scored (a row once per group)
  /// Scan scores out (optional): a query on the scan path over the float32 rows or a
  /// half-precision copy at SIMD levels >= 1, or over the int8 copy (any level), writes
  /// the scan score of every row x of its segment [a, e) at scores_out[i * scores_ld + (x
  /// - a)] and sets scores_written[i] = 1 (others are left untouched); ``scores_ld`` >=
  /// the longest queried segment. Those scores are within that scan's bound (scan_bound)
  /// of the exact ones, or (int8) the keys i8_upper, upper bounds of them: the beam driver
  /// prunes with them (recollect's ref; all give q0.x <= f0(x) + B0, recollect.cpp
  /// prune_radius).
  float* scores_out = nullptr;
  int64_t scores_ld = 0;
  uint8_t* scores_written = nullptr;
  /// Lexical hits (optional; lexical.h fused_topk reads what they give): query i's hits
  /// are the local rows hit_rows[hit_ptr[i] : hit_ptr[i + 1]] of its segment (ascending,
  /// in [0, its length)). The pass writes every hit's key hit_keys[h] (float32 [H]) and
  /// per query an offset hit_up[i] (float64 [b]) with hit_keys[h] + hit_up[i] >=
  /// RN32(Q[i] . x) for its hits x: a scan score and its path's bound (float32 scan, half
  /// scan, GEMM path), or an int8 key (an upper bound already, offset 0). hit_up[i] = +inf
  /// where the query's path records none (level 0's scans and int8 GEMM units, a list-mode
  /// selection, pruned scans): the caller then scores those hits itself.
  const int64_t* hit_ptr = nullptr;
  const int32_t* hit_rows = nullptr;
  float* hit_keys = nullptr;
  double* hit_up = nullptr;
  /// Per-query continuation (optional; QueryHook): lexical.h FusedTopk takes each query's
  /// fused top-k right after its dense one, reading the keys the pass just recorded.
  QueryHook* after = nullptr;
};

/// The int8 scan copy pays from this many rows per queried segment (mean over the call's
/// queries): below it the call scans the float32 rows (segmented_topk; the copy's keys,
/// int8 dots and the exact re-scoring of the rows within its bound cost more than the
/// float32 scan saves). Measured (rfmem bench --workloads multitenant --users 1000, batch
/// 1,024, one thread, AMD EPYC Zen 4, SIMD level 2, int8 kernel avx512_vnni): int8 /
/// float32 dense q/s 0.66x at 64 rows, 1.00x at 256, 1.45x at 1,024, 2.2x at 4,096;
/// RF-Mem 0.86x / 0.87x / 1.16x / 1.5x.
constexpr int64_t kI8MinRows = 512;

/// The row count from which a call uses the int8 copy (kI8MinRows unless set): ``rows`` >=
/// 0 sets it (0: always, for tests that exercise the int8 kernels on small banks),
/// negative restores kI8MinRows; returns the value now in use. Results never depend on it.
int64_t set_int8_min_rows(int64_t rows);
int64_t int8_min_rows();

/// The cost rule of the segmented top-k: true when ``nq`` queries of one segment of
/// ``seg_len`` rows cost less on the GEMM path than on the scan path at SIMD level
/// ``level`` (simd.h). Scan: nq * seg_len * d multiply-adds at kScanRate[level]; GEMM:
/// the queries padded to whole panels of NR (32 at level 2, 16 below) times seg_len * d
/// at kGemmRate[level], plus a fixed cost of kGemmFixed queries (topk.cpp, measured
/// rates): GEMM iff padded * scan_rate / gemm_rate + kGemmFixed < nq, i.e. from 18
/// queries at level 2, 10 at level 1, never at level 0; never for segments of fewer than
/// kGemmMinRows = 128 rows. Memory traffic is the same on both paths (each group / unit
/// reads the segment once; a unit holds up to ~10 x more queries than a scan group).
bool gemm_pays(int64_t nq, int64_t seg_len, int64_t d, int level);

/// The cost rule of the int8 copy's paths (levels 1, 2, where an int8 GEMM micro-kernel
/// exists): GEMM from kI8GemmMinQueries queries of one segment of >= 128 rows. Measured
/// (bench/bench_gemm.py --parts crossover --scan-type int8, AMD EPYC Zen 4, int8 kernel
/// avx512_vnni, bench/results/gemm-crossover-int8-amd-epyc-zen4.json): GEMM / scan
/// 0.86-0.97x at 16 queries, 1.01-1.07x at 24, on segments of 128 to 4,096 rows; the
/// float32 rule (from 18) would take GEMM a few queries early.
constexpr int64_t kI8GemmMinQueries = 24;
bool i8_gemm_pays(int64_t nq, int64_t seg_len);

/// Top-k inner products of each query within its own CSR segment (spec "Vectors and
/// scores"; DESIGN.md segmented_topk).
///
/// X: float32 [n, d] rows. offsets: int64 [U + 1], non-decreasing, 0 <= offsets[u] <= n.
/// Q: float32 [b, d]. qseg: int64 [b] in [0, U). Writes scores [b, k] (descending)
/// and rows [b, k] (global row indices); ties are broken by the smaller row, so the
/// order equals a stable sort by descending score. Where a segment holds fewer than
/// k rows (or a score is -inf / NaN) the tail is -inf / -1.
/// One float32 pass over each segment per group of queries of that segment (up to 16
/// on the scan path; whole panels of a GEMM micro-kernel on the GEMM path, chosen per
/// segment by gemm_pays), in row tiles that stay in cache while every query of the
/// group scores them, keeps k + 8 candidates per query; every candidate whose float32 score can reach the k-th
/// exact score within the proven error bound of the scan is re-scored exactly
/// (e = RN32(q.x), exact.h), the segment being rescanned for the rare query whose
/// kept list cannot prove it holds them all (topk.cpp, rfmem_fast/backends/exact.py).
/// ``xnorm``: an upper bound of the row norms of X (< 0: computed here, O(n d)).
/// ``num_threads``: most threads to use (0 = the machine's); fewer when the work is small.
void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U,
                    const float* Q, const int64_t* qseg, int64_t b, int64_t k, float* out_scores,
                    int64_t* out_rows, int num_threads, double xnorm);

/// segmented_topk with options: a half-precision scan copy, a forced path (see
/// TopkOptions). Same results for every option: the exact top-k of the float32 rows X.
void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U,
                    const float* Q, const int64_t* qseg, int64_t b, int64_t k, float* out_scores,
                    int64_t* out_rows, const TopkOptions& opt);

/// The scan path's error bound for a query of norm <= qnorm over rows of norm <= xnorm,
/// d elements, rows read as ``type`` (kF32, kF16, kBF16; kI8 as kF32): |f - RN32(q.x)|
/// <= this for every scan score f of the scan path (topk.cpp make_bound, ExactCtx::bound).
double scan_bound(int64_t d, ScanType type, double xnorm, double qnorm);

/// An upper bound of max_i ||X[i]|| (float64 sums, inflated by their error bound).
double row_norm_bound(const float* X, int64_t n, int64_t d);

/// The int8 scan's bounds of every (query, row) pair, as segmented_topk's int8 scan
/// computes them (the queries quantised the same way, the dots of the SIMD level in use):
/// lower[i * n + r] <= RN32(Q[i] . x_r) <= upper[i * n + r] for the float32 row x_r whose
/// int8 copy is codes[r] with meta[r] (TopkOptions::scan_i8). Returns false (nothing
/// written) where the int8 scan would fall back to the float32 rows (TopkOptions).
/// ``gemm``: upper as the GEMM path's micro-kernel computes it (the keys its heaps
/// receive, simd.h i8_gemm_panel; the scan path's i8_dots at level 0, which has none);
/// lower always as the exact finish computes it (i8_dots). ``bytes``: the queries
/// quantised as byte queries (|code| <= 127, the GEMM units' form where
/// int8_byte_queries(d)), upper with ``gemm`` from i8_gemm_panel_b where it applies.
bool int8_bounds(const int8_t* codes, const float* meta, int64_t n, int64_t d, const float* Q, int64_t b, double xnorm,
                 float* lower, float* upper, bool gemm = false, bool bytes = false);

/// The segment length from which an int8 GEMM unit takes byte queries (where they apply):
/// below it their wider keys' longer kept list and re-keyed finish cost more than the
/// kernel saves. Measured (`bench/bench_int8.py --byte-crossover`, AMD EPYC Zen 4, one
/// thread, batch 1,024 in units of 256 queries a segment, d = 384; byte / int16 queries
/// q/s, bench/results/int8-byte-crossover-amd-epyc-zen4.json): 0.76x at 512 rows, 0.93x
/// at 4,096, 1.05x at 8,192, 1.09x at 16,384, 1.22x at 25,000, 1.33x at 50,000 (1.42x at
/// 1e5, 1.67x at 1e6 in bench/results/int8-byte-queries-amd-epyc-zen4.json).
constexpr int64_t kI8ByteMinRows = 8192;

/// Turns the byte queries of the int8 GEMM path on or off (default on) and sets the
/// segment length they start at (min_rows < 0: kI8ByteMinRows); returns the previous
/// on / off. For tests and benchmarks; results never depend on it.
bool set_int8_byte_queries(bool on, int64_t min_rows = -1);

/// The segment length from which GEMM units take byte queries now.
int64_t int8_byte_min_rows();

/// Whether an int8 call of dimension d gives its GEMM units over segments of
/// int8_byte_min_rows() rows or more byte queries now: the avx512_vnni kernels in use
/// (simd.h i8_gemm_panel_b), d % 4 == 0, d <= kI8ByteMaxD, turned on.
bool int8_byte_queries(int64_t d);

/// Entropy conventions of familiarity_signals (spec section 1).
enum class Entropy : int { kMean = 0, kSum = 1, kNormalized = 2 };

/// Mean score and temperature-softmax entropy of the first ``probe_k`` columns of
/// each row of ``scores`` [b, k] (valid = finite), in float64, exactly as
/// rfmem_fast.signals.familiarity_signals. Writes mean [b], ent [b], count [b].
void probe_signals(const float* scores, int64_t b, int64_t k, int64_t probe_k, double temperature,
                   Entropy convention, double* mean, double* ent, int64_t* count, int num_threads);

/// Many small KMeans problems (spec section 4), as rfmem_fast/kmeans.py ``lloyd``.
///
/// V: float32 [m, n, d]; problem i uses V[i, :counts[i]] with clusters[i] clusters
/// (1 <= clusters[i] <= counts[i] <= n). Greedy k-means++ seeding driven by
/// draws[i, :] (float64 [m, n_draws], scikit-learn's uniforms: 1 + (k - 1) *
/// kmeanspp_trials(k) of them are read), then Lloyd steps until the labels repeat, the
/// squared centre shift is <= tol * mean variance of the points, or ``iters`` steps;
/// argmin ties to the smaller cluster. Writes labels [m, n] (-1 for padding) and
/// centroids [m, c_max, d] = mean of the members under those labels (0 if empty).
void batched_kmeans(const float* V, int64_t m, int64_t n, int64_t d, const int64_t* counts,
                    const int64_t* clusters, int64_t c_max, int64_t iters, double tol,
                    const double* draws, int64_t n_draws, int64_t* labels, float* centroids,
                    int num_threads);

/// Candidates per centre of scikit-learn's greedy k-means++: 2 + int(ln k).
int64_t kmeanspp_trials(int64_t k);

/// Uniform draws the seeding of k clusters reads: 1 + (k - 1) * kmeanspp_trials(k).
int64_t kmeanspp_draws(int64_t k);

/// q_child = normalise(alpha * qb + (1 - alpha) * normalise(centroid) + q0) with
/// normalise(v) = v / (||v|| + 1e-12) (spec section 4). qb, q0: [m, d];
/// centroids and out: [m, c, d].
void alpha_mix(const float* qb, const float* centroids, const float* q0, int64_t m, int64_t c,
               int64_t d, double alpha, float* out, int num_threads);

/// The rows of X (float32 [n, d]) divided by their L2 norms, into out (float32 [n, d]):
/// out[r, j] = RN32(x[r, j] / ||x[r]||), the norm the square root of the float64 squares
/// summed as numpy's np.add.reduce sums a row (pairwise, numpy's order), the division in
/// float64: bit for bit what rfmem_fast._validate computed with numpy before (RFMEM_SPEC.md
/// "Vectors and scores"). Returns -1, or the first row whose norm is not in (eps, inf)
/// (NaN / Inf values or a zero row; out's rows are then partly written and unusable).
/// Threads (num_threads most, 0 = the machine's) over rows; results never depend on them.
int64_t unit_rows(const float* X, int64_t n, int64_t d, double eps, float* out, int num_threads);

}  // namespace rfmem
