// delayed_scaling_update: one launch for a table of (history, scale, scale_inv) tensors, one block per table entry
// (the update of one entry: csrc/scaling_update.cuh).
#include <algorithm>

#include "scaling.h"
#include "scaling_update.cuh"

namespace tfp8 {
namespace {

constexpr int kThreads = kScalingUpdateThreads;

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const ScalingUpdateTable table, float fp8_max, float pow2_margin, bool use_max) {
  const int entry = blockIdx.x;
  update_scaling_entry(table.history[entry], table.scale[entry], table.scale_inv[entry], table.history_len[entry],
                       table.slots[entry], fp8_max, pow2_margin, use_max);
}

}  // namespace

void launch_delayed_scaling_update(const ScalingUpdateTable& table, float fp8_max, float pow2_margin, bool use_max,
                                   cudaStream_t stream) {
  if (table.count == 0) return;
  delayed_scaling_update_kernel<<<table.count, kThreads, 0, stream>>>(table, fp8_max, pow2_margin, use_max);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
