// Host helpers the grouped families' launchers share (csrc/grouped_shared.cu defines them). Internal.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm_arrays.h"

namespace tfp8::grouped {

// The current device and its SM count (asked once per device).
Device current_device();

// out[g] = 0 ([n, k] bfloat16 each) for every empty group g of offs (the wgrad kernels skip a group with no tiles).
// Returns nullptr, or why the launch failed.
const char* launch_zero_empty_groups(const int32_t* offs, int64_t rows, int groups, int64_t n, int64_t k, void* out,
                                     cudaStream_t stream);

}  // namespace tfp8::grouped
