// CUDA kernels of the attention family for torch: argument checks, output allocation, the cuDNN handle (torch's own,
// per thread and device) on the current stream, workspace from the caching allocator.
// Contracts: csrc/ops.cpp; graphs: csrc/attention_cudnn.cpp.
#include <ATen/Context.h>
#include <ATen/cudnn/Handle.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "attention.h"
#include "common.h"

namespace tfp8 {
namespace {

Strides4 strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

void check_4d(const at::Tensor& t, const char* arg, const char* layout) {
  TORCH_CHECK(t.dim() == 4, arg, ": expected a 4-D tensor ", layout, ", got shape ", dims(t.sizes()));
  TORCH_CHECK(t.stride(3) == 1, arg, ": expected a contiguous last dim, got strides ", dims(t.strides()));
}

void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* arg) {
  TORCH_CHECK(t.sizes() == expected, arg, ": expected shape ", dims(expected), ", got ", dims(t.sizes()));
}

void check_like(const at::Tensor& t, const at::Tensor& q, const char* arg) {
  check_same_device(t, q, arg);
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), arg, ": expected ", q.scalar_type(), " (as q), got ",
              t.scalar_type());
}

// cuDNN reads and writes its tensors with 16-byte vector accesses.
void check_aligned(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_NOT_IMPLEMENTED(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, arg,
                              ": cuDNN attention needs 16-byte aligned data");
}

void check_high_precision_io(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "q: expected a float16 or bfloat16 tensor, got ", q.scalar_type());
}

// Checks q, k, v (not q's dtype: the caller does) and the optional inputs; returns the problem without its output /
// backward strides.
SdpaProblem problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
                       double dropout_p, const std::optional<at::Tensor>& seqlens_q,
                       const std::optional<at::Tensor>& seqlens_kv, const std::optional<at::Tensor>& rng_state) {
  check_cuda(q, "q");
  check_4d(q, "q", "[b, hq, sq, d_qk]");
  check_4d(k, "k", "[b, hkv, skv, d_qk]");
  check_4d(v, "v", "[b, hkv, skv, d_v]");
  check_like(k, q, "k");
  check_like(v, q, "v");
  SdpaProblem p;
  p.dtype = to_dtype(q.scalar_type(), "q");
  p.b = q.size(0), p.hq = q.size(1), p.sq = q.size(2), p.d_qk = q.size(3);
  p.hkv = k.size(1), p.skv = k.size(2), p.d_v = v.size(3);
  TORCH_CHECK(k.size(0) == p.b && k.size(3) == p.d_qk && p.hkv > 0 && p.hq % p.hkv == 0, "k: expected [", num(p.b),
              ", hkv, skv, ", num(p.d_qk), "] with hkv dividing hq = ", num(p.hq), ", got shape ", dims(k.sizes()));
  TORCH_CHECK(v.size(0) == p.b && v.size(1) == p.hkv && v.size(2) == p.skv, "v: expected [", num(p.b), ", ", num(p.hkv),
              ", ", num(p.skv), ", d_v] (as k), got shape ", dims(v.sizes()));
  TORCH_CHECK(p.skv > 0 && p.d_qk > 0 && p.d_v > 0, "k/v: expected at least one key and non-empty head dims, got k ",
              dims(k.sizes()), ", v ", dims(v.sizes()));
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p: expected a value in [0, 1), got ",
              std::to_string(dropout_p));
  TORCH_CHECK(seqlens_q.has_value() == seqlens_kv.has_value(),
              "seqlens_q/seqlens_kv: expected both or neither (padding mask)");
  for (const auto& [t, arg] : {std::make_pair(&seqlens_q, "seqlens_q"), std::make_pair(&seqlens_kv, "seqlens_kv")}) {
    if (!t->has_value()) continue;
    const at::Tensor& s = **t;
    check_same_device(s, q, arg);
    TORCH_CHECK(s.scalar_type() == at::kInt, arg, ": expected an int32 tensor, got ", s.scalar_type());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == p.b && s.is_contiguous(), arg, ": expected a contiguous [", num(p.b),
                "] tensor, got shape ", dims(s.sizes()), " strides ", dims(s.strides()));
  }
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng_state.has_value(), "rng_state: required with dropout_p > 0 (int64 [2]: philox seed, offset)");
    check_same_device(*rng_state, q, "rng_state");
    TORCH_CHECK(rng_state->scalar_type() == at::kLong && rng_state->numel() == 2 && rng_state->is_contiguous(),
                "rng_state: expected a contiguous int64 tensor of 2 elements (seed, offset), got ",
                rng_state->scalar_type(), " of shape ", dims(rng_state->sizes()));
  }
  p.q = strides_of(q), p.k = strides_of(k), p.v = strides_of(v);
  p.scale = float(scale), p.dropout_p = float(dropout_p), p.causal = causal, p.padding = seqlens_q.has_value();
  return p;
}

