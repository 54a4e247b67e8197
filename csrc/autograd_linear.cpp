// The FP8 Linear's autograd node in C++, for the common case of transformer_fp8/module/linear.py (its Python
// autograd.Function `_FP8Linear` takes every other case).
//
// Why: a small model's training step is host-bound, and a Python autograd.Function costs a Python call per direction
// plus the engine's Python node machinery (on the H100 host, ~1/4 of an FP8 Linear's fwd+bwd host time). Here the
// forward is one call from Python (fp8_linear below) and the backward runs without Python: under delayed scaling it
// queues the module's gradient scaling state for the update after the backward in C++ (native_update,
// csrc/delayed_update_queue.cpp), or, where the update needs Python (an amax reduction over a process group), calls
// autocast.register_backward with the `registration` argument, exactly as the Python Function's backward does.
//
// Contract of fp8_linear: inp [..., K] contiguous, weight [N, K], bias [N] or None (inp's dtype) -> out [..., N] in
// inp's dtype = fp8_linear_fwd's GEMM. Each role (x, w, dy) comes as one tuple. Delayed scaling: its quantizer's
// output_args(), (scale, fp8 dtype, amax, scale_inv), the slot a cast with a known scale writes. Current scaling
// (`current`: the forward and backward FP8 maxima): (scale, fp8 dtype, the slot's [1, 1] history view, the slot's
// scale_inv), each scale computed from its tensor's amax before the cast, as CurrentScalingQuantizer does. The
// backward: dy cast into its role's slot and fp8_linear_bwd from the saved FP8 xᵀ and Wᵀ (Wᵀ kept from the forward
// when keep_w_t, else cast again from the weight with the forward's scale).
// Gradients: dx (inp's dtype), dW (weight's dtype), dbias (dy's dtype), each only where needed. Not twice
// differentiable.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "autograd_node_ptr.h"
#include "autograd_nodes.h"

namespace tfp8 {
namespace {

namespace autograd = torch::autograd;
using OptTensor = std::optional<at::Tensor>;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using LinearFwd = Triple(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType,
                         const OptTensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, bool, bool,
                         at::ScalarType, const OptTensor&, const OptTensor&);
using LinearBwd = Triple(const at::Tensor&, const at::Tensor&, at::ScalarType, const OptTensor&, const at::Tensor&,
                         bool, const OptTensor&, const at::Tensor&, at::ScalarType, const OptTensor&, const at::Tensor&,
                         at::ScalarType, const OptTensor&);
using CastTranspose = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::ScalarType, bool,
                                                         bool, const OptTensor&, const OptTensor&);

using ComputeAmax = void(const at::Tensor&, const at::Tensor&);
using ScalingUpdate = void(at::TensorList, at::TensorList, at::TensorList, double, double, c10::string_view);

// Current scaling's cast arguments for t, as CurrentScalingQuantizer.cast_args makes them: the slot's scale from
// amax(t) (compute_amax into the slot's [1, 1] history view, then the update with "most_recent", which zeroes it
// again), and a fresh scale_inv [1] for the cast to write (the slot's next cast may come before the backward that
// reads this one). role: (scale [1], FP8 dtype, the history view [1, 1], the slot's scale_inv [1]).
at::Tensor current_scale(const at::Tensor& t, const QuantizerArgs& role, double fp8_max) {
  static const auto compute_amax = library_op<ComputeAmax>("transformer_fp8::compute_amax");
  static const auto update = library_op<ScalingUpdate>("transformer_fp8::delayed_scaling_update");
  const auto& [scale, dtype, history, slot_scale_inv] = role;
  compute_amax.call(t, history);
  update.call({history}, {scale}, {slot_scale_inv}, fp8_max, 0.0, "most_recent");
  return at::empty({1}, scale.options());
}

// autocast.register_backward, set once by transformer_fp8.module.linear at import.
std::unique_ptr<PyReference>& registrar() {
  static std::unique_ptr<PyReference> callable;
  return callable;
}

// registrar()(*registration), with the GIL; a Python exception reaches backward()'s caller as itself.
void register_backward(const PyReference& registration) {
  pybind11::gil_scoped_acquire gil;
  PyObject* result = PyObject_Call(registrar()->get(), registration.get(), nullptr);
  if (result == nullptr) throw pybind11::error_already_set();
  Py_DECREF(result);
}

struct FP8LinearBackward : public autograd::Node {
  // Saved by the forward: FP8 xᵀ [K, M] (when dW is needed) and Wᵀ [K, N] (when kept), as saved variables like the
  // Function's save_for_backward (saved-tensor hooks see them); the weight (for the Wᵀ recast), the scale_inv
  // snapshots the forward's casts wrote, and the gradient slot.
  autograd::SavedVariable x_t, w_t;
  at::Tensor weight, x_scale_inv, w_scale_inv, dy_scale, dy_amax, dy_scale_inv;
  at::ScalarType fwd_dtype, bwd_dtype, dx_dtype, dw_dtype;
  std::vector<int64_t> input_sizes;
  bool has_bias = false, released = false;
  std::unique_ptr<PyReference> registration;
  std::optional<NativeUpdateArgs> native_update;
  // current scaling: dy's slot (scale, history view, slot scale_inv) and its FP8 maximum; nothing is registered
  std::optional<QuantizerArgs> dy_current;
  double dy_max = 0.0;

