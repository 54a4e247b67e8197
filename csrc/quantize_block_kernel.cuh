// The block-scaled FP8 cast kernel (recipe Float8BlockScaling), shared by block_cast and the fused casts that
// compute what they cast while loading it (activation, norm, activation gradient): layouts in
// transformer_fp8/quantization/block.py.
//
// One block of 256 threads per 128x128 tile of the values cast. Warp w holds rows 16w .. 16w + 15 of the tile, lane l
// columns 4l .. 4l + 3 of each, in registers (64 values). Row amaxes (1x128 tiles of q) are warp reductions; column
// amaxes (1x128 tiles of qt, along m) reduce the lane's 16 rows, then the 8 warps through shared memory; the block
// amax (128x128) reduces everything. q is stored from registers (4 bytes per lane and row: 128-byte rows per warp);
// qt goes through a shared byte tile, written as 16-byte columns (the 16 rows a thread holds) and read back as rows.
//
// A Loader says what is cast: `bool vec` (interior tiles may use its unguarded vector loads) and
// `load(a, row0, col, interior, v)` filling v[i][j] with the float value at row row0 + i, column col + j of the [m, k]
// matrix cast, 0 past its edges (so padding rows and columns do not touch any amax).
#pragma once
#include <cfloat>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "quantize.h"
#include "quantize_common.cuh"

