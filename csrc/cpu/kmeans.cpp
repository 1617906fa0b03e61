// Many small KMeans problems at once, and the alpha-mix of the child queries.
//
// batched_kmeans reproduces rfmem_fast/kmeans.py (``lloyd`` / ``kmeanspp_init``, the
// torch backend's KMeans), which itself replays scikit-learn's KMeans(n_init=1):
//   * greedy k-means++ seeding driven by a table of uniforms per problem (scikit-learn's
//     draws of RandomState(seed), made in Python): first centre =
//     searchsorted(cdf of the uniform weights, u_0, right); centre t: T = 2 + int(ln k)
//     candidates searchsorted(cumsum(D2), u * sum(D2), left) capped at count - 1, the
//     one whose addition gives the smallest potential wins (first on ties); squared
//     distances ||p||^2 + ||v||^2 - 2 <p, v> in float64, clamped at 0;
//   * Lloyd steps: assign (argmin, ties to the smaller cluster), centres = member
//     means (an empty cluster keeps its centre); stop when the labels repeat (strict
//     convergence) or the squared centre shift summed over clusters is
//     <= tol * mean over dimensions of the points' variance, or after ``iters`` steps;
//     without strict convergence the labels are recomputed from the final centres;
//   * returned centroids = member means under the returned labels (0 when empty).
// All arithmetic is float64 on the float32 points, with kmeans.py's formulas; results
// agree with it except where two choices tie in exact arithmetic and rounding (whose
// order differs between the two) decides.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace rfmem {

int64_t kmeanspp_trials(int64_t k) { return 2 + static_cast<int64_t>(std::log(static_cast<double>(k))); }

int64_t kmeanspp_draws(int64_t k) { return 1 + (k - 1) * kmeanspp_trials(k); }

namespace {

inline double dot64(const float* a, const float* b, int64_t d) {
  double s = 0.0;
  for (int64_t j = 0; j < d; ++j) s += static_cast<double>(a[j]) * static_cast<double>(b[j]);
  return s;
}

// ||c||^2 of each of the kc centres
inline void centre_norms(const double* C, int64_t kc, int64_t d, double* cc) {
  for (int64_t c = 0; c < kc; ++c) {
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += C[c * d + j] * C[c * d + j];
    cc[c] = s;
  }
}

// argmin over the kc centres of ||c||^2 - 2 <v, c> (the squared distance less the
// constant ||v||^2, as kmeans.py computes it), ties to the smaller index
inline int64_t nearest(const float* v, const double* C, const double* cc, int64_t kc, int64_t d) {
  int64_t best = 0;
  double bd = std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < kc; ++c) {
    const double* cv = C + c * d;
    double dot = 0.0;
    for (int64_t j = 0; j < d; ++j) dot += static_cast<double>(v[j]) * cv[j];
    const double dc = cc[c] - 2.0 * dot;
    if (dc < bd || c == 0) {
      bd = dc;
      best = c;
    }
  }
  return best;
}

// Member means under ``lab`` into ``out`` (kc x d); an empty cluster gets ``keep``'s
// row when keep is non-null, else zeros. ``csize`` is scratch of kc entries.
void member_means(const float* P, int64_t cnt, int64_t d, const int64_t* lab, int64_t kc,
                  const double* keep, double* out, int64_t* csize) {
  std::fill(out, out + kc * d, 0.0);
  std::fill(csize, csize + kc, int64_t{0});
  for (int64_t j = 0; j < cnt; ++j) {
    double* o = out + lab[j] * d;
    const float* v = P + j * d;
    for (int64_t t = 0; t < d; ++t) o[t] += static_cast<double>(v[t]);
    ++csize[lab[j]];
  }
  for (int64_t c = 0; c < kc; ++c) {
    double* o = out + c * d;
    if (csize[c] > 0) {
      const double inv = static_cast<double>(csize[c]);
      for (int64_t t = 0; t < d; ++t) o[t] /= inv;
    } else if (keep != nullptr) {
      std::copy(keep + c * d, keep + (c + 1) * d, o);
    }
  }
}

