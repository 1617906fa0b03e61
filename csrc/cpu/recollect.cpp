// The native beam driver (recollect.h): rfmem_fast/recollection.py, query by query.
//
// Work items are groups of at most kMaxGroup queries of ONE segment (consecutive in
// the order of the segments); a group runs all its rounds back to back on one thread,
// its queries in lockstep, so that the segment stays in cache from round to round
// (DESIGN.md "Cost model") and, when several queries share a user (a shared bank),
// one top-k call per round serves all their branches (the kernel shares each tile of
// the segment among them). Each query keeps its own state; the results of a query do
// not depend on its group (the exact top-k is batch-invariant).
//
// Per query, per round (level = 0 .. R-1), exactly as the Python driver:
//   1. candidates: the top (B + level) * F of every live branch query within the
//      query's segment (segmented_topk); level 0 reuses the probe's top-k when given;
//   2. per branch, in beam-slot order: keep the candidates with a row, a float32 score
//      >= score_floor and not yet returned, in their top-k order; with mmr_lambda < 1 a
//      candidate's score becomes lam * s - (1 - lam) * max_{other kept j} <v, v_j>
//      (float64, max_similarity_set; 0 when alone); KMeans of the kept vectors into
//      min(B, kept) clusters (batched_kmeans: scikit-learn's seeding replayed); the
//      child of cluster c is alpha_mix(branch query, centroid c, q0) with accumulated
//      score branch acc + (sum of its members' scores in candidate order, from 0); a
//      cluster without members yields no child; a child's query is mixed only once it
//      is in a beam that runs another round (the mixes nobody scans are skipped);
//   3. the next beam: the B children of largest accumulated score over the
//      (slot, cluster) grid, stable (ties to the smaller slot * B + cluster);
//   4. the hits of the new beam in (beam slot, candidate) order, first occurrences
//      only, are appended to the result (discovery order); then stop if no child was
//      made, once out_k items are found, or after R rounds.
// Filtered search: with a selection table in the batch's TopkOptions (kernels.h
// SelTable, qsel per query of the batch), every round's top-k call gets the selection
// of each branch's query, so all candidates come from the selected rows (level 0 reuses
// the probe, filtered the same way).
// Pruning (segments of >= kPruneMinRows rows, float32 scans at SIMD levels >= 1): the
// group first scores its original queries q0 against every row of the segment (one
// pass, kept for all rounds); a round's top-k call for a branch query q then skips any
// row x whose bound f0(x) + rad(q) (prune_radius: the scan bound of q0 and ||x|| ||q -
// q0||) is below a proven lower bound of q's k-th exact score (topk.cpp scan_pruned).
// Skipped rows are provably outside the top-k, so every result is the full scan's; the
// branches of one query then share each call (one call per query of the group). A
// filtered query is not pruned: its calls score its selection's rows (a list: usually
// far fewer than the segment), so no scan of q0 over the segment is made for it.
// "Not yet returned" is one bit per (row of the segment, query of the group), set when
// an item is appended and cleared when the group ends, so its cost does not grow with
// out_k.
#include "recollect.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "common.h"
#include "exact.h"
#include "kernels.h"

