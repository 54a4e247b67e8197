// Launcher of the inference cast (csrc/quantize_inference.cu): the input cast of an FP8-weight Linear's inference
// forward with its scaling bookkeeping in the same launch. Plain pointers, no torch.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// x (n contiguous elements of in_type) -> q (n bytes of fp8_type) = saturate(float(x) * scale), rounded to nearest
// even, as launch_quantize casts.
//   current scaling (current): amax (zero on entry) = max|x|; then, as delayed_scaling_update of [amax as [1, 1]]
//     with margin 0 and "most_recent": if amax is > 0 and finite and fp8_max / amax is finite, scale = that; the cast
//     uses the resulting scale; scale_inv = 1 / scale; amax = 0 again.
//   delayed scaling: the cast uses scale; amax = max(amax, max|x|); scale_inv = 1 / scale. With history (not null):
//     afterwards backup [4, slots] = (history row 0, history row history_len - 1, state_scale, state_scale_inv) as
//     they are after the cast, then the state (history [history_len, slots], state_scale and state_scale_inv
//     [slots]) is updated as delayed_scaling_update updates one entry (fp8_max, pow2_margin = 2**margin, use_max:
//     amax_compute_algo "max"). scale and amax may be elements of state_scale and history row 0.
struct InferenceCastArgs {
  const void* x;
  uint8_t* q;
  int64_t n;
  DType in_type, fp8_type;
  float* scale;
  float* amax;
  float* scale_inv;
  bool current;
  float fp8_max;
  float* history = nullptr;
  float* state_scale = nullptr;
  float* state_scale_inv = nullptr;
  float* backup = nullptr;
  int32_t history_len = 0, slots = 0;
  float pow2_margin = 1.0f;
  bool use_max = true;
};

// One launch (a cooperative one where the bookkeeping needs every block's amax first); none when n == 0 (then the
// caller does the bookkeeping).
void launch_inference_cast(const InferenceCastArgs& args, cudaStream_t stream);

}  // namespace tfp8
