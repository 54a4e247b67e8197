// Device helpers of the activation kernels: the activation math (float32, in the operation order of the CPU reference
// transformer_fp8/cpu/activation.py), element storage per DType, VEC-element loads/stores (one access when aligned),
// the NaN-propagating amax, and dispatch from runtime enums to template arguments.
#pragma once
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "activation.h"
#include "kernel_common.cuh"

namespace tfp8 {
namespace act {

// ------------------------------------------------------------------------------------------------- activation math
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kGeluC3 = static_cast<float>(3.0 * 0.044715);  // 3 * kGeluC, rounded once as in the reference

__device__ __forceinline__ float gelu_tanh(float x) { return tanhf(kGeluK * (x + kGeluC * x * x * x)); }
// kFast: exp and the reciprocal by the hardware's approximations (__expf, __fdividef: a few float32 ulps), for results
// rounded to 16 bits or FP8 anyway (every kernel on a 16-bit input); with the IEEE versions (about 35 instructions per
// sigmoid) the SwiGLU kernels were bound by their arithmetic, not by memory. -inf -> 0, +inf -> 1, NaN stays NaN.
template <bool kFast = false>
__device__ __forceinline__ float sigmoid(float x) {
  if constexpr (kFast) return __fdividef(1.0f, 1.0f + __expf(-x));
  else return 1.0f / (1.0f + expf(-x));
}

// y = act(x) of the one-input activations (GELU, ReLU; NaN stays NaN).
template <Activation A>
__device__ __forceinline__ float forward(float x) {
  if constexpr (A == Activation::kGelu) return 0.5f * x * (1.0f + gelu_tanh(x));
  else return x < 0.0f ? 0.0f : x;
}

// dy * act'(x) of the one-input activations.
template <Activation A>
__device__ __forceinline__ float backward(float dy, float x) {
  if constexpr (A == Activation::kGelu) {
    const float t = gelu_tanh(x);
    const float dt = kGeluK * (1.0f + kGeluC3 * x * x) * (1.0f - t * t);
    return dy * (0.5f * (1.0f + t) + 0.5f * x * dt);
  } else {
    return x > 0.0f ? dy : 0.0f;
  }
}

template <bool kFast = false>
__device__ __forceinline__ float swiglu_forward(float gate, float up) {
  return gate * sigmoid<kFast>(gate) * up;
}

template <bool kFast = false>
__device__ __forceinline__ void swiglu_backward(float dy, float gate, float up, float& dgate, float& dup) {
  const float sig = sigmoid<kFast>(gate);
  dgate = dy * up * sig * (1.0f + gate * (1.0f - sig));
  dup = dy * gate * sig;
}

// --------------------------------------------------------------------------------------------------- element storage
constexpr bool is_fp8(DType d) { return d == DType::kE4M3 || d == DType::kE5M2; }

template <DType D>
struct Storage;
template <>
struct Storage<DType::kFloat32> {
  using T = float;
};
template <>
struct Storage<DType::kFloat16> {
  using T = __half;
};
template <>
struct Storage<DType::kBFloat16> {
  using T = __nv_bfloat16;
};
template <>
struct Storage<DType::kE4M3> {
  using T = uint8_t;
};
template <>
struct Storage<DType::kE5M2> {
  using T = uint8_t;
};
template <DType D>
using StorageT = typename Storage<D>::T;

// A value as stored in D: FP8 = saturate(value * scale), high precision = value rounded to nearest (scale unused).
template <DType D>
__device__ __forceinline__ StorageT<D> encode(float value, float scale) {
  if constexpr (is_fp8(D)) return float_to_fp8<D>(value * scale);
  else return from_float<StorageT<D>>(value);
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// out[0..count) = float(src[0..count)), the rest 0. count == N uses one N-element access (src aligned to it).
template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[N], int count) {
  if (count == N) {
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(src);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(v.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = k < count ? to_float(src[k]) : 0.0f;
  }
}

// v = src[0..count) (the rest zero). count == N with `vector` takes one access of the whole vector (src aligned to its
// size) or, for vectors of a multiple of 16 bytes, 16-byte accesses (src aligned to 16); else one element at a time.
// The raw elements, not floats: a batch of loads in flight then holds half the registers for 16-bit types.
template <typename T, int N>
__device__ __forceinline__ void load_vector(const T* src, Vec<T, N>& v, int count, bool vector = true) {
  if (vector && count == N) {
    if constexpr (N * sizeof(T) % 16 == 0) {
      constexpr int kWords = N * sizeof(T) / 16;
      uint4 words[kWords];
#pragma unroll
      for (int k = 0; k < kWords; ++k) words[k] = reinterpret_cast<const uint4*>(src)[k];
      memcpy(&v, words, sizeof(words));
    } else {
      v = *reinterpret_cast<const Vec<T, N>*>(src);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) v.v[k] = k < count ? src[k] : T{};
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& v, float (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(v.v[k]);
}

// The FP8 D bytes of saturate(a * scale) (low byte) and saturate(b * scale) (high byte): one hardware conversion.
template <DType D>
__device__ __forceinline__ uint16_t encode_fp8_pair(float a, float b, float scale) {
  static_assert(is_fp8(D), "FP8 only");
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE,
                                                        D == DType::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

// bytes[k] = saturate(values[k] * scale) in FP8 D, two values per hardware conversion (N even).
template <DType D, int N>
__device__ __forceinline__ void encode_fp8(const float (&values)[N], float scale, Vec<uint8_t, N>& bytes) {
  static_assert(is_fp8(D) && N % 2 == 0, "FP8 pairs only");
#pragma unroll
  for (int k = 0; k < N; k += 2) {
    const uint16_t pair = encode_fp8_pair<D>(values[k], values[k + 1], scale);
    bytes.v[k] = static_cast<uint8_t>(pair & 0xff);
    bytes.v[k + 1] = static_cast<uint8_t>(pair >> 8);
  }
}

// dst[0..count) = encode<D>(values[0..count), scale). count == N uses one N-element access (dst aligned to it).
template <DType D, int N>
__device__ __forceinline__ void store_floats(StorageT<D>* dst, const float (&values)[N], float scale, int count) {
  if (count == N) {
    Vec<StorageT<D>, N> v;
    if constexpr (is_fp8(D) && N % 2 == 0) {
      encode_fp8<D>(values, scale, v);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v.v[k] = encode<D>(values[k], scale);
    }
    *reinterpret_cast<Vec<StorageT<D>, N>*>(dst) = v;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < count) dst[k] = encode<D>(values[k], scale);
    }
  }
}

// ----------------------------------------------------------------------------------------------------------- amax
// running = max(running, |x|), a NaN winning (int order of non-negative floats, see atomic_max_nonneg).
__device__ __forceinline__ float max_abs(float running, float x) {
  return __int_as_float(max(__float_as_int(running), __float_as_int(fabsf(x))));
}


// ------------------------------------------------------------------------------------------------------- host side
__host__ __device__ inline bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int sm_count() {
  int device = 0, count = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  TFP8_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <Activation A>
using ActTag = std::integral_constant<Activation, A>;
template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

// f(ActTag<act>{}): the activation as a compile-time constant.
template <typename F>
void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kGelu: f(ActTag<Activation::kGelu>{}); break;
    case Activation::kRelu: f(ActTag<Activation::kRelu>{}); break;
    case Activation::kSwiglu: f(ActTag<Activation::kSwiglu>{}); break;
    default: throw std::invalid_argument("activation: unknown activation");
  }
}

// f(DTypeTag<dtype>{}) for a float32 / float16 / bfloat16 dtype.
template <typename F>
void with_high_precision(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(DTypeTag<DType::kFloat32>{}); break;
    case DType::kFloat16: f(DTypeTag<DType::kFloat16>{}); break;
    case DType::kBFloat16: f(DTypeTag<DType::kBFloat16>{}); break;
    default: throw std::invalid_argument("expected a float32, float16 or bfloat16 dtype");
  }
}

// f(DTypeTag<dtype>{}) for an FP8 dtype.
template <typename F>
void with_fp8(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kE4M3: f(DTypeTag<DType::kE4M3>{}); break;
    case DType::kE5M2: f(DTypeTag<DType::kE5M2>{}); break;
    default: throw std::invalid_argument("expected an FP8 dtype");
  }
}

}  // namespace act
}  // namespace tfp8
