// LayerNorm / RMSNorm forward, optionally with FP8 output and amax (contract in norm.h).
// Statistics are two-pass in float32 (over the row held in registers, or re-read from memory on the general path):
// the mean, then the mean of squared deviations (RMSNorm: the mean of squares). A one-reduction merge of per-thread
// (count, mean, m2) was measured slower on H100 (the merge's divisions sit on the row's critical path).
// y is computed as ((x - mean) * rstd) * gamma' + beta without fused multiply-adds, in the CPU reference's order, so
// FP8 bytes match it except where mean / rstd differ in a last bit.
#include "norm.h"
#include "norm_common.cuh"

namespace tfp8 {
namespace {

using namespace norm;

constexpr int kFwdVecsPerThread = 4;  // bf16: a 1024-thread row covers 32768 columns

constexpr bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// kOut: kE4M3 or kE5M2 for an FP8 output, else the input's own DType.
template <typename T, typename W, DType kOut>
struct FwdIo {
  static constexpr bool kFp8 = is_fp8(kOut);
  using Out = std::conditional_t<kFp8, uint8_t, T>;

  // y of one element: ((x - mean) * rstd) * (gamma + offset) [+ beta]; amax updated; returns the output element.
  static __device__ __forceinline__ Out normalize(float x, float mean, float rstd, float gamma, float beta,
                                                  bool has_beta, float offset, float scale, float& amax) {
    float y = __fmul_rn(__fmul_rn(x - mean, rstd), __fadd_rn(gamma, offset));
    if (has_beta) y = __fadd_rn(y, beta);
    amax = max_nonneg(amax, fabsf(y));
    if constexpr (kFp8) return float_to_fp8<kOut>(__fmul_rn(y, scale));
    else return from_float<T>(y);
  }
};

// After the rows: amax of the CTA into *amax, and scale_inv = 1 / scale from one thread.
template <bool kFp8>
__device__ __forceinline__ void finish_fwd(const NormFwdParams& p, float scale, float amax) {
  if (p.amax != nullptr && p.rows > 0) block_amax_atomic(amax, p.amax);
  if (kFp8 && p.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    *p.scale_inv = 1.f / scale;
}

template <typename T, typename W, DType kOut, bool kLayerNorm, int kVecs>
__global__ void __launch_bounds__(1024) norm_fwd_registers(NormFwdParams p) {
  constexpr int kVec = vec_elems<T>();
  using Io = FwdIo<T, W, kOut>;
  __shared__ float partials[kMaxRowsPerCta][32];
  const T* input = static_cast<const T*>(p.input);
  const W* weight = static_cast<const W*>(p.weight);
  const W* bias = static_cast<const W*>(p.bias);
  auto* out = static_cast<typename Io::Out*>(p.out);
  const float scale = Io::kFp8 ? *p.scale : 1.f;
  const float cols_f = static_cast<float>(p.cols);
  float amax = 0.f;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < p.rows;
       base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t row = base + threadIdx.y;
    const bool valid_row = row < p.rows;
    const T* x_row = input + row * p.cols;
    Vec<T, kVec> x[kVecs];  // kept in the input's type: half the registers of float for 16-bit inputs
    bool in_row[kVecs];
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int col = (v * blockDim.x + threadIdx.x) * kVec;  // a row here has at most 1024 * kVecs * kVec columns
      in_row[v] = valid_row && col < p.cols;
      if (in_row[v]) {
        x[v] = *reinterpret_cast<const Vec<T, kVec>*>(x_row + col);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) x[v].v[i] = from_float<T>(0.f);
      }
    }

    float mean = 0.f;  // RMSNorm: 0, so the squared deviations below are the squares
    if constexpr (kLayerNorm) {
      float sum = 0.f;  // the zeros outside the row add nothing
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int i = 0; i < kVec; ++i) sum += to_float<T>(x[v].v[i]);
      mean = row_reduce(sum, partials) / cols_f;
    }
    float sq = 0.f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (!in_row[v]) continue;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float d = to_float<T>(x[v].v[i]) - mean;
        sq += d * d;
      }
    }
    const float rstd = 1.f / sqrtf(row_reduce(sq, partials) / cols_f + p.eps);
    if (valid_row && threadIdx.x == 0) {
      if constexpr (kLayerNorm) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }

