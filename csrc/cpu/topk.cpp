// Segmented top-k (one pass over each query's own segment) and the familiarity signals.
//
// Layout of the work:
//   1. queries are stably sorted by segment and cut into groups of at most kGroup
//      queries of one segment;
//   2. each group scans its segment once, in tiles of rows small enough to stay in
//      L1/L2 while every query of the group scores them (4 rows per kernel call,
//      inner loop over d on 16 float lanes), so a tile loaded once serves the whole
//      group and no [b, n] score matrix is ever written;
//   3. each query keeps a bounded min-heap of its k + kRescoreMargin best float32
//      scores (worst at the root); a score touches the heap only when it beats the
//      current worst kept one;
//   4. when there are fewer groups than threads (b = 1, or one user), each group's
//      rows are also split into parts whose partial lists are merged exactly;
//   5. the kept candidates are re-scored exactly: the float64 sum of the (exact)
//      float64 products, rounded to float32, as the torch backend does; the top k of
//      those by (score desc, row asc) is the answer.
//
// Ties: the final list is sorted by (exact score desc, row asc), i.e. the order of a
// stable sort by descending score. Determinism: the float32 scan runs the same IEEE
// operations for a (q, x) pair whatever the row's position in a tile, the group or
// the CPU clone (no FP contraction), and the re-scoring is one fixed float64 loop, so
// duplicate rows get bit-identical scores and a query's result does not depend on the
// rest of its batch, the thread count or the CPU.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace rfmem {
namespace {

constexpr int kGroup = 16;                 // queries of one segment scored per tile
constexpr int64_t kTileBytes = 64 << 10;   // bytes of X per tile
constexpr int64_t kMinPartRows = 2048;     // smallest row range worth a thread of its own
// Extra float32 candidates kept for the exact re-scoring (torch backend: RESCORE_MARGIN).
constexpr int64_t kRescoreMargin = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Entry {
  float s;
  int64_t r;
};

// a ranks strictly below b (lower score, or equal score and larger row)
inline bool worse(const Entry& a, const Entry& b) { return a.s < b.s || (a.s == b.s && a.r > b.r); }
// a ranks strictly above b: the output order
inline bool better(const Entry& a, const Entry& b) { return a.s > b.s || (a.s == b.s && a.r < b.r); }

// Bounded min-heap of the k best entries seen (root = the worst kept one).
struct Heap {
  Entry* h = nullptr;
  int64_t k = 0;
  int64_t size = 0;

  float threshold() const { return size < k ? kNegInf : h[0].s; }

  // Rows arrive in increasing order, so a newcomer never wins a tie with a kept row.
  void push(float s, int64_t r) {
    if (!(s == s)) return;  // NaN is never kept
    if (size < k) {
      int64_t i = size++;
      h[i] = Entry{s, r};
      while (i > 0) {  // sift up: parent must be worse than or equal to child
        int64_t p = (i - 1) >> 1;
        if (worse(h[i], h[p])) {
          std::swap(h[i], h[p]);
          i = p;
        } else {
          break;
        }
      }
    } else if (s > h[0].s) {
      h[0] = Entry{s, r};
      int64_t i = 0;
      for (;;) {  // sift down
        int64_t l = 2 * i + 1, rr = l + 1, w = i;
        if (l < size && worse(h[l], h[w])) w = l;
        if (rr < size && worse(h[rr], h[w])) w = rr;
        if (w == i) break;
        std::swap(h[i], h[w]);
        i = w;
      }
    }
  }

