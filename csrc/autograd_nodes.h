// C++ autograd nodes for the host-bound common cases of two Python autograd.Functions (see each .cpp), and what they
// share. Python reaches them through transformer_fp8._C (csrc/python_module.cpp).
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

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
at::Tensor fp8_linear(const at::Tensor& inp, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      pybind11::object registration, const QuantizerArgs& x, const QuantizerArgs& w,
                      const QuantizerArgs& dy, bool keep_w_t);
void set_backward_registrar(pybind11::object callable);

// csrc/autograd_attention.cpp
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& qkv_format,
                           double scale, bool causal);
void set_attention_fallback(pybind11::object callable);

}  // namespace tfp8
