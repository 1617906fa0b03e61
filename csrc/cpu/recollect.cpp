// The native beam driver (recollect.h): rfmem_fast/recollection.py, one query at a time.
//
// Per query, per round (level = 0 .. R-1), exactly as the Python driver:
//   1. candidates: the top (B + level) * F of every live branch query within the
//      query's segment (segmented_topk, one call for all live branches, which share
//      each tile of the segment); level 0 reuses the probe's top-k when given;
//   2. per branch, in beam-slot order: keep the candidates with a row, a float32 score
//      >= score_floor and not yet returned, in their top-k order; with mmr_lambda < 1 a
//      candidate's score becomes lam * s - (1 - lam) * max_{other kept j} <v, v_j>
//      (float64, max_similarity_set; 0 when alone); KMeans of the kept vectors into min(B, kept) clusters
//      (batched_kmeans: scikit-learn's seeding replayed); the child of cluster c is
//      alpha_mix(branch query, centroid c, q0) with accumulated score
//      branch acc + (sum of its members' scores in candidate order, from 0);
//      a cluster without members yields no child;
//   3. the next beam: the B children of largest accumulated score over the
//      (slot, cluster) grid, stable (ties to the smaller slot * B + cluster);
//   4. the hits of the new beam in (beam slot, candidate) order, first occurrences
//      only, are appended to the result (discovery order); then stop if no child was
//      made, once out_k items are found, or after R rounds.
// "Not yet returned" is a byte per row of the segment (set when an item is appended,
// cleared when the query ends), so the cost does not grow with out_k.
#include "recollect.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "common.h"
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

struct Child {
  double acc;
  int64_t flat;  // slot * B + cluster
};

// One thread's buffers, sized for the largest round (K = (B + R - 1) * F candidates).
struct Workspace {
  std::vector<float> bq, nbq, c_sc, V, cent, child_q;
  std::vector<double> bacc, mmr, mx, res_sc;
  std::vector<int64_t> segs, c_rows, rows, lab, nvalid, kc, csize, res_rows;
  std::vector<double> cgain;
  std::vector<Child> children;
  std::vector<uint8_t> seen;  // one byte per row of the query's segment

  void allocate(int64_t B, int64_t Kmax, int64_t d, int64_t cap, int64_t max_len) {
    const size_t b = static_cast<size_t>(B), k = static_cast<size_t>(Kmax), dd = static_cast<size_t>(d);
    bq.resize(b * dd);
    nbq.resize(b * dd);
    c_sc.resize(b * k);
    V.resize(k * dd);
    cent.resize(b * dd);
    child_q.resize(b * b * dd);
    bacc.resize(b);
    mmr.resize(b * k);
    mx.resize(k);
    res_sc.resize(static_cast<size_t>(cap));
    segs.resize(b);
    c_rows.resize(b * k);
    rows.resize(b * k);
    lab.resize(b * k);
    nvalid.resize(b);
    kc.resize(b);
    csize.resize(b * b);
    res_rows.resize(static_cast<size_t>(cap));
    cgain.resize(b * b);
    children.resize(b * b);
    seen.assign(static_cast<size_t>(max_len), 0);
  }
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
};

