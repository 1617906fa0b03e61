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

// Every inner product below is the float64 sum, in order of the dimension t from 0, of
// the (exact) float64 products of its two operands, exactly as kmeans.py's formulas
// read with one accumulator per product: s = 0; for t: s += a[t] * b[t]. The loops
// run over blocks of kBlock POINTS in the innermost position (points stored transposed
// and zero-padded, Pt[t][j], row stride pad_points(cnt)), so that the block's
// accumulators stay in vector registers while every lane keeps that order: the results
// do not depend on the vector width (bit-identical AVX2 / baseline clones).
constexpr int64_t kBlock = 16;

inline int64_t pad_points(int64_t cnt) { return (cnt + kBlock - 1) / kBlock * kBlock; }

// P64 = P as float64 [cnt, d]; Pt[t * pad_points(cnt) + j] = P[j][t] as float64, 0 for
// the padding points
RFMEM_MULTIVERSION
void to_float64(const float* P, int64_t cnt, int64_t d, double* P64, double* Pt) {
  const int64_t cp = pad_points(cnt);
  for (int64_t q = 0; q < cnt * d; ++q) P64[q] = static_cast<double>(P[q]);
  for (int64_t t = 0; t < d; ++t) {
    double* row = Pt + t * cp;
    for (int64_t j = 0; j < cnt; ++j) row[j] = P64[j * d + t];
    for (int64_t j = cnt; j < cp; ++j) row[j] = 0.0;
  }
}

#if defined(__GNUC__)
// kBlock float64 lanes as four 4-lane vectors (GCC vector extension; the baseline clone
// splits them into SSE2 halves, same IEEE operations per lane)
typedef double v4d __attribute__((vector_size(32)));
typedef double v4du __attribute__((vector_size(32), aligned(8), may_alias));
inline v4d ld4d(const double* p) { return *reinterpret_cast<const v4du*>(p); }
inline void st4d(double* p, v4d v) { *reinterpret_cast<v4du*>(p) = v; }

// out[j] = <a, P_j> for j < pad_points(cnt) (a: float64 [d]; out has that many slots)
RFMEM_MULTIVERSION
void dots_to_points(const double* a, const double* Pt, int64_t cnt, int64_t d, double* out) {
  const int64_t cp = pad_points(cnt);
  for (int64_t j0 = 0; j0 < cp; j0 += kBlock) {
    v4d s0 = {0, 0, 0, 0}, s1 = s0, s2 = s0, s3 = s0;
    const double* row = Pt + j0;
    for (int64_t t = 0; t < d; ++t, row += cp) {
      const double at = a[t];
      const v4d av = {at, at, at, at};
      s0 += av * ld4d(row);
      s1 += av * ld4d(row + 4);
      s2 += av * ld4d(row + 8);
      s3 += av * ld4d(row + 12);
    }
    st4d(out + j0, s0);
    st4d(out + j0 + 4, s1);
    st4d(out + j0 + 8, s2);
    st4d(out + j0 + 12, s3);
  }
}

// sq[j] = <P_j, P_j> for j < pad_points(cnt)
RFMEM_MULTIVERSION
void point_norms(const double* Pt, int64_t cnt, int64_t d, double* sq) {
  const int64_t cp = pad_points(cnt);
  for (int64_t j0 = 0; j0 < cp; j0 += kBlock) {
    v4d s0 = {0, 0, 0, 0}, s1 = s0, s2 = s0, s3 = s0;
    const double* row = Pt + j0;
    for (int64_t t = 0; t < d; ++t, row += cp) {
      const v4d x0 = ld4d(row), x1 = ld4d(row + 4), x2 = ld4d(row + 8), x3 = ld4d(row + 12);
      s0 += x0 * x0;
      s1 += x1 * x1;
      s2 += x2 * x2;
      s3 += x3 * x3;
    }
    st4d(sq + j0, s0);
    st4d(sq + j0 + 4, s1);
    st4d(sq + j0 + 8, s2);
    st4d(sq + j0 + 12, s3);
  }
}
#else
void dots_to_points(const double* a, const double* Pt, int64_t cnt, int64_t d, double* out) {
  const int64_t cp = pad_points(cnt);
  std::fill(out, out + cp, 0.0);
  for (int64_t t = 0; t < d; ++t)
    for (int64_t j = 0; j < cp; ++j) out[j] += a[t] * Pt[t * cp + j];
}

