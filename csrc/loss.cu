// cross_entropy_chunk: the loss and d(loss)/d(logits) of a chunk of float32 logits in two passes over each row.
//
// One block per row. Pass 1 reads the row once (16-byte loads where the row allows) keeping a running (max, sum of
// exp(x - max)) per thread, merged over the block; pass 2 reads it again and writes exp(x - lse) in the gradient's
// dtype, the target column as exp(x - lse) - 1 rounded once. The row is re-read from L2 where it fits (a 32000-class
// row is 125 KiB). exp is the accurate expf: the kernel is bound by memory, not arithmetic. A row whose target is
// ignore_index is not read: its loss is 0 and its gradient row zeros, so the GEMMs that take dlogits need no mask.
#include <cmath>
#include <cstdio>

#include "loss.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max;
  float sum;  // of exp(x - max)
};

// The pair for the union of two sets of values (an empty set is {-inf, 0}).
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ MaxSum add_value(MaxSum acc, float x) {
  if (x > acc.max) return {x, acc.sum * expf(acc.max - x) + 1.0f};  // (NaN fails both tests: see below)
  if (x == x) return {acc.max, acc.sum + expf(x - acc.max)};
  return {x, x};  // a NaN poisons the row's loss and gradient, as log_softmax does
}

__device__ __forceinline__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  MaxSum all = partial[0];
  for (int w = 1; w < kThreads / 32; ++w) all = merge(all, partial[w]);
  return all;
}

template <typename G, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_chunk_kernel(const float* __restrict__ logits, int64_t cols, int64_t ld,
                               const int64_t* __restrict__ targets, int64_t ignore_index, float* __restrict__ loss_rows,
                               G* __restrict__ dlogits) {
  const int64_t row = blockIdx.x;
  const float* x = logits + row * ld;
  const int64_t target = targets[row];
  if (target == ignore_index) {
    if (threadIdx.x == 0) loss_rows[row] = 0.0f;
    if (dlogits != nullptr) {
      G* d = dlogits + row * cols;
      for (int64_t c = threadIdx.x; c < cols; c += kThreads) d[c] = from_float<G>(0.0f);
    }
    return;
  }
  MaxSum acc{-INFINITY, 0.0f};
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(kThreads) * VEC) {
    if constexpr (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(x + c);
      acc = add_value(add_value(add_value(add_value(acc, v.x), v.y), v.z), v.w);
    } else {
      acc = add_value(acc, x[c]);
    }
  }
  const MaxSum all = block_merge(acc);
  const float lse = all.max + logf(all.sum);
  if (target < 0 || target >= cols) {  // (as torch's gather on CUDA: a device-side error, not a guess)
    if (threadIdx.x == 0)
      printf("cross_entropy_chunk: target %lld of row %lld is outside [0, %lld) and not ignore_index %lld\n",
             static_cast<long long>(target), static_cast<long long>(row), static_cast<long long>(cols),
             static_cast<long long>(ignore_index));
    __trap();
  }
  if (threadIdx.x == 0) loss_rows[row] = lse - x[target];
  if (dlogits == nullptr) return;
  G* d = dlogits + row * cols;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(kThreads) * VEC) {
    float p[VEC];
    if constexpr (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(x + c);
      p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
    } else {
      p[0] = x[c];
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      p[k] = expf(p[k] - lse);
      if (c + k == target) p[k] -= 1.0f;
    }
    if constexpr (VEC == 4) {
      struct alignas(4 * sizeof(G)) Quad {
        G v[4];
      } q;
#pragma unroll
      for (int k = 0; k < 4; ++k) q.v[k] = from_float<G>(p[k]);
      *reinterpret_cast<Quad*>(d + c) = q;
    } else {
      d[c] = from_float<G>(p[0]);
    }
  }
}

template <typename G>
void launch(const float* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* targets, int64_t ignore_index,
            float* loss_rows, G* dlogits, cudaStream_t stream) {
  const bool vec4 = cols % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dlogits) % (4 * sizeof(G)) == 0;
  if (vec4) {
    cross_entropy_chunk_kernel<G, 4><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        logits, cols, ld, targets, ignore_index, loss_rows, dlogits);
  } else {
    cross_entropy_chunk_kernel<G, 1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        logits, cols, ld, targets, ignore_index, loss_rows, dlogits);
  }
}

}  // namespace

void launch_cross_entropy_chunk(const float* logits, int64_t rows, int64_t cols, int64_t ld, const int64_t* targets,
                                int64_t ignore_index, float* loss_rows, void* dlogits, DType grad_dtype,
                                cudaStream_t stream) {
  if (rows == 0) return;
  switch (grad_dtype) {
    case DType::kFloat32:
      launch(logits, rows, cols, ld, targets, ignore_index, loss_rows, static_cast<float*>(dlogits), stream);
      break;
    case DType::kFloat16:
      launch(logits, rows, cols, ld, targets, ignore_index, loss_rows, static_cast<__half*>(dlogits), stream);
      break;
    case DType::kBFloat16:
      launch(logits, rows, cols, ld, targets, ignore_index, loss_rows, static_cast<__nv_bfloat16*>(dlogits), stream);
      break;
    default: throw std::invalid_argument("grad_dtype: expected float32, float16 or bfloat16");
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
