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

}  // namespace tfp8
