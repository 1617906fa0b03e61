// The context score's exact top-k (context.h; rfmem_fast/context.py has the definition,
// the layout and the exactness argument). Per query, on one thread: the approximate base
// scores b~ = f + x of the segment's rows laid out, c~ of every item (its 2r neighbours
// read directly, the thread maximum once per block) and the k-th largest c~ (a min-heap
// of k); the candidates within 2 Bc of it; the exact scores of the candidates, of their
// neighbours within 2 Bb of the neighbour maximum and of their threads' items within 2 Bb
// of the thread maximum; then the exact c of the candidates in float64 (b + w_n M + w_s T,
// in that order; compiled with -ffp-contract=off) and their top-k by (c desc, row asc).
#include "context.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "exact.h"

namespace rfmem {

namespace {

struct Hit {
  double c, b;
  int32_t row;
  float dense;
};

struct Scratch {
  std::vector<double> A, c, Tt, heap;
  std::vector<float> dense;
  std::vector<int64_t> cand, need;
  std::vector<Hit> hits;
};

inline double down(double x) { return std::nextafter(x, -std::numeric_limits<double>::infinity()); }

// the largest b~ among the neighbours of thread position p (r on each side; sentinels -inf)
inline double nbr_max(const double* A, int64_t p, int64_t r) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t o = 1; o <= r; ++o) m = std::max(m, std::max(A[p - o], A[p + o]));
  return m;
}

// the thread block holding position p (ts ascending, p in the thread part)
inline int64_t block_of(const int32_t* ts, int64_t nt, int64_t p) {
  return static_cast<int64_t>(std::upper_bound(ts, ts + nt, static_cast<int32_t>(p)) - ts) - 1;
}

void one_query(const float* X, int64_t d, const int64_t* offsets, const float* q, int64_t seg, const float* fq,
               const double* xq, const int32_t* ly, int64_t L, const int32_t* ts, int64_t nt, int64_t fs, int64_t r,
               double w_n, double w_s, int64_t k, double scale, double abs_term, double xnorm, double g64, Scratch& s,
               int64_t* orow, double* oc, double* ob, float* od) {
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < k; ++j) {
    orow[j] = -1;
    oc[j] = std::numeric_limits<double>::quiet_NaN();
    ob[j] = -inf;
    od[j] = std::numeric_limits<float>::quiet_NaN();
  }
  const int64_t a = offsets[seg], n = offsets[seg + 1] - a;
  if (n == 0 || L <= 2 * r) return;
  double qq = 0.0;
  for (int64_t j = 0; j < d; ++j) qq += static_cast<double>(q[j]) * static_cast<double>(q[j]);
  const double qn = std::sqrt(qq);
  const double B = scale * (qn * (1.0 + 9.313225746154785e-10)) + abs_term;
  // b~ = f + x of every laid-out item (every row: no chunk rows here), -inf at the sentinels
  if (s.A.size() < static_cast<size_t>(L)) s.A.resize(static_cast<size_t>(L));
  double* A = s.A.data();
  double xmax = 0.0;
  if (xq) {
    for (int64_t p = 0; p < L; ++p) {
      const int32_t row = ly[p];
      if (row < 0) {
        A[p] = -inf;
      } else {
        A[p] = static_cast<double>(fq[row]) + xq[row];
        xmax = std::max(xmax, xq[row]);
      }
    }
  } else {
    for (int64_t p = 0; p < L; ++p) A[p] = ly[p] < 0 ? -inf : static_cast<double>(fq[ly[p]]);
  }
  const double M = xnorm * qn * (1.0 + 1e-6) + B + xmax;
  const double Bb = (B + 2.0 * kU64 * M) * (1.0 + 1e-9);
  const double Bc = (1.0 + w_n + w_s) * (Bb + 8.0 * kU64 * (M + Bb)) * (1.0 + 1e-9);
  const bool nb = w_n > 0.0;
  // one pass: c~ of every item (the thread maximum first, per block), the k largest (a
  // min-heap) and the positions that may still reach the cut (the heap's least minus 2 Bc
  // only grows: a position below it now stays below the final cut)
  if (s.c.size() < static_cast<size_t>(L)) s.c.resize(static_cast<size_t>(L));
  double* C = s.c.data();
  s.Tt.resize(static_cast<size_t>(nt));
  s.heap.clear();
  s.cand.clear();
  double bar = -inf;  // the heap's least - 2 Bc once it holds k entries
  auto offer = [&](int64_t p, double cv) {
    C[p] = cv;
    if (static_cast<int64_t>(s.heap.size()) < k) {
      s.heap.push_back(cv);
      std::push_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
      if (static_cast<int64_t>(s.heap.size()) == k) bar = down(s.heap.front() - 2.0 * Bc);
    } else if (cv > s.heap.front()) {
      std::pop_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
      s.heap.back() = cv;
      std::push_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
      bar = down(s.heap.front() - 2.0 * Bc);
    }
    if (cv >= bar) s.cand.push_back(p);
  };
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
    double T = -inf;
    for (int64_t p = ts[t]; p < e; ++p) T = std::max(T, A[p]);
    s.Tt[t] = T;
    for (int64_t p = ts[t]; p < e; ++p) {
      if (ly[p] < 0) continue;
      double cv = A[p];
      if (nb) cv += w_n * nbr_max(A, p, r);
      if (w_s > 0.0) cv += w_s * T;
      offer(p, cv);
    }
  }
  for (int64_t p = fs; p < L - r; ++p) {  // free items: no neighbour, their own score as T
    double cv = A[p];
    if (w_s > 0.0) cv += w_s * A[p];
    offer(p, cv);
  }
  if (s.heap.empty()) return;
  const double cut = down(s.heap.front() - 2.0 * Bc);
  // the candidates and the positions whose exact scores their exact c needs
  size_t m = 0;
  for (int64_t p : s.cand)
    if (C[p] >= cut) s.cand[m++] = p;
  s.cand.resize(m);
  s.need.clear();
  for (int64_t p : s.cand) {
    s.need.push_back(p);
    if (p >= fs) continue;
    if (nb) {  // the neighbours near the neighbour maximum
      const double thr = down(nbr_max(A, p, r) - 2.0 * Bb);
      for (int64_t o = -r; o <= r; ++o)
        if (o != 0 && ly[p + o] >= 0 && A[p + o] >= thr) s.need.push_back(p + o);
    }
    if (w_s > 0.0) {  // the thread's items near its maximum
      const int64_t t = block_of(ts, nt, p);
      const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
      const double thr = down(s.Tt[t] - 2.0 * Bb);
      for (int64_t p2 = ts[t]; p2 < e; ++p2)
        if (ly[p2] >= 0 && A[p2] >= thr) s.need.push_back(p2);
    }
  }
  std::sort(s.need.begin(), s.need.end());
  s.need.erase(std::unique(s.need.begin(), s.need.end()), s.need.end());
  // exact base scores at those positions, written into A (every later read of A is of
  // the candidates' windows and threads, where exact and approximate values mix as the
  // exactness argument allows)
  if (s.dense.size() < static_cast<size_t>(L)) s.dense.resize(static_cast<size_t>(L));
  for (int64_t p : s.need) {
    const int32_t row = ly[p];
    const float e = exact_score(q, X + (a + row) * d, d, g64);
    s.dense[p] = e;
    A[p] = static_cast<double>(e) + (xq ? xq[row] : 0.0);
  }
  // the candidates' exact c: b + w_n M + w_s T in float64, in that order
  s.hits.clear();
  for (int64_t p : s.cand) {
    const double bx = A[p];
    double Mx = 0.0, T = bx;
    if (p < fs) {
      if (nb) {
        Mx = nbr_max(A, p, r);
        if (Mx == -inf) Mx = 0.0;
      }
      const int64_t t = block_of(ts, nt, p);
      const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
      T = -inf;
      for (int64_t p2 = ts[t]; p2 < e; ++p2) T = std::max(T, A[p2]);
    }
    const double cx = bx + w_n * Mx + w_s * T;
    s.hits.push_back(Hit{cx, bx, ly[p], s.dense[p]});
  }
  const int64_t kh = std::min<int64_t>(k, static_cast<int64_t>(s.hits.size()));
  std::partial_sort(s.hits.begin(), s.hits.begin() + kh, s.hits.end(),
                    [](const Hit& x, const Hit& y) { return x.c > y.c || (x.c == y.c && x.row < y.row); });
  for (int64_t j = 0; j < kh; ++j) {
    orow[j] = a + s.hits[j].row;
    oc[j] = s.hits[j].c;
    ob[j] = s.hits[j].b;
    od[j] = s.hits[j].dense;
  }
}

}  // namespace

