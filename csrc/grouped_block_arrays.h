// The per-group device arrays the block-scaled grouped GEMM reads (written by csrc/grouped_block_launch.cu's setup
// kernel), and the entry points of its compiled configurations (csrc/grouped_block_<kind>.cu). Internal.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "grouped_gemm_arrays.h"

namespace tfp8::grouped {

// One entry per group: shapes (M, N, K), operand and output pointers, leading dimensions (CUTLASS's packed strides
// hold only them), and the group's packed scales (CUTLASS derives their layout from the group's shape).
struct BlockGroupArrays {
  int* shapes = nullptr;  // [groups][3]
  const void** a = nullptr;
  const void** b = nullptr;
  void** d = nullptr;
  int64_t* lda = nullptr;
  int64_t* ldb = nullptr;
  int64_t* ldd = nullptr;
  const float** sfa = nullptr;
  const float** sfb = nullptr;
};

struct BlockConfigEntry {
  size_t (*workspace)(int groups, const Device& device);
  const char* (*run)(int groups, const BlockGroupArrays& arrays, void* cutlass_workspace, const Device& device,
                     cudaStream_t stream);
};

BlockConfigEntry block_rows_config();         // fprop / dgrad: 1x128 A tiles x 128x128 B blocks
BlockConfigEntry block_contraction_config();  // wgrad: 1x128 A tiles x 1x128 B tiles

}  // namespace tfp8::grouped