namespace rfmem {
namespace {

// <a, b> of two float32 vectors in float64: exact products, summed on 4 partial sums
// (j mod 4) in order of j, then (s0 + s1) + (s2 + s3)
inline double dot64(const float* a, const float* b, int64_t d) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t j = 0;
  for (; j + 4 <= d; j += 4) {
    s0 += static_cast<double>(a[j]) * static_cast<double>(b[j]);
    s1 += static_cast<double>(a[j + 1]) * static_cast<double>(b[j + 1]);
    s2 += static_cast<double>(a[j + 2]) * static_cast<double>(b[j + 2]);
    s3 += static_cast<double>(a[j + 3]) * static_cast<double>(b[j + 3]);
  }
  for (; j < d; ++j) s0 += static_cast<double>(a[j]) * static_cast<double>(b[j]);
  return (s0 + s1) + (s2 + s3);
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The profile of one thread (recollect's ``stats``): lap(i) adds the time since the last
// lap to phase i; nothing is read from the clock when off.
struct Profile {
  bool on = false;
  double t = 0.0;
  double acc[kRecollectStats] = {0.0};
  void start() {
    if (on) t = now_s();
  }
  void lap(int i) {
    if (!on) return;
    const double u = now_s();
    acc[i] += u - t;
    t = u;
  }
  void count(int i, double v) {
    if (on) acc[i] += v;
  }
};

struct Child {
  double acc;
  int64_t flat;  // slot * B + cluster
};

constexpr int64_t kMaxGroup = 16;  // queries of one group (one bit each in the seen masks)


// One thread's buffers for a group of G queries, sized for the largest round
// (K = (B + R - 1) * F candidates per branch, G * B branches).
struct Workspace {
  // per query: beam queries [G, B, d] (and the next beam's centroids and parent slots),
  // beam scores [G, B], results [G, cap]
  std::vector<float> bq, nbq;
  std::vector<double> bacc, res_sc;
  std::vector<int64_t> res_rows;
  // per branch of a round: its query [GB, d], candidates [GB, K], kept candidates and
  // their scores / labels [GB, K], children's centroids [GB, B, d] and their sizes / gains [GB, B]
  std::vector<float> qbuf, c_sc, child_q;
  std::vector<int64_t> segs, qsels, c_rows, rows, lab, nvalid, kc, csize, par;
  std::vector<double> mmr, cgain;
  // scratch of one branch / one query
  std::vector<float> V;
  std::vector<double> mx;
  std::vector<Child> children;
  std::vector<uint16_t> seen;  // bit g: returned to query g of the group; one per row of the segment
  // pruning: the original queries' scan scores [G, max_len], their bounds' parts, and
  // the radius of each branch query of a round [B]
  std::vector<float> ref;
  std::vector<double> ref_b0, ref_qn, ref_fmax, rad;
  Profile prof;

  void allocate(int64_t G, int64_t B, int64_t Kmax, int64_t d, int64_t cap, int64_t max_len) {
    const size_t g = static_cast<size_t>(G), b = static_cast<size_t>(B), k = static_cast<size_t>(Kmax),
                 dd = static_cast<size_t>(d);
    bq.resize(g * b * dd);
    nbq.resize(g * b * dd);
    bacc.resize(g * b);
    res_sc.resize(g * static_cast<size_t>(cap));
    res_rows.resize(g * static_cast<size_t>(cap));
    qbuf.resize(g * b * dd);
    c_sc.resize(g * b * k);
    child_q.resize(g * b * b * dd);
    segs.resize(g * b);
    qsels.resize(g * b);
    c_rows.resize(g * b * k);
    rows.resize(g * b * k);
    lab.resize(g * b * k);
    nvalid.resize(g * b);
    kc.resize(g * b);
    csize.resize(g * b * b);
    par.resize(g * b);
    mmr.resize(g * b * k);
    cgain.resize(g * b * b);
    V.resize(k * dd);
    mx.resize(k);
    children.resize(b * b);
    seen.assign(static_cast<size_t>(max_len), 0);
    if (prune) {
      ref.resize(g * static_cast<size_t>(max_len));
      ref_b0.resize(g);
      ref_qn.resize(g);
      ref_fmax.resize(g);
      rad.resize(b);
    }
  }
  bool prune = false;  // set before allocate()
};

struct Batch {
  const float* X;
  int64_t n, d;
  const int64_t* offsets;
  int64_t U;
  const float* Q0;
  const int64_t* qseg;
  const float* l0_s;
  const int64_t* l0_r;
  int64_t k0;
  double xnorm;
  int64_t width;
  int64_t* out_rows;
  float* out_scores;
  int64_t* out_rounds;
  TopkOptions topk;  // scan copy, type and path of the rounds' top-k calls
  const float* ref;  // the original queries' scan scores from the caller (or null): [b, ref_ld]
  int64_t ref_ld;
  const uint8_t* ref_ok;
  float* out_dense;  // [b, out_k] exact scores RN32(q0 . x) of the result rows (or null)
};

// One branch of a round: filter its candidates (cs / cr [K]) for query bit ``bit``,
// MMR, KMeans, the children's centroids and gains. Writes the kept rows / scores /
// labels, nvalid, kc, the centroids (child_q), csize, cgain of p. A child's query (the
// alpha-mix of its branch query, its centroid and q0) is made only when it is selected
// for a beam that runs another round (recollect_group).
void branch(const Batch& bt, const RecollectConfig& cfg, Workspace& w, int64_t p, int64_t K, int64_t a,
            uint16_t bit) {
  const int64_t B = cfg.beam_width, d = bt.d;
  const float* cs = w.c_sc.data() + p * K;
  const int64_t* cr = w.c_rows.data() + p * K;
  int64_t* rows = w.rows.data() + p * K;
  double* mmr = w.mmr.data() + p * K;
  int64_t* lab = w.lab.data() + p * K;
  int64_t nv = 0;
  for (int64_t t = 0; t < K; ++t) {
    if (cr[t] >= 0 && cs[t] >= cfg.score_floor && !(w.seen[cr[t] - a] & bit)) {
      rows[nv] = cr[t];
      mmr[nv] = static_cast<double>(cs[t]);
      ++nv;
    }
  }
  w.nvalid[p] = nv;
  w.kc[p] = 0;
  if (nv == 0) {
    w.prof.lap(kStatFilter);
    return;
  }
  float* V = w.V.data();
  for (int64_t j = 0; j < nv; ++j) std::copy(bt.X + rows[j] * d, bt.X + (rows[j] + 1) * d, V + j * d);
  w.prof.lap(kStatFilter);
  w.prof.count(kStatBranches, 1.0);
  w.prof.count(kStatKept, static_cast<double>(nv));
  const double lam = cfg.mmr_lambda;
  if (lam < 1.0) {
    double* mx = w.mx.data();
    max_similarity_set(V, nv, d, mx);
    for (int64_t i = 0; i < nv; ++i) {
      const double m = std::isfinite(mx[i]) ? mx[i] : 0.0;
      mmr[i] = lam * mmr[i] - (1.0 - lam) * m;
    }
  }
  w.prof.lap(kStatMmr);
  const int64_t kc = std::min(nv, B);
  w.kc[p] = kc;
  batched_kmeans(V, 1, nv, d, &nv, &kc, kc, cfg.kmeans_iters, cfg.kmeans_tol, cfg.draws + kc * cfg.n_draws,
                 cfg.n_draws, lab, w.child_q.data() + p * B * d, 1);
  w.prof.lap(kStatKmeans);
  int64_t* csize = w.csize.data() + p * B;
  double* cgain = w.cgain.data() + p * B;
  std::fill(csize, csize + kc, int64_t{0});
  std::fill(cgain, cgain + kc, 0.0);
  for (int64_t j = 0; j < nv; ++j) {  // members' scores summed in candidate order
    ++csize[lab[j]];
    cgain[lab[j]] += mmr[j];
  }
  w.prof.lap(kStatSelect);
}

// The radius of branch query q around its original query q0 (TopkOptions::prune_rad):
// with f0(x) the reference score of q0 for row x, q0.x <= f0(x) + B0 (a float32 or
// half-precision scan's scores lie within its bound B0 of q0.x, scan_bound; the int8
// scan's keys are upper bounds of RN32(q0.x), which lies within 2^-24 |q0.x| + 2^-150 <=
// B0 of q0.x, B0 the float32 scan's bound), |f0(x)| <= fmax over
// the segment, and R >= ||x||:
//   q.x = q0.x + x.(q - q0) <= f0(x) + B0 + R ||q - q0|| =: V,
// and RN32(q.x) <= RN32(V) <= V + 2^-24 |V| + 2^-149, |V| <= fmax + B0 + R ||q - q0||:
// rad = B0 + R delta + 2^-23 (fmax + B0 + R delta) + 2^-140 with delta >= ||q - q0||
// (float64 sum of the squared differences, each exact or within 2^-53, inflated), every
// term rounded up by the factor kSlack.
double prune_radius(const float* q, const float* q0, int64_t d, double R, double b0, double fmax) {
  double s = 0.0;
  for (int64_t t = 0; t < d; ++t) {
    const double e = static_cast<double>(q[t]) - static_cast<double>(q0[t]);
    s += e * e;
  }
  const double delta = std::sqrt(s * (1.0 + gamma_n(static_cast<double>(d + 4), kU64))) * kSlack;
  const double slack = 1.1920928955078125e-07 * (fmax + b0 + R * delta) + 7.174648137343064e-43;
  return (b0 + R * delta * kSlack + slack) * kSlack;
}

// The largest |f| of the reference scores f[0:len] (inf when one is not finite).
double max_abs(const float* f, int64_t len) {
  float m = 0.0f;
  bool finite = true;
  for (int64_t x = 0; x < len; ++x) {
    const float v = std::fabs(f[x]);
    finite = finite && v <= std::numeric_limits<float>::max();
    m = v > m ? v : m;
  }
  return finite ? static_cast<double>(m) : std::numeric_limits<double>::infinity();
}

// All rounds of the queries idx[0 : G] (one segment), in lockstep.
void recollect_group(const Batch& bt, const RecollectConfig& cfg, const int64_t* idx, int64_t G, Workspace& w,
                     int inner_threads) {
  const int64_t B = cfg.beam_width, F = cfg.fanout, R = cfg.max_rounds, d = bt.d;
  const int64_t cap = recollect_capacity(cfg);
  const int64_t seg = bt.qseg[idx[0]];
  const int64_t a = bt.offsets[seg];
  int64_t nlive[kMaxGroup], res_len[kMaxGroup], rounds[kMaxGroup], p0[kMaxGroup];
  bool active[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const float* q0 = bt.Q0 + idx[g] * d;
    std::copy(q0, q0 + d, w.bq.data() + g * B * d);
    w.bacc[g * B] = 0.0;
    nlive[g] = 1;
    res_len[g] = 0;
    rounds[g] = 0;
    active[g] = true;
  }
  std::fill(w.segs.begin(), w.segs.end(), seg);
  w.prof.start();
  // pruning: the scan scores of the original queries over the segment, once (scores_f32:
  // the scan path's lanes, so its bound B0 holds), and the parts of that bound
  const int64_t len = bt.offsets[seg + 1] - a;
  const bool pruned = w.prune && len >= kPruneMinRows;
  const float* refp[kMaxGroup];  // the scan scores of q0 of query g over the segment
  bool probe_ref[kMaxGroup] = {};  // refp[g] from the probe (its scan copy's bound), else scanned here
  int64_t prev_scored[kMaxGroup] = {0};  // rows scored by query g's last pruned round
  if (pruned) {
    const float* qs[kMaxGroup];
    int nq = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (bt.topk.sel != nullptr && bt.topk.qsel != nullptr && bt.topk.qsel[idx[g]] >= 0) {
        refp[g] = nullptr;  // a filtered query: its rounds score its selection's rows (no pruning)
      } else if (bt.ref != nullptr && bt.ref_ok[idx[g]]) {  // the probe's scan already has them
        refp[g] = bt.ref + idx[g] * bt.ref_ld;
        probe_ref[g] = true;
      } else {
        refp[g] = w.ref.data() + nq * len;
        qs[nq++] = bt.Q0 + idx[g] * d;
      }
    }
    if (nq > 0) simd_kernels().scores_f32(bt.X, d, a, a + len, qs, nq, w.ref.data(), len);
    for (int64_t g = 0; g < G; ++g) {
      const float* q0 = bt.Q0 + idx[g] * d;
      double qq = 0.0;
      for (int64_t t = 0; t < d; ++t) qq += static_cast<double>(q0[t]) * static_cast<double>(q0[t]);
      w.ref_qn[g] = std::sqrt(qq) * kSlack;  // >= ||q0|| (float64 sum of exact squares: relative error << 2^-30)
      // the bound of the scan that made the scores: the probe's over its scan copy (a
      // half-precision copy's is wider; the int8 keys are upper bounds: the float32 one)
      const ScanType st = probe_ref[g] && bt.topk.scan != nullptr ? bt.topk.scan_type : ScanType::kF32;
      w.ref_b0[g] = scan_bound(d, st, bt.xnorm, w.ref_qn[g]);
      if (refp[g] != nullptr) w.ref_fmax[g] = max_abs(refp[g], len) * kSlack;
    }
    w.prof.lap(kStatScan);
  }

  for (int64_t level = 0; level < R; ++level) {
    const int64_t K = (B + level) * F;
    // ---- 1. candidates of every live branch of the active queries: [nb, K]
    int64_t nb = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      p0[g] = nb;
      nb += nlive[g];
    }
    if (nb == 0) break;
    w.prof.count(kStatRounds, 1.0);
    if (level == 0 && bt.l0_s != nullptr) {
      for (int64_t g = 0; g < G; ++g) {  // one branch each: the probe's first K
        if (!active[g]) continue;
        const int64_t o = idx[g] * bt.k0;
        std::copy(bt.l0_s + o, bt.l0_s + o + K, w.c_sc.data() + p0[g] * K);
        std::copy(bt.l0_r + o, bt.l0_r + o + K, w.c_rows.data() + p0[g] * K);
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        if (!active[g]) continue;
        float* qb = w.qbuf.data() + p0[g] * d;
        if (level == 0) {  // the original query
          std::copy(w.bq.data() + g * B * d, w.bq.data() + (g * B + nlive[g]) * d, qb);
          continue;
        }
        // the beam's queries: the alpha-mix of each selected child's branch query (slot
        // par[j] of the previous beam), its centroid (nbq[j]) and q0; then the beam
        const float* q0 = bt.Q0 + idx[g] * d;
        for (int64_t j = 0; j < nlive[g]; ++j)
          alpha_mix(w.bq.data() + (g * B + w.par[g * B + j]) * d, w.nbq.data() + (g * B + j) * d, q0, 1, 1, d,
                    cfg.alpha, qb + j * d, 1);
        std::copy(qb, qb + nlive[g] * d, w.bq.data() + g * B * d);
      }
      w.prof.lap(kStatMix);
      TopkOptions opt = bt.topk;
      opt.num_threads = inner_threads;
      opt.xnorm = bt.xnorm;
      if (opt.sel != nullptr && bt.topk.qsel != nullptr) {  // each branch: its query's selection
        for (int64_t g = 0; g < G; ++g) {
          if (!active[g]) continue;
          std::fill(w.qsels.data() + p0[g], w.qsels.data() + p0[g] + nlive[g], bt.topk.qsel[idx[g]]);
        }
        opt.qsel = w.qsels.data();
      }
      if (!pruned || level == 0) {  // one call for every branch of the group (they share each block)
        segmented_topk(bt.X, bt.n, d, bt.offsets, bt.U, w.qbuf.data(), w.segs.data(), nb, K, w.c_sc.data(),
                       w.c_rows.data(), opt);
      } else {  // per query: its branches' rows pruned by its own scores (prune_radius)
        int64_t scored_all = 0;
        opt.prune_row0 = a;
        // the float32 rows: a pruned round scores the rows near its top-k, where the int8
        // bound would leave most of them to re-score exactly (measured slower), and a few
        // float32 rows cost less than a half copy's unpruned scan (multi-tenant float16
        // bank: Recollection path 2.0x)
        opt.scan_i8 = nullptr;
        opt.scan_meta = nullptr;
        opt.scan = nullptr;
        opt.scan_type = ScanType::kF32;
        for (int64_t g = 0; g < G; ++g) {
          if (!active[g]) continue;
          const float* qb = w.qbuf.data() + p0[g] * d;
          if (opt.qsel != nullptr) opt.qsel = w.qsels.data() + p0[g];  // its branches' selections
          if (refp[g] == nullptr) {  // filtered: the selection's rows, unpruned (the scan copy), threads by their count
            TopkOptions fo = opt;
            fo.scan = bt.topk.scan;
            fo.scan_i8 = bt.topk.scan_i8;
            fo.scan_meta = bt.topk.scan_meta;
            fo.scan_type = bt.topk.scan_type;
            fo.prune_ref = nullptr;
            fo.prune_rad = nullptr;
            fo.rows_scored = nullptr;
            fo.num_threads = inner_threads;
            segmented_topk(bt.X, bt.n, d, bt.offsets, bt.U, qb, w.segs.data(), nlive[g], K,
                           w.c_sc.data() + p0[g] * K, w.c_rows.data() + p0[g] * K, fo);
            continue;
          }
          for (int64_t j = 0; j < nlive[g]; ++j)
            w.rad[j] = prune_radius(qb + j * d, bt.Q0 + idx[g] * d, d, bt.xnorm, w.ref_b0[g], w.ref_fmax[g]);
          opt.prune_ref = refp[g];
          opt.prune_rad = w.rad.data();
          // threads by the work the rows scored in this query's previous pruned round
          // predict (the first one: one thread); the full segment's would overestimate it
          int64_t scored = 0;
          opt.rows_scored = &scored;
          opt.num_threads = threads_for(inner_threads, static_cast<double>(prev_scored[g]) * nlive[g] * d, 1 << 30);
          segmented_topk(bt.X, bt.n, d, bt.offsets, bt.U, qb, w.segs.data(), nlive[g], K, w.c_sc.data() + p0[g] * K,
                         w.c_rows.data() + p0[g] * K, opt);
          prev_scored[g] = scored;
          scored_all += scored;
        }
        w.prof.count(kStatScanRows, static_cast<double>(scored_all));
      }
      w.prof.count(kStatScanQueries, static_cast<double>(nb));
    }
    w.prof.lap(kStatScan);
    // ---- 2. per branch: filter, MMR, KMeans, children
    for (int64_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      for (int64_t s = 0; s < nlive[g]; ++s)
        branch(bt, cfg, w, p0[g] + s, K, a, static_cast<uint16_t>(1u << g));
    }
    // ---- 3, 4. per query: the next beam (the B best children, stable on ties) and its hits
    for (int64_t g = 0; g < G; ++g) {
      if (!active[g]) continue;
      const uint16_t bit = static_cast<uint16_t>(1u << g);
      int64_t nc = 0;
      for (int64_t s = 0; s < nlive[g]; ++s) {
        const int64_t p = p0[g] + s;
        for (int64_t c = 0; c < w.kc[p]; ++c)
          if (w.csize[p * B + c] > 0) w.children[nc++] = Child{w.bacc[g * B + s] + w.cgain[p * B + c], s * B + c};
      }
      if (nc == 0) {  // no child: the query stops
        active[g] = false;
        continue;
      }
      std::stable_sort(w.children.begin(), w.children.begin() + nc,
                       [](const Child& x, const Child& y) { return x.acc > y.acc; });
      const int64_t nsel = std::min(nc, B);
      int64_t* rr = w.res_rows.data() + g * cap;
      double* rs = w.res_sc.data() + g * cap;
      float* nbq = w.nbq.data() + g * B * d;
      for (int64_t j = 0; j < nsel; ++j) {
        const int64_t s = w.children[j].flat / B, c = w.children[j].flat % B, p = p0[g] + s;
        const int64_t* rows = w.rows.data() + p * K;
        const double* mmr = w.mmr.data() + p * K;
        const int64_t* lab = w.lab.data() + p * K;
        for (int64_t t = 0; t < w.nvalid[p]; ++t) {
          if (lab[t] != c || (w.seen[rows[t] - a] & bit)) continue;
          w.seen[rows[t] - a] |= bit;
          rr[res_len[g]] = rows[t];
          rs[res_len[g]] = mmr[t];
          ++res_len[g];
        }
        const float* cq = w.child_q.data() + (p * B + c) * d;  // its centroid
        std::copy(cq, cq + d, nbq + j * d);
        w.par[g * B + j] = s;
      }
      for (int64_t j = 0; j < nsel; ++j) w.bacc[g * B + j] = w.children[j].acc;
      nlive[g] = nsel;
      ++rounds[g];
      if (res_len[g] >= cfg.out_k) active[g] = false;
    }
    w.prof.lap(kStatSelect);
  }

