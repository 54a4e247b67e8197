// Creating a C++ autograd node, across the torch versions we support.
//
// Up to torch 2.12 `torch::autograd::Node` is owned through std::shared_ptr (enable_shared_from_this; a node is made
// with `deleteNode` as its deleter, which breaks long chains of nodes up without deep recursion). From torch 2.13 it
// is a c10::intrusive_ptr target and `deleteNode` is gone. Both versions have `Node::getptr()`, which returns the
// owning pointer of either kind, and `set_history` / `SavedVariable::unpack` take that kind: so only the creation
// differs, and it lives here.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define TFP8_INTRUSIVE_AUTOGRAD_NODES 1
#endif

namespace tfp8 {

// A new, default-constructed autograd node of type NodeType, owned the way this torch owns nodes.
template <class NodeType>
auto make_autograd_node() {
#ifdef TFP8_INTRUSIVE_AUTOGRAD_NODES
  return c10::make_intrusive<NodeType>();
#else
  return std::shared_ptr<NodeType>(new NodeType(), torch::autograd::deleteNode);
#endif
}

}  // namespace tfp8
