// Device helpers shared by the kernel files. Plain CUDA: no torch headers, so kernels compile fast.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include <string>
#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace tfp8 {

enum class DType : int { kFloat32, kFloat16, kBFloat16, kE4M3, kE5M2 };

inline int element_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kFloat16 || t == DType::kBFloat16) ? 2 : 1;
}

#define TFP8_CUDA_CHECK(expr) \
  do { \
    cudaError_t err_ = (expr); \
    if (err_ != cudaSuccess) \
      throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(err_) + " at " #expr); \
  } while (0)

#ifdef __CUDACC__
// Saturating, round-to-nearest-even conversion: the same bytes as torch's cast of clamp(x, -max, max).
template <DType F>
__device__ __forceinline__ uint8_t float_to_fp8(float x) {
  static_assert(F == DType::kE4M3 || F == DType::kE5M2, "FP8 dtypes only");
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, F == DType::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

template <DType F>
__device__ __forceinline__ float fp8_to_float(uint8_t q) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q), F == DType::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// amax = max(amax, value) for value >= 0 or NaN: non-negative floats order like their bit patterns as ints,
// and a positive NaN's bits exceed +Inf's, so NaN wins (and the scaling update then keeps the old scale).
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float value) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(value));
}

// max|x| across a warp (NaN-propagating when lanes hold |x| as produced by fabsf).
__device__ __forceinline__ float warp_max_nonneg(float v) {
  for (int off = 16; off > 0; off /= 2) {
    int other = __shfl_xor_sync(0xffffffffu, __float_as_int(v), off);
    v = __int_as_float(max(__float_as_int(v), other));
  }
  return v;
}

// amax = max(amax, max over the block of v) with one atomic per block (any 1-D/2-D block of whole warps).
// Every thread of the block must call it.
__device__ __forceinline__ void block_amax_atomic(float v, float* amax) {
  __shared__ float warp_max[32];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid % 32, warp = tid / 32;
  v = warp_max_nonneg(v);
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_max_nonneg(lane < static_cast<int>(blockDim.x * blockDim.y / 32) ? warp_max[lane] : 0.f);
    if (lane == 0) atomic_max_nonneg(amax, v);
  }
}
#endif

}  // namespace tfp8
