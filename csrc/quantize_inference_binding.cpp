// CUDA kernel of inference_cast (contract: csrc/ops.cpp; kernel: csrc/quantize_inference.cu): argument checks, the
// output's allocation, one launch on the current stream. While the stream is being captured into a CUDA graph, and
// for an empty input, the op sequence of the contract runs instead (a cooperative launch is not captured everywhere;
// an empty input launches nothing).
#include <ATen/cuda/EmptyTensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "common.h"
#include "library_op.h"
#include "linear_inference.h"
#include "quantize_inference.h"

namespace tfp8 {
namespace {

using OptTensor = std::optional<at::Tensor>;
using ScalingUpdate = void(at::TensorList, at::TensorList, at::TensorList, double, double, c10::string_view);
using ComputeAmax = void(const at::Tensor&, const at::Tensor&);
using CastTranspose = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::ScalarType, bool,
                                                         bool, const OptTensor&, const OptTensor&);

void check_state_tensor(const at::Tensor& t, at::IntArrayRef shape, const at::Tensor& x, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == shape && t.is_contiguous(), arg,
              ": expected a contiguous float32 tensor of shape ", dims(shape), ", got ", t.scalar_type(), " of shape ",
              dims(t.sizes()), t.is_contiguous() ? "" : " (not contiguous)");
  check_same_device(t, x, arg);
}

// The delayed update's state: all four tensors or none; history [H, slots], the others [slots] and backup [4, slots].
bool check_state(const at::Tensor& x, bool current_scaling, const OptTensor& history, const OptTensor& state_scale,
                 const OptTensor& state_scale_inv, const OptTensor& backup, c10::string_view amax_compute_algo) {
  const int given = history.has_value() + state_scale.has_value() + state_scale_inv.has_value() + backup.has_value();
  TORCH_CHECK(given == 0 || given == 4,
              "history, state_scale, state_scale_inv, backup: expected all four (a delayed update) or none, got ",
              num(given));
  if (given == 0) return false;
  TORCH_CHECK(!current_scaling, "history: the fused update is for delayed scaling (current_scaling=False)");
  TORCH_CHECK(amax_compute_algo == "max" || amax_compute_algo == "most_recent",
              "amax_compute_algo: expected one of ('max', 'most_recent'), got '", amax_compute_algo, "'");
  TORCH_CHECK(history->dim() == 2 && history->size(0) >= 1 && history->size(1) >= 1 &&
                  history->size(0) < (int64_t{1} << 31) && history->size(1) < (int64_t{1} << 31),
              "history: expected shape [H, slots] with 1 <= H, slots < 2**31, got ", dims(history->sizes()));
  const int64_t slots = history->size(1);
  check_state_tensor(*history, history->sizes(), x, "history");
  check_state_tensor(*state_scale, {slots}, x, "state_scale");
  check_state_tensor(*state_scale_inv, {slots}, x, "state_scale_inv");
  check_state_tensor(*backup, {4, slots}, x, "backup");
  return true;
}

// The contract's op sequence (library ops through the dispatcher): x as [-1, last dim] -> q of x's shape.
at::Tensor op_sequence(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype, const at::Tensor& amax,
                       const at::Tensor& scale_inv, bool current_scaling, bool update, const OptTensor& history,
                       const OptTensor& state_scale, const OptTensor& state_scale_inv, const OptTensor& backup,
                       double fp8_max, double margin, c10::string_view amax_compute_algo) {
  static const auto scaling_update = library_op<ScalingUpdate>("transformer_fp8::delayed_scaling_update");
  static const auto compute_amax = library_op<ComputeAmax>("transformer_fp8::compute_amax");
  static const auto cast = library_op<CastTranspose>("transformer_fp8::cast_transpose");
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  if (current_scaling) {
    compute_amax.call(x2, amax);
    scaling_update.call({amax.view({1, 1})}, {scale.view({1})}, {scale_inv.view({1})}, fp8_max, 0.0, "most_recent");
  }
  const OptTensor cast_amax = current_scaling ? OptTensor() : OptTensor(amax);
  const at::Tensor q = std::get<0>(cast.call(x2, scale, fp8_dtype, true, false, cast_amax, scale_inv));
  if (update) {
    backup->select(0, 0).copy_(history->select(0, 0));
    backup->select(0, 1).copy_(history->select(0, history->size(0) - 1));
    backup->select(0, 2).copy_(*state_scale);
    backup->select(0, 3).copy_(*state_scale_inv);
    scaling_update.call({*history}, {*state_scale}, {*state_scale_inv}, fp8_max, margin, amax_compute_algo);
  }
  return q.view(x.sizes());
}

