// BM25 hits of a batch of queries (lexical.h). The scores equal rfmem_fast.lexical's
// numpy computation bit for bit: the same float64 products and sums in the same order.
#include "lexical.h"

#include <algorithm>
#include <functional>

namespace rfmem {

int64_t bm25_hits(const PostingsRef* users, int64_t n_users, const int64_t* quser, int64_t b,
               const int32_t* qterms, const double* qcnt, const int64_t* qptr, std::vector<int64_t>& hptr,
               std::vector<int32_t>& hrows, std::vector<double>& hval, double* mx, double* top, double* sum,
               double* sumsq) {
  hptr.assign(static_cast<size_t>(b) + 1, 0);
  int64_t max_rows = 0;
  for (int64_t u = 0; u < n_users; ++u) max_rows = std::max(max_rows, users[u].n_rows);
  std::vector<double> acc(static_cast<size_t>(max_rows), 0.0);
  std::vector<char> seen(static_cast<size_t>(max_rows), 0);
  std::vector<int32_t> touched;
  std::vector<double> best;
  for (int64_t i = 0; i < b; ++i) {
    double* tp = top + i * kTopLexical;
    std::fill(tp, tp + kTopLexical, 0.0);
    mx[i] = 0.0;
    sum[i] = 0.0;
    sumsq[i] = 0.0;
    hptr[i + 1] = hptr[i];
    if (quser[i] < 0) continue;
    const PostingsRef& P = users[quser[i]];
    touched.clear();
    for (int64_t j = qptr[i]; j < qptr[i + 1]; ++j) {  // query-term order, as postings_for
      const int32_t* it = std::lower_bound(P.terms, P.terms + P.T, qterms[j]);
      if (it == P.terms + P.T || *it != qterms[j]) continue;
      const int64_t t = it - P.terms;
      const double c = qcnt[j];
      const int64_t p0 = P.ptr[t], p1 = P.ptr[t + 1];
      if (p0 < 0 || p1 < p0 || p1 > P.ptr[P.T]) return quser[i];
      for (int64_t p = p0; p < p1; ++p) {
        const int32_t r = P.rows[p];
        if (r < 0 || r >= P.n_rows) return quser[i];
        if (!seen[r]) {
          seen[r] = 1;
          touched.push_back(r);
        }
        acc[r] += P.weight[p] * c;  // qtf * w(t, d) (w * 1.0 = w: as postings_for, which skips it then)
      }
    }
    if (static_cast<int64_t>(touched.size()) * 16 > P.n_rows) {  // many hits: read them off in row order
      touched.clear();
      for (int64_t r = 0; r < P.n_rows; ++r)
        if (seen[r]) touched.push_back(static_cast<int32_t>(r));
    } else {
      std::sort(touched.begin(), touched.end());
    }
    best.clear();
    double s = 0.0, s2 = 0.0, m = 0.0;
    for (const int32_t r : touched) {
      const double v = acc[r];
      acc[r] = 0.0;
      seen[r] = 0;
      if (!(v > 0.0)) continue;
      hrows.push_back(r);
      hval.push_back(v);
      s += v;
      const double sq = v * v;
      s2 += sq;
      m = std::max(m, v);
      best.push_back(v);
    }
    hptr[i + 1] = static_cast<int64_t>(hrows.size());
    mx[i] = m;
    sum[i] = s;
    sumsq[i] = s2;
    const size_t nt = std::min<size_t>(kTopLexical, best.size());
    std::partial_sort(best.begin(), best.begin() + nt, best.end(), std::greater<double>());
    std::copy(best.begin(), best.begin() + nt, tp);
  }
  return -1;
}

}  // namespace rfmem
