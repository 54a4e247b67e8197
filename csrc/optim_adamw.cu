// adamw_step_'s kernel: one launch updates up to AdamWTable::kCapacity tensors; a block takes one chunk of
// AdamWTable::kChunk elements of one tensor (found by binary search over the table's first_block). The update reads
// four or five tensors and writes three or four, so it is bound by memory when enough loads are in flight and the
// per-element math is short: a thread loads two groups of 8 elements of every tensor (16-byte loads, all issued
// before any arithmetic), and the math takes one square root and one division per element (the bias correction is a
// multiplication by its reciprocal). Tensors whose pointers are not all 16-byte aligned, and a chunk's last elements
// short of a group, take the group-by-group and one-element paths. Every float32 operation is rounded on its own
// (__f*_rn: no FMA contraction), as the CPU reference computes it, so both give the same bits.
#include "optim.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kGroup = 8;  // elements of a group: 16 bytes of a 16-bit tensor, 32 of a float32 one

template <typename T>
struct alignas(16) Group {
  T v[kGroup];
};

template <typename T, bool kReadOnly = false>
__device__ __forceinline__ Group<T> load_group(const T* p) {
  Group<T> out;
  uint4* dst = reinterpret_cast<uint4*>(&out);
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Group<T>) / 16); ++i) dst[i] = kReadOnly ? __ldg(src + i) : src[i];
  return out;
}

template <typename T>
__device__ __forceinline__ void store_group(T* p, const Group<T>& g) {
  *reinterpret_cast<Group<T>*>(p) = g;
}

// The update of one element: w is the parameter's working value (the master weight, or the parameter) in float32.
template <typename S>
__device__ __forceinline__ float adamw_element(float w, float g, S& exp_avg, S& exp_avg_sq, const AdamWScalars& s) {
  if (s.maximize) g = -g;
  g = __fadd_rn(g, __fmul_rn(s.l2_wd, w));
  w = __fsub_rn(w, __fmul_rn(s.lr_wd, w));
  const float m = __fadd_rn(__fmul_rn(s.beta1, to_float(exp_avg)), __fmul_rn(s.one_minus_beta1, g));
  const float v = __fadd_rn(__fmul_rn(s.beta2, to_float(exp_avg_sq)), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), s.inv_bias_correction2_sqrt), s.eps);
  exp_avg = from_float<S>(m);
  exp_avg_sq = from_float<S>(v);
  return __fsub_rn(w, __fdiv_rn(__fmul_rn(s.step_size, m), denom));
}

// The pointers of one table entry, typed.
template <typename P, typename S>
struct Entry {
  P* param;
  const P* grad;
  S* exp_avg;
  S* exp_avg_sq;
  float* master;
};

// Groups [i, i + 1 group) of every tensor, k groups at stride `stride` elements: loaded together, updated, stored.
template <typename P, typename S, bool kMaster, int kGroups>
__device__ __forceinline__ void update_groups(const Entry<P, S>& t, int64_t i, int64_t stride, const AdamWScalars& s) {
  Group<float> w[kGroups];
  Group<P> p[kGroups];
  Group<P> g[kGroups];
  Group<S> m[kGroups], v[kGroups];
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    if constexpr (kMaster) {
      w[k] = load_group(t.master + i + k * stride);
    } else {
      p[k] = load_group(t.param + i + k * stride);
    }
    g[k] = load_group<P, true>(t.grad + i + k * stride);
    m[k] = load_group(t.exp_avg + i + k * stride);
    v[k] = load_group(t.exp_avg_sq + i + k * stride);
  }
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      const float w0 = kMaster ? w[k].v[e] : to_float(p[k].v[e]);
      const float w1 = adamw_element(w0, to_float(g[k].v[e]), m[k].v[e], v[k].v[e], s);
      if constexpr (kMaster) w[k].v[e] = w1;
      p[k].v[e] = from_float<P>(w1);
    }
    if constexpr (kMaster) store_group(t.master + i + k * stride, w[k]);
    store_group(t.param + i + k * stride, p[k]);
    store_group(t.exp_avg + i + k * stride, m[k]);
    store_group(t.exp_avg_sq + i + k * stride, v[k]);
  }
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

