// Segmented top-k (one pass over each query's own segment) and the familiarity signals.
//
// Layout of the work:
//   1. queries are stably sorted by segment and cut into groups of at most kGroup
//      queries of one segment;
//   2. each group scans its segment once, in tiles of rows small enough to stay in
//      L1/L2 while every query of the group scores them (4 rows per kernel call,
//      inner loop over d on 16 float lanes), so a tile loaded once serves the whole
//      group and no [b, n] score matrix is ever written;
//   3. each query keeps a bounded min-heap of its k + kScanMargin best float32
//      scores (worst at the root); a score touches the heap only when it beats the
//      current worst kept one;
//   4. when there are fewer groups than threads (b = 1, or one user), each group's
//      rows are also split into parts whose partial lists are merged exactly;
//   5. exact re-scoring (rfmem_fast/backends/exact.py has the derivation): the float32
//      scan score f of any row is within B = c ||q|| R + (d + 2) 2^-149 of its exact
//      score e = RN32(q.x), with c = (1 + gamma_n(2^-24)) - 1 + 2^-24 for this kernel's
//      depth n = ceil(d / 16) + 4 (each of the 16 lanes adds its ceil(d / 16) products
//      in order, then a 4-level tree; one rounding per multiplication and per addition,
//      no FMA contraction) and R the largest row norm. With t the k-th best scan score,
//      every row of the exact top-k has f >= t - 2B: those candidates are re-scored
//      exactly (exact_score) and the top k of (e desc, row asc) is the answer. When the
//      heap was full and its worst kept score is still >= t - 2B, rows may have been
//      dropped: the query's segment is rescanned and every row with f >= t - 2B is
//      re-scored into a running exact top-k (rescan_query).
//
// Ties: the final list is sorted by (exact score desc, row asc), i.e. the order of a
// stable sort by descending score. Determinism: the exact scores do not depend on the
// order of any computation, so a query's result does not depend on the rest of its
// batch, the thread count or the CPU, and a top-k is a prefix of every wider top-k.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "exact.h"

namespace rfmem {
namespace {

constexpr int kGroup = 16;                 // queries of one segment scored per tile
constexpr int64_t kTileBytes = 64 << 10;   // bytes of X per tile
constexpr int64_t kMinPartRows = 2048;     // smallest row range worth a thread of its own
// Extra float32 candidates kept beyond k (exact.py SCAN_MARGIN); the re-scored set is
// decided by the error bound, not by this.
constexpr int64_t kScanMargin = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Entry {
  float s;
  int64_t r;
};

// e[0:m] into out_s / out_r, padded to k with -inf / -1.
inline void write_padded(const Entry* e, int64_t m, int64_t k, float* out_s, int64_t* out_r) {
  for (int64_t j = 0; j < m; ++j) {
    out_s[j] = e[j].s;
    out_r[j] = e[j].r;
  }
  for (int64_t j = m; j < k; ++j) {
    out_s[j] = kNegInf;
    out_r[j] = -1;
  }
}

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

