// The delayed-scaling updates of transformer_fp8/quantization/update.py in C++, for the host-bound common case (a
// single process, no amax reduction): the forward update at the autocast's exit in one call, and the gradient states'
// queue of a backward kept here, so that neither the C++ Linear node's backward nor the end of the backward needs
// Python (nor the GIL on autograd's device threads).
//
// Why: a small layer's FP8 training step is host-bound, and the two updates were most of its host time beyond
// nn.Linear's (benchmarks/RESULTS.md, 2026-11-27 session 12): the forward update's Python (three tensor lists parsed
// by the op's Python binding, then new scale_inv snapshots in two more calls) and, per backward, the node's call into
// Python with the GIL, the queue's weak reference and autograd callback made in Python, and the update's Python again.
//
// Semantics are update.py's, bit for bit: one delayed_scaling_update launch per (fp8_max, margin, algo, device) over
// the states registered in one backward (graph task), each state once, after the backward; a nested backward keeps
// its own queue; a backward that fails leaves its queue to die with its graph task (the callback holds the only strong
// reference). States registered before their first update carry their Python ScalingState, whose `calibrated` and
// `pending` flags the end of the backward sets with the GIL (update_scaling_states' bookkeeping); the C++ Linear node
// registers calibrated states only, so its backward ends without Python.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "autograd_nodes.h"

namespace tfp8 {
namespace {

using ScalingUpdate = void(at::TensorList, at::TensorList, at::TensorList, double, double, c10::string_view);

void run_update(at::TensorList histories, at::TensorList scales, at::TensorList scale_invs, double fp8_max,
                double margin, bool use_max) {
  static const auto update = library_op<ScalingUpdate>("transformer_fp8::delayed_scaling_update");
  update.call(histories, scales, scale_invs, fp8_max, margin, use_max ? "max" : "most_recent");
}

struct QueuedState {
  at::Tensor history, scale, scale_inv;
  double fp8_max, margin;
  bool use_max;
  std::unique_ptr<PyReference> python_state;  // (a ScalingState before its first update, else null)
};

// One backward's registrations.
struct BackwardQueue {
  std::vector<QueuedState> states;
};

// graph task id -> its queue. Weak: the end-of-backward callback owns the queue; a failed backward's callback dies with
// its graph task, and so does the queue (its entry here is pruned on a later registration).
std::mutex queues_mutex;
std::unordered_map<int, std::weak_ptr<BackwardQueue>>& queues() {
  static auto* map = new std::unordered_map<int, std::weak_ptr<BackwardQueue>>();
  return *map;
}

void set_updated(const std::vector<QueuedState>& states) {
  bool any = false;
  for (const QueuedState& s : states) any = any || s.python_state != nullptr;
  if (!any) return;
  pybind11::gil_scoped_acquire gil;
  for (const QueuedState& s : states) {
    if (s.python_state == nullptr) continue;
    pybind11::handle state(s.python_state->get());
    state.attr("pending") = false;
    state.attr("calibrated") = true;
  }
}

// The end of a backward: one update per (fp8_max, margin, algo, device), in registration order, then the flags.
void finish_backward(const std::shared_ptr<BackwardQueue>& queue, int task) {
  std::vector<QueuedState> states;
  {
    const std::lock_guard<std::mutex> lock(queues_mutex);
    states = std::move(queue->states);
    queue->states.clear();
    queues().erase(task);
  }
  std::vector<bool> done(states.size(), false);
  for (size_t i = 0; i < states.size(); ++i) {
    if (done[i]) continue;
    std::vector<at::Tensor> histories, scales, scale_invs;
    const QueuedState& first = states[i];
    for (size_t j = i; j < states.size(); ++j) {
      const QueuedState& s = states[j];
      if (done[j] || s.fp8_max != first.fp8_max || s.margin != first.margin || s.use_max != first.use_max ||
          s.history.device() != first.history.device()) {
        continue;
      }
      done[j] = true;
      histories.push_back(s.history), scales.push_back(s.scale), scale_invs.push_back(s.scale_inv);
    }
    run_update(histories, scales, scale_invs, first.fp8_max, first.margin, first.use_max);
  }
  set_updated(states);
}

}  // namespace

void queue_backward_update(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& scale_inv,
                           double fp8_max, double margin, bool use_max, PyObject* python_state) {
  const int task = torch::autograd::get_current_graph_task_id();
  TORCH_CHECK(task != -1, "queue_backward_update: expected a call from a running backward");
  TORCH_CHECK(history.dim() == 2 && scale.dim() == 1 && scale_inv.dim() == 1,
              "queue_backward_update: expected amax_history [H, n], scale [n], scale_inv [n], got shapes ",
              history.sizes(), ", ", scale.sizes(), ", ", scale_inv.sizes());
  std::shared_ptr<BackwardQueue> queue;
  bool created = false;
  {
    const std::lock_guard<std::mutex> lock(queues_mutex);
    auto& map = queues();
    auto found = map.find(task);
    if (found != map.end()) queue = found->second.lock();
    if (queue == nullptr) {
      for (auto it = map.begin(); it != map.end();) it = it->second.expired() ? map.erase(it) : std::next(it);
      queue = std::make_shared<BackwardQueue>();
      map[task] = queue;
      created = true;
    }
    for (const QueuedState& s : queue->states) {
      if (s.history.is_same(history)) return;  // (once per state and backward)
    }
    queue->states.push_back({history, scale, scale_inv, fp8_max, margin, use_max,
                             python_state == nullptr ? nullptr : std::make_unique<PyReference>(python_state)});
  }
  if (created) {
    torch::autograd::Engine::get_default_engine().queue_callback([queue, task] { finish_backward(queue, task); });
  }
}

int64_t backward_queues_alive() {
  const std::lock_guard<std::mutex> lock(queues_mutex);
  int64_t alive = 0;
  for (const auto& entry : queues()) alive += entry.second.expired() ? 0 : 1;
  return alive;
}

std::vector<at::Tensor> forward_scaling_update(const std::vector<at::Tensor>& histories,
                                               const std::vector<at::Tensor>& scales,
                                               const std::vector<at::Tensor>& scale_invs, double fp8_max, double margin,
                                               bool use_max, int64_t snapshots) {
  TORCH_CHECK(snapshots >= 0, "snapshots: expected a count >= 0, got ", snapshots);
  run_update(histories, scales, scale_invs, fp8_max, margin, use_max);
  std::vector<at::Tensor> views;
  if (snapshots == 0 || histories.empty()) return views;
  // one-element views 16 bytes apart (cuBLASLt's scale pointers need that alignment) of one new buffer
  const at::Tensor buffer = at::empty_strided({snapshots}, {4}, histories[0].options());
  views.reserve(snapshots);
  for (int64_t i = 0; i < snapshots; ++i) views.push_back(buffer.narrow(0, i, 1));
  return views;
}

}  // namespace tfp8
