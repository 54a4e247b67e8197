// delayed_scaling_update: one launch for a table of (history, scale, scale_inv) tensors. blockIdx.y picks the
// table entry, threads of blockIdx.x stride over its slots; each thread owns one column of its history, so the roll is
// race-free in place.
#include <algorithm>

#include "scaling.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxBlocksPerEntry = 64;

// max with a NaN winning (once running is NaN it stays NaN), as torch's amax over the history.
__device__ __forceinline__ float max_nan(float running, float v) { return (v > running || v != v) ? v : running; }

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const ScalingUpdateTable table, float fp8_max, float pow2_margin, bool use_max) {
  const int entry = blockIdx.y;
  const int64_t slots = table.slots[entry];
  const int history_len = table.history_len[entry];
  float* history = table.history[entry];
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < slots;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float raw = history[j];
    const float newest = isfinite(raw) ? raw : 0.0f;
    float amax = newest;
    if (use_max && history_len > 1) amax = max_nan(amax, history[(history_len - 1) * slots + j]);
    for (int row = history_len - 1; row >= 1; --row) {  // row k-1 -> row k, the last row dropped
      const float v = row == 1 ? newest : history[(row - 1) * slots + j];
      if (use_max && row >= 2) amax = max_nan(amax, v);
      history[row * slots + j] = v;
    }
    history[j] = 0.0f;
    if (amax > 0.0f && isfinite(amax)) {
      const float s = fp8_max / amax / pow2_margin;
      if (isfinite(s)) {
        table.scale[entry][j] = s;
        table.scale_inv[entry][j] = 1.0f / s;
      }
    }
  }
}

}  // namespace

void launch_delayed_scaling_update(const ScalingUpdateTable& table, float fp8_max, float pow2_margin, bool use_max,
                                   cudaStream_t stream) {
  if (table.count == 0) return;
  const int blocks_per_entry = std::min(kMaxBlocksPerEntry, (table.max_slots + kThreads - 1) / kThreads);
  const dim3 grid(std::max(1, blocks_per_entry), table.count);
  delayed_scaling_update_kernel<<<grid, kThreads, 0, stream>>>(table, fp8_max, pow2_margin, use_max);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
