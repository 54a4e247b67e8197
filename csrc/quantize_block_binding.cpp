// CUDA kernels of block_cast and block_dequantize (contracts in csrc/ops.cpp, layouts in
// transformer_fp8/quantization/block.py): argument checks, output allocation, launch on the current stream.
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "activation.h"
#include "common.h"
#include "quantize.h"
#include "quantize_block_fused.h"

namespace tfp8 {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t pad4(int64_t a) { return (a + 3) / 4 * 4; }

void check_block_dim(int64_t block_dim) {
  TORCH_CHECK(block_dim == 1 || block_dim == 2, "block_dim: expected 1 (1x128 tiles) or 2 (128x128 blocks), got ",
              std::to_string(block_dim));
}

// Shape of the scale_inv of FP8 data [rows, cols] cast with block_dim (the transposed copy: call with its shape).
std::vector<int64_t> scale_shape(int64_t rows, int64_t cols, int64_t block_dim) {
  if (block_dim == 1) return {cdiv(cols, kBlockLen), pad4(rows)};
  return {cdiv(rows, kBlockLen), pad4(cdiv(cols, kBlockLen))};
}

using BlockCastResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_cast_input(const at::Tensor& input, at::ScalarType fp8_dtype, double amax_epsilon) {
  check_cuda(input, "input");
  check_high_precision(input, "input");
  TORCH_CHECK(input.dim() == 2, "input: expected a 2-D tensor [M, K], got shape ", dims(input.sizes()));
  check_contiguous(input, "input");
  check_fp8_dtype(fp8_dtype, "fp8_dtype");
  TORCH_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0, "amax_epsilon: expected a finite number >= 0, got ",
              std::to_string(amax_epsilon));
}

// block_cast's outputs for cast values [m, k] made from input (on input's device), and the launch arguments that
// point at them (x = input; the activation unset).
struct BlockCastOutputs {
  at::Tensor q, scale_inv, qt, scale_inv_t;
  BlockCastArgs args;
  BlockCastResult result() const { return {q, scale_inv, qt, scale_inv_t}; }
};

BlockCastOutputs block_cast_outputs(const at::Tensor& input, int64_t m, int64_t k, at::ScalarType fp8_dtype,
                                    int64_t block_dim, bool rowwise, bool transpose, double amax_epsilon,
                                    bool power_2_scale) {
  const auto fp8 = input.options().dtype(fp8_dtype), f32 = input.options().dtype(at::kFloat);
  BlockCastOutputs out;
  out.q = rowwise ? at::empty({m, k}, fp8) : at::empty({0}, fp8);
  out.scale_inv = rowwise ? at::empty(scale_shape(m, k, block_dim), f32) : at::empty({0}, f32);
  out.qt = transpose ? at::empty({k, m}, fp8) : at::empty({0}, fp8);
  out.scale_inv_t = transpose ? at::empty(scale_shape(k, m, block_dim), f32) : at::empty({0}, f32);
  BlockCastArgs& args = out.args;
  args = BlockCastArgs{};
  args.x = input.data_ptr();
  args.m = m;
  args.k = k;
  args.in_type = to_dtype(input.scalar_type(), "input");
  args.fp8_type = to_dtype(fp8_dtype, "fp8_dtype");
  args.two_d = block_dim == 2;
  args.amax_epsilon = static_cast<float>(amax_epsilon);
  args.power_2_scale = power_2_scale;
  if (rowwise) {
    args.q = static_cast<uint8_t*>(out.q.data_ptr());
    args.scale_inv = out.scale_inv.data_ptr<float>();
    args.scale_ld = out.scale_inv.size(1);
  }
  if (transpose) {
    args.qt = static_cast<uint8_t*>(out.qt.data_ptr());
    args.scale_inv_t = out.scale_inv_t.data_ptr<float>();
    args.scale_t_ld = out.scale_inv_t.size(1);
  }
  return out;
}

// Casts input (or act(input): activation >= 0, an Activation) whose cast values are [m, k], as block_cast's contract
// says.
BlockCastResult cast_blocks(const at::Tensor& input, int64_t m, int64_t k, at::ScalarType fp8_dtype, int64_t block_dim,
                            bool rowwise, bool transpose, double amax_epsilon, bool power_2_scale, int activation) {
  const c10::cuda::CUDAGuard guard(input.device());
  BlockCastOutputs out = block_cast_outputs(input, m, k, fp8_dtype, block_dim, rowwise, transpose, amax_epsilon,
                                            power_2_scale);
  out.args.activation = activation;
  launch_block_cast(out.args, current_stream());
  return out.result();
}

