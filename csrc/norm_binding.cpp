// CUDA kernels of layernorm_fwd / layernorm_bwd / rmsnorm_fwd / rmsnorm_bwd (contracts in csrc/ops.cpp and norm.h):
// argument checks, output allocation, launch on the current stream.
#include <torch/library.h>

#include "common.h"
#include "norm.h"

namespace tfp8 {
namespace {

void check_input(const at::Tensor& input) {
  check_cuda(input, "input");
  check_high_precision(input, "input");
  TORCH_CHECK(input.dim() == 2, "input: expected a 2-D tensor [M, N], got shape ", dims(input.sizes()));
  TORCH_CHECK(input.size(1) > 0, "input: expected at least one column, got shape ", dims(input.sizes()));
  check_contiguous(input, "input");
}

// weight / bias: [N], the input's dtype or float32, contiguous, on the input's device.
void check_param(const at::Tensor& t, const at::Tensor& input, const char* arg) {
  TORCH_CHECK(t.scalar_type() == input.scalar_type() || t.scalar_type() == at::kFloat, arg, ": expected dtype ",
              input.scalar_type(), " (the input's) or Float, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == input.size(1), arg, ": expected shape [", num(input.size(1)), "], got ",
              dims(t.sizes()));
  check_same_device(t, input, arg);
  check_contiguous(t, arg);
}

// mean / rstd: float32 [M] on the input's device.
void check_stat(const at::Tensor& t, const at::Tensor& input, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == input.size(0), arg, ": expected shape [", num(input.size(0)), "], got ",
              dims(t.sizes()));
  check_same_device(t, input, arg);
  check_contiguous(t, arg);
}

// grad_out, dx_add: the input's shape, dtype and device.
void check_like_input(const at::Tensor& t, const at::Tensor& input, const char* arg) {
  TORCH_CHECK(t.scalar_type() == input.scalar_type(), arg, ": expected dtype ", input.scalar_type(),
              " (the input's), got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == input.sizes(), arg, ": expected shape ", dims(input.sizes()), ", got ", dims(t.sizes()));
  check_same_device(t, input, arg);
  check_contiguous(t, arg);
}

void check_fp8_args(const at::Tensor& input, const std::optional<at::Tensor>& scale,
                    std::optional<at::ScalarType> fp8_dtype, const std::optional<at::Tensor>& amax,
                    const std::optional<at::Tensor>& scale_inv) {
  if (fp8_dtype.has_value()) {
    check_fp8_dtype(*fp8_dtype, "fp8_dtype");
    TORCH_CHECK(scale.has_value(), "scale: required when fp8_dtype is given");
  } else {
    TORCH_CHECK(!scale.has_value() && !scale_inv.has_value(),
                "fp8_dtype: scale and scale_inv are only taken with an FP8 output (fp8_dtype given)");
  }
  check_optional_scalar_f32(scale, input, "scale");
  check_optional_scalar_f32(amax, input, "amax");
  check_optional_scalar_f32(scale_inv, input, "scale_inv");
}

// Shared by both forward ops: checks, allocates out / mean (LayerNorm) / rstd, launches.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& input, const at::Tensor& weight,
                                                        const std::optional<at::Tensor>& bias, bool layernorm,
                                                        double eps, bool zero_centered_gamma,
                                                        const std::optional<at::Tensor>& scale,
                                                        std::optional<at::ScalarType> fp8_dtype,
                                                        const std::optional<at::Tensor>& amax,
                                                        const std::optional<at::Tensor>& scale_inv) {
  check_input(input);
  check_param(weight, input, "weight");
  if (bias.has_value()) {
    check_param(*bias, input, "bias");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), "bias: expected dtype ", weight.scalar_type(),
                " (the weight's), got ", bias->scalar_type());
  }
  check_fp8_args(input, scale, fp8_dtype, amax, scale_inv);
  const c10::cuda::CUDAGuard guard(input.device());

  const at::ScalarType out_dtype = fp8_dtype.value_or(input.scalar_type());
  at::Tensor out = at::empty_like(input, input.options().dtype(out_dtype));
  const auto stat_options = input.options().dtype(at::kFloat);
  at::Tensor mean = layernorm ? at::empty({input.size(0)}, stat_options) : at::empty({0}, stat_options);
  at::Tensor rstd = at::empty({input.size(0)}, stat_options);

  NormFwdParams p{};
  p.layernorm = layernorm;
  p.input = input.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.mean = layernorm ? mean.data_ptr<float>() : nullptr;
  p.rstd = rstd.data_ptr<float>();
  p.scale = fp8_dtype.has_value() ? scale->data_ptr<float>() : nullptr;
  p.amax = optional_ptr(amax);
  p.scale_inv = optional_ptr(scale_inv);
  p.rows = input.size(0);
  p.cols = input.size(1);
  p.eps = static_cast<float>(eps);
  p.gamma_offset = zero_centered_gamma ? 1.f : 0.f;
  p.input_dtype = to_dtype(input.scalar_type(), "input");
  p.weight_dtype = to_dtype(weight.scalar_type(), "weight");
  p.out_dtype = to_dtype(out_dtype, "fp8_dtype");
  launch_norm_fwd(p, current_stream());
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps,
    bool zero_centered_gamma, const std::optional<at::Tensor>& scale, std::optional<at::ScalarType> fp8_dtype,
    const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale_inv) {
  return norm_fwd(input, weight, bias, true, eps, zero_centered_gamma, scale, fp8_dtype, amax, scale_inv);
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& input, const at::Tensor& weight, double eps,
                                               bool zero_centered_gamma, const std::optional<at::Tensor>& scale,
                                               std::optional<at::ScalarType> fp8_dtype,
                                               const std::optional<at::Tensor>& amax,
                                               const std::optional<at::Tensor>& scale_inv) {
  auto [out, mean, rstd] = norm_fwd(input, weight, std::nullopt, false, eps, zero_centered_gamma, scale, fp8_dtype,
                                    amax, scale_inv);
  return {out, rstd};
}

