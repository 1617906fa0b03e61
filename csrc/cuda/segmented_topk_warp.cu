// segmented_topk_warp.cu: warp-per-query segmented top-k for large k / very long
// segments (DESIGN.md, "Kernels worth fusing": CUDA where Triton does poorly).
//
// Triton keeps a running top-k in registers, which stops scaling past k ~ 1024. Here
// one warp serves one query and keeps its running top-K (K = max(32, next pow2 >= k))
// in SHARED memory as packed 64-bit keys:
//
//   key = (ordered(score) << 32) | (0xffffffff - (row - segment start))
//
// where ordered() maps the float's bits to an order-preserving uint32 (after s + 0.0f
// folds -0.0 into +0.0). Unsigned key order is the spec's order (score descending,
// ties by the SMALLER row, RFMEM_SPEC.md "Vectors and scores"); 0 is the empty slot.
//
// Scan: the warp walks its segment 32 rows at a time; each row's inner product is
// computed cooperatively (lane j reads columns j, j+32, ...: coalesced) in float64 and
// reduced with __shfl_xor_sync, so lane r ends up owning row base + r; the score is
// rounded once to float32 (the torch and triton backends' exact scores, so that ids,
// scores and ties agree across backends and do not depend on the batch). Keys that beat the
// current K-th key are appended to a staging buffer (ballot + popc, no atomics).
// When the stage would overflow (and once at the end), it is bitonic-sorted and merged
// into the top-K with the max trick: top[K-1-i] = max(top[K-1-i], stage[i]) turns the
// two sorted lists into one bitonic sequence holding the K largest keys, which a
// warp-wide bitonic merge (log2 K half-cleaner passes) sorts again.
//
// C ABI: rfmem_cuda.h.

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "rfmem_cuda.h"

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxStage = 256;        // staging keys per warp (power of two, >= 32)
constexpr int kMaxWarpsPerBlock = 4;  // warps (queries) per block when shared memory allows
constexpr int64_t kDefaultSmem = 48 * 1024;

typedef unsigned long long rk_key;

__host__ __device__ inline int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

__host__ __device__ inline int64_t padded_k(int64_t k) { return next_pow2(k < kWarp ? kWarp : k); }

__host__ __device__ inline int64_t stage_size(int64_t kp) { return kp < kMaxStage ? kp : kMaxStage; }

__host__ __device__ inline int64_t smem_per_warp(int64_t d, int64_t kp) {
  const int64_t qbytes = ((d * (int64_t)sizeof(float) + 15) / 16) * 16;
  return (kp + stage_size(kp)) * (int64_t)sizeof(rk_key) + qbytes;
}

__device__ __forceinline__ rk_key pack_key(float s, uint32_t local) {
  const uint32_t bits = __float_as_uint(s + 0.0f);
  const uint32_t ord = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ((rk_key)ord << 32) | (rk_key)(0xffffffffu - local);
}

__device__ __forceinline__ float key_score(rk_key key) {
  const uint32_t ord = (uint32_t)(key >> 32);
  const uint32_t bits = (ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord;
  return __uint_as_float(bits);
}

__device__ __forceinline__ uint32_t key_local(rk_key key) {
  return 0xffffffffu - (uint32_t)(key & 0xffffffffull);
}

// Index of the lower element of compare-exchange pair i at distance `stride`.
__device__ __forceinline__ int pair_lo(int i, int stride) {
  return ((i & ~(stride - 1)) << 1) | (i & (stride - 1));
}

// Sort a[0:len) descending (len a power of two), by the 32 lanes of one warp.
__device__ void warp_bitonic_sort_desc(rk_key* a, int len, int lane) {
  for (int size = 2; size <= len; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = lane; i < (len >> 1); i += kWarp) {
        const int lo = pair_lo(i, stride);
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const rk_key x = a[lo];
        const rk_key y = a[hi];
        if ((x < y) == desc && x != y) {
          a[lo] = y;
          a[hi] = x;
        }
      }
      __syncwarp();
    }
  }
}

// Sort a bitonic sequence a[0:len) descending (half-cleaner passes).
__device__ void warp_bitonic_merge_desc(rk_key* a, int len, int lane) {
  for (int stride = len >> 1; stride > 0; stride >>= 1) {
    for (int i = lane; i < (len >> 1); i += kWarp) {
      const int lo = pair_lo(i, stride);
      const int hi = lo + stride;
      const rk_key x = a[lo];
      const rk_key y = a[hi];
      if (x < y) {
        a[lo] = y;
        a[hi] = x;
      }
    }
    __syncwarp();
  }
}

// Merge the n_stage staged keys into the sorted top[0:kp) (stage size s <= kp).
__device__ void merge_stage(rk_key* top, int kp, rk_key* stage, int s, int n_stage, int lane) {
  for (int i = n_stage + lane; i < s; i += kWarp) stage[i] = 0ull;
  __syncwarp();
  warp_bitonic_sort_desc(stage, s, lane);
  for (int i = lane; i < s; i += kWarp) {
    const int j = kp - 1 - i;
    const rk_key v = stage[i];
    if (v > top[j]) top[j] = v;
  }
  __syncwarp();
  warp_bitonic_merge_desc(top, kp, lane);
}

