// Launchers of the activation family's CUDA kernels (csrc/activation_*.cu). Plain pointers, no torch.
// Activations: GELU (tanh approximation), ReLU, SwiGLU (rows of x are [gate | up], 2 * out_cols wide).
// Math in float32. An FP8 output is saturate(value * *scale) rounded to nearest even; amax (may be null) is
// max-accumulated with max|value| (one atomic per block); scale_inv (may be null) receives 1 / *scale.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

enum class Activation : int { kGelu, kRelu, kSwiglu };

// y = act(x): y has out_elems elements, out_cols per row, of out_dtype (high precision, or FP8 with scale given).
// Launches even when out_elems == 0, so scale_inv is always written.
void launch_activation_fwd(const void* x, DType in_dtype, void* y, DType out_dtype, int64_t out_elems, int64_t out_cols,
                           Activation act, const float* scale, float* amax, float* scale_inv, cudaStream_t stream);

// The kept input of activation_fwd_keep_input: E4M3 in 1 x kKeepTile tiles along each row, one float32 scale_inv per
// tile (x ~= byte value * scale_inv; scale_inv = amax_tile / 448, 1 for an all-zero tile).
constexpr int kKeepTile = 128;

// Whether activation_fwd_keep_input takes this input: float16 / bfloat16, out_cols and out_elems multiples of
// kKeepTile (for SwiGLU the input's rows are then whole tiles too).
bool activation_fwd_can_keep_input(DType in_dtype, int64_t out_elems, int64_t out_cols);

// activation_fwd with an FP8 output y (scale required) that also writes x8 [rows, in_cols] (E4M3) and x8_scale_inv
// [rows, in_cols / kKeepTile] (float32), the kept input, in the same pass. Throws unless
// activation_fwd_can_keep_input and x is 16-byte aligned.
void launch_activation_fwd_keep_input(const void* x, DType in_dtype, uint8_t* y, DType out_dtype, int64_t out_elems,
                                      int64_t out_cols, Activation act, const float* scale, float* amax,
                                      float* scale_inv, uint8_t* x8, float* x8_scale_inv, cudaStream_t stream);

// dx = dy * act'(x), all three of dtype; dy has out_elems elements, out_cols per row. No launch when out_elems == 0.
void launch_activation_bwd(const void* dy, const void* x, void* dx, DType dtype, int64_t out_elems, int64_t out_cols,
                           Activation act, cudaStream_t stream);

// The high-precision activation_fwd (y of dtype) as a [rows, cols] kernel (activation_rows.cu; cols = out_cols), which
// launch_activation_fwd takes for rows of at least kRowsKernelMinCols elements: the same math (16-bit SwiGLU with the
// hardware's exp and reciprocal: see activation_rows.cu).
constexpr int64_t kRowsKernelMinCols = 1024;
void launch_activation_rows_fwd(const void* x, void* y, DType dtype, int64_t rows, int64_t cols, Activation act,
                                cudaStream_t stream);

// Rows of d(input) one dact_cast_transpose tile covers: the dbias workspace holds one float32 row per tile row.
constexpr int kDactTile = 128;
inline int64_t dact_dbias_workspace_rows(int64_t rows) { return (rows + kDactTile - 1) / kDactTile; }

// d = dy * act'(x) for dy [rows, out_cols] and x [rows, in_cols] of dtype (in_cols = 2 * out_cols for SwiGLU):
// q [rows, in_cols] and qT [in_cols, rows] (not written when null) = saturate(d * *scale) in fp8_dtype. With dbias
// (then workspace is float32
// [dact_dbias_workspace_rows(rows), in_cols]): dbias[j] = sum_i d[i, j] in float32, written in dtype.
// rows and out_cols must be > 0.
// x may instead be a kept input (x8, x8_scale_inv non-null, x null; then in_cols must be a multiple of kKeepTile).
void launch_dact_cast_transpose(const void* dy, const void* x, DType dtype, uint8_t* q, uint8_t* qT, DType fp8_dtype,
                                int64_t rows, int64_t out_cols, Activation act, const float* scale, float* amax,
                                float* scale_inv, void* dbias, float* workspace, cudaStream_t stream,
                                const uint8_t* x8 = nullptr, const float* x8_scale_inv = nullptr);

}  // namespace tfp8
