// BM25 hits of a batch of queries (lexical.h). The scores equal rfmem_fast.lexical's
// numpy computation bit for bit: the same float64 products and sums in the same order.
#include "lexical.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <numeric>

#include "common.h"

namespace rfmem {

namespace {

// Per-thread scratch of bm25_hits: the BM25 accumulator and touched-row bitmap of one
// segment (all zero between queries), the touched rows, the term spans.
struct Bm25Scratch {
  std::vector<double> acc;
  std::vector<uint64_t> bits;
  std::vector<int32_t> touched;
  struct Span {
    int64_t p0, p1;
    double c;
  };
  std::vector<Span> spans;
};

// One query's hits (bm25_hits) appended to out; false: the postings it reads are malformed.
bool query_hits(const PostingsRef& P, const int32_t* qt, const double* qc, int64_t nt, Bm25Scratch& s, HitsPart& out,
                int64_t& count, double& mx, double* tp, double& sum, double& sumsq) {
  s.spans.clear();
  int64_t reads = 0;
  for (int64_t j = 0; j < nt; ++j) {  // query-term order, as postings_for
    const int32_t* it = lower_bound_i32(P.terms, P.T, qt[j]);
    if (it == P.terms + P.T || *it != qt[j]) continue;
    const int64_t t = it - P.terms;
    const int64_t p0 = P.ptr[t], p1 = P.ptr[t + 1];
    if (p0 < 0 || p1 < p0 || p1 > P.ptr[P.T]) return false;
    s.spans.push_back(Bm25Scratch::Span{p0, p1, qc[j]});
    reads += p1 - p0;
  }
  for (const Bm25Scratch::Span& sp : s.spans) {  // every term's first postings on their way from memory
    __builtin_prefetch(P.rows + sp.p0);
    __builtin_prefetch(P.weight + sp.p0);
    __builtin_prefetch(P.weight + sp.p0 + 8);
  }
  // the hits read off in row order: from the bitmap when its words are few next to the
  // postings read, else by sorting the touched rows
  const int64_t words = (P.n_rows + 63) >> 6;
  const bool by_bitmap = words <= 4 * reads;
  double* acc = s.acc.data();
  uint64_t* bits = s.bits.data();
  s.touched.clear();
  const uint32_t n_rows = static_cast<uint32_t>(P.n_rows);
  for (const Bm25Scratch::Span& sp : s.spans) {
    const double c = sp.c;
    for (int64_t p = sp.p0; p < sp.p1; ++p) {
      const int32_t r = P.rows[p];
      if (static_cast<uint32_t>(r) >= n_rows) {  // (clears what this query set before leaving)
        for (int64_t w = 0; w < words; ++w) bits[w] = 0;
        std::fill(acc, acc + P.n_rows, 0.0);
        return false;
      }
      uint64_t& w = bits[r >> 6];
      const uint64_t bit = uint64_t{1} << (r & 63);
      if (!by_bitmap && !(w & bit)) s.touched.push_back(r);  // (the bitmap read-off needs no list: no branch)
      w |= bit;
      acc[r] += P.weight[p] * c;  // qtf * w(t, d) (w * 1.0 = w: as postings_for, which skips it then)
    }
  }
  double sm = 0.0, s2 = 0.0, m = 0.0;
  std::fill(tp, tp + kTopLexical, 0.0);  // the largest first (hits are > 0: 0 is padding)
  auto emit = [&](int32_t r) {
    const double v = acc[r];
    acc[r] = 0.0;
    if (!(v > 0.0)) return;
    out.rows.push_back(r);
    out.val.push_back(v);
    sm += v;
    const double sq = v * v;
    s2 += sq;
    m = std::max(m, v);
    if (v > tp[kTopLexical - 1]) {  // into the top list (rarely, once it holds large values)
      int j = kTopLexical - 1;
      for (; j > 0 && tp[j - 1] < v; --j) tp[j] = tp[j - 1];
      tp[j] = v;
    }
  };
  const size_t before = out.rows.size();
  if (by_bitmap) {
    for (int64_t w = 0; w < words; ++w) {
      uint64_t x = bits[w];
      if (!x) continue;
      bits[w] = 0;
      while (x) {
        emit(static_cast<int32_t>((w << 6) | __builtin_ctzll(x)));
        x &= x - 1;
      }
    }
  } else {
    std::sort(s.touched.begin(), s.touched.end());
    for (const int32_t r : s.touched) {
      bits[r >> 6] = 0;
      emit(r);
    }
  }
  count = static_cast<int64_t>(out.rows.size() - before);
  mx = m;
  sum = sm;
  sumsq = s2;
  return true;
}

// bm25_hits' scratch kept between calls (a call that finds it held allocates its own)
std::mutex g_bm25_scratch_mu;
std::vector<Bm25Scratch> g_bm25_scratch;

}  // namespace

int64_t bm25_hits(const PostingsRef* users, int64_t n_users, const int64_t* quser, int64_t b,
                  const int32_t* qterms, const double* qcnt, const int64_t* qptr, int num_threads,
                  std::vector<int64_t>& hptr, std::vector<int64_t>& order, std::vector<HitsPart>& parts, double* mx,
                  double* top, double* sum, double* sumsq) {
  hptr.assign(static_cast<size_t>(b) + 1, 0);
  order.resize(static_cast<size_t>(b));  // the queries by user (a user's terms and postings read while cached)
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [quser](int64_t x, int64_t y) { return quser[x] < quser[y]; });
  const int64_t nparts = (b + kBm25Part - 1) / kBm25Part;
  parts.assign(static_cast<size_t>(nparts), HitsPart{});
  int64_t max_rows = 0;
  for (int64_t u = 0; u < n_users; ++u) max_rows = std::max(max_rows, users[u].n_rows);
  // about 1/4 of kMinWorkPerThread per query (a few hundred postings and the read-off):
  // one query runs on the caller, a batch on every thread
  const int nthreads = threads_for(num_threads, 0.25 * kMinWorkPerThread * static_cast<double>(b), nparts);
  // the scratch, allocated before the threads (nothing throws in them): the process's kept
  // one when no other call holds it (its accumulators are all zero between queries, so a
  // call reuses them as they are), else this call's own
  std::unique_lock<std::mutex> held(g_bm25_scratch_mu, std::try_to_lock);
  std::vector<Bm25Scratch> own;
  std::vector<Bm25Scratch>& scratch = held.owns_lock() ? g_bm25_scratch : own;
  if (scratch.size() < static_cast<size_t>(nthreads)) scratch.resize(static_cast<size_t>(nthreads));
  for (Bm25Scratch& s : scratch) {
    if (s.acc.size() < static_cast<size_t>(max_rows)) s.acc.assign(static_cast<size_t>(max_rows), 0.0);
    const size_t words = static_cast<size_t>((max_rows + 63) >> 6);
    if (s.bits.size() < words) s.bits.assign(words, 0);
    s.touched.reserve(1024);
  }
  for (int64_t pi = 0; pi < nparts; ++pi) {  // room for a part's usual hits (fewer regrowths)
    const size_t room = static_cast<size_t>(std::min(kBm25Part, b - pi * kBm25Part)) * 512;
    parts[static_cast<size_t>(pi)].rows.reserve(room);
    parts[static_cast<size_t>(pi)].val.reserve(room);
  }
  std::atomic<int64_t> bad{-1};
  parallel_for(nparts, nthreads, [&](int64_t pi, int tid) {
    Bm25Scratch& s = scratch[static_cast<size_t>(tid)];
    HitsPart& out = parts[static_cast<size_t>(pi)];
    for (int64_t j = pi * kBm25Part; j < std::min(b, (pi + 1) * kBm25Part); ++j) {
      const int64_t i = order[static_cast<size_t>(j)];
      double* tp = top + i * kTopLexical;
      std::fill(tp, tp + kTopLexical, 0.0);
      mx[i] = sum[i] = sumsq[i] = 0.0;  // (query_hits sets them for a query with postings)
      if (quser[i] < 0) continue;
      if (!query_hits(users[quser[i]], qterms + qptr[i], qcnt + qptr[i], qptr[i + 1] - qptr[i], s, out,
                      hptr[static_cast<size_t>(i) + 1], mx[i], tp, sum[i], sumsq[i])) {
        int64_t none = -1;
        bad.compare_exchange_strong(none, quser[i]);
      }
    }
  });
  for (int64_t i = 0; i < b; ++i) hptr[static_cast<size_t>(i) + 1] += hptr[static_cast<size_t>(i)];
  return bad.load();
}

void bm25_gather(const std::vector<HitsPart>& parts, const std::vector<int64_t>& order,
                 const std::vector<int64_t>& hptr, int num_threads, int32_t* rows, double* val) {
  const int64_t np = static_cast<int64_t>(parts.size());
  const int64_t b = static_cast<int64_t>(order.size());
  // a copy of 12 bytes a hit (~1 ns), about what 16 multiply-adds of a scan cost
  const int nthreads = threads_for(num_threads, 16.0 * static_cast<double>(hptr.back()), np);
  parallel_for(np, nthreads, [&](int64_t pi, int) {
    const HitsPart& part = parts[static_cast<size_t>(pi)];
    size_t at = 0;  // the part's queries' hits one after the other
    for (int64_t j = pi * kBm25Part; j < std::min(b, (pi + 1) * kBm25Part); ++j) {
      const size_t i = static_cast<size_t>(order[static_cast<size_t>(j)]);
      const size_t n = static_cast<size_t>(hptr[i + 1] - hptr[i]);
      std::copy(part.rows.begin() + at, part.rows.begin() + at + n, rows + hptr[i]);
      std::copy(part.val.begin() + at, part.val.begin() + at + n, val + hptr[i]);
      at += n;
    }
  });
}

}  // namespace rfmem