namespace tfp8 {
namespace block {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kBlockLen / kWarps;  // 16 rows of the tile per warp
constexpr int kCols = kBlockLen / 32;      // 4 columns per lane
constexpr int kPitch = kBlockLen + 16;     // bytes per row of the shared transposed tile (16-byte aligned rows)
static_assert(kRows == 16 && kCols == 4, "a thread's 16 rows make one 16-byte column of the transposed tile");

// The scale of a tile from its amax (TE's rule): amax floored at epsilon; 1 for a zero, Inf or NaN amax; fp8_max /
// amax, float32 max when that overflows; with power_2 the mantissa bits cleared (rounded down to a power of two).
__device__ __forceinline__ float tile_scale(float amax, float fp8_max, float epsilon, bool power_2) {
  if (amax < epsilon) amax = epsilon;  // (false for NaN: it stays NaN)
  if (amax == 0.0f || isinf(amax) || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = FLT_MAX;
  if (power_2) scale = __int_as_float(__float_as_int(scale) & 0xFF800000);
  return scale;
}

__device__ __forceinline__ float inverse(float scale) { return __fdiv_rn(1.0f, scale); }

__device__ __forceinline__ float max_bits(float a, float b) {  // max of |x| values (int order: NaN wins)
  return __int_as_float(max(__float_as_int(a), __float_as_int(b)));
}

// Swaps half of n values with the lane `offset` away and keeps the max of the other half: after it, value j of this
// lane belongs to row (lane & offset ? n / 2 : 0) + j of the n it held.
template <int kN>
__device__ __forceinline__ void halve(const float (&in)[kN], float (&out)[kN / 2], int lane, int offset) {
  const bool upper = lane & offset;
#pragma unroll
  for (int j = 0; j < kN / 2; ++j) {
    const float send = upper ? in[j] : in[j + kN / 2], keep = upper ? in[j + kN / 2] : in[j];
    out[j] = max_bits(keep, __shfl_xor_sync(0xffffffffu, send, offset));
  }
}

// The max over the warp of each of a lane's 16 row amaxes in 16 shuffles (not 16 x 5): returns the max of row
// lane / 2 (lanes 2i and 2i + 1 both hold row i's).
__device__ __forceinline__ float warp_max_rows(const float (&rows)[kRows], int lane) {
  float v8[8], v4[4], v2[2], v1[1];
  halve<16>(rows, v8, lane, 16);
  halve<8>(v8, v4, lane, 8);
  halve<4>(v4, v2, lane, 4);
  halve<2>(v2, v1, lane, 2);
  return max_bits(v1[0], __shfl_xor_sync(0xffffffffu, v1[0], 1));
}

// Columns col .. col + 3 of row `row` of x [m, k] as float (zeros past the edges). vec: k % 4 == 0 and x 16-byte
// aligned, so 4 in-bounds elements are one aligned 8- or 16-byte load.
template <typename T>
__device__ __forceinline__ void load4(const T* x, int64_t row, int64_t col, int64_t m, int64_t k, int64_t ld, bool vec,
                                      float (&v)[kCols]) {
#pragma unroll
  for (int j = 0; j < kCols; ++j) v[j] = 0.0f;
  if (row >= m) return;
  const T* p = x + row * ld + col;
  if (vec && col + kCols <= k) {
    T t[kCols];
    if constexpr (sizeof(T) == 4) {
      const float4 w = *reinterpret_cast<const float4*>(p);
      memcpy(t, &w, sizeof(w));
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      memcpy(t, &w, sizeof(w));
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) v[j] = to_float(t[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j)
    if (col + j < k) v[j] = to_float(p[j]);
}

// The 4 elements of T a lane loads per row, as one aligned word (8 or 16 bytes).
template <typename T>
using Word4 = std::conditional_t<sizeof(T) == 4, float4, uint2>;

// The lane's kN words (4 elements each) of an interior tile of x (in bounds, vec), rows row0 .. row0 + kN - 1: all
// loads issued back to back, none used yet. Loaders of interior tiles fetch every input this way before computing
// anything: a load behind a per-row branch or a use waits for the one before it, and a warp with one or two loads in
// flight at a time leaves the memory system idle (the fused casts' first loaders went row by row and ran at a third
// of the plain cast's bandwidth).
template <typename T, int kN>
__device__ __forceinline__ void load_words(const T* x, int64_t row0, int64_t col, int64_t ld, Word4<T> (&w)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) w[i] = *reinterpret_cast<const Word4<T>*>(x + (row0 + i) * ld + col);
}

// The 4 elements of a word as float.
template <typename T>
__device__ __forceinline__ void word_floats(const Word4<T>& w, float (&v)[kCols]) {
  T t[kCols];
  memcpy(t, &w, sizeof(w));
#pragma unroll
  for (int j = 0; j < kCols; ++j) v[j] = to_float(t[j]);
}

// The values a thread casts (rows row0 .. row0 + 15, columns col .. col + 3 of the tile), as the kernel reads them:
// at(i, j). FloatTile holds float32 (what a loader computed); PackedTile<T> holds 16-bit input as loaded and
// converts at each read (exact, a few integer instructions): half the registers, so that a plain cast of 16-bit data
// fits 3 blocks per multiprocessor instead of 2, more loads in flight and more blocks to overlap each other's
// reductions and stores.
// (kN rows: 16 in block_cast_kernel, 8 in the wide kernel of quantize_block_wide.cuh)
template <int kN>
struct FloatRows {
  float v[kN][kCols];
  __device__ __forceinline__ float at(int i, int j) const { return v[i][j]; }
};
using FloatTile = FloatRows<kRows>;

// Element `half` (0: low 16 bits, 1: high) of a word of two 16-bit values as float. Volatile assembly: the compiler
// may neither merge two conversions of one element nor hoist them, which would keep all 64 floats live again (at 80
// registers they spilled).
template <typename T>
__device__ __forceinline__ float unpack16(uint32_t word, int half) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    uint32_t bits;
    if (half == 0) asm volatile("shl.b32 %0, %1, 16;" : "=r"(bits) : "r"(word));
    else asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(bits) : "r"(word));
    return __uint_as_float(bits);
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit values: bfloat16 or half");
    float out;
    const unsigned short h = static_cast<unsigned short>(half == 0 ? word : word >> 16);
    asm volatile("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(h));
    return out;
  }
}

template <typename T, int kN>
struct PackedRows {
  Word4<T> w[kN];
  __device__ __forceinline__ float at(int i, int j) const { return unpack16<T>(j < 2 ? w[i].x : w[i].y, j % 2); }
};
template <typename T>
using PackedTile = PackedRows<T, kRows>;

// A loader's tile type (`using Tile = ...`; FloatTile when it names none, its load then filling a float array) and
// its blocks per multiprocessor (the kernel's launch bounds).
template <typename L, typename = void>
struct TileOf {
  using type = FloatTile;
};
template <typename L>
struct TileOf<L, std::void_t<typename L::Tile>> {
  using type = typename L::Tile;
};

template <typename Loader>
__device__ __forceinline__ void load_tile(const Loader& loader, const BlockCastArgs& a, int64_t row0, int64_t col,
                                          bool interior, FloatTile& tile) {
  loader.load(a, row0, col, interior, tile.v);
}

template <typename Loader, typename T>
__device__ __forceinline__ void load_tile(const Loader& loader, const BlockCastArgs& a, int64_t row0, int64_t col,
                                          bool interior, PackedTile<T>& tile) {
  loader.load_packed(a, row0, col, interior, tile);
}

// All kRows rows of a lane of an interior tile (in bounds, vec) as float, from load_words.
template <typename T>
__device__ __forceinline__ void load_interior(const T* x, int64_t row0, int64_t col, int64_t ld,
                                              float (&v)[kRows][kCols]) {
  Word4<T> words[kRows];
  load_words(x, row0, col, ld, words);
#pragma unroll
  for (int i = 0; i < kRows; ++i) word_floats<T>(words[i], v[i]);
}

// SwiGLU's sigmoid from the hardware exponential and reciprocal (__expf, __fdividef: a few float32 ulps from
// act::sigmoid's expf and IEEE division, far below an FP8 step). With the accurate ones, the loaders that evaluate
// it were latency-bound at the cast kernel's occupancy (H200: the d(SwiGLU) cast 0.9 ms per 8192 x 16384 call,
// activation_bwd plus a plain cast 0.48 ms).
__device__ __forceinline__ float fast_sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// act::swiglu_backward's d gate (up_half false) or d up (true) of one element, with fast_sigmoid: the d(SwiGLU) casts'
// one formula (up is not read for d up).
__device__ __forceinline__ float swiglu_grad(float dy, float gate, float up, bool up_half) {
  const float sig = fast_sigmoid(gate);
  return up_half ? dy * gate * sig : dy * up * sig * (1.0f + gate * (1.0f - sig));
}

// One row of a lane's 4 columns of d up (from dy's and gate's words) or of d gate (also up's words), as float.
template <typename T>
__device__ __forceinline__ void dswiglu_up_row(const Word4<T>& d, const Word4<T>& g, float (&v)[kCols]) {
  float dv[kCols], gate[kCols];
  word_floats<T>(d, dv);
  word_floats<T>(g, gate);
#pragma unroll
  for (int j = 0; j < kCols; ++j) v[j] = swiglu_grad(dv[j], gate[j], 0.0f, true);
}

template <typename T>
__device__ __forceinline__ void dswiglu_gate_row(const Word4<T>& d, const Word4<T>& g, const Word4<T>& u,
                                                 float (&v)[kCols]) {
  float dv[kCols], gate[kCols], up[kCols];
  word_floats<T>(d, dv);
  word_floats<T>(g, gate);
  word_floats<T>(u, up);
#pragma unroll
  for (int j = 0; j < kCols; ++j) v[j] = swiglu_grad(dv[j], gate[j], up[j], false);
}

// Row `row`, columns col .. col + 3 of a [rows, cols] matrix x with row stride ld, as float: one unguarded word when
// interior (the tile in bounds, vec), else load4. Loaders that combine several inputs per element go row by row
// with it, so that only one row of each extra input is live (all 16 rows of three inputs took 218 registers).
template <typename T>
__device__ __forceinline__ void load_row(const T* x, int64_t rows, int64_t cols, int64_t ld, int64_t row, int64_t col,
                                         bool vec, bool interior, float (&v)[kCols]) {
  if (interior) {
    const Word4<T> w = *reinterpret_cast<const Word4<T>*>(x + row * ld + col);
    T t[kCols];
    memcpy(t, &w, sizeof(w));
#pragma unroll
    for (int j = 0; j < kCols; ++j) v[j] = to_float(t[j]);
  } else {
    load4(x, row, col, rows, cols, ld, vec, v);
  }
}

// The lane's 16 rows x 4 columns of a [rows, cols] matrix x with row stride ld, as float (zeros past the edges).
// The lane's 16 rows x 4 columns of 16-bit x [rows, cols] as loaded (zeros past the edges; vec as load4's).
template <typename T>
__device__ __forceinline__ void load_packed_rows(const T* x, int64_t rows, int64_t cols, int64_t ld, int64_t row0,
                                                 int64_t col, bool vec, bool interior, PackedTile<T>& tile) {
  static_assert(sizeof(T) == 2, "PackedTile holds 16-bit values");
  if (interior) {
    load_words(x, row0, col, ld, tile.w);
    return;
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float v[kCols];
    load4(x, row0 + i, col, rows, cols, ld, vec, v);
    T t[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) t[j] = from_float<T>(v[j]);  // (exact: v holds values of T, or 0)
    memcpy(&tile.w[i], t, sizeof(t));
  }
}

template <typename T>
__device__ __forceinline__ void load_rows(const T* x, int64_t rows, int64_t cols, int64_t ld, int64_t row0, int64_t col,
                                          bool vec, bool interior, float (&v)[kRows][kCols]) {
  if (interior) {
    load_interior(x, row0, col, ld, v);
  } else {
#pragma unroll
    for (int i = 0; i < kRows; ++i) load4(x, row0 + i, col, rows, cols, ld, vec, v[i]);
  }
}

// 4 bytes to row `row`, columns col .. col + 3, of an FP8 matrix [rows, cols] (guarded at the edges).
__device__ __forceinline__ void store4(uint8_t* out, int64_t row, int64_t col, int64_t rows, int64_t cols,
                                       uint32_t word) {
  if (row >= rows) return;
  uint8_t* p = out + row * cols + col;
  if (cols % 4 == 0 && col + 4 <= cols) {
    *reinterpret_cast<uint32_t*>(p) = word;
    return;
  }
  for (int j = 0; j < 4 && col + j < cols; ++j) p[j] = static_cast<uint8_t>(word >> (8 * j));
}

template <DType F>
__device__ __forceinline__ uint32_t pack4(const float (&v)[kCols], const float (&scale)[kCols]) {
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < kCols; ++j) word |= uint32_t{float_to_fp8<F>(v[j] * scale[j])} << (8 * j);
  return word;
}

// Writes scale_inv values of the 128x128 block (blockIdx.y, bx) into both layouts, and the padding entries right of the
// last block of a row (value 1).
__device__ __forceinline__ void store_block_scales(const BlockCastArgs& a, int64_t bx, float scale_inv) {
  const int64_t by = blockIdx.y;
  if (a.scale_inv != nullptr) {
    a.scale_inv[by * a.scale_ld + bx] = scale_inv;
    if (bx == gridDim.x - 1)
      for (int64_t j = bx + 1; j < a.scale_ld; ++j) a.scale_inv[by * a.scale_ld + j] = 1.0f;
  }
  if (a.scale_inv_t != nullptr) {
    a.scale_inv_t[bx * a.scale_t_ld + by] = scale_inv;
    if (by == gridDim.y - 1)
      for (int64_t i = by + 1; i < a.scale_t_ld; ++i) a.scale_inv_t[bx * a.scale_t_ld + i] = 1.0f;
  }
}

// The tile's column sums of the values cast (float32, rows in order within a warp, then warps in order) to
// a.col_sums[blockIdx.y * a.k + column] (bx: the tile column): the per-tile partials of a bias gradient. Uses
// `scratch` and leaves it free.
template <typename Tile>
__device__ __forceinline__ void write_column_sums(const BlockCastArgs& a, int64_t bx, const Tile& v,
                                                  float (&scratch)[kWarps][kBlockLen]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) sum += v.at(i, j);
    scratch[warp][lane * kCols + j] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kBlockLen) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += scratch[w][threadIdx.x];
    const int64_t col = bx * kBlockLen + threadIdx.x;
    if (col < a.k) a.col_sums[int64_t{blockIdx.y} * a.k + col] = sum;
  }
  __syncthreads();
}

