// cuDNN attention's autograd node in C++, for the common case of transformer_fp8/module/attention_cudnn.py (no
// dropout, no padding mask; its Python autograd.Function `_FusedAttention` takes the others).
//
// Why: attention alone is timed step by step against PyTorch's SDPA, whose whole autograd path is C++. In Python, the
// forward's host path before the cuDNN launch and the backward's before its launch were each ~100 µs longer on the
// H100 host; with a short forward kernel the backward then started late.
//
// Contract of fused_attention: q [.., hq, .., d], k, v [.., hkv, .., d] in qkv_format "sbhd" / "bshd" / "bhsd" (any
// strides with a contiguous last dim; q, k, v may be views of one fused QKV buffer) -> out [s, b, hq * d] /
// [b, s, hq * d] (contiguous), or [b, hq, s, d] for "bhsd" (dense in q's dim order) = fused_attn_fwd(q, k, v, scale,
// causal) on the [b, h, s, d] views. The backward: fused_attn_bwd into dq, dk, dv laid out like q, k, v (views of ONE
// buffer when q, k, v are disjoint views of one: a fused QKV gets its gradient without a concatenation); when cuDNN
// refuses the backward, the Python fallback set by set_attention_fallback computes the gradients.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd_node_ptr.h"
#include "autograd_nodes.h"

namespace tfp8 {
namespace {

namespace autograd = torch::autograd;
using OptTensor = std::optional<at::Tensor>;
using AttnFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                   bool, double, const OptTensor&, const OptTensor&, const OptTensor&);
using AttnBwd = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool, double,
                     const OptTensor&, const OptTensor&, const OptTensor&);
using Dims = std::array<int64_t, 4>;

// qkv_format -> (its dims permuted to [b, h, s, d], the inverse)
std::pair<Dims, Dims> permutations(const std::string& qkv_format) {
  if (qkv_format == "sbhd") return {{1, 2, 0, 3}, {2, 0, 1, 3}};
  if (qkv_format == "bshd") return {{0, 2, 1, 3}, {0, 2, 1, 3}};
  TORCH_CHECK(qkv_format == "bhsd", "qkv_format: expected 'sbhd', 'bshd' or 'bhsd', got '", qkv_format, "'");
  return {{0, 1, 2, 3}, {0, 1, 2, 3}};
}

// Whether q, k, v ([b, h, s, d] views of one storage) share their b and s strides and hold their heads in disjoint
// channel ranges of one token: then one buffer laid out like them holds dq, dk, dv without overlap.
bool one_buffer_fits(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const std::array<const at::Tensor*, 3> all{&q, &k, &v};
  int64_t start = q.storage_offset();
  for (const at::Tensor* t : all) start = std::min(start, t->storage_offset());
  std::set<std::pair<int64_t, int64_t>> token_strides;  // (b stride, s stride), -1 where that dim has size 1
  std::vector<std::pair<int64_t, int64_t>> intervals;   // [first, end) of each head's channels in a token
  for (const at::Tensor* t : all) {
    token_strides.insert({t->size(0) > 1 ? t->stride(0) : -1, t->size(2) > 1 ? t->stride(2) : -1});
    const int64_t first = t->storage_offset() - start;
    for (int64_t h = 0; h < t->size(1); ++h)
      intervals.push_back({first + h * t->stride(1), first + h * t->stride(1) + t->size(3)});
  }
  if (token_strides.size() != 1 || intervals.empty()) return false;
  std::sort(intervals.begin(), intervals.end());
  for (size_t i = 1; i < intervals.size(); ++i)
    if (intervals[i - 1].second > intervals[i].first) return false;
  const auto [b_stride, s_stride] = *token_strides.begin();
  const int64_t end = intervals.back().second;
  return intervals.front().first >= 0 && (b_stride < 0 || end <= b_stride) && (s_stride < 0 || end <= s_stride);
}

// (dq, dk, dv) with q's, k's, v's shapes and strides: views of one new buffer when one_buffer_fits, else each like
// its input.
std::array<at::Tensor, 3> grad_buffers(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.numel() > 0 && k.numel() > 0 && q.is_alias_of(k) && q.is_alias_of(v) && one_buffer_fits(q, k, v)) {
    int64_t start = q.storage_offset(), end = 0;
    for (const at::Tensor* t : {&q, &k, &v}) {
      start = std::min(start, t->storage_offset());
      int64_t last = t->storage_offset();
      for (int64_t d = 0; d < 4; ++d) last += (t->size(d) - 1) * t->stride(d);
      end = std::max(end, last + 1);
    }
    const at::Tensor buffer = at::empty({end - start}, q.options());
    return {buffer.as_strided(q.sizes(), q.strides(), q.storage_offset() - start),
            buffer.as_strided(k.sizes(), k.strides(), k.storage_offset() - start),
            buffer.as_strided(v.sizes(), v.strides(), v.storage_offset() - start)};
  }
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

