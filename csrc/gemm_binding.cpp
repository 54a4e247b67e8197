// CUDA kernels of fp8_gemm and fp8_gemm_accumulate (contracts in csrc/ops.cpp): argument checks, output allocation,
// and zero padding of the shapes cuBLASLt's FP8 kernels cannot take (K and the output row length must be multiples
// of 16, pointers 16-byte aligned). Padding is exact: zero K columns add nothing, extra output columns are sliced off.
#include <ATen/cuda/CUDAContextLight.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "gemm.h"
#include "gemm_workspace.h"

namespace tfp8 {

// (declared in gemm_workspace.h)
Fp8GemmArgs operand_args(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, int64_t m, int64_t n, int64_t k, bool use_split_accumulator) {
  Fp8GemmArgs args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.a_scale_inv = a_scale_inv.data_ptr<float>();
  args.b_scale_inv = b_scale_inv.data_ptr<float>();
  args.a_type = to_dtype(a.scalar_type(), "a");
  args.b_type = to_dtype(b.scalar_type(), "b");
  args.m = m;
  args.n = n;
  args.k = k;
  args.fast_accum = !use_split_accumulator;
  return args;
}

// (declared in gemm_workspace.h)
void check_residual(const at::Tensor& residual, at::ScalarType out_dtype, int64_t m, int64_t n, const at::Tensor& a) {
  check_cuda(residual, "residual");
  TORCH_CHECK(residual.scalar_type() == out_dtype, "residual: expected dtype ", out_dtype, " (out_dtype), got ",
              residual.scalar_type());
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == m && residual.size(1) == n, "residual: expected shape ",
              dims({m, n}), ", got ", dims(residual.sizes()));
  TORCH_CHECK(residual.is_contiguous(), "residual: expected a contiguous tensor, got strides ",
              dims(residual.strides()));
  TORCH_CHECK(residual.device() == a.device(), "residual: expected a tensor on ", a.device().str(), ", got one on ",
              residual.device().str());
}

// (declared in gemm_workspace.h) Gives the fully described GEMM `args` the workspace its algorithm needs (possibly
// none): torch's own cuBLASLt workspace of the current stream when it is large enough (kept by torch per stream, also under graph capture: no
// allocation per call, no second buffer; GEMMs on one stream run in order, so sharing it is safe), else a fresh
// buffer. The tensor returned owns a fresh buffer (undefined otherwise) and must live until the GEMM is enqueued.
at::Tensor attach_workspace(Fp8GemmArgs& args, const at::TensorOptions& options) {
  args.workspace_bytes = fp8_gemm_workspace_bytes(args);
  if (args.workspace_bytes == 0) return {};
  if (args.workspace_bytes <= at::cuda::getCUDABlasLtWorkspaceSize()) {
    args.workspace = at::cuda::getCUDABlasLtWorkspace();
    return {};
  }
  at::Tensor workspace = at::empty({int64_t(args.workspace_bytes)}, options.dtype(at::kByte));
  args.workspace = workspace.data_ptr();
  return workspace;
}

namespace {

constexpr int64_t kPad = 16;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_on_device_of(const at::Tensor& t, const at::Tensor& data, const char* arg) {
  TORCH_CHECK(t.device() == data.device(), arg, ": expected a tensor on ", data.device().str(), ", got one on ",
              t.device().str());
}

// scale_inv / out_scale / out_amax: one float32 element on the operands' device.
void check_scalar(const at::Tensor& t, const at::Tensor& data, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == 1, arg, ": expected one element, got shape ", dims(t.sizes()));
  check_on_device_of(t, data, arg);
}

void check_operand(const at::Tensor& t, const char* arg) {
  check_cuda(t, arg);
  check_fp8_dtype(t.scalar_type(), arg);
  TORCH_CHECK(t.dim() == 2, arg, ": expected a 2-D tensor, got shape ", dims(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), arg, ": expected a K-contiguous row-major tensor, got strides ", dims(t.strides()));
}

