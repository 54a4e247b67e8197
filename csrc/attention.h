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
struct SdpaProblem {
  bool backward = false;
  DType dtype = DType::kBFloat16;  // float16 or bfloat16
  int64_t b = 0, hq = 0, hkv = 0, sq = 0, skv = 0, d_qk = 0, d_v = 0;
  Strides4 q{}, k{}, v{}, o{}, d_o{}, dq{}, dk{}, dv{};
  float scale = 1.0f;
  float dropout_p = 0.0f;
  bool causal = false;         // top-left aligned: key j > query i is masked
  bool padding = false;        // seqlens_q / seqlens_kv given
  bool deterministic = false;  // backward only: a bitwise reproducible algorithm
};

// Device pointers of one call. seqlens: int32 [b] (padding only); seed / offset: int64 [1] (dropout only).
struct SdpaPointers {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void *o = nullptr, *stats = nullptr;  // outputs of the forward, inputs of the backward
  const void* d_o = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  const int32_t *seqlens_q = nullptr, *seqlens_kv = nullptr;
  const int64_t *seed = nullptr, *offset = nullptr;
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