void point_norms(const double* Pt, int64_t cnt, int64_t d, double* sq) {
  const int64_t cp = pad_points(cnt);
  std::fill(sq, sq + cp, 0.0);
  for (int64_t t = 0; t < d; ++t)
    for (int64_t j = 0; j < cp; ++j) sq[j] += Pt[t * cp + j] * Pt[t * cp + j];
}
#endif

// ||c||^2 of each of the kc centres (each summed in order of t; the centres' sums are
// interleaved, four at a time, so that their additions overlap)
inline void centre_norms(const double* C, int64_t kc, int64_t d, double* cc) {
  int64_t c = 0;
  for (; c + 4 <= kc; c += 4) {
    const double *c0 = C + c * d, *c1 = c0 + d, *c2 = c1 + d, *c3 = c2 + d;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (int64_t t = 0; t < d; ++t) {
      s0 += c0[t] * c0[t];
      s1 += c1[t] * c1[t];
      s2 += c2[t] * c2[t];
      s3 += c3[t] * c3[t];
    }
    cc[c] = s0;
    cc[c + 1] = s1;
    cc[c + 2] = s2;
    cc[c + 3] = s3;
  }
  for (; c < kc; ++c) {
    double s = 0.0;
    for (int64_t t = 0; t < d; ++t) s += C[c * d + t] * C[c * d + t];
    cc[c] = s;
  }
}

// lab[j] = argmin over the kc centres of ||c||^2 - 2 <v_j, c> (the squared distance
// less the constant ||v_j||^2, as kmeans.py computes it), ties to the smaller index.
// D: scratch of kc * pad_points(cnt).
void assign(const double* Pt, int64_t cnt, const double* C, const double* cc, int64_t kc, int64_t d, double* D,
            int64_t* lab) {
  const int64_t cp = pad_points(cnt);
  for (int64_t c = 0; c < kc; ++c) dots_to_points(C + c * d, Pt, cnt, d, D + c * cp);
  for (int64_t j = 0; j < cnt; ++j) {
    int64_t best = 0;
    double bd = std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < kc; ++c) {
      const double dc = cc[c] - 2.0 * D[c * cp + j];
      if (dc < bd || c == 0) {
        bd = dc;
        best = c;
      }
    }
    lab[j] = best;
  }
}

// Member means under ``lab`` into ``out`` (kc x d); an empty cluster gets ``keep``'s
// row when keep is non-null, else zeros. ``csize`` is scratch of kc entries.
RFMEM_MULTIVERSION
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
  std::vector<double> C, Cn, cc, sq, closest, cum, dc, best_dc, P64, Pt, D, mu, var;
  std::vector<int64_t> lab, prev, csize;
  bool ready = false;  // reserve()d (on first use: a batch of small problems never allocates)
  void reserve(int64_t n, int64_t c, int64_t d) {
    ready = true;
    const int64_t np = pad_points(n);  // the point buffers hold the padding points too
    C.resize(static_cast<size_t>(c * d));
    Cn.resize(static_cast<size_t>(c * d));
    cc.resize(static_cast<size_t>(c));
    sq.resize(static_cast<size_t>(np));
    closest.resize(static_cast<size_t>(np));
    cum.resize(static_cast<size_t>(n));
    dc.resize(static_cast<size_t>(np));
    best_dc.resize(static_cast<size_t>(n));
    P64.resize(static_cast<size_t>(n * d));
    Pt.resize(static_cast<size_t>(np * d));
    D.resize(static_cast<size_t>(c * np));
    mu.resize(static_cast<size_t>(d));
    var.resize(static_cast<size_t>(d));
    lab.resize(static_cast<size_t>(n));
    prev.resize(static_cast<size_t>(n));
    csize.resize(static_cast<size_t>(c));
  }
};

