// CUDA kernel of delayed_scaling_update (contract: csrc/ops.cpp): checks every tensor of the three lists, then fills
// tables of pointers and launches once per ScalingUpdateTable::kCapacity tensors. No host synchronisation, no
// device allocation.
#include <cmath>
#include <limits>
#include <string>

#include <torch/library.h>

#include "common.h"
#include "scaling.h"

namespace tfp8 {
namespace {

// Checks list[index]: float32, expected_shape, contiguous, on device. Messages name it "list[index]"; TORCH_CHECK
// formats them only on failure, so a passing check builds no string.
void check_slot_tensor(const at::Tensor& t, at::IntArrayRef expected_shape, const at::Device& device, const char* list,
                       size_t index) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, list, "[", num(index), "]: expected a float32 tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == expected_shape, list, "[", num(index), "]: expected shape ", dims(expected_shape), ", got ",
              dims(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), list, "[", num(index), "]: expected a contiguous tensor (got strides ",
              dims(t.strides()), ")");
  TORCH_CHECK(t.device() == device, list, "[", num(index), "]: expected a tensor on ", device, ", got one on ",
              t.device());
}

void check_arguments(at::TensorList amax_histories, at::TensorList scales, at::TensorList scale_invs, double fp8_max,
                     c10::string_view amax_compute_algo) {
  TORCH_CHECK(amax_compute_algo == "max" || amax_compute_algo == "most_recent",
              "amax_compute_algo: expected one of ('max', 'most_recent'), got '", amax_compute_algo, "'");
  TORCH_CHECK(fp8_max > 0, "fp8_max: expected a positive number, got ", std::to_string(fp8_max));
  const size_t n = amax_histories.size();
  TORCH_CHECK(scales.size() == n, "scales: expected ", num(n), " tensors (one per amax history), got ",
              num(scales.size()));
  TORCH_CHECK(scale_invs.size() == n, "scale_invs: expected ", num(n), " tensors (one per amax history), got ",
              num(scale_invs.size()));
  if (n == 0) return;
  check_cuda(amax_histories[0], "amax_histories[0]");
  const at::Device device = amax_histories[0].device();
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& history = amax_histories[i];
    TORCH_CHECK(history.dim() == 2 && history.size(0) >= 1 && history.size(0) <= kMaxDim && history.size(1) <= kMaxDim,
                "amax_histories[", num(i), "]: expected shape [H, n] with 1 <= H, n < 2**31, got ",
                dims(history.sizes()));
    const int64_t slots = history.size(1);
    check_slot_tensor(history, history.sizes(), device, "amax_histories", i);
    check_slot_tensor(scales[i], {slots}, device, "scales", i);
    check_slot_tensor(scale_invs[i], {slots}, device, "scale_invs", i);
  }
}

void delayed_scaling_update(at::TensorList amax_histories, at::TensorList scales, at::TensorList scale_invs,
                            double fp8_max, double margin, c10::string_view amax_compute_algo) {
  check_arguments(amax_histories, scales, scale_invs, fp8_max, amax_compute_algo);
  if (amax_histories.empty()) return;
  const c10::cuda::CUDAGuard guard(amax_histories[0].device());
  const cudaStream_t stream = current_stream();
  // float32 operands as the CPU reference rounds them: fp8_max, and 2**margin computed in double.
  const float fp8_max_f = static_cast<float>(fp8_max), pow2_margin = static_cast<float>(std::pow(2.0, margin));
  const bool use_max = amax_compute_algo == "max";
  ScalingUpdateTable table;
  table.count = 0;
  for (size_t i = 0; i < amax_histories.size(); ++i) {
    const int32_t slots = static_cast<int32_t>(amax_histories[i].size(1));
    if (slots == 0) continue;
    const int e = table.count++;
    table.history[e] = amax_histories[i].data_ptr<float>();
    table.scale[e] = scales[i].data_ptr<float>();
    table.scale_inv[e] = scale_invs[i].data_ptr<float>();
    table.history_len[e] = static_cast<int32_t>(amax_histories[i].size(0));
    table.slots[e] = slots;
    if (table.count == ScalingUpdateTable::kCapacity) {
      launch_delayed_scaling_update(table, fp8_max_f, pow2_margin, use_max, stream);
      table.count = 0;
    }
  }
  launch_delayed_scaling_update(table, fp8_max_f, pow2_margin, use_max, stream);
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("delayed_scaling_update", &tfp8::delayed_scaling_update); }