  // The kept entries into out_s / out_r (heap order: the root, the worst, first),
  // padded to k with -inf / -1.
  void drain(float* out_s, int64_t* out_r) {
    write_padded(h, size, k, out_s, out_r);
    size = 0;
  }
};

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

// What the exact re-scoring of one query needs.
struct ExactCtx {
  const float* X;
  int64_t d;
  int64_t k;
  double coef;  // scan_coef(ceil(d / 16) + 4)
  double xnorm;  // upper bound of the row norms
  double absb;  // abs_bound(d)
  double g64;  // gamma_d(2^-53) * (1 + 2^-30), for exact_score
};

// Write the k best of cand[0:m] (exact scores) by (score desc, row asc), padded.
void emit(Entry* cand, int64_t m, int64_t k, float* out_s, int64_t* out_r) {
  const int64_t kk = std::min(k, m);
  std::partial_sort(cand, cand + kk, cand + m, better);
  write_padded(cand, kk, k, out_s, out_r);
}

// The scan cut of query q: every row of its exact top-k has a scan score >= the cut.
// t = the k-th best scan score of the candidates (reorders cand), B = c ||q|| R + abs.
double scan_cut(const ExactCtx& c, const float* q, Entry* cand, int64_t nc) {
  if (nc < c.k) return -std::numeric_limits<double>::infinity();
  std::nth_element(cand, cand + (c.k - 1), cand + nc, [](const Entry& x, const Entry& y) { return x.s > y.s; });
  const double t = cand[c.k - 1].s;
  if (!(t > -std::numeric_limits<double>::infinity())) return -std::numeric_limits<double>::infinity();
  double qq = 0.0;
  for (int64_t j = 0; j < c.d; ++j) qq += static_cast<double>(q[j]) * static_cast<double>(q[j]);
  const double B = c.coef * std::sqrt(qq) * kSlack * c.xnorm + c.absb;
  return std::nextafter(t - 2.0 * B, -std::numeric_limits<double>::infinity());
}

// Re-score exactly the candidates whose scan score reaches the cut; emit the top k.
void rescore(const ExactCtx& c, const float* q, Entry* cand, int64_t nc, double cut, float* out_s,
             int64_t* out_r) {
  int64_t m = 0;
  for (int64_t j = 0; j < nc; ++j) {
    if (static_cast<double>(cand[j].s) < cut) continue;
    const float e = exact_score(q, c.X + cand[j].r * c.d, c.d, c.g64);
    if (e > kNegInf) cand[m++] = Entry{e, cand[j].r};  // NaN and -inf are dropped
  }
  emit(cand, m, c.k, out_s, out_r);
}

// Rescan rows [a, e) for one query: every row whose scan score reaches the cut is
// re-scored exactly into a running top-k (heap of capacity k at store).
RFMEM_MULTIVERSION
void rescan_query(const ExactCtx& c, const float* q, int64_t a, int64_t e, double cut, Entry* store,
                  float* out_s, int64_t* out_r) {
  Heap hp;
  hp.h = store;
  hp.k = c.k;
  hp.size = 0;
  const int64_t d = c.d;
  float sc[4];
  for (int64_t r = a; r < e; r += 4) {
    const int64_t cnt = std::min<int64_t>(4, e - r);
    const float* x0 = c.X + r * d;
    const float* x1 = cnt > 1 ? x0 + d : x0;
    const float* x2 = cnt > 2 ? x0 + 2 * d : x0;
    const float* x3 = cnt > 3 ? x0 + 3 * d : x0;
    dot4(q, x0, x1, x2, x3, d, sc);
    for (int64_t i = 0; i < cnt; ++i) {
      if (static_cast<double>(sc[i]) >= cut) {
        const float ex = exact_score(q, c.X + (r + i) * d, d, c.g64);
        if (ex > hp.threshold() || hp.size < hp.k) hp.push(ex, r + i);
      }
    }
  }
  emit(hp.h, hp.size, c.k, out_s, out_r);
}

struct Group {
  int64_t seg;    // segment of every query of the group
  int64_t first;  // position of its first query in the sorted order
  int nq;         // number of queries
};

}  // namespace

