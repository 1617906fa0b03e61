// Shared helpers of the CPU kernels of rfmem_fast (module rfmem_fast._native).
//
// Everything here is plain C++17 with no Python dependency, so that the kernels can
// be unit-tested or reused outside the binding.
//
// Threads. The kernels run on plain std::threads started for one call and joined
// before it returns (parallel_for): no thread pool stays behind, nothing spins while
// waiting (a pool that busy-waits between parallel regions, as OpenMP runtimes do by
// default, steals the cores of a busy serving machine), and a call uses more than one
// thread only when its work pays for the start-up (threads_for: at least
// kMinWorkPerThread multiply-adds per thread), so a single small query runs on the
// calling thread alone. Work is handed out one item at a time from an atomic counter,
// so a thread that the OS preempts delays the call by at most the item it holds.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

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

/// Multiply-adds (or comparable units of work) a thread must get before a call uses it
/// (about 0.5-1 ms of work: a thread's start and join cost some 20-50 us).
constexpr double kMinWorkPerThread = 4.0e6;

/// Threads of the machine (std::thread::hardware_concurrency(), at least 1).
inline int hardware_threads() {
  const unsigned h = std::thread::hardware_concurrency();
  return h ? static_cast<int>(h) : 1;
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

/// Calls ``fn(i, tid)`` for every i in [0, n) on ``nthreads`` threads (the caller is
/// thread 0; tid < nthreads indexes per-thread scratch). Items are claimed one at a
/// time from an atomic counter. ``fn`` must not throw. If the OS refuses to start a
/// thread, the threads already running do the work.
template <class F>
void parallel_for(int64_t n, int nthreads, const F& fn) {
  if (n <= 0) return;
  if (static_cast<int64_t>(nthreads) > n) nthreads = static_cast<int>(n);
  if (nthreads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&](int tid) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i, tid);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(nthreads - 1));
  for (int t = 1; t < nthreads; ++t) {
    try {
      pool.emplace_back(work, t);
    } catch (const std::system_error&) {
      break;
    }
  }
  work(0);
  for (std::thread& th : pool) th.join();
}

}  // namespace rfmem
