// Scaled-dot-product attention forward and backward as cudnn-frontend graphs (header-only C++ frontend over the cuDNN
// that torch loads).
//
// Host cost: a graph (validated, lowered, its plan chosen by heuristic mode A and built) is made once per thread and
// problem (SdpaProblem + device) and kept in a thread_local table; a call looks it up and executes it with a variant
// pack of uid -> pointer. A problem cuDNN refuses is cached with its reason, so asking again costs a lookup.
// FP8 problems build cuDNN's per-tensor-scaled FP8 SDPA graphs (sdpa_fp8 / sdpa_fp8_backward); on Hopper these take
// and give FP8 only (o, dq, dk, dv in FP8: BF16 outputs need Blackwell), and the FP8 backward only head dims 128.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <limits.h>
#include <nvrtc.h>
#include <stdint.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention.h"

// torch links its own (older) copy of the header-only frontend into libtorch_cuda: keep ours private to this library
// so that no inline frontend function of one copy binds to the other's. The system and CUDA headers it includes come
// first, above, so that their functions keep default visibility.
#pragma GCC visibility push(hidden)
#include <cudnn_frontend.h>
#pragma GCC visibility pop

namespace tfp8 {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Graphs a thread keeps before it drops them all (a bound for workloads whose shapes keep changing).
constexpr size_t kMaxGraphsPerThread = 256;

enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqlensQ,
  kSeqlensKv,
  kSeed,
  kOffset,
  // FP8 scales and amaxes
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleS,
  kScaleS,
  kScaleO,
  kAmaxS,
  kAmaxO,
  kDescaleO,
  kDescaleDO,
  kDescaleDP,
  kScaleDP,
  kScaleDQ,
  kScaleDK,
  kScaleDV,
  kAmaxDP,
  kAmaxDQ,
  kAmaxDK,
  kAmaxDV
};

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string unsupported;  // non-empty: why cuDNN cannot run the problem
};

fe::DataType_t io_type(DType t) {
  if (t == DType::kFloat16) return fe::DataType_t::HALF;
  if (t == DType::kBFloat16) return fe::DataType_t::BFLOAT16;
  if (t == DType::kE4M3) return fe::DataType_t::FP8_E4M3;
  if (t == DType::kE5M2) return fe::DataType_t::FP8_E5M2;
  throw std::invalid_argument("cuDNN attention: io dtype must be float16, bfloat16 or an FP8 dtype");
}

std::vector<int64_t> vec(const Strides4& s) { return {s.begin(), s.end()}; }

TensorPtr tensor(fe::graph::Graph& g, const char* name, Uid uid, std::vector<int64_t> dim, std::vector<int64_t> stride,
                 fe::DataType_t type = fe::DataType_t::NOT_SET) {
  auto attrs = fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride);
  if (type != fe::DataType_t::NOT_SET) attrs.set_data_type(type);
  return g.tensor(attrs);
}

void mark_output(const TensorPtr& t, Uid uid, std::vector<int64_t> dim, std::vector<int64_t> stride) {
  t->set_output(true).set_uid(uid).set_dim(dim).set_stride(stride);
}

