// d(SwiGLU) -> 1x128 block cast with its own transposed tiles, the wide kernel: what dact_block_cast computes for
// SwiGLU (d(input) = [d gate | d up] from grad_out and [gate | up], float32, cast without a high-precision copy),
// bit for bit, on interior problems only (m and f multiples of 128, 16-bit, aligned).
//
// Why a second kernel: block_cast_kernel holds a 128x128 tile as 16 rows x 4 columns per thread of 256; d(SwiGLU)
// needs all 64 float32 results live until the row and column scales are known plus the words of three inputs in
// flight, which caps it at 128 registers and 2 blocks (16 warps) per multiprocessor, too few to keep the memory busy
// through each block's reductions and stores. Here 512 threads share the tile, 8 rows x 4 columns each: half the
// registers per thread, twice the warps per multiprocessor. The math, the tile order and the rounding are those of
// block_cast_kernel with DactLoader (same helpers), so the two kernels write identical bytes; TFP8_BLOCK_DSWIGLU_WIDE=0
// keeps the generic one (the GPU test compares them).
#include <cstdlib>
#include <cstring>

#include "quantize_block_fused.h"
#include "quantize_block_kernel.cuh"

namespace tfp8 {
namespace block {
namespace {

constexpr int kWideThreads = 512;
constexpr int kWideWarps = kWideThreads / 32;
constexpr int kWideRows = kBlockLen / kWideWarps;  // 8 rows of the tile per warp
static_assert(kWideRows == 8, "a thread's 8 rows make one 8-byte column piece of the transposed tile");

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

// Rows row0 .. row0 + 7, columns c .. c + 3 of x (row stride ld): every load issued before the first use.
template <typename T>
__device__ __forceinline__ void load_8_words(const T* x, int64_t row0, int64_t c, int64_t ld,
                                             Word4<T> (&w)[kWideRows]) {
#pragma unroll
  for (int i = 0; i < kWideRows; ++i) w[i] = *reinterpret_cast<const Word4<T>*>(x + (row0 + i) * ld + c);
}

// grid (2f / 128, m / 128); block x -> tile column as DactLoader::column_tile (d gate's column p, then d up's).
template <DType F, typename T>
__global__ void __launch_bounds__(kWideThreads, 2)
    dswiglu_block_cast_wide_kernel(const T* __restrict__ dy, const T* __restrict__ input, int64_t f, BlockCastArgs a) {
  __shared__ float partial[kWideWarps][kBlockLen];  // per-warp column amaxes
  __shared__ float col_scale[kBlockLen];
  __shared__ __align__(16) uint8_t tile_t[kBlockLen * kPitch];  // the transposed tile: row c holds column c
  constexpr float fp8_max = F == DType::kE4M3 ? 448.0f : 57344.0f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row0 = int64_t{blockIdx.y} * kBlockLen + warp * kWideRows;
  const int64_t half_tiles = f / kBlockLen;
  const int64_t bx = blockIdx.x % 2 == 0 ? blockIdx.x / 2 : half_tiles + blockIdx.x / 2;
  const int64_t col0 = bx * kBlockLen + lane * kCols;  // column of d(input) [m, 2f]
  const bool up_half = col0 >= f;
  const int64_t c = up_half ? col0 - f : col0;  // column of dy, gate and up

  float v[kWideRows][kCols];
  {
    Word4<T> d[kWideRows], g[kWideRows];
    load_8_words(dy, row0, c, f, d);
    load_8_words(input, row0, c, 2 * f, g);
    if (up_half) {
#pragma unroll
      for (int i = 0; i < kWideRows; ++i) {
        float dv[kCols], gate[kCols];
        word_floats<T>(d[i], dv);
        word_floats<T>(g[i], gate);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = swiglu_grad(dv[j], gate[j], 0.0f, true);
      }
    } else {
      Word4<T> u[kWideRows];
      load_8_words(input + f, row0, c, 2 * f, u);
#pragma unroll
      for (int i = 0; i < kWideRows; ++i) {
        float dv[kCols], gate[kCols], up[kCols];
        word_floats<T>(d[i], dv);
        word_floats<T>(g[i], gate);
        word_floats<T>(u[i], up);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = swiglu_grad(dv[j], gate[j], up[j], false);
      }
    }
  }
  float row_amax[kWideRows], col_amax[kCols] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kWideRows; ++i) {
    row_amax[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      row_amax[i] = max_abs(row_amax[i], v[i][j]);
      col_amax[j] = max_abs(col_amax[j], v[i][j]);
    }
  }