// d2[j] = max(||p||^2 + ||v_j||^2 - 2 <p, v_j>, 0) for j < cnt (float64, as kmeans.py;
// d2 has pad_points(cnt) slots)
inline void d2_to(const double* P64, const double* Pt, int64_t cnt, int64_t d, const double* sq, int64_t p,
                  double* d2) {
  dots_to_points(P64 + p * d, Pt, cnt, d, d2);
  const double pp = sq[p];
  for (int64_t j = 0; j < cnt; ++j) {
    const double v = (pp + sq[j]) - 2.0 * d2[j];
    d2[j] = v < 0.0 ? 0.0 : v;
  }
}

// tol * mean over the dimensions of the points' variance (per dimension: the mean, then
// the mean squared deviation, each summed over the points in order)
RFMEM_MULTIVERSION
double scaled_tol(const float* P, int64_t cnt, int64_t d, double tol, double* mu, double* var) {
  std::fill(mu, mu + d, 0.0);
  std::fill(var, var + d, 0.0);
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t q = 0; q < d; ++q) mu[q] += static_cast<double>(P[j * d + q]);
  for (int64_t q = 0; q < d; ++q) mu[q] /= static_cast<double>(cnt);
  for (int64_t j = 0; j < cnt; ++j) {
    for (int64_t q = 0; q < d; ++q) {
      const double t = static_cast<double>(P[j * d + q]) - mu[q];
      var[q] += t * t;
    }
  }
  double var_sum = 0.0;
  for (int64_t q = 0; q < d; ++q) var_sum += var[q] / static_cast<double>(cnt);
  return tol * (var_sum / static_cast<double>(d));
}

// Greedy k-means++ seeding (kmeans.py kmeanspp_init with scikit-learn's draws U) of kc
// centres among cnt points: picks[0:kc] (point indices). ``d2(p, out)`` writes the
// clamped squared distances of point p to every point j < cnt into out (d2_to, or the
// same numbers read from a Gram matrix); closest / cum / dc / best_dc: cnt slots each
// (closest and dc: as many as d2 writes).
template <class D2>
void seed_centres(int64_t n, int64_t cnt, int64_t kc, const double* U, const D2& d2, double* closest, double* cum,
                  double* dc, double* best_dc, int64_t* picks) {
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
    picks[0] = first;
    d2(first, closest);
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
      d2(cand, dc);
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
    picks[t] = pick;
    std::copy(best_dc, best_dc + cnt, closest);
    pot = best_pot;
  }
}

// Problems with as many clusters as points (kc == cnt <= kSmall: a branch that kept at
// most beam_width candidates) decided from the Gram matrix of the points: G[i][j] is the
// float64 sum in order of t of the exact products, i.e. bit for bit the <p_i, p_j> of
// dots_to_points / point_norms / centre_norms (a centre is a point until the first
// M-step), so the seeding and the first assignment below are those of the general path.
// When that assignment gives every point its own centre (all points distinct enough),
// the M-step returns the same centres, so the general path would stop there with these
// labels and the points as centroids (with or without Lloyd steps): written, true.
// Otherwise (near-duplicates tie): false, nothing written.
constexpr int64_t kSmall = 16;

