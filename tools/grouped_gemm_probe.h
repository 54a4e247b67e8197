// The interface between tools/grouped_gemm_probe.cu and its kernels (tools/grouped_gemm_probe_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../csrc/grouped_gemm_arrays.h"

namespace tfp8::probe {

// One problem: grouped kernels read `arrays` (groups of rows of a, each with its own weight), dense ones a, b, d.
struct ProbeProblem {
  int groups = 0;
  grouped::GroupArrays arrays;   // device arrays
  const void* a = nullptr;       // [m, k] E4M3
  const void* b = nullptr;       // [n, k] E4M3 (dense kernels)
  void* d = nullptr;             // [m, n] bfloat16 (dense kernels)
  const float* alpha = nullptr;  // device scalar (dense kernels)
  int64_t m = 0, n = 0, k = 0;
  int sm_count = 0;
  size_t workspace_bytes = 0;
};

// The tile scheduler's options: CUTLASS's max_swizzle_size and raster order (0 heuristic, 1 along M, 2 along N).
struct ProbeOptions {
  int swizzle = 1;
  int raster = 1;
};

struct ProbeKernel {
  const char* name;
  bool grouped;
  const char* (*run)(const ProbeProblem& problem, const ProbeOptions& options, void* workspace, cudaStream_t stream);
};

ProbeKernel probe_kernel_0();
ProbeKernel probe_kernel_1();
ProbeKernel probe_kernel_2();
ProbeKernel probe_kernel_3();
ProbeKernel probe_kernel_4();
ProbeKernel probe_kernel_5();
ProbeKernel probe_kernel_6();
ProbeKernel probe_kernel_7();
ProbeKernel probe_kernel_8();
ProbeKernel probe_kernel_9();
ProbeKernel probe_kernel_10();
ProbeKernel probe_kernel_11();
ProbeKernel probe_kernel_12();
ProbeKernel probe_kernel_13();

}  // namespace tfp8::probe
