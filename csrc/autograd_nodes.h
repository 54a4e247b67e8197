// C++ autograd nodes for the host-bound common cases of two Python autograd.Functions (see each .cpp), and what they
// share. Python reaches them through transformer_fp8._C (csrc/python_module.cpp).
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "library_op.h"

namespace tfp8 {

// A strong reference to a Python object, droppable on any thread (autograd nodes die on the engine's threads too).
class PyReference {
 public:
  explicit PyReference(PyObject* object) : object_(object) { Py_XINCREF(object_); }  // (called with the GIL)
  PyReference(const PyReference&) = delete;
  PyReference& operator=(const PyReference&) = delete;
  ~PyReference() {
    if (object_ == nullptr || !Py_IsInitialized()) return;
    const PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(object_);
    PyGILState_Release(gil);
  }
  PyObject* get() const { return object_; }

 private:
  PyObject* object_;
};

// csrc/autograd_linear.cpp
// One role's cast with a known scale: a quantizer's output_args() (scale [1], FP8 dtype, amax [1], scale_inv [1]).
using QuantizerArgs = std::tuple<at::Tensor, at::ScalarType, at::Tensor, at::Tensor>;
// The gradient state's update in C++ (csrc/delayed_update_queue.cpp): (amax_history, scale, scale_inv, fp8_max, margin,
// use_max), or None where the update goes through Python (an amax reduction over a process group).
using NativeUpdateArgs = std::tuple<at::Tensor, at::Tensor, at::Tensor, double, double, bool>;
// Current scaling's FP8 maxima: (forward roles', gradient's).
using CurrentMaxima = std::tuple<double, double>;
at::Tensor fp8_linear(const at::Tensor& inp, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      pybind11::object registration, const QuantizerArgs& x, const QuantizerArgs& w,
                      const QuantizerArgs& dy, const std::optional<NativeUpdateArgs>& native_update,
                      const std::optional<CurrentMaxima>& current, bool keep_w_t);
void set_backward_registrar(pybind11::object callable);

// csrc/delayed_update_queue.cpp
// Queue a gradient state for one fused delayed_scaling_update after the running backward (call from a backward; once
// per state and backward). python_state: its ScalingState, whose `pending` / `calibrated` flags the end of the
// backward sets (with the GIL), or null (a calibrated state: the backward ends without Python).
void queue_backward_update(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& scale_inv,
                           double fp8_max, double margin, bool use_max, PyObject* python_state);
// How many backwards have queued states and not ended yet (for tests).
int64_t backward_queues_alive();
// The forward update at the autocast's exit: delayed_scaling_update of the three lists, then `snapshots` new
// one-element scale_inv views, 16 bytes apart, of one new buffer on the states' device.
std::vector<at::Tensor> forward_scaling_update(const std::vector<at::Tensor>& histories,
                                               const std::vector<at::Tensor>& scales,
                                               const std::vector<at::Tensor>& scale_invs, double fp8_max, double margin,
                                               bool use_max, int64_t snapshots);

// csrc/autograd_attention.cpp
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& qkv_format,
                           double scale, bool causal);
void set_attention_fallback(pybind11::object callable);

}  // namespace tfp8