  // The kept entries into out_s / out_r (any order), padded to k with -inf / -1.
  void drain(float* out_s, int64_t* out_r) {
    for (int64_t j = 0; j < size; ++j) {
      out_s[j] = h[j].s;
      out_r[j] = h[j].r;
    }
    for (int64_t j = size; j < k; ++j) {
      out_s[j] = kNegInf;
      out_r[j] = -1;
    }
    size = 0;
  }
};

// Exact score of row x for query q: the float64 sum of the float64 products (exact
// for float32 inputs), in a fixed order (4 partial sums over j mod 4, then
// (s0 + s1) + (s2 + s3)), rounded to float32.
inline float exact_score(const float* q, const float* x, int64_t d) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t j = 0;
  for (; j + 4 <= d; j += 4) {
    s0 += static_cast<double>(q[j]) * static_cast<double>(x[j]);
    s1 += static_cast<double>(q[j + 1]) * static_cast<double>(x[j + 1]);
    s2 += static_cast<double>(q[j + 2]) * static_cast<double>(x[j + 2]);
    s3 += static_cast<double>(q[j + 3]) * static_cast<double>(x[j + 3]);
  }
  if (j < d) s0 += static_cast<double>(q[j]) * static_cast<double>(x[j]);
  if (j + 1 < d) s1 += static_cast<double>(q[j + 1]) * static_cast<double>(x[j + 1]);
  if (j + 2 < d) s2 += static_cast<double>(q[j + 2]) * static_cast<double>(x[j + 2]);
  return static_cast<float>((s0 + s1) + (s2 + s3));
}

