// The native beam driver: the whole Recollection path (RFMEM_SPEC.md section 4) for a
// batch of queries in one call, the C++ twin of rfmem_fast/recollection.py (the
// portable Python driver and this driver's oracle; same rows, scores and rounds).
//
// Each query runs all its rounds on one thread, back to back, so that its user's rows
// stay in cache from one round to the next (DESIGN.md "Cost model"); queries of one
// user run in lockstep groups that share each round's top-k call; the groups of a
// batch are spread over per-call threads (common.h parallel_for). The primitives are
// the native backend's own: segmented_topk (exact top-k, topk.cpp), batched_kmeans
// (scikit-learn's seeding replayed, kmeans.cpp) and alpha_mix, called per query.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace rfmem {

/// Segments from this many rows prune the rounds' scans (recollect.cpp): one scan of
/// the original query over the segment (its scores kept for the whole recollection, or
/// the probe's: recollect's ``ref``) lets every later round skip the rows that cannot
/// reach a branch query's top-k.
constexpr int64_t kPruneMinRows = 512;

/// Settings of the Recollection path (RFMemConfig's fields, spec section 4).
struct RecollectConfig {
  int64_t beam_width = 4;    // B: beam slots, and clusters per branch
  int64_t fanout = 1;        // F: a branch retrieves (B + level) * F candidates
  int64_t max_rounds = 10;   // R
  int64_t out_k = 10;        // stop once this many items were found
  double alpha = 0.5;        // weight of the branch query in the child mix
  double mmr_lambda = 0.9;   // 1.0 = MMR off
  float score_floor = 0.0f;  // candidates scoring below are dropped (compared in float32)
  int64_t kmeans_iters = 300;
  double kmeans_tol = 1e-4;
  // scikit-learn's uniforms per cluster count: row k (1 <= k <= beam_width) of a
  // [beam_width + 1, n_draws] table holds the draws of KMeans(k clusters)
  const double* draws = nullptr;
  int64_t n_draws = 0;
};

/// The MMR similarity of one set of cnt points (float32 [cnt, d]): mx[j] = the largest
/// <v_j, v_l> over l != j, -inf when cnt == 1; each inner product is the float64 sum of
/// the exact products on 4 partial sums (j mod 4, in order), then (s0 + s1) + (s2 + s3).
void max_similarity_set(const float* V, int64_t cnt, int64_t d, double* mx);

/// max_similarity_set for m sets: V float32 [m, n, d], set i = V[i, :counts[i]]
/// (0 <= counts[i] <= n); out float64 [m, n] (-inf beyond counts[i]).
void max_similarity(const float* V, int64_t m, int64_t n, int64_t d, const int64_t* counts, double* out,
                    int num_threads);

/// Where the time of one recollect() call goes (its optional ``stats`` output, float64
/// [kRecollectStats], ADDED to): seconds of the phases (summed over the threads), then
/// counts. Taken with steady_clock around each phase only when stats is given.
enum RecollectStat : int {
  kStatTotal = 0,    // the whole call (wall seconds of the calling thread)
  kStatScan,         // the rounds' top-k calls (levels >= 1; level 0 reuses the probe), and the
                     // scan of the original queries that prunes them
  kStatFilter,       // candidates filtered (floor, already returned) and gathered
  kStatMmr,          // MMR similarity of the kept candidates
  kStatKmeans,       // KMeans of the kept candidates
  kStatMix,          // alpha-mix of the children
  kStatSelect,       // next beam, hits appended
  kStatRounds,       // count: rounds run (a round = one level of one query group)
  kStatScanQueries,  // count: branch queries scored by the rounds' top-k calls
  kStatBranches,     // count: branches processed (KMeans problems, when any candidate was kept)
  kStatKept,         // count: candidates kept (KMeans points)
  kStatScanRows,     // count: rows the pruned rounds' scans scored (per query group, a row once)
  kRecollectStats
};