#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (!in_row[v]) continue;
      const int col = (v * blockDim.x + threadIdx.x) * kVec;
      float gamma[kVec], beta[kVec] = {};
      load_floats(weight + col, gamma);
      if (bias != nullptr) load_floats(bias + col, beta);
      Vec<typename Io::Out, kVec> y;
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        y.v[i] = Io::normalize(to_float<T>(x[v].v[i]), mean, rstd, gamma[i], beta[i], bias != nullptr, p.gamma_offset,
                               scale, amax);
      *reinterpret_cast<Vec<typename Io::Out, kVec>*>(out + row * p.cols + col) = y;
    }
  }
  finish_fwd<Io::kFp8>(p, scale, amax);
}

// Any cols, any alignment: one row per CTA, three passes over the row (the re-reads mostly hit L1/L2).
template <typename T, typename W, DType kOut, bool kLayerNorm>
__global__ void __launch_bounds__(kGeneralThreads) norm_fwd_general(NormFwdParams p) {
  using Io = FwdIo<T, W, kOut>;
  __shared__ float partials[kMaxRowsPerCta][32];
  const W* weight = static_cast<const W*>(p.weight);
  const W* bias = static_cast<const W*>(p.bias);
  const float scale = Io::kFp8 ? *p.scale : 1.f;
  const float cols_f = static_cast<float>(p.cols);
  float amax = 0.f;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.input) + row * p.cols;
    auto* out = static_cast<typename Io::Out*>(p.out) + row * p.cols;
    float mean = 0.f;
    if constexpr (kLayerNorm) {
      float sum = 0.f;
      for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) sum += to_float<T>(x[c]);
      mean = row_reduce(sum, partials) / cols_f;
    }
    float sq = 0.f;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float d = to_float<T>(x[c]) - mean;
      sq += d * d;
    }
    const float rstd = 1.f / sqrtf(row_reduce(sq, partials) / cols_f + p.eps);
    if (threadIdx.x == 0) {
      if constexpr (kLayerNorm) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float beta = bias != nullptr ? to_float<W>(bias[c]) : 0.f;
      out[c] = Io::normalize(to_float<T>(x[c]), mean, rstd, to_float<W>(weight[c]), beta, bias != nullptr,
                             p.gamma_offset, scale, amax);
    }
  }
  finish_fwd<Io::kFp8>(p, scale, amax);
}

template <typename T, typename W, DType kOut, bool kLayerNorm>
void launch_typed(const NormFwdParams& p, cudaStream_t stream) {
  const bool aligned = aligned16(p.input) && aligned16(p.weight) && aligned16(p.bias) && aligned16(p.out);
  const RowLaunch plan = plan_rows(p.rows, p.cols, vec_elems<T>(), kFwdVecsPerThread, 1024, aligned);
  if (plan.registers) {
    auto kernel = norm_fwd_registers<T, W, kOut, kLayerNorm, kFwdVecsPerThread>;
    kernel<<<persistent_grid(kernel, plan.block, plan.row_groups), plan.block, 0, stream>>>(p);
  } else {
    auto kernel = norm_fwd_general<T, W, kOut, kLayerNorm>;
    kernel<<<persistent_grid(kernel, plan.block, plan.row_groups), plan.block, 0, stream>>>(p);
  }
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_norm_fwd(const NormFwdParams& p, cudaStream_t stream) {
  dispatch_input_weight(p.input_dtype, p.weight_dtype, [&](auto t, auto w) {
    using T = typename decltype(t)::type;
    using W = typename decltype(w)::type;
    auto with_out = [&](auto out) {
      constexpr DType kOut = decltype(out)::value;
      if (p.layernorm) launch_typed<T, W, kOut, true>(p, stream);
      else launch_typed<T, W, kOut, false>(p, stream);
    };
    if (p.out_dtype == DType::kE4M3) with_out(std::integral_constant<DType, DType::kE4M3>{});
    else if (p.out_dtype == DType::kE5M2) with_out(std::integral_constant<DType, DType::kE5M2>{});
    else if (p.out_dtype == p.input_dtype) with_out(std::integral_constant<DType, dtype_of<T>()>{});
    else throw std::invalid_argument("norm: out dtype must be FP8 or the input's");
  });
}

}  // namespace tfp8
