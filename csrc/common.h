// Argument checks and dtype helpers shared by the torch-facing binding files (csrc/<family>_binding.cpp).
// Kernel files (.cu) do not include this: they see only csrc/kernel_common.cuh and plain pointers.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernel_common.cuh"

namespace tfp8 {

// Shapes and numbers in error messages are formatted with std::to_string, never streamed: built with the device
// image's default compiler (/opt/gcc), streaming integers into a TORCH_CHECK message crashed inside a copy of
// libstdc++'s ostream code in our library (tools/device_env.sh now builds with the system g++, which fixes it; the
// rule stays so that messages never depend on the toolchain).
inline std::string dims(at::IntArrayRef values) {
  std::string text = "(";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + (values.size() == 1 ? ",)" : ")");
}

inline std::string num(int64_t value) { return std::to_string(value); }

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

inline DType to_dtype(at::ScalarType t, const char* arg) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kE4M3;
    case at::kFloat8_e5m2: return DType::kE5M2;
    default: TORCH_CHECK(false, arg, ": unsupported dtype ", t);
  }
}

inline float fp8_max(at::ScalarType t) { return t == at::kFloat8_e4m3fn ? 448.0f : 57344.0f; }

inline void check_fp8_dtype(at::ScalarType t, const char* arg) {
  TORCH_CHECK(is_fp8(t), arg, ": expected torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
}

inline void check_high_precision(const at::Tensor& t, const char* arg) {
  auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kHalf || d == at::kBFloat16, arg,
              ": expected a float32, float16 or bfloat16 tensor, got ", d);
}

inline void check_cuda(const at::Tensor& t, const char* arg) {
  TORCH_CHECK(t.is_cuda(), arg, ": expected a CUDA tensor, got one on ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* arg) {
  TORCH_CHECK(t.is_contiguous(), arg, ": expected a contiguous tensor (got strides ", dims(t.strides()), ")");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK(t.device() == ref.device(), arg, ": expected a tensor on ", ref.device(), ", got one on ", t.device());
}

// scale / scale_inv / amax: one float32 element on the data's device.
inline void check_scalar_f32(const at::Tensor& t, const at::Tensor& data, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == 1, arg, ": expected one element, got shape ", dims(t.sizes()));
  check_same_device(t, data, arg);
}

inline void check_optional_scalar_f32(const std::optional<at::Tensor>& t, const at::Tensor& data, const char* arg) {
  if (t.has_value()) check_scalar_f32(*t, data, arg);
}

template <typename T = float>
inline T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

}  // namespace tfp8
