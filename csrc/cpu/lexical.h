// The lexical (BM25) channel's kernels (rfmem_fast/lexical.py, rfmem_fast/fusion.py):
// the BM25 hits of each query in its user's postings, and the exact fused top-k of a
// dense and a lexical channel (the proof is in rfmem_fast/fusion.py's docstring).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"

namespace rfmem {

/// One user's inverted index (rfmem_fast.lexical.UserPostings): terms int32 [T]
/// ascending; ptr int64 [T + 1] into rows / weight; rows int32 [P] local rows,
/// ascending within a term; weight float64 [P] w(t, d); n_rows rows of the segment.
struct PostingsRef {
  const int32_t* terms;
  int64_t T;
  const int64_t* ptr;
  const int32_t* rows;
  const double* weight;
  int64_t n_rows;
};

/// Number of the largest BM25 scores kept per query (rfmem_fast.fusion.TOP_LEXICAL).
constexpr int kTopLexical = 10;

/// Queries per part of bm25_hits' output (a part's hits, its queries' one after the other).
constexpr int64_t kBm25Part = 16;

/// The hits of queries order[p kBm25Part .. (p + 1) kBm25Part) of a bm25_hits call, one query after the other.
struct HitsPart {
  std::vector<int32_t> rows;
  std::vector<double> val;
};

/// The BM25 hits of b queries. Query i reads users[quser[i]] (quser[i] < 0: no
/// postings, no hit) with its distinct known terms qterms[qptr[i]:qptr[i + 1]] (first-
/// occurrence order) and their counts qcnt. BM25 of a local row = the sum over the
/// query's terms, in query-term order, of qcnt * weight (float64, from 0: what
/// numpy.bincount over UserPostings.postings_for gives). The queries are taken in order of
/// their user (``order`` [b]: stable by quser, so that a user's terms and postings stay in
/// cache across its queries), kBm25Part at a time. Sets hptr [b + 1], order and parts
/// [ceil(b / kBm25Part)]: query i's hits (BM25 > 0), ascending local rows and their BM25,
/// are entries hptr[i] .. hptr[i + 1] of what bm25_gather lays out from the parts; writes
/// mx [b] (largest BM25, 0 without a hit), top [b, kTopLexical] (largest first, 0
/// padding), sum / sumsq [b] (sums of the BM25 and of its squares over the hits in
/// ascending row order, sequentially: the sums over the user's rows in row order).
/// Threads (num_threads most, 0 = the machine's; common.h threads_for) over parts of
/// queries; results never depend on them. Returns -1, or the index of a user whose
/// postings read are malformed (a ptr that decreases or runs past the rows, a row outside
/// [0, n_rows)): the outputs are then unusable.
int64_t bm25_hits(const PostingsRef* users, int64_t n_users, const int64_t* quser, int64_t b,
                  const int32_t* qterms, const double* qcnt, const int64_t* qptr, int num_threads,
                  std::vector<int64_t>& hptr, std::vector<int64_t>& order, std::vector<HitsPart>& parts, double* mx,
                  double* top, double* sum, double* sumsq);

/// bm25_hits' hits laid out in query order: query i's at rows / val [hptr[i], hptr[i + 1])
/// (from the parts, in the order bm25_hits took the queries), on up to num_threads threads.
void bm25_gather(const std::vector<HitsPart>& parts, const std::vector<int64_t>& order,
                 const std::vector<int64_t>& hptr, int num_threads, int32_t* rows, double* val);

/// The exact fused top-kf of b queries (rfmem_fast.fusion: fused = dense + x, x >= 0 the
/// boost of a lexical hit, 0 elsewhere), from each query's exact dense top-K
/// (dsc / drows [b, K], -inf / -1 padding, rows of segment qseg[i] of offsets) and its
/// hits (hptr [b + 1]; hrows int32 local rows ascending; hx float64 boosts; hval
/// float64 BM25). Hits outside the dense list are screened with the scan kernel's
/// float32 score and its error bound and re-scored exactly (exact_score) only when
/// they can reach the kf-th fused score of the dense list. Writes rows int64 [b, kf]
/// (-1 padding), fused float64 (-inf), dense float32 RN32(q.x) (NaN), lex float64
/// (BM25, 0 for no hit; NaN padding), ordered by (fused desc, row asc). ``hf``: the hits'
/// scan scores (float32 [H], hybrid_probe's), used instead of computing them (or nullptr).
/// ``hup`` (with hf; or nullptr): per query an offset with hf[h] + hup[i] >= RN32(q_i.x)
/// (kernels.h TopkOptions::hit_keys / hit_up: the probe's keys); +inf: query i's keys
/// were not recorded, its hits are scored here. Without hup, hf is within the scan bound.
void fused_topk(const float* X, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg, int64_t b,
                const float* dsc, const int64_t* drows, int64_t K, const int64_t* hptr, const int32_t* hrows,
                const double* hx, const double* hval, int64_t kf, double xnorm, int num_threads, int64_t* out_rows,
                double* out_fused, float* out_dense, double* out_lex, const float* hf = nullptr,
                const double* hup = nullptr);

/// The arrays of fused_topk (same names, same meaning; K the dense lists' width and
/// stride) for FusedTopk.
struct FusedArgs {
  const float* X = nullptr;
  int64_t d = 0;
  const int64_t* offsets = nullptr;
  const float* Q = nullptr;
  const int64_t* qseg = nullptr;
  int64_t b = 0;
  const float* dsc = nullptr;
  const int64_t* drows = nullptr;
  int64_t K = 0;
  const int64_t* hptr = nullptr;
  const int32_t* hrows = nullptr;
  const double* hx = nullptr;
  const double* hval = nullptr;
  int64_t kf = 0;
  double xnorm = 0.0;
  int64_t* out_rows = nullptr;
  double* out_fused = nullptr;
  float* out_dense = nullptr;
  double* out_lex = nullptr;
  const float* hf = nullptr;
  const double* hup = nullptr;
  /// Boosts as per-query factors instead of hx (hx null): hit h of query i gets
  /// hscale[i] * (hval[h] / hden[i]) (0 where hden[i] <= 0), or hscale[i] * hval[h]
  /// without hden: rfmem_fast.fusion.apply_boost, the same float64 operations.
  const double* hscale = nullptr;
  const double* hden = nullptr;
};

/// fused_topk one query at a time: done(i, tid) writes query i's fused top-kf (its row of
/// the outputs) from its dense list and hits as they stand then (dsc / drows row i, hf and
/// hup[i] when given), on thread tid's scratch (prepare(n): threads 0 .. n - 1).
/// fused_topk runs it over its queries; a probe runs it as segmented_topk's
/// TopkOptions::after, each query's fused list taken right after its dense list and its
/// hits' keys, the segment still in cache. The results do not depend on which.
class FusedTopk final : public QueryHook {
 public:
  explicit FusedTopk(const FusedArgs& args);
  ~FusedTopk() override;
  void prepare(int nthreads) override;
  void done(int64_t i, int tid) override;
  /// -1, or a query whose boosts from hscale / hden are not all finite and >= 0 (its
  /// results are then unusable).
  int64_t bad_boost() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The dense exact top-k AND the exact fused top-kf of b queries in one pass over each
/// query's segment (topk.cpp): fused = fl64(RN32(q.x) + x), x the boost hx of the row's
/// hit (hptr / hrows / hx / hval as fused_topk), 0 elsewhere. Writes the dense top-k as
/// segmented_topk (out_scores / out_rows [b, k]) and the fused top-kf as fused_topk
/// (f_rows, f_fused, f_dense, f_lex [b, kf]); kf = 0: no fused list (hx unused). Writes
/// hf [H], every hit's float32 scan score (for fused_topk). The scan reads the float32 rows.
void hybrid_probe(const float* X, int64_t n, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg,
                  int64_t b, int64_t k, const int64_t* hptr, const int32_t* hrows, const double* hx,
                  const double* hval, int64_t kf, double xnorm, int num_threads, float* out_scores,
                  int64_t* out_rows, int64_t* f_rows, double* f_fused, float* f_dense, double* f_lex, float* hf);

}  // namespace rfmem
