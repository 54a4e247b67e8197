// CUDA kernels of the block-scaled grouped FP8 GEMM for torch (csrc/grouped_block_gemm.h): argument checks, output and
// workspace allocation (torch's caching allocator: no sync), launch on the current stream.
// Contracts: csrc/ops.cpp (grouped_block_fp8_gemm_sm90, grouped_block_fp8_gemm_wgrad_sm90).
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "common.h"
#include "grouped_binding_checks.h"
#include "grouped_block_gemm.h"

namespace tfp8 {
namespace {

using grouped::check_e4m3;
using grouped::check_multiple;
using grouped::kAlign;
constexpr int64_t kBlock = 128;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 1x128 tile scales [tiles, >= rows] with a contiguous last dim (block_cast's layout).
void check_tile_scales(const at::Tensor& t, const at::Tensor& ref, int64_t tiles, int64_t rows, const char* arg) {
  check_same_device(t, ref, arg);
  TORCH_CHECK(t.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == tiles && t.size(1) >= rows && t.stride(1) == 1, arg,
              ": expected 1x128 tile scales [", num(tiles), ", >= ", num(rows),
              "] with a contiguous last dim (block_cast's layout), got shape ", dims(t.sizes()), ", strides ",
              dims(t.strides()));
}

at::Tensor run(const GroupedBlockGemmArgs& args, at::Tensor out, const at::Tensor& like) {
  if (args.rows == 0 || args.n == 0 || args.k == 0) return out.zero_();
  c10::cuda::CUDAGuard guard(like.device());
  at::Tensor workspace = at::empty({static_cast<int64_t>(grouped_block_fp8_gemm_workspace_bytes(args))},
                                   like.options().dtype(at::kByte));
  const char* error = launch_grouped_block_fp8_gemm(args, workspace.data_ptr(), current_stream());
  TORCH_CHECK(error == nullptr, "block-scaled grouped FP8 GEMM: ", error ? error : "");
  return out;
}

at::Tensor grouped_block_fp8_gemm_sm90(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                                       const at::Tensor& b_scale_inv, const at::Tensor& offs) {
  check_e4m3(a, a, "a");
  check_e4m3(b, a, "b");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "a: expected a contiguous 2-D tensor [M, K], got shape ",
              dims(a.sizes()), ", strides ", dims(a.strides()));
  TORCH_CHECK(b.dim() == 3 && b.size(2) == a.size(1) && b.stride(2) == 1, "b: expected [G, N, ", num(a.size(1)),
              "] with a contiguous last dim, got shape ", dims(b.sizes()), ", strides ", dims(b.strides()));
  const int64_t m = a.size(0), k = a.size(1), groups = b.size(0), n = b.size(1);
  grouped::check_offs(offs, a);
  TORCH_CHECK(offs.numel() == groups, "offs: expected ", num(groups), " elements (b's groups), got ",
              num(offs.numel()));
  check_tile_scales(a_scale_inv, a, cdiv(k, kBlock), m, "a_scale_inv");
  check_same_device(b_scale_inv, a, "b_scale_inv");
  TORCH_CHECK(b_scale_inv.scalar_type() == at::kFloat && b_scale_inv.dim() == 3 && b_scale_inv.size(0) == groups &&
                  b_scale_inv.size(1) == cdiv(n, kBlock) && b_scale_inv.size(2) == cdiv(k, kBlock),
              "b_scale_inv: expected float32 128x128 block scales [", num(groups), ", ", num(cdiv(n, kBlock)), ", ",
              num(cdiv(k, kBlock)), "], got ", b_scale_inv.scalar_type(), " of shape ", dims(b_scale_inv.sizes()));
  check_multiple(n, "N");
  check_multiple(k, "K");
  check_multiple(b.stride(0), "b.stride(0)");
  check_multiple(b.stride(1), "b.stride(1)");
  grouped::check_hopper(a, "block-scaled grouped FP8 GEMM");
  GroupedBlockGemmArgs args;
  args.kind = GroupedKind::kRows;
  args.a = a.data_ptr(), args.b = b.data_ptr(), args.offs = offs.data_ptr<int32_t>();
  args.groups = static_cast<int>(groups);
  args.rows = m, args.n = n, args.k = k;
  args.b_group_stride = b.stride(0), args.b_row_stride = b.stride(1);
  args.a_scale = a_scale_inv.data_ptr<float>(), args.a_scale_ld = a_scale_inv.stride(0);
  args.b_scale = b_scale_inv.data_ptr<float>();
  for (int i = 0; i < 3; ++i) args.b_scale_strides[i] = b_scale_inv.stride(i);
  at::Tensor out = at::empty({m, n}, a.options().dtype(at::kBFloat16));
  args.out = out.data_ptr();
  return run(args, out, a);
}

at::Tensor grouped_block_fp8_gemm_wgrad_sm90(const at::Tensor& a_t, const at::Tensor& a_scale_inv,
                                             const at::Tensor& b_t, const at::Tensor& b_scale_inv,
                                             const at::Tensor& offs) {
  check_e4m3(a_t, a_t, "a_t");
  check_e4m3(b_t, a_t, "b_t");
  TORCH_CHECK(a_t.dim() == 2 && a_t.is_contiguous(), "a_t: expected a contiguous 2-D tensor [N, M], got shape ",
              dims(a_t.sizes()), ", strides ", dims(a_t.strides()));
  TORCH_CHECK(b_t.dim() == 2 && b_t.is_contiguous() && b_t.size(1) == a_t.size(1), "b_t: expected a contiguous [K, ",
              num(a_t.size(1)), "] (a_t's columns), got shape ", dims(b_t.sizes()), ", strides ", dims(b_t.strides()));
  const int64_t n = a_t.size(0), m = a_t.size(1), k = b_t.size(0);
  grouped::check_offs(offs, a_t);
  check_multiple(n, "N");
  check_multiple(k, "K");
  check_multiple(m, "M");
  // (the kernel reads each group's scales as a packed [tiles, N] / [tiles, K] block: rows of exactly N / K floats)
  check_tile_scales(a_scale_inv, a_t, cdiv(m, kBlock), n, "a_scale_inv");
  check_tile_scales(b_scale_inv, a_t, cdiv(m, kBlock), k, "b_scale_inv");
  TORCH_CHECK(a_scale_inv.stride(0) == n && b_scale_inv.stride(0) == k,
              "a_scale_inv, b_scale_inv: expected rows of exactly N and K scales (strides ", num(n), " and ", num(k),
              "), got strides ", num(a_scale_inv.stride(0)), " and ", num(b_scale_inv.stride(0)));
  grouped::check_hopper(a_t, "block-scaled grouped FP8 GEMM");
  GroupedBlockGemmArgs args;
  args.kind = GroupedKind::kContraction;
  args.a = a_t.data_ptr(), args.b = b_t.data_ptr(), args.offs = offs.data_ptr<int32_t>();
  args.groups = static_cast<int>(offs.numel());
  args.rows = m, args.n = n, args.k = k;
  args.a_scale = a_scale_inv.data_ptr<float>(), args.b_scale = b_scale_inv.data_ptr<float>();
  at::Tensor out = at::empty({offs.numel(), n, k}, a_t.options().dtype(at::kBFloat16));
  args.out = out.data_ptr();
  return run(args, out, a_t);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("grouped_block_fp8_gemm_sm90", &grouped_block_fp8_gemm_sm90);
  m.impl("grouped_block_fp8_gemm_wgrad_sm90", &grouped_block_fp8_gemm_wgrad_sm90);
}

}  // namespace tfp8
