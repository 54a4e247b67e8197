// Launcher of the block-scaled grouped FP8 GEMM (recipe Float8BlockScaling; csrc/grouped_block_*.cu): CUTLASS's sm90
// pointer-array kernel with blockwise scaling in the mainloop (each 128-deep K step's partial sums multiplied by the
// scales of its A rows and B columns or block, in float32). Per-group shapes, pointers and scale pointers are written
// on the device from the groups' offsets (no host sync, empty groups allowed); the forward's scales are repacked per
// group first (CUTLASS reads each group's scales as one packed block). Plain pointers, no torch. Contracts (the ops
// grouped_block_fp8_gemm_sm90 / grouped_block_fp8_gemm_wgrad_sm90): csrc/ops.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "grouped_gemm.h"

namespace tfp8 {

struct GroupedBlockGemmArgs {
  // kRows (fprop / dgrad): out [rows, n], rows of group g = a[rows of g] (1x128 tiles) . b[g]ᵀ (128x128 blocks).
  // kContraction (wgrad): out [G, n, k], out[g] = a_t [n, columns of g] . b_t [k, columns of g]ᵀ (1x128 tiles along
  // the columns each; every non-empty group starts at a multiple of 128 columns).
  GroupedKind kind = GroupedKind::kRows;
  const void* a = nullptr;  // E4M3; kRows: [rows, k]; kContraction: a_t [n, rows]
  const void* b = nullptr;  // E4M3; kRows: group g at b + g * b_group_stride, row stride b_row_stride; kContraction:
                            // b_t [k, rows]
  void* out = nullptr;      // bfloat16; kRows: [rows, n]; kContraction: [G, n, k]
  const int32_t* offs = nullptr;  // [groups] cumulative ends (device)
  int groups = 0;
  int64_t rows = 0, n = 0, k = 0;
  int64_t b_group_stride = 0, b_row_stride = 0;  // kRows only, in elements
  // kRows: a's tile scales, element (m, kb) at a_scale[kb * a_scale_ld + m]; b's block scales, element (g, nb, kb)
  // at b_scale[g * s0 + nb * s1 + kb * s2]. kContraction: [cdiv(rows, 128), n] and [cdiv(rows, 128), k], contiguous.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  int64_t a_scale_ld = 0;
  int64_t b_scale_strides[3] = {0, 0, 0};
};

// Bytes of device workspace launch_grouped_block_fp8_gemm needs (host only, no device access).
size_t grouped_block_fp8_gemm_workspace_bytes(const GroupedBlockGemmArgs& args);

// Runs the GEMM on stream with a workspace of grouped_block_fp8_gemm_workspace_bytes(args) bytes (256-byte aligned).
// Returns nullptr, or a message saying why CUTLASS refused the problem.
const char* launch_grouped_block_fp8_gemm(const GroupedBlockGemmArgs& args, void* workspace, cudaStream_t stream);

}  // namespace tfp8