void segmented_topk(const float* X, int64_t n, int64_t d, const int64_t* offsets, int64_t U,
                    const float* Q, const int64_t* qseg, int64_t b, int64_t k, float* out_scores,
                    int64_t* out_rows, int num_threads, double xnorm) {
  (void)U;
  if (b == 0 || k == 0) return;
  if (!(xnorm >= 0.0)) xnorm = row_norm_bound(X, n, d);
  const ExactCtx ctx{X, d, k, scan_coef((d + 15) / 16 + 4), xnorm, abs_bound(d),
                     gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64) * kSlack};

  // 1. queries sorted by segment (stable), cut into groups of one segment
  std::vector<int64_t> order(b);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [qseg](int64_t a, int64_t c) { return qseg[a] < qseg[c]; });
  std::vector<Group> groups;
  double work = 0.0;  // multiply-adds of the scan
  for (int64_t i = 0; i < b;) {
    int64_t j = i;
    while (j < b && qseg[order[j]] == qseg[order[i]] && j - i < kGroup) ++j;
    groups.push_back(Group{qseg[order[i]], i, static_cast<int>(j - i)});
    work += static_cast<double>(j - i) * static_cast<double>(offsets[qseg[order[i]] + 1] - offsets[qseg[order[i]]]) *
            static_cast<double>(d);
    i = j;
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  // schedule the longest segments first (the work counter then balances the tail)
  std::vector<int64_t> gorder(ng);
  std::iota(gorder.begin(), gorder.end(), int64_t{0});
  std::stable_sort(gorder.begin(), gorder.end(), [&](int64_t x, int64_t y) {
    return offsets[groups[x].seg + 1] - offsets[groups[x].seg] > offsets[groups[y].seg + 1] - offsets[groups[y].seg];
  });

  // 2. threads the work pays for; row parts per group when there are too few groups
  int nthreads = threads_for(num_threads, work, std::numeric_limits<int64_t>::max());
  int64_t max_len = 0;
  for (const Group& g : groups) max_len = std::max(max_len, offsets[g.seg + 1] - offsets[g.seg]);
  int64_t parts = 1;
  if (nthreads > 1 && ng < 2 * nthreads) {
    parts = (2 * nthreads + ng - 1) / ng;
    parts = std::max<int64_t>(1, std::min(parts, max_len / kMinPartRows));
  }
  const int64_t tile_rows = std::max<int64_t>(4, (kTileBytes / (d * 4)) / 4 * 4);

  const int64_t items = ng * parts;
  nthreads = static_cast<int>(std::min<int64_t>(nthreads, items));
  const int64_t kw = k + kScanMargin;  // float32 candidates kept per query
  // per-thread scratch, allocated before the threads start: kGroup heaps of capacity kw
  // and one exact heap of capacity k (rescans)
  const size_t per_thread = static_cast<size_t>(kGroup * kw + k);
  std::vector<Entry> heap_store(static_cast<size_t>(nthreads) * per_thread);
  // partial lists [ng, parts, kGroup, kw] when the rows are split
  std::vector<float> part_s;
  std::vector<int64_t> part_r;
  if (parts > 1) {
    part_s.resize(static_cast<size_t>(items) * kGroup * kw);
    part_r.resize(static_cast<size_t>(items) * kGroup * kw);
  }

  parallel_for(items, nthreads, [&](int64_t it, int tid) {
    const int64_t gi = gorder[it / parts];
    const Group& g = groups[gi];
    const int64_t p = it % parts;
    const int64_t a = offsets[g.seg], e = offsets[g.seg + 1];
    const int64_t len = e - a;
    // part p covers rows [a + len*p/parts, a + len*(p+1)/parts)
    const int64_t r0 = a + len * p / parts, r1 = a + len * (p + 1) / parts;
    Heap heaps[kGroup];
    const float* qs[kGroup];
    Entry* store = heap_store.data() + static_cast<size_t>(tid) * per_thread;
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
        Heap& hp = heaps[i];
        // rows were dropped only if the heap filled up; they all scored <= its root
        const bool filled = hp.size == kw && len > kw;
        const float worst = hp.size ? hp.h[0].s : kNegInf;
        const double cut = scan_cut(ctx, qs[i], hp.h, hp.size);
        if (filled && static_cast<double>(worst) >= cut)
          rescan_query(ctx, qs[i], a, e, cut, store + kGroup * kw, out_scores + qi * k, out_rows + qi * k);
        else
          rescore(ctx, qs[i], hp.h, hp.size, cut, out_scores + qi * k, out_rows + qi * k);
        hp.size = 0;
      } else {
        const size_t off = ((static_cast<size_t>(gi) * parts + p) * kGroup + i) * kw;
        heaps[i].drain(part_s.data() + off, part_r.data() + off);  // the root (worst) first
      }
    }
  });

  if (parts > 1) {  // merge of the partial lists (disjoint rows), then the exact re-scoring
    // candidate buffers per thread, allocated here so that nothing throws in the threads
    std::vector<std::vector<Entry>> cands(static_cast<size_t>(nthreads));
    for (auto& c : cands) c.reserve(static_cast<size_t>(parts * kw));
    parallel_for(ng, nthreads, [&](int64_t gi, int tid) {
      const Group& g = groups[gi];
      const int64_t a = offsets[g.seg], e = offsets[g.seg + 1];
      const int64_t len = e - a;
      std::vector<Entry>& cand = cands[static_cast<size_t>(tid)];
      for (int i = 0; i < g.nq; ++i) {
        cand.clear();
        for (int64_t p = 0; p < parts; ++p) {
          const size_t off = ((static_cast<size_t>(gi) * parts + p) * kGroup + i) * kw;
          for (int64_t j = 0; j < kw && part_r[off + j] >= 0; ++j)
            cand.push_back(Entry{part_s[off + j], part_r[off + j]});
        }
        const int64_t qi = order[g.first + i];
        const float* q = Q + qi * d;
        const double cut = scan_cut(ctx, q, cand.data(), static_cast<int64_t>(cand.size()));
        bool dropped = false;  // a part whose list filled up may have dropped rows >= cut
        for (int64_t p = 0; p < parts && !dropped; ++p) {
          const size_t off = ((static_cast<size_t>(gi) * parts + p) * kGroup + i) * kw;
          const int64_t prows = len * (p + 1) / parts - len * p / parts;
          dropped = part_r[off + kw - 1] >= 0 && prows > kw && static_cast<double>(part_s[off]) >= cut;
        }
        Entry* store = heap_store.data() + static_cast<size_t>(tid) * per_thread + kGroup * kw;
        if (dropped)
          rescan_query(ctx, q, a, e, cut, store, out_scores + qi * k, out_rows + qi * k);
        else
          rescore(ctx, q, cand.data(), static_cast<int64_t>(cand.size()), cut, out_scores + qi * k,
                  out_rows + qi * k);
      }
    });
  }
}

double row_norm_bound(const float* X, int64_t n, int64_t d) {
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += static_cast<double>(X[i * d + j]) * static_cast<double>(X[i * d + j]);
    m = std::max(m, s);
  }
  // float64 sum of exact squares: relative error <= gamma_d(2^-53)
  return std::sqrt(m * (1.0 + gamma_n(static_cast<double>(std::max<int64_t>(d, 1)), kU64))) * kSlack;
}

void probe_signals(const float* scores, int64_t b, int64_t k, int64_t probe_k, double temperature,
                   Entropy convention, double* mean, double* ent, int64_t* count, int num_threads) {
  const int64_t K = std::min(probe_k, k);
  // about 64 flops per probe score (exp, log): parallel only for very large batches
  const int nthreads = threads_for(num_threads, 64.0 * static_cast<double>(b) * static_cast<double>(K), b);
  parallel_for(b, nthreads, [&](int64_t i, int) {
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
      return;
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
  });
}

}  // namespace rfmem
