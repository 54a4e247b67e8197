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

// dx = dy * act'(x), all three of dtype; dy has out_elems elements, out_cols per row. No launch when out_elems == 0.
void launch_activation_bwd(const void* dy, const void* x, void* dx, DType dtype, int64_t out_elems, int64_t out_cols,
                           Activation act, cudaStream_t stream);

// Rows of d(input) one dact_cast_transpose tile covers: the dbias workspace holds one float32 row per tile row.
constexpr int kDactTile = 128;
inline int64_t dact_dbias_workspace_rows(int64_t rows) { return (rows + kDactTile - 1) / kDactTile; }

// d = dy * act'(x) for dy [rows, out_cols] and x [rows, in_cols] of dtype (in_cols = 2 * out_cols for SwiGLU):
// q [rows, in_cols] and qT [in_cols, rows] (not written when null) = saturate(d * *scale) in fp8_dtype. With dbias
// (then workspace is float32
// [dact_dbias_workspace_rows(rows), in_cols]): dbias[j] = sum_i d[i, j] in float32, written in dtype.
// rows and out_cols must be > 0.
void launch_dact_cast_transpose(const void* dy, const void* x, DType dtype, uint8_t* q, uint8_t* qT, DType fp8_dtype,
                                int64_t rows, int64_t out_cols, Activation act, const float* scale, float* amax,
                                float* scale_inv, void* dbias, float* workspace, cudaStream_t stream);

}  // namespace tfp8
