// The moe family's kernels: token rows gathered into expert order (moe_permute_rows), summed back into token order
// (moe_unpermute_rows) and the gradient of the merging probabilities (moe_merging_probs_grad).
// One block per output row (gathers are bound by memory bandwidth: the row's bytes move once, in 16-byte accesses
// when the row size and the pointers allow). Products and sums are rounded one by one (no FMA contraction), in slot
// order, as the CPU reference (transformer_fp8/cpu/moe.py) computes them.
#include <cstdint>

#include "moe.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 128;
constexpr int kGradThreads = 256;

template <typename T>
__device__ __forceinline__ T zero() {
  if constexpr (sizeof(T) == 1) {
    return T(0);
  } else {
    return from_float<T>(0.0f);
  }
}

template <int N, typename T>
__device__ __forceinline__ void load(const T* src, T (&v)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = src[k];
  }
}

template <int N, typename T>
__device__ __forceinline__ void store(T* dst, const T (&v)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = v[k];
  }
}

// Row n of out <- row slot_of_row[n] / slots of inp (times probs[slot] with PROBS), or zeros. N elements per access.
template <typename T, int N, bool PROBS>
__global__ void __launch_bounds__(kThreads)
    permute_rows_kernel(const T* inp, const int32_t* slot_of_row, const float* probs, T* out, int64_t tokens,
                        int64_t slots, int64_t hidden) {
  const int64_t n = blockIdx.x;
  const int64_t slot = slot_of_row[n];
  const bool valid = slot >= 0 && slot < tokens * slots;
  const T* src = inp + (valid ? slot / slots : 0) * hidden;
  T* dst = out + n * hidden;
  float p = 1.0f;
  if constexpr (PROBS) p = valid ? probs[slot] : 0.0f;
  for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += int64_t(kThreads) * N) {
    T v[N];
    if (valid) {
      load<N>(src + c, v);
      if constexpr (PROBS) {
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = from_float<T>(__fmul_rn(to_float(v[k]), p));
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = zero<T>();
    }
    store<N>(dst + c, v);
  }
}

// Row t of out <- sum over the routed slots s (in order) of probs[t, s] * inp[row_id_map[t, s]], float32 sums.
// Thread 0 first lists the routed slots of the token in shared memory (slots rows and weights).
template <typename T, int N, bool PROBS>
__global__ void __launch_bounds__(kThreads)
    unpermute_rows_kernel(const T* inp, const int32_t* row_id_map, const float* probs, T* out, int64_t slots,
                          int64_t rows, int64_t hidden) {
  extern __shared__ int32_t routed_rows[];  // [slots], then float weights [slots]
  float* weights = reinterpret_cast<float*>(routed_rows + slots);
  __shared__ int count;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int k = 0;
    for (int64_t s = 0; s < slots; ++s) {
      const int32_t row = row_id_map[t * slots + s];
      if (row >= 0 && row < rows) {
        routed_rows[k] = row;
        weights[k] = PROBS ? probs[t * slots + s] : 1.0f;
        ++k;
      }
    }
    count = k;
  }
  __syncthreads();
  T* dst = out + t * hidden;
  for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += int64_t(kThreads) * N) {
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.0f;
    for (int j = 0; j < count; ++j) {
      T v[N];
      load<N>(inp + int64_t(routed_rows[j]) * hidden + c, v);
      const float p = weights[j];
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = __fadd_rn(acc[k], PROBS ? __fmul_rn(to_float(v[k]), p) : to_float(v[k]));
    }
    T v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = from_float<T>(acc[k]);
    store<N>(dst + c, v);
  }
}

