// transformer_fp8._C: importing it loads this library, which runs the op registrations (csrc/ops.cpp and the kernels'
// files), and gives the C++ autograd nodes' entry points (csrc/autograd_nodes.h). Errors reach Python as torch's
// do (c10::NotImplementedError as NotImplementedError, TORCH_CHECK as RuntimeError, ...).
#include <torch/csrc/Exceptions.h>

#include "autograd_nodes.h"
#include "linear_inference.h"

namespace {

// fn as a callable whose C++ exceptions become torch's Python exceptions.
template <typename R, typename... Args>
auto translated(R (*fn)(Args...)) {
  return [fn](Args... args) -> R {
    HANDLE_TH_ERRORS
    return fn(std::forward<Args>(args)...);
    END_HANDLE_TH_ERRORS_PYBIND
  };
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("fp8_linear", translated(&tfp8::fp8_linear),
        "The plain FP8 Linear with its C++ autograd node (csrc/autograd_linear.cpp)");
  m.def("linear_inference", translated(&tfp8::linear_inference),
        "fp8_linear_inference through the dispatcher: an FP8-weight Linear's no-grad forward "
        "(csrc/linear_inference.cpp)");
  m.def("set_backward_registrar", &tfp8::set_backward_registrar,
        "The callable fp8_linear's backward calls with its registration tuple");
  m.def(
      "queue_backward_update",
      [](const at::Tensor& history, const at::Tensor& scale, const at::Tensor& scale_inv, double fp8_max, double margin,
         bool use_max, pybind11::object python_state) {
        HANDLE_TH_ERRORS
        tfp8::queue_backward_update(history, scale, scale_inv, fp8_max, margin, use_max,
                                    python_state.is_none() ? nullptr : python_state.ptr());
        END_HANDLE_TH_ERRORS_PYBIND
      },
      "Queue a gradient scaling state for the fused update after the running backward (csrc/delayed_update_queue.cpp)");
  m.def("backward_queues_alive", &tfp8::backward_queues_alive,
        "How many backwards have queued scaling states and not ended (csrc/delayed_update_queue.cpp)");
  m.def("forward_scaling_update", translated(&tfp8::forward_scaling_update),
        "The forward delayed-scaling update and new scale_inv snapshots in one call (csrc/delayed_update_queue.cpp)");
  m.def("fused_attention", translated(&tfp8::fused_attention),
        "cuDNN attention with its C++ autograd node (csrc/autograd_attention.cpp)");
  m.def("set_attention_fallback", &tfp8::set_attention_fallback,
        "The callable fused_attention's backward calls when cuDNN refuses the case");
}