BlockCastResult block_cast(const at::Tensor& input, at::ScalarType fp8_dtype, int64_t block_dim, bool rowwise,
                           bool transpose, double amax_epsilon, bool power_2_scale) {
  check_cast_input(input, fp8_dtype, amax_epsilon);
  check_block_dim(block_dim);
  return cast_blocks(input, input.size(0), input.size(1), fp8_dtype, block_dim, rowwise, transpose, amax_epsilon,
                     power_2_scale, -1);
}

int activation_of(c10::string_view name) {
  if (name == "gelu") return static_cast<int>(Activation::kGelu);
  if (name == "relu") return static_cast<int>(Activation::kRelu);
  if (name == "swiglu") return static_cast<int>(Activation::kSwiglu);
  TORCH_CHECK(false, "activation: expected one of 'gelu', 'relu', 'swiglu', got '", std::string(name), "'");
}

BlockCastResult block_activation_cast(const at::Tensor& input, c10::string_view activation, at::ScalarType fp8_dtype,
                                      bool rowwise, bool transpose, double amax_epsilon, bool power_2_scale) {
  const int act = activation_of(activation);
  check_cast_input(input, fp8_dtype, amax_epsilon);
  const bool gated = act == static_cast<int>(Activation::kSwiglu);
  TORCH_CHECK(!gated || input.size(1) % 2 == 0, "input: swiglu expects an even last dimension [M, 2F], got shape ",
              dims(input.sizes()));
  return cast_blocks(input, input.size(0), gated ? input.size(1) / 2 : input.size(1), fp8_dtype, 1, rowwise, transpose,
                     amax_epsilon, power_2_scale, act);
}

// --- the fused casts (quantize_block_fused.h) ---

using NormBlockCastResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// weight / bias of the norm: [K], the input's dtype or float32, contiguous, on its device.
void check_norm_param(const at::Tensor& t, const at::Tensor& input, const char* arg) {
  TORCH_CHECK(t.scalar_type() == input.scalar_type() || t.scalar_type() == at::kFloat, arg, ": expected dtype ",
              input.scalar_type(), " (the input's) or Float, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == input.size(1), arg, ": expected shape [", num(input.size(1)), "], got ",
              dims(t.sizes()));
  check_same_device(t, input, arg);
  check_contiguous(t, arg);
}

NormBlockCastResult norm_block_cast(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::string_view normalization, double eps,
                                    bool zero_centered_gamma, at::ScalarType fp8_dtype, bool rowwise, bool transpose,
                                    double amax_epsilon, bool power_2_scale) {
  const bool layernorm = normalization == "LayerNorm";
  TORCH_CHECK(layernorm || normalization == "RMSNorm", "normalization: expected 'LayerNorm' or 'RMSNorm', got '",
              std::string(normalization), "'");
  check_cast_input(input, fp8_dtype, amax_epsilon);
  TORCH_CHECK(input.size(1) > 0, "input: expected at least one column, got shape ", dims(input.sizes()));
  check_norm_param(weight, input, "weight");
  if (bias.has_value()) {
    TORCH_CHECK(layernorm, "bias: RMSNorm takes no bias");
    check_norm_param(*bias, input, "bias");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), "bias: expected dtype ", weight.scalar_type(),
                " (the weight's), got ", bias->scalar_type());
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "eps: expected a finite number >= 0, got ", std::to_string(eps));
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t m = input.size(0), k = input.size(1);
  BlockCastOutputs out = block_cast_outputs(input, m, k, fp8_dtype, 1, rowwise, transpose, amax_epsilon, power_2_scale);
  const auto f32 = input.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({layernorm ? m : 0}, f32), rstd = at::empty({m}, f32);
  NormBlockCastArgs args{};
  args.cast = out.args;
  args.layernorm = layernorm;
  args.weight = weight.data_ptr();
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.weight_type = to_dtype(weight.scalar_type(), "weight");
  args.eps = static_cast<float>(eps);
  args.gamma_offset = zero_centered_gamma ? 1.0f : 0.0f;
  args.mean = layernorm ? mean.data_ptr<float>() : nullptr;
  args.rstd = rstd.data_ptr<float>();
  launch_norm_block_cast(args, current_stream());  // (the statistics even when neither copy is asked for)
  return {out.q, out.scale_inv, out.qt, out.scale_inv_t, mean, rstd};
}

using DactBlockCastResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

DactBlockCastResult dact_block_cast(const at::Tensor& grad_out, const at::Tensor& input, c10::string_view activation,
                                    at::ScalarType fp8_dtype, bool rowwise, bool transpose, double amax_epsilon,
                                    bool power_2_scale, bool compute_dbias) {
  const int act = activation_of(activation);
  check_cast_input(input, fp8_dtype, amax_epsilon);
  const bool gated = act == static_cast<int>(Activation::kSwiglu);
  TORCH_CHECK(!gated || input.size(1) % 2 == 0, "input: swiglu expects an even last dimension [M, 2F], got shape ",
              dims(input.sizes()));
  check_cuda(grad_out, "grad_out");
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(), "grad_out: expected dtype ", input.scalar_type(),
              " (input's), got ", grad_out.scalar_type());
  const int64_t m = input.size(0), k = input.size(1), f = gated ? k / 2 : k;
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == m && grad_out.size(1) == f, "grad_out: expected shape ",
              dims({m, f}), " for input ", dims(input.sizes()), " and ", std::string(activation), ", got ",
              dims(grad_out.sizes()));
  check_same_device(grad_out, input, "grad_out");
  check_contiguous(grad_out, "grad_out");
  const c10::cuda::CUDAGuard guard(input.device());
  BlockCastOutputs out = block_cast_outputs(input, m, k, fp8_dtype, 1, rowwise, transpose, amax_epsilon, power_2_scale);
  DactBlockCastArgs args{};
  args.cast = out.args;
  args.cast.x = grad_out.data_ptr();
  args.act_input = input.data_ptr();
  args.activation = act;
  args.f = f;
  // dbias: per-128-row-tile column sums from the kernel, summed here in a fixed order (deterministic)
  at::Tensor partial_sums = compute_dbias ? at::empty({cdiv(m, kBlockLen), k}, input.options().dtype(at::kFloat))
                                          : at::Tensor();
  if (compute_dbias) args.cast.col_sums = partial_sums.data_ptr<float>();
  launch_dact_block_cast(args, current_stream());
  at::Tensor dbias = compute_dbias ? partial_sums.sum(0).to(grad_out.scalar_type())
                                   : at::empty({0}, grad_out.options());
  return {out.q, out.scale_inv, out.qt, out.scale_inv_t, dbias};
}

at::Tensor block_dequantize(const at::Tensor& input, const at::Tensor& scale_inv, int64_t block_dim,
                            at::ScalarType out_dtype) {
  check_cuda(input, "input");
  check_fp8_dtype(input.scalar_type(), "input");
  TORCH_CHECK(input.dim() == 2, "input: expected a 2-D tensor [M, K], got shape ", dims(input.sizes()));
  check_contiguous(input, "input");
  check_block_dim(block_dim);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
              "out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got ", out_dtype);
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat, "scale_inv: expected a float32 tensor, got ",
              scale_inv.scalar_type());
  check_same_device(scale_inv, input, "scale_inv");
  check_contiguous(scale_inv, "scale_inv");
  const int64_t m = input.size(0), k = input.size(1);
  const auto expected = scale_shape(m, k, block_dim);
  TORCH_CHECK(scale_inv.sizes() == at::IntArrayRef(expected), "scale_inv: expected shape ", dims(expected),
              " for input ", dims(input.sizes()), " with block_dim ", std::to_string(block_dim), ", got ",
              dims(scale_inv.sizes()));
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty({m, k}, input.options().dtype(out_dtype));
  launch_block_dequantize(static_cast<const uint8_t*>(input.data_ptr()), scale_inv.data_ptr<float>(), expected[1],
                          block_dim == 2, m, k, to_dtype(input.scalar_type(), "input"), out.data_ptr(),
                          to_dtype(out_dtype, "out_dtype"), current_stream());
  return out;
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("block_cast", &tfp8::block_cast);
  m.impl("block_activation_cast", &tfp8::block_activation_cast);
  m.impl("block_dequantize", &tfp8::block_dequantize);
  m.impl("norm_block_cast", &tfp8::norm_block_cast);
  m.impl("dact_block_cast", &tfp8::dact_block_cast);
}
