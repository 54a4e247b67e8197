// Launcher of the loss family's CUDA kernel (csrc/loss.cu). Plain pointers, no torch.
// Contract (the op cross_entropy_chunk): csrc/ops.cpp.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// Per row r of logits [rows, cols] (float32, row stride ld, columns contiguous): lse = log(sum(exp(x))),
// loss_rows[r] = lse - x[target] for a counted row (target != ignore_index), 0 for an ignored one; and when dlogits is
// non-null, dlogits[r] (row stride cols, in grad_dtype: float32, float16 or bfloat16) = exp(x - lse), minus 1 at the
// target column of a counted row (subtracted in float32, rounded once). Targets are int64, in [0, cols) or
// ignore_index: any other stops the kernel with a message (__trap, a device-side error as torch's gather raises).
void launch_cross_entropy_chunk(const float* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* targets,
                                int64_t ignore_index, float* loss_rows, void* dlogits, DType grad_dtype,
                                cudaStream_t stream);

}  // namespace tfp8
