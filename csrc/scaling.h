// Launcher of the delayed-scaling update kernel (csrc/scaling_update.cu). Plain pointers, no torch.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// The tensors of one launch, passed by value as the kernel's parameter (about 16 KB: Hopper takes up to 32 KB).
// Entry i: history [history_len[i], slots[i]], scale and scale_inv [slots[i]], float32, contiguous.
struct ScalingUpdateTable {
  static constexpr int kCapacity = 512;
  float* history[kCapacity];
  float* scale[kCapacity];
  float* scale_inv[kCapacity];
  int32_t history_len[kCapacity];
  int32_t slots[kCapacity];
  int32_t count;  // entries in use
};

// For every slot of every entry: newest = history[0] (NaN / Inf -> 0); amax = max(newest, history[1 ..]) when use_max,
// else newest; the history rolls down one row (row 0 zeroed); if amax > 0 and finite and
// s = fp8_max / amax / pow2_margin is finite: scale = s, scale_inv = 1 / s. No launch when table.count == 0.
void launch_delayed_scaling_update(const ScalingUpdateTable& table, float fp8_max, float pow2_margin, bool use_max,
                                   cudaStream_t stream);

}  // namespace tfp8
