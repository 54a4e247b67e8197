// CUDA kernels of block_fp8_gemm and block_fp8_gemm_accumulate (contracts in csrc/ops.cpp; operand layouts in
// transformer_fp8/quantization/block.py): argument checks, output allocation, and zero padding of M, N and K to
// multiples of 16 as cuBLASLt's FP8 kernels need. Padding is exact and keeps the block scales valid: a 16-multiple
// stays inside the last 128-tile, so only a 1x128 operand's scale rows (one entry per operand row) grow, with 1s.
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "gemm_workspace.h"

namespace tfp8 {
namespace {

constexpr int64_t kPad = 16;
constexpr int64_t kBlock = 128;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ScaleMode scale_mode(int64_t block_dim, const char* arg) {
  TORCH_CHECK(block_dim == 1 || block_dim == 2, arg, ": expected 1 (1x128 tiles) or 2 (128x128 blocks), got ",
              std::to_string(block_dim));
  return block_dim == 1 ? ScaleMode::kVec128 : ScaleMode::kBlock128;
}

// block_cast's scale shape for FP8 data [rows, k].
std::vector<int64_t> scale_shape(int64_t rows, int64_t k, int64_t block_dim) {
  if (block_dim == 1) return {cdiv(k, kBlock), round_up(rows, 4)};
  return {cdiv(rows, kBlock), round_up(cdiv(k, kBlock), 4)};
}

void check_operand(const at::Tensor& t, const at::Tensor& scale_inv, int64_t block_dim, const char* arg,
                   const char* scale_arg) {
  check_cuda(t, arg);
  check_fp8_dtype(t.scalar_type(), arg);
  TORCH_CHECK(t.dim() == 2, arg, ": expected a 2-D tensor, got shape ", dims(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), arg, ": expected a K-contiguous row-major tensor, got strides ", dims(t.strides()));
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat, scale_arg, ": expected a float32 tensor, got ",
              scale_inv.scalar_type());
  check_contiguous(scale_inv, scale_arg);
  check_same_device(scale_inv, t, scale_arg);
  const auto expected = scale_shape(t.size(0), t.size(1), block_dim);
  TORCH_CHECK(scale_inv.sizes() == at::IntArrayRef(expected), scale_arg, ": expected shape ", dims(expected), " for ",
              arg, " ", dims(t.sizes()), " with block_dim ", std::to_string(block_dim), " (block_cast's layout), got ",
              dims(scale_inv.sizes()));
}

void check_operands(const at::Tensor& a, const at::Tensor& a_scale_inv, int64_t a_block_dim, const at::Tensor& b,
                    const at::Tensor& b_scale_inv, int64_t b_block_dim) {
  scale_mode(a_block_dim, "a_block_dim");
  scale_mode(b_block_dim, "b_block_dim");
  TORCH_CHECK(!(a_block_dim == 2 && b_block_dim == 2),
              "a_block_dim, b_block_dim: 128x128 x 128x128 block scaling is not supported by cuBLASLt; make one "
              "operand 1x128");
  check_operand(a, a_scale_inv, a_block_dim, "a", "a_scale_inv");
  check_operand(b, b_scale_inv, b_block_dim, "b", "b_scale_inv");
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "a, b: E5M2 x E5M2 is not supported by the FP8 tensor cores; make one operand E4M3");
  TORCH_CHECK(b.size(1) == a.size(1), "b: expected K = ", std::to_string(a.size(1)), " columns (a is ", dims(a.sizes()),
              "), got shape ", dims(b.sizes()));
  check_same_device(b, a, "b");
}

// t [rows, cols] zero-padded to [rows_to, cols_to] (t itself when that changes nothing).
at::Tensor padded(const at::Tensor& t, int64_t rows_to, int64_t cols_to) {
  if (t.size(0) == rows_to && t.size(1) == cols_to) return t;
  at::Tensor out = at::zeros({rows_to, cols_to}, t.options().dtype(at::kByte));
  out.narrow(0, 0, t.size(0)).narrow(1, 0, t.size(1)).copy_(t.view(at::kByte));
  return out.view(t.scalar_type());
}

// The operands padded to M, N and K multiples of 16, with 1x128 scales to match, and the GEMM arguments for them.
// (M too: cuBLASLt refused the H100's 1x128 GEMMs of 21 rows; rows past M come out and are sliced off.)
struct PaddedOperands {
  at::Tensor a, a_scale_inv, b, b_scale_inv;
  int64_t m_pad, n_pad;
};

// A 1x128 operand's scales [ceil(K/128), pad4(rows)] widened to rows_to columns (the new ones 1).
at::Tensor widened_scales(const at::Tensor& scale_inv, int64_t block_dim, int64_t rows_to) {
  if (block_dim != 1 || scale_inv.size(1) == rows_to) return scale_inv;
  at::Tensor out = at::ones({scale_inv.size(0), rows_to}, scale_inv.options());
  out.narrow(1, 0, scale_inv.size(1)).copy_(scale_inv);
  return out;
}

PaddedOperands pad_operands(const at::Tensor& a, const at::Tensor& a_scale_inv, int64_t a_block_dim,
                            const at::Tensor& b, const at::Tensor& b_scale_inv, int64_t b_block_dim) {
  const int64_t k = a.size(1), m = a.size(0), n = b.size(0);
  const int64_t k_pad = std::max(kPad, round_up(k, kPad)), m_pad = round_up(m, kPad), n_pad = round_up(n, kPad);
  return {padded(a, m_pad, k_pad),
          widened_scales(a_scale_inv, a_block_dim, m_pad),
          padded(b, n_pad, k_pad),
          widened_scales(b_scale_inv, b_block_dim, n_pad),
          m_pad,
          n_pad};
}