// Shared by both backward ops: checks, allocates dx / dgamma / dbeta (LayerNorm) and the workspace, launches.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                        const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                                        const at::Tensor& weight, bool zero_centered_gamma,
                                                        const std::optional<at::Tensor>& dx_add) {
  check_input(input);
  check_like_input(grad_out, input, "grad_out");
  if (dx_add.has_value()) check_like_input(*dx_add, input, "dx_add");
  if (mean.has_value()) check_stat(*mean, input, "mean");
  check_stat(rstd, input, "rstd");
  check_param(weight, input, "weight");
  const c10::cuda::CUDAGuard guard(input.device());

  at::Tensor dx = at::empty_like(input);
  at::Tensor dgamma = at::empty_like(weight);
  at::Tensor dbeta = mean.has_value() ? at::empty_like(weight) : at::empty({0}, weight.options());

  NormBwdParams p{};
  p.layernorm = mean.has_value();
  p.grad_out = grad_out.data_ptr();
  p.input = input.data_ptr();
  p.mean = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  p.rstd = rstd.data_ptr<float>();
  p.weight = weight.data_ptr();
  p.dx = dx.data_ptr();
  p.dx_add = dx_add.has_value() ? dx_add->data_ptr() : nullptr;
  p.dgamma = dgamma.data_ptr();
  p.dbeta = mean.has_value() ? dbeta.data_ptr() : nullptr;
  p.rows = input.size(0);
  p.cols = input.size(1);
  p.gamma_offset = zero_centered_gamma ? 1.f : 0.f;
  p.input_dtype = to_dtype(input.scalar_type(), "input");
  p.weight_dtype = to_dtype(weight.scalar_type(), "weight");
  at::Tensor workspace = at::empty({norm_bwd_workspace_size(p)}, input.options().dtype(at::kFloat));
  launch_norm_bwd(p, workspace.data_ptr<float>(), current_stream());
  return {dx, dgamma, dbeta};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                             const at::Tensor& mean, const at::Tensor& rstd,
                                                             const at::Tensor& weight, bool zero_centered_gamma,
                                                             const std::optional<at::Tensor>& dx_add) {
  return norm_bwd(grad_out, input, mean, rstd, weight, zero_centered_gamma, dx_add);
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma, const std::optional<at::Tensor>& dx_add) {
  auto [dx, dgamma, dbeta] = norm_bwd(grad_out, input, std::nullopt, rstd, weight, zero_centered_gamma, dx_add);
  return {dx, dgamma};
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("layernorm_fwd", &tfp8::layernorm_fwd);
  m.impl("layernorm_bwd", &tfp8::layernorm_bwd);
  m.impl("rmsnorm_fwd", &tfp8::rmsnorm_fwd);
  m.impl("rmsnorm_bwd", &tfp8::rmsnorm_bwd);
}
