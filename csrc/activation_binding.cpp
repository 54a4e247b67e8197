// CUDA kernels of activation_fwd(_keep_input), activation_bwd and dact_cast_transpose(_kept_input) (contracts:
// csrc/ops.cpp): argument checks,
// output allocation, launch on the current stream.
#include <torch/library.h>

#include "activation.h"
#include "common.h"

namespace tfp8 {
namespace {

Activation parse_activation(c10::string_view name) {
  if (name == "gelu") return Activation::kGelu;
  if (name == "relu") return Activation::kRelu;
  if (name == "swiglu") return Activation::kSwiglu;
  TORCH_CHECK(false, "activation: expected one of ('gelu', 'relu', 'swiglu'), got '", name, "'");
}

int64_t out_features(Activation act, int64_t in_features) {
  return act == Activation::kSwiglu ? in_features / 2 : in_features;
}

void check_input(const at::Tensor& input, Activation act) {
  check_cuda(input, "input");
  check_high_precision(input, "input");
  check_contiguous(input, "input");
  TORCH_CHECK(input.dim() >= 1, "input: expected at least one dimension, got shape ", dims(input.sizes()));
  TORCH_CHECK(act != Activation::kSwiglu || input.size(-1) % 2 == 0,
              "input: swiglu expects an even last dimension [..., 2F], got shape ", dims(input.sizes()));
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& input, Activation act) {
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(), "grad_out: expected dtype ", input.scalar_type(),
              " (input's), got ", grad_out.scalar_type());
  check_same_device(grad_out, input, "grad_out");
  check_contiguous(grad_out, "grad_out");
  std::vector<int64_t> expected = input.sizes().vec();
  expected.back() = out_features(act, expected.back());
  TORCH_CHECK(grad_out.sizes() == expected, "grad_out: expected shape ", dims(expected), " for input ",
              dims(input.sizes()), ", got ", dims(grad_out.sizes()));
}

// The FP8 arguments: a scale is required, amax and scale_inv are optional; none of them without fp8_dtype.
void check_fp8_arguments(const at::Tensor& input, const std::optional<at::Tensor>& scale,
                         std::optional<at::ScalarType> fp8_dtype, const std::optional<at::Tensor>& amax,
                         const std::optional<at::Tensor>& scale_inv) {
  if (!fp8_dtype.has_value()) {
    TORCH_CHECK(!scale.has_value(), "scale: given without fp8_dtype (only an FP8 output takes it)");
    TORCH_CHECK(!amax.has_value(), "amax: given without fp8_dtype (only an FP8 output takes it)");
    TORCH_CHECK(!scale_inv.has_value(), "scale_inv: given without fp8_dtype (only an FP8 output takes it)");
    return;
  }
  check_fp8_dtype(*fp8_dtype, "fp8_dtype");
  TORCH_CHECK(scale.has_value(), "scale: required when fp8_dtype is given");
  check_scalar_f32(*scale, input, "scale");
  check_optional_scalar_f32(amax, input, "amax");
  check_optional_scalar_f32(scale_inv, input, "scale_inv");
}

at::Tensor activation_fwd(const at::Tensor& input, c10::string_view activation, const std::optional<at::Tensor>& scale,
                          std::optional<at::ScalarType> fp8_dtype, const std::optional<at::Tensor>& amax,
                          const std::optional<at::Tensor>& scale_inv) {
  const Activation act = parse_activation(activation);
  check_input(input, act);
  check_fp8_arguments(input, scale, fp8_dtype, amax, scale_inv);
  const c10::cuda::CUDAGuard guard(input.device());
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = out_features(act, out_shape.back());
  at::Tensor out = at::empty(out_shape, input.options().dtype(fp8_dtype.value_or(input.scalar_type())));
  launch_activation_fwd(input.data_ptr(), to_dtype(input.scalar_type(), "input"), out.data_ptr(),
                        to_dtype(out.scalar_type(), "fp8_dtype"), out.numel(), out_shape.back(), act,
                        optional_ptr(scale), optional_ptr(amax), optional_ptr(scale_inv), current_stream());
  return out;
}

at::Tensor activation_bwd(const at::Tensor& grad_out, const at::Tensor& input, c10::string_view activation) {
  const Activation act = parse_activation(activation);
  check_input(input, act);
  check_grad_out(grad_out, input, act);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor grad_in = at::empty_like(input);
  launch_activation_bwd(grad_out.data_ptr(), input.data_ptr(), grad_in.data_ptr(),
                        to_dtype(input.scalar_type(), "input"), grad_out.numel(), grad_out.size(-1), act,
                        current_stream());
  return grad_in;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dact_cast_transpose(const at::Tensor& grad_out, const at::Tensor& input,
                                                                   c10::string_view activation, const at::Tensor& scale,
                                                                   at::ScalarType fp8_dtype,
                                                                   const std::optional<at::Tensor>& amax,
                                                                   const std::optional<at::Tensor>& scale_inv,
                                                                   bool compute_dbias, bool transpose) {
  const Activation act = parse_activation(activation);
  check_input(input, act);
  TORCH_CHECK(input.dim() == 2, "input: expected a 2-D tensor [M, F_in], got shape ", dims(input.sizes()));
  check_grad_out(grad_out, input, act);
  check_fp8_arguments(input, scale, fp8_dtype, amax, scale_inv);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t rows = input.size(0), in_cols = input.size(1), out_cols = grad_out.size(1);
  at::Tensor q = at::empty({rows, in_cols}, input.options().dtype(fp8_dtype));
  at::Tensor qT = at::empty(transpose ? at::IntArrayRef{in_cols, rows} : at::IntArrayRef{0},
                            input.options().dtype(fp8_dtype));
  at::Tensor dbias = at::empty({compute_dbias ? in_cols : 0}, grad_out.options());
  if (rows == 0 || out_cols == 0) {  // nothing to cast: still refresh scale_inv, and the sums of no rows are 0
    if (scale_inv.has_value()) scale_inv->copy_(scale.reciprocal().reshape(scale_inv->sizes()));
    dbias.zero_();
    return {q, qT, dbias};
  }
  at::Tensor workspace;
  if (compute_dbias) {
    workspace = at::empty({dact_dbias_workspace_rows(rows), in_cols}, input.options().dtype(at::kFloat));
  }
  launch_dact_cast_transpose(grad_out.data_ptr(), input.data_ptr(), to_dtype(input.scalar_type(), "input"),
                             static_cast<uint8_t*>(q.data_ptr()),
                             transpose ? static_cast<uint8_t*>(qT.data_ptr()) : nullptr,
                             to_dtype(fp8_dtype, "fp8_dtype"), rows, out_cols, act, scale.data_ptr<float>(),
                             optional_ptr(amax), optional_ptr(scale_inv), compute_dbias ? dbias.data_ptr() : nullptr,
                             compute_dbias ? workspace.data_ptr<float>() : nullptr, current_stream());
  return {q, qT, dbias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> activation_fwd_keep_input(
    const at::Tensor& input, c10::string_view activation, const at::Tensor& scale, at::ScalarType fp8_dtype,
    const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale_inv) {
  const Activation act = parse_activation(activation);
  check_input(input, act);
  check_fp8_arguments(input, scale, fp8_dtype, amax, scale_inv);
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = out_features(act, out_shape.back());
  const int64_t out_elems = c10::multiply_integers(out_shape);
  TORCH_CHECK(activation_fwd_can_keep_input(to_dtype(input.scalar_type(), "input"), out_elems, out_shape.back()),
              "input: activation_fwd_keep_input needs a float16 or bfloat16 input whose output's last dim is a "
              "multiple of ",
              kKeepTile, ", got ", input.scalar_type(), " of shape ", dims(input.sizes()));
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(out_shape, input.options().dtype(fp8_dtype));
  at::Tensor kept = at::empty_like(input, input.options().dtype(at::kFloat8_e4m3fn));
  std::vector<int64_t> scale_shape = input.sizes().vec();
  scale_shape.back() /= kKeepTile;
  at::Tensor kept_scale_inv = at::empty(scale_shape, input.options().dtype(at::kFloat));
  if (out_elems == 0) {  // nothing to compute: still refresh scale_inv
    if (scale_inv.has_value()) scale_inv->copy_(scale.reciprocal().reshape(scale_inv->sizes()));
    return {out, kept, kept_scale_inv};
  }
  launch_activation_fwd_keep_input(input.data_ptr(), to_dtype(input.scalar_type(), "input"),
                                   static_cast<uint8_t*>(out.data_ptr()), to_dtype(fp8_dtype, "fp8_dtype"), out_elems,
                                   out_shape.back(), act, scale.data_ptr<float>(), optional_ptr(amax),
                                   optional_ptr(scale_inv), static_cast<uint8_t*>(kept.data_ptr()),
                                   kept_scale_inv.data_ptr<float>(), current_stream());
  return {out, kept, kept_scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dact_cast_transpose_kept_input(
    const at::Tensor& grad_out, const at::Tensor& kept_input, const at::Tensor& kept_scale_inv,
    c10::string_view activation, const at::Tensor& scale, at::ScalarType fp8_dtype,
    const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale_inv, bool compute_dbias,
    bool transpose) {
  const Activation act = parse_activation(activation);
  check_cuda(grad_out, "grad_out");
  check_high_precision(grad_out, "grad_out");
  check_contiguous(grad_out, "grad_out");
  TORCH_CHECK(kept_input.scalar_type() == at::kFloat8_e4m3fn && kept_input.dim() == 2,
              "kept_input: expected a 2-D float8_e4m3fn tensor [M, F_in] (activation_fwd_keep_input's), got ",
              kept_input.scalar_type(), " of shape ", dims(kept_input.sizes()));
  check_same_device(kept_input, grad_out, "kept_input");
  check_contiguous(kept_input, "kept_input");
  const int64_t rows = kept_input.size(0), in_cols = kept_input.size(1);
  TORCH_CHECK(in_cols % kKeepTile == 0 && (act != Activation::kSwiglu || in_cols % 2 == 0),
              "kept_input: expected a last dim that is a multiple of ", kKeepTile, ", got shape ",
              dims(kept_input.sizes()));
  TORCH_CHECK(kept_scale_inv.scalar_type() == at::kFloat && kept_scale_inv.dim() == 2 &&
                  kept_scale_inv.size(0) == rows && kept_scale_inv.size(1) == in_cols / kKeepTile,
              "kept_scale_inv: expected float32 [", rows, ", ", in_cols / kKeepTile, "], got ",
              kept_scale_inv.scalar_type(), " of shape ", dims(kept_scale_inv.sizes()));
  check_same_device(kept_scale_inv, grad_out, "kept_scale_inv");
  check_contiguous(kept_scale_inv, "kept_scale_inv");
  const int64_t out_cols = out_features(act, in_cols);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == rows && grad_out.size(1) == out_cols,
              "grad_out: expected shape [", rows, ", ", out_cols, "] for kept_input ", dims(kept_input.sizes()),
              ", got ", dims(grad_out.sizes()));
  check_fp8_arguments(grad_out, scale, fp8_dtype, amax, scale_inv);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  at::Tensor q = at::empty({rows, in_cols}, grad_out.options().dtype(fp8_dtype));
  at::Tensor qT = at::empty(transpose ? at::IntArrayRef{in_cols, rows} : at::IntArrayRef{0},
                            grad_out.options().dtype(fp8_dtype));
  at::Tensor dbias = at::empty({compute_dbias ? in_cols : 0}, grad_out.options());
  if (rows == 0 || out_cols == 0) {
    if (scale_inv.has_value()) scale_inv->copy_(scale.reciprocal().reshape(scale_inv->sizes()));
    dbias.zero_();
    return {q, qT, dbias};
  }
  at::Tensor workspace;
  if (compute_dbias) {
    workspace = at::empty({dact_dbias_workspace_rows(rows), in_cols}, grad_out.options().dtype(at::kFloat));
  }
  launch_dact_cast_transpose(
      grad_out.data_ptr(), nullptr, to_dtype(grad_out.scalar_type(), "grad_out"), static_cast<uint8_t*>(q.data_ptr()),
      transpose ? static_cast<uint8_t*>(qT.data_ptr()) : nullptr, to_dtype(fp8_dtype, "fp8_dtype"), rows, out_cols, act,
      scale.data_ptr<float>(), optional_ptr(amax), optional_ptr(scale_inv), compute_dbias ? dbias.data_ptr() : nullptr,
      compute_dbias ? workspace.data_ptr<float>() : nullptr, current_stream(),
      static_cast<const uint8_t*>(kept_input.data_ptr()), kept_scale_inv.data_ptr<float>());
  return {q, qT, dbias};
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("activation_fwd_keep_input", &tfp8::activation_fwd_keep_input);
  m.impl("dact_cast_transpose_kept_input", &tfp8::dact_cast_transpose_kept_input);
  m.impl("activation_fwd", &tfp8::activation_fwd);
  m.impl("activation_bwd", &tfp8::activation_bwd);
  m.impl("dact_cast_transpose", &tfp8::dact_cast_transpose);
}
