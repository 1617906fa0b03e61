// bindings.cpp: thin torch binding of the CUDA kernels (loaded by
// rfmem_fast/backends/cuda_ext.py with torch.utils.cpp_extension.load).
//
//   segmented_topk(Q, qseg, X, offsets, k) -> (scores float32 [b, k], rows int64 [b, k])
//
// Shapes and semantics: rfmem_cuda.h (rfmem_cuda_segmented_topk_warp). All tensors must
// be on the same CUDA device; Q and X float32, qseg and offsets int64 (made contiguous
// here). Errors raise Python exceptions (TORCH_CHECK -> RuntimeError / ValueError).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <tuple>

#include "rfmem_cuda.h"

namespace {

void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                 const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
}

std::tuple<at::Tensor, at::Tensor> segmented_topk(const at::Tensor& Q_in, const at::Tensor& qseg_in,
                                                  const at::Tensor& X_in, const at::Tensor& offsets_in,
                                                  int64_t k) {
  TORCH_CHECK_VALUE(Q_in.is_cuda(), "Q must be a CUDA tensor, got ", Q_in.device());
  const at::Device device = Q_in.device();
  check_input(Q_in, "Q", at::kFloat, 2, device);
  check_input(qseg_in, "qseg", at::kLong, 1, device);
  check_input(X_in, "X", at::kFloat, 2, device);
  check_input(offsets_in, "offsets", at::kLong, 1, device);
  TORCH_CHECK_VALUE(X_in.size(1) == Q_in.size(1), "Q has dimension ", Q_in.size(1), " but X has ", X_in.size(1));
  TORCH_CHECK_VALUE(qseg_in.size(0) == Q_in.size(0), "qseg has ", qseg_in.size(0), " entries but Q has ",
                    Q_in.size(0), " rows");
  TORCH_CHECK_VALUE(offsets_in.size(0) >= 1, "offsets must hold U + 1 >= 1 entries");
  TORCH_CHECK_VALUE(k >= 1 && k <= RFMEM_CUDA_TOPK_MAX_K, "k must be in [1, ", RFMEM_CUDA_TOPK_MAX_K, "], got ", k);

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor Q = Q_in.contiguous();
  const at::Tensor qseg = qseg_in.contiguous();
  const at::Tensor X = X_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t b = Q.size(0);
  at::Tensor scores = at::empty({b, k}, Q.options());
  at::Tensor rows = at::empty({b, k}, qseg.options());
  if (b == 0) return {scores, rows};
  const int rc = rfmem_cuda_segmented_topk_warp(
      Q.data_ptr<float>(), qseg.data_ptr<int64_t>(), b, X.numel() ? X.data_ptr<float>() : nullptr,
      offsets.data_ptr<int64_t>(), offsets.size(0) - 1, Q.size(1), k, scores.data_ptr<float>(),
      rows.data_ptr<int64_t>(), static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(rc == 0, "rfmem_cuda_segmented_topk_warp failed: ", rfmem_cuda_error_string(rc),
              " (shared memory per warp: ", rfmem_cuda_topk_smem_per_warp(Q.size(1), k), " bytes)");
  return {scores, rows};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rfmem_fast CUDA kernels (csrc/cuda)";
  m.def("segmented_topk", &segmented_topk, "Warp-per-query segmented top-k (see rfmem_cuda.h)",
        pybind11::arg("Q"), pybind11::arg("qseg"), pybind11::arg("X"), pybind11::arg("offsets"),
        pybind11::arg("k"));
  m.attr("max_k") = RFMEM_CUDA_TOPK_MAX_K;
}