SdpaPointers pointers_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SdpaProblem& p,
                         const std::optional<at::Tensor>& seqlens_q, const std::optional<at::Tensor>& seqlens_kv,
                         const std::optional<at::Tensor>& rng_state) {
  SdpaPointers ptrs;
  ptrs.q = q.data_ptr(), ptrs.k = k.data_ptr(), ptrs.v = v.data_ptr();
  if (p.padding) ptrs.seqlens_q = seqlens_q->data_ptr<int32_t>(), ptrs.seqlens_kv = seqlens_kv->data_ptr<int32_t>();
  if (p.dropout_p > 0.0f) {
    ptrs.seed = rng_state->data_ptr<int64_t>();
    ptrs.offset = ptrs.seed + 1;
  }
  return ptrs;
}

// A [sizes] tensor like `like` (of dtype, default like's), dense in like's dim order (dims 0..2 by decreasing stride,
// d last).
at::Tensor dense_in_order_of(const at::Tensor& like, at::IntArrayRef sizes, bool zeroed,
                             std::optional<at::ScalarType> dtype = std::nullopt) {
  std::array<int64_t, 3> order{0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return like.stride(a) > like.stride(b); });
  const std::vector<int64_t> memory_sizes{sizes[order[0]], sizes[order[1]], sizes[order[2]], sizes[3]};
  const auto options = like.options().dtype(dtype.value_or(like.scalar_type()));
  at::Tensor t = zeroed ? at::zeros(memory_sizes, options) : at::empty(memory_sizes, options);
  std::vector<int64_t> inverse(4, 3);
  for (int64_t i = 0; i < 3; ++i) inverse[order[i]] = i;
  return t.permute(inverse);
}

// Runs p on the current stream; NotImplementedError (with cuDNN's reason) when cuDNN cannot run it.
void run(const SdpaProblem& p, const SdpaPointers& ptrs, const at::Tensor& q, const char* op) {
  cudnnHandle_t handle = at::native::getCudnnHandle();
  const cudnnStatus_t status = cudnnSetStream(handle, current_stream());
  TORCH_CHECK(status == CUDNN_STATUS_SUCCESS, op, ": cudnnSetStream failed: ", cudnnGetErrorString(status));
  int64_t bytes = 0;
  try {
    bytes = sdpa_workspace_bytes(p, handle);
  } catch (const SdpaUnsupported& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": cuDNN cannot run this case (", q.scalar_type(), ", b=", num(p.b),
                                " hq=", num(p.hq), " hkv=", num(p.hkv), " sq=", num(p.sq), " skv=", num(p.skv),
                                " d_qk=", num(p.d_qk), " d_v=", num(p.d_v), p.causal ? ", causal" : "",
                                p.padding ? ", padding" : "", p.dropout_p > 0.0f ? ", dropout" : "", "): ", e.what());
  }
  at::Tensor workspace = at::empty({bytes}, q.options().dtype(at::kByte));
  sdpa_execute(p, ptrs, bytes > 0 ? workspace.data_ptr() : nullptr, handle);
}

