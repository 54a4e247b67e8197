// C++ autograd nodes for the host-bound common cases of two Python autograd.Functions (see each .cpp), and what they
// share. Python reaches them through transformer_fp8._C (csrc/python_module.cpp).
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>

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
at::Tensor fp8_linear(const at::Tensor& inp, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      pybind11::object registration, const at::Tensor& x_scale, const at::Tensor& x_amax,
                      const at::Tensor& x_scale_inv, const at::Tensor& w_scale, const at::Tensor& w_amax,
                      const at::Tensor& w_scale_inv, at::ScalarType fwd_dtype, bool keep_w_t,
                      const at::Tensor& dy_scale, const at::Tensor& dy_amax, const at::Tensor& dy_scale_inv,
                      at::ScalarType bwd_dtype);
void set_backward_registrar(pybind11::object callable);

// csrc/autograd_attention.cpp
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& qkv_format,
                           double scale, bool causal);
void set_attention_fallback(pybind11::object callable);

}  // namespace tfp8
