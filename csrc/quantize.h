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

}  // namespace tfp8
