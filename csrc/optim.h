// Launcher of the optimizer family's CUDA kernel (csrc/optim_adamw.cu). Plain pointers, no torch.
// Contract (the op adamw_step_): csrc/ops.cpp.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// The tensors of one launch, passed by value as the kernel's parameter (about 12 KB: Hopper takes up to 32 KB).
// Entry i: param, grad (the parameter's dtype), exp_avg, exp_avg_sq (the moments' dtype) and, when the launch keeps
// master weights, master (float32), numel[i] contiguous elements each; its chunks of AdamWTable::kChunk elements are
// the blocks first_block[i] .. first_block[i + 1] - 1 (first_block[count] = the launch's block count).
struct AdamWTable {
  static constexpr int kCapacity = 192;
  static constexpr int64_t kChunk = 16384;  // elements per block
  void* param[kCapacity];
  const void* grad[kCapacity];
  void* exp_avg[kCapacity];
  void* exp_avg_sq[kCapacity];
  float* master[kCapacity];  // (null entries when the launch keeps no master weights)
  int64_t numel[kCapacity];
  int32_t first_block[kCapacity + 1];
  int32_t count;  // entries in use
};

// The float32 operands of one step, each rounded once from the double the caller computed: lr_wd = lr *
// weight_decay (decoupled decay, else 0), l2_wd = weight_decay (L2 decay added to the gradient, else 0),
// one_minus_beta1 = 1 - beta1, ..., step_size = lr / (1 - beta1**step) (lr without bias correction),
// inv_bias_correction2_sqrt = 1 / sqrt(1 - beta2**step) (1 without bias correction).
struct AdamWScalars {
  float lr_wd, l2_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_bias_correction2_sqrt;
  bool maximize;
};

// Per element, in float32 with every operation rounded (no contraction): w = master if the launch keeps master
// weights, else param; g = maximize ? -grad : grad; g = g + l2_wd * w; w = w - lr_wd * w;
// m = beta1 * exp_avg + one_minus_beta1 * g; v = beta2 * exp_avg_sq + (one_minus_beta2 * g) * g;
// w = w - (step_size * m) / (sqrt(v) * inv_bias_correction2_sqrt + eps); then master = w (when kept), param = w, exp_avg
// = m, exp_avg_sq = v, each rounded to its dtype. param_dtype: float32, float16 or bfloat16; moment_dtype:
// param_dtype or float32; master weights only for 16-bit parameters. No launch when table.count == 0.
void launch_adamw(const AdamWTable& table, const AdamWScalars& scalars, DType param_dtype, DType moment_dtype,
                  bool master_weights, cudaStream_t stream);

}  // namespace tfp8