  std::string name() const override { return "FP8LinearBackward"; }

  void release_variables() override {
    x_t.reset_data(), w_t.reset_data(), weight.reset();
    released = true;
  }

  autograd::variable_list apply(autograd::variable_list&& grads) override {
    static const auto linear_bwd = library_op<LinearBwd>("transformer_fp8::fp8_linear_bwd");
    static const auto cast = library_op<CastTranspose>("transformer_fp8::cast_transpose");
    TORCH_CHECK(!released, autograd::ERR_BACKWARD_TWICE);
    const bool need_dx = should_compute_output(0), need_dw = should_compute_output(1),
               need_dbias = has_bias && should_compute_output(2);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor dy = grad.dim() == 2 && grad.is_contiguous() ? grad
                                                                  : grad.reshape({-1, grad.size(-1)}).contiguous();
    at::Tensor w_t_now = need_dx ? w_t.unpack() : at::Tensor();
    if (need_dx && !w_t_now.defined()) {  // (no Wᵀ from the forward: the weight cast with the forward's scale)
      w_t_now = std::get<1>(
          cast.call(weight, at::reciprocal(w_scale_inv), fwd_dtype, false, true, std::nullopt, std::nullopt));
    }
    const at::Tensor dy_sinv = dy_current.has_value() ? current_scale(dy, *dy_current, dy_max) : dy_scale_inv;
    const OptTensor amax = dy_current.has_value() ? std::nullopt : OptTensor(dy_amax);
    auto [dx, dw, dbias] = linear_bwd.call(dy, dy_scale, bwd_dtype, amax, dy_sinv, need_dbias,
                                           need_dx ? OptTensor(w_t_now) : std::nullopt, need_dx ? w_scale_inv : dy_sinv,
                                           dx_dtype, need_dw ? OptTensor(x_t.unpack()) : std::nullopt,
                                           need_dw ? x_scale_inv : dy_sinv, dw_dtype, std::nullopt);
    if (dy_current.has_value()) {
      // (current scaling: no update to queue)
    } else if (native_update.has_value()) {
      const auto& [history, scale, scale_inv, fp8_max, margin, use_max] = *native_update;
      queue_backward_update(history, scale, scale_inv, fp8_max, margin, use_max, nullptr);
    } else {
      register_backward(*registration);
    }
    return {need_dx ? dx.view(input_sizes) : at::Tensor(), need_dw ? dw : at::Tensor(),
            need_dbias ? dbias : at::Tensor()};
  }
};

}  // namespace

