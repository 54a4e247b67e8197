// The wide block cast kernel: block_cast_kernel's work (quantize_block_kernel.cuh) on interior problems (m and k
// multiples of 128, aligned) with 512 threads per 128x128 tile instead of 256: warp w holds rows 8w .. 8w + 7, lane l
// columns 4l .. 4l + 3 of each (32 values, not 64). Half the registers per thread, so twice the warps per
// multiprocessor for the casts whose tile filled the register file (d(SwiGLU): 16 warps per SM before, 32 now) and
// more for the plain 16-bit ones, which keeps the memory busy through each block's reductions and stores.
//
// Same math, tile order, reductions (max is exact in any order) and rounding as block_cast_kernel with the
// corresponding loader, so both kernels write the same bytes and scales; TFP8_BLOCK_WIDE=0 keeps the generic kernel
// everywhere (the GPU tests compare the two).
//
// A wide loader: `Tile` (FloatTile8, or PackedTile8<T> for 16-bit values cast as they are), `kMinBlocks` (launch
// bounds), `kTwoDOk`, `load(row0, col, bx, tile)` filling the lane's 8 rows x 4 columns of the (interior) tile in
// tile column bx, and `column_tile(block_x, blocks)` (the tile column block x casts).
#pragma once
#include <cstdlib>
#include <cstring>

#include "quantize_block_kernel.cuh"

