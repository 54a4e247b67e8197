// Device helpers of the quantize family's kernels: 16-element chunks moved with 16-byte accesses, the NaN-propagating
// running max|x|, the per-block amax reduction, and dtype dispatch for the launchers.
#pragma once
#include <cstring>
#include <stdexcept>

#include "kernel_common.cuh"

namespace tfp8 {

// Elements per thread per step: 16 FP8 bytes make one 16-byte store.
constexpr int kChunk = 16;

// Loads 16 elements of T (16 * sizeof(T) bytes, 16-byte aligned) as sizeof(T) 16-byte loads.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* src, T (&v)[kChunk]) {
  uint4 words[sizeof(T)];
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) words[k] = reinterpret_cast<const uint4*>(src)[k];
  memcpy(v, words, sizeof(words));
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* dst, const T (&v)[kChunk]) {
  uint4 words[sizeof(T)];
  memcpy(words, v, sizeof(words));
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) reinterpret_cast<uint4*>(dst)[k] = words[k];
}

// running = max(running, |x|), with a NaN winning (int order of non-negative floats, see atomic_max_nonneg).
__device__ __forceinline__ float max_abs(float running, float x) {
  return __int_as_float(max(__float_as_int(running), __float_as_int(fabsf(x))));
}


inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int sm_count() {
  int device = 0, count = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  TFP8_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace tfp8

// Runs the statements with `T` bound to the C++ type of a float32 / float16 / bfloat16 DType.
#define TFP8_DISPATCH_HIGH_PRECISION(dtype, T, ...) \
  switch (dtype) { \
    case ::tfp8::DType::kFloat32: { \
      using T = float; \
      __VA_ARGS__; \
      break; \
    } \
    case ::tfp8::DType::kFloat16: { \
      using T = __half; \
      __VA_ARGS__; \
      break; \
    } \
    case ::tfp8::DType::kBFloat16: { \
      using T = __nv_bfloat16; \
      __VA_ARGS__; \
      break; \
    } \
    default: throw std::invalid_argument("expected a float32, float16 or bfloat16 dtype"); \
  }

// Runs the statements with the constexpr `F` bound to an FP8 DType.
#define TFP8_DISPATCH_FP8(dtype, F, ...) \
  switch (dtype) { \
    case ::tfp8::DType::kE4M3: { \
      constexpr ::tfp8::DType F = ::tfp8::DType::kE4M3; \
      __VA_ARGS__; \
      break; \
    } \
    case ::tfp8::DType::kE5M2: { \
      constexpr ::tfp8::DType F = ::tfp8::DType::kE5M2; \
      __VA_ARGS__; \
      break; \
    } \
    default: throw std::invalid_argument("expected an FP8 dtype"); \
  }