// d_probs[t, s] = dot(grad_out[t], inp[row_id_map[t, s]]): one warp per slot, lanes over the hidden dim.
template <typename T, int N>
__global__ void __launch_bounds__(kGradThreads)
    merging_probs_grad_kernel(const T* grad_out, const T* inp, const int32_t* row_id_map, float* d_probs, int64_t slots,
                              int64_t rows, int64_t hidden) {
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* g = grad_out + t * hidden;
  for (int64_t s = warp; s < slots; s += kGradThreads / 32) {
    const int32_t row = row_id_map[t * slots + s];
    float sum = 0.0f;
    if (row >= 0 && row < rows) {
      const T* x = inp + int64_t(row) * hidden;
      for (int64_t c = int64_t(lane) * N; c < hidden; c += 32 * N) {
        T a[N], b[N];
        load<N>(g + c, a);
        load<N>(x + c, b);
#pragma unroll
        for (int k = 0; k < N; ++k) sum += to_float(a[k]) * to_float(b[k]);
      }
      for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    if (lane == 0) d_probs[t * slots + s] = sum;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte accesses when the rows and every pointer allow them.
template <typename T>
bool vector_ok(int64_t hidden, std::initializer_list<const void*> pointers) {
  if (hidden * int64_t(sizeof(T)) % 16 != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

template <typename T>
void permute_rows(const void* inp, const int32_t* slot_of_row, const float* probs, void* out, int64_t tokens,
                  int64_t slots, int64_t rows, int64_t hidden, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(inp);
  T* y = static_cast<T*>(out);
  const bool vec = vector_ok<T>(hidden, {inp, out});
  if constexpr (sizeof(T) == 1) {
    if (vec) {
      permute_rows_kernel<T, V, false><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
    } else {
      permute_rows_kernel<T, 1, false><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
    }
  } else if (probs != nullptr) {
    if (vec) {
      permute_rows_kernel<T, V, true><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
    } else {
      permute_rows_kernel<T, 1, true><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
    }
  } else if (vec) {
    permute_rows_kernel<T, V, false><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
  } else {
    permute_rows_kernel<T, 1, false><<<rows, kThreads, 0, stream>>>(x, slot_of_row, probs, y, tokens, slots, hidden);
  }
}

template <typename T>
void unpermute_rows(const void* inp, const int32_t* row_id_map, const float* probs, void* out, int64_t tokens,
                    int64_t slots, int64_t rows, int64_t hidden, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(inp);
  T* y = static_cast<T*>(out);
  const size_t smem = size_t(slots) * (sizeof(int32_t) + sizeof(float));
  if (smem > 48 * 1024) throw std::runtime_error("moe_unpermute_rows: too many slots per token (at most 6144)");
  const bool vec = vector_ok<T>(hidden, {inp, out});
  if (probs != nullptr) {
    if (vec) {
      unpermute_rows_kernel<T, V, true>
          <<<tokens, kThreads, smem, stream>>>(x, row_id_map, probs, y, slots, rows, hidden);
    } else {
      unpermute_rows_kernel<T, 1, true>
          <<<tokens, kThreads, smem, stream>>>(x, row_id_map, probs, y, slots, rows, hidden);
    }
  } else if (vec) {
    unpermute_rows_kernel<T, V, false>
        <<<tokens, kThreads, smem, stream>>>(x, row_id_map, probs, y, slots, rows, hidden);
  } else {
    unpermute_rows_kernel<T, 1, false>
        <<<tokens, kThreads, smem, stream>>>(x, row_id_map, probs, y, slots, rows, hidden);
  }
}

template <typename T>
void merging_probs_grad(const void* grad_out, const void* inp, const int32_t* row_id_map, float* d_probs,
                        int64_t tokens, int64_t slots, int64_t rows, int64_t hidden, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T* g = static_cast<const T*>(grad_out);
  const T* x = static_cast<const T*>(inp);
  if (vector_ok<T>(hidden, {grad_out, inp})) {
    merging_probs_grad_kernel<T, V>
        <<<tokens, kGradThreads, 0, stream>>>(g, x, row_id_map, d_probs, slots, rows, hidden);
  } else {
    merging_probs_grad_kernel<T, 1>
        <<<tokens, kGradThreads, 0, stream>>>(g, x, row_id_map, d_probs, slots, rows, hidden);
  }
}

}  // namespace

void launch_moe_permute_rows(const void* inp, const int32_t* slot_of_row, const float* probs, void* out, int64_t tokens,
                             int64_t slots, int64_t rows, int64_t hidden, DType dtype, cudaStream_t stream) {
  if (rows == 0 || hidden == 0) return;
  switch (dtype) {
    case DType::kFloat32: permute_rows<float>(inp, slot_of_row, probs, out, tokens, slots, rows, hidden, stream); break;
    case DType::kFloat16:
      permute_rows<__half>(inp, slot_of_row, probs, out, tokens, slots, rows, hidden, stream);
      break;
    case DType::kBFloat16:
      permute_rows<__nv_bfloat16>(inp, slot_of_row, probs, out, tokens, slots, rows, hidden, stream);
      break;
    default: permute_rows<uint8_t>(inp, slot_of_row, nullptr, out, tokens, slots, rows, hidden, stream);
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_moe_unpermute_rows(const void* inp, const int32_t* row_id_map, const float* probs, void* out,
                               int64_t tokens, int64_t slots, int64_t rows, int64_t hidden, DType dtype,
                               cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      unpermute_rows<float>(inp, row_id_map, probs, out, tokens, slots, rows, hidden, stream);
      break;
    case DType::kFloat16:
      unpermute_rows<__half>(inp, row_id_map, probs, out, tokens, slots, rows, hidden, stream);
      break;
    case DType::kBFloat16:
      unpermute_rows<__nv_bfloat16>(inp, row_id_map, probs, out, tokens, slots, rows, hidden, stream);
      break;
    default: throw std::runtime_error("moe_unpermute_rows: FP8 rows cannot be summed");
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_moe_merging_probs_grad(const void* grad_out, const void* inp, const int32_t* row_id_map, float* d_probs,
                                   int64_t tokens, int64_t slots, int64_t rows, int64_t hidden, DType dtype,
                                   cudaStream_t stream) {
  if (tokens == 0 || slots == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      merging_probs_grad<float>(grad_out, inp, row_id_map, d_probs, tokens, slots, rows, hidden, stream);
      break;
    case DType::kFloat16:
      merging_probs_grad<__half>(grad_out, inp, row_id_map, d_probs, tokens, slots, rows, hidden, stream);
      break;
    case DType::kBFloat16:
      merging_probs_grad<__nv_bfloat16>(grad_out, inp, row_id_map, d_probs, tokens, slots, rows, hidden, stream);
      break;
    default: throw std::runtime_error("moe_merging_probs_grad: FP8 rows are not supported");
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