bool kmeans_small(const float* P, int64_t n, int64_t cnt, int64_t d, const double* U, int64_t c_max,
                  int64_t* labels_out, float* cent_out) {
  double G[kSmall * kSmall];
  for (int64_t i = 0; i < cnt; ++i) {
    const float* a = P + i * d;
    for (int64_t j = 0; j <= i; ++j) {
      const float* b = P + j * d;
      double s = 0.0;
      for (int64_t t = 0; t < d; ++t) s += static_cast<double>(a[t]) * static_cast<double>(b[t]);
      G[i * kSmall + j] = G[j * kSmall + i] = s;
    }
  }
  auto d2 = [&](int64_t p, double* out) {  // d2_to's formula on the Gram entries
    const double pp = G[p * kSmall + p];
    for (int64_t j = 0; j < cnt; ++j) {
      const double v = (pp + G[j * kSmall + j]) - 2.0 * G[p * kSmall + j];
      out[j] = v < 0.0 ? 0.0 : v;
    }
  };
  double closest[kSmall], cum[kSmall], dc[kSmall], best_dc[kSmall];
  int64_t picks[kSmall];
  seed_centres(n, cnt, cnt, U, d2, closest, cum, dc, best_dc, picks);
  // the first E-step (assign): argmin over the centres of ||c||^2 - 2 <p_j, c>, ties to
  // the smaller centre; every point must land on the centre that is itself
  for (int64_t j = 0; j < cnt; ++j) {
    int64_t best = 0;
    double bd = std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < cnt; ++c) {
      const double dcj = G[picks[c] * kSmall + picks[c]] - 2.0 * G[picks[c] * kSmall + j];
      if (dcj < bd || c == 0) {
        bd = dcj;
        best = c;
      }
    }
    if (picks[best] != j) return false;
    labels_out[j] = best;
  }
  for (int64_t j = cnt; j < n; ++j) labels_out[j] = -1;
  for (int64_t c = 0; c < c_max; ++c) {
    float* o = cent_out + c * d;
    if (c < cnt)
      std::copy(P + picks[c] * d, P + (picks[c] + 1) * d, o);  // a one-point mean: the point
    else
      std::fill(o, o + d, 0.0f);
  }
  return true;
}

