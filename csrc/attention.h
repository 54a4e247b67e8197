// Scaled-dot-product attention through cuDNN's graph API (cudnn-frontend), behind plain structs: no torch here.
// Contract (the ops fused_attn_fwd / fused_attn_bwd): csrc/ops.cpp. Graphs: csrc/attention_cudnn.cpp.
#pragma once
#include <cudnn.h>

#include <array>
#include <cstdint>
#include <stdexcept>

#include "kernel_common.cuh"

namespace tfp8 {

// Element strides of a [b, h, s, d] tensor (d's stride is 1).
using Strides4 = std::array<int64_t, 4>;

// One attention problem: everything its cuDNN graph depends on (the pointers' values aside).
// q [b, hq, sq, d_qk], k [b, hkv, skv, d_qk], v [b, hkv, skv, d_v], o / d_o [b, hq, sq, d_v], stats float32
// [b, hq, sq, 1] contiguous; dq / dk / dv as q / k / v. The backward strides are unused (zero) in a forward problem.
// FP8 problems (dtype E4M3 or E5M2: cuDNN's per-tensor-scaled FP8 SDPA): q, k, v, o of dtype; d_o, dq, dk, dv of
// grad_dtype (backward); scales and amaxes through Fp8ScalePointers; no dropout, no padding.
struct SdpaProblem {
  bool backward = false;
  DType dtype = DType::kBFloat16;       // float16 or bfloat16, or an FP8 dtype
  DType grad_dtype = DType::kBFloat16;  // FP8 backward only: d_o's and dq / dk / dv's FP8 dtype
  int64_t b = 0, hq = 0, hkv = 0, sq = 0, skv = 0, d_qk = 0, d_v = 0;
  Strides4 q{}, k{}, v{}, o{}, d_o{}, dq{}, dk{}, dv{};
  float scale = 1.0f;
  float dropout_p = 0.0f;
  bool causal = false;         // top-left aligned: key j > query i is masked
  bool padding = false;        // seqlens_q / seqlens_kv given
  bool deterministic = false;  // backward only: a bitwise reproducible algorithm

  bool fp8() const { return dtype == DType::kE4M3 || dtype == DType::kE5M2; }
};

// One-element float32 device pointers of an FP8 problem. descale = 1 / scale of the tensor it dequantizes; the amax
// outputs are overwritten (max|x| before scaling) with: s = softmax probabilities P, o = out, dp = dS (the gradient of
// q kᵀ, i.e. including the attention scale), dq / dk / dv = the gradients before their cast.
struct Fp8ScalePointers {
  const float *descale_q = nullptr, *descale_k = nullptr, *descale_v = nullptr, *descale_s = nullptr;
  const float *scale_s = nullptr, *scale_o = nullptr;  // forward
  const float *descale_o = nullptr, *descale_do = nullptr, *descale_dp = nullptr;
  const float *scale_dp = nullptr, *scale_dq = nullptr, *scale_dk = nullptr, *scale_dv = nullptr;  // backward
  float *amax_s = nullptr, *amax_o = nullptr;                                                      // forward
  float *amax_dp = nullptr, *amax_dq = nullptr, *amax_dk = nullptr, *amax_dv = nullptr;            // backward
};

// Device pointers of one call. seqlens: int32 [b] (padding only); seed / offset: int64 [1] (dropout only).
struct SdpaPointers {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void *o = nullptr, *stats = nullptr;  // outputs of the forward, inputs of the backward
  const void* d_o = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  const int32_t *seqlens_q = nullptr, *seqlens_kv = nullptr;
  const int64_t *seed = nullptr, *offset = nullptr;
  Fp8ScalePointers fp8;  // FP8 problems only
};

// cuDNN cannot run a problem (its support check or plan build refused it); what() says why.
struct SdpaUnsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Workspace bytes the graph of p needs. Builds the graph on this thread's first call with p on the current device and
// caches it (an unsupported p is cached too). Throws SdpaUnsupported when cuDNN cannot run p.
int64_t sdpa_workspace_bytes(const SdpaProblem& p, cudnnHandle_t handle);

// Runs p's cached graph on the handle's stream (set it first), with a workspace of sdpa_workspace_bytes(p) bytes.
void sdpa_execute(const SdpaProblem& p, const SdpaPointers& ptrs, void* workspace, cudnnHandle_t handle);

}  // namespace tfp8
