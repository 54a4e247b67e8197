// Composite ops (schemas and contracts in csrc/ops.cpp): a fixed sequence of this library's ops behind one call, so
// that an FP8 Linear's forward and backward each cross from Python into the dispatcher once instead of once per op
// (a small model's step is host-bound, and on a slow host each crossing costs several microseconds).
// Registered as CompositeImplicitAutograd: every backend (the CUDA kernels, the CPU reference, fake tensors under
// torch.compile) runs the same sequence of the underlying ops, so the results are theirs bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "library_op.h"

namespace tfp8 {
namespace {

using OptTensor = std::optional<at::Tensor>;
using CastTranspose = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::ScalarType, bool,
                                                         bool, const OptTensor&, const OptTensor&);
using CastTransposeDbias = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                          at::ScalarType, const OptTensor&,
                                                                          const OptTensor&);
using Gemm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, at::ScalarType, const OptTensor&, bool,
                                                const OptTensor&, const OptTensor&, bool, const OptTensor&);
using GemmAccumulate = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, bool);

at::Tensor empty_of(const at::Tensor& like, at::ScalarType dtype) {
  return at::empty({0}, like.options().dtype(dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& x_scale, const at::Tensor& w_scale,
                                                              at::ScalarType fp8_dtype, const OptTensor& x_amax,
                                                              const at::Tensor& x_scale_inv, const OptTensor& w_amax,
                                                              const at::Tensor& w_scale_inv, bool x_transpose,
                                                              bool w_transpose, at::ScalarType out_dtype,
                                                              const OptTensor& bias, const OptTensor& residual) {
  static const auto cast = library_op<CastTranspose>("transformer_fp8::cast_transpose");
  static const auto gemm = library_op<Gemm>("transformer_fp8::fp8_gemm");
  auto [xq, xqt] = cast.call(x, x_scale, fp8_dtype, true, x_transpose, x_amax, x_scale_inv);
  auto [wq, wqt] = cast.call(weight, w_scale, fp8_dtype, true, w_transpose, w_amax, w_scale_inv);
  at::Tensor out = std::get<0>(gemm.call(xq, x_scale_inv, wq, w_scale_inv, out_dtype, bias, false, std::nullopt,
                                         std::nullopt, /*use_split_accumulator=*/false, residual));
  return {out, xqt, wqt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_bwd(const at::Tensor& dy, const at::Tensor& dy_scale,
                                                              at::ScalarType fp8_dtype, const OptTensor& dy_amax,
                                                              const at::Tensor& dy_scale_inv, bool compute_dbias,
                                                              const OptTensor& w_t, const at::Tensor& w_scale_inv,
                                                              at::ScalarType dx_dtype, const OptTensor& x_t,
                                                              const at::Tensor& x_scale_inv, at::ScalarType dw_dtype,
                                                              const OptTensor& main_grad) {
  static const auto cast = library_op<CastTranspose>("transformer_fp8::cast_transpose");
  static const auto cast_dbias = library_op<CastTransposeDbias>("transformer_fp8::cast_transpose_dbias");
  static const auto gemm = library_op<Gemm>("transformer_fp8::fp8_gemm");
  static const auto accumulate = library_op<GemmAccumulate>("transformer_fp8::fp8_gemm_accumulate");
  at::Tensor q, qt, dbias;
  if (compute_dbias) {
    std::tie(q, qt, dbias) = cast_dbias.call(dy, dy_scale, fp8_dtype, dy_amax, dy_scale_inv);
  } else {
    std::tie(q, qt) = cast.call(dy, dy_scale, fp8_dtype, w_t.has_value(), x_t.has_value(), dy_amax, dy_scale_inv);
    dbias = empty_of(dy, dy.scalar_type());
  }
  at::Tensor dx = w_t.has_value() ? std::get<0>(gemm.call(q, dy_scale_inv, *w_t, w_scale_inv, dx_dtype, std::nullopt,
                                                          false, std::nullopt, std::nullopt, true, std::nullopt))
                                  : empty_of(dy, dx_dtype);
  at::Tensor dw = empty_of(dy, dw_dtype);
  if (x_t.has_value() && main_grad.has_value()) {
    accumulate.call(qt, dy_scale_inv, *x_t, x_scale_inv, *main_grad, true);
  } else if (x_t.has_value()) {
    dw = std::get<0>(gemm.call(qt, dy_scale_inv, *x_t, x_scale_inv, dw_dtype, std::nullopt, false, std::nullopt,
                               std::nullopt, true, std::nullopt));
  }
  return {dx, dw, dbias};
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CompositeImplicitAutograd, m) {
  m.impl("fp8_linear_fwd", &tfp8::fp8_linear_fwd);
  m.impl("fp8_linear_bwd", &tfp8::fp8_linear_bwd);
}
