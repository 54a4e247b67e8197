// dact_cast_transpose: d = dy * act'(x) cast to FP8 and written row-major and transposed, plus its column sums.
//
// One block of 256 threads per 128 x 128 tile of dy (rows x out_cols); SwiGLU tiles have two parts, the dgate tile
// (columns c of d) and the dup tile (columns out_cols + c). Pass 1 reads dy and x row by row (VEC elements per thread,
// 16-byte loads), writes q row-major straight from registers and keeps the FP8 bytes in shared memory; pass 2 reads the
// bytes column by column and writes qT (when given), 4 bytes per thread, each warp one contiguous 128-byte row
// segment.
// The shared tile's rows are 129 bytes apart, so the 32 lanes reading 4 rows each of one column hit 32 banks.
// dbias: each block writes its tile's column sums to a float32 workspace row; a second kernel adds the rows.
#include "activation_common.cuh"

namespace tfp8 {
namespace {

using act::StorageT;
constexpr int kTile = kDactTile;
constexpr int kThreads = 256;

// out = x[offset .. offset + count) as floats: from x, or (KEPT) from the kept E4M3 input x8 times its tile's
// scale_inv (offset % VEC == 0, so the VEC values lie in one tile).
template <bool KEPT, int VEC, typename T>
__device__ __forceinline__ void load_input(const T* x, const uint8_t* x8, const float* x8_scale_inv, int64_t offset,
                                           float (&out)[VEC], int count) {
  if constexpr (KEPT) {
    const float tile_scale_inv = x8_scale_inv[offset / kKeepTile];
    if (count == VEC) {
      const act::Vec<uint8_t, VEC> v = *reinterpret_cast<const act::Vec<uint8_t, VEC>*>(x8 + offset);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = fp8_to_float<DType::kE4M3>(v.v[k]) * tile_scale_inv;
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        out[k] = k < count ? fp8_to_float<DType::kE4M3>(x8[offset + k]) * tile_scale_inv : 0;
    }
  } else {
    act::load_floats(x + offset, out, count);
  }
}

template <Activation A, DType IN, DType F8, int VEC, bool KEPT, bool DBIAS>
__global__ void __launch_bounds__(kThreads)
    dact_cast_transpose_kernel(const StorageT<IN>* __restrict__ dy, const StorageT<IN>* __restrict__ x,
                               uint8_t* __restrict__ q, uint8_t* __restrict__ qT, int64_t rows, int64_t out_cols,
                               const float* __restrict__ scale_ptr, float* amax, float* scale_inv, float* workspace,
                               const uint8_t* __restrict__ x8, const float* __restrict__ x8_scale_inv) {
  constexpr int kParts = A == Activation::kSwiglu ? 2 : 1;
  constexpr int kThreadsPerRow = kTile / VEC;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  __shared__ uint8_t tile[kParts][kTile][kTile + 1];
  __shared__ float column_sums[DBIAS ? kRowsPerPass : 1][kTile];  // (no dbias: neither the sums nor their space)

  const int64_t in_cols = kParts * out_cols;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile, col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int tile_col = (threadIdx.x % kThreadsPerRow) * VEC, sub_row = threadIdx.x / kThreadsPerRow;
  const int64_t col = col0 + tile_col;
  const int count = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(VEC), out_cols - col)));
  const float scale = *scale_ptr;
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;

  // Pass 1: rows of the tile -> q, the shared tile, column sums and amax.
  float sums[kParts][VEC] = {};
  float local_amax = 0.0f;
#pragma unroll 2
  for (int tile_row = sub_row; tile_row < kTile; tile_row += kRowsPerPass) {
    const int64_t row = row0 + tile_row;
    if (row >= rows || count == 0) continue;
    float grad[VEC], d[kParts][VEC];
    act::load_floats(dy + row * out_cols + col, grad, count);
    if constexpr (A == Activation::kSwiglu) {
      float gate[VEC], up[VEC];
      load_input<KEPT>(x, x8, x8_scale_inv, row * in_cols + col, gate, count);
      load_input<KEPT>(x, x8, x8_scale_inv, row * in_cols + out_cols + col, up, count);
#pragma unroll
      for (int k = 0; k < VEC; ++k) act::swiglu_backward<true>(grad[k], gate[k], up[k], d[0][k], d[kParts - 1][k]);
    } else {
      float in[VEC];
      load_input<KEPT>(x, x8, x8_scale_inv, row * in_cols + col, in, count);
#pragma unroll
      for (int k = 0; k < VEC; ++k) d[0][k] = act::backward<A>(grad[k], in[k]);
    }
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      act::Vec<uint8_t, VEC> bytes;
      if constexpr (VEC % 2 == 0) {
        act::encode_fp8<F8>(d[p], scale, bytes);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) bytes.v[k] = float_to_fp8<F8>(d[p][k] * scale);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (k < count) {
          local_amax = act::max_abs(local_amax, d[p][k]);
          if constexpr (DBIAS) sums[p][k] += d[p][k];
        }
        tile[p][tile_row][tile_col + k] = bytes.v[k];
      }
      uint8_t* dst = q + row * in_cols + p * out_cols + col;
      if (count == VEC) {
        *reinterpret_cast<act::Vec<uint8_t, VEC>*>(dst) = bytes;
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if (k < count) dst[k] = bytes.v[k];
        }
      }
    }
  }
  __syncthreads();

  // Pass 2 (qT given): columns of the tile -> rows of qT. Lane l writes tile rows 4l .. 4l+3 of one column.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = row0 + 4 * lane;
  const bool word_stores = rows % 4 == 0 && act::aligned(qT, 4);
