// LayerNorm / RMSNorm backward (contract in norm.h).
// Per row: xhat = (x - mean) * rstd, g = dy * gamma', two row sums (of g and of g * xhat), then dx. The column sums
// dgamma = sum dy * xhat and dbeta = sum dy are accumulated per thread over the rows its CTA handles, written as one
// float32 partial row per CTA into the workspace [parts, grid, cols], then reduced over CTAs in a fixed order.
#include "norm.h"
#include "norm_common.cuh"

namespace tfp8 {
namespace {

using namespace norm;

// Registers path: one vector a thread and up to 1024 threads a row (64 registers a thread), or four vectors a thread
// and up to 512 threads a row (128 registers). bf16 rows up to 8192 columns take the first, up to 16384 the second.
template <int kVecs>
constexpr int bwd_max_threads_per_row() {
  return kVecs == 1 ? 1024 : 512;
}
constexpr int kBwdWideVecs = 4;
constexpr int kReduceRows = 16;  // reduce kernel: blockDim = (32 columns, kReduceRows partial rows)

// Per-element backward terms of one row.
struct RowTerms {
  float mean, rstd, offset;
  __device__ __forceinline__ float xhat(float x) const { return (x - mean) * rstd; }
  __device__ __forceinline__ float g(float dy, float gamma) const { return dy * (gamma + offset); }
};

// dx = rstd * ((g - xhat * mean(g * xhat)) - mean(g)); sums = (sum g, sum g * xhat), the first unused for RMSNorm.
template <bool kLayerNorm>
__device__ __forceinline__ float dx_of(float g, float xhat, float2 sums, float cols, float rstd) {
  float d = g - xhat * (sums.y / cols);
  if constexpr (kLayerNorm) d -= sums.x / cols;
  return d * rstd;
}

template <bool kLayerNorm>
__device__ __forceinline__ RowTerms row_terms(const NormBwdParams& p, int64_t row, bool valid) {
  return {kLayerNorm && valid ? p.mean[row] : 0.f, valid ? p.rstd[row] : 0.f, p.gamma_offset};
}

template <typename T, typename W, bool kLayerNorm, int kVecs>
__global__ void __launch_bounds__(bwd_max_threads_per_row<kVecs>())
    norm_bwd_registers(NormBwdParams p, float* partial_dgamma, float* partial_dbeta) {
  constexpr int kVec = vec_elems<T>();
  __shared__ float2 partials[kMaxRowsPerCta][32];
  __shared__ float column_sums[bwd_max_threads_per_row<kVecs>() * kVec];  // >= blockDim.x * blockDim.y * kVec
  const W* weight = static_cast<const W*>(p.weight);
  const float cols_f = static_cast<float>(p.cols);
  float dgamma[kVecs][kVec] = {}, dbeta[kVecs][kVec] = {};

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < p.rows;
       base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t row = base + threadIdx.y;
    const bool valid_row = row < p.rows;
    const RowTerms terms = row_terms<kLayerNorm>(p, row, valid_row);
    Vec<T, kVec> x[kVecs], dy[kVecs];  // the row, kept in the input's type
    bool in_row[kVecs];
    float2 sums = make_float2(0.f, 0.f);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kVec;
      in_row[v] = valid_row && col < p.cols;
      if (!in_row[v]) continue;
      x[v] = *reinterpret_cast<const Vec<T, kVec>*>(static_cast<const T*>(p.input) + row * p.cols + col);
      dy[v] = *reinterpret_cast<const Vec<T, kVec>*>(static_cast<const T*>(p.grad_out) + row * p.cols + col);
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (!in_row[v]) continue;
      float gamma[kVec];
      load_floats(weight + (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kVec, gamma);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float xhat = terms.xhat(to_float<T>(x[v].v[i])), d = to_float<T>(dy[v].v[i]);
        const float g = terms.g(d, gamma[i]);
        sums = sums + make_float2(g, g * xhat);
        dgamma[v][i] += d * xhat;
        dbeta[v][i] += d;
      }
    }
    sums = row_reduce(sums, partials);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (!in_row[v]) continue;
      const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kVec;
      float gamma[kVec];
      load_floats(weight + col, gamma);
      Vec<T, kVec> dx, add;
      if (p.dx_add != nullptr)
        add = *reinterpret_cast<const Vec<T, kVec>*>(static_cast<const T*>(p.dx_add) + row * p.cols + col);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float xhat = terms.xhat(to_float<T>(x[v].v[i])), g = terms.g(to_float<T>(dy[v].v[i]), gamma[i]);
        const float extra = p.dx_add != nullptr ? to_float<T>(add.v[i]) : 0.f;
        dx.v[i] = from_float<T>(dx_of<kLayerNorm>(g, xhat, sums, cols_f, terms.rstd) + extra);
      }
      *reinterpret_cast<Vec<T, kVec>*>(static_cast<T*>(p.dx) + row * p.cols + col) = dx;
    }
  }

  // The CTA's column sums: add the rows of the CTA (threadIdx.y) in order through shared memory, write one partial row.
  const int chunk = blockDim.x * kVec, cta_threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int part = 0; part < (kLayerNorm ? 2 : 1); ++part) {
    float* out = (part == 0 ? partial_dgamma : partial_dbeta) + static_cast<int64_t>(blockIdx.x) * p.cols;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        column_sums[threadIdx.y * chunk + threadIdx.x * kVec + i] = part == 0 ? dgamma[v][i] : dbeta[v][i];
      __syncthreads();
      for (int j = tid; j < chunk; j += cta_threads) {
        const int64_t col = static_cast<int64_t>(v) * chunk + j;
        if (col >= p.cols) break;
        float total = 0.f;
        for (int y = 0; y < static_cast<int>(blockDim.y); ++y) total += column_sums[y * chunk + j];
        out[col] = total;
      }
      __syncthreads();
    }
  }
}

