// Exact scores of the CPU kernels: e = RN32(q . x), the real inner product of two float32
// vectors rounded once to float32 (round to nearest, ties to even). The derivation of
// the bounds is in rfmem_fast/backends/exact.py (module docstring); this is its C++ twin
// for the native kernels. Compiled with -ffp-contract=off: the error-free sums below
// need every IEEE operation as written.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace rfmem {

constexpr double kU32 = 5.9604644775390625e-08;  // 2^-24
constexpr double kU64 = 1.1102230246251565e-16;  // 2^-53
constexpr double kSlack = 1.0 + 9.313225746154785e-10;  // 1 + 2^-30
constexpr double kTiny32 = 1.401298464324817e-45;  // 2^-149

/// Higham's gamma_n = n u / (1 - n u) (n u < 1 is the caller's to ensure).
inline double gamma_n(double n, double u) { return n * u / (1.0 - n * u); }

/// Relative coefficient c of |f - RN32(q.x)| <= c ||q|| ||x|| + abs_bound(d) for a float32
/// scan whose product terms see at most ``depth`` roundings (exact.py scan_error_coef);
/// ``u_in``: unit roundoff of the rounding of the rows in the scan copy (0: the scan reads
/// the float32 rows; 2^-11 float16, 2^-8 bfloat16): (1 + u_in) (1 + gamma) - 1, the query
/// being read in float32 (exact.py scan_error_coef(depth, U32, u_in, rounded_inputs=1)).
inline double scan_coef(int64_t depth, double u_in = 0.0) {
  const double g = gamma_n(static_cast<double>(depth < 1 ? 1 : depth), kU32);
  const double scan = u_in == 0.0 ? g : (1.0 + u_in) * (1.0 + g) - 1.0;
  return (scan + kU32) * kSlack;
}

/// Absolute part of the bound: (d + 2) 2^-149 (underflow of the products and roundings).
inline double abs_bound(int64_t d) { return static_cast<double>(d + 2) * kTiny32; }

namespace detail {

// A sum of doubles kept exactly as a non-overlapping expansion (Shewchuk's
// grow-expansion, the algorithm of Python's math.fsum); components grow in magnitude.
// Products of float32 span 2^-298 .. 2^256, i.e. at most ~11 components of 53 bits;
// kMax leaves room for any double.
struct Expansion {
  static constexpr int kMax = 64;
  double p[kMax];
  int n = 0;

  void add(double x) {
    int i = 0;
    for (int j = 0; j < n; ++j) {
      double y = p[j];
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0 && i < kMax - 1) p[i++] = lo;
      x = hi;
    }
    p[i++] = x;
    n = i;
  }

  // sign of (this sum - m), exactly: the largest non-zero component of the expansion
  // of (sum - m) carries it
  int compare(double m) const {
    Expansion e = *this;
    e.add(-m);
    for (int j = e.n - 1; j >= 0; --j)
      if (e.p[j] != 0.0) return e.p[j] > 0.0 ? 1 : -1;
    return 0;
  }

  double approx() const {
    double s = 0.0;
    for (int j = 0; j < n; ++j) s += p[j];
    return s;
  }
};

inline bool is_even(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits & 1u) == 0u;
}

}  // namespace detail

/// RN32(q . x) exactly (the slow path): the exact sum as an expansion, then the float32
/// whose rounding interval holds it, found by comparing with the midpoints exactly.
inline float round32_exact(const float* q, const float* x, int64_t d) {
  detail::Expansion e;
  for (int64_t j = 0; j < d; ++j) e.add(static_cast<double>(q[j]) * static_cast<double>(x[j]));
  float f = static_cast<float>(e.approx());
  const float inf = std::numeric_limits<float>::infinity();
  for (int guard = 0; guard < 64; ++guard) {
    const float up = std::nextafter(f, inf);
    int c = e.compare((static_cast<double>(f) + static_cast<double>(up)) * 0.5);
    if (c > 0 || (c == 0 && detail::is_even(up))) {
      f = up;
      continue;
    }
    const float dn = std::nextafter(f, -inf);
    c = e.compare((static_cast<double>(f) + static_cast<double>(dn)) * 0.5);
    if (c < 0 || (c == 0 && detail::is_even(dn))) {
      f = dn;
      continue;
    }
    break;
  }
  return f;
}

/// e = RN32(q . x): the float64 sum s of the (exact) float64 products and its error
/// bound gamma_d(2^-53) sum|p|, which holds for any order of the additions (the SIMD
/// level's simd.h exact_sums picks one); when both ends of that interval round to the
/// same float32, that is e; otherwise round32_exact. ``g64`` = gamma_d(2^-53) * (1 + 2^-30).
inline float exact_score(const float* q, const float* x, int64_t d, double g64) {
  double s = 0.0, a = 0.0;
  simd_kernels().exact_sums(q, x, d, &s, &a);
  const double err = g64 * a;
  const double inf = std::numeric_limits<double>::infinity();
  const float lo = static_cast<float>(std::nextafter(s - err, -inf));
  const float hi = static_cast<float>(std::nextafter(s + err, inf));
  if (lo == hi) return lo;
  return round32_exact(q, x, d);
}

}  // namespace rfmem
