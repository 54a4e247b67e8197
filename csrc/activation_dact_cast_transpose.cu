// dact_cast_transpose: d = dy * act'(x) cast to FP8 and written row-major and transposed, plus its column sums.
//
// One block of 256 threads per 128 x 128 tile of dy (rows x out_cols); SwiGLU tiles have two parts, the dgate tile
// (columns c of d) and the dup tile (columns out_cols + c). Phase 1: each thread takes 16 columns of 4 rows of the
// tile, kRowsInFlight rows at a time with their loads issued first (dy and x as 16-byte loads, or the kept E4M3
// input's 16 bytes and its tile's scale_inv); per row it writes the 16 FP8 bytes of each part to q (one 16-byte
// store) and to the part's shared tile. Phase 2: each thread reads 16 rows x 4 columns of each shared tile as 16
// words, transposes the bytes with __byte_perm and stores 4 rows of qT, 16 bytes each (8- or 4-byte stores where rows
// is not a multiple of 16). The tiles' 16-byte chunks are XOR-swizzled (chunk ^ 4 in odd 16-row groups) so that both
// phases are free of bank conflicts (the layout of quantize_transpose.cu's cast_transpose). Pieces at the right edge,
// or with rows not 16-byte aligned, take the element path (VECTOR false); partial row groups a guarded byte path.
// dbias: each block writes its tile's column sums to a float32 workspace row; a second kernel adds the rows.
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "activation_common.cuh"
#include "fp8_tile_transpose.cuh"

namespace tfp8 {
namespace {

using act::StorageT;
using fp8_tile::kThreads;
using fp8_tile::tile_offset;
constexpr int kTile = kDactTile;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 16;                              // columns per thread in phase 1
constexpr int kChunksPerRow = kTile / kChunk;           // 8
constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 32
constexpr int kPasses = kTile / kRowsPerPass;           // 4: rows per thread in phase 1
// Rows a thread loads before their math in phase 1 (2 timed slower: more registers, fewer blocks per SM).
constexpr int kRowsInFlight = 1;
static_assert(kTile == fp8_tile::kSide && kChunk == fp8_tile::kChunkBytes, "fp8_tile_transpose.cuh's tile");

// Shapes and outputs of one launch (qT may be null: not written; workspace null: no dbias).
struct DactArgs {
  int64_t rows, out_cols;
  int qt_store_bytes;  // 16, 8, 4 or 1: the widest store that divides rows and qT's alignment (phase 2)
  uint8_t* q;
  uint8_t* qT;
  const float* scale;
  float* amax;
  float* scale_inv;
  float* workspace;
  const uint8_t* x8;  // the kept input (KEPT)
  const float* x8_scale_inv;
};

// One row's 16-column piece of the inputs, loaded raw: dy, and x's gate / up (SwiGLU) or x, in the input dtype or
// (KEPT) as E4M3 bytes with their tile's scale_inv (a piece starts at a multiple of 16, so it lies in one tile).
// VECTOR: 16-byte accesses (out_cols % 16 == 0 and the pointers 16-byte aligned, so a piece is whole or empty).
template <Activation A, typename T, bool KEPT, bool VECTOR>
struct RowPiece {
  static constexpr int kOperands = A == Activation::kSwiglu ? 2 : 1;
  act::Vec<T, kChunk> dy;
  act::Vec<std::conditional_t<KEPT, uint8_t, T>, kChunk> x[kOperands];
  float x_scale_inv[KEPT ? kOperands : 1];

  // Loads the piece of row `row` at column col: count (0 .. 16) valid columns.
  __device__ __forceinline__ void load(const T* dy_base, const T* x_base, const DactArgs& a, int64_t row, int64_t col,
                                       int count) {
    if (count == 0) return;
    if constexpr (VECTOR) count = kChunk;  // (whole pieces: lets the compiler drop the element path)
    act::load_vector(dy_base + row * a.out_cols + col, dy, count, VECTOR);
    const int64_t in_cols = kOperands * a.out_cols;
#pragma unroll
    for (int o = 0; o < kOperands; ++o) {
      const int64_t offset = row * in_cols + o * a.out_cols + col;
      if constexpr (KEPT) {
        act::load_vector(a.x8 + offset, x[o], count, VECTOR);
        x_scale_inv[o] = a.x8_scale_inv[offset / kKeepTile];
      } else {
        act::load_vector(x_base + offset, x[o], count, VECTOR);
      }
    }
  }

