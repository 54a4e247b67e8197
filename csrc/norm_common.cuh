// Device and launch helpers shared by norm_fwd.cu and norm_bwd.cu (plain CUDA, no torch headers).
//
// Two kernel shapes per op:
//   "registers": blockDim = (threads_per_row, rows_per_cta). A row is held in registers as kVecs 16-byte vectors per
//     thread (vector v of thread t covers columns [(v * threads_per_row + t) * kVec, ... + kVec)). Needs cols a
//     multiple of kVec and 16-byte aligned pointers. CTAs loop over row groups (persistent grid).
//   "general": any cols and alignment; one row per CTA of kGeneralThreads threads, scalar loads, several passes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "kernel_common.cuh"

namespace tfp8 {
namespace norm {

constexpr int kCtaThreads = 512;  // registers path: rows_per_cta = max(1, kCtaThreads / threads_per_row)
constexpr int kMaxRowsPerCta = kCtaThreads / 32;
constexpr int kGeneralThreads = 512;

template <typename T>
constexpr int vec_elems() {
  return 16 / sizeof(T);
}  // elements of T in one 16-byte vector

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::kFloat32 : std::is_same_v<T, __half> ? DType::kFloat16 : DType::kBFloat16;
}

// N elements of T loaded / stored with one (or, for 32 bytes of float, two) vector instructions.
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* ptr, float (&out)[N]) {
  const Vec<T, N> vec = *reinterpret_cast<const Vec<T, N>*>(ptr);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float<T>(vec.v[i]);
}

__device__ __forceinline__ float max_nonneg(float a, float b) {  // NaN-propagating max of non-negative floats
  return __int_as_float(max(__float_as_int(a), __float_as_int(b)));
}

__device__ __forceinline__ float warp_reduce(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float2 warp_reduce(float2 v) { return make_float2(warp_reduce(v.x), warp_reduce(v.y)); }

__device__ __forceinline__ float2 operator+(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// Sum of v over the threads of this row (threadIdx.y); every thread of the row gets the same bits (the xor butterfly
// adds the same pairs on every lane). Every thread of the CTA must call it (it synchronises the CTA unless a row is one
// warp). partials: [kMaxRowsPerCta][32].
template <typename V>
__device__ __forceinline__ V row_reduce(V v, V (*partials)[32]) {
  v = warp_reduce(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partials[threadIdx.y][warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? partials[threadIdx.y][lane] : V{};
  v = warp_reduce(v);
  __syncthreads();
  return v;
}


// ---------------------------------------------------------------- host side

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}, Tag<W>{}): T the input type, W the weight type (T, or float).
template <typename F>
void dispatch_input_weight(DType input, DType weight, F&& f) {
  auto with_input = [&](auto t) {
    using T = typename decltype(t)::type;
    if (weight == input) f(t, t);
    else if (weight == DType::kFloat32) f(t, Tag<float>{});
    else throw std::invalid_argument("norm: weight dtype must be the input's or float32");
  };
  switch (input) {
    case DType::kFloat32: with_input(Tag<float>{}); break;
    case DType::kFloat16: with_input(Tag<__half>{}); break;
    case DType::kBFloat16: with_input(Tag<__nv_bfloat16>{}); break;
    default: throw std::invalid_argument("norm: input dtype must be float32, float16 or bfloat16");
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct RowLaunch {
  bool registers;  // false: the general kernel
  dim3 block;
  int64_t row_groups;  // rows / rows per CTA, rounded up
};

// Registers path when cols is a multiple of vec, every pointer is 16-byte aligned and a row fits
// max_threads_per_row threads of vecs_per_thread vectors; else the general path.
inline RowLaunch plan_rows(int64_t rows, int64_t cols, int vec, int vecs_per_thread, int max_threads_per_row,
                           bool aligned) {
  const int64_t vecs = cols / vec;
  const int64_t threads = (vecs + vecs_per_thread - 1) / vecs_per_thread;
  const int64_t threads_per_row = (threads + 31) / 32 * 32;
  if (!aligned || cols % vec != 0 || threads_per_row > max_threads_per_row) return {false, dim3(kGeneralThreads), rows};
  const int rows_per_cta = static_cast<int>(std::max<int64_t>(1, kCtaThreads / threads_per_row));
  return {true, dim3(static_cast<unsigned>(threads_per_row), rows_per_cta), (rows + rows_per_cta - 1) / rows_per_cta};
}

// Persistent grid: as many CTAs as fit on the device at once, at most max_per_sm a multiprocessor (at least one CTA,
// at most one per row group).
template <typename Kernel>
int persistent_grid(Kernel kernel, dim3 block, int64_t row_groups, int max_per_sm = 32) {
  int device = 0, sms = 0, per_sm = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  TFP8_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  TFP8_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block.x * block.y * block.z, 0));
  const int64_t resident = static_cast<int64_t>(sms) * std::min(std::max(per_sm, 1), max_per_sm);
  return static_cast<int>(std::max<int64_t>(1, std::min(row_groups, resident)));
}

}  // namespace norm
}  // namespace tfp8