// A loader may order the tile columns (`int64_t column_tile(unsigned block_x, unsigned blocks) const`: a permutation of
// 0 .. blocks - 1), so that blocks that read the same inputs run side by side and the second read comes from L2;
// without it, block x casts tile column x.
template <typename L, typename = void>
struct HasColumnTile : std::false_type {};
template <typename L>
struct HasColumnTile<L, std::void_t<decltype(std::declval<const L&>().column_tile(0u, 1u))>> : std::true_type {};

template <typename Loader>
__device__ __forceinline__ int64_t column_tile(const Loader& loader, unsigned block_x) {
  if constexpr (HasColumnTile<Loader>::value) return loader.column_tile(block_x, gridDim.x);
  else return block_x;
}

template <typename L, typename = void>
struct MinBlocksOf : std::integral_constant<int, 2> {};
template <typename L>
struct MinBlocksOf<L, std::void_t<decltype(L::kMinBlocks)>> : std::integral_constant<int, L::kMinBlocks> {};

// The max over the warp of each of a lane's 8 row amaxes (the wide kernel's rows): after three halvings lanes 4r ..
// 4r + 3 hold partial maxes of row r, combined by two shuffles; returns the max of row lane / 4.
__device__ __forceinline__ float warp_max_8_rows(const float (&rows)[8], int lane) {
  float v4[4], v2[2], v1[1];
  halve<8>(rows, v4, lane, 16);
  halve<4>(v4, v2, lane, 8);
  halve<2>(v2, v1, lane, 4);
  const float m = max_bits(v1[0], __shfl_xor_sync(0xffffffffu, v1[0], 2));
  return max_bits(m, __shfl_xor_sync(0xffffffffu, m, 1));
}