  for (int64_t g = 0; g < G; ++g) {
    const int64_t qi = idx[g];
    const int64_t* rr = w.res_rows.data() + g * cap;
    const double* rs = w.res_sc.data() + g * cap;
    int64_t* orow = bt.out_rows + qi * bt.width;
    float* osc = bt.out_scores + qi * bt.width;
    for (int64_t t = 0; t < bt.width; ++t) {
      orow[t] = t < res_len[g] ? rr[t] : -1;
      osc[t] = t < res_len[g] ? static_cast<float>(rs[t]) : -std::numeric_limits<float>::infinity();
    }
    bt.out_rounds[qi] = rounds[g];
    if (bt.out_dense != nullptr) {  // the result rows' exact dense scores (what search reports)
      const double g64 = gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64) * kSlack;
      float* od = bt.out_dense + qi * cfg.out_k;
      const float* q0 = bt.Q0 + qi * d;
      for (int64_t t = 0; t < cfg.out_k; ++t)
        od[t] = t < res_len[g] ? exact_score(q0, bt.X + rr[t] * d, d, g64) : std::numeric_limits<float>::quiet_NaN();
    }
    for (int64_t t = 0; t < res_len[g]; ++t) w.seen[rr[t] - a] = 0;
  }
}

}  // namespace