// The Python fallback for a backward cuDNN refuses, set once by transformer_fp8.module.attention_cudnn at import:
// fallback(message, grad_out, q, k, v, scale, causal, qkv_format) -> (dq, dk, dv), all [b, h, s, d].
std::unique_ptr<PyReference>& fallback() {
  static std::unique_ptr<PyReference> callable;
  return callable;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fallback_grads(const std::string& message, const at::Tensor& grad_out,
                                                              const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, double scale, bool causal,
                                                              const std::string& qkv_format) {
  pybind11::gil_scoped_acquire gil;
  pybind11::handle callable(fallback()->get());
  return callable(message, grad_out, q, k, v, scale, causal, qkv_format)
      .cast<std::tuple<at::Tensor, at::Tensor, at::Tensor>>();
}

struct FusedAttentionBackward : public autograd::Node {
  autograd::SavedVariable q, k, v, out, stats;  // the inputs in qkv_format, the output (as returned), the softmax stats
  std::string qkv_format;
  Dims to_bhsd, from_bhsd;
  double scale = 1.0;
  bool causal = false;

  std::string name() const override { return "FusedAttentionBackward"; }

  void release_variables() override {
    q.reset_data(), k.reset_data(), v.reset_data(), out.reset_data(), stats.reset_data();
  }

  autograd::variable_list apply(autograd::variable_list&& grads) override {
    static const auto attn_bwd = library_op<AttnBwd>("transformer_fp8::fused_attn_bwd");
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor qb = q.unpack().permute(to_bhsd), kb = k.unpack().permute(to_bhsd),
                     vb = v.unpack().permute(to_bhsd);
    const int64_t heads = qb.size(1), d_v = vb.size(3);
    at::Tensor o = out.unpack(getptr()), g = grad;
    if (qkv_format != "bhsd") {  // [s, b, h * d] / [b, s, h * d] -> [s, b, h, d] / [b, s, h, d]
      o = o.view({o.size(0), o.size(1), heads, d_v});
      g = g.view({g.size(0), g.size(1), heads, d_v});
    }
    o = o.permute(to_bhsd), g = g.permute(to_bhsd);
    if (g.stride(3) != 1) g = g.contiguous();
    auto [dq, dk, dv] = grad_buffers(qb, kb, vb);
    try {
      attn_bwd.call(g, qb, kb, vb, o, stats.unpack(), dq, dk, dv, scale, causal, 0.0, std::nullopt, std::nullopt,
                    std::nullopt);
    } catch (const c10::NotImplementedError& err) {
      std::tie(dq, dk, dv) = fallback_grads(err.what_without_backtrace(), g, qb, kb, vb, scale, causal, qkv_format);
    }
    return {should_compute_output(0) ? dq.permute(from_bhsd) : at::Tensor(),
            should_compute_output(1) ? dk.permute(from_bhsd) : at::Tensor(),
            should_compute_output(2) ? dv.permute(from_bhsd) : at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& qkv_format,
                           double scale, bool causal) {
  static const auto attn_fwd = library_op<AttnFwd>("transformer_fp8::fused_attn_fwd");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v: expected 4-D tensors");
  TORCH_CHECK(fallback() != nullptr, "fused_attention: set_attention_fallback was not called");
  const auto [to_bhsd, from_bhsd] = permutations(qkv_format);
  at::Tensor out, stats;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, stats) = attn_fwd.call(q.permute(to_bhsd), k.permute(to_bhsd), v.permute(to_bhsd), scale, causal, 0.0,
                                         std::nullopt, std::nullopt, std::nullopt);
    out = out.permute(from_bhsd);  // (dense in q's dim order: for sbhd / bshd inputs a contiguous tensor)
    if (qkv_format != "bhsd") out = out.reshape({out.size(0), out.size(1), -1});
  }
  if (!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad())) return out;
  auto node = make_autograd_node<FusedAttentionBackward>();
  node->set_next_edges(autograd::collect_next_edges(q, k, v));
  node->q = autograd::SavedVariable(q, false);
  node->k = autograd::SavedVariable(k, false);
  node->v = autograd::SavedVariable(v, false);
  node->stats = autograd::SavedVariable(stats, false);
  node->qkv_format = qkv_format, node->to_bhsd = to_bhsd, node->from_bhsd = from_bhsd;
  node->scale = scale, node->causal = causal;
  autograd::set_history(out, node);
  node->out = autograd::SavedVariable(out, true);
  return out;
}

void set_attention_fallback(pybind11::object callable) { fallback() = std::make_unique<PyReference>(callable.ptr()); }

}  // namespace tfp8
