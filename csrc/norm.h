// LayerNorm / RMSNorm kernels (csrc/norm_fwd.cu, csrc/norm_bwd.cu) behind plain-pointer launchers.
// Contract (the same as the CPU reference, transformer_fp8/cpu/norm.py):
//   input [rows, cols] row-major of input_dtype (float32/float16/bfloat16); weight, bias [cols] of weight_dtype
//   (input_dtype, or float32). Math in float32; gamma' = weight + gamma_offset (1 for zero-centered gamma, else 0).
//   LayerNorm: y = (x - mean) * rstd * gamma' + bias, rstd = 1 / sqrt(biased var + eps);
//   RMSNorm: y = x * rstd * gamma', rstd = 1 / sqrt(mean(x^2) + eps).
//   out = y in out_dtype (= input_dtype), or saturate(y * *scale) in FP8.
//   amax (optional) = max(amax, max|y|); scale_inv (optional) = 1 / *scale; mean (LayerNorm) and rstd: float32 [rows].
#pragma once
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

struct NormFwdParams {
  bool layernorm;  // else RMSNorm
  const void* input;
  const void* weight;
  const void* bias;  // LayerNorm only, may be null
  void* out;
  float* mean;  // LayerNorm only
  float* rstd;
  const float* scale;  // required for an FP8 out_dtype, else null
  float* amax;         // may be null
  float* scale_inv;    // may be null
  int64_t rows, cols;
  float eps, gamma_offset;
  DType input_dtype, weight_dtype, out_dtype;
};

void launch_norm_fwd(const NormFwdParams& p, cudaStream_t stream);

// Backward: dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) with g = dy * gamma', xhat the normalized input (the
// mean(g) term for LayerNorm only); dgamma = sum over rows of dy * xhat, dbeta = sum of dy (LayerNorm only).
// dx in input_dtype, dgamma / dbeta in weight_dtype. The column sums go through a float32 workspace of per-block
// partial sums, reduced in a fixed order by a second kernel (deterministic).
struct NormBwdParams {
  bool layernorm;  // else RMSNorm
  const void* grad_out;
  const void* input;
  const float* mean;  // LayerNorm only
  const float* rstd;
  const void* weight;
  void* dx;
  const void* dx_add;  // optional, the input's type: added to dx
  void* dgamma;
  void* dbeta;  // LayerNorm only
  int64_t rows, cols;
  float gamma_offset;
  DType input_dtype, weight_dtype;
};

// Floats of workspace launch_norm_bwd needs (depends on the shape, the dtypes and the device).
int64_t norm_bwd_workspace_size(const NormBwdParams& p);
void launch_norm_bwd(const NormBwdParams& p, float* workspace, cudaStream_t stream);

}  // namespace tfp8
