// csrc/linear_inference.cpp: fp8_linear_inference through the dispatcher, for transformer_fp8._C (one typed call from
// Python, no schema parsing: a small Linear's inference is host-bound). Below autograd: for callers that need no
// gradient (the output never requires grad). Arguments: the op's (csrc/ops.cpp), amax_compute_algo as use_max
// ("max" when true, "most_recent" when false).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace tfp8 {

at::Tensor linear_inference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale_inv,
                            const at::Tensor& x_scale, at::ScalarType fp8_dtype, const at::Tensor& x_amax,
                            const at::Tensor& x_scale_inv, const std::optional<at::Tensor>& bias, bool current_scaling,
                            double fp8_max, const std::optional<at::Tensor>& history,
                            const std::optional<at::Tensor>& state_scale,
                            const std::optional<at::Tensor>& state_scale_inv, const std::optional<at::Tensor>& backup,
                            double margin, bool use_max);

// The CUDA kernels' own entries, for linear_inference to call without the dispatcher (three dispatcher calls fewer
// per call: the composite, inference_cast and fp8_gemm). The CUDA families fill them in when their objects load
// (csrc/quantize_inference_binding.cpp, csrc/gemm_inference.cpp); null in a build without those families, where the
// dispatcher path runs.
// inference_cast's CUDA kernel (arguments: the op's, csrc/ops.cpp).
using InferenceCastEntry = at::Tensor (*)(const at::Tensor&, const at::Tensor&, at::ScalarType, const at::Tensor&,
                                          const at::Tensor&, bool, double, const std::optional<at::Tensor>&,
                                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                          const std::optional<at::Tensor>&, double, c10::string_view);
// fp8_gemm's CUDA kernel for the inference call's one case (fast accumulation, optional bias of the output's dtype,
// no GELU, residual or FP8 output): writes `out` and returns true when the operands need no padding or copy (fp8_gemm
// would run the same cuBLASLt plan on them), else returns false and leaves the call to fp8_gemm.
using InferenceGemmEntry = bool (*)(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                                    const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                                    const std::optional<at::Tensor>& bias, at::Tensor& out);
InferenceCastEntry& inference_cast_cuda_entry();
InferenceGemmEntry& inference_gemm_cuda_entry();

}  // namespace tfp8
