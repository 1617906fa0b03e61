/*
 * rfmem_cuda.h: C ABI of the CUDA kernels of rfmem_fast (DESIGN.md, "Kernels worth
 * fusing": CUDA where Triton does poorly).
 *
 * Plain C (C99 / C++17), no CUDA header needed: streams are passed as void* (a
 * cudaStream_t; NULL = the legacy default stream) and every launcher returns a
 * cudaError_t as int (0 = success). All pointers are DEVICE pointers; arrays are
 * C-contiguous (row-major).
 */
#ifndef RFMEM_CUDA_H_
#define RFMEM_CUDA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Largest k accepted by rfmem_cuda_segmented_topk_warp (a power of two). */
#define RFMEM_CUDA_TOPK_MAX_K 16384

/*
 * Segmented top-k, one warp per query (RFMEM_SPEC.md "Vectors and scores", section 1).
 *
 * For each query i, scores s_r = <Q[i, :], X[r, :]> over the rows r of its own segment
 * offsets[qseg[i]] <= r < offsets[qseg[i] + 1] (products and sums in float64, rounded
 * once to float32: the exact scores of the torch and triton backends), and writes the k
 * largest, descending, ties broken by the smaller row:
 *   out_scores[i, j] (float32) and out_rows[i, j] (int64, global row index),
 * padded with -inf / -1 where the segment has fewer than k rows, or where qseg[i] is
 * outside [0, num_segments). Segments must hold fewer than 2^32 rows.
 *
 * Meant for large k (up to RFMEM_CUDA_TOPK_MAX_K) and very long segments: each warp
 * keeps its running top-k in shared memory as packed (score, row) keys and merges
 * staged candidates that beat the current k-th score with a warp-wide bitonic merge;
 * no [b, n] score matrix is written.
 *
 * Args:
 *   Q:            float32 [b, d]
 *   qseg:         int64 [b]
 *   b:            number of queries (>= 0)
 *   X:            float32 [n, d]
 *   offsets:      int64 [num_segments + 1], non-decreasing, CSR
 *   num_segments: U >= 0
 *   d:            dimension >= 1
 *   k:            1 <= k <= RFMEM_CUDA_TOPK_MAX_K
 *   out_scores:   float32 [b, k]
 *   out_rows:     int64 [b, k]
 *   stream:       cudaStream_t or NULL
 *
 * Returns: 0 on success; cudaErrorInvalidValue (1) for bad arguments; otherwise the
 *   cudaError_t of the launch (e.g. not enough shared memory on this device).
 */
int rfmem_cuda_segmented_topk_warp(const float* Q, const int64_t* qseg, int64_t b, const float* X,
                                   const int64_t* offsets, int64_t num_segments, int64_t d, int64_t k,
                                   float* out_scores, int64_t* out_rows, void* stream);

/* Dynamic shared memory (bytes) one warp of rfmem_cuda_segmented_topk_warp needs. */
int64_t rfmem_cuda_topk_smem_per_warp(int64_t d, int64_t k);

/* Human-readable text of a code returned above (cudaGetErrorString). */
const char* rfmem_cuda_error_string(int code);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RFMEM_CUDA_H_ */
