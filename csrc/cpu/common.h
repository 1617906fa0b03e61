// Shared helpers of the CPU kernels of rfmem_fast (module rfmem_fast._native).
//
// Everything here is plain C++17 with no Python dependency, so that the kernels can
// be unit-tested or reused outside the binding.
//
// Threads. A call uses more than one thread only when its work pays for it
// (threads_for: at least kMinWorkPerThread multiply-adds per thread), so a small call
// runs on the calling thread alone; a parallel region runs on the process's pool of
// helper threads (pool.h), which sleep on a condition variable between regions (after a
// spin of at most kHelperSpinSeconds, 400 us, when the calls come back to back; an
// OpenMP runtime's pool busy-waits far longer and steals the cores of a busy serving
// machine), and whose caller never waits for a helper to be scheduled: it claims items
// one at a time from an atomic counter like the helpers, so a helper that the OS does not
// run in time only leaves its items to the caller. One region holds the pool at
// a time: another thread of the process in a region, and the call runs alone. The rule
// is the same for every kernel and every entry point (search, the server, the CLI).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "pool.h"

namespace rfmem {

// Function multiversioning: an AVX2 clone and a baseline x86-64 clone, picked once
// at load time by the dynamic loader (ifunc). Elsewhere the attribute is empty.
// The kernels are compiled with -ffp-contract=off, so both clones run the same IEEE
// operations in the same order and give bit-identical results.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && \
    defined(__linux__) && !defined(RFMEM_NO_MULTIVERSION)
#define RFMEM_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define RFMEM_MULTIVERSION
#endif

/// Multiply-adds (or comparable units of work) a thread must get before a call uses it.
/// A pool region costs the caller one futex wake (~5-15 us) and a helper wakes within
/// ~5-40 us (bench/bench_single_query.py measures both), while a core does 0.5 million
/// float32 multiply-adds in ~10-30 us (the scan path at 20-60 GMAC/s): a thread pays
/// from about that much work. One query over a 4,096 x 384 memory (1.6 million) is
/// split over 2 threads, a recollection round of 4 branch queries (6.3 million) too.
constexpr double kMinWorkPerThread = 0.5e6;

/// Threads of the machine (std::thread::hardware_concurrency(), at least 1), read once
/// per process (glibc reads /sys for it: ~5 us, as much as a small kernel call).
inline int hardware_threads() {
  static const int h = [] {
    const unsigned n = std::thread::hardware_concurrency();
    return n ? static_cast<int>(n) : 1;
  }();
  return h;
}

/// Threads for a call: ``requested`` (> 0; 0 = hardware_threads()), capped so that each
/// thread gets at least kMinWorkPerThread of ``work`` and at least one of ``items``.
inline int threads_for(int requested, double work, int64_t items) {
  int t = requested > 0 ? requested : hardware_threads();
  const double by_work = work / kMinWorkPerThread;
  if (by_work < static_cast<double>(t)) t = static_cast<int>(by_work);
  if (static_cast<int64_t>(t) > items) t = static_cast<int>(items);
  return std::max(1, t);
}

/// The first of the n ascending values p[0:n] that is >= v (p + n if none): std::lower_bound
/// with a conditional move per step instead of a branch the data decides.
inline const int32_t* lower_bound_i32(const int32_t* p, int64_t n, int32_t v) {
  if (n <= 0) return p;
  while (n > 1) {
    const int64_t half = n >> 1;
    p = p[half - 1] < v ? p + half : p;
    n -= half;
  }
  return p + (*p < v);
}

/// Calls ``fn(i, tid)`` for every i in [0, n) on ``nthreads`` threads (the caller is
/// thread 0; tid < nthreads indexes per-thread scratch, one thread per tid at a time).
/// Items are claimed one at a time from an atomic counter. ``fn`` must not throw. More
/// than one thread: the process's pool (pool.h: helpers that sleep between regions, a
/// caller that never waits for a helper to show up, inline when another region of the
/// process holds the pool); if the OS refuses to start a thread, those running do the work.
template <class F>
void parallel_for(int64_t n, int nthreads, const F& fn) {
  if (n <= 0) return;
  if (static_cast<int64_t>(nthreads) > n) nthreads = static_cast<int>(n);
  if (nthreads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  pool_run(n, nthreads, [](const void* ctx, int64_t i, int tid) { (*static_cast<const F*>(ctx))(i, tid); }, &fn);
}

}  // namespace rfmem