  // Element k of operand o as a float (a kept operand dequantized).
  __device__ __forceinline__ float operand(int o, int k) const {
    if constexpr (KEPT) return fp8_to_float<DType::kE4M3>(x[o].v[k]) * x_scale_inv[o];
    else return to_float(x[o].v[k]);
  }
};


// Phase 2 for one part: its tile (16 rows x 4 columns per thread) -> qT rows qt_row0 + 4 * word_col + j (those below
// qt_rows_end), columns row0 + 16 * row_group ...
__device__ __forceinline__ void store_transposed(const uint8_t* tile, const DactArgs& a, int64_t row0, int64_t qt_row0,
                                                 int64_t qt_rows_end) {
  const fp8_tile::Phase2Place place = fp8_tile::phase2_place();
  const int64_t col = row0 + place.row_group * 16;
  if (col >= a.rows) return;
  uint32_t out[4][4];  // out[k][j]: bytes of qT row 4 * word_col + j, columns 4k .. 4k + 3 of the 16
  fp8_tile::read_transposed(tile, place, out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t qt_row = qt_row0 + place.word_col * 4 + j;
    if (qt_row >= qt_rows_end) break;
    uint8_t* dst = a.qT + qt_row * a.rows + col;
    if (a.qt_store_bytes == 16 && col + 16 <= a.rows) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(out[0][j], out[1][j], out[2][j], out[3][j]);
    } else if (a.qt_store_bytes == 8 && col + 16 <= a.rows) {
      reinterpret_cast<uint2*>(dst)[0] = make_uint2(out[0][j], out[1][j]);
      reinterpret_cast<uint2*>(dst)[1] = make_uint2(out[2][j], out[3][j]);
    } else if (a.qt_store_bytes == 4 && col + 16 <= a.rows) {
#pragma unroll
      for (int k = 0; k < 4; ++k) reinterpret_cast<uint32_t*>(dst)[k] = out[k][j];
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (col + i < a.rows) dst[i] = static_cast<uint8_t>(out[i / 4][j] >> (8 * (i % 4)));
      }
    }
  }
}

// Blocks per SM the register budget aims at: the fastest of the variants timed for SwiGLU from the kept and from the
// 16-bit input (benchmarks/RESULTS.md, session 5, "SwiGLU FP8 kernels"); float32 inputs and column sums take more
// registers.
template <bool KEPT, DType IN, bool DBIAS>
constexpr int min_blocks_per_sm() {
  return (DBIAS || IN == DType::kFloat32) ? 2 : KEPT ? 4 : 3;
}

template <Activation A, DType IN, DType F8, bool KEPT, bool DBIAS, bool VECTOR>
__global__ void __launch_bounds__(kThreads, (min_blocks_per_sm<KEPT, IN, DBIAS>()))
    dact_cast_transpose_kernel(const StorageT<IN>* __restrict__ dy, const StorageT<IN>* __restrict__ x,
                               const DactArgs a) {
  using Piece = RowPiece<A, StorageT<IN>, KEPT, VECTOR>;
  constexpr int kParts = Piece::kOperands;
  __shared__ alignas(16) uint8_t tile[kParts][kTile * kTile];
  __shared__ float column_sums[DBIAS ? kWarps : 1][kTile];  // (no dbias: neither the sums nor their space)

  const int64_t in_cols = kParts * a.out_cols;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile, col0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int chunk = threadIdx.x % kChunksPerRow, sub_row = threadIdx.x / kChunksPerRow;
  const int64_t col = col0 + chunk * kChunk;
  const int count = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(kChunk), a.out_cols - col)));
  const float scale = *a.scale;
  if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *a.scale_inv = 1.0f / scale;

  // Phase 1, kRowsInFlight rows at a time -> q, the shared tiles, column sums and amax.
  float sums[kParts][kChunk] = {};
  float local_amax = 0.0f;