at::Tensor fp8_linear(const at::Tensor& inp, const at::Tensor& weight, const OptTensor& bias,
                      pybind11::object registration, const QuantizerArgs& x, const QuantizerArgs& w,
                      const QuantizerArgs& dy, const std::optional<NativeUpdateArgs>& native_update,
                      const std::optional<CurrentMaxima>& current, bool keep_w_t) {
  static const auto linear_fwd = library_op<LinearFwd>("transformer_fp8::fp8_linear_fwd");
  const auto& [x_scale, fwd_dtype, x_amax, x_slot_scale_inv] = x;
  const auto& [w_scale, w_dtype, w_amax, w_slot_scale_inv] = w;
  TORCH_CHECK(w_dtype == fwd_dtype, "w: expected the input's FP8 dtype ", fwd_dtype, ", got ", w_dtype);
  TORCH_CHECK(inp.dim() >= 1 && inp.is_contiguous(), "inp: expected a contiguous tensor with at least one dim");
  TORCH_CHECK(current.has_value() || PyTuple_Check(registration.ptr()),
              "registration: expected a tuple of register_backward's arguments");
  TORCH_CHECK(registrar() != nullptr, "fp8_linear: set_backward_registrar was not called");
  const bool grad_mode = at::GradMode::is_enabled();
  const bool need_dx = grad_mode && inp.requires_grad(), need_dw = grad_mode && weight.requires_grad();
  const bool need_any = need_dx || need_dw || (grad_mode && bias.has_value() && bias->requires_grad());
  at::Tensor out, x_t, w_t;
  // (delayed scaling: the slots' snapshots the casts write; current: fresh ones, below)
  at::Tensor x_scale_inv = x_slot_scale_inv, w_scale_inv = w_slot_scale_inv;
  const QuantizerArgs &x_arg = x, &w_arg = w;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = inp.dim() == 2 ? inp : inp.reshape({-1, inp.size(-1)});
    if (current.has_value()) {  // (the scales from this call's amaxes; the casts record none)
      x_scale_inv = current_scale(x, x_arg, std::get<0>(*current));
      w_scale_inv = current_scale(weight, w_arg, std::get<0>(*current));
    }
    const OptTensor x_amax_out = current.has_value() ? std::nullopt : OptTensor(x_amax);
    const OptTensor w_amax_out = current.has_value() ? std::nullopt : OptTensor(w_amax);
    std::tie(out, x_t, w_t) = linear_fwd.call(x, weight, x_scale, w_scale, fwd_dtype, x_amax_out, x_scale_inv,
                                              w_amax_out, w_scale_inv, need_dw, need_dx && keep_w_t, inp.scalar_type(),
                                              bias, std::nullopt);
    if (inp.dim() != 2) {
      std::vector<int64_t> sizes = inp.sizes().vec();
      sizes.back() = out.size(1);
      out = out.view(sizes);
    }
  }
  if (!need_any) return out;
  auto node = make_autograd_node<FP8LinearBackward>();
  const auto& [dy_scale, bwd_dtype, dy_amax, dy_scale_inv] = dy;
  node->set_next_edges(autograd::collect_next_edges(inp, weight, bias));
  if (need_dw) node->x_t = autograd::SavedVariable(x_t, false);
  if (need_dx && keep_w_t) node->w_t = autograd::SavedVariable(w_t, false);
  node->weight = weight.detach();
  node->x_scale_inv = x_scale_inv, node->w_scale_inv = w_scale_inv;
  node->dy_scale = dy_scale, node->dy_amax = dy_amax, node->dy_scale_inv = dy_scale_inv;
  node->fwd_dtype = fwd_dtype, node->bwd_dtype = bwd_dtype;
  node->dx_dtype = inp.scalar_type(), node->dw_dtype = weight.scalar_type();
  node->input_sizes = inp.sizes().vec();
  node->has_bias = bias.has_value();
  node->registration = std::make_unique<PyReference>(registration.ptr());
  node->native_update = native_update;
  if (current.has_value()) {
    node->dy_current = dy;
    node->dy_max = std::get<1>(*current);
  }
  autograd::set_history(out, node);
  return out;
}

void set_backward_registrar(pybind11::object callable) { registrar() = std::make_unique<PyReference>(callable.ptr()); }

}  // namespace tfp8
