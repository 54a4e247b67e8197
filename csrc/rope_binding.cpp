// CUDA kernels of the rope family for torch: argument checks, output allocation, launch on the current stream.
// Contracts: csrc/ops.cpp; kernel: csrc/rope.cu.
#include <torch/library.h>

#include <string>
#include <utility>

#include "common.h"
#include "rope.h"

namespace tfp8 {
namespace {

bool seq_first(const std::string& qkv_format) {
  TORCH_CHECK(qkv_format == "sbhd" || qkv_format == "bshd", "qkv_format: expected 'sbhd' or 'bshd', got '", qkv_format,
              "'");
  return qkv_format == "sbhd";
}

// Stride of dim i, or 0 for a dim of size 1 (its stride is never used, and may be anything).
int64_t used_stride(const at::Tensor& t, int64_t i) { return t.size(i) == 1 ? 0 : t.stride(i); }

// Checks x and freqs as the ops' contract says -> (s, b) of x.
std::pair<int64_t, int64_t> check_rope_inputs(const at::Tensor& x, const at::Tensor& freqs, bool sbhd,
                                              const std::string& qkv_format, const char* arg) {
  check_cuda(x, arg);
  check_high_precision(x, arg);
  TORCH_CHECK(x.dim() == 4, arg, ": expected a 4-D tensor [", sbhd ? "s, b" : "b, s", ", h, d] for qkv_format '",
              qkv_format, "', got shape ", dims(x.sizes()));
  TORCH_CHECK(x.size(3) <= 1 || x.stride(3) == 1, arg, ": expected a contiguous last dim, got strides ",
              dims(x.strides()));
  check_same_device(freqs, x, "freqs");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat, "freqs: expected a float32 tensor, got ", freqs.scalar_type());
  const int64_t s = x.size(sbhd ? 0 : 1), b = x.size(sbhd ? 1 : 0), d = x.size(3);
  const std::string expected = "[>= " + num(s) + ", 1 or " + num(b) +
                               ", 1, rot_dim] with rot_dim even and 2 <= rot_dim <= d = " + num(d);
  TORCH_CHECK(freqs.dim() == 4, "freqs: expected ", expected, ", got shape ", dims(freqs.sizes()));
  const int64_t rot_dim = freqs.size(3);
  TORCH_CHECK(freqs.size(0) >= s && (freqs.size(1) == 1 || freqs.size(1) == b) && freqs.size(2) == 1 &&
                  rot_dim % 2 == 0 && rot_dim >= 2 && rot_dim <= d,
              "freqs: expected ", expected, ", got shape ", dims(freqs.sizes()));
  TORCH_CHECK(freqs.stride(3) == 1, "freqs: expected a contiguous last dim, got strides ", dims(freqs.strides()));
  return {s, b};
}

// out: x's shape and dtype, on x's device, last dim contiguous; x itself (same strides) or of another storage.
void check_rope_out(const at::Tensor& out, const at::Tensor& x, const char* arg) {
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out: expected ", x.scalar_type(), " (", arg, "'s dtype), got ",
              out.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes(), "out: expected shape ", dims(x.sizes()), " (", arg, "'s), got ",
              dims(out.sizes()));
  check_same_device(out, x, "out");
  TORCH_CHECK(out.size(3) <= 1 || out.stride(3) == 1, "out: expected a contiguous last dim, got strides ",
              dims(out.strides()));
  const bool same = out.data_ptr() == x.data_ptr() && out.strides() == x.strides();
  TORCH_CHECK(same || !out.is_alias_of(x), "out: expected ", arg,
              " itself (the same view: in place) or a tensor of another storage");
}

void rope_into(const at::Tensor& x, const at::Tensor& freqs, const std::string& qkv_format, bool interleaved,
               bool inverse, const at::Tensor& out, const char* arg) {
  const bool sbhd = seq_first(qkv_format);
  const auto [s, b] = check_rope_inputs(x, freqs, sbhd, qkv_format, arg);
  check_rope_out(out, x, arg);
  c10::cuda::CUDAGuard guard(x.device());
  RopeArgs args{x.data_ptr(),
                out.data_ptr(),
                freqs.data_ptr<float>(),
                s,
                b,
                x.size(2),
                x.size(3),
                freqs.size(3),
                used_stride(x, sbhd ? 0 : 1),
                used_stride(x, sbhd ? 1 : 0),
                used_stride(x, 2),
                used_stride(out, sbhd ? 0 : 1),
                used_stride(out, sbhd ? 1 : 0),
                used_stride(out, 2),
                used_stride(freqs, 0),
                used_stride(freqs, 1),
                sbhd,
                interleaved};
  launch_rope(args, to_dtype(x.scalar_type(), arg), inverse, current_stream());
}

at::Tensor rope_fwd(const at::Tensor& t, const at::Tensor& freqs, const std::string& qkv_format, bool interleaved) {
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  rope_into(t, freqs, qkv_format, interleaved, /*inverse=*/false, out, "t");
  return out;
}

at::Tensor rope_bwd(const at::Tensor& grad_out, const at::Tensor& freqs, const std::string& qkv_format,
                    bool interleaved) {
  at::Tensor out = at::empty(grad_out.sizes(), grad_out.options().memory_format(at::MemoryFormat::Contiguous));
  rope_into(grad_out, freqs, qkv_format, interleaved, /*inverse=*/true, out, "grad_out");
  return out;
}

void rope_fwd_into(const at::Tensor& t, const at::Tensor& freqs, const std::string& qkv_format, bool interleaved,
                   const at::Tensor& out) {
  rope_into(t, freqs, qkv_format, interleaved, /*inverse=*/false, out, "t");
}

void rope_bwd_into(const at::Tensor& grad_out, const at::Tensor& freqs, const std::string& qkv_format, bool interleaved,
                   const at::Tensor& out) {
  rope_into(grad_out, freqs, qkv_format, interleaved, /*inverse=*/true, out, "grad_out");
}

}  // namespace
}  // namespace tfp8

TORCH_LIBRARY_IMPL(transformer_fp8, CUDA, m) {
  m.impl("rope_fwd", &tfp8::rope_fwd);
  m.impl("rope_bwd", &tfp8::rope_bwd);
  m.impl("rope_fwd_into", &tfp8::rope_fwd_into);
  m.impl("rope_bwd_into", &tfp8::rope_bwd_into);
}
