// fp8_linear_inference (contract: csrc/ops.cpp): an FP8 Linear's inference forward, where the weight is already FP8
// (fp8_model_init) and nothing is kept for a backward: the input's cast and the GEMM behind one dispatcher call.
//
// Why: a small Linear's inference is host-bound (the L20 grid of issue 22: M 128-512, K, N 1280-20480, where the GPU
// works 10-40 µs). The training path crosses from Python into the dispatcher once per op and builds an autograd
// Function around them; here Python makes one call (transformer_fp8._C.linear_inference, a typed pybind entry with
// no schema parsing) and the op makes two launches: inference_cast (the cast with its scaling bookkeeping: current
// scaling's amax and scale, or delayed scaling's update of the module's forward state, which the training path runs
// at the autocast's exit) and the GEMM. The values are those of the training path's ops bit for bit.
// Registered as CompositeImplicitAutograd (as csrc/composite.cpp): CUDA kernels, the CPU reference and fake tensors
// all run the same sequence of the underlying ops. The pybind entry skips the dispatcher altogether for plain CUDA
// tensors (no dispatch mode, no profiler): it calls the two CUDA kernels' own entries (linear_inference.h), which
// are what the dispatcher would reach, so the values stay the same bit for bit.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "library_op.h"
#include "linear_inference.h"

namespace tfp8 {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Gemm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, at::ScalarType, const OptTensor&, bool,
                                                const OptTensor&, const OptTensor&, bool, const OptTensor&);
using InferenceCast = at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType, const at::Tensor&,
                                 const at::Tensor&, bool, double, const OptTensor&, const OptTensor&, const OptTensor&,
                                 const OptTensor&, double, c10::string_view);
using LinearInference = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   at::ScalarType, const at::Tensor&, const at::Tensor&, const OptTensor&, bool, double,
                                   const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, double,
                                   c10::string_view);

void check_arguments(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale_inv, const OptTensor& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x: expected a contiguous tensor with at least one dim, got shape ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x: expected float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat8_e4m3fn || w.scalar_type() == at::kFloat8_e5m2),
              "w: expected an FP8 (float8_e4m3fn / float8_e5m2) matrix [out_features, in_features], got ",
              w.scalar_type(), " of shape ", w.sizes());
  TORCH_CHECK(x.size(-1) == w.size(1), "x: expected last dim ", w.size(1), " (w's in_features), got shape ", x.sizes());
  TORCH_CHECK(w_scale_inv.numel() == 1 && w_scale_inv.scalar_type() == at::kFloat,
              "w_scale_inv: expected one float32 element (a per-tensor scale), got ", w_scale_inv.scalar_type(),
              " of shape ", w_scale_inv.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == w.size(0)), "bias: expected shape [",
              w.size(0), "], got ", bias.has_value() ? bias->sizes() : at::IntArrayRef{});
}

// The op's sequence: inference_cast, then fp8_gemm; `direct`: through the CUDA kernels' entries (see
// linear_inference.h) instead of the dispatcher (the same kernels, so the same values bit for bit).
at::Tensor run_linear_inference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale_inv,
                                const at::Tensor& x_scale, at::ScalarType fp8_dtype, const at::Tensor& x_amax,
                                const at::Tensor& x_scale_inv, const OptTensor& bias, bool current_scaling,
                                double fp8_max, const OptTensor& history, const OptTensor& state_scale,
                                const OptTensor& state_scale_inv, const OptTensor& backup, double margin,
                                c10::string_view amax_compute_algo, bool direct) {
  static const auto cast = library_op<InferenceCast>("transformer_fp8::inference_cast");
  static const auto gemm = library_op<Gemm>("transformer_fp8::fp8_gemm");
  check_arguments(x, w, w_scale_inv, bias);
  const at::ScalarType out_dtype = x.scalar_type();
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  const at::Tensor xq = direct ? inference_cast_cuda_entry()(x2, x_scale, fp8_dtype, x_amax, x_scale_inv,
                                                             current_scaling, fp8_max, history, state_scale,
                                                             state_scale_inv, backup, margin, amax_compute_algo)
                               : cast.call(x2, x_scale, fp8_dtype, x_amax, x_scale_inv, current_scaling, fp8_max,
                                           history, state_scale, state_scale_inv, backup, margin, amax_compute_algo);
  // (a 16-bit output takes the bias in the GEMM epilogue, in its dtype; a float32 one gets it added afterwards, as
  // module/_gemm.py's fp8_gemm_bias does)
  const bool epilogue_bias = bias.has_value() && out_dtype != at::kFloat;
  // (Tensor::to is a dispatcher call even when the dtype already matches: skipped then)
  const OptTensor gemm_bias = !epilogue_bias                     ? std::nullopt
                              : bias->scalar_type() == out_dtype ? bias
                                                                 : OptTensor(bias->to(out_dtype));
  at::Tensor out;
  if (!direct || !inference_gemm_cuda_entry()(xq, x_scale_inv, w, w_scale_inv, out_dtype, gemm_bias, out))
    out = std::get<0>(gemm.call(xq, x_scale_inv, w, w_scale_inv, out_dtype, gemm_bias, false, std::nullopt,
                                std::nullopt, /*use_split_accumulator=*/false, std::nullopt));
  if (bias.has_value() && !epilogue_bias) out.add_(*bias);
  if (x.dim() == 2) return out;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out.size(1);
  return out.view(sizes);
}

