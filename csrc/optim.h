// Launcher of the optimizer family's CUDA kernel (csrc/optim_adamw.cu). Plain pointers, no torch.
// Contract (the op adamw_step_): csrc/ops.cpp.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// The tensors of one launch, passed by value as the kernel's parameter (about 10 KB: Hopper takes up to 32 KB).
// Entry i: param, grad, exp_avg, exp_avg_sq, numel[i] contiguous elements each, all of one dtype; its chunks of
// AdamWTable::kChunk elements are the blocks first_block[i] .. first_block[i + 1] - 1 (first_block[count] = the
// launch's block count).
struct AdamWTable {
  static constexpr int kCapacity = 192;
  static constexpr int64_t kChunk = 16384;  // elements per block
  void* param[kCapacity];
  const void* grad[kCapacity];
  void* exp_avg[kCapacity];
  void* exp_avg_sq[kCapacity];
  int64_t numel[kCapacity];
  int32_t first_block[kCapacity + 1];
  int32_t count;  // entries in use
};

// The float32 operands of one AdamW step, each rounded once from the double the caller computed:
// lr_wd = lr * weight_decay, one_minus_beta1 = 1 - beta1, ..., step_size = lr / (1 - beta1**step),
// inv_bias_correction2_sqrt = 1 / sqrt(1 - beta2**step).
struct AdamWScalars {
  float lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_bias_correction2_sqrt;
  bool maximize;
};

// Per element, in float32 with every operation rounded (no contraction), then each result rounded to the dtype:
// g = maximize ? -grad : grad; p = param - lr_wd * param; m = beta1 * exp_avg + one_minus_beta1 * g;
// v = beta2 * exp_avg_sq + (one_minus_beta2 * g) * g; param = p - (step_size * m) / (sqrt(v) *
// inv_bias_correction2_sqrt + eps); exp_avg = m; exp_avg_sq = v. dtype: float32, float16 or bfloat16. No launch when
// table.count == 0.
void launch_adamw(const AdamWTable& table, const AdamWScalars& scalars, DType dtype, cudaStream_t stream);

}  // namespace tfp8