// What a block does with its tile once loaded, shared by block_cast_kernel and block_cast_wide_kernel
// (quantize_block_wide.cuh): kNumWarps warps of kN rows each hold the 128x128 tile v (lane l: columns 4l .. 4l + 3,
// rows row0 .. row0 + kN - 1). Finds the row / column / block amaxes and scales, writes scale_inv (and its
// transposed layout), q from registers and qt through the shared byte tile. kEdges: tiles may cross the matrix's
// edges (guarded stores, padding scales of 1) and may write column sums; without it the tile is interior.
template <DType F, bool kTwoD, bool kEdges, int kNumWarps, int kN, typename Tile>
__device__ __forceinline__ void cast_tile(const BlockCastArgs& a, const Tile& v, int64_t row0, int64_t col0, int64_t bx,
                                          float (&partial)[kNumWarps][kBlockLen], float (&col_scale)[kBlockLen],
                                          uint8_t* tile_t) {
  static_assert(kN == 16 || kN == 8, "16 rows a warp (256 threads) or 8 (512)");
  constexpr int kLanesPerRow = 32 / kN;  // (after the warp reduction, lanes holding one row's amax)
  constexpr float fp8_max = F == DType::kE4M3 ? 448.0f : 57344.0f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float row_amax[kN], col_amax[kCols] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    row_amax[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      row_amax[i] = max_abs(row_amax[i], v.at(i, j));
      col_amax[j] = max_abs(col_amax[j], v.at(i, j));
    }
  }

  if constexpr (kEdges) {
    if (a.col_sums != nullptr) write_column_sums(a, bx, v, partial);
  }

  // lane_scale: 128x128, the block's scale; 1x128, the scale of row lane / kLanesPerRow (shuffled out where used)
  float lane_scale = 1.0f, my_col_scale[kCols];
  if constexpr (kTwoD) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kN; ++i) amax = max_abs(amax, row_amax[i]);
    amax = warp_max_nonneg(amax);
    if (lane == 0) partial[warp][0] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) amax = max_abs(amax, partial[w][0]);
    const float scale = tile_scale(amax, fp8_max, a.amax_epsilon, a.power_2_scale);
    if (threadIdx.x == 0) store_block_scales(a, bx, inverse(scale));
    lane_scale = scale;
