// LayerNorm / RMSNorm forward fused with the 1x128 block cast (norm_block_cast): a row-statistics kernel (one warp
// per row, two passes over the row: the mean, then the mean of squared deviations, as norm_fwd.cu), then the block
// cast kernel normalising each value as it loads it. The normalised tensor is never stored in high precision: x is
// read twice (statistics, cast) instead of norm -> y -> cast's four passes, and no y buffer is allocated.
#include "quantize_block_fused.h"
#include "quantize_block_kernel.cuh"
#include "quantize_block_wide.cuh"

namespace tfp8 {
namespace {

using namespace block;

constexpr int kStatsWarps = 8;  // rows per statistics block

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over row r [k] of f(value), the lane's share: 16-byte loads when vec (k a multiple of the 16-byte element
// count, r 16-byte aligned), else one element at a time.
template <typename T, typename F>
__device__ __forceinline__ float lane_sum(const T* r, int64_t k, bool vec, int lane, F f) {
  constexpr int kVec = 16 / sizeof(T);
  float sum = 0.0f;
  if (vec) {
    for (int64_t c = int64_t{lane} * kVec; c < k; c += 32 * kVec) {
      T t[kVec];
      const uint4 w = *reinterpret_cast<const uint4*>(r + c);
      memcpy(t, &w, sizeof(w));
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum += f(to_float(t[i]));
    }
  } else {
    for (int64_t c = lane; c < k; c += 32) sum += f(to_float(r[c]));
  }
  return sum;
}

template <typename T, bool kLayerNorm>
__global__ void __launch_bounds__(kStatsWarps * 32)
    row_stats_kernel(const T* __restrict__ x, int64_t m, int64_t k, float eps, bool vec, float* __restrict__ mean,
                     float* __restrict__ rstd) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kStatsWarps + threadIdx.x / 32;
  if (row >= m) return;
  const T* r = x + row * k;
  const float cols = static_cast<float>(k);
  float mu = 0.0f;  // RMSNorm: 0, so the squared deviations are the squares
  if constexpr (kLayerNorm) mu = warp_sum(lane_sum(r, k, vec, lane, [](float v) { return v; })) / cols;
  const float sq = warp_sum(lane_sum(r, k, vec, lane, [mu](float v) { return (v - mu) * (v - mu); }));
  if (lane == 0) {
    if constexpr (kLayerNorm) mean[row] = mu;
    rstd[row] = 1.0f / sqrtf(sq / cols + eps);
  }
}

// y = ((x - mean) * rstd) * (gamma + offset) [+ beta] of one element (norm_fwd.cu's order, no fused multiply-adds).
__device__ __forceinline__ float normalized(float x, float mu, float rs, float g, float b, bool has_beta) {
  const float y = __fmul_rn(__fmul_rn(x - mu, rs), g);
  return has_beta ? __fadd_rn(y, b) : y;
}

// What both norm loaders read: x [m, k], gamma / beta [k], mean / rstd [m] from row_stats_kernel.
template <typename T, typename W>
struct NormInputs {
  const T* x;
  const W* gamma;
  const W* beta;  // null: none
  const float* mean;
  const float* rstd;
  float gamma_offset;
};

// Loads y = normalized(x).
template <typename T, typename W, bool kLayerNorm>
struct NormLoader : NormInputs<T, W> {
  static constexpr bool kTwoDOk = false;
  bool vec;
  using NormInputs<T, W>::x, NormInputs<T, W>::gamma, NormInputs<T, W>::beta, NormInputs<T, W>::mean,
      NormInputs<T, W>::rstd, NormInputs<T, W>::gamma_offset;