void recollect_one(const Batch& bt, const RecollectConfig& cfg, int64_t qi, Workspace& w, int inner_threads) {
  const int64_t B = cfg.beam_width, F = cfg.fanout, R = cfg.max_rounds, d = bt.d;
  const double lam = cfg.mmr_lambda;
  const float* q0 = bt.Q0 + qi * d;
  const int64_t seg = bt.qseg[qi];
  const int64_t a = bt.offsets[seg];
  uint8_t* seen = w.seen.data();
  std::copy(q0, q0 + d, w.bq.data());
  w.bacc[0] = 0.0;
  std::fill(w.segs.begin(), w.segs.end(), seg);
  int64_t nlive = 1, res_len = 0, rounds = 0;

  for (int64_t level = 0; level < R; ++level) {
    const int64_t K = (B + level) * F;
    // ---- 1. candidates of every live branch: [nlive, K]
    if (level == 0 && bt.l0_s != nullptr) {
      std::copy(bt.l0_s + qi * bt.k0, bt.l0_s + qi * bt.k0 + K, w.c_sc.data());
      std::copy(bt.l0_r + qi * bt.k0, bt.l0_r + qi * bt.k0 + K, w.c_rows.data());
    } else {
      segmented_topk(bt.X, bt.n, d, bt.offsets, bt.U, w.bq.data(), w.segs.data(), nlive, K, w.c_sc.data(),
                     w.c_rows.data(), inner_threads, bt.xnorm);
    }
    // ---- 2. per branch: filter, MMR, KMeans, children
    int64_t n_children = 0;
    for (int64_t p = 0; p < nlive; ++p) {
      const float* cs = w.c_sc.data() + p * K;
      const int64_t* cr = w.c_rows.data() + p * K;
      int64_t* rows = w.rows.data() + p * K;
      double* mmr = w.mmr.data() + p * K;
      int64_t* lab = w.lab.data() + p * K;
      int64_t nv = 0;
      for (int64_t t = 0; t < K; ++t) {
        if (cr[t] >= 0 && cs[t] >= cfg.score_floor && !seen[cr[t] - a]) {
          rows[nv] = cr[t];
          mmr[nv] = static_cast<double>(cs[t]);
          ++nv;
        }
      }
      w.nvalid[p] = nv;
      w.kc[p] = 0;
      if (nv == 0) continue;
      float* V = w.V.data();
      for (int64_t j = 0; j < nv; ++j) std::copy(bt.X + rows[j] * d, bt.X + (rows[j] + 1) * d, V + j * d);
      if (lam < 1.0) {
        double* mx = w.mx.data();
        max_similarity_set(V, nv, d, mx);
        for (int64_t i = 0; i < nv; ++i) {
          const double m = std::isfinite(mx[i]) ? mx[i] : 0.0;
          mmr[i] = lam * mmr[i] - (1.0 - lam) * m;
        }
      }
      const int64_t kc = std::min(nv, B);
      w.kc[p] = kc;
      batched_kmeans(V, 1, nv, d, &nv, &kc, kc, cfg.kmeans_iters, cfg.kmeans_tol, cfg.draws + kc * cfg.n_draws,
                     cfg.n_draws, lab, w.cent.data(), 1);
      alpha_mix(w.bq.data() + p * d, w.cent.data(), q0, 1, kc, d, cfg.alpha, w.child_q.data() + p * B * d, 1);
      int64_t* csize = w.csize.data() + p * B;
      double* cgain = w.cgain.data() + p * B;
      std::fill(csize, csize + kc, int64_t{0});
      std::fill(cgain, cgain + kc, 0.0);
      for (int64_t j = 0; j < nv; ++j) {  // members' scores summed in candidate order
        ++csize[lab[j]];
        cgain[lab[j]] += mmr[j];
      }
      for (int64_t c = 0; c < kc; ++c)
        if (csize[c] > 0) w.children[n_children++] = Child{w.bacc[p] + cgain[c], p * B + c};
    }
    // ---- 3. the next beam: the B best children, stable on ties
    if (n_children == 0) break;
    std::stable_sort(w.children.begin(), w.children.begin() + n_children,
                     [](const Child& x, const Child& y) { return x.acc > y.acc; });
    const int64_t nsel = std::min(n_children, B);
    // ---- 4. hits of the new beam in (slot, candidate) order, first occurrences only
    for (int64_t j = 0; j < nsel; ++j) {
      const int64_t p = w.children[j].flat / B, c = w.children[j].flat % B;
      const int64_t* rows = w.rows.data() + p * K;
      const double* mmr = w.mmr.data() + p * K;
      const int64_t* lab = w.lab.data() + p * K;
      for (int64_t t = 0; t < w.nvalid[p]; ++t) {
        if (lab[t] != c || seen[rows[t] - a]) continue;
        seen[rows[t] - a] = 1;
        w.res_rows[res_len] = rows[t];
        w.res_sc[res_len] = mmr[t];
        ++res_len;
      }
      const float* cq = w.child_q.data() + (p * B + c) * d;
      std::copy(cq, cq + d, w.nbq.data() + j * d);
    }
    std::swap(w.bq, w.nbq);
    for (int64_t j = 0; j < nsel; ++j) w.bacc[j] = w.children[j].acc;
    nlive = nsel;
    ++rounds;
    if (res_len >= cfg.out_k) break;
  }

  int64_t* orow = bt.out_rows + qi * bt.width;
  float* osc = bt.out_scores + qi * bt.width;
  for (int64_t t = 0; t < bt.width; ++t) {
    orow[t] = t < res_len ? w.res_rows[t] : -1;
    osc[t] = t < res_len ? static_cast<float>(w.res_sc[t]) : -std::numeric_limits<float>::infinity();
  }
  bt.out_rounds[qi] = rounds;
  for (int64_t t = 0; t < res_len; ++t) seen[w.res_rows[t] - a] = 0;
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

size_t recollect_workspace_bytes(const RecollectConfig& cfg, int64_t d, int64_t max_len) {
  const size_t B = static_cast<size_t>(cfg.beam_width), dd = static_cast<size_t>(d);
  const size_t K = static_cast<size_t>((cfg.beam_width + cfg.max_rounds - 1) * cfg.fanout);
  const size_t cap = static_cast<size_t>(recollect_capacity(cfg));
  // float32 beam / children / candidate vectors, per-candidate scores and labels, and
  // what batched_kmeans allocates for one problem (float64 centres and point buffers)
  return (B * dd * 3 + B * B * dd + K * dd) * sizeof(float) + B * K * (4 + 8 + 8 + 8 + 8) + K * 8 +
         cap * 16 + B * B * 32 + static_cast<size_t>(max_len) + (2 * B * dd + 8 * K) * sizeof(double) + 4096;
}

void recollect(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U, const float* Q0,
               const int64_t* qseg, int64_t b, const float* level0_scores, const int64_t* level0_rows,
               int64_t k0, const RecollectConfig& cfg, int64_t width, int64_t* out_rows, float* out_scores,
               int64_t* out_rounds, int num_threads, double xnorm, int64_t memory_budget,
               const uint8_t* active) {
  if (b == 0) return;
  // the queries to recollect; the others get padding at once
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
  }
  const int64_t nq = static_cast<int64_t>(todo.size());
  if (nq == 0) return;
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
  int nthreads = threads_for(num_threads, work, nq);
  const double ws_bytes = static_cast<double>(recollect_workspace_bytes(cfg, d, max_len));
  const double by_budget = static_cast<double>(memory_budget) / ws_bytes;
  if (by_budget < static_cast<double>(nthreads)) nthreads = std::max(1, static_cast<int>(by_budget));
  // a single worker lets its top-k calls use the threads their own work pays for
  const int inner_threads = nthreads == 1 ? num_threads : 1;

  std::vector<Workspace> ws(static_cast<size_t>(nthreads));
  for (Workspace& w : ws) w.allocate(B, Kmax, d, cap, max_len);
  const Batch bt{X,     n,  d,     offsets, U,        Q0,         qseg,      level0_scores,
                 level0_rows, k0, xnorm, width,   out_rows, out_scores, out_rounds};
  std::exception_ptr error;
  std::mutex error_lock;
  parallel_for(nq, nthreads, [&](int64_t t, int tid) {
    try {
      recollect_one(bt, cfg, todo[static_cast<size_t>(t)], ws[static_cast<size_t>(tid)], inner_threads);
    } catch (...) {  // bad_alloc inside a primitive: reported after the join
      std::lock_guard<std::mutex> g(error_lock);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace rfmem