#pragma unroll
    for (int j = 0; j < kCols; ++j) my_col_scale[j] = scale;
  } else {
    if (a.q != nullptr) {  // the lanes of row r find its scale, the first of them writes its scale_inv
      float row_max;
      if constexpr (kN == 16) row_max = warp_max_rows(row_amax, lane);
      else row_max = warp_max_8_rows(row_amax, lane);
      const float scale = tile_scale(row_max, fp8_max, a.amax_epsilon, a.power_2_scale);
      const int64_t row = row0 + lane / kLanesPerRow;
      if constexpr (kEdges) {  // (rows past m: 1)
        if (lane % kLanesPerRow == 0 && row < a.scale_ld)
          a.scale_inv[bx * a.scale_ld + row] = row < a.m ? inverse(scale) : 1.0f;
      } else {
        if (lane % kLanesPerRow == 0) a.scale_inv[bx * a.scale_ld + row] = inverse(scale);
      }
      lane_scale = scale;
    }
    if (a.qt != nullptr) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) partial[warp][lane * kCols + j] = col_amax[j];
      __syncthreads();
      if (threadIdx.x < kBlockLen) {
        float amax = 0.0f;
#pragma unroll
        for (int w = 0; w < kNumWarps; ++w) amax = max_abs(amax, partial[w][threadIdx.x]);
        const float scale = tile_scale(amax, fp8_max, a.amax_epsilon, a.power_2_scale);
        col_scale[threadIdx.x] = scale;
        const int64_t col = bx * kBlockLen + threadIdx.x;
        if constexpr (kEdges) {
          if (col < a.scale_t_ld)
            a.scale_inv_t[int64_t{blockIdx.y} * a.scale_t_ld + col] = col < a.k ? inverse(scale) : 1.0f;
        } else {
          a.scale_inv_t[int64_t{blockIdx.y} * a.scale_t_ld + col] = inverse(scale);
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kCols; ++j) my_col_scale[j] = col_scale[lane * kCols + j];
    }
  }

  if (a.q != nullptr) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float rs = kTwoD ? lane_scale : __shfl_sync(0xffffffffu, lane_scale, kLanesPerRow * i);
      const float scale[kCols] = {rs, rs, rs, rs};
      const float row[kCols] = {v.at(i, 0), v.at(i, 1), v.at(i, 2), v.at(i, 3)};
      if constexpr (kEdges) store4(a.q, row0 + i, col0, a.m, a.k, pack4<F>(row, scale));
      else *reinterpret_cast<uint32_t*>(a.q + (row0 + i) * a.k + col0) = pack4<F>(row, scale);
    }
  }
  if (a.qt == nullptr) return;
    // Column c = 4 * lane + j of the tile, rows kN * warp .. + kN - 1: one kN-byte piece of tile_t's row c.
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    uint32_t words[kN / 4];
#pragma unroll
    for (int g = 0; g < kN / 4; ++g) {
      const float column[kCols] = {v.at(4 * g, j), v.at(4 * g + 1, j), v.at(4 * g + 2, j), v.at(4 * g + 3, j)};
      const float scale[kCols] = {my_col_scale[j], my_col_scale[j], my_col_scale[j], my_col_scale[j]};
      words[g] = pack4<F>(column, scale);
    }
    uint8_t* piece = tile_t + (lane * kCols + j) * kPitch + warp * kN;
    if constexpr (kN == 16) *reinterpret_cast<uint4*>(piece) = make_uint4(words[0], words[1], words[2], words[3]);
    else *reinterpret_cast<uint2*>(piece) = make_uint2(words[0], words[1]);
  }
  __syncthreads();
  // qt rows: tile columns kN * warp + i; each lane stores 4 bytes (qt columns = x rows 4 * lane .. + 3 of the tile).
  const int64_t qt_col = int64_t{blockIdx.y} * kBlockLen + lane * 4;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int c = warp * kN + i;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(tile_t + c * kPitch + lane * 4);
    if constexpr (kEdges) store4(a.qt, bx * kBlockLen + c, qt_col, a.k, a.m, word);
    else *reinterpret_cast<uint32_t*>(a.qt + (bx * kBlockLen + c) * a.m + qt_col) = word;
  }
}