#pragma unroll
  for (int p = 0; p < (qT != nullptr ? kParts : 0); ++p) {
    for (int tc = warp; tc < kTile && col0 + tc < out_cols; tc += kThreads / 32) {
      uint8_t* dst = qT + (p * out_cols + col0 + tc) * rows + row;
      if (word_stores && row + 4 <= rows) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) word |= static_cast<uint32_t>(tile[p][4 * lane + k][tc]) << (8 * k);
        *reinterpret_cast<uint32_t*>(dst) = word;
      } else {
        for (int k = 0; k < 4 && row + k < rows; ++k) dst[k] = tile[p][4 * lane + k][tc];
      }
    }
  }

  if constexpr (DBIAS) {
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) column_sums[sub_row][tile_col + k] = sums[p][k];
      __syncthreads();
      if (threadIdx.x < kTile && col0 + threadIdx.x < out_cols) {
        float sum = 0.0f;
        for (int r = 0; r < kRowsPerPass; ++r) sum += column_sums[r][threadIdx.x];
        workspace[blockIdx.x * in_cols + p * out_cols + col0 + threadIdx.x] = sum;
      }
      __syncthreads();
    }
  }
  if (amax != nullptr) block_amax_atomic(local_amax, amax);
}

// dbias[c] = sum over the workspace rows of column c, in float32, written in D.
template <DType D>
__global__ void dbias_from_workspace_kernel(const float* __restrict__ workspace, int64_t workspace_rows, int64_t cols,
                                            StorageT<D>* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = 0.0f;
  for (int64_t r = 0; r < workspace_rows; ++r) sum += workspace[r * cols + c];
  dbias[c] = from_float<StorageT<D>>(sum);
}

}  // namespace

void launch_dact_cast_transpose(const void* dy, const void* x, DType dtype, uint8_t* q, uint8_t* qT, DType fp8_dtype,
                                int64_t rows, int64_t out_cols, Activation act, const float* scale, float* amax,
                                float* scale_inv, void* dbias, float* workspace, cudaStream_t stream, const uint8_t* x8,
                                const float* x8_scale_inv) {
  const int64_t tile_rows = dact_dbias_workspace_rows(rows);
  const dim3 grid(static_cast<unsigned>(tile_rows), static_cast<unsigned>((out_cols + kTile - 1) / kTile));
  const int in_cols_factor = act == Activation::kSwiglu ? 2 : 1;
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(dtype, [&](auto d) {
      act::with_fp8(fp8_dtype, [&](auto f) {
        constexpr Activation A = decltype(a)::value;
        constexpr DType IN = decltype(d)::value, F8 = decltype(f)::value;
        using T = StorageT<IN>;
        constexpr int kVec = 16 / sizeof(T);
        const auto* dyp = static_cast<const T*>(dy);
        const auto* xp = static_cast<const T*>(x);
        float* ws = dbias != nullptr ? workspace : nullptr;
        const bool vectors = out_cols % kVec == 0 && act::aligned(dy, 16) && act::aligned(q, kVec);
        auto launch = [&](auto dbias_tag) {
          constexpr bool DB = decltype(dbias_tag)::value;
          if (x8 != nullptr) {  // (a kept input: in_cols is a multiple of kKeepTile)
            if (vectors && act::aligned(x8, kVec)) {
              dact_cast_transpose_kernel<A, IN, F8, kVec, true, DB><<<grid, kThreads, 0, stream>>>(
                  dyp, nullptr, q, qT, rows, out_cols, scale, amax, scale_inv, ws, x8, x8_scale_inv);
            } else {
              dact_cast_transpose_kernel<A, IN, F8, 1, true, DB><<<grid, kThreads, 0, stream>>>(
                  dyp, nullptr, q, qT, rows, out_cols, scale, amax, scale_inv, ws, x8, x8_scale_inv);
            }
          } else if (vectors && act::aligned(x, 16)) {
            dact_cast_transpose_kernel<A, IN, F8, kVec, false, DB><<<grid, kThreads, 0, stream>>>(
                dyp, xp, q, qT, rows, out_cols, scale, amax, scale_inv, ws, nullptr, nullptr);
          } else {
            dact_cast_transpose_kernel<A, IN, F8, 1, false, DB><<<grid, kThreads, 0, stream>>>(
                dyp, xp, q, qT, rows, out_cols, scale, amax, scale_inv, ws, nullptr, nullptr);
          }
        };
        if (ws != nullptr) launch(std::true_type{});
        else launch(std::false_type{});
        TFP8_CUDA_CHECK(cudaGetLastError());
        if (dbias != nullptr) {
          const int64_t cols = in_cols_factor * out_cols;
          dbias_from_workspace_kernel<IN><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(
              workspace, tile_rows, cols, static_cast<T*>(dbias));
          TFP8_CUDA_CHECK(cudaGetLastError());
        }
      });
    });
  });
}

}  // namespace tfp8