  float lane_scale = 1.0f, my_col_scale[kCols];
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

  if (a.q != nullptr) {
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) {
      const float rs = __shfl_sync(0xffffffffu, lane_scale, 4 * i);
      const float scale[kCols] = {rs, rs, rs, rs};
      *reinterpret_cast<uint32_t*>(a.q + (row0 + i) * a.k + col0) = pack4<F>(v[i], scale);
    }
  }
  if (a.qt == nullptr) return;
  // Column 4 * lane + j of the tile, rows 8 * warp .. + 7: one 8-byte piece of tile_t's row.
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const float scale[kCols] = {my_col_scale[j], my_col_scale[j], my_col_scale[j], my_col_scale[j]};
    const float low[kCols] = {v[0][j], v[1][j], v[2][j], v[3][j]};
    const float high[kCols] = {v[4][j], v[5][j], v[6][j], v[7][j]};
    *reinterpret_cast<uint2*>(tile_t + (lane * kCols + j) * kPitch + warp * kWideRows) =
        make_uint2(pack4<F>(low, scale), pack4<F>(high, scale));
  }
  __syncthreads();
  // qt rows: tile columns 8 * warp .. + 7; each lane stores 4 bytes (qt columns = rows 4 * lane .. + 3 of the tile).
  const int64_t qt_col = int64_t{blockIdx.y} * kBlockLen + lane * 4;
#pragma unroll
  for (int i = 0; i < kWideRows; ++i) {
    const int tc = warp * kWideRows + i;
    *reinterpret_cast<uint32_t*>(a.qt + (bx * kBlockLen + tc) * a.m + qt_col) =
        *reinterpret_cast<const uint32_t*>(tile_t + tc * kPitch + lane * 4);
  }
}

// Read at each launch (a test switches it within one process).
bool wide_kernel_enabled() {
  const char* value = std::getenv("TFP8_BLOCK_DSWIGLU_WIDE");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

template <typename T>
void launch_typed(const DactBlockCastArgs& p, cudaStream_t stream) {
  const BlockCastArgs& a = p.cast;
  const dim3 grid(static_cast<unsigned>(a.k / kBlockLen), static_cast<unsigned>(a.m / kBlockLen));
  const T* dy = static_cast<const T*>(a.x);
  const T* input = static_cast<const T*>(p.act_input);
  TFP8_DISPATCH_FP8(a.fp8_type, F,
                    dswiglu_block_cast_wide_kernel<F, T><<<grid, kWideThreads, 0, stream>>>(dy, input, p.f, a));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace block

bool launch_dswiglu_block_cast_wide(const DactBlockCastArgs& p, cudaStream_t stream) {
  const BlockCastArgs& a = p.cast;
  const bool fits = !a.two_d && a.col_sums == nullptr && (a.q != nullptr || a.qt != nullptr) &&
                    (a.in_type == DType::kBFloat16 || a.in_type == DType::kFloat16) && a.m > 0 &&
                    a.m % kBlockLen == 0 && p.f > 0 && p.f % kBlockLen == 0 && a.k == 2 * p.f &&
                    a.m / kBlockLen <= 65535 && aligned16(a.x) && aligned16(p.act_input) &&
                    (a.q == nullptr || (aligned16(a.q) && a.scale_ld >= a.m)) &&
                    (a.qt == nullptr || (aligned16(a.qt) && a.scale_t_ld >= a.k));
  if (!fits || !block::wide_kernel_enabled()) return false;
  if (a.in_type == DType::kBFloat16) block::launch_typed<__nv_bfloat16>(p, stream);
  else block::launch_typed<__half>(p, stream);
  return true;
}

}  // namespace tfp8
