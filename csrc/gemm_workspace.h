// The GEMM workspace helper shared by the torch-facing GEMM bindings (gemm_binding.cpp defines it).
#pragma once
#include <ATen/ATen.h>

#include "gemm.h"

namespace tfp8 {

// Gives the fully described GEMM `args` the workspace its algorithm needs: torch's cuBLASLt workspace of the current
// stream when large enough, else a fresh buffer, returned (undefined otherwise); keep it alive until the GEMM is
// enqueued.
at::Tensor attach_workspace(Fp8GemmArgs& args, const at::TensorOptions& options);

}  // namespace tfp8