void max_similarity_set(const float* V, int64_t cnt, int64_t d, double* mx) {
  std::fill(mx, mx + cnt, -std::numeric_limits<double>::infinity());
  for (int64_t i = 1; i < cnt; ++i) {
    for (int64_t j = 0; j < i; ++j) {  // <v_i, v_j> == <v_j, v_i> bit for bit: computed once
      const double g = dot64(V + i * d, V + j * d, d);
      mx[i] = std::max(mx[i], g);
      mx[j] = std::max(mx[j], g);
    }
  }
}

void max_similarity(const float* V, int64_t m, int64_t n, int64_t d, const int64_t* counts, double* out,
                    int num_threads) {
  double work = 0.0;
  for (int64_t i = 0; i < m; ++i) work += 0.5 * static_cast<double>(counts[i] * counts[i]) * static_cast<double>(d);
  parallel_for(m, threads_for(num_threads, work, m), [&](int64_t i, int) {
    double* o = out + i * n;
    max_similarity_set(V + i * n * d, counts[i], d, o);
    std::fill(o + counts[i], o + n, -std::numeric_limits<double>::infinity());
  });
}

int64_t recollect_capacity(const RecollectConfig& cfg) {
  return cfg.out_k - 1 + cfg.beam_width * (cfg.beam_width + cfg.max_rounds - 1) * cfg.fanout;
}

