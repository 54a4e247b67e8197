// CUDA kernel of adamw_step_ for torch (contract: csrc/ops.cpp): checks every tensor of the lists, computes the
// step's scalars in double (rounded once to float32, as the CPU reference does), fills tables of pointers and
// launches once per AdamWTable::kCapacity tensors. No host synchronisation, no allocation.
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "common.h"
#include "optim.h"

namespace tfp8 {
namespace {

void check_entry(const at::Tensor& t, const at::Tensor& param, at::ScalarType dtype, const char* list, size_t index,
                 const char* why) {
  TORCH_CHECK(t.scalar_type() == dtype, list, "[", num(index), "]: expected ", dtype, " (", why, "), got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), list, "[", num(index), "]: expected shape ", dims(param.sizes()), " (params[",
              num(index), "]'s), got ", dims(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), list, "[", num(index), "]: expected a contiguous tensor (got strides ",
              dims(t.strides()), ")");
  TORCH_CHECK(t.device() == param.device(), list, "[", num(index), "]: expected a tensor on ", param.device(),
              ", got one on ", t.device());
}

void check_arguments(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList master_params, double lr, double beta1, double beta2, double eps,
                     double weight_decay, int64_t step) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "grads: expected ", num(n), " tensors (one per param), got ", num(grads.size()));
  TORCH_CHECK(exp_avgs.size() == n, "exp_avgs: expected ", num(n), " tensors (one per param), got ",
              num(exp_avgs.size()));
  TORCH_CHECK(exp_avg_sqs.size() == n, "exp_avg_sqs: expected ", num(n), " tensors (one per param), got ",
              num(exp_avg_sqs.size()));
  TORCH_CHECK(master_params.empty() || master_params.size() == n, "master_params: expected none or ", num(n),
              " tensors (one per param), got ", num(master_params.size()));
  TORCH_CHECK(lr >= 0, "lr: expected >= 0, got ", std::to_string(lr));
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, "beta1: expected 0 <= beta1 < 1, got ", std::to_string(beta1));
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, "beta2: expected 0 <= beta2 < 1, got ", std::to_string(beta2));
  TORCH_CHECK(eps >= 0, "eps: expected >= 0, got ", std::to_string(eps));
  TORCH_CHECK(weight_decay >= 0, "weight_decay: expected >= 0, got ", std::to_string(weight_decay));
  TORCH_CHECK(step >= 1, "step: expected >= 1 (the step being taken, counted from 1), got ", num(step));
  if (n == 0) return;
  const auto param_dtype = params[0].scalar_type();
  TORCH_CHECK(param_dtype == at::kFloat || param_dtype == at::kHalf || param_dtype == at::kBFloat16,
              "params[0]: expected a float32, float16 or bfloat16 tensor, got ", param_dtype);
  const auto moment_dtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(moment_dtype == params[0].scalar_type() || moment_dtype == at::kFloat, "exp_avgs[0]: expected ",
              params[0].scalar_type(), " (the parameters' dtype) or torch.float32, got ", moment_dtype);
  TORCH_CHECK(master_params.empty() || params[0].scalar_type() != at::kFloat,
              "master_params: float32 parameters take no master weights");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK(param.is_cuda(), "params[", num(i), "]: expected a CUDA tensor, got one on ", param.device());
    const auto dtype = param.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "params[", num(i),
                "]: expected a float32, float16 or bfloat16 tensor, got ", dtype);
    TORCH_CHECK(param.is_contiguous(), "params[", num(i), "]: expected a contiguous tensor (got strides ",
                dims(param.strides()), ")");
    TORCH_CHECK(param.device() == params[0].device(), "params[", num(i), "]: expected a tensor on ", params[0].device(),
                ", got one on ", param.device());
    TORCH_CHECK(param.scalar_type() == params[0].scalar_type(), "params[", num(i), "]: expected ",
                params[0].scalar_type(), " (params[0]'s dtype: one call takes one dtype), got ", param.scalar_type());
    check_entry(grads[i], param, dtype, "grads", i, "params[i]'s dtype");
    check_entry(exp_avgs[i], param, moment_dtype, "exp_avgs", i, "exp_avgs[0]'s dtype: one call takes one");
    check_entry(exp_avg_sqs[i], param, moment_dtype, "exp_avg_sqs", i, "exp_avgs[0]'s dtype: one call takes one");
    if (!master_params.empty()) check_entry(master_params[i], param, at::kFloat, "master_params", i, "master weights");
  }
}

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, bool maximize,
                std::optional<at::TensorList> master_params_or_none, bool bias_correction,
                bool decoupled_weight_decay) {
  const at::TensorList master_params = master_params_or_none.value_or(at::TensorList());
  check_arguments(params, grads, exp_avgs, exp_avg_sqs, master_params, lr, beta1, beta2, eps, weight_decay, step);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = current_stream();
  const DType param_dtype = to_dtype(params[0].scalar_type(), "params[0]");
  const DType moment_dtype = to_dtype(exp_avgs[0].scalar_type(), "exp_avgs[0]");
  const bool masters = !master_params.empty();
  const double steps = static_cast<double>(step);
  const double step_size = bias_correction ? lr / (1.0 - std::pow(beta1, steps)) : lr;
  const double inv_bc2 = bias_correction ? 1.0 / std::sqrt(1.0 - std::pow(beta2, steps)) : 1.0;
  const AdamWScalars scalars{static_cast<float>(decoupled_weight_decay ? lr * weight_decay : 0.0),
                             static_cast<float>(decoupled_weight_decay ? 0.0 : weight_decay),
                             static_cast<float>(beta1),
                             static_cast<float>(1.0 - beta1),
                             static_cast<float>(beta2),
                             static_cast<float>(1.0 - beta2),
                             static_cast<float>(eps),
                             static_cast<float>(step_size),
                             static_cast<float>(inv_bc2),
                             maximize};
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
  AdamWTable table;
  table.count = 0;
  table.first_block[0] = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    if (numel == 0) continue;
    const int64_t blocks = (numel + AdamWTable::kChunk - 1) / AdamWTable::kChunk;
    TORCH_CHECK(blocks <= kMaxBlocks, "params[", num(i), "]: too many elements (", num(numel), ")");
    if (table.count == AdamWTable::kCapacity || table.first_block[table.count] + blocks > kMaxBlocks) {
      launch_adamw(table, scalars, param_dtype, moment_dtype, masters, stream);
      table.count = 0;
    }
    const int e = table.count++;
    table.param[e] = params[i].data_ptr();
    table.grad[e] = grads[i].data_ptr();
    table.exp_avg[e] = exp_avgs[i].data_ptr();
    table.exp_avg_sq[e] = exp_avg_sqs[i].data_ptr();
    table.master[e] = masters ? master_params[i].data_ptr<float>() : nullptr;
    table.numel[e] = numel;
    table.first_block[e + 1] = static_cast<int32_t>(table.first_block[e] + blocks);
  }
  launch_adamw(table, scalars, param_dtype, moment_dtype, masters, stream);
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) { m.impl("adamw_step_", &tfp8::adamw_step); }