// Two groups in flight per thread; at 64 registers (four blocks an SM) for 16-bit parameters and moments without
// master weights, more for the wider variants (float32 moments, master weights or parameters: two blocks an SM,
// still ~100 KB of loads in flight).
template <typename P, typename S, bool kMaster>
constexpr int min_blocks() {
  return sizeof(P) == 2 && sizeof(S) == 2 && !kMaster ? 4 : 2;
}

template <typename P, typename S, bool kMaster>
__global__ void __launch_bounds__(kThreads, (min_blocks<P, S, kMaster>()))
    adamw_kernel(const __grid_constant__ AdamWTable table, const AdamWScalars s) {
  static_assert(AdamWTable::kChunk % (2 * kThreads * kGroup) == 0, "chunks of whole group pairs per thread");
  const int e = entry_of_block(table, blockIdx.x);
  const int64_t begin = static_cast<int64_t>(blockIdx.x - table.first_block[e]) * AdamWTable::kChunk;
  const int64_t end = min(begin + AdamWTable::kChunk, table.numel[e]);
  const Entry<P, S> t{static_cast<P*>(table.param[e]), static_cast<const P*>(table.grad[e]),
                      static_cast<S*>(table.exp_avg[e]), static_cast<S*>(table.exp_avg_sq[e]), table.master[e]};
  const bool aligned = ((reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(t.grad) |
                         reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq) |
                         reinterpret_cast<uintptr_t>(t.master)) %
                        16) == 0;
  int64_t scalar_from = begin;
  if (aligned) {  // whole groups: chunks start at multiples of kChunk, so at 16-byte boundaries of every tensor
    constexpr int64_t kStride = int64_t{kThreads} * kGroup;  // between a thread's two groups
    const int64_t group_end = begin + (end - begin) / kGroup * kGroup;
    int64_t i = begin + int64_t{threadIdx.x} * kGroup;
#pragma unroll 1
    for (; i + kStride < group_end; i += 2 * kStride) update_groups<P, S, kMaster, 2>(t, i, kStride, s);
    if (i < group_end) update_groups<P, S, kMaster, 1>(t, i, kStride, s);  // (a chunk's tail: one group left)
    scalar_from = group_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
    const float w0 = kMaster ? t.master[i] : to_float(t.param[i]);
    const float w1 = adamw_element(w0, to_float(t.grad[i]), t.exp_avg[i], t.exp_avg_sq[i], s);
    if constexpr (kMaster) t.master[i] = w1;
    t.param[i] = from_float<P>(w1);
  }
}

template <typename P, typename S, bool kMaster>
void launch(const AdamWTable& table, const AdamWScalars& scalars, cudaStream_t stream) {
  adamw_kernel<P, S, kMaster><<<table.first_block[table.count], kThreads, 0, stream>>>(table, scalars);
}

template <typename P>
void launch_for_param(const AdamWTable& table, const AdamWScalars& scalars, bool float32_moments, bool master,
                      cudaStream_t stream) {
  if (float32_moments) {
    master ? launch<P, float, true>(table, scalars, stream) : launch<P, float, false>(table, scalars, stream);
  } else {
    master ? launch<P, P, true>(table, scalars, stream) : launch<P, P, false>(table, scalars, stream);
  }
}

}  // namespace

void launch_adamw(const AdamWTable& table, const AdamWScalars& scalars, DType param_dtype, DType moment_dtype,
                  bool master_weights, cudaStream_t stream) {
  if (table.count == 0 || table.first_block[table.count] == 0) return;
  if (moment_dtype != param_dtype && moment_dtype != DType::kFloat32) {
    throw std::invalid_argument("launch_adamw: moment dtype must be the parameters' or float32");
  }
  const bool float32_moments = moment_dtype == DType::kFloat32;
  switch (param_dtype) {
    case DType::kFloat32:
      if (master_weights) throw std::invalid_argument("launch_adamw: master weights for float32 parameters");
      launch<float, float, false>(table, scalars, stream);
      break;
    case DType::kFloat16: launch_for_param<__half>(table, scalars, float32_moments, master_weights, stream); break;
    case DType::kBFloat16:
      launch_for_param<__nv_bfloat16>(table, scalars, float32_moments, master_weights, stream);
      break;
    default: throw std::invalid_argument("launch_adamw: dtype must be float32, float16 or bfloat16");
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
