// Fused cast-transpose kernels: x [m, n] -> q [m, n] and qT [n, m] in FP8 in one pass (+amax, +scale_inv, +dbias),
// and the plain FP8 byte transpose.
//
// One block of 256 threads per 128x128 tile. Phase 1: each thread loads 4 chunks of 16 elements along a row
// (16-byte loads), casts them, stores the 16 FP8 bytes to q (one 16-byte store) and to the shared tile. Phase 2: each
// thread reads 16 rows x 4 columns of the tile as 16 words, transposes the bytes with __byte_perm, and stores
// 4 rows of qT, 16 bytes each. The tile's 16-byte chunks are XOR-swizzled (chunk ^ 4 in odd 16-row groups) so that
// both phases are free of bank conflicts. Chunks at the right or bottom edge, or in rows not 16-byte aligned, take
// a guarded scalar path. dbias: per-tile column sums go to a float32 workspace [tile rows, n], then a second small
// kernel sums the workspace's rows in a fixed order (deterministic); with one row of tiles (m <= 128) the tiles'
// sums are dbias itself and one launch writes it (the same bits: the reduce kernel would add them to 0).
#include <type_traits>

#include "fp8_tile_transpose.cuh"
#include "quantize.h"
#include "quantize_common.cuh"

namespace tfp8 {
namespace {

using fp8_tile::kThreads;
using fp8_tile::tile_offset;
constexpr int kTileM = kTransposeTileRows;  // 128
constexpr int kTileN = fp8_tile::kSide;
constexpr int kChunksPerRow = kTileN / kChunk;              // 8
constexpr int kPasses = kTileM * kChunksPerRow / kThreads;  // 4: chunks per thread in phase 1
constexpr int kRowsPerPass = kThreads / kChunksPerRow;      // 32
constexpr int kLoadsInFlight = 2;                           // chunks a thread loads before casting them
static_assert(kTileM == fp8_tile::kSide && kChunk == fp8_tile::kChunkBytes, "fp8_tile_transpose.cuh's tile");

// Shapes and outputs of one launch. q / qT / dbias_workspace / dbias / amax / scale_inv may be null (skipped).
struct TransposeArgs {
  int64_t m, n;
  bool rows_vectorized;  // n % 16 == 0 and x, q 16-byte aligned: phase 1 may use 16-byte accesses
  bool cols_vectorized;  // m % 16 == 0 and qT 16-byte aligned: phase 2 may use 16-byte stores
  uint8_t* q;
  uint8_t* qT;
  float* dbias_workspace;
  void* dbias;  // with one row of tiles: the column sums' final destination (in the input's type), not the workspace
  const float* scale;
  float* amax;
  float* scale_inv;
};

// Phase 2: tile (16 rows x 4 columns per thread) -> qT rows n0 + 4 * word_col + j, columns m0 + 16 * row_group.
__device__ __forceinline__ void store_transposed(const uint8_t* tile, const TransposeArgs& a, int64_t m0, int64_t n0) {
  const fp8_tile::Phase2Place place = fp8_tile::phase2_place();
  uint32_t out[4][4];  // out[k][j]: bytes of qT row 4 * word_col + j, columns 4k .. 4k + 3 of the 16
  fp8_tile::read_transposed(tile, place, out);
  const int64_t col = m0 + place.row_group * 16;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t row = n0 + place.word_col * 4 + j;
    if (row >= a.n) break;
    uint8_t* dst = a.qT + row * a.m + col;
    if (a.cols_vectorized && col + 16 <= a.m) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(out[0][j], out[1][j], out[2][j], out[3][j]);
    } else {
      for (int i = 0; i < 16 && col + i < a.m; ++i) dst[i] = static_cast<uint8_t>(out[i / 4][j] >> (8 * (i % 4)));
    }
  }
}

// Phase-1 column sums of the tile -> one row of the dbias workspace, or dbias itself. Every thread of the block must
// call it.
template <typename T>
__device__ __forceinline__ void store_column_sums(const float (&sums)[kChunk], const TransposeArgs& a, int64_t n0) {
  __shared__ float partial[kRowsPerPass][kTileN];  // one row per thread row of phase 1
  const int chunk = threadIdx.x % kChunksPerRow, thread_row = threadIdx.x / kChunksPerRow;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) partial[thread_row][chunk * kChunk + k] = sums[k];
  __syncthreads();
  if (threadIdx.x < kTileN && n0 + threadIdx.x < a.n) {
    float s = 0.0f;
    for (int r = 0; r < kRowsPerPass; ++r) s += partial[r][threadIdx.x];
    if (a.dbias != nullptr) {
      static_cast<T*>(a.dbias)[n0 + threadIdx.x] = from_float<T>(s);
    } else {
      a.dbias_workspace[int64_t{blockIdx.y} * a.n + n0 + threadIdx.x] = s;
    }
  }
}

// Blocks per SM the register budget aims at (more for fewer registers per element; with no spills in ptxas -v).
template <typename T, bool kDbias>
constexpr int min_blocks_per_sm() {
  return (kDbias ? 3 : 4) - (sizeof(T) == 4 ? 1 : 0);
}