void check_operands(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                    const at::Tensor& b_scale_inv) {
  check_operand(a, "a");
  check_operand(b, "b");
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "a, b: E5M2 x E5M2 is not supported by the FP8 tensor cores; make one operand E4M3");
  TORCH_CHECK(b.size(1) == a.size(1), "b: expected K = ", std::to_string(a.size(1)), " columns (a is ", dims(a.sizes()),
              "), got shape ", dims(b.sizes()));
  check_on_device_of(b, a, "b");
  check_scalar(a_scale_inv, a, "a_scale_inv");
  check_scalar(b_scale_inv, a, "b_scale_inv");
}

// cuBLASLt's FP8 GEMM: bias dtype = C dtype = the output's, BF16 for a float32 output, BF16 or FP16 for FP8 ones.
bool bias_dtype_allowed(at::ScalarType bias, at::ScalarType out) {
  if (out == at::kHalf) return bias == at::kHalf;
  if (is_fp8(out)) return bias == at::kBFloat16 || bias == at::kHalf;
  return bias == at::kBFloat16;
}

at::ScalarType pre_gelu_dtype(at::ScalarType out, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) return bias->scalar_type();
  return is_fp8(out) ? at::kBFloat16 : out;
}

// t [rows, cols] zero-padded to [rows_to, cols_to] in fresh (aligned) memory; t itself when that changes nothing.
at::Tensor padded(const at::Tensor& t, int64_t rows_to, int64_t cols_to) {
  if (t.size(0) == rows_to && t.size(1) == cols_to && aligned16(t)) return t;
  at::Tensor out = at::zeros({rows_to, cols_to}, t.options().dtype(at::kByte));
  out.narrow(0, 0, t.size(0)).narrow(1, 0, t.size(1)).copy_(t.view(at::kByte));
  return out.view(t.scalar_type());
}

at::Tensor padded_bias(const at::Tensor& bias, int64_t n_to) {
  if (bias.size(0) == n_to && bias.is_contiguous() && aligned16(bias)) return bias;
  at::Tensor out = at::zeros({n_to}, bias.options());
  out.narrow(0, 0, bias.size(0)).copy_(bias);
  return out;
}


