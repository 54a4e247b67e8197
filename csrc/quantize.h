// Launchers of the quantize family's CUDA kernels (csrc/quantize_*.cu). Plain pointers, no torch.
// Conventions: contiguous row-major data (the elementwise casts: rows at a stride, see Rows); q = saturate(float(x) * *scale) rounded to nearest even;
// amax (may be null) is max-accumulated with max|x| (one atomic per block); scale_inv (may be null) receives
// 1 / *scale.
// Every launcher returns at once when there is nothing to do (no launch).
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// Where the n elements of an elementwise cast lie: rows of `cols` elements, row r of the input starting at element
// r * ld_in and of the output at r * ld_out (ld >= cols). Contiguous data: Rows::dense(n) (one row).
struct Rows {
  int64_t cols, ld_in, ld_out;
  static Rows dense(int64_t n) { return {n, n, n}; }
};

// x (n elements of in_type) -> q (n bytes of fp8_type), both laid out as `rows` says.
void launch_quantize(const void* x, uint8_t* q, int64_t n, Rows rows, DType in_type, DType fp8_type, const float* scale,
                     float* amax, float* scale_inv, cudaStream_t stream);

// q (n bytes of fp8_type) -> out (n elements of out_type) = float(q) * *scale_inv, both laid out as `rows` says.
void launch_dequantize(const uint8_t* q, void* out, int64_t n, Rows rows, DType fp8_type, DType out_type,
                       const float* scale_inv, cudaStream_t stream);

// amax = max(amax, max|x|) over n elements of in_type.
void launch_compute_amax(const void* x, int64_t n, DType in_type, float* amax, cudaStream_t stream);

// Rows of input that one cast-transpose tile covers: the dbias workspace holds one float32 row per tile row.
constexpr int kTransposeTileRows = 128;
// Rows of the dbias workspace: one per row of tiles; none when there is one (the kernel writes dbias directly).
inline int64_t dbias_workspace_rows(int64_t m) {
  const int64_t tile_rows = (m + kTransposeTileRows - 1) / kTransposeTileRows;
  return tile_rows == 1 ? 0 : tile_rows;
}

// x [m, n] -> q [m, n] (when q is not null) and qT [n, m] (when qT is not null).
// With dbias (then workspace is float32 [dbias_workspace_rows(m), n], null when that is 0): dbias[j] = sum_i x[i, j]
// in float32, written in in_type; m must be > 0.
void launch_cast_transpose(const void* x, uint8_t* q, uint8_t* qT, int64_t m, int64_t n, DType in_type, DType fp8_type,
                           const float* scale, float* amax, float* scale_inv, void* dbias, float* workspace,
                           cudaStream_t stream);

// Byte transpose: q [m, n] -> qT [n, m].
void launch_fp8_transpose(const uint8_t* q, uint8_t* qT, int64_t m, int64_t n, cudaStream_t stream);

// --- block scaling (csrc/quantize_block.cu); the layouts: transformer_fp8/quantization/block.py ---
constexpr int kBlockLen = 128;  // values per 1x128 tile, rows and columns per 128x128 block

// x [m, k] -> q [m, k] with scale_inv (row stride scale_ld) and / or qt [k, m] with scale_inv_t (row stride
// scale_t_ld), each skipped when its pointer is null. two_d: one scale per 128x128 block shared by q and qt, else
// 1x128 tiles along k for q and along m for qt. Padding entries of the scale tensors (columns past the data) get 1.
struct BlockCastArgs {
  const void* x;
  int64_t m, k;
  DType in_type, fp8_type;
  bool two_d;
  float amax_epsilon;  // amax floor (>= 0)
  bool power_2_scale;  // scales rounded down to powers of two
  uint8_t* q;
  float* scale_inv;
  int64_t scale_ld;
  uint8_t* qt;
  float* scale_inv_t;
  int64_t scale_t_ld;
  int activation = -1;  // >= 0: cast act(x) (an Activation, activation.h; 1x128 only): x is [m, k] ([m, 2k] swiglu)
  float* col_sums = nullptr;  // optional [ceil(m / 128), k] float32: each 128-row tile's column sums of what is cast
};
void launch_block_cast(const BlockCastArgs& args, cudaStream_t stream);

// q [m, k] (fp8_type) -> out [m, k] (out_type) = q * the scale_inv of its tile or block (layout as block_cast writes
// it, rows of scale_inv at stride scale_ld).
void launch_block_dequantize(const uint8_t* q, const float* scale_inv, int64_t scale_ld, bool two_d, int64_t m,
                             int64_t k, DType fp8_type, void* out, DType out_type, cudaStream_t stream);

}  // namespace tfp8
