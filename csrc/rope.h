// Launcher of the rope family's CUDA kernel (csrc/rope.cu). Plain pointers, no torch.
// Contract (the ops rope_fwd / rope_bwd): csrc/ops.cpp.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// One rotation: x [s, b, h, d] (seq_first, "sbhd") or [b, s, h, d] with element strides x_stride_* (last dim
// contiguous) -> out of x's shape with element strides out_stride_* (last dim contiguous; out may be x itself, with
// x's strides: each element is read before it is written, by the thread that writes it). Angles of token (si, bi) at
// freqs + si * freqs_stride_s + bi * freqs_stride_b (freqs_stride_b = 0 when the batch shares them), rot_dim
// contiguous floats.
struct RopeArgs {
  const void* x;
  void* out;
  const float* freqs;
  int64_t s, b, h, d, rot_dim;
  int64_t x_stride_s, x_stride_b, x_stride_h;
  int64_t out_stride_s, out_stride_b, out_stride_h;
  int64_t freqs_stride_s, freqs_stride_b;
  bool seq_first;
  bool interleaved;
};

// inverse = false: rope_fwd; true: rope_bwd (x is the gradient). dtype: float32, float16 or bfloat16.
// No launch when there is nothing to do.
void launch_rope(const RopeArgs& args, DType dtype, bool inverse, cudaStream_t stream);

}  // namespace tfp8
