// The delayed-scaling update of one (history, scale, scale_inv) entry by one block of kScalingUpdateThreads threads,
// shared by delayed_scaling_update's kernel (csrc/scaling_update.cu) and the inference cast's fused update
// (csrc/quantize_inference.cu), so that both produce the same bits.
// Phase 1: a warp per slot reads its history column (coalesced across rows in flight) and sets scale / scale_inv.
// Phase 2: the block shifts the flat [H * slots] history down by `slots` elements (row k -> row k+1), from the
// bottom up in chunks of blockDim with a barrier between each chunk's reads and writes, so it is race-free in place.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

constexpr int kScalingUpdateThreads = 256;

#ifdef __CUDACC__
// max with a NaN winning (once running is NaN it stays NaN), as torch's amax over the history.
__device__ __forceinline__ float update_max_nan(float running, float v) {
  return (v > running || v != v) ? v : running;
}

__device__ __forceinline__ float sanitize_newest(float raw) { return isfinite(raw) ? raw : 0.0f; }

// Every thread of the block (kScalingUpdateThreads of them) must call it.
__device__ __forceinline__ void update_scaling_entry(float* history, float* scale, float* scale_inv, int history_len,
                                                     int slots, float fp8_max, float pow2_margin, bool use_max) {
  constexpr int kWarps = kScalingUpdateThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < slots; j += kWarps) {
    float amax = lane == 0 ? sanitize_newest(history[j]) : 0.0f;
    if (use_max) {
      for (int row = 1 + lane; row < history_len; row += 32) amax = update_max_nan(amax, history[row * slots + j]);
      for (int off = 16; off > 0; off /= 2) amax = update_max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    if (lane == 0 && amax > 0.0f && isfinite(amax)) {
      const float s = fp8_max / amax / pow2_margin;
      if (isfinite(s)) {
        scale[j] = s;
        scale_inv[j] = 1.0f / s;
      }
    }
  }
  __syncthreads();  // every read of phase 1 happens before the shift writes

  const int64_t total = static_cast<int64_t>(history_len) * slots;
  for (int64_t chunk = (total - 1) / kScalingUpdateThreads * kScalingUpdateThreads; chunk >= 0;
       chunk -= kScalingUpdateThreads) {
    const int64_t k = chunk + threadIdx.x;
    float v = 0.0f;
    if (k < total && k >= slots) v = k < 2 * slots ? sanitize_newest(history[k - slots]) : history[k - slots];
    __syncthreads();
    if (k < total) history[k] = v;
  }
}
#endif

}  // namespace tfp8
