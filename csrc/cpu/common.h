// Shared helpers of the CPU kernels of rfmem_fast (module rfmem_fast._native).
//
// Everything here is plain C++17 with no Python dependency, so that the kernels can
// be unit-tested or reused outside the binding. OpenMP is optional (_OPENMP).
#pragma once

#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

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

/// Number of OpenMP threads to use: ``requested`` when > 0, else the runtime default.
inline int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

/// Index of the calling thread inside the current parallel region (0 without OpenMP).
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace rfmem