// Whether the op sequence must stand in for the kernel because `stream` is being captured. TFP8_INFERENCE_CAPTURE=
// kernel captures the kernel itself (a cooperative launch: for trying where the driver captures those).
bool sequence_for_capture(cudaStream_t stream) {
  static const bool capture_kernel = [] {
    const char* value = std::getenv("TFP8_INFERENCE_CAPTURE");
    return value != nullptr && std::string(value) == "kernel";
  }();
  if (capture_kernel) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TFP8_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

at::Tensor inference_cast(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype,
                          const at::Tensor& amax, const at::Tensor& scale_inv, bool current_scaling, double fp8_max,
                          const OptTensor& history, const OptTensor& state_scale, const OptTensor& state_scale_inv,
                          const OptTensor& backup, double margin, c10::string_view amax_compute_algo) {
  check_cuda(x, "x");
  check_high_precision(x, "x");
  check_contiguous(x, "x");
  TORCH_CHECK(x.dim() >= 1, "x: expected a tensor with at least one dim, got a 0-dim tensor");
  check_fp8_dtype(fp8_dtype, "fp8_dtype");
  check_scalar_f32(scale, x, "scale");
  check_scalar_f32(amax, x, "amax");
  check_scalar_f32(scale_inv, x, "scale_inv");
  TORCH_CHECK(fp8_max > 0 && std::isfinite(fp8_max), "fp8_max: expected a positive finite number, got ",
              std::to_string(fp8_max));
  const bool update = check_state(x, current_scaling, history, state_scale, state_scale_inv, backup, amax_compute_algo);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream();
  if (x.numel() == 0 || sequence_for_capture(stream)) {
    return op_sequence(x, scale, fp8_dtype, amax, scale_inv, current_scaling, update, history, state_scale,
                       state_scale_inv, backup, fp8_max, margin, amax_compute_algo);
  }
  // (the CUDA allocation at::empty's CUDA kernel makes, without its dispatcher call: a small layer's inference is
  // host-bound)
  at::Tensor q = at::detail::empty_cuda(x.sizes(), fp8_dtype, x.device(), std::nullopt);
  InferenceCastArgs args{x.data_ptr(),
                         static_cast<uint8_t*>(q.data_ptr()),
                         x.numel(),
                         to_dtype(x.scalar_type(), "x"),
                         to_dtype(fp8_dtype, "fp8_dtype"),
                         scale.data_ptr<float>(),
                         amax.data_ptr<float>(),
                         scale_inv.data_ptr<float>(),
                         current_scaling,
                         static_cast<float>(fp8_max)};
  if (update) {
    args.history = history->data_ptr<float>();
    args.state_scale = state_scale->data_ptr<float>();
    args.state_scale_inv = state_scale_inv->data_ptr<float>();
    args.backup = backup->data_ptr<float>();
    args.history_len = static_cast<int32_t>(history->size(0));
    args.slots = static_cast<int32_t>(history->size(1));
    args.pow2_margin = static_cast<float>(std::pow(2.0, margin));  // (as delayed_scaling_update rounds it)
    args.use_max = amax_compute_algo == "max";
  }
  launch_inference_cast(args, stream);
  return q;
}

// linear_inference's direct entry (csrc/linear_inference.h), filled in as this object loads.
const bool entry_filled = [] {
  inference_cast_cuda_entry() = &inference_cast;
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("inference_cast", &inference_cast); }

}  // namespace tfp8