__global__ void segmented_topk_warp_kernel(const float* __restrict__ Q, const int64_t* __restrict__ qseg,
                                           int64_t b, const float* __restrict__ X,
                                           const int64_t* __restrict__ offsets, int64_t num_segments,
                                           int64_t d, int64_t k, int kp, int warps_per_block,
                                           float* __restrict__ out_scores, int64_t* __restrict__ out_rows) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t qi = (int64_t)blockIdx.x * warps_per_block + warp;
  if (qi >= b) return;  // whole warps only: no block-level barrier below

  const int s = (int)stage_size(kp);
  unsigned char* base = smem + (size_t)warp * (size_t)smem_per_warp(d, kp);
  rk_key* top = reinterpret_cast<rk_key*>(base);
  rk_key* stage = top + kp;
  float* qv = reinterpret_cast<float*>(stage + s);

  for (int i = lane; i < kp; i += kWarp) top[i] = 0ull;
  const float* q = Q + qi * d;
  for (int64_t j = lane; j < d; j += kWarp) qv[j] = q[j];
  const int64_t seg = qseg[qi];
  int64_t start = 0, end = 0;
  if (seg >= 0 && seg < num_segments) {
    start = offsets[seg];
    end = offsets[seg + 1];
  }
  __syncwarp();

  rk_key thresh = 0ull;  // the current kp-th key: a candidate must beat it
  int n_stage = 0;
  for (int64_t row0 = start; row0 < end; row0 += kWarp) {
    const int nrow = (int)((end - row0) < kWarp ? (end - row0) : kWarp);
    float mine = 0.0f;
    for (int r = 0; r < nrow; ++r) {
      const float* x = X + (row0 + r) * d;
      double part = 0.0;  // float64 products and sums, rounded once: exact, batch-invariant scores
      for (int64_t j = lane; j < d; j += kWarp) part = fma((double)qv[j], (double)__ldg(x + j), part);
#pragma unroll
      for (int off = kWarp / 2; off > 0; off >>= 1) part += __shfl_xor_sync(kFullMask, part, off);
      if (lane == r) mine = (float)part;
    }
    const rk_key key = lane < nrow ? pack_key(mine, (uint32_t)(row0 + lane - start)) : 0ull;
    bool take = key > thresh;
    unsigned ballot = __ballot_sync(kFullMask, take);
    int cnt = __popc(ballot);
    if (n_stage + cnt > s) {
      merge_stage(top, kp, stage, s, n_stage, lane);
      thresh = top[kp - 1];
      n_stage = 0;
      take = key > thresh;
      ballot = __ballot_sync(kFullMask, take);
      cnt = __popc(ballot);
    }
    if (take) stage[n_stage + __popc(ballot & ((1u << lane) - 1u))] = key;
    n_stage += cnt;
    __syncwarp();
  }
  if (n_stage > 0) merge_stage(top, kp, stage, s, n_stage, lane);

  for (int64_t j = lane; j < k; j += kWarp) {
    const rk_key key = top[j];
    out_scores[qi * k + j] = key ? key_score(key) : -INFINITY;
    out_rows[qi * k + j] = key ? start + (int64_t)key_local(key) : (int64_t)-1;
  }
}

}  // namespace

extern "C" int64_t rfmem_cuda_topk_smem_per_warp(int64_t d, int64_t k) {
  if (d < 1 || k < 1 || k > RFMEM_CUDA_TOPK_MAX_K) return -1;
  return smem_per_warp(d, padded_k(k));
}

extern "C" const char* rfmem_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

extern "C" int rfmem_cuda_segmented_topk_warp(const float* Q, const int64_t* qseg, int64_t b, const float* X,
                                              const int64_t* offsets, int64_t num_segments, int64_t d,
                                              int64_t k, float* out_scores, int64_t* out_rows, void* stream) {
  if (b < 0 || d < 1 || k < 1 || k > RFMEM_CUDA_TOPK_MAX_K || num_segments < 0) return cudaErrorInvalidValue;
  if (b == 0) return cudaSuccess;
  if (!Q || !qseg || !offsets || !out_scores || !out_rows) return cudaErrorInvalidValue;
  const int64_t kp = padded_k(k);
  const int64_t per_warp = smem_per_warp(d, kp);
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  int max_optin = 0;
  err = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  int wpb = kMaxWarpsPerBlock;
  while (wpb > 1 && wpb * per_warp > kDefaultSmem) wpb >>= 1;
  const int64_t smem = wpb * per_warp;
  if (smem > (int64_t)max_optin) return cudaErrorInvalidValue;  // k or d too large for this GPU
  if (smem > kDefaultSmem) {
    err = cudaFuncSetAttribute(segmented_topk_warp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem);
    if (err != cudaSuccess) return err;
  }
  const int64_t blocks = (b + wpb - 1) / wpb;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  segmented_topk_warp_kernel<<<(unsigned)blocks, wpb * kWarp, (size_t)smem, static_cast<cudaStream_t>(stream)>>>(
      Q, qseg, b, X, offsets, num_segments, d, k, (int)kp, wpb, out_scores, out_rows);
  return (int)cudaGetLastError();
}