  __device__ __forceinline__ void load(const BlockCastArgs& a, int64_t row0, int64_t col, bool interior,
                                       float (&v)[kRows][kCols]) const {
    float g[kCols], b[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const bool in = col + j < a.k;
      g[j] = in ? __fadd_rn(to_float(gamma[col + j]), gamma_offset) : 0.0f;
      b[j] = in && beta != nullptr ? to_float(beta[col + j]) : 0.0f;
    }
    if (interior) {  // (every word and row statistic in flight before the first use: see load_words)
      Word4<T> w[kRows];
      float mu[kRows], rs[kRows];
      load_words(x, row0, col, a.k, w);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        mu[i] = kLayerNorm ? mean[row0 + i] : 0.0f;
        rs[i] = rstd[row0 + i];
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        word_floats<T>(w[i], v[i]);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = normalized(v[i][j], mu[i], rs[i], g[j], b[j], beta != nullptr);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {  // (edge tiles row by row: see load_row)
      const int64_t row = row0 + i;
      const bool in_row = row < a.m;
      load_row(x, a.m, a.k, a.k, row, col, vec, interior, v[i]);
      const float mu = kLayerNorm && in_row ? mean[row] : 0.0f, rs = in_row ? rstd[row] : 0.0f;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const float y = normalized(v[i][j], mu, rs, g[j], b[j], beta != nullptr);
        v[i][j] = in_row && col + j < a.k ? y : 0.0f;  // (the padding stays out of every amax)
      }
    }
  }
};

// NormLoader's interior tiles on the wide kernel (quantize_block_wide.cuh): the same math on 8 rows per warp.
template <typename T, typename W, bool kLayerNorm>
struct NormWideLoader : NormInputs<T, W> {
  using Tile = FloatTile8;
  static constexpr int kMinBlocks = 2;
  static constexpr bool kTwoDOk = false;
  int64_t k;
  using NormInputs<T, W>::x, NormInputs<T, W>::gamma, NormInputs<T, W>::beta, NormInputs<T, W>::mean,
      NormInputs<T, W>::rstd, NormInputs<T, W>::gamma_offset;

  __device__ __forceinline__ int64_t column_tile(unsigned block_x, unsigned) const { return block_x; }

  __device__ __forceinline__ void load(int64_t row0, int64_t col, int64_t, FloatTile8& tile) const {
    Word4<T> w[kWideRows];
    float mu[kWideRows], rs[kWideRows], g[kCols], b[kCols];
    load_words(x, row0, col, k, w);
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) {
      mu[i] = kLayerNorm ? mean[row0 + i] : 0.0f;
      rs[i] = rstd[row0 + i];
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      g[j] = __fadd_rn(to_float(gamma[col + j]), gamma_offset);
      b[j] = beta != nullptr ? to_float(beta[col + j]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) {
      word_floats<T>(w[i], tile.v[i]);
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        tile.v[i][j] = normalized(tile.v[i][j], mu[i], rs[i], g[j], b[j], beta != nullptr);
    }
  }
};

template <typename T, typename W, bool kLayerNorm>
void launch_typed(const NormBlockCastArgs& p, cudaStream_t stream) {
  const BlockCastArgs& a = p.cast;
  const T* x = static_cast<const T*>(a.x);
  constexpr int kVec = 16 / sizeof(T);
  const bool stats_vec = a.k % kVec == 0 && aligned16(x);
  const unsigned blocks = static_cast<unsigned>((a.m + kStatsWarps - 1) / kStatsWarps);
  row_stats_kernel<T, kLayerNorm>
      <<<blocks, kStatsWarps * 32, 0, stream>>>(x, a.m, a.k, p.eps, stats_vec, p.mean, p.rstd);
  TFP8_CUDA_CHECK(cudaGetLastError());
  const NormInputs<T, W> inputs{
      x, static_cast<const W*>(p.weight), static_cast<const W*>(p.bias), p.mean, p.rstd, p.gamma_offset};
  if constexpr (sizeof(T) == 2) {
    const void* read[1] = {x};
    if (wide_fits(a, read, 1)) {
      const NormWideLoader<T, W, kLayerNorm> wide{inputs, a.k};
      launch_wide(wide, a, stream);
      return;
    }
  }
  const NormLoader<T, W, kLayerNorm> loader{inputs, a.k % kCols == 0 && aligned16(x)};
  launch_with_loader(loader, a, stream);
}

template <typename T, typename W>
void launch_norm(const NormBlockCastArgs& p, cudaStream_t stream) {
  if (p.layernorm) launch_typed<T, W, true>(p, stream);
  else launch_typed<T, W, false>(p, stream);
}

}  // namespace

void launch_norm_block_cast(const NormBlockCastArgs& p, cudaStream_t stream) {
  const BlockCastArgs& a = p.cast;
  if (a.m == 0 || a.k == 0) return;
  if (a.two_d) throw std::invalid_argument("norm_block_cast: 1x128 tiles only");
  if (p.weight_type != a.in_type && p.weight_type != DType::kFloat32)
    throw std::invalid_argument("norm_block_cast: the weight must be of the input's dtype or float32");
  TFP8_DISPATCH_HIGH_PRECISION(a.in_type, T, if (p.weight_type == a.in_type) launch_norm<T, T>(p, stream);
                               else launch_norm<T, float>(p, stream););
}

}  // namespace tfp8