struct Scratch {
  std::vector<double> C, Cn, cc, sq, closest, cum, dc, best_dc;
  std::vector<int64_t> lab, prev, csize;
  void reserve(int64_t n, int64_t c, int64_t d) {
    C.resize(static_cast<size_t>(c * d));
    Cn.resize(static_cast<size_t>(c * d));
    cc.resize(static_cast<size_t>(c));
    sq.resize(static_cast<size_t>(n));
    closest.resize(static_cast<size_t>(n));
    cum.resize(static_cast<size_t>(n));
    dc.resize(static_cast<size_t>(n));
    best_dc.resize(static_cast<size_t>(n));
    lab.resize(static_cast<size_t>(n));
    prev.resize(static_cast<size_t>(n));
    csize.resize(static_cast<size_t>(c));
  }
};

// d2[j] = max(||p||^2 + ||v_j||^2 - 2 <p, v_j>, 0) for j < cnt (float64, as kmeans.py)
inline void d2_to(const float* P, int64_t cnt, int64_t d, const double* sq, int64_t p, double* d2) {
  const float* pv = P + p * d;
  const double pp = sq[p];
  for (int64_t j = 0; j < cnt; ++j) {
    const double v = (pp + sq[j]) - 2.0 * dot64(pv, P + j * d, d);
    d2[j] = v < 0.0 ? 0.0 : v;
  }
}

void kmeans_one(const float* P, int64_t n, int64_t cnt, int64_t kc, int64_t d, int64_t iters,
                double tol, const double* U, int64_t c_max, Scratch& s, int64_t* labels_out,
                float* cent_out) {
  double* C = s.C.data();
  double* Cn = s.Cn.data();
  double* cc = s.cc.data();
  double* sq = s.sq.data();
  double* closest = s.closest.data();
  double* cum = s.cum.data();
  double* dc = s.dc.data();
  double* best_dc = s.best_dc.data();
  int64_t* lab = s.lab.data();
  int64_t* prev = s.prev.data();
  int64_t* csize = s.csize.data();

  // ---- greedy k-means++ seeding with the given draws
  for (int64_t j = 0; j < cnt; ++j) sq[j] = dot64(P + j * d, P + j * d, d);
  // first centre: searchsorted(cumsum(1/cnt) / last, u_0, right=True)
  {
    const double w = 1.0 / static_cast<double>(cnt);
    double acc = 0.0;
    for (int64_t j = 0; j < cnt; ++j) {
      acc += w;
      cum[j] = acc;
    }
    const double last = cum[cnt - 1];
    int64_t first = 0;
    for (int64_t j = 0; j < cnt; ++j) {
      if (cum[j] / last <= U[0])
        first = j + 1;
      else
        break;
    }
    first = std::min(first, std::min(n, cnt) - 1);
    for (int64_t t = 0; t < d; ++t) C[t] = static_cast<double>(P[first * d + t]);
    d2_to(P, cnt, d, sq, first, closest);
  }
  double pot = 0.0;
  for (int64_t j = 0; j < cnt; ++j) pot += closest[j];
  const int64_t T = kmeanspp_trials(kc);
  for (int64_t t = 1; t < kc; ++t) {
    double acc = 0.0;
    for (int64_t j = 0; j < cnt; ++j) {
      acc += closest[j];
      cum[j] = acc;
    }
    double best_pot = std::numeric_limits<double>::infinity();
    int64_t pick = -1;
    for (int64_t a = 0; a < T; ++a) {
      const double rnd = U[1 + (t - 1) * T + a] * pot;
      // searchsorted(cum, rnd, right=False): the number of prefix sums < rnd
      int64_t cand = 0;
      while (cand < cnt && cum[cand] < rnd) ++cand;
      cand = std::min(cand, cnt - 1);
      d2_to(P, cnt, d, sq, cand, dc);
      double cp = 0.0;
      for (int64_t j = 0; j < cnt; ++j) {
        dc[j] = std::min(closest[j], dc[j]);
        cp += dc[j];
      }
      if (cp < best_pot) {  // first minimum wins
        best_pot = cp;
        pick = cand;
        std::copy(dc, dc + cnt, best_dc);
      }
    }
    if (pick < 0) {  // every candidate potential NaN (non-finite input): keep the first
      pick = 0;
      std::copy(closest, closest + cnt, best_dc);
      best_pot = pot;
    }
    double* ct = C + t * d;
    for (int64_t q = 0; q < d; ++q) ct[q] = static_cast<double>(P[pick * d + q]);
    std::copy(best_dc, best_dc + cnt, closest);
    pot = best_pot;
  }

  // ---- per-problem tolerance: tol * mean variance of the points
  double var_sum = 0.0;
  for (int64_t q = 0; q < d; ++q) {
    double mu = 0.0;
    for (int64_t j = 0; j < cnt; ++j) mu += static_cast<double>(P[j * d + q]);
    mu /= static_cast<double>(cnt);
    double v = 0.0;
    for (int64_t j = 0; j < cnt; ++j) {
      const double t = static_cast<double>(P[j * d + q]) - mu;
      v += t * t;
    }
    var_sum += v / static_cast<double>(cnt);
  }
  const double tol_m = tol * (var_sum / static_cast<double>(d));

  // ---- Lloyd iterations (scikit-learn's loop: strict convergence or centre shift)
  bool strict = false;
  std::fill(prev, prev + cnt, int64_t{-1});
  for (int64_t it = 0; it < iters; ++it) {
    bool same = true;
    centre_norms(C, kc, d, cc);
    for (int64_t j = 0; j < cnt; ++j) {
      lab[j] = nearest(P + j * d, C, cc, kc, d);
      same = same && lab[j] == prev[j];
    }
    member_means(P, cnt, d, lab, kc, C, Cn, csize);
    double shift = 0.0;
    for (int64_t q = 0; q < kc * d; ++q) {
      const double t = Cn[q] - C[q];
      shift += t * t;
    }
    std::swap(C, Cn);
    std::copy(lab, lab + cnt, prev);
    if (same) {
      strict = true;
      break;
    }
    if (shift <= tol_m) break;
  }
  // labels: the last assignment on strict convergence, else one more E-step
  if (!strict) {
    centre_norms(C, kc, d, cc);
    for (int64_t j = 0; j < cnt; ++j) prev[j] = nearest(P + j * d, C, cc, kc, d);
  }
  member_means(P, cnt, d, prev, kc, nullptr, Cn, csize);
  for (int64_t j = 0; j < n; ++j) labels_out[j] = j < cnt ? prev[j] : -1;
  for (int64_t q = 0; q < c_max * d; ++q)
    cent_out[q] = q < kc * d ? static_cast<float>(Cn[q]) : 0.0f;
}

}  // namespace