// Scale, causal and padding masks and dropout: the same setters on the forward and the backward attributes.
template <typename Attributes>
void set_common(Attributes& attrs, fe::graph::Graph& g, const SdpaProblem& p) {
  attrs.set_attn_scale(p.scale);
  if (p.causal) {
    attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  }
  if (p.padding) {
    attrs.set_padding_mask(true)
        .set_seq_len_q(tensor(g, "seqlens_q", kSeqlensQ, {p.b, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32))
        .set_seq_len_kv(tensor(g, "seqlens_kv", kSeqlensKv, {p.b, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32));
  }
  if (p.dropout_p > 0.0f) {
    attrs.set_dropout(p.dropout_p, tensor(g, "seed", kSeed, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT64),
                      tensor(g, "offset", kOffset, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT64));
  }
}

// A one-element float32 scale / amax tensor.
TensorPtr scalar(fe::graph::Graph& g, const char* name, Uid uid) {
  return tensor(g, name, uid, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::FLOAT);
}

void mark_scalar_output(const TensorPtr& t, Uid uid) {
  mark_output(t, uid, {1, 1, 1, 1}, {1, 1, 1, 1});
  t->set_data_type(fe::DataType_t::FLOAT);
}

void add_sdpa_fp8(fe::graph::Graph& g, const SdpaProblem& p, const TensorPtr& q, const TensorPtr& k,
                  const TensorPtr& v) {
  const std::vector<int64_t> q_dim{p.b, p.hq, p.sq, p.d_qk}, k_dim{p.b, p.hkv, p.skv, p.d_qk},
      v_dim{p.b, p.hkv, p.skv, p.d_v}, o_dim{p.b, p.hq, p.sq, p.d_v}, stats_dim{p.b, p.hq, p.sq, 1},
      stats_stride{p.hq * p.sq, p.sq, 1, 1};
  auto descale_q = scalar(g, "descale_q", kDescaleQ), descale_k = scalar(g, "descale_k", kDescaleK),
       descale_v = scalar(g, "descale_v", kDescaleV), descale_s = scalar(g, "descale_s", kDescaleS),
       scale_s = scalar(g, "scale_s", kScaleS);
  if (!p.backward) {
    fe::graph::SDPA_fp8_attributes attrs;
    attrs.set_name("sdpa_fp8_fwd").set_generate_stats(true);
    set_common(attrs, g, p);
    auto [o, stats, amax_s, amax_o] = g.sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                                                 scalar(g, "scale_o", kScaleO), attrs);
    mark_output(o, kO, o_dim, vec(p.o));
    o->set_data_type(io_type(p.dtype));
    mark_output(stats, kStats, stats_dim, stats_stride);
    stats->set_data_type(fe::DataType_t::FLOAT);
    mark_scalar_output(amax_s, kAmaxS);
    mark_scalar_output(amax_o, kAmaxO);
    return;
  }
  const fe::DataType_t grad_type = io_type(p.grad_dtype);
  auto o = tensor(g, "o", kO, o_dim, vec(p.o));
  auto d_o = tensor(g, "d_o", kDO, o_dim, vec(p.d_o), grad_type);
  auto stats = tensor(g, "stats", kStats, stats_dim, stats_stride, fe::DataType_t::FLOAT);
  fe::graph::SDPA_fp8_backward_attributes attrs;
  attrs.set_name("sdpa_fp8_bwd");
  set_common(attrs, g, p);
  if (p.deterministic) attrs.set_deterministic_algorithm(true);
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] = g.sdpa_fp8_backward(
      q, k, v, o, d_o, stats, descale_q, descale_k, descale_v, scalar(g, "descale_o", kDescaleO),
      scalar(g, "descale_do", kDescaleDO), descale_s, scalar(g, "descale_dp", kDescaleDP), scale_s,
      scalar(g, "scale_dq", kScaleDQ), scalar(g, "scale_dk", kScaleDK), scalar(g, "scale_dv", kScaleDV),
      scalar(g, "scale_dp", kScaleDP), attrs);
  mark_output(dq, kDQ, q_dim, vec(p.dq));
  mark_output(dk, kDK, k_dim, vec(p.dk));
  mark_output(dv, kDV, v_dim, vec(p.dv));
  for (const auto& t : {dq, dk, dv}) t->set_data_type(grad_type);
  mark_scalar_output(amax_dq, kAmaxDQ);
  mark_scalar_output(amax_dk, kAmaxDK);
  mark_scalar_output(amax_dv, kAmaxDV);
  mark_scalar_output(amax_dp, kAmaxDP);
}

