// The SIMD kernels of simd.h: simd_impl.inc compiled once per instruction-set level,
// each in its own namespace, and the run-time choice of the level (CPUID through the
// compiler's __builtin_cpu_supports, which also checks that the OS saves the vector
// registers). Levels 1 and 2 exist on x86 with GCC or Clang; elsewhere only level 0.
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(RFMEM_NO_MULTIVERSION)
#define RFMEM_SIMD_X86 1
#include <immintrin.h>
#else
#define RFMEM_SIMD_X86 0
#endif

namespace rfmem {

namespace simd_l0 {
#define RFMEM_LEVEL 0
#include "simd_impl.inc"
#undef RFMEM_LEVEL
}  // namespace simd_l0

#if RFMEM_SIMD_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace simd_l1 {
#define RFMEM_LEVEL 1
#include "simd_impl.inc"
#undef RFMEM_LEVEL
}  // namespace simd_l1
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace simd_l2 {
#define RFMEM_LEVEL 2
#include "simd_impl.inc"
#undef RFMEM_LEVEL
}  // namespace simd_l2
// level 2's int8 kernels: AVX-512BW (vpmaddwd), then AVX-512BW + AVX512_VNNI (vpdpwssd)
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
namespace simd_l2_bw {
#define RFMEM_I8_VNNI 0
#include "simd_i8_avx512.inc"
#undef RFMEM_I8_VNNI
}  // namespace simd_l2_bw
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
namespace simd_l2_vnni {
#define RFMEM_I8_VNNI 1
#include "simd_i8_avx512.inc"
#undef RFMEM_I8_VNNI
}  // namespace simd_l2_vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // RFMEM_SIMD_X86

namespace {

#if RFMEM_SIMD_X86
// Level 2's kernels with one of its int8 variants (the int8 dots, GEMM micro-kernel, name
// and micro-tile shape); everything else is the same AVX-512 code.
SimdKernels level2(decltype(SimdKernels::i8_dots) i8_dots, decltype(SimdKernels::i8_gemm_panel) i8_gemm_panel,
                   const char* i8_name, int i8_mr, int i8_nr,
                   decltype(SimdKernels::i8_gemm_panel_b) i8_gemm_panel_b = nullptr) {
  return {2, "avx512", simd_l2::MR, simd_l2::NR, &simd_l2::gemm_panel, &simd_l2::to_f32, i8_dots, i8_gemm_panel,
          &simd_l2::dot4_half, &simd_l2::scan_rows_half, &simd_l2::scan_rows_f32, &simd_l2::scan_rows_f32_pruned,
          &simd_l2::scores_f32, &simd_l2::exact_sums, i8_name, i8_mr, i8_nr, i8_gemm_panel_b};
}
#endif

// kLevels[level] for levels 0, 1; level 2 is kLevels[2 + i8 variant] (0 avx2: level 1's
// int8 kernels, 1 avx512bw, 2 avx512_vnni; simd.h)
const SimdKernels kLevels[] = {
    {0, "baseline", simd_l0::MR, simd_l0::NR, &simd_l0::gemm_panel, &simd_l0::to_f32, &simd_l0::i8_dots,
     nullptr, &simd_l0::dot4_half,
     &simd_l0::scan_rows_half, nullptr, nullptr, nullptr, &simd_l0::exact_sums, "baseline", 0, 0},
#if RFMEM_SIMD_X86
    {1, "avx2", simd_l1::MR, simd_l1::NR, &simd_l1::gemm_panel, &simd_l1::to_f32, &simd_l1::i8_dots,
     &simd_l1::i8_gemm_panel, &simd_l1::dot4_half,
     &simd_l1::scan_rows_half, &simd_l1::scan_rows_f32,
     &simd_l1::scan_rows_f32_pruned, &simd_l1::scores_f32, &simd_l1::exact_sums, "avx2", simd_l1::kI8MR, simd_l1::kI8NR},
    level2(&simd_l1::i8_dots, &simd_l1::i8_gemm_panel, "avx2", simd_l1::kI8MR, simd_l1::kI8NR),
    level2(&simd_l2_bw::i8_dots, &simd_l2_bw::i8_gemm_panel, "avx512bw", simd_l2_bw::kI8MR, simd_l2_bw::kI8NR),
    level2(&simd_l2_vnni::i8_dots, &simd_l2_vnni::i8_gemm_panel, "avx512_vnni", simd_l2_vnni::kI8MR,
           simd_l2_vnni::kI8NR, &simd_l2_vnni::i8_gemm_panel_b),
#endif
};

std::atomic<int> g_cap{std::numeric_limits<int>::max()};
std::atomic<int> g_i8_cap{std::numeric_limits<int>::max()};

int detect_level() {
#if RFMEM_SIMD_X86
  __builtin_cpu_init();
  const bool l1 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (l1 && __builtin_cpu_supports("avx512f")) return 2;
  if (l1) return 1;
#endif
  return 0;
}

int detect_i8() {
#if RFMEM_SIMD_X86
  if (detect_level() < 2) return 0;
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) return 0;
  return __builtin_cpu_supports("avx512vnni") ? 2 : 1;
#else
  return 0;
#endif
}

}  // namespace

int simd_level_supported() {
  static const int level = detect_level();
  return level;
}

int simd_i8_supported() {
  static const int v = detect_i8();
  return v;
}

const SimdKernels& simd_kernels() {
  const int level = std::max(0, std::min(simd_level_supported(), g_cap.load(std::memory_order_relaxed)));
  if (level < 2) return kLevels[level];
  return kLevels[2 + std::max(0, std::min(simd_i8_supported(), g_i8_cap.load(std::memory_order_relaxed)))];
}

int set_simd_cap(int cap, int i8_cap) {
  g_i8_cap.store(i8_cap < 0 ? std::numeric_limits<int>::max() : i8_cap, std::memory_order_relaxed);
  g_cap.store(cap < 0 ? std::numeric_limits<int>::max() : cap, std::memory_order_relaxed);
  return simd_kernels().level;
}

}  // namespace rfmem
