// linear_inference's direct GEMM entry (csrc/linear_inference.h): fp8_gemm's CUDA kernel (csrc/gemm_binding.cpp) for
// the one case of an FP8-weight Linear's inference call, without the dispatcher. It runs where fp8_gemm would pad or
// copy nothing, so both build the same Fp8GemmArgs and run the same cuBLASLt plan: the same values bit for bit.
// Anything else (a shape to pad, a misaligned operand, a bias of another dtype, any argument fp8_gemm would refuse)
// answers false, and the caller calls fp8_gemm, which runs or raises its clear error.
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "common.h"
#include "gemm.h"
#include "gemm_workspace.h"
#include "linear_inference.h"

namespace tfp8 {
namespace {

constexpr int64_t kPad = 16;  // (fp8_gemm pads K and N to multiples of this)

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

bool fp8_matrix(const at::Tensor& t, const at::Tensor& a) {
  return t.dim() == 2 && t.is_contiguous() && t.device() == a.device() &&
         (t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2) && aligned16(t);
}

bool scalar_on(const at::Tensor& t, const at::Tensor& a) {
  return t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == a.device();
}

bool inference_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                    const at::Tensor& b_scale_inv, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                    at::Tensor& out) {
  if (!a.is_cuda() || !fp8_matrix(a, a) || !fp8_matrix(b, a) || !scalar_on(a_scale_inv, a) ||
      !scalar_on(b_scale_inv, a) || (out_dtype != at::kHalf && out_dtype != at::kBFloat16))
    return false;
  if (a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2) return false;
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  if (m == 0 || n == 0 || b.size(1) != k || k % kPad != 0 || n % kPad != 0) return false;
  if (bias.has_value() && !(bias->scalar_type() == out_dtype && bias->dim() == 1 && bias->size(0) == n &&
                            bias->is_contiguous() && bias->device() == a.device() && aligned16(*bias)))
    return false;
  const c10::cuda::CUDAGuard guard(a.device());
  // (the CUDA allocation at::empty's CUDA kernel makes, without its dispatcher call)
  out = at::detail::empty_cuda({m, n}, out_dtype, a.device(), std::nullopt);
  // (the fields fp8_gemm's operand_args and epilogue set for this case, in the same values)
  Fp8GemmArgs args = operand_args(a, a_scale_inv, b, b_scale_inv, m, n, k, /*use_split_accumulator=*/false);
  args.out = out.data_ptr();
  args.out_type = to_dtype(out_dtype, "out_dtype");
  args.ld_out = n;
  if (bias.has_value()) {
    args.bias = bias->data_ptr();
    args.bias_type = to_dtype(bias->scalar_type(), "bias");
  }
  const at::Tensor workspace = attach_workspace(args, a.options());
  fp8_gemm_cublaslt(args, current_stream());
  return true;
}

const bool entry_filled = [] {
  inference_gemm_cuda_entry() = &inference_gemm;
  return true;
}();

}  // namespace
}  // namespace tfp8