template <DType F, bool kTwoD, typename Loader>
__global__ void __launch_bounds__(kThreads, MinBlocksOf<Loader>::value)
    block_cast_kernel(Loader loader, BlockCastArgs a) {
  __shared__ float partial[kWarps][kBlockLen];  // per-warp column amaxes (1x128), or warp amaxes (128x128)
  __shared__ float col_scale[kBlockLen];
  __shared__ __align__(16) uint8_t tile_t[kBlockLen * kPitch];  // the transposed tile: row c holds column c of x
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row0 = int64_t{blockIdx.y} * kBlockLen + warp * kRows;
  const int64_t bx = column_tile(loader, blockIdx.x);  // (the tile column this block casts)
  const int64_t col0 = bx * kBlockLen + lane * kCols;

  typename TileOf<Loader>::type v;
  const bool interior = loader.vec && int64_t{blockIdx.y + 1} * kBlockLen <= a.m && (bx + 1) * kBlockLen <= a.k;
  load_tile(loader, a, row0, col0, interior, v);
  cast_tile<F, kTwoD, true, kWarps, kRows>(a, v, row0, col0, bx, partial, col_scale, tile_t);
}

// Launches block_cast_kernel over a's [m, k] with `loader` (two_d only when Loader::kTwoDOk).
template <typename Loader>
void launch_with_loader(const Loader& loader, const BlockCastArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.k == 0 || (a.q == nullptr && a.qt == nullptr && a.col_sums == nullptr)) return;
  if ((a.m + kBlockLen - 1) / kBlockLen > 65535)
    throw std::invalid_argument("block_cast: too many rows for one launch");
  const dim3 grid(static_cast<unsigned>((a.k + kBlockLen - 1) / kBlockLen),
                  static_cast<unsigned>((a.m + kBlockLen - 1) / kBlockLen));
  if constexpr (Loader::kTwoDOk) {
    if (a.two_d) {
      TFP8_DISPATCH_FP8(a.fp8_type, F, block_cast_kernel<F, true, Loader><<<grid, kThreads, 0, stream>>>(loader, a));
      TFP8_CUDA_CHECK(cudaGetLastError());
      return;
    }
  } else {
    if (a.two_d) throw std::invalid_argument("block_cast: a fused cast makes 1x128 tiles only");
  }
  TFP8_DISPATCH_FP8(a.fp8_type, F, block_cast_kernel<F, false, Loader><<<grid, kThreads, 0, stream>>>(loader, a));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace block
}  // namespace tfp8
