// Launchers of the moe family's CUDA kernels (csrc/moe_permute.cu): token permutation for mixture-of-experts layers.
// Plain pointers, no torch. Contracts (the ops moe_permute_rows, moe_unpermute_rows, moe_merging_probs_grad):
// csrc/ops.cpp.
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// out [rows, hidden] (row n) = inp [tokens, hidden] (row slot_of_row[n] / slots), times probs[slot_of_row[n]] when
// probs (float32 [tokens * slots]) is given; a slot outside [0, tokens * slots) gives a row of zeros.
// dtype: any; FP8 rows are copied as bytes (probs must be null then).
void launch_moe_permute_rows(const void* inp, const int32_t* slot_of_row, const float* probs, void* out, int64_t tokens,
                             int64_t slots, int64_t rows, int64_t hidden, DType dtype, cudaStream_t stream);

// out [tokens, hidden] (row t) = sum over s of probs[t * slots + s] (1 when probs is null) * inp[row_id_map[t, s]],
// rows outside [0, rows) skipped; float32 sums in slot order. dtype: float32, float16 or bfloat16.
void launch_moe_unpermute_rows(const void* inp, const int32_t* row_id_map, const float* probs, void* out,
                               int64_t tokens, int64_t slots, int64_t rows, int64_t hidden, DType dtype,
                               cudaStream_t stream);

// d_probs [tokens, slots] float32 = dot(grad_out[t], inp[row_id_map[t, s]]) (0 for a row outside [0, rows)).
// dtype (of grad_out and inp): float32, float16 or bfloat16.
void launch_moe_merging_probs_grad(const void* grad_out, const void* inp, const int32_t* row_id_map, float* d_probs,
                                   int64_t tokens, int64_t slots, int64_t rows, int64_t hidden, DType dtype,
                                   cudaStream_t stream);

}  // namespace tfp8