#pragma unroll 1
  for (int first_pass = 0; first_pass < kPasses; first_pass += kRowsInFlight) {
    Piece pieces[kRowsInFlight];
    int counts[kRowsInFlight];
#pragma unroll
    for (int p = 0; p < kRowsInFlight; ++p) {
      const int64_t row = row0 + (first_pass + p) * kRowsPerPass + sub_row;
      counts[p] = row < a.rows ? count : 0;
      pieces[p].load(dy, x, a, row, col, counts[p]);
    }
#pragma unroll
    for (int p = 0; p < kRowsInFlight; ++p) {
      if (counts[p] == 0) continue;
      const int valid = VECTOR ? kChunk : counts[p];
      const int tile_row = (first_pass + p) * kRowsPerPass + sub_row;
      const int64_t row = row0 + tile_row;
      // Two columns at a time, each pair cast at once, so that few floats are live.
      act::Vec<uint8_t, kChunk> bytes[kParts];
#pragma unroll
      for (int k = 0; k < kChunk; k += 2) {
        float d[kParts][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float grad = to_float(pieces[p].dy.v[k + e]);
          if constexpr (A == Activation::kSwiglu) {
            act::swiglu_backward<true>(grad, pieces[p].operand(0, k + e), pieces[p].operand(1, k + e), d[0][e],
                                       d[1][e]);
          } else {
            d[0][e] = act::backward<A>(grad, pieces[p].operand(0, k + e));
          }
#pragma unroll
          for (int part = 0; part < kParts; ++part) {
            if (k + e < valid) {
              local_amax = act::max_abs(local_amax, d[part][e]);
              if constexpr (DBIAS) sums[part][k + e] += d[part][e];
            }
          }
        }
#pragma unroll
        for (int part = 0; part < kParts; ++part) {
          const uint16_t pair = act::encode_fp8_pair<F8>(d[part][0], d[part][1], scale);
          bytes[part].v[k] = static_cast<uint8_t>(pair & 0xff);
          bytes[part].v[k + 1] = static_cast<uint8_t>(pair >> 8);
        }
      }
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        uint8_t* dst = a.q + row * in_cols + part * a.out_cols + col;
        if (VECTOR) {
          *reinterpret_cast<act::Vec<uint8_t, kChunk>*>(dst) = bytes[part];
        } else {
#pragma unroll
          for (int k = 0; k < kChunk; ++k) {
            if (k < valid) dst[k] = bytes[part].v[k];
          }
        }
        if (a.qT != nullptr)
          *reinterpret_cast<act::Vec<uint8_t, kChunk>*>(&tile[part][tile_offset(tile_row, chunk)]) = bytes[part];
      }
    }
  }

  // Phase 2: transposed stores, part by part.
  if (a.qT != nullptr) {
    __syncthreads();
    const int64_t part_cols_end = min(col0 + kTile, a.out_cols);
#pragma unroll
    for (int part = 0; part < kParts; ++part)
      store_transposed(tile[part], a, row0, part * a.out_cols + col0, part * a.out_cols + part_cols_end);
  }

  // Column sums: over the warp's 4 rows of threads (lanes 8 apart share a chunk), then over the warps.
  if constexpr (DBIAS) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        float v = sums[part][k];
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < kChunksPerRow) column_sums[warp][chunk * kChunk + k] = v;
      }
      __syncthreads();
      if (threadIdx.x < kTile && col0 + threadIdx.x < a.out_cols) {
        float sum = 0.0f;
        for (int w = 0; w < kWarps; ++w) sum += column_sums[w][threadIdx.x];
        a.workspace[blockIdx.x * in_cols + part * a.out_cols + col0 + threadIdx.x] = sum;
      }
      __syncthreads();
    }
  }
  if (a.amax != nullptr) block_amax_atomic(local_amax, a.amax);
}

// The widest store (16, 8, 4 or 1 bytes) that phase 2's 16-byte qT row segments can take: it divides rows (where each
// qT row starts) and qT's alignment.
int qt_store_bytes(int64_t rows, const uint8_t* qT) {
  for (int bytes : {16, 8, 4}) {
    if (rows % bytes == 0 && act::aligned(qT, bytes)) return bytes;
  }
  return 1;
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
  const bool rows_aligned = out_cols % kChunk == 0 && act::aligned(dy, 16) && act::aligned(q, 16) &&
                            (x8 != nullptr ? act::aligned(x8, 16) : act::aligned(x, 16));
  DactArgs args{};
  args.rows = rows;
  args.out_cols = out_cols;
  args.qt_store_bytes = qt_store_bytes(rows, qT);
  args.q = q;
  args.qT = qT;
  args.scale = scale;
  args.amax = amax;
  args.scale_inv = scale_inv;
  args.workspace = dbias != nullptr ? workspace : nullptr;
  args.x8 = x8;
  args.x8_scale_inv = x8_scale_inv;
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(dtype, [&](auto d) {
      act::with_fp8(fp8_dtype, [&](auto f) {
        constexpr Activation A = decltype(a)::value;
        constexpr DType IN = decltype(d)::value, F8 = decltype(f)::value;
        using T = StorageT<IN>;
        const auto* dyp = static_cast<const T*>(dy);
        const auto* xp = static_cast<const T*>(x);
        auto launch = [&](auto kept_tag, auto dbias_tag) {
          constexpr bool KEPT = decltype(kept_tag)::value, DB = decltype(dbias_tag)::value;
          if (rows_aligned)
            dact_cast_transpose_kernel<A, IN, F8, KEPT, DB, true><<<grid, kThreads, 0, stream>>>(dyp, xp, args);
          else dact_cast_transpose_kernel<A, IN, F8, KEPT, DB, false><<<grid, kThreads, 0, stream>>>(dyp, xp, args);
        };
        auto with_dbias = [&](auto kept_tag) {
          if (dbias != nullptr) launch(kept_tag, std::true_type{});
          else launch(kept_tag, std::false_type{});
        };
        if (x8 != nullptr) with_dbias(std::true_type{});  // (a kept input: in_cols is a multiple of kKeepTile)
        else with_dbias(std::false_type{});
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