at::Tensor fp8_linear_inference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale_inv,
                                const at::Tensor& x_scale, at::ScalarType fp8_dtype, const at::Tensor& x_amax,
                                const at::Tensor& x_scale_inv, const OptTensor& bias, bool current_scaling,
                                double fp8_max, const OptTensor& history, const OptTensor& state_scale,
                                const OptTensor& state_scale_inv, const OptTensor& backup, double margin,
                                c10::string_view amax_compute_algo) {
  return run_linear_inference(x, w, w_scale_inv, x_scale, fp8_dtype, x_amax, x_scale_inv, bias, current_scaling,
                              fp8_max, history, state_scale, state_scale_inv, backup, margin, amax_compute_algo,
                              /*direct=*/false);
}

// Whether a tensor is a plain CUDA tensor: no Python subclass (fake tensors), functorch or functionalization wrapper,
// whose ops must go through the dispatcher.
bool plain_cuda(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                             c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Functionalize,
                                             c10::DispatchKey::FuncTorchGradWrapper});
  return t.is_cuda() && !t.key_set().has_any(wrappers);
}

// Whether linear_inference may call the kernels' entries directly: both filled in, plain CUDA operands, no Python
// dispatch mode (it must see the ops) and no RecordFunction callbacks (the profiler records the ops' names).
bool direct_applies(const at::Tensor& x, const at::Tensor& w) {
  return inference_cast_cuda_entry() != nullptr && inference_gemm_cuda_entry() != nullptr && plain_cuda(x) &&
         plain_cuda(w) && c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::hasCallbacks();
}

}  // namespace

InferenceCastEntry& inference_cast_cuda_entry() {
  static InferenceCastEntry entry = nullptr;
  return entry;
}

InferenceGemmEntry& inference_gemm_cuda_entry() {
  static InferenceGemmEntry entry = nullptr;
  return entry;
}

at::Tensor linear_inference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale_inv,
                            const at::Tensor& x_scale, at::ScalarType fp8_dtype, const at::Tensor& x_amax,
                            const at::Tensor& x_scale_inv, const OptTensor& bias, bool current_scaling, double fp8_max,
                            const OptTensor& history, const OptTensor& state_scale, const OptTensor& state_scale_inv,
                            const OptTensor& backup, double margin, bool use_max) {
  static const auto op = library_op<LinearInference>("transformer_fp8::fp8_linear_inference");
  // (the caller needs no gradient: below autograd, so that neither this call nor the composite's inner ops pass
  // through the autograd layer, as the C++ Linear node's forward does)
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (direct_applies(x, w))
    return run_linear_inference(x, w, w_scale_inv, x_scale, fp8_dtype, x_amax, x_scale_inv, bias, current_scaling,
                                fp8_max, history, state_scale, state_scale_inv, backup, margin,
                                use_max ? "max" : "most_recent", /*direct=*/true);
  return op.call(x, w, w_scale_inv, x_scale, fp8_dtype, x_amax, x_scale_inv, bias, current_scaling, fp8_max, history,
                 state_scale, state_scale_inv, backup, margin, use_max ? "max" : "most_recent");
}

}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CompositeImplicitAutograd, m) {
  m.impl("fp8_linear_inference", &tfp8::fp8_linear_inference);
}