void kmeans_one(const float* P, int64_t n, int64_t cnt, int64_t kc, int64_t d, int64_t iters,
                double tol, const double* U, int64_t c_max, Scratch& s, int64_t* labels_out,
                float* cent_out) {
  if (kc == cnt && cnt <= kSmall && kmeans_small(P, n, cnt, d, U, c_max, labels_out, cent_out)) return;
  if (!s.ready) s.reserve(n, std::max<int64_t>(c_max, 1), d);
  double* C = s.C.data();
  double* Cn = s.Cn.data();
  double* cc = s.cc.data();
  double* sq = s.sq.data();
  double* closest = s.closest.data();
  double* cum = s.cum.data();
  double* dc = s.dc.data();
  double* best_dc = s.best_dc.data();
  double* Pt = s.Pt.data();
  double* D = s.D.data();
  double* P64 = s.P64.data();
  int64_t* lab = s.lab.data();
  int64_t* prev = s.prev.data();
  int64_t* csize = s.csize.data();

  // ---- greedy k-means++ seeding with the given draws
  to_float64(P, cnt, d, P64, Pt);
  point_norms(Pt, cnt, d, sq);
  int64_t* picks = csize;  // kc slots, free until the Lloyd steps
  seed_centres(n, cnt, kc, U, [&](int64_t p, double* out) { d2_to(P64, Pt, cnt, d, sq, p, out); }, closest, cum,
               dc, best_dc, picks);
  for (int64_t t = 0; t < kc; ++t)
    for (int64_t q = 0; q < d; ++q) C[t * d + q] = static_cast<double>(P[picks[t] * d + q]);

  // ---- per-problem tolerance: tol * mean variance of the points
  const double tol_m = scaled_tol(P, cnt, d, tol, s.mu.data(), s.var.data());

  // ---- Lloyd iterations (scikit-learn's loop: strict convergence or centre shift)
  bool strict = false;
  std::fill(prev, prev + cnt, int64_t{-1});
  for (int64_t it = 0; it < iters; ++it) {
    centre_norms(C, kc, d, cc);
    assign(Pt, cnt, C, cc, kc, d, D, lab);
    bool same = true;
    for (int64_t j = 0; j < cnt; ++j) same = same && lab[j] == prev[j];
    member_means(P, cnt, d, lab, kc, C, Cn, csize);
    std::swap(C, Cn);
    std::copy(lab, lab + cnt, prev);
    if (same) {
      strict = true;
      break;
    }
    // squared centre shift, summed in order; its partial sums never decrease, so the
    // sum stops as soon as it exceeds tol_m (the comparison is then decided)
    double shift = 0.0;
    for (int64_t q = 0; q < kc * d && shift <= tol_m; ++q) {
      const double t = C[q] - Cn[q];
      shift += t * t;
    }
    if (shift <= tol_m) break;
  }
  // labels: the last assignment on strict convergence, else one more E-step; centroids:
  // the member means under those labels (on strict convergence, the centres of the last
  // step are those means, but for an empty cluster, which gets 0 here)
  if (strict) {
    std::copy(C, C + kc * d, Cn);
    for (int64_t c = 0; c < kc; ++c)
      if (csize[c] == 0) std::fill(Cn + c * d, Cn + (c + 1) * d, 0.0);
  } else {
    centre_norms(C, kc, d, cc);
    assign(Pt, cnt, C, cc, kc, d, D, prev);
    member_means(P, cnt, d, prev, kc, nullptr, Cn, csize);
  }
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
  // per-thread scratch: reserved here when threads run (they must not throw), else on
  // first use (a call whose problems are all small allocates nothing)
  std::vector<Scratch> scratch(static_cast<size_t>(nthreads));
  if (nthreads > 1)
    for (Scratch& s : scratch) s.reserve(n, std::max<int64_t>(c_max, 1), d);
  parallel_for(m, nthreads, [&](int64_t i, int tid) {
    kmeans_one(V + i * n * d, n, counts[i], clusters[i], d, iters, tol, draws + i * n_draws, c_max,
               scratch[static_cast<size_t>(tid)], labels + i * n, centroids + i * c_max * d);
  });
}

namespace {

// One child: o = normalise(alpha a + beta normalise(cen) + z), each term's element
// computed once into v (float64; the same operations as the formula read element by
// element), the norms summed in order of t.
RFMEM_MULTIVERSION
void mix_one(const float* a, const float* cen, const float* z, int64_t d, double alpha, double beta, float* o,
             double* v) {
  double cn = 0.0;
  for (int64_t t = 0; t < d; ++t) cn += static_cast<double>(cen[t]) * cen[t];
  const double cden = std::sqrt(cn) + 1e-12;
  for (int64_t t = 0; t < d; ++t) v[t] = alpha * a[t] + beta * (cen[t] / cden) + z[t];
  double qn = 0.0;
  for (int64_t t = 0; t < d; ++t) qn += v[t] * v[t];
  const double qden = std::sqrt(qn) + 1e-12;
  for (int64_t t = 0; t < d; ++t) o[t] = static_cast<float>(v[t] / qden);
}

}  // namespace

void alpha_mix(const float* qb, const float* centroids, const float* q0, int64_t m, int64_t c,
               int64_t d, double alpha, float* out, int num_threads) {
  const double beta = 1.0 - alpha;
  const int nthreads = threads_for(num_threads, 6.0 * static_cast<double>(m * c * d), m * c);
  std::vector<double> v(static_cast<size_t>(nthreads) * static_cast<size_t>(d));  // before the threads start
  parallel_for(m * c, nthreads, [&](int64_t p, int tid) {
    const int64_t i = p / c;
    mix_one(qb + i * d, centroids + p * d, q0 + i * d, d, alpha, beta, out + p * d, v.data() + tid * d);
  });
}

}  // namespace rfmem