// Re-score the candidates cand[0:nc] (rows) of query q exactly, sort them by
// (score desc, row asc) and write the first k into out_s / out_r (padded with
// -inf / -1). cand is reordered in place.
void finalize(const float* X, int64_t d, const float* q, Entry* cand, int64_t nc, int64_t k,
              float* out_s, int64_t* out_r) {
  int64_t m = 0;
  for (int64_t j = 0; j < nc; ++j) {
    const float e = exact_score(q, X + cand[j].r * d, d);
    if (e > kNegInf) cand[m++] = Entry{e, cand[j].r};  // NaN and -inf are dropped
  }
  const int64_t kk = std::min(k, m);
  std::partial_sort(cand, cand + kk, cand + m, better);
  for (int64_t j = 0; j < kk; ++j) {
    out_s[j] = cand[j].s;
    out_r[j] = cand[j].r;
  }
  for (int64_t j = kk; j < k; ++j) {
    out_s[j] = kNegInf;
    out_r[j] = -1;
  }
}

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
RFMEM_INLINE void dot4(const float* q, const float* x0, const float* x1, const float* x2,
                       const float* x3, int64_t d, float* out) {
  const v8 z = {0, 0, 0, 0, 0, 0, 0, 0};
  v8 a0l = z, a0h = z, a1l = z, a1h = z, a2l = z, a2h = z, a3l = z, a3h = z;
  int64_t j = 0;
  for (; j + 16 <= d; j += 16) {
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

struct Group {
  int64_t seg;    // segment of every query of the group
  int64_t first;  // position of its first query in the sorted order
  int nq;         // number of queries
};

}  // namespace

void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U,
                    const float* Q, const int64_t* qseg, int64_t b, int64_t k, float* out_scores,
                    int64_t* out_rows, int num_threads) {
  (void)n;
  (void)U;
  if (b == 0 || k == 0) return;
  const int nthreads = resolve_threads(num_threads);

  // 1. queries sorted by segment (stable), cut into groups of one segment
  std::vector<int64_t> order(b);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [qseg](int64_t a, int64_t c) { return qseg[a] < qseg[c]; });
  std::vector<Group> groups;
  for (int64_t i = 0; i < b;) {
    int64_t j = i;
    while (j < b && qseg[order[j]] == qseg[order[i]] && j - i < kGroup) ++j;
    groups.push_back(Group{qseg[order[i]], i, static_cast<int>(j - i)});
    i = j;
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  // schedule the longest segments first (dynamic scheduling then balances the tail)
  std::vector<int64_t> gorder(ng);
  std::iota(gorder.begin(), gorder.end(), int64_t{0});
  std::stable_sort(gorder.begin(), gorder.end(), [&](int64_t x, int64_t y) {
    return offsets[groups[x].seg + 1] - offsets[groups[x].seg] > offsets[groups[y].seg + 1] - offsets[groups[y].seg];
  });

  // 2. row parts per group when there are too few groups to feed the threads
  int64_t max_len = 0;
  for (const Group& g : groups) max_len = std::max(max_len, offsets[g.seg + 1] - offsets[g.seg]);
  int64_t parts = 1;
  if (nthreads > 1 && ng < 2 * nthreads) {
    parts = (2 * nthreads + ng - 1) / ng;
    parts = std::max<int64_t>(1, std::min(parts, max_len / kMinPartRows));
  }
  const int64_t tile_rows = std::max<int64_t>(4, (kTileBytes / (d * 4)) / 4 * 4);

  const int64_t items = ng * parts;
  const int64_t kw = k + kRescoreMargin;  // float32 candidates kept per query
  // per-thread heaps (kGroup heaps of capacity kw), allocated before the parallel region
  std::vector<Entry> heap_store(static_cast<size_t>(nthreads) * kGroup * kw);
  // partial lists [ng, parts, kGroup, kw] when the rows are split
  std::vector<float> part_s;
  std::vector<int64_t> part_r;
  if (parts > 1) {
    part_s.resize(static_cast<size_t>(items) * kGroup * kw);
    part_r.resize(static_cast<size_t>(items) * kGroup * kw);
  }

#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t gi = gorder[it / parts];
    const Group& g = groups[gi];
    const int64_t p = it % parts;
    const int64_t a = offsets[g.seg], e = offsets[g.seg + 1];
    const int64_t len = e - a;
    // part p covers rows [a + len*p/parts, a + len*(p+1)/parts)
    const int64_t r0 = a + len * p / parts, r1 = a + len * (p + 1) / parts;
    Heap heaps[kGroup];
    const float* qs[kGroup];
    Entry* store = heap_store.data() + static_cast<size_t>(thread_index()) * kGroup * kw;
    for (int i = 0; i < g.nq; ++i) {
      heaps[i].h = store + static_cast<size_t>(i) * kw;
      heaps[i].k = kw;
      heaps[i].size = 0;
      qs[i] = Q + order[g.first + i] * d;
    }
    if (r1 > r0) scan_rows(X, d, r0, r1, qs, g.nq, heaps, tile_rows);
    for (int i = 0; i < g.nq; ++i) {
      if (parts == 1) {
        const int64_t qi = order[g.first + i];
        finalize(X, d, qs[i], heaps[i].h, heaps[i].size, k, out_scores + qi * k, out_rows + qi * k);
        heaps[i].size = 0;
      } else {
        const size_t off = ((static_cast<size_t>(gi) * parts + p) * kGroup + i) * kw;
        heaps[i].drain(part_s.data() + off, part_r.data() + off);
      }
    }
  }

  if (parts > 1) {  // exact merge of the partial lists (disjoint rows)
    // candidate buffers per thread, allocated here so that nothing throws inside the region
    std::vector<std::vector<Entry>> cands(static_cast<size_t>(nthreads));
    for (auto& c : cands) c.reserve(static_cast<size_t>(parts * kw));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t gi = 0; gi < ng; ++gi) {
      const Group& g = groups[gi];
      std::vector<Entry>& cand = cands[static_cast<size_t>(thread_index())];
      for (int i = 0; i < g.nq; ++i) {
        cand.clear();
        for (int64_t p = 0; p < parts; ++p) {
          const size_t off = ((static_cast<size_t>(gi) * parts + p) * kGroup + i) * kw;
          for (int64_t j = 0; j < kw && part_r[off + j] >= 0; ++j)
            cand.push_back(Entry{part_s[off + j], part_r[off + j]});
        }
        // the kw best float32 candidates overall (as one pass would keep), then exact
        const int64_t kk = std::min<int64_t>(kw, static_cast<int64_t>(cand.size()));
        std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), better);
        const int64_t qi = order[g.first + i];
        finalize(X, d, Q + qi * d, cand.data(), kk, k, out_scores + qi * k, out_rows + qi * k);
      }
    }
  }
}

void probe_signals(const float* scores, int64_t b, int64_t k, int64_t probe_k, double temperature,
                   Entropy convention, double* mean, double* ent, int64_t* count, int num_threads) {
  const int nthreads = resolve_threads(num_threads);
  const int64_t K = std::min(probe_k, k);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && b > 256)
  for (int64_t i = 0; i < b; ++i) {
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
      continue;
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
  }
}

}  // namespace rfmem