/// Result slots one query can fill: out_k - 1 + B * (B + R - 1) * F (a round adds at
/// most B * (B + level) * F items and the loop stops at out_k).
int64_t recollect_capacity(const RecollectConfig& cfg);

/// Bytes of one thread's workspace for groups of ``group`` queries of segments of at
/// most ``max_len`` rows.
size_t recollect_workspace_bytes(const RecollectConfig& cfg, int64_t d, int64_t max_len, int64_t group);

/// The Recollection path for b queries (spec section 4, as rfmem_fast/recollection.py).
///
/// X: float32 [n, d] bank rows; offsets: int64 [U + 1] CSR offsets; Q0: float32 [b, d]
/// the original (unit) queries; qseg: int64 [b] the segment of each query.
/// level0_scores / level0_rows: [b, k0] (k0 >= B * F) the probe's top-k of Q0, reused
/// as the first round's candidates, or both null (then searched here).
/// Writes, per query, the first ``width`` discovered items (rows int64 [b, width],
/// -1 padding; scores float32 [b, width], the (MMR-adjusted) discovery score, -inf
/// padding; width >= 1: out_k for the result, recollect_capacity(cfg) or more for every
/// hit) and the rounds that produced a beam (int64 [b]).
/// Queries of one segment run in groups of up to 16 (a round's top-k call serves all
/// their branches); the groups are spread over ``num_threads`` threads (0 = the
/// machine's), fewer when the work is small, at most
/// max(1, memory_budget / recollect_workspace_bytes(...)) (groups shrink when even one
/// does not fit). A single query runs on the calling thread (its top-k calls may split
/// rows over threads when their own work pays for it). ``xnorm``: an upper bound of
/// the row norms of X.
/// ``active``: uint8 [b] or null (all): a query with active[i] == 0 is not recollected
/// (padding rows, -inf scores, 0 rounds, no work).
/// ``topk``: null, or the scan options of every round's top-k call (a half-precision
/// scan copy of X and its type, a forced path; TopkOptions' num_threads and xnorm are
/// ignored: this call's are used). Results never depend on them. Its ``sel`` / ``qsel``
/// (qsel per query of this batch) make it a filtered search: every round's candidates
/// of a query come from its selected rows only (level0 must be filtered the same way).
/// ``ref`` / ``ref_ld`` / ``ref_ok``: null, or the scan scores of every Q0[i] over its
/// segment (float32 [b, ref_ld], row x at ref[i * ref_ld + x - offsets[qseg[i]]], the
/// float32 or half-precision scan path's lanes or the int8 copy's keys:
/// TopkOptions::scores_out of a probe with the same scan copy as ``topk``) for the
/// queries with ref_ok[i] != 0: the pruned rounds use them instead of scanning Q0 again. With a half-precision or int8 copy in ``topk``, the pruned rounds
/// score the float32 rows (a pruned round's rows lie near its top-k, where the int8 bound
/// would leave most of them to re-score exactly; a few float32 rows cost less than the
/// copy's whole segment); its other scans read the copy.
/// ``out_dense``: null, or float32 [b, out_k] for the exact dense scores RN32(Q0[i] .
/// X[row]) of each query's first out_k result rows (NaN padding and for queries not
/// recollected): what a search reports as the hits' dense scores.
/// ``stats``: null, or float64 [kRecollectStats] to which the call adds its profile
/// (RecollectStat). May throw std::bad_alloc (nothing else); the outputs are then unspecified.
void recollect(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U, const float* Q0,
               const int64_t* qseg, int64_t b, const float* level0_scores, const int64_t* level0_rows,
               int64_t k0, const RecollectConfig& cfg, int64_t width, int64_t* out_rows, float* out_scores,
               int64_t* out_rounds, int num_threads, double xnorm, int64_t memory_budget,
               const uint8_t* active = nullptr, const TopkOptions* topk = nullptr, double* stats = nullptr,
               const float* ref = nullptr, int64_t ref_ld = 0, const uint8_t* ref_ok = nullptr,
               float* out_dense = nullptr);

}  // namespace rfmem
