// CUDA kernel of the loss family for torch: argument checks, output allocation, launch on the current stream.
// Contract: csrc/ops.cpp; kernel: csrc/loss.cu.
#include <torch/library.h>

#include <optional>

#include "common.h"
#include "loss.h"

namespace tfp8 {
namespace {

std::tuple<at::Tensor, at::Tensor> cross_entropy_chunk(const at::Tensor& logits, const at::Tensor& targets,
                                                       int64_t ignore_index, std::optional<at::ScalarType> grad_dtype) {
  check_cuda(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "logits: expected a float32 tensor, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2, "logits: expected a 2-D tensor [rows, classes], got shape ", dims(logits.sizes()));
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, "logits: expected contiguous rows, got strides ",
              dims(logits.strides()));
  check_same_device(targets, logits, "targets");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "targets: expected an int64 tensor, got ", targets.scalar_type());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "targets: expected shape (", num(logits.size(0)),
              ",), got ", dims(targets.sizes()));
  TORCH_CHECK(logits.size(0) == 0 || logits.size(1) > 0, "logits: expected at least one class, got shape ",
              dims(logits.sizes()));
  if (grad_dtype.has_value()) {
    const auto g = *grad_dtype;
    TORCH_CHECK(g == at::kFloat || g == at::kHalf || g == at::kBFloat16,
                "grad_dtype: expected float32, float16, bfloat16 or None, got ", g);
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor target_rows = targets.contiguous();
  at::Tensor loss_rows = at::empty({logits.size(0)}, logits.options());
  at::Tensor dlogits = grad_dtype.has_value() ? at::empty(logits.sizes(), logits.options().dtype(*grad_dtype))
                                              : at::empty({0}, logits.options());
  launch_cross_entropy_chunk(
      logits.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0), target_rows.data_ptr<int64_t>(),
      ignore_index, loss_rows.data_ptr<float>(), grad_dtype.has_value() ? dlogits.data_ptr() : nullptr,
      grad_dtype.has_value() ? to_dtype(*grad_dtype, "grad_dtype") : DType::kFloat32, current_stream());
  return {loss_rows, dlogits};
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("cross_entropy_chunk", &tfp8::cross_entropy_chunk); }