size_t recollect_workspace_bytes(const RecollectConfig& cfg, int64_t d, int64_t max_len, int64_t group) {
  const size_t G = static_cast<size_t>(std::max<int64_t>(group, 1)), B = static_cast<size_t>(cfg.beam_width),
               dd = static_cast<size_t>(d);
  const size_t K = static_cast<size_t>((cfg.beam_width + cfg.max_rounds - 1) * cfg.fanout);
  const size_t cap = static_cast<size_t>(recollect_capacity(cfg));
  // per query: beams and results; per branch: its query, candidates, kept candidates,
  // children; per thread: one branch's vectors and what batched_kmeans allocates for one
  // problem (float64 points, transposed points, centres), the seen masks
  const size_t per_query = (3 * B * dd + B * B * dd) * sizeof(float) + B * K * (4 + 8 + 8 + 8 + 8) +
                           B * (8 * 4 + B * 24) + cap * 16;
  // (+ the pruning scores of the group's original queries over the segment)
  return G * per_query + K * dd * (4 + 8 + 8) + K * 8 + B * dd * 12 + B * B * 16 +
         static_cast<size_t>(max_len) * (sizeof(uint16_t) + G * sizeof(float)) + 4096;
}

void recollect(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U, const float* Q0,
               const int64_t* qseg, int64_t b, const float* level0_scores, const int64_t* level0_rows,
               int64_t k0, const RecollectConfig& cfg, int64_t width, int64_t* out_rows, float* out_scores,
               int64_t* out_rounds, int num_threads, double xnorm, int64_t memory_budget,
               const uint8_t* active, const TopkOptions* topk, double* stats, const float* ref, int64_t ref_ld,
               const uint8_t* ref_ok, float* out_dense) {
  const double t_start = stats ? now_s() : 0.0;
  if (b == 0) return;
  // the queries to recollect, by segment (stable); the others get padding at once
  std::vector<int64_t> todo;
  todo.reserve(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    if (active == nullptr || active[i]) {
      todo.push_back(i);
      continue;
    }
    std::fill(out_rows + i * width, out_rows + (i + 1) * width, int64_t{-1});
    std::fill(out_scores + i * width, out_scores + (i + 1) * width, -std::numeric_limits<float>::infinity());
    out_rounds[i] = 0;
    if (out_dense != nullptr)
      std::fill(out_dense + i * cfg.out_k, out_dense + (i + 1) * cfg.out_k, std::numeric_limits<float>::quiet_NaN());
  }
  const int64_t nq = static_cast<int64_t>(todo.size());
  if (nq == 0) return;
  std::stable_sort(todo.begin(), todo.end(), [qseg](int64_t x, int64_t y) { return qseg[x] < qseg[y]; });
  if (!(xnorm >= 0.0)) xnorm = row_norm_bound(X, n, d);
  const int64_t B = cfg.beam_width;
  const int64_t Kmax = (cfg.beam_width + cfg.max_rounds - 1) * cfg.fanout;
  const int64_t cap = recollect_capacity(cfg);
  int64_t max_len = 0;
  double work = 0.0;  // multiply-adds: a probe's worth plus B branches over ~3 more rounds
  const double rounds_est = static_cast<double>(1 + B * std::min<int64_t>(cfg.max_rounds - 1, 3));
  for (const int64_t i : todo) {
    const int64_t len = offsets[qseg[i] + 1] - offsets[qseg[i]];
    max_len = std::max(max_len, len);
    work += static_cast<double>(len) * static_cast<double>(d) * rounds_est;
  }
  // groups: up to G queries of one segment, G such that a round's top-k call holds about
  // 64 branch queries (the kernel shares each tile among up to 16), and at least as many
  // groups as threads when the batch allows it
  int nthreads = threads_for(num_threads, work, nq);
  int64_t G = std::max<int64_t>(1, std::min<int64_t>(kMaxGroup, 64 / B));
  G = std::max<int64_t>(1, std::min<int64_t>(G, nq / nthreads));
  const double by_budget =
      static_cast<double>(memory_budget) / static_cast<double>(recollect_workspace_bytes(cfg, d, max_len, G));
  if (by_budget < static_cast<double>(nthreads)) nthreads = std::max(1, static_cast<int>(by_budget));
  while (G > 1 && static_cast<double>(recollect_workspace_bytes(cfg, d, max_len, G)) > static_cast<double>(memory_budget))
    G /= 2;  // one thread whose group does not fit: smaller groups
  std::vector<int64_t> group_start;
  for (int64_t i = 0; i < nq;) {
    int64_t j = i + 1;
    while (j < nq && j - i < G && qseg[todo[j]] == qseg[todo[i]]) ++j;
    group_start.push_back(i);
    i = j;
  }
  const int64_t ngroups = static_cast<int64_t>(group_start.size());
  group_start.push_back(nq);
  nthreads = static_cast<int>(std::min<int64_t>(nthreads, ngroups));
  // a single worker lets its top-k calls use the threads their own work pays for
  const int inner_threads = nthreads == 1 ? num_threads : 1;

  std::vector<Workspace> ws(static_cast<size_t>(nthreads));
  // pruning needs the float32 rows' SIMD kernels (with a half-precision or int8 copy the
  // pruned rounds score the float32 rows: recollect_group), and pays only when later
  // rounds scan (max_rounds > 1)
  const bool prune = simd_kernels().scores_f32 != nullptr && cfg.max_rounds > 1 && max_len >= kPruneMinRows;
  for (Workspace& w : ws) {
    w.prune = prune;
    w.allocate(G, B, Kmax, d, cap, max_len);
    w.prof.on = stats != nullptr;
  }
  const Batch bt{X,     n,  d,     offsets, U,        Q0,         qseg,      level0_scores,
                 level0_rows, k0, xnorm, width,   out_rows, out_scores, out_rounds, topk ? *topk : TopkOptions{},
                 ref_ok != nullptr ? ref : nullptr, ref_ld, ref_ok, out_dense};
  std::exception_ptr error;
  std::mutex error_lock;
  parallel_for(ngroups, nthreads, [&](int64_t t, int tid) {
    try {
      const int64_t g0 = group_start[static_cast<size_t>(t)], g1 = group_start[static_cast<size_t>(t) + 1];
      recollect_group(bt, cfg, todo.data() + g0, g1 - g0, ws[static_cast<size_t>(tid)], inner_threads);
    } catch (...) {  // bad_alloc inside a primitive: reported after the join
      std::lock_guard<std::mutex> g(error_lock);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
  pool_keep_awake();  // the next query's probe finds the helpers awake (pool.h)
  if (stats) {
    for (const Workspace& w : ws)
      for (int i = 1; i < kRecollectStats; ++i) stats[i] += w.prof.acc[i];
    stats[kStatTotal] += now_s() - t_start;
  }
}

}  // namespace rfmem
