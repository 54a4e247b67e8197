// Helpers shared by the torch-facing GEMM bindings (gemm_binding.cpp defines them): the workspace, the operand
// fields, the residual's checks.
#pragma once
#include <ATen/ATen.h>

#include "gemm.h"

namespace tfp8 {

// Gives the fully described GEMM `args` the workspace its algorithm needs: torch's cuBLASLt workspace of the current
// stream when large enough, else a fresh buffer, returned (undefined otherwise); keep it alive until the GEMM is
// enqueued.
at::Tensor attach_workspace(Fp8GemmArgs& args, const at::TensorOptions& options);

// The operand fields of a GEMM's arguments: a [m, k] and b [n, k] FP8 with their float32 scale_inv, fast
// accumulation unless use_split_accumulator; the caller sets the output and epilogue.
Fp8GemmArgs operand_args(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, int64_t m, int64_t n, int64_t k, bool use_split_accumulator);

// A GEMM's residual [m, n]: a contiguous CUDA tensor of out_dtype on a's device (errors name "residual").
void check_residual(const at::Tensor& residual, at::ScalarType out_dtype, int64_t m, int64_t n, const at::Tensor& a);

}  // namespace tfp8
