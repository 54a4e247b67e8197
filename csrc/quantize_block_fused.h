// Block-scaled FP8 casts fused with the op that makes what they cast (recipe Float8BlockScaling, 1x128 tiles):
// LayerNorm / RMSNorm forward, and the activation backward. Torch-free launchers; contracts in csrc/ops.cpp.
#pragma once
#include "quantize.h"

namespace tfp8 {

// cast: block_cast's arguments for the normalised [m, k] (x = the norm's input, in_type; two_d false). The norm as
// norm.h's contract says (weight, bias [k] of weight_type: in_type or float32; bias LayerNorm only, may be null);
// mean (LayerNorm) and rstd [m] float32 are written by a first kernel, read back by the cast.
struct NormBlockCastArgs {
  BlockCastArgs cast;
  bool layernorm;
  const void* weight;
  const void* bias;
  DType weight_type;
  float eps, gamma_offset;
  float* mean;  // LayerNorm only
  float* rstd;
};
void launch_norm_block_cast(const NormBlockCastArgs& args, cudaStream_t stream);

// cast: block_cast's arguments for d(input) [m, k] (x = grad_out [m, f], in_type; two_d false; k = f, or 2f for
// swiglu); act_input: the activation's input [m, k] of in_type; activation: an Activation (activation.h).
struct DactBlockCastArgs {
  BlockCastArgs cast;
  const void* act_input;
  int activation;
  int64_t f;
};
void launch_dact_block_cast(const DactBlockCastArgs& args, cudaStream_t stream);

// The d(SwiGLU) case of launch_dact_block_cast on the wide kernel (csrc/quantize_block_dswiglu.cu) when the problem
// fits it (16-bit input, m and f multiples of 128, aligned, 1x128, no column sums, TFP8_BLOCK_WIDE not "0");
// returns false, launching nothing, otherwise.
bool launch_dswiglu_block_cast_wide(const DactBlockCastArgs& args, cudaStream_t stream);

}  // namespace tfp8