void context_topk(const float* X, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg, int64_t b,
                  const float* f, const int64_t* fptr, const double* boosts, const int64_t* quser,
                  const ContextLayouts& lo, int64_t r, double w_n, double w_s, int64_t k, double scale,
                  double abs_term, double xnorm, int num_threads, int64_t* out_rows, double* out_c, double* out_b,
                  float* out_dense) {
  if (b == 0) return;
  const double g64 = gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64) * kSlack;
  double work = 0.0;
  for (int64_t i = 0; i < b; ++i) work += 64.0 * static_cast<double>(fptr[i + 1] - fptr[i]);
  const int nthreads = threads_for(num_threads, work, b);
  static thread_local std::vector<Scratch> scratch_of_caller;  // grown, never shrunk: no allocation per call
  // the caller's vector, by reference: inside the lambda a thread_local name would be the
  // RUNNING thread's own (empty) vector on a pool helper
  std::vector<Scratch>& scratch = scratch_of_caller;
  if (scratch.size() < static_cast<size_t>(nthreads)) scratch.resize(static_cast<size_t>(nthreads));
  parallel_for(b, nthreads, [&](int64_t i, int tid) {
    const int64_t j = quser[i];
    if (j < 0) {  // left to the caller
      for (int64_t c = 0; c < k; ++c) {
        out_rows[i * k + c] = -1;
        out_c[i * k + c] = std::numeric_limits<double>::quiet_NaN();
        out_b[i * k + c] = -std::numeric_limits<double>::infinity();
        out_dense[i * k + c] = std::numeric_limits<float>::quiet_NaN();
      }
      return;
    }
    const int64_t l0 = lo.lay_ptr[j], t0 = lo.t_ptr[j];
    one_query(X, d, offsets, Q + i * d, qseg[i], f + fptr[i], boosts ? boosts + fptr[i] : nullptr, lo.lay + l0,
              lo.lay_ptr[j + 1] - l0, lo.tstart + t0, lo.t_ptr[j + 1] - t0, lo.fstart[j], r, w_n, w_s, k, scale,
              abs_term, xnorm, g64, scratch[static_cast<size_t>(tid)], out_rows + i * k, out_c + i * k, out_b + i * k,
              out_dense + i * k);
  });
}

}  // namespace rfmem
