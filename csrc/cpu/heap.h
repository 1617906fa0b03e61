// Candidate lists of the segmented top-k: (score, row) entries and the bounded min-heap
// each query keeps while a kernel scans its segment (topk.cpp; the SIMD kernels of
// simd_impl.inc push into it too).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace rfmem {

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
// ``mask`` (filtered search, kernels.h SelTable): when set, a row r with
// mask[r - mask_base] == 0 is never kept, so the heap holds only selected rows and its
// threshold rises only with them (a scan pushes only scores above the threshold, so
// the check costs nothing on the common path).
struct Heap {
  Entry* h = nullptr;
  int64_t k = 0;
  int64_t size = 0;
  const uint8_t* mask = nullptr;
  int64_t mask_base = 0;

  float threshold() const { return size < k ? kNegInf : h[0].s; }

  // Rows arrive in increasing order, so a newcomer never wins a tie with a kept row.
  void push(float s, int64_t r) {
    if (!(s == s)) return;  // NaN is never kept
    if (mask != nullptr && !mask[r - mask_base]) return;  // not selected
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

// ``better`` as a function object (inlined into std algorithms, where a function pointer is not)
struct Better {
  bool operator()(const Entry& a, const Entry& b) const { return better(a, b); }
};

// The k best entries seen, collected for a kernel that pushes many (the int8 GEMM path,
// whose heaps keep k + up to 128 rows: every replacement in a Heap sifts through ~log2 k
// levels, mostly outside L1). An entry above the threshold is appended to buf; when buf
// holds cap entries (cap > k) the k best (``better``) are kept and the threshold becomes
// the score of the worst of them (-inf until then). It keeps a superset of what a Heap
// of capacity k would keep at every moment (its threshold is never above the Heap's),
// and the same ``mask`` rule; to_heap leaves in a Heap exactly the Heap's set: the k
// best by (score desc, row asc) of the entries pushed (rows arrive in increasing order,
// so a newcomer tying the worst kept score ranks below it: pushed only when above).
struct Reservoir {
  Entry* buf = nullptr;
  int64_t k = 0;
  int64_t cap = 0;
  int64_t n = 0;
  float thr = kNegInf;
  const uint8_t* mask = nullptr;
  int64_t mask_base = 0;

  float threshold() const { return thr; }

  // A reservoir over hp's storage, which must hold 2 hp.k entries (cap = 2 k), holding hp's
  // entries (a scan continued over further rows keeps what the earlier rows gave; a full
  // heap's worst entry is the threshold), with hp's selection mask; to_heap(hp) ends it.
  static Reservoir over(const Heap& hp) {
    return Reservoir{hp.h, hp.k, 2 * hp.k, hp.size, hp.threshold(), hp.mask, hp.mask_base};
  }

  void push(float s, int64_t r) {
    if (!(s == s)) return;  // NaN is never kept
    if (mask != nullptr && !mask[r - mask_base]) return;  // not selected
    buf[n++] = Entry{s, r};
    if (n == cap) shrink();
  }

  // the k best first, n = k, the threshold raised to the worst of them
  void shrink() {
    std::nth_element(buf, buf + (k - 1), buf + n, Better());
    n = k;
    thr = buf[k - 1].s;
  }

  // The k best entries as hp's heap, in hp's storage (which must be buf).
  void to_heap(Heap& hp) {
    if (n > k) {
      std::nth_element(buf, buf + (k - 1), buf + n, Better());
      n = k;
    }
    std::make_heap(buf, buf + n, Better());  // root: the worst, each parent worse than or tied with its children
    hp.h = buf;
    hp.k = k;
    hp.size = n;
  }
};

}  // namespace rfmem