// Any cols, any alignment: one row per CTA, two passes over the row. Each thread owns the columns
// c = threadIdx.x + k * blockDim.x of the CTA's partial rows and accumulates into them in global memory.
template <typename T, typename W, bool kLayerNorm>
__global__ void __launch_bounds__(kGeneralThreads)
    norm_bwd_general(NormBwdParams p, float* partial_dgamma, float* partial_dbeta) {
  __shared__ float2 partials[kMaxRowsPerCta][32];
  const W* weight = static_cast<const W*>(p.weight);
  const float cols_f = static_cast<float>(p.cols);
  float* dgamma = partial_dgamma + static_cast<int64_t>(blockIdx.x) * p.cols;
  float* dbeta = kLayerNorm ? partial_dbeta + static_cast<int64_t>(blockIdx.x) * p.cols : nullptr;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    dgamma[c] = 0.f;
    if constexpr (kLayerNorm) dbeta[c] = 0.f;
  }

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const RowTerms terms = row_terms<kLayerNorm>(p, row, true);
    const T* x = static_cast<const T*>(p.input) + row * p.cols;
    const T* dy = static_cast<const T*>(p.grad_out) + row * p.cols;
    float2 sums = make_float2(0.f, 0.f);
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float xhat = terms.xhat(to_float<T>(x[c])), g = terms.g(to_float<T>(dy[c]), to_float<W>(weight[c]));
      sums = sums + make_float2(g, g * xhat);
    }
    sums = row_reduce(sums, partials);
    T* dx = static_cast<T*>(p.dx) + row * p.cols;
    const T* add = p.dx_add != nullptr ? static_cast<const T*>(p.dx_add) + row * p.cols : nullptr;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float xhat = terms.xhat(to_float<T>(x[c])), d = to_float<T>(dy[c]);
      const float extra = add != nullptr ? to_float<T>(add[c]) : 0.f;
      dx[c] = from_float<T>(dx_of<kLayerNorm>(terms.g(d, to_float<W>(weight[c])), xhat, sums, cols_f, terms.rstd) +
                            extra);
      dgamma[c] += d * xhat;
      if constexpr (kLayerNorm) dbeta[c] += d;
    }
  }
}

