// L2-normalised rows of float32 vectors (kernels.h unit_rows): the arithmetic of
// rfmem_fast._validate's numpy expression, bit for bit, in one call.
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace rfmem {

namespace {

// numpy's pairwise summation of n float64 values (numpy/_core/src/umath/loops_utils.h.src
// pairwise_sum, what np.add.reduce runs over a contiguous axis): below 8 values a plain
// sum from 0; up to 128, eight running sums over the multiples of 8, combined
// ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest one by one; above 128,
// the two halves (the first of a multiple of 8 values) summed apart and added.
double pairwise_sum(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

}  // namespace

int64_t unit_rows(const float* X, int64_t n, int64_t d, double eps, float* out, int num_threads) {
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  parallel_for(n, threads_for(num_threads, static_cast<double>(n) * d, n), [&](int64_t r, int) {
    thread_local std::vector<double> sq;
    if (sq.size() < static_cast<size_t>(d)) sq.resize(static_cast<size_t>(d));
    const float* x = X + r * d;
    for (int64_t j = 0; j < d; ++j) {
      const double v = static_cast<double>(x[j]);
      sq[static_cast<size_t>(j)] = v * v;  // exact: a float32's square fits a float64
    }
    const double norm = std::sqrt(pairwise_sum(sq.data(), d));
    if (!(norm > eps && norm < std::numeric_limits<double>::infinity())) {  // NaN fails both
      int64_t cur = bad.load(std::memory_order_relaxed);
      while (r < cur && !bad.compare_exchange_weak(cur, r, std::memory_order_relaxed)) {
      }
      return;
    }
    float* o = out + r * d;
    for (int64_t j = 0; j < d; ++j) o[j] = static_cast<float>(static_cast<double>(x[j]) / norm);
  });
  const int64_t b = bad.load();
  return b == std::numeric_limits<int64_t>::max() ? -1 : b;
}

}  // namespace rfmem
