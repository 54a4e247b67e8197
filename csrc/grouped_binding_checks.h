// Argument checks the grouped families' bindings share (csrc/grouped_gemm_binding.cpp, grouped_block_binding.cpp).
#pragma once
#include <ATen/cuda/CUDAContext.h>

#include "common.h"

namespace tfp8::grouped {

constexpr int64_t kAlign = 16;  // TMA: 16-byte aligned addresses and strides (FP8: 16 elements)

// An E4M3 operand on ref's device with a 16-byte aligned data pointer (TMA).
inline void check_e4m3(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  check_cuda(t, arg);
  check_same_device(t, ref, arg);
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, arg,
              ": expected a torch.float8_e4m3fn tensor (the grouped kernel takes E4M3 only), got ", t.scalar_type());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlign == 0, arg,
              ": expected a 16-byte aligned data pointer (TMA)");
}

// A dimension the kernel's 16-byte alignment needs as a multiple of 16.
inline void check_multiple(int64_t value, const char* what) {
  TORCH_CHECK(value % kAlign == 0, what, ": expected a multiple of 16 (the kernel's 16-byte alignment), got ",
              num(value));
}

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