std::tuple<at::Tensor, at::Tensor> fused_attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, bool causal, double dropout_p,
                                                  const std::optional<at::Tensor>& seqlens_q,
                                                  const std::optional<at::Tensor>& seqlens_kv,
                                                  const std::optional<at::Tensor>& rng_state) {
  check_high_precision_io(q);
  SdpaProblem p = problem_of(q, k, v, scale, causal, dropout_p, seqlens_q, seqlens_kv, rng_state);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = dense_in_order_of(q, {p.b, p.hq, p.sq, p.d_v}, /*zeroed=*/p.padding);
  at::Tensor stats = at::empty({p.b, p.hq, p.sq, 1}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, stats};
  for (const auto& [t, arg] : {std::make_pair(&q, "q"), std::make_pair(&k, "k"), std::make_pair(&v, "v")})
    check_aligned(*t, arg);
  p.o = strides_of(out);
  SdpaPointers ptrs = pointers_of(q, k, v, p, seqlens_q, seqlens_kv, rng_state);
  ptrs.o = out.data_ptr(), ptrs.stats = stats.data_ptr();
  run(p, ptrs, q, "fused_attn_fwd");
  return {out, stats};
}

void fused_attn_bwd(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& stats, const at::Tensor& dq, const at::Tensor& dk,
                    const at::Tensor& dv, double scale, bool causal, double dropout_p,
                    const std::optional<at::Tensor>& seqlens_q, const std::optional<at::Tensor>& seqlens_kv,
                    const std::optional<at::Tensor>& rng_state) {
  check_high_precision_io(q);
  SdpaProblem p = problem_of(q, k, v, scale, causal, dropout_p, seqlens_q, seqlens_kv, rng_state);
  p.backward = true;
  p.deterministic = at::globalContext().deterministicAlgorithms();
  const std::vector<int64_t> o_shape{p.b, p.hq, p.sq, p.d_v};
  for (const auto& [t, arg] : {std::make_pair(&grad_out, "grad_out"), std::make_pair(&out, "out")}) {
    check_4d(*t, arg, "[b, hq, sq, d_v]");
    check_like(*t, q, arg);
    check_shape(*t, o_shape, arg);
  }
  check_same_device(stats, q, "stats");
  TORCH_CHECK(stats.scalar_type() == at::kFloat, "stats: expected a float32 tensor, got ", stats.scalar_type());
  check_shape(stats, {p.b, p.hq, p.sq, 1}, "stats");
  check_contiguous(stats, "stats");
  for (const auto& [grad, like, arg] :
       {std::make_tuple(&dq, &q, "dq"), std::make_tuple(&dk, &k, "dk"), std::make_tuple(&dv, &v, "dv")}) {
    check_4d(*grad, arg, "(the shape of its input)");
    check_like(*grad, q, arg);
    check_shape(*grad, like->sizes(), arg);
  }
  c10::cuda::CUDAGuard guard(q.device());
  if (grad_out.numel() == 0) {  // no queries: no gradient
    dq.zero_(), dk.zero_(), dv.zero_();
    return;
  }
  for (const auto& [t, arg] : {std::make_pair(&q, "q"), std::make_pair(&k, "k"), std::make_pair(&v, "v"),
                               std::make_pair(&out, "out"), std::make_pair(&grad_out, "grad_out"),
                               std::make_pair(&dq, "dq"), std::make_pair(&dk, "dk"), std::make_pair(&dv, "dv")})
    check_aligned(*t, arg);
  p.o = strides_of(out), p.d_o = strides_of(grad_out);
  p.dq = strides_of(dq), p.dk = strides_of(dk), p.dv = strides_of(dv);
  SdpaPointers ptrs = pointers_of(q, k, v, p, seqlens_q, seqlens_kv, rng_state);
  ptrs.o = out.data_ptr(), ptrs.stats = stats.data_ptr(), ptrs.d_o = grad_out.data_ptr();
  ptrs.dq = dq.data_ptr(), ptrs.dk = dk.data_ptr(), ptrs.dv = dv.data_ptr();
  run(p, ptrs, q, "fused_attn_bwd");
}

// --- FP8 (cuDNN's per-tensor-scaled FP8 SDPA) ---

const float* scale_ptr(const at::Tensor& t, const at::Tensor& data, const char* arg) {
  check_scalar_f32(t, data, arg);
  return t.data_ptr<float>();
}

