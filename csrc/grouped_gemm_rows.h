// Our own grouped FP8 kernel for the rows form with fast accumulation (csrc/grouped_gemm_rows_kernel.cuh says how it
// works and why); csrc/grouped_gemm_launch.cu runs it for GroupedTile::kOurs.
#pragma once
#include <cuda_runtime.h>

#include "grouped_gemm.h"

namespace tfp8::grouped {

// Whether the kernel takes these arguments: the rows form, fast accumulation, 1..1024 groups, rows and n below 2^31
// (and fewer than 2^31 tiles), k > 0 a multiple of 16, n of 8, 16-byte aligned operands, weight strides multiples of
// 16 that do not overlap rows or groups. Elsewhere the launcher runs a CUTLASS configuration.
bool rows_kernel_supports(const GroupedFp8GemmArgs& args);

// Runs it on stream (no workspace). Returns nullptr, or why it could not.
const char* launch_rows_kernel(const GroupedFp8GemmArgs& args, cudaStream_t stream);

}  // namespace tfp8::grouped