// T = uint8_t: a plain byte transpose (no cast, no amax). Otherwise a cast with scale to FP8 format F.
template <typename T, DType F, bool kDbias>
__global__ void __launch_bounds__(kThreads, (min_blocks_per_sm<T, kDbias>()))
    cast_transpose_kernel(const T* __restrict__ x, const TransposeArgs a) {
  constexpr bool kRaw = std::is_same_v<T, uint8_t>;
  __shared__ alignas(16) uint8_t tile[kTileM * kTileN];
  const int64_t m0 = int64_t{blockIdx.y} * kTileM, n0 = int64_t{blockIdx.x} * kTileN;
  const int chunk = threadIdx.x % kChunksPerRow;
  const int64_t col = n0 + chunk * kChunk;

  // Phase 1, kLoadsInFlight chunks at a time: issue their loads, then cast them; amax, column sums; q and the
  // shared tile get the FP8 bytes.
  float scale = 1.0f, local_amax = 0.0f, sums[kChunk] = {};
  if constexpr (!kRaw) scale = *a.scale;
#pragma unroll 1
  for (int first_pass = 0; first_pass < kPasses; first_pass += kLoadsInFlight) {
    T v[kLoadsInFlight][kChunk];
#pragma unroll
    for (int p = 0; p < kLoadsInFlight; ++p) {
      const int64_t row = m0 + (first_pass + p) * kRowsPerPass + threadIdx.x / kChunksPerRow;
      const T* src = x + row * a.n + col;
      if (a.rows_vectorized && row < a.m && col + kChunk <= a.n) {
        load_chunk(src, v[p]);
      } else {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) v[p][k] = (row < a.m && col + k < a.n) ? src[k] : T{};
      }
    }
#pragma unroll
    for (int p = 0; p < kLoadsInFlight; ++p) {
      const int tile_row = (first_pass + p) * kRowsPerPass + threadIdx.x / kChunksPerRow;
      const int64_t row = m0 + tile_row;
      uint8_t out[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        if constexpr (kRaw) {
          out[k] = v[p][k];
        } else {
          const float f = to_float(v[p][k]);
          local_amax = max_abs(local_amax, f);
          if constexpr (kDbias) sums[k] += f;
          out[k] = float_to_fp8<F>(f * scale);
        }
      }
      if (a.q != nullptr) {
        uint8_t* dst = a.q + row * a.n + col;
        if (a.rows_vectorized && row < a.m && col + kChunk <= a.n) {
          store_chunk(dst, out);
        } else if (row < a.m) {
          for (int k = 0; k < kChunk && col + k < a.n; ++k) dst[k] = out[k];
        }
      }
      if (a.qT != nullptr) {
        uint4 packed;
        memcpy(&packed, out, sizeof(packed));
        *reinterpret_cast<uint4*>(tile + tile_offset(tile_row, chunk)) = packed;
      }
    }
  }
  if constexpr (!kRaw) {
    if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *a.scale_inv = 1.0f / scale;
  }

  // Phase 2: transposed stores.
  if (a.qT != nullptr) {
    __syncthreads();
    store_transposed(tile, a, m0, n0);
  }
  if constexpr (kDbias) store_column_sums<T>(sums, a, n0);
  if constexpr (!kRaw) {
    if (a.amax != nullptr) block_amax_atomic(local_amax, a.amax);
  }
}

// dbias[j] = sum over workspace rows r (in order) of workspace[r, j], in T.
template <typename T>
__global__ void dbias_reduce_kernel(const float* __restrict__ workspace, T* __restrict__ dbias, int64_t rows,
                                    int64_t n) {
  const int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float s = 0.0f;
  for (int64_t r = 0; r < rows; ++r) s += workspace[r * n + j];
  dbias[j] = from_float<T>(s);
}

dim3 tile_grid(int64_t m, int64_t n) {
  return dim3(static_cast<unsigned>((n + kTileN - 1) / kTileN), static_cast<unsigned>((m + kTileM - 1) / kTileM));
}

}  // namespace

void launch_cast_transpose(const void* x, uint8_t* q, uint8_t* qT, int64_t m, int64_t n, DType in_type, DType fp8_type,
                           const float* scale, float* amax, float* scale_inv, void* dbias, float* workspace,
                           cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const dim3 grid = tile_grid(m, n);
  if (grid.y > 65535) throw std::invalid_argument("cast_transpose: too many rows for one launch");
  const bool one_tile_row = grid.y == 1;
  const TransposeArgs args{m,
                           n,
                           n % kChunk == 0 && aligned16(x) && (q == nullptr || aligned16(q)),
                           m % kChunk == 0 && (qT == nullptr || aligned16(qT)),
                           q,
                           qT,
                           dbias != nullptr && !one_tile_row ? workspace : nullptr,
                           one_tile_row ? dbias : nullptr,
                           scale,
                           amax,
                           scale_inv};
  TFP8_DISPATCH_HIGH_PRECISION(
      in_type, T,
      TFP8_DISPATCH_FP8(
          fp8_type, F,
          if (dbias != nullptr) {
            cast_transpose_kernel<T, F, true><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), args);
            TFP8_CUDA_CHECK(cudaGetLastError());
            if (!one_tile_row) {
              const int reduce_threads = 256;
              const unsigned reduce_blocks = static_cast<unsigned>((n + reduce_threads - 1) / reduce_threads);
              dbias_reduce_kernel<T>
                  <<<reduce_blocks, reduce_threads, 0, stream>>>(workspace, static_cast<T*>(dbias), grid.y, n);
            }
          } else {
            cast_transpose_kernel<T, F, false><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), args);
          }));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_fp8_transpose(const uint8_t* q, uint8_t* qT, int64_t m, int64_t n, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  const TransposeArgs args{m,
                           n,
                           n % kChunk == 0 && aligned16(q),
                           m % kChunk == 0 && aligned16(qT),
                           nullptr,
                           qT,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr};
  const dim3 grid = tile_grid(m, n);
  if (grid.y > 65535) throw std::invalid_argument("fp8_transpose: too many rows for one launch");
  cast_transpose_kernel<uint8_t, DType::kE4M3, false><<<grid, kThreads, 0, stream>>>(q, args);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