std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                                            const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias, bool gelu,
                                            const std::optional<at::Tensor>& out_scale,
                                            const std::optional<at::Tensor>& out_amax, bool use_split_accumulator,
                                            const std::optional<at::Tensor>& residual) {
  check_operands(a, a_scale_inv, b, b_scale_inv);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16 || is_fp8(out_dtype),
              "out_dtype: expected float32, float16, bfloat16 or an FP8 dtype, got ", out_dtype);
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    TORCH_CHECK(bias_dtype_allowed(bias->scalar_type(), out_dtype), "bias: expected dtype ",
                out_dtype == at::kHalf ? "torch.float16"
                : is_fp8(out_dtype)    ? "torch.bfloat16 or torch.float16"
                                       : "torch.bfloat16",
                " for out_dtype ", out_dtype, ", got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape (", std::to_string(n), ",), got ",
                dims(bias->sizes()));
    check_on_device_of(*bias, a, "bias");
  }
  if (is_fp8(out_dtype)) {
    TORCH_CHECK(out_scale.has_value(), "out_scale: required for an FP8 out_dtype (", out_dtype, ")");
    check_scalar(*out_scale, a, "out_scale");
    if (out_amax.has_value()) check_scalar(*out_amax, a, "out_amax");
  } else {
    TORCH_CHECK(!out_scale.has_value() && !out_amax.has_value(),
                "out_scale, out_amax: only for an FP8 out_dtype, got out_dtype ", out_dtype);
  }

  if (residual.has_value()) {
    TORCH_CHECK(!is_fp8(out_dtype) && !gelu,
                "residual: only for a float32, float16 or bfloat16 out_dtype without "
                "gelu, got out_dtype ",
                out_dtype, gelu ? " with gelu" : "");
    check_residual(*residual, out_dtype, m, n, a);
  }

  const c10::cuda::CUDAGuard guard(a.device());
  const at::TensorOptions options = a.options();
  const at::ScalarType pre_dtype = pre_gelu_dtype(out_dtype, bias);
  if (m == 0 || n == 0) {
    return {at::empty({m, n}, options.dtype(out_dtype)),
            gelu ? at::empty({m, n}, options.dtype(pre_dtype)) : at::empty({0}, options.dtype(pre_dtype))};
  }
  const int64_t k_pad = std::max(kPad, round_up(k, kPad)), n_pad = round_up(n, kPad);
  const at::Tensor a_p = padded(a, m, k_pad), b_p = padded(b, n_pad, k_pad);
  at::Tensor out = at::empty({m, n_pad}, options.dtype(out_dtype));
  // cuBLASLt has no GELU_AUX_BIAS epilogue for a float32 output with a BF16 pre-activation: there the GEMM adds the
  // bias and GELU runs after it (a rare combination; the fused epilogue serves every other one).
  const bool fused_gelu = gelu && !(out_dtype == at::kFloat && bias.has_value());
  at::Tensor pre_gelu = fused_gelu ? at::empty({m, n_pad}, options.dtype(pre_dtype))
                                   : at::empty({0}, options.dtype(pre_dtype));
  at::Tensor bias_p, amax_scratch;

  Fp8GemmArgs args = operand_args(a_p, a_scale_inv, b_p, b_scale_inv, m, n_pad, k_pad, use_split_accumulator);
  args.out = out.data_ptr();
  args.out_type = to_dtype(out_dtype, "out_dtype");
  args.ld_out = n_pad;
  if (bias.has_value()) {
    bias_p = padded_bias(*bias, n_pad);
    args.bias = bias_p.data_ptr();
    args.bias_type = to_dtype(bias_p.scalar_type(), "bias");
  }
  // (a padded or misaligned output: the residual is added after the GEMM instead)
  const bool fused_residual = residual.has_value() && n_pad == n && aligned16(*residual);
  if (fused_residual) args.residual = residual->data_ptr();
  if (fused_gelu) {
    args.pre_gelu = pre_gelu.data_ptr();
    args.pre_gelu_type = to_dtype(pre_dtype, "pre_gelu");
  }
  if (is_fp8(out_dtype)) {
    args.out_scale = out_scale->data_ptr<float>();
    if (out_amax.has_value()) {
      amax_scratch = at::empty({1}, options.dtype(at::kFloat));
      args.amax_scratch = amax_scratch.data_ptr<float>();
    }
  }
  const at::Tensor workspace = attach_workspace(args, options);
  const cudaStream_t stream = current_stream();
  fp8_gemm_cublaslt(args, stream);
  if (amax_scratch.defined()) launch_fold_amax(amax_scratch.data_ptr<float>(), out_amax->data_ptr<float>(), stream);
  if (gelu && !fused_gelu) {
    pre_gelu = out.to(pre_dtype);
    at::gelu_(out, "tanh");
  }
  if (n_pad != n) {
    out = out.narrow(1, 0, n).contiguous();
    if (gelu) pre_gelu = pre_gelu.narrow(1, 0, n).contiguous();
  }
  if (residual.has_value() && !fused_residual) out.add_(*residual);
  return {out, pre_gelu};
}

void fp8_gemm_accumulate(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, const at::Tensor& out, bool use_split_accumulator) {
  check_operands(a, a_scale_inv, b, b_scale_inv);
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out: expected a float32 tensor, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "out: expected shape ", dims({m, n}), ", got ",
              dims(out.sizes()));
  TORCH_CHECK(out.is_contiguous(), "out: expected a contiguous tensor, got strides ", dims(out.strides()));
  check_on_device_of(out, a, "out");
  if (m == 0 || n == 0 || k == 0) return;

  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t k_pad = round_up(k, kPad), n_pad = round_up(n, kPad);
  const at::Tensor a_p = padded(a, m, k_pad), b_p = padded(b, n_pad, k_pad);
  const bool in_place = n_pad == n && aligned16(out);
  at::Tensor acc = in_place ? out : at::zeros({m, n_pad}, out.options());
  if (!in_place) acc.narrow(1, 0, n).copy_(out);

  Fp8GemmArgs args = operand_args(a_p, a_scale_inv, b_p, b_scale_inv, m, n_pad, k_pad, use_split_accumulator);
  args.out = acc.data_ptr();
  args.out_type = DType::kFloat32;
  args.ld_out = n_pad;
  args.accumulate = true;
  const at::Tensor workspace = attach_workspace(args, a.options());
  fp8_gemm_cublaslt(args, current_stream());
  if (!in_place) out.copy_(acc.narrow(1, 0, n));
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("fp8_gemm_accumulate", &fp8_gemm_accumulate);
}

}  // namespace tfp8
