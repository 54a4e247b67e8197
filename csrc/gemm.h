// FP8 GEMM entry points without torch types (implemented in gemm_cublaslt.cpp and gemm_amax.cu).
// A call: fill Fp8GemmArgs (all but the workspace), ask fp8_gemm_workspace_bytes, give that much workspace, run
// fp8_gemm_cublaslt on the same thread with the same arguments.
//
// Row-major "TN": out [m, n] = epilogue((a * a_scale_inv) @ (b * b_scale_inv)^T) (+ out when accumulating, + residual
// when given),
// a [m, k] and b [n, k] FP8 with k-contiguous rows. The caller pads: k % 16 == 0, ld_out % 16 == 0, every pointer
// 16-byte aligned.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernel_common.cuh"

namespace tfp8 {

// The most workspace the algorithm search may pick an algorithm for (cuBLAS's recommendation for Hopper); a call
// allocates only what its algorithm needs (fp8_gemm_workspace_bytes).
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

// How an operand's scale_inv pointer is read: one float32 for the tensor, or block scaling (float32 per 1x128 tile
// along k / per 128x128 block, laid out as transformer_fp8/quantization/block.py says; not both operands kBlock128).
enum class ScaleMode : int { kTensor, kVec128, kBlock128 };

struct Fp8GemmArgs {
  const void* a;             // [m, k], a_type (E4M3 or E5M2)
  const void* b;             // [n, k], b_type (not E5M2 when a_type is)
  const float* a_scale_inv;  // device scalars (kTensor), else the block scales
  const float* b_scale_inv;
  DType a_type, b_type;
  ScaleMode a_scale_mode = ScaleMode::kTensor, b_scale_mode = ScaleMode::kTensor;
  int64_t m, n, k;
  void* out;  // [m, ld_out] of out_type; float32 and read too when accumulate
  DType out_type;
  int64_t ld_out;
  const float* out_scale = nullptr;  // FP8 out: out = saturate(result * out_scale)
  float* amax_scratch = nullptr;     // FP8 out, optional: receives max|result| (written, not max-accumulated)
  const void* bias = nullptr;        // optional [n] of bias_type, added before the GELU
  DType bias_type = DType::kBFloat16;
  void* pre_gelu = nullptr;  // non-null: GELU epilogue, the pre-activation [m, ld_out] stored here
  DType pre_gelu_type = DType::kBFloat16;
  const void* residual = nullptr;  // optional [m, ld_out] of out_type (not FP8): out = result + residual (cuBLASLt's
                                   // C with beta = 1; not with accumulate or the GELU epilogue)
  bool accumulate = false;         // out += result (beta = 1)
  bool fast_accum = false;         // FP8 fast accumulation (no periodic promotion to float32)
  void* workspace = nullptr;       // workspace_bytes on the device (null when 0)
  size_t workspace_bytes = 0;      // at least fp8_gemm_workspace_bytes(args)
};

// Bytes of workspace the GEMM of `args` needs (on the current device; the pointers' values do not matter, their
// alignment does). Builds and caches the cuBLASLt setup on first use, so it throws what fp8_gemm_cublaslt would.
size_t fp8_gemm_workspace_bytes(const Fp8GemmArgs& args);

// Enqueues the GEMM on `stream` (the current device's). Throws std::runtime_error when cuBLASLt refuses it, and
// std::invalid_argument when args.workspace_bytes is less than the GEMM needs.
void fp8_gemm_cublaslt(const Fp8GemmArgs& args, cudaStream_t stream);

// *amax = max(*amax, *value), both device scalars (value >= 0 or NaN).
void launch_fold_amax(const float* value, float* amax, cudaStream_t stream);

}  // namespace tfp8