void batched_kmeans(const float* V, int64_t m, int64_t n, int64_t d, const int64_t* counts,
                    const int64_t* clusters, int64_t c_max, int64_t iters, double tol,
                    const double* draws, int64_t n_draws, int64_t* labels, float* centroids,
                    int num_threads) {
  if (m == 0) return;
  // work of one problem: a few Lloyd steps of n points x c centres x d (a rough
  // estimate; the point is that a handful of small problems stays on one thread)
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(std::max<int64_t>(c_max, 1)) *
                      static_cast<double>(d) * 8.0;
  const int nthreads = threads_for(num_threads, work, m);
  std::vector<Scratch> scratch(static_cast<size_t>(nthreads));
  for (Scratch& s : scratch) s.reserve(n, std::max<int64_t>(c_max, 1), d);
  parallel_for(m, nthreads, [&](int64_t i, int tid) {
    kmeans_one(V + i * n * d, n, counts[i], clusters[i], d, iters, tol, draws + i * n_draws, c_max,
               scratch[static_cast<size_t>(tid)], labels + i * n, centroids + i * c_max * d);
  });
}

void alpha_mix(const float* qb, const float* centroids, const float* q0, int64_t m, int64_t c,
               int64_t d, double alpha, float* out, int num_threads) {
  const double beta = 1.0 - alpha;
  const int nthreads = threads_for(num_threads, 6.0 * static_cast<double>(m * c * d), m * c);
  parallel_for(m * c, nthreads, [&](int64_t p, int) {
    const int64_t i = p / c;
    const float* cen = centroids + p * d;
    const float* a = qb + i * d;
    const float* z = q0 + i * d;
    float* o = out + p * d;
    double cn = 0.0;
    for (int64_t t = 0; t < d; ++t) cn += static_cast<double>(cen[t]) * cen[t];
    const double cden = std::sqrt(cn) + 1e-12;
    double qn = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      const double v = alpha * a[t] + beta * (cen[t] / cden) + z[t];
      qn += v * v;
    }
    const double qden = std::sqrt(qn) + 1e-12;
    for (int64_t t = 0; t < d; ++t) {
      const double v = alpha * a[t] + beta * (cen[t] / cden) + z[t];
      o[t] = static_cast<float>(v / qden);
    }
  });
}

}  // namespace rfmem
