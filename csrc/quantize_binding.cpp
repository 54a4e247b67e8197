// CUDA kernels of the quantize family for torch: argument checks, output allocation, launch on the current stream.
// Contracts: csrc/ops.cpp; kernels: csrc/quantize_cast.cu, csrc/quantize_transpose.cu.
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "common.h"
#include "quantize.h"

namespace tfp8 {
namespace {

void check_input(const at::Tensor& t, const char* arg) {
  check_cuda(t, arg);
  check_high_precision(t, arg);
}

// t as rows at a stride (see Rows in quantize.h): its trailing dims, contiguous among themselves, make a row of `cols`
// elements; its leading dims merge into one row index at stride `ld` (a contiguous t: one row). Else an error naming
// arg.
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t, const char* arg) {
  int64_t cols = 1, dim = t.dim() - 1;
  for (; dim >= 0 && (t.size(dim) == 1 || t.stride(dim) == cols); --dim) cols *= t.size(dim);
  int64_t ld = -1, span = 1;  // the leading dims: the innermost one's stride, and the rows it and those inside span
  bool rows = true;
  for (; dim >= 0 && rows; --dim) {
    if (t.size(dim) == 1) continue;
    if (ld < 0) {
      ld = t.stride(dim);
      rows = ld >= cols;
    } else {
      rows = t.stride(dim) == ld * span;
    }
    span *= t.size(dim);
  }
  TORCH_CHECK(rows, arg,
              ": expected a contiguous tensor or rows of contiguous elements at one stride (such as a "
              "slice of a wider tensor's last dim), got shape ",
              dims(t.sizes()), " and strides ", dims(t.strides()));
  return {cols, ld < 0 ? cols : ld};
}

void check_2d(const at::Tensor& t, const char* arg) {
  TORCH_CHECK(t.dim() == 2, arg, ": expected a 2-D tensor [M, N], got shape ", dims(t.sizes()));
}

// The checks every cast shares: input, fp8_dtype, scale, and the optional amax / scale_inv.
void check_cast_args(const at::Tensor& input, const at::Tensor& scale, at::ScalarType fp8_dtype,
                     const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale_inv,
                     const char* arg = "input") {
  check_input(input, arg);
  check_fp8_dtype(fp8_dtype, "fp8_dtype");
  check_scalar_f32(scale, input, "scale");
  check_optional_scalar_f32(amax, input, "amax");
  check_optional_scalar_f32(scale_inv, input, "scale_inv");
}

// An empty input launches nothing, but scale_inv still receives 1 / scale.
void refresh_scale_inv(const at::Tensor& scale, const std::optional<at::Tensor>& scale_inv) {
  if (scale_inv.has_value()) scale_inv->copy_(scale.reciprocal().reshape(scale_inv->sizes()));
}

uint8_t* fp8_ptr(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

at::Tensor quantize(const at::Tensor& input, const at::Tensor& scale, at::ScalarType fp8_dtype,
                    const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale_inv) {
  check_cast_args(input, scale, fp8_dtype, amax, scale_inv);
  const auto [cols, ld] = rows_of(input, "input");
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor q = at::empty(input.sizes(), input.options().dtype(fp8_dtype));
  if (input.numel() == 0) {
    refresh_scale_inv(scale, scale_inv);
    return q;
  }
  launch_quantize(input.data_ptr(), fp8_ptr(q), input.numel(), Rows{cols, ld, cols},
                  to_dtype(input.scalar_type(), "input"), to_dtype(fp8_dtype, "fp8_dtype"), scale.data_ptr<float>(),
                  optional_ptr(amax), optional_ptr(scale_inv), current_stream());
  return q;
}

at::Tensor dequantize(const at::Tensor& input, const at::Tensor& scale_inv, at::ScalarType out_dtype) {
  check_cuda(input, "input");
  check_fp8_dtype(input.scalar_type(), "input");
  check_contiguous(input, "input");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
              "out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got ", out_dtype);
  check_scalar_f32(scale_inv, input, "scale_inv");
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty_like(input, input.options().dtype(out_dtype));
  launch_dequantize(fp8_ptr(input), out.data_ptr(), input.numel(), Rows::dense(input.numel()),
                    to_dtype(input.scalar_type(), "input"), to_dtype(out_dtype, "out_dtype"),
                    scale_inv.data_ptr<float>(), current_stream());
  return out;
}

void dequantize_into(const at::Tensor& input, const at::Tensor& scale_inv, const at::Tensor& out) {
  check_cuda(input, "input");
  check_fp8_dtype(input.scalar_type(), "input");
  check_contiguous(input, "input");
  check_cuda(out, "out");
  check_same_device(out, input, "out");
  check_high_precision(out, "out");
  TORCH_CHECK(out.sizes() == input.sizes(), "out: expected input's shape ", dims(input.sizes()), ", got ",
              dims(out.sizes()));
  check_scalar_f32(scale_inv, input, "scale_inv");
  const auto [cols, ld] = rows_of(out, "out");
  c10::cuda::CUDAGuard guard(input.device());
  launch_dequantize(fp8_ptr(input), out.data_ptr(), input.numel(), Rows{cols, cols, ld},
                    to_dtype(input.scalar_type(), "input"), to_dtype(out.scalar_type(), "out"),
                    scale_inv.data_ptr<float>(), current_stream());
}

void compute_amax(const at::Tensor& input, const at::Tensor& amax) {
  check_input(input, "input");
  check_contiguous(input, "input");
  check_scalar_f32(amax, input, "amax");
  c10::cuda::CUDAGuard guard(input.device());
  launch_compute_amax(input.data_ptr(), input.numel(), to_dtype(input.scalar_type(), "input"), amax.data_ptr<float>(),
                      current_stream());
}

std::tuple<at::Tensor, at::Tensor> cast_transpose(const at::Tensor& input, const at::Tensor& scale,
                                                  at::ScalarType fp8_dtype, bool rowwise, bool transpose,
                                                  const std::optional<at::Tensor>& amax,
                                                  const std::optional<at::Tensor>& scale_inv) {
  check_cast_args(input, scale, fp8_dtype, amax, scale_inv);
  check_2d(input, "input");
  check_contiguous(input, "input");
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t m = input.size(0), n = input.size(1);
  const auto options = input.options().dtype(fp8_dtype);
  at::Tensor q = rowwise ? at::empty({m, n}, options) : at::empty({0}, options);
  at::Tensor qT = transpose ? at::empty({n, m}, options) : at::empty({0}, options);
  if (input.numel() == 0 || !(rowwise || transpose)) {
    // Nothing to cast, but the side outputs keep their contract.
    if (amax.has_value() && input.numel() > 0) compute_amax(input, *amax);
    refresh_scale_inv(scale, scale_inv);
    return {q, qT};
  }
  launch_cast_transpose(input.data_ptr(), rowwise ? fp8_ptr(q) : nullptr, transpose ? fp8_ptr(qT) : nullptr, m, n,
                        to_dtype(input.scalar_type(), "input"), to_dtype(fp8_dtype, "fp8_dtype"),
                        scale.data_ptr<float>(), optional_ptr(amax), optional_ptr(scale_inv), nullptr, nullptr,
                        current_stream());
  return {q, qT};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_transpose_dbias(const at::Tensor& grad, const at::Tensor& scale,
                                                                    at::ScalarType fp8_dtype,
                                                                    const std::optional<at::Tensor>& amax,
                                                                    const std::optional<at::Tensor>& scale_inv) {
  check_cast_args(grad, scale, fp8_dtype, amax, scale_inv, "grad");
  check_2d(grad, "grad");
  check_contiguous(grad, "grad");
  c10::cuda::CUDAGuard guard(grad.device());
  const int64_t m = grad.size(0), n = grad.size(1);
  const auto options = grad.options().dtype(fp8_dtype);
  at::Tensor q = at::empty({m, n}, options), qT = at::empty({n, m}, options);
  at::Tensor dbias = at::empty({n}, grad.options());
  if (grad.numel() == 0) {
    dbias.zero_();  // a sum over no rows
    refresh_scale_inv(scale, scale_inv);
    return {q, qT, dbias};
  }
  const int64_t workspace_rows = dbias_workspace_rows(m);
  at::Tensor workspace;
  if (workspace_rows > 0) workspace = at::empty({workspace_rows, n}, grad.options().dtype(at::kFloat));
  launch_cast_transpose(grad.data_ptr(), fp8_ptr(q), fp8_ptr(qT), m, n, to_dtype(grad.scalar_type(), "grad"),
                        to_dtype(fp8_dtype, "fp8_dtype"), scale.data_ptr<float>(), optional_ptr(amax),
                        optional_ptr(scale_inv), dbias.data_ptr(),
                        workspace.defined() ? workspace.data_ptr<float>() : nullptr, current_stream());
  return {q, qT, dbias};
}

at::Tensor fp8_transpose(const at::Tensor& input) {
  check_cuda(input, "input");
  check_fp8_dtype(input.scalar_type(), "input");
  check_2d(input, "input");
  check_contiguous(input, "input");
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty({input.size(1), input.size(0)}, input.options());
  launch_fp8_transpose(fp8_ptr(input), fp8_ptr(out), input.size(0), input.size(1), current_stream());
  return out;
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("quantize", &tfp8::quantize);
  m.impl("dequantize", &tfp8::dequantize);
  m.impl("dequantize_into", &tfp8::dequantize_into);
  m.impl("compute_amax", &tfp8::compute_amax);
  m.impl("cast_transpose", &tfp8::cast_transpose);
  m.impl("cast_transpose_dbias", &tfp8::cast_transpose_dbias);
  m.impl("fp8_transpose", &tfp8::fp8_transpose);
}