Fp8GemmArgs gemm_args(const PaddedOperands& p, int64_t a_block_dim, int64_t b_block_dim) {
  Fp8GemmArgs args{};
  args.a = p.a.data_ptr();
  args.b = p.b.data_ptr();
  args.a_scale_inv = p.a_scale_inv.data_ptr<float>();
  args.b_scale_inv = p.b_scale_inv.data_ptr<float>();
  args.a_type = to_dtype(p.a.scalar_type(), "a");
  args.b_type = to_dtype(p.b.scalar_type(), "b");
  args.a_scale_mode = scale_mode(a_block_dim, "a_block_dim");
  args.b_scale_mode = scale_mode(b_block_dim, "b_block_dim");
  args.m = p.m_pad;
  args.n = p.n_pad;
  args.k = p.a.size(1);
  args.ld_out = p.n_pad;
  args.fast_accum = false;  // block scaling needs the split accumulator (cuBLASLt has no fast-accumulation kernel)
  return args;
}

at::Tensor block_fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv, int64_t a_block_dim, const at::Tensor& b,
                          const at::Tensor& b_scale_inv, int64_t b_block_dim, at::ScalarType out_dtype,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  check_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
              "out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got ", out_dtype);
  const int64_t m = a.size(0), n = b.size(0);
  if (bias.has_value()) {
    const at::ScalarType wanted = out_dtype == at::kHalf ? at::kHalf : at::kBFloat16;
    check_cuda(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == wanted, "bias: expected dtype ", wanted, " for out_dtype ", out_dtype, ", got ",
                bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape (", std::to_string(n), ",), got ",
                dims(bias->sizes()));
    check_same_device(*bias, a, "bias");
  }
  if (residual.has_value()) check_residual(*residual, out_dtype, m, n, a);
  const c10::cuda::CUDAGuard guard(a.device());
  if (m == 0 || n == 0) return at::empty({m, n}, a.options().dtype(out_dtype));
  if (a.size(1) == 0) {  // an empty sum: zeros (+ bias) (+ residual)
    at::Tensor out = at::zeros({m, n}, a.options().dtype(out_dtype));
    if (bias.has_value()) out.add_(*bias);
    return residual.has_value() ? out.add_(*residual) : out;
  }
  const PaddedOperands p = pad_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim);
  at::Tensor out = at::empty({p.m_pad, p.n_pad}, a.options().dtype(out_dtype));
  at::Tensor bias_p;
  Fp8GemmArgs args = gemm_args(p, a_block_dim, b_block_dim);
  args.out = out.data_ptr();
  args.out_type = to_dtype(out_dtype, "out_dtype");
  if (bias.has_value()) {  // (padded only when N is: an aligned bias is read in place)
    const bool aligned = p.n_pad == n && bias->is_contiguous() &&
                         reinterpret_cast<uintptr_t>(bias->data_ptr()) % 16 == 0;
    bias_p = aligned ? *bias : at::zeros({p.n_pad}, bias->options());
    if (!aligned) bias_p.narrow(0, 0, n).copy_(*bias);
    args.bias = bias_p.data_ptr();
    args.bias_type = to_dtype(bias_p.scalar_type(), "bias");
  }
  // the residual as cuBLASLt's C (beta = 1) where it has the output's layout; else added after the GEMM
  const bool fused_residual = residual.has_value() && p.m_pad == m && p.n_pad == n &&
                              reinterpret_cast<uintptr_t>(residual->data_ptr()) % 16 == 0;
  if (fused_residual) args.residual = residual->data_ptr();
  const at::Tensor workspace = attach_workspace(args, a.options());
  fp8_gemm_cublaslt(args, current_stream());
  if (p.m_pad != m) out = out.narrow(0, 0, m);  // (leading rows: still contiguous)
  if (p.n_pad != n) out = out.narrow(1, 0, n).contiguous();
  return residual.has_value() && !fused_residual ? out.add_(*residual) : out;
}

void block_fp8_gemm_accumulate(const at::Tensor& a, const at::Tensor& a_scale_inv, int64_t a_block_dim,
                               const at::Tensor& b, const at::Tensor& b_scale_inv, int64_t b_block_dim,
                               const at::Tensor& out) {
  check_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim);
  const int64_t m = a.size(0), n = b.size(0);
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out: expected a float32 tensor, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n, "out: expected shape ", dims({m, n}), ", got ",
              dims(out.sizes()));
  TORCH_CHECK(out.is_contiguous(), "out: expected a contiguous tensor, got strides ", dims(out.strides()));
  check_same_device(out, a, "out");
  if (m == 0 || n == 0 || a.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const PaddedOperands p = pad_operands(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim);
  const bool in_place = p.m_pad == m && p.n_pad == n && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  at::Tensor acc = in_place ? out : at::zeros({p.m_pad, p.n_pad}, out.options());
  if (!in_place) acc.narrow(0, 0, m).narrow(1, 0, n).copy_(out);
  Fp8GemmArgs args = gemm_args(p, a_block_dim, b_block_dim);
  args.out = acc.data_ptr();
  args.out_type = DType::kFloat32;
  args.accumulate = true;
  const at::Tensor workspace = attach_workspace(args, a.options());
  fp8_gemm_cublaslt(args, current_stream());
  if (!in_place) out.copy_(acc.narrow(0, 0, m).narrow(1, 0, n));
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("block_fp8_gemm", &tfp8::block_fp8_gemm);
  m.impl("block_fp8_gemm_accumulate", &tfp8::block_fp8_gemm_accumulate);
}