namespace tfp8 {
namespace block {

constexpr int kWideThreads = 512;
constexpr int kWideWarps = kWideThreads / 32;
constexpr int kWideRows = kBlockLen / kWideWarps;  // 8 rows of the tile per warp
static_assert(kWideRows == 8, "a thread's 8 rows make one 8-byte piece of a row of the transposed tile");

// TFP8_BLOCK_WIDE: unset or anything but "0" uses the wide kernel where it fits. Read at each launch (a test
// switches it within one process; a getenv is far below a launch's cost).
inline bool wide_kernel_enabled() {
  const char* value = std::getenv("TFP8_BLOCK_WIDE");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// Whether the wide kernel takes a's cast: interior problems only (no edge tiles, so no guarded loads or padding
// scales), pointers 16-byte aligned, no column sums.
inline bool wide_fits(const BlockCastArgs& a, const void* const* inputs, int n_inputs) {
  if (!wide_kernel_enabled() || a.col_sums != nullptr || (a.q == nullptr && a.qt == nullptr)) return false;
  if (a.m <= 0 || a.k <= 0 || a.m % kBlockLen != 0 || a.k % kBlockLen != 0 || a.m / kBlockLen > 65535) return false;
  for (int i = 0; i < n_inputs; ++i)
    if (!aligned16(inputs[i])) return false;
  if (a.q != nullptr && (!aligned16(a.q) || (a.two_d ? a.scale_ld < a.k / kBlockLen : a.scale_ld < a.m))) return false;
  if (a.qt != nullptr && (!aligned16(a.qt) || (a.two_d ? a.scale_t_ld < a.m / kBlockLen : a.scale_t_ld < a.k)))
    return false;
  return true;
}

using FloatTile8 = FloatRows<kWideRows>;
template <typename T>
using PackedTile8 = PackedRows<T, kWideRows>;

// The max over the warp of each of a lane's 8 row amaxes: after three halvings lanes 4r .. 4r + 3 hold partial maxes
// of row r, combined by two shuffles; returns the max of row lane / 4.
__device__ __forceinline__ float warp_max_8_rows(const float (&rows)[kWideRows], int lane) {
  float v4[4], v2[2], v1[1];
  halve<8>(rows, v4, lane, 16);
  halve<4>(v4, v2, lane, 8);
  halve<2>(v2, v1, lane, 4);
  const float m = max_bits(v1[0], __shfl_xor_sync(0xffffffffu, v1[0], 2));
  return max_bits(m, __shfl_xor_sync(0xffffffffu, m, 1));
}

// grid (k / 128, m / 128), kWideThreads threads.
template <DType F, bool kTwoD, typename Loader>
__global__ void __launch_bounds__(kWideThreads, Loader::kMinBlocks)
    block_cast_wide_kernel(Loader loader, BlockCastArgs a) {
  __shared__ float partial[kWideWarps][kBlockLen];  // per-warp column amaxes (1x128), or warp amaxes (128x128)
  __shared__ float col_scale[kBlockLen];
  __shared__ __align__(16) uint8_t tile_t[kBlockLen * kPitch];  // the transposed tile: row c holds column c
  constexpr float fp8_max = F == DType::kE4M3 ? 448.0f : 57344.0f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row0 = int64_t{blockIdx.y} * kBlockLen + warp * kWideRows;
  const int64_t bx = loader.column_tile(blockIdx.x, gridDim.x);
  const int64_t col0 = bx * kBlockLen + lane * kCols;

  typename Loader::Tile v;
  loader.load(row0, col0, bx, v);
  float row_amax[kWideRows], col_amax[kCols] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kWideRows; ++i) {
    row_amax[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      row_amax[i] = max_abs(row_amax[i], v.at(i, j));
      col_amax[j] = max_abs(col_amax[j], v.at(i, j));
    }
  }

  // lane_scale: 128x128, the block's scale; 1x128, the scale of row lane / 4 (shuffled out where it is used)
  float lane_scale = 1.0f, my_col_scale[kCols];
  if constexpr (kTwoD) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) amax = max_abs(amax, row_amax[i]);
    amax = warp_max_nonneg(amax);
    if (lane == 0) partial[warp][0] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWideWarps; ++w) amax = max_abs(amax, partial[w][0]);
    const float scale = tile_scale(amax, fp8_max, a.amax_epsilon, a.power_2_scale);
    if (threadIdx.x == 0) store_block_scales(a, bx, inverse(scale));
    lane_scale = scale;
#pragma unroll
    for (int j = 0; j < kCols; ++j) my_col_scale[j] = scale;
  } else {
    if (a.q != nullptr) {  // lanes 4r .. 4r + 3 find row r's scale, lane 4r writes its scale_inv
      lane_scale = tile_scale(warp_max_8_rows(row_amax, lane), fp8_max, a.amax_epsilon, a.power_2_scale);
      if (lane % 4 == 0) a.scale_inv[bx * a.scale_ld + row0 + lane / 4] = inverse(lane_scale);
    }
    if (a.qt != nullptr) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) partial[warp][lane * kCols + j] = col_amax[j];
      __syncthreads();
      if (threadIdx.x < kBlockLen) {
        float amax = 0.0f;
#pragma unroll
        for (int w = 0; w < kWideWarps; ++w) amax = max_abs(amax, partial[w][threadIdx.x]);
        const float scale = tile_scale(amax, fp8_max, a.amax_epsilon, a.power_2_scale);
        col_scale[threadIdx.x] = scale;
        a.scale_inv_t[int64_t{blockIdx.y} * a.scale_t_ld + bx * kBlockLen + threadIdx.x] = inverse(scale);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kCols; ++j) my_col_scale[j] = col_scale[lane * kCols + j];
    }
  }

  if (a.q != nullptr) {
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) {
      const float rs = kTwoD ? lane_scale : __shfl_sync(0xffffffffu, lane_scale, 4 * i);
      const float scale[kCols] = {rs, rs, rs, rs};
      const float row[kCols] = {v.at(i, 0), v.at(i, 1), v.at(i, 2), v.at(i, 3)};
      *reinterpret_cast<uint32_t*>(a.q + (row0 + i) * a.k + col0) = pack4<F>(row, scale);
    }
  }
  if (a.qt == nullptr) return;
    // Column 4 * lane + j of the tile, rows 8 * warp .. + 7: one 8-byte piece of tile_t's row.
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const float scale[kCols] = {my_col_scale[j], my_col_scale[j], my_col_scale[j], my_col_scale[j]};
    const float low[kCols] = {v.at(0, j), v.at(1, j), v.at(2, j), v.at(3, j)};
    const float high[kCols] = {v.at(4, j), v.at(5, j), v.at(6, j), v.at(7, j)};
    *reinterpret_cast<uint2*>(tile_t + (lane * kCols + j) * kPitch + warp * kWideRows) = make_uint2(
        pack4<F>(low, scale), pack4<F>(high, scale));
  }
  __syncthreads();
  // qt rows: tile columns 8 * warp .. + 7; each lane stores 4 bytes (qt columns = rows 4 * lane .. + 3 of the tile).
  const int64_t qt_col = int64_t{blockIdx.y} * kBlockLen + lane * 4;
#pragma unroll
  for (int i = 0; i < kWideRows; ++i) {
    const int tc = warp * kWideRows + i;
    *reinterpret_cast<uint32_t*>(a.qt + (bx * kBlockLen + tc) * a.m +
                                 qt_col) = *reinterpret_cast<const uint32_t*>(tile_t + tc * kPitch + lane * 4);
  }
}

// Launches block_cast_wide_kernel over a's [m, k] (wide_fits(a) checked by the caller).
template <typename Loader>
void launch_wide(const Loader& loader, const BlockCastArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.k / kBlockLen), static_cast<unsigned>(a.m / kBlockLen));
  if constexpr (Loader::kTwoDOk) {
    if (a.two_d) {
      TFP8_DISPATCH_FP8(a.fp8_type, F,
                        block_cast_wide_kernel<F, true, Loader><<<grid, kWideThreads, 0, stream>>>(loader, a));
      TFP8_CUDA_CHECK(cudaGetLastError());
      return;
    }
  } else {
    if (a.two_d) throw std::invalid_argument("block_cast: a fused cast makes 1x128 tiles only");
  }
  TFP8_DISPATCH_FP8(a.fp8_type, F,
                    block_cast_wide_kernel<F, false, Loader><<<grid, kWideThreads, 0, stream>>>(loader, a));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace block
}  // namespace tfp8
