// Elementwise kernels of the quantize family: quantize (+amax, +scale_inv), dequantize, compute_amax.
// Grid-stride loops over 16-element chunks with 16-byte loads and stores; a scalar loop takes the last n % 16
// elements, or all of them when a pointer is not 16-byte aligned (or rows at a stride are not whole chunks).
// quantize and dequantize take their operands as rows at a stride (Rows): element e of the n is at
// (e / cols) * ld + e % cols on each side, e itself where ld == cols.
#include <algorithm>

#include "quantize.h"
#include "quantize_common.cuh"

namespace tfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

// Blocks for `work` items (chunks or elements) of one thread each: enough to fill the GPU, no more.
int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{sm_count()} * kBlocksPerSm)));
}

// Offset of element e of rows of `cols` elements at stride ld.
__device__ __forceinline__ int64_t row_offset(int64_t e, int64_t cols, int64_t ld) {
  return ld == cols ? e : e / cols * ld + e % cols;
}

template <typename T, DType F>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, int64_t n, int64_t n_chunks, Rows rows,
                    const float* __restrict__ scale_ptr, float* amax, float* scale_inv) {
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x, stride = int64_t{gridDim.x} * blockDim.x;
  float local_amax = 0.0f;
  for (int64_t c = first; c < n_chunks; c += stride) {
    T v[kChunk];
    load_chunk(x + row_offset(c * kChunk, rows.cols, rows.ld_in), v);
    uint8_t out[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const float f = to_float(v[k]);
      local_amax = max_abs(local_amax, f);
      out[k] = float_to_fp8<F>(f * scale);
    }
    store_chunk(q + row_offset(c * kChunk, rows.cols, rows.ld_out), out);
  }
  for (int64_t i = n_chunks * kChunk + first; i < n; i += stride) {
    const float f = to_float(x[row_offset(i, rows.cols, rows.ld_in)]);
    local_amax = max_abs(local_amax, f);
    q[row_offset(i, rows.cols, rows.ld_out)] = float_to_fp8<F>(f * scale);
  }
  if (amax != nullptr) block_amax_atomic(local_amax, amax);
}

template <DType F, typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, T* __restrict__ out, int64_t n, int64_t n_chunks, Rows rows,
                      const float* __restrict__ scale_inv_ptr) {
  const float scale_inv = *scale_inv_ptr;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = first; c < n_chunks; c += stride) {
    uint8_t v[kChunk];
    load_chunk(q + row_offset(c * kChunk, rows.cols, rows.ld_in), v);
    T o[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) o[k] = from_float<T>(fp8_to_float<F>(v[k]) * scale_inv);
    store_chunk(out + row_offset(c * kChunk, rows.cols, rows.ld_out), o);
  }
  for (int64_t i = n_chunks * kChunk + first; i < n; i += stride) {
    out[row_offset(i, rows.cols, rows.ld_out)] = from_float<T>(
        fp8_to_float<F>(q[row_offset(i, rows.cols, rows.ld_in)]) * scale_inv);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, int64_t n, int64_t n_chunks, float* amax) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x, stride = int64_t{gridDim.x} * blockDim.x;
  float local_amax = 0.0f;
  for (int64_t c = first; c < n_chunks; c += stride) {
    T v[kChunk];
    load_chunk(x + c * kChunk, v);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) local_amax = max_abs(local_amax, to_float(v[k]));
  }
  for (int64_t i = n_chunks * kChunk + first; i < n; i += stride) local_amax = max_abs(local_amax, to_float(x[i]));
  block_amax_atomic(local_amax, amax);
}

// Chunks the vector loop takes: all whole chunks when both pointers are 16-byte aligned, else none.
int64_t vector_chunks(int64_t n, const void* a, const void* b) { return aligned16(a) && aligned16(b) ? n / kChunk : 0; }

// The same for rows at a stride: whole chunks only when every row is whole chunks that stay 16-byte aligned.
int64_t vector_chunks(int64_t n, Rows rows, const void* a, const void* b) {
  const bool dense = rows.ld_in == rows.cols && rows.ld_out == rows.cols;
  const bool whole = rows.cols % kChunk == 0 && rows.ld_in % kChunk == 0 && rows.ld_out % kChunk == 0;
  return dense || whole ? vector_chunks(n, a, b) : 0;
}

int64_t thread_work(int64_t n, int64_t n_chunks) { return n_chunks > 0 ? n_chunks : n; }

}  // namespace

void launch_quantize(const void* x, uint8_t* q, int64_t n, Rows rows, DType in_type, DType fp8_type, const float* scale,
                     float* amax, float* scale_inv, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t n_chunks = vector_chunks(n, rows, x, q);
  const int grid = grid_for(thread_work(n, n_chunks));
  TFP8_DISPATCH_HIGH_PRECISION(
      in_type, T,
      TFP8_DISPATCH_FP8(fp8_type, F,
                        quantize_kernel<T, F><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), q, n, n_chunks,
                                                                             rows, scale, amax, scale_inv)));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_dequantize(const uint8_t* q, void* out, int64_t n, Rows rows, DType fp8_type, DType out_type,
                       const float* scale_inv, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t n_chunks = vector_chunks(n, rows, q, out);
  const int grid = grid_for(thread_work(n, n_chunks));
  TFP8_DISPATCH_HIGH_PRECISION(out_type, T,
                               TFP8_DISPATCH_FP8(fp8_type, F,
                                                 dequantize_kernel<F, T><<<grid, kThreads, 0, stream>>>(
                                                     q, static_cast<T*>(out), n, n_chunks, rows, scale_inv)));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_compute_amax(const void* x, int64_t n, DType in_type, float* amax, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t n_chunks = vector_chunks(n, x, x);
  const int grid = grid_for(thread_work(n, n_chunks));
  TFP8_DISPATCH_HIGH_PRECISION(
      in_type, T, amax_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, n_chunks, amax));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
