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

// grid (k / 128, m / 128), kWideThreads threads.
template <DType F, bool kTwoD, typename Loader>
__global__ void __launch_bounds__(kWideThreads, Loader::kMinBlocks)
    block_cast_wide_kernel(Loader loader, BlockCastArgs a) {
  __shared__ float partial[kWideWarps][kBlockLen];  // per-warp column amaxes (1x128), or warp amaxes (128x128)
  __shared__ float col_scale[kBlockLen];
  __shared__ __align__(16) uint8_t tile_t[kBlockLen * kPitch];  // the transposed tile: row c holds column c
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row0 = int64_t{blockIdx.y} * kBlockLen + warp * kWideRows;
  const int64_t bx = loader.column_tile(blockIdx.x, gridDim.x);
  const int64_t col0 = bx * kBlockLen + lane * kCols;

  typename Loader::Tile v;
  loader.load(row0, col0, bx, v);
  cast_tile<F, kTwoD, false, kWideWarps, kWideRows>(a, v, row0, col0, bx, partial, col_scale, tile_t);
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
