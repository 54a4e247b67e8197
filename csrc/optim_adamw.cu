// adamw_step_'s kernel: one launch updates up to AdamWTable::kCapacity tensors; a block takes one chunk of
// AdamWTable::kChunk elements of one tensor (found by binary search over the table's first_block). The update reads
// four tensors and writes three, so it is bound by memory when enough loads are in flight and the per-element math is
// short: a thread loads two 16-byte vectors of each tensor (eight loads issued before any arithmetic), and the math
// takes one square root and one division per element (the bias correction is a multiplication by its reciprocal).
// Tensors whose four pointers are not all 16-byte aligned, and a chunk's last elements short of a vector pair, take
// the vector-by-vector and one-element paths. Every float32 operation is rounded on its own (__f*_rn: no FMA
// contraction), as the CPU reference computes it, so both give the same bits.
#include "optim.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kMinBlocksPerSm = 4;  // (64 registers a thread: two vectors of four tensors and the math fit)

template <typename T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// A 16-byte vector of a tensor only read (the gradient), through the read-only data cache.
template <typename T>
__device__ __forceinline__ Vec<T> load_read_only(const T* p) {
  const uint4 bits = __ldg(reinterpret_cast<const uint4*>(p));
  Vec<T> out;
  memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
__device__ __forceinline__ void adamw_element(T& param, T grad, T& exp_avg, T& exp_avg_sq, const AdamWScalars& s) {
  float g = to_float(grad);
  if (s.maximize) g = -g;
  float p = to_float(param);
  p = __fsub_rn(p, __fmul_rn(s.lr_wd, p));
  const float m = __fadd_rn(__fmul_rn(s.beta1, to_float(exp_avg)), __fmul_rn(s.one_minus_beta1, g));
  const float v = __fadd_rn(__fmul_rn(s.beta2, to_float(exp_avg_sq)), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), s.inv_bias_correction2_sqrt), s.eps);
  param = from_float<T>(__fsub_rn(p, __fdiv_rn(__fmul_rn(s.step_size, m), denom)));
  exp_avg = from_float<T>(m);
  exp_avg_sq = from_float<T>(v);
}

template <typename T>
__device__ __forceinline__ void adamw_vector(Vec<T>& p, const Vec<T>& g, Vec<T>& m, Vec<T>& v, const AdamWScalars& s) {
#pragma unroll
  for (int k = 0; k < Vec<T>::kSize; ++k) adamw_element(p.v[k], g.v[k], m.v[k], v.v[k], s);
}

__device__ __forceinline__ int entry_of_block(const AdamWTable& table, int block) {
  int lo = 0, hi = table.count - 1;  // the last entry whose first_block <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    adamw_kernel(const __grid_constant__ AdamWTable table, const AdamWScalars s) {
  constexpr int kVec = Vec<T>::kSize;
  static_assert(AdamWTable::kChunk % (2 * kThreads * kVec) == 0, "chunks of whole vector pairs per thread");
  const int e = entry_of_block(table, blockIdx.x);
  const int64_t begin = static_cast<int64_t>(blockIdx.x - table.first_block[e]) * AdamWTable::kChunk;
  const int64_t end = min(begin + AdamWTable::kChunk, table.numel[e]);
  T* param = static_cast<T*>(table.param[e]);
  const T* grad = static_cast<const T*>(table.grad[e]);
  T* exp_avg = static_cast<T*>(table.exp_avg[e]);
  T* exp_avg_sq = static_cast<T*>(table.exp_avg_sq[e]);
  const bool aligned = ((reinterpret_cast<uintptr_t>(param) | reinterpret_cast<uintptr_t>(grad) |
                         reinterpret_cast<uintptr_t>(exp_avg) | reinterpret_cast<uintptr_t>(exp_avg_sq)) %
                        16) == 0;
  int64_t scalar_from = begin;
  if (aligned) {  // whole vectors: chunks start at multiples of kChunk, so at 16-byte boundaries
    constexpr int64_t kStride = int64_t{kThreads} * kVec;  // between a thread's two vectors
    const int64_t vector_end = begin + (end - begin) / kVec * kVec;
    int64_t i = begin + int64_t{threadIdx.x} * kVec;
#pragma unroll 1
    for (; i + kStride < vector_end; i += 2 * kStride) {
      Vec<T> p0 = *reinterpret_cast<const Vec<T>*>(param + i);
      Vec<T> p1 = *reinterpret_cast<const Vec<T>*>(param + i + kStride);
      const Vec<T> g0 = load_read_only(grad + i);
      const Vec<T> g1 = load_read_only(grad + i + kStride);
      Vec<T> m0 = *reinterpret_cast<const Vec<T>*>(exp_avg + i);
      Vec<T> m1 = *reinterpret_cast<const Vec<T>*>(exp_avg + i + kStride);
      Vec<T> v0 = *reinterpret_cast<const Vec<T>*>(exp_avg_sq + i);
      Vec<T> v1 = *reinterpret_cast<const Vec<T>*>(exp_avg_sq + i + kStride);
      adamw_vector(p0, g0, m0, v0, s);
      adamw_vector(p1, g1, m1, v1, s);
      *reinterpret_cast<Vec<T>*>(param + i) = p0;
      *reinterpret_cast<Vec<T>*>(param + i + kStride) = p1;
      *reinterpret_cast<Vec<T>*>(exp_avg + i) = m0;
      *reinterpret_cast<Vec<T>*>(exp_avg + i + kStride) = m1;
      *reinterpret_cast<Vec<T>*>(exp_avg_sq + i) = v0;
      *reinterpret_cast<Vec<T>*>(exp_avg_sq + i + kStride) = v1;
    }
    if (i < vector_end) {  // (a chunk's tail: one vector left for this thread)
      Vec<T> p = *reinterpret_cast<const Vec<T>*>(param + i);
      Vec<T> m = *reinterpret_cast<const Vec<T>*>(exp_avg + i);
      Vec<T> v = *reinterpret_cast<const Vec<T>*>(exp_avg_sq + i);
      adamw_vector(p, load_read_only(grad + i), m, v, s);
      *reinterpret_cast<Vec<T>*>(param + i) = p;
      *reinterpret_cast<Vec<T>*>(exp_avg + i) = m;
      *reinterpret_cast<Vec<T>*>(exp_avg_sq + i) = v;
    }
    scalar_from = vector_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
    adamw_element(param[i], grad[i], exp_avg[i], exp_avg_sq[i], s);
  }
}

}  // namespace

void launch_adamw(const AdamWTable& table, const AdamWScalars& scalars, DType dtype, cudaStream_t stream) {
  if (table.count == 0) return;
  const int blocks = table.first_block[table.count];
  if (blocks == 0) return;
  switch (dtype) {
    case DType::kFloat32: adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(table, scalars); break;
    case DType::kFloat16: adamw_kernel<__half><<<blocks, kThreads, 0, stream>>>(table, scalars); break;
    case DType::kBFloat16: adamw_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(table, scalars); break;
    default: throw std::invalid_argument("launch_adamw: dtype must be float32, float16 or bfloat16");
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
