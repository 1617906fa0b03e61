// The context score's exact top-k on the host (rfmem_fast/context.py, context_topk): the
// compiled twin of the numpy pass for unfiltered queries on users without chunk rows. The
// definition, the layout and the exactness argument are in rfmem_fast/context.py's
// module docstring; the numpy code there is the portable path and the oracle of this one.
#pragma once

#include <cstdint>

namespace rfmem {

/// Per-user layouts for a batch (rfmem_fast/context.py _Layout): user j's positions are
/// lay[lay_ptr[j] .. lay_ptr[j + 1]) (the local item row, -1 at a sentinel), its thread
/// blocks start at tstart[t_ptr[j] .. t_ptr[j + 1]) (positions), its free block at fstart[j].
struct ContextLayouts {
  const int32_t* lay;
  const int64_t* lay_ptr;
  const int32_t* tstart;
  const int64_t* t_ptr;
  const int64_t* fstart;
};

/// For each query i (segment qseg[i], layout quser[i]; -1: skipped, padding): every row's scan score
/// f[fptr[i] + j] (|f - RN32(q.x)| <= scale ||q|| (1 + 2^-30) + abs_term), its boost
/// boosts[fptr[i] + j] (nullptr: none), the exact top-k by c (ties by the smaller row):
/// rows (global, -1 padding), c and the base score (float64; NaN / -inf padding) and the
/// exact dense score (float32, NaN padding).
void context_topk(const float* X, int64_t d, const int64_t* offsets, const float* Q, const int64_t* qseg, int64_t b,
                  const float* f, const int64_t* fptr, const double* boosts, const int64_t* quser,
                  const ContextLayouts& lo, int64_t r, double w_n, double w_s, int64_t k, double scale,
                  double abs_term, double xnorm, int num_threads, int64_t* out_rows, double* out_c, double* out_b,
                  float* out_dense);

}  // namespace rfmem
