// CUDA kernels of the grouped family for torch (our CUTLASS grouped FP8 GEMM, csrc/grouped_gemm.h): argument
// checks, output and workspace allocation (torch's caching allocator: no sync), launch on the current stream.
// Contracts: csrc/ops.cpp (grouped_fp8_gemm_sm90, grouped_fp8_gemm_wgrad_sm90).
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "common.h"
#include "grouped_binding_checks.h"
#include "grouped_gemm.h"

namespace tfp8 {
namespace {

using grouped::check_e4m3;
using grouped::check_multiple;
using grouped::kAlign;

void check_scale(const at::Tensor& t, const at::Tensor& ref, int64_t groups, const char* arg) {
  check_same_device(t, ref, arg);
  TORCH_CHECK(t.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && (t.numel() == 1 || t.numel() == groups) && t.is_contiguous(), arg,
              ": expected a contiguous 1-D tensor of 1", groups > 1 ? " or " + num(groups) : std::string(),
              " elements, got shape ", dims(t.sizes()));
}

GroupedTile to_tile(int64_t tile) {
  TORCH_CHECK(tile >= 0 && tile <= 7,
              "tile: expected 0 (auto), 1 (large), 2 (small), 3 (alt), 4 (wide), 5 (solo), 6 (ping) or 7 (ours), got ",
              num(tile));
  return static_cast<GroupedTile>(tile);
}

at::Tensor run(const GroupedFp8GemmArgs& args, at::Tensor out, const at::Tensor& like) {
  if (args.rows == 0 || args.n == 0 || args.k == 0) return out.zero_();
  c10::cuda::CUDAGuard guard(like.device());
  at::Tensor workspace = at::empty({static_cast<int64_t>(grouped_fp8_gemm_workspace_bytes(args))},
                                   like.options().dtype(at::kByte));
  const char* error = launch_grouped_fp8_gemm(args, workspace.data_ptr(), current_stream());
  TORCH_CHECK(error == nullptr, "grouped FP8 GEMM: ", error ? error : "");
  return out;
}

at::Tensor grouped_fp8_gemm_sm90(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                                 const at::Tensor& b_scale_inv, const at::Tensor& offs, bool fast_accumulation,
                                 int64_t tile) {
  check_e4m3(a, a, "a");
  check_e4m3(b, a, "b");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "a: expected a contiguous 2-D tensor [M, K], got shape ",
              dims(a.sizes()), ", strides ", dims(a.strides()));
  TORCH_CHECK(b.dim() == 3 && b.size(2) == a.size(1) && b.stride(2) == 1, "b: expected [G, N, ", num(a.size(1)),
              "] with a contiguous last dim, got shape ", dims(b.sizes()), ", strides ", dims(b.strides()));
  grouped::check_offs(offs, a);
  TORCH_CHECK(offs.numel() == b.size(0), "offs: expected ", num(b.size(0)), " elements (b's groups), got ",
              num(offs.numel()));
  check_scale(a_scale_inv, a, 1, "a_scale_inv");
  check_scale(b_scale_inv, a, b.size(0), "b_scale_inv");
  check_multiple(b.size(1), "N");
  check_multiple(a.size(1), "K");
  check_multiple(b.stride(0), "b.stride(0)");
  check_multiple(b.stride(1), "b.stride(1)");
  grouped::check_hopper(a, "grouped FP8 GEMM");
  GroupedFp8GemmArgs args;
  args.kind = GroupedKind::kRows;
  args.a = a.data_ptr(), args.b = b.data_ptr(), args.offs = offs.data_ptr<int32_t>();
  args.groups = static_cast<int>(b.size(0));
  args.rows = a.size(0), args.n = b.size(1), args.k = a.size(1);
  args.b_group_stride = b.stride(0), args.b_row_stride = b.stride(1);
  args.a_scale_inv = a_scale_inv.data_ptr<float>(), args.b_scale_inv = b_scale_inv.data_ptr<float>();
  args.b_scale_per_group = b_scale_inv.numel() > 1;
  args.fast_accumulation = fast_accumulation;
  args.tile = to_tile(tile);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kBFloat16));
  args.out = out.data_ptr();
  return run(args, out, a);
}

at::Tensor grouped_fp8_gemm_wgrad_sm90(const at::Tensor& a_t, const at::Tensor& a_scale_inv, const at::Tensor& b_t,
                                       const at::Tensor& b_scale_inv, const at::Tensor& offs, bool fast_accumulation,
                                       int64_t tile) {
  check_e4m3(a_t, a_t, "a_t");
  check_e4m3(b_t, a_t, "b_t");
  TORCH_CHECK(a_t.dim() == 2 && a_t.is_contiguous(), "a_t: expected a contiguous 2-D tensor [N, M], got shape ",
              dims(a_t.sizes()), ", strides ", dims(a_t.strides()));
  TORCH_CHECK(b_t.dim() == 2 && b_t.is_contiguous() && b_t.size(1) == a_t.size(1), "b_t: expected a contiguous [K, ",
              num(a_t.size(1)), "] (a_t's columns), got shape ", dims(b_t.sizes()), ", strides ", dims(b_t.strides()));
  grouped::check_offs(offs, a_t);
  check_scale(a_scale_inv, a_t, 1, "a_scale_inv");
  check_scale(b_scale_inv, a_t, 1, "b_scale_inv");
  check_multiple(a_t.size(0), "N");
  check_multiple(b_t.size(0), "K");
  check_multiple(a_t.size(1), "M");
  grouped::check_hopper(a_t, "grouped FP8 GEMM");
  GroupedFp8GemmArgs args;
  args.kind = GroupedKind::kContraction;
  args.a = a_t.data_ptr(), args.b = b_t.data_ptr(), args.offs = offs.data_ptr<int32_t>();
  args.groups = static_cast<int>(offs.numel());
  args.rows = a_t.size(1), args.n = a_t.size(0), args.k = b_t.size(0);
  args.a_scale_inv = a_scale_inv.data_ptr<float>(), args.b_scale_inv = b_scale_inv.data_ptr<float>();
  args.fast_accumulation = fast_accumulation;
  args.tile = to_tile(tile);
  at::Tensor out = at::empty({offs.numel(), a_t.size(0), b_t.size(0)}, a_t.options().dtype(at::kBFloat16));
  args.out = out.data_ptr();
  return run(args, out, a_t);
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("grouped_fp8_gemm_sm90", &grouped_fp8_gemm_sm90);
  m.impl("grouped_fp8_gemm_wgrad_sm90", &grouped_fp8_gemm_wgrad_sm90);
}

}  // namespace tfp8
