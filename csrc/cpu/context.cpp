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

struct Scratch {
  std::vector<double> v, A, Ax, c;
  std::vector<float> dense;
  std::vector<int64_t> cand, need;
  std::vector<double> heap;
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
  if (s.v.size() < static_cast<size_t>(n)) s.v.resize(static_cast<size_t>(n));
  double xmax = 0.0;
  if (xq) {
    for (int64_t j = 0; j < n; ++j) {
      s.v[j] = static_cast<double>(fq[j]) + xq[j];
      xmax = std::max(xmax, xq[j]);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) s.v[j] = static_cast<double>(fq[j]);
  }
  const double M = xnorm * qn * (1.0 + 1e-6) + B + xmax;
  const double Bb = (B + 2.0 * kU64 * M) * (1.0 + 1e-9);
  const double Bc = (1.0 + w_n + w_s) * (Bb + 8.0 * kU64 * (M + Bb)) * (1.0 + 1e-9);
  if (s.A.size() < static_cast<size_t>(L)) s.A.resize(static_cast<size_t>(L));
  double* A = s.A.data();
  for (int64_t p = 0; p < L; ++p) A[p] = ly[p] < 0 ? -inf : s.v[ly[p]];
  const bool nb = w_n > 0.0;
  // approximate c of every item position, block by block (the thread maximum first), and
  // the k-th largest of them (a min-heap of k)
  s.heap.clear();
  auto offer = [&](double c) {
    if (static_cast<int64_t>(s.heap.size()) < k) {
      s.heap.push_back(c);
      std::push_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
    } else if (c > s.heap.front()) {
      std::pop_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
      s.heap.back() = c;
      std::push_heap(s.heap.begin(), s.heap.end(), std::greater<double>());
    }
  };
  if (s.c.size() < static_cast<size_t>(L)) s.c.resize(static_cast<size_t>(L));
  double* C = s.c.data();
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
    double T = -inf;
    for (int64_t p = ts[t]; p < e; ++p) T = std::max(T, A[p]);
    for (int64_t p = ts[t]; p < e; ++p) {
      if (ly[p] < 0) continue;
      double cv = s.v[ly[p]];
      if (nb) cv += w_n * nbr_max(A, p, r);
      if (w_s > 0.0) cv += w_s * T;
      C[p] = cv;
      offer(cv);
    }
  }
  for (int64_t p = fs; p < L - r; ++p) {  // free items: no neighbour, their own score as T
    double cv = s.v[ly[p]];
    if (w_s > 0.0) cv += w_s * A[p];
    C[p] = cv;
    offer(cv);
  }
  if (s.heap.empty()) return;
  const double cut = down(s.heap.front() - 2.0 * Bc);
  s.cand.clear();
  s.need.clear();
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
    double T = -inf;
    for (int64_t p = ts[t]; p < e; ++p) T = std::max(T, A[p]);
    bool any = false;
    for (int64_t p = ts[t]; p < e; ++p) {
      if (ly[p] < 0 || C[p] < cut) continue;
      any = true;
      s.cand.push_back(p);
      s.need.push_back(p);
      if (nb) {  // the neighbours near the neighbour maximum
        const double thr = down(nbr_max(A, p, r) - 2.0 * Bb);
        for (int64_t o = -r; o <= r; ++o)
          if (o != 0 && ly[p + o] >= 0 && A[p + o] >= thr) s.need.push_back(p + o);
      }
    }
    if (any && w_s > 0.0) {  // the thread's items near its maximum
      const double thr = down(T - 2.0 * Bb);
      for (int64_t p = ts[t]; p < e; ++p)
        if (ly[p] >= 0 && A[p] >= thr) s.need.push_back(p);
    }
  }
  for (int64_t p = fs; p < L - r; ++p) {
    if (C[p] >= cut) {
      s.cand.push_back(p);
      s.need.push_back(p);
    }
  }
  std::sort(s.need.begin(), s.need.end());
  s.need.erase(std::unique(s.need.begin(), s.need.end()), s.need.end());
  // exact base scores at those positions (the others keep their approximate ones)
  if (s.Ax.size() < static_cast<size_t>(L)) s.Ax.resize(static_cast<size_t>(L));
  if (s.dense.size() < static_cast<size_t>(L)) s.dense.resize(static_cast<size_t>(L));
  double* Ax = s.Ax.data();
  std::copy(A, A + L, Ax);
  for (int64_t p : s.need) {
    const int32_t row = ly[p];
    const float e = exact_score(q, X + (a + row) * d, d, g64);
    s.dense[p] = e;
    Ax[p] = static_cast<double>(e) + (xq ? xq[row] : 0.0);
  }
  // the candidates' exact c: b + w_n M + w_s T in float64, in that order
  struct Hit {
    double c, b;
    int32_t row;
    float dense;
  };
  std::vector<Hit> hits;
  hits.reserve(s.cand.size());
  for (int64_t p : s.cand) {
    const double bx = Ax[p];
    double Mx = 0.0, T = bx;
    if (p < fs) {
      if (nb) {
        Mx = nbr_max(Ax, p, r);
        if (Mx == -inf) Mx = 0.0;
      }
      const int64_t t = block_of(ts, nt, p);
      const int64_t e = t + 1 < nt ? ts[t + 1] : fs;
      T = -inf;
      for (int64_t p2 = ts[t]; p2 < e; ++p2) T = std::max(T, Ax[p2]);
    }
    const double cx = bx + w_n * Mx + w_s * T;
    hits.push_back(Hit{cx, bx, ly[p], s.dense[p]});
  }
  const int64_t kh = std::min<int64_t>(k, static_cast<int64_t>(hits.size()));
  std::partial_sort(hits.begin(), hits.begin() + kh, hits.end(),
                    [](const Hit& x, const Hit& y) { return x.c > y.c || (x.c == y.c && x.row < y.row); });
  for (int64_t j = 0; j < kh; ++j) {
    orow[j] = a + hits[j].row;
    oc[j] = hits[j].c;
    ob[j] = hits[j].b;
    od[j] = hits[j].dense;
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
  static thread_local std::vector<Scratch> scratch;  // grown, never shrunk: no allocation per call
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
