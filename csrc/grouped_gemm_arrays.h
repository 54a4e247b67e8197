// The per-group device arrays the grouped GEMM reads (written by csrc/grouped_gemm_launch.cu's setup kernel), and the
// entry points of the compiled tile configurations (csrc/grouped_gemm_<config>.cu). Internal to the grouped family.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tfp8::grouped {

// Pointers into the workspace, one entry per group. Strides are the leading dimensions (CUTLASS's packed strides
// (ld, 1, 0) hold only them); shapes are (M, N, K) of each group's GEMM.
struct GroupArrays {
  int* shapes = nullptr;  // [groups][3]
  const void** a = nullptr;
  const void** b = nullptr;
  void** d = nullptr;
  int64_t* lda = nullptr;
  int64_t* ldb = nullptr;
  int64_t* ldd = nullptr;
  float* alpha = nullptr;
};

struct Device {
  int id = 0;
  int sm_count = 0;
};

// One compiled configuration: its CUTLASS workspace size and its run.
struct GroupedConfigEntry {
  size_t (*workspace)(int groups, const Device& device);
  const char* (*run)(int groups, const GroupArrays& arrays, void* cutlass_workspace, const Device& device,
                     cudaStream_t stream);
};

GroupedConfigEntry fast_large_config();
GroupedConfigEntry fast_small_config();
GroupedConfigEntry split_large_config();
GroupedConfigEntry split_small_config();
GroupedConfigEntry fast_alt_config();
GroupedConfigEntry split_alt_config();
GroupedConfigEntry fast_wide_config();
GroupedConfigEntry split_wide_config();
GroupedConfigEntry fast_solo_config();
GroupedConfigEntry split_solo_config();
GroupedConfigEntry fast_ping_config();

}  // namespace tfp8::grouped