// The graph overwrites its amax outputs: it writes them into a scratch buffer, one every 16 bytes (kAmaxStride
// floats, the alignment cuDNN asks of tensors), whose values the ops max-accumulate into the caller's (see ops.cpp).
constexpr int64_t kAmaxStride = 4;

at::Tensor amax_scratch(const at::Tensor& like, int64_t n) {
  return at::empty({n * kAmaxStride}, like.options().dtype(at::kFloat));
}

void accumulate_amaxes(const at::Tensor& scratch, std::initializer_list<const at::Tensor*> amaxes) {
  int64_t i = 0;
  for (const at::Tensor* amax : amaxes) {
    at::Tensor row = scratch.narrow(0, kAmaxStride * i++, 1).view(amax->sizes());
    at::maximum_out(const_cast<at::Tensor&>(*amax), *amax, row);
  }
}

std::tuple<at::Tensor, at::Tensor> fused_attn_fp8_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& descale_q, const at::Tensor& descale_k,
                                                      const at::Tensor& descale_v, const at::Tensor& scale_s,
                                                      const at::Tensor& descale_s, const at::Tensor& scale_o,
                                                      const at::Tensor& amax_s, const at::Tensor& amax_o, double scale,
                                                      bool causal) {
  check_fp8_dtype(q.scalar_type(), "q");
  SdpaProblem p = problem_of(q, k, v, scale, causal, 0.0, std::nullopt, std::nullopt, std::nullopt);
  Fp8ScalePointers f;
  f.descale_q = scale_ptr(descale_q, q, "descale_q"), f.descale_k = scale_ptr(descale_k, q, "descale_k");
  f.descale_v = scale_ptr(descale_v, q, "descale_v"), f.scale_s = scale_ptr(scale_s, q, "scale_s");
  f.descale_s = scale_ptr(descale_s, q, "descale_s"), f.scale_o = scale_ptr(scale_o, q, "scale_o");
  check_scalar_f32(amax_s, q, "amax_s");
  check_scalar_f32(amax_o, q, "amax_o");
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = dense_in_order_of(q, {p.b, p.hq, p.sq, p.d_v}, /*zeroed=*/false);
  at::Tensor stats = at::empty({p.b, p.hq, p.sq, 1}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, stats};
  for (const auto& [t, arg] : {std::make_pair(&q, "q"), std::make_pair(&k, "k"), std::make_pair(&v, "v")})
    check_aligned(*t, arg);
  p.o = strides_of(out);
  SdpaPointers ptrs = pointers_of(q, k, v, p, std::nullopt, std::nullopt, std::nullopt);
  ptrs.o = out.data_ptr(), ptrs.stats = stats.data_ptr();
  at::Tensor fresh = amax_scratch(q, 2);
  f.amax_s = fresh.data_ptr<float>(), f.amax_o = f.amax_s + kAmaxStride;
  ptrs.fp8 = f;
  run(p, ptrs, q, "fused_attn_fp8_fwd");
  accumulate_amaxes(fresh, {&amax_s, &amax_o});
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attn_fp8_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& stats, const at::Tensor& descale_q, const at::Tensor& descale_k, const at::Tensor& descale_v,
    const at::Tensor& descale_o, const at::Tensor& descale_do, const at::Tensor& scale_s, const at::Tensor& descale_s,
    const at::Tensor& scale_dp, const at::Tensor& descale_dp, const at::Tensor& scale_dq, const at::Tensor& scale_dk,
    const at::Tensor& scale_dv, const at::Tensor& amax_dp, const at::Tensor& amax_dq, const at::Tensor& amax_dk,
    const at::Tensor& amax_dv, double scale, bool causal) {
  check_fp8_dtype(q.scalar_type(), "q");
  SdpaProblem p = problem_of(q, k, v, scale, causal, 0.0, std::nullopt, std::nullopt, std::nullopt);
  p.backward = true;
  p.deterministic = at::globalContext().deterministicAlgorithms();
  const std::vector<int64_t> o_shape{p.b, p.hq, p.sq, p.d_v};
  check_4d(out, "out", "[b, hq, sq, d_v]");
  check_like(out, q, "out");
  check_shape(out, o_shape, "out");
  check_4d(grad_out, "grad_out", "[b, hq, sq, d_v]");
  check_same_device(grad_out, q, "grad_out");
  check_fp8_dtype(grad_out.scalar_type(), "grad_out");
  check_shape(grad_out, o_shape, "grad_out");
  check_same_device(stats, q, "stats");
  TORCH_CHECK(stats.scalar_type() == at::kFloat, "stats: expected a float32 tensor, got ", stats.scalar_type());
  check_shape(stats, {p.b, p.hq, p.sq, 1}, "stats");
  check_contiguous(stats, "stats");
  p.grad_dtype = to_dtype(grad_out.scalar_type(), "grad_out");
  Fp8ScalePointers f;
  f.descale_q = scale_ptr(descale_q, q, "descale_q"), f.descale_k = scale_ptr(descale_k, q, "descale_k");
  f.descale_v = scale_ptr(descale_v, q, "descale_v"), f.descale_o = scale_ptr(descale_o, q, "descale_o");
  f.descale_do = scale_ptr(descale_do, q, "descale_do"), f.scale_s = scale_ptr(scale_s, q, "scale_s");
  f.descale_s = scale_ptr(descale_s, q, "descale_s"), f.scale_dp = scale_ptr(scale_dp, q, "scale_dp");
  f.descale_dp = scale_ptr(descale_dp, q, "descale_dp"), f.scale_dq = scale_ptr(scale_dq, q, "scale_dq");
  f.scale_dk = scale_ptr(scale_dk, q, "scale_dk"), f.scale_dv = scale_ptr(scale_dv, q, "scale_dv");
  for (const auto& [t, arg] : {std::make_pair(&amax_dp, "amax_dp"), std::make_pair(&amax_dq, "amax_dq"),
                               std::make_pair(&amax_dk, "amax_dk"), std::make_pair(&amax_dv, "amax_dv")})
    check_scalar_f32(*t, q, arg);
  c10::cuda::CUDAGuard guard(q.device());
  const bool no_queries = grad_out.numel() == 0;
  at::Tensor dq = dense_in_order_of(q, q.sizes(), no_queries, grad_out.scalar_type());
  at::Tensor dk = dense_in_order_of(k, k.sizes(), no_queries, grad_out.scalar_type());
  at::Tensor dv = dense_in_order_of(v, v.sizes(), no_queries, grad_out.scalar_type());
  if (no_queries) return {dq, dk, dv};  // zero gradients
  for (const auto& [t, arg] : {std::make_pair(&q, "q"), std::make_pair(&k, "k"), std::make_pair(&v, "v"),
                               std::make_pair(&out, "out"), std::make_pair(&grad_out, "grad_out")})
    check_aligned(*t, arg);
  p.o = strides_of(out), p.d_o = strides_of(grad_out);
  p.dq = strides_of(dq), p.dk = strides_of(dk), p.dv = strides_of(dv);
  SdpaPointers ptrs = pointers_of(q, k, v, p, std::nullopt, std::nullopt, std::nullopt);
  ptrs.o = out.data_ptr(), ptrs.stats = stats.data_ptr(), ptrs.d_o = grad_out.data_ptr();
  ptrs.dq = dq.data_ptr(), ptrs.dk = dk.data_ptr(), ptrs.dv = dv.data_ptr();
  at::Tensor fresh = amax_scratch(q, 4);
  f.amax_dp = fresh.data_ptr<float>(), f.amax_dq = f.amax_dp + kAmaxStride, f.amax_dk = f.amax_dp + 2 * kAmaxStride;
  f.amax_dv = f.amax_dp + 3 * kAmaxStride;
  ptrs.fp8 = f;
  run(p, ptrs, q, "fused_attn_fp8_bwd");
  accumulate_amaxes(fresh, {&amax_dp, &amax_dq, &amax_dk, &amax_dv});
  return {dq, dk, dv};
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("fused_attn_fwd", &tfp8::fused_attn_fwd);
  m.impl("fused_attn_bwd", &tfp8::fused_attn_bwd);
  m.impl("fused_attn_fp8_fwd", &tfp8::fused_attn_fp8_fwd);
  m.impl("fused_attn_fp8_bwd", &tfp8::fused_attn_fp8_bwd);
}
