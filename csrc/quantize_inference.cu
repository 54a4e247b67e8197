// The inference cast (contract: csrc/quantize_inference.h): one launch for what the training path does in two to
// three (compute_amax, delayed_scaling_update, the cast; or the cast and, at the autocast's exit, the update). A small
// FP8 Linear's inference is host-bound, and each launch costs host time.
// Where the bookkeeping needs every block's amax (current scaling's scale before the cast; the delayed update after
// it), the kernel is launched cooperatively (all blocks resident) and waits at grid-wide barriers.
#include <cooperative_groups.h>

#include <algorithm>

#include "quantize_common.cuh"
#include "quantize_inference.h"
#include "scaling_update.cuh"

namespace tfp8 {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = kScalingUpdateThreads;  // (block 0 runs the state update with all its threads)

// The running max|x| over this thread's elements; q written when cast (else only the max is taken).
template <typename T, DType F, bool kCast>
__device__ __forceinline__ float cast_pass(const T* __restrict__ x, uint8_t* __restrict__ q, int64_t n,
                                           int64_t n_chunks, float scale) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x, stride = int64_t{gridDim.x} * blockDim.x;
  float local_amax = 0.0f;
  for (int64_t c = first; c < n_chunks; c += stride) {
    T v[kChunk];
    load_chunk(x + c * kChunk, v);
    uint8_t out[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const float f = to_float(v[k]);
      local_amax = max_abs(local_amax, f);
      if (kCast) out[k] = float_to_fp8<F>(f * scale);
    }
    if (kCast) store_chunk(q + c * kChunk, out);
  }
  for (int64_t i = n_chunks * kChunk + first; i < n; i += stride) {
    const float f = to_float(x[i]);
    local_amax = max_abs(local_amax, f);
    if (kCast) q[i] = float_to_fp8<F>(f * scale);
  }
  return local_amax;
}

// Current scaling's scale from the amax every block has added (delayed_scaling_update of one [1, 1] history with
// margin 0, "most_recent").
__device__ __forceinline__ float current_scale(float amax_raw, float old_scale, float fp8_max) {
  const float amax = sanitize_newest(amax_raw);
  if (amax > 0.0f && isfinite(amax)) {
    const float s = fp8_max / amax / 1.0f;
    if (isfinite(s)) return s;
  }
  return old_scale;
}

template <typename T, DType F>
__global__ void __launch_bounds__(kThreads)
    inference_cast_kernel(const T* __restrict__ x, const InferenceCastArgs a, int64_t n_chunks) {
  __shared__ float block_scale;
  float scale;
  if (a.current) {
    block_amax_atomic(cast_pass<T, F, false>(x, nullptr, a.n, n_chunks, 0.0f), a.amax);
    cg::this_grid().sync();
    if (threadIdx.x == 0) block_scale = current_scale(*reinterpret_cast<volatile float*>(a.amax), *a.scale, a.fp8_max);
    __syncthreads();
    scale = block_scale;
    cg::this_grid().sync();  // every block has read the amax and the old scale before block 0 writes them
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      *a.scale = scale;
      *a.scale_inv = 1.0f / scale;
      *a.amax = 0.0f;
    }
    cast_pass<T, F, true>(x, a.q, a.n, n_chunks, scale);
    return;
  }
  scale = *a.scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale_inv = 1.0f / scale;
  block_amax_atomic(cast_pass<T, F, true>(x, a.q, a.n, n_chunks, scale), a.amax);
  if (a.history == nullptr) return;
  cg::this_grid().sync();  // every block's amax is in history row 0 and every block has read the scale
  if (blockIdx.x != 0) return;
  const int slots = a.slots, last_row = (a.history_len - 1) * slots;
  volatile float* history = a.history;  // (row 0 was written by other blocks' atomics)
  for (int j = threadIdx.x; j < slots; j += kThreads) {
    a.backup[j] = history[j];
    a.backup[slots + j] = history[last_row + j];
    a.backup[2 * slots + j] = a.state_scale[j];
    a.backup[3 * slots + j] = a.state_scale_inv[j];
  }
  __syncthreads();
  update_scaling_entry(a.history, a.state_scale, a.state_scale_inv, a.history_len, slots, a.fp8_max, a.pow2_margin,
                       a.use_max);
}

// The most blocks of inference_cast_kernel<T, F> that fit on the device at once (a cooperative launch's limit),
// asked once per kernel.
template <typename T, DType F>
int resident_blocks() {
  static const int blocks = [] {
    int per_sm = 0;
    TFP8_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, inference_cast_kernel<T, F>, kThreads, 0));
    return std::max(1, per_sm) * sm_count();
  }();
  return blocks;
}

template <typename T, DType F>
void launch(const InferenceCastArgs& a, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.x);
  int64_t n_chunks = aligned16(a.x) && aligned16(a.q) ? a.n / kChunk : 0;
  const int64_t work = n_chunks > 0 ? n_chunks : a.n;
  auto kernel = inference_cast_kernel<T, F>;
  const int64_t wanted = std::max<int64_t>(1, (work + kThreads - 1) / kThreads);
  const int grid = static_cast<int>(std::min<int64_t>(wanted, resident_blocks<T, F>()));
  if (!a.current && a.history == nullptr) {  // (no barrier: an ordinary launch)
    kernel<<<grid, kThreads, 0, stream>>>(x, a, n_chunks);
  } else {
    void* params[] = {const_cast<T**>(&x), const_cast<InferenceCastArgs*>(&a), &n_chunks};
    TFP8_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(kThreads),
                                                params, 0, stream));
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_inference_cast(const InferenceCastArgs& args, cudaStream_t stream) {
  if (args.n == 0) return;
  TFP8_DISPATCH_HIGH_PRECISION(args.in_type, T, TFP8_DISPATCH_FP8(args.fp8_type, F, launch<T, F>(args, stream)));
}

}  // namespace tfp8
