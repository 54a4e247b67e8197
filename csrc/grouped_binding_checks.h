// Argument checks the grouped families' bindings share (csrc/grouped_gemm_binding.cpp, grouped_block_binding.cpp).
#pragma once
#include <ATen/cuda/CUDAContext.h>

#include "common.h"

namespace tfp8::grouped {

// offs: the groups' cumulative ends, a contiguous non-empty int32 vector on ref's device, at most 65535 groups.
inline void check_offs(const at::Tensor& offs, const at::Tensor& ref) {
  check_same_device(offs, ref, "offs");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1 && offs.numel() > 0 && offs.is_contiguous(),
              "offs: expected a contiguous non-empty 1-D int32 tensor (the groups' cumulative ends), got ",
              offs.scalar_type(), " of shape ", dims(offs.sizes()));
  TORCH_CHECK(offs.numel() <= 65535, "offs: at most 65535 groups supported, got ", num(offs.numel()));
}

// Our CUTLASS kernels are built for sm_90a only: `what` names the op in the message.
inline void check_hopper(const at::Tensor& t, const char* what) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(t.device().index());
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, what,
              " (CUTLASS sm_90a): needs a compute capability 9.0 GPU (H100/H200), got ", num(prop->major), ".",
              num(prop->minor));
}

}  // namespace tfp8::grouped