void add_sdpa(fe::graph::Graph& g, const SdpaProblem& p) {
  const std::vector<int64_t> q_dim{p.b, p.hq, p.sq, p.d_qk}, k_dim{p.b, p.hkv, p.skv, p.d_qk},
      v_dim{p.b, p.hkv, p.skv, p.d_v}, o_dim{p.b, p.hq, p.sq, p.d_v}, stats_dim{p.b, p.hq, p.sq, 1},
      stats_stride{p.hq * p.sq, p.sq, 1, 1};
  auto q = tensor(g, "q", kQ, q_dim, vec(p.q));
  auto k = tensor(g, "k", kK, k_dim, vec(p.k));
  auto v = tensor(g, "v", kV, v_dim, vec(p.v));
  if (p.fp8()) return add_sdpa_fp8(g, p, q, k, v);
  if (!p.backward) {
    fe::graph::SDPA_attributes attrs;
    attrs.set_name("sdpa_fwd").set_generate_stats(true);
    set_common(attrs, g, p);
    auto [o, stats] = g.sdpa(q, k, v, attrs);
    mark_output(o, kO, o_dim, vec(p.o));
    mark_output(stats, kStats, stats_dim, stats_stride);
    stats->set_data_type(fe::DataType_t::FLOAT);
    return;
  }
  auto o = tensor(g, "o", kO, o_dim, vec(p.o));
  auto d_o = tensor(g, "d_o", kDO, o_dim, vec(p.d_o));
  auto stats = tensor(g, "stats", kStats, stats_dim, stats_stride, fe::DataType_t::FLOAT);
  fe::graph::SDPA_backward_attributes attrs;
  attrs.set_name("sdpa_bwd");
  set_common(attrs, g, p);
  if (p.deterministic) attrs.set_deterministic_algorithm(true);
  auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, d_o, stats, attrs);
  mark_output(dq, kDQ, q_dim, vec(p.dq));
  mark_output(dk, kDK, k_dim, vec(p.dk));
  mark_output(dv, kDV, v_dim, vec(p.dv));
}

// "" when the step succeeded, else "<step>: <cuDNN's message>".
std::string failure(fe::error_t status, const char* step) {
  if (status.is_good()) return "";
  return std::string(step) + ": " + status.get_message();
}

// Builds p's graph; a step cuDNN refuses (an error status, or an exception from the backend) makes it unsupported.
std::unique_ptr<CachedGraph> build(const SdpaProblem& p, cudnnHandle_t handle) {
  auto cached = std::make_unique<CachedGraph>();
  auto g = std::make_shared<fe::graph::Graph>();
  std::string why;
  try {
    g->set_io_data_type(io_type(p.dtype))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    add_sdpa(*g, p);
    why = failure(g->validate(), "validate");
    if (why.empty()) why = failure(g->build_operation_graph(handle), "build_operation_graph");
    if (why.empty()) why = failure(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
    if (why.empty()) why = failure(g->check_support(handle), "check_support");
    if (why.empty()) why = failure(g->build_plans(handle), "build_plans");
    if (why.empty()) why = failure(g->get_workspace_size(cached->workspace_bytes), "get_workspace_size");
  } catch (const std::exception& e) {
    why = std::string("graph build: ") + e.what();
  }
  if (why.empty()) {
    cached->graph = std::move(g);
  } else {
    cached->unsupported = why;
  }
  return cached;
}

using GraphKey = std::vector<int64_t>;

GraphKey key_of(const SdpaProblem& p, int device) {
  auto bits = [](float x) {
    int32_t i;
    std::memcpy(&i, &x, sizeof(i));
    return int64_t(i);
  };
  GraphKey key{device,
               int64_t(p.backward),
               int64_t(p.dtype),
               int64_t(p.grad_dtype),
               p.b,
               p.hq,
               p.hkv,
               p.sq,
               p.skv,
               p.d_qk,
               p.d_v,
               bits(p.scale),
               bits(p.dropout_p),
               int64_t(p.causal),
               int64_t(p.padding),
               int64_t(p.deterministic)};
  for (const Strides4* s : {&p.q, &p.k, &p.v, &p.o, &p.d_o, &p.dq, &p.dk, &p.dv})
    key.insert(key.end(), s->begin(), s->end());
  return key;
}

struct GraphKeyHash {
  size_t operator()(const GraphKey& key) const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t v : key) h = (h ^ uint64_t(v)) * 0x100000001b3ull;
    return size_t(h ^ (h >> 32));
  }
};

