// CUDA kernels of the moe family (token permutation) for torch: argument checks, output allocation, launch on the
// current stream. Contracts: csrc/ops.cpp; kernels: csrc/moe_permute.cu.
#include <torch/library.h>

#include <optional>

#include "common.h"
#include "moe.h"

namespace tfp8 {
namespace {

void check_rows(const at::Tensor& t, const char* arg) {
  check_cuda(t, arg);
  TORCH_CHECK(t.dim() == 2, arg, ": expected a 2-D tensor [rows, hidden], got shape ", dims(t.sizes()));
  check_contiguous(t, arg);
}

void check_index(const at::Tensor& t, const at::Tensor& data, int64_t dim, const char* arg) {
  check_same_device(t, data, arg);
  TORCH_CHECK(t.scalar_type() == at::kInt, arg, ": expected an int32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, arg, ": expected a ", num(dim), "-D tensor, got shape ", dims(t.sizes()));
  check_contiguous(t, arg);
}

// probs: float32 with numel elements, contiguous, on data's device.
void check_probs(const at::Tensor& probs, const at::Tensor& data, int64_t numel, const char* arg) {
  check_same_device(probs, data, arg);
  TORCH_CHECK(probs.scalar_type() == at::kFloat, arg, ": expected a float32 tensor, got ", probs.scalar_type());
  TORCH_CHECK(probs.numel() == numel, arg, ": expected ", num(numel), " elements (tokens x slots), got shape ",
              dims(probs.sizes()));
  check_contiguous(probs, arg);
}

at::Tensor moe_permute_rows(const at::Tensor& inp, const at::Tensor& slot_of_row, int64_t slots_per_token,
                            const std::optional<at::Tensor>& probs) {
  check_rows(inp, "inp");
  const DType dtype = to_dtype(inp.scalar_type(), "inp");
  check_index(slot_of_row, inp, 1, "slot_of_row");
  TORCH_CHECK(slots_per_token >= 1, "slots_per_token: expected >= 1, got ", num(slots_per_token));
  const int64_t tokens = inp.size(0), hidden = inp.size(1), rows = slot_of_row.size(0);
  if (probs.has_value()) {
    TORCH_CHECK(!is_fp8(inp.scalar_type()), "probs: not supported with an FP8 inp (its rows are copied as bytes)");
    check_probs(*probs, inp, tokens * slots_per_token, "probs");
  }
  c10::cuda::CUDAGuard guard(inp.device());
  at::Tensor out = at::empty({rows, hidden}, inp.options());
  launch_moe_permute_rows(inp.data_ptr(), slot_of_row.data_ptr<int32_t>(), optional_ptr(probs), out.data_ptr(), tokens,
                          slots_per_token, rows, hidden, dtype, current_stream());
  return out;
}

at::Tensor moe_unpermute_rows(const at::Tensor& inp, const at::Tensor& row_id_map,
                              const std::optional<at::Tensor>& probs) {
  check_rows(inp, "inp");
  check_high_precision(inp, "inp");
  check_index(row_id_map, inp, 2, "row_id_map");
  const int64_t tokens = row_id_map.size(0), slots = row_id_map.size(1), hidden = inp.size(1);
  if (probs.has_value()) check_probs(*probs, inp, tokens * slots, "probs");
  c10::cuda::CUDAGuard guard(inp.device());
  at::Tensor out = at::empty({tokens, hidden}, inp.options());
  launch_moe_unpermute_rows(inp.data_ptr(), row_id_map.data_ptr<int32_t>(), optional_ptr(probs), out.data_ptr(), tokens,
                            slots, inp.size(0), hidden, to_dtype(inp.scalar_type(), "inp"), current_stream());
  return out;
}

at::Tensor moe_merging_probs_grad(const at::Tensor& grad_out, const at::Tensor& inp, const at::Tensor& row_id_map) {
  check_rows(grad_out, "grad_out");
  check_high_precision(grad_out, "grad_out");
  check_rows(inp, "inp");
  check_same_device(inp, grad_out, "inp");
  TORCH_CHECK(inp.scalar_type() == grad_out.scalar_type() && inp.size(1) == grad_out.size(1), "inp: expected ",
              grad_out.scalar_type(), " rows of ", num(grad_out.size(1)), " (grad_out's), got ", inp.scalar_type(),
              " of shape ", dims(inp.sizes()));
  check_index(row_id_map, inp, 2, "row_id_map");
  TORCH_CHECK(row_id_map.size(0) == grad_out.size(0), "row_id_map: expected ", num(grad_out.size(0)),
              " rows (grad_out's tokens), got shape ", dims(row_id_map.sizes()));
  const int64_t tokens = row_id_map.size(0), slots = row_id_map.size(1);
  c10::cuda::CUDAGuard guard(inp.device());
  at::Tensor d_probs = at::empty({tokens, slots}, inp.options().dtype(at::kFloat));
  launch_moe_merging_probs_grad(grad_out.data_ptr(), inp.data_ptr(), row_id_map.data_ptr<int32_t>(),
                                d_probs.data_ptr<float>(), tokens, slots, inp.size(0), inp.size(1),
                                to_dtype(inp.scalar_type(), "inp"), current_stream());
  return d_probs;
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("moe_permute_rows", &tfp8::moe_permute_rows);
  m.impl("moe_unpermute_rows", &tfp8::moe_unpermute_rows);
  m.impl("moe_merging_probs_grad", &tfp8::moe_merging_probs_grad);
}
