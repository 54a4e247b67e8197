// delayed_scaling_update: one launch for a table of (history, scale, scale_inv) tensors, one block per table entry.
// Phase 1: a warp per slot reads its history column (coalesced across rows in flight) and sets scale / scale_inv.
// Phase 2: the block shifts the flat [H * slots] history down by `slots` elements (row k -> row k+1), from the
// bottom up in chunks of blockDim with a barrier between each chunk's reads and writes, so it is race-free in place.
#include <algorithm>

#include "scaling.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// max with a NaN winning (once running is NaN it stays NaN), as torch's amax over the history.
__device__ __forceinline__ float max_nan(float running, float v) { return (v > running || v != v) ? v : running; }

__device__ __forceinline__ float sanitize_newest(float raw) { return isfinite(raw) ? raw : 0.0f; }

__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const ScalingUpdateTable table, float fp8_max, float pow2_margin, bool use_max) {
  const int entry = blockIdx.x;
  const int slots = table.slots[entry];
  const int history_len = table.history_len[entry];
  float* history = table.history[entry];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int j = warp; j < slots; j += kWarps) {
    float amax = lane == 0 ? sanitize_newest(history[j]) : 0.0f;
    if (use_max) {
      for (int row = 1 + lane; row < history_len; row += 32) amax = max_nan(amax, history[row * slots + j]);
      for (int off = 16; off > 0; off /= 2) amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    if (lane == 0 && amax > 0.0f && isfinite(amax)) {
      const float s = fp8_max / amax / pow2_margin;
      if (isfinite(s)) {
        table.scale[entry][j] = s;
        table.scale_inv[entry][j] = 1.0f / s;
      }
    }
  }
  __syncthreads();  // every read of phase 1 happens before the shift writes

  const int64_t total = static_cast<int64_t>(history_len) * slots;
  for (int64_t chunk = (total - 1) / kThreads * kThreads; chunk >= 0; chunk -= kThreads) {
    const int64_t k = chunk + threadIdx.x;
    float v = 0.0f;
    if (k < total && k >= slots) v = k < 2 * slots ? sanitize_newest(history[k - slots]) : history[k - slots];
    __syncthreads();
    if (k < total) history[k] = v;
  }
}

}  // namespace

void launch_delayed_scaling_update(const ScalingUpdateTable& table, float fp8_max, float pow2_margin, bool use_max,
                                   cudaStream_t stream) {
  if (table.count == 0) return;
  delayed_scaling_update_kernel<<<table.count, kThreads, 0, stream>>>(table, fp8_max, pow2_margin, use_max);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