// This thread's graph for p on the current device, built on first use.
const CachedGraph& graph_for(const SdpaProblem& p, cudnnHandle_t handle) {
  thread_local std::unordered_map<GraphKey, std::unique_ptr<CachedGraph>, GraphKeyHash> graphs;
  int device = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  GraphKey key = key_of(p, device);
  auto it = graphs.find(key);
  if (it != graphs.end()) return *it->second;
  auto cached = build(p, handle);
  if (graphs.size() >= kMaxGraphsPerThread) graphs.clear();
  return *graphs.emplace(std::move(key), std::move(cached)).first->second;
}

const CachedGraph& supported_graph_for(const SdpaProblem& p, cudnnHandle_t handle) {
  const CachedGraph& cached = graph_for(p, handle);
  if (!cached.unsupported.empty()) throw SdpaUnsupported(cached.unsupported);
  return cached;
}

void add_fp8_pointers(const SdpaProblem& p, const Fp8ScalePointers& f, std::unordered_map<int64_t, void*>& pack) {
  auto in = [](const float* x) { return static_cast<void*>(const_cast<float*>(x)); };
  pack[kDescaleQ] = in(f.descale_q), pack[kDescaleK] = in(f.descale_k), pack[kDescaleV] = in(f.descale_v);
  pack[kDescaleS] = in(f.descale_s), pack[kScaleS] = in(f.scale_s);
  if (!p.backward) {
    pack[kScaleO] = in(f.scale_o), pack[kAmaxS] = f.amax_s, pack[kAmaxO] = f.amax_o;
    return;
  }
  pack[kDescaleO] = in(f.descale_o), pack[kDescaleDO] = in(f.descale_do), pack[kDescaleDP] = in(f.descale_dp);
  pack[kScaleDP] = in(f.scale_dp), pack[kScaleDQ] = in(f.scale_dq), pack[kScaleDK] = in(f.scale_dk);
  pack[kScaleDV] = in(f.scale_dv);
  pack[kAmaxDP] = f.amax_dp, pack[kAmaxDQ] = f.amax_dq, pack[kAmaxDK] = f.amax_dk, pack[kAmaxDV] = f.amax_dv;
}

}  // namespace

int64_t sdpa_workspace_bytes(const SdpaProblem& p, cudnnHandle_t handle) {
  return supported_graph_for(p, handle).workspace_bytes;
}

void sdpa_execute(const SdpaProblem& p, const SdpaPointers& ptrs, void* workspace, cudnnHandle_t handle) {
  const CachedGraph& cached = supported_graph_for(p, handle);
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(ptrs.q)},
                                          {kK, const_cast<void*>(ptrs.k)},
                                          {kV, const_cast<void*>(ptrs.v)},
                                          {kO, ptrs.o},
                                          {kStats, ptrs.stats}};
  if (p.backward) {
    pack[kDO] = const_cast<void*>(ptrs.d_o);
    pack[kDQ] = ptrs.dq;
    pack[kDK] = ptrs.dk;
    pack[kDV] = ptrs.dv;
  }
  if (p.padding) {
    pack[kSeqlensQ] = const_cast<int32_t*>(ptrs.seqlens_q);
    pack[kSeqlensKv] = const_cast<int32_t*>(ptrs.seqlens_kv);
  }
  if (p.dropout_p > 0.0f) {
    pack[kSeed] = const_cast<int64_t*>(ptrs.seed);
    pack[kOffset] = const_cast<int64_t*>(ptrs.offset);
  }
  if (p.fp8()) add_fp8_pointers(p, ptrs.fp8, pack);
  fe::error_t status = cached.graph->execute(handle, pack, workspace);
  if (!status.is_good())
    throw std::runtime_error(std::string("cuDNN attention ") + (p.backward ? "backward" : "forward") +
                             ": execute failed: " + status.get_message());
}

}  // namespace tfp8