// out_part[c] = sum over the partial rows p of partials[part][p][c], in a fixed order; part = blockIdx.y
// (0: dgamma, 1: dbeta).
template <typename W>
__global__ void __launch_bounds__(32 * kReduceRows)
    reduce_partials(const float* partials, int64_t num_partials, int64_t cols, W* dgamma, W* dbeta) {
  __shared__ float sums[kReduceRows][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const float* src = partials + blockIdx.y * num_partials * cols;
  float sum = 0.f;
  if (col < cols)
    for (int64_t r = threadIdx.y; r < num_partials; r += kReduceRows) sum += src[r * cols + col];
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
    for (int r = 0; r < kReduceRows; ++r) total += sums[r][threadIdx.x];
    (blockIdx.y == 0 ? dgamma : dbeta)[col] = from_float<W>(total);
  }
}

// The kernel a shape takes and its grid; the workspace holds (LayerNorm ? 2 : 1) * grid partial rows of cols floats.
struct BwdPlan {
  void (*kernel)(NormBwdParams, float*, float*);
  dim3 block;
  int grid;
};

template <typename T, typename W, bool kLayerNorm>
BwdPlan plan_typed(const NormBwdParams& p) {
  const bool aligned = aligned16(p.input) && aligned16(p.grad_out) && aligned16(p.weight) && aligned16(p.dx) &&
                       (p.dx_add == nullptr || aligned16(p.dx_add));
  RowLaunch plan = plan_rows(p.rows, p.cols, vec_elems<T>(), 1, bwd_max_threads_per_row<1>(), aligned);
  BwdPlan out{norm_bwd_registers<T, W, kLayerNorm, 1>, plan.block, 0};
  if (!plan.registers) {
    plan = plan_rows(p.rows, p.cols, vec_elems<T>(), kBwdWideVecs, bwd_max_threads_per_row<kBwdWideVecs>(), aligned);
    out.kernel = plan.registers ? norm_bwd_registers<T, W, kLayerNorm, kBwdWideVecs>
                                : norm_bwd_general<T, W, kLayerNorm>;
  }
  out.block = plan.block;
  // The general path's partial rows are as long as its (long or odd) rows: one CTA a multiprocessor keeps them few.
  out.grid = persistent_grid(out.kernel, out.block, plan.row_groups, plan.registers ? 32 : 1);
  return out;
}

template <typename F>
void dispatch_bwd(const NormBwdParams& p, F&& f) {
  dispatch_input_weight(p.input_dtype, p.weight_dtype, [&](auto t, auto w) {
    using T = typename decltype(t)::type;
    using W = typename decltype(w)::type;
    if (p.layernorm) f(plan_typed<T, W, true>(p), w);
    else f(plan_typed<T, W, false>(p), w);
  });
}

}  // namespace

int64_t norm_bwd_workspace_size(const NormBwdParams& p) {
  int64_t size = 0;
  dispatch_bwd(p, [&](const BwdPlan& plan, auto) { size = (p.layernorm ? 2 : 1) * plan.grid * p.cols; });
  return size;
}

void launch_norm_bwd(const NormBwdParams& p, float* workspace, cudaStream_t stream) {
  dispatch_bwd(p, [&](const BwdPlan& plan, auto w) {
    using W = typename decltype(w)::type;
    float* partial_dbeta = workspace + static_cast<int64_t>(plan.grid) * p.cols;
    plan.kernel<<<plan.grid, plan.block, 0, stream>>>(p, workspace, partial_dbeta);
    TFP8_CUDA_CHECK(cudaGetLastError());
    const dim3 grid(static_cast<unsigned>((p.cols + 31) / 32), p.layernorm ? 2 : 1);
    reduce_partials<W><<<grid, dim3(32, kReduceRows), 0, stream>>>(workspace, plan.grid, p.cols,
                                                                   static_cast<W*>(p.dgamma), static_cast<W*>(p.dbeta));
    TFP8_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace tfp8
