// activation_fwd / activation_bwd: elementwise kernels, VEC elements per thread and step with 16-byte input accesses,
// a grid-stride loop over a grid that fills the GPU. activation_fwd_keep_input also writes the input's kept E4M3 copy
// (1 x 128 tiles, see keep_tile) for the backward, in the same pass.
// GELU / ReLU index input and output alike. SwiGLU output element i = row * F + c reads gate at row * 2F + c and up at
// row * 2F + F + c (F = out_cols), i.e. at i + row * F and i + row * F + F; its backward writes dgate and dup there.
#include <algorithm>
#include <cstdlib>

#include "activation_common.cuh"

namespace tfp8 {
namespace {

using act::StorageT;
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
// Chunks per thread whose loads are in flight together (activation_fwd_kernel), and the blocks per SM its register
// budget aims at (64 registers a thread): the fastest of the variants timed for SwiGLU, with and without the kept
// input (1 to 8 chunks, 1 to 4 blocks; benchmarks/RESULTS.md, session 5, "SwiGLU FP8 kernels").
constexpr int kBatch = 2;
constexpr int kMinBlocks = 4;

// Offset of the gate element of output element i in a SwiGLU input (i and out_cols as above). The row index takes a
// 32-bit division where the whole output fits (a 64-bit one is a long software sequence), n being uniform.
__device__ __forceinline__ int64_t swiglu_gate_offset(int64_t i, int64_t out_cols, int64_t n) {
  const int64_t row = n <= INT32_MAX ? static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(out_cols))
                                     : i / out_cols;
  return i + row * out_cols;
}

// The kept copy of the input (KEEP): each input row cut into 1 x kKeepTile tiles, each tile saturate(value * 448 /
// amax_tile) in E4M3 with scale_inv = amax_tile / 448 (1 for an all-zero tile). A half-warp's 16 lanes hold one
// tile's kKeepTile outputs (VEC = 8); a SwiGLU output tile reads one gate tile and one up tile of its input row.
constexpr float kE4M3Max = 448.0f;

// Writes one thread's VEC input values of a tile into the kept copy: the tile's amax over the half-warp (mask: the
// lanes of this half, all of which run this call), then the bytes and (lane 0 of the half) the tile's scale_inv.
template <int VEC>
__device__ __forceinline__ void keep_tile(const float (&values)[VEC], uint8_t* dst, float* tile_scale_inv) {
  const unsigned half_mask = (threadIdx.x % 32) < 16 ? 0x0000ffffu : 0xffff0000u;
  float tile_amax = 0.0f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) tile_amax = act::max_abs(tile_amax, values[k]);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2)
    tile_amax = act::max_abs(tile_amax, __shfl_xor_sync(half_mask, tile_amax, offset));
  const float scale = tile_amax > 0.0f ? kE4M3Max / tile_amax : 1.0f;
  act::Vec<uint8_t, VEC> bytes;
  act::encode_fp8<DType::kE4M3>(values, scale, bytes);
  *reinterpret_cast<act::Vec<uint8_t, VEC>*>(dst) = bytes;
  if (threadIdx.x % 16 == 0) *tile_scale_inv = 1.0f / scale;
}

// VEC outputs per thread and chunk; a last partial vector (GELU / ReLU only) is handled element by element. Each
// step of the grid-stride loop takes kBatch chunks, one grid stride apart, and issues all their loads before the
// math: the bytes a thread has in flight, not the arithmetic, bound these kernels.
// KEEP (VEC == 8, out_cols % kKeepTile == 0, n % kKeepTile == 0: whole tiles per half-warp, and a chunk's validity is
// the same for the 16 lanes of a tile) also writes the kept copy of the input: x8 [rows, in_cols] and x8_scale_inv
// [rows, in_cols / kKeepTile].
template <Activation A, DType IN, DType OUT, int VEC, bool KEEP>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    activation_fwd_kernel(const StorageT<IN>* __restrict__ x, StorageT<OUT>* __restrict__ y, int64_t n,
                          int64_t out_cols, const float* __restrict__ scale_ptr, float* amax, float* scale_inv,
                          uint8_t* __restrict__ x8, float* __restrict__ x8_scale_inv) {
  using TI = StorageT<IN>;
  constexpr bool kSwiglu = A == Activation::kSwiglu;
  const float scale = act::is_fp8(OUT) ? *scale_ptr : 1.0f;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  float local_amax = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * VEC;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC; base < n;
       base += kBatch * stride) {
    // (first / second operand: SwiGLU's gate / up, else the input / unused)
    act::Vec<TI, VEC> first[kBatch], second[kBatch];
    int64_t first_at[kBatch];
    int count[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t i = base + b * stride;
      count[b] = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(VEC), n - i)));
      first_at[b] = kSwiglu ? swiglu_gate_offset(i, out_cols, n) : i;
      if (count[b] > 0) {
        act::load_vector(x + first_at[b], first[b], count[b]);
        if constexpr (kSwiglu) act::load_vector(x + first_at[b] + out_cols, second[b], count[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (count[b] == 0) continue;
      float in[VEC], out[VEC];
      act::to_floats(first[b], in);
      if constexpr (kSwiglu) {
        float up[VEC];
        act::to_floats(second[b], up);
#pragma unroll
        for (int k = 0; k < VEC; ++k) out[k] = act::swiglu_forward<IN != DType::kFloat32>(in[k], up[k]);
        if constexpr (KEEP) {
          keep_tile(in, x8 + first_at[b], x8_scale_inv + first_at[b] / kKeepTile);
          keep_tile(up, x8 + first_at[b] + out_cols, x8_scale_inv + (first_at[b] + out_cols) / kKeepTile);
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) out[k] = act::forward<A>(in[k]);
        if constexpr (KEEP) keep_tile(in, x8 + first_at[b], x8_scale_inv + first_at[b] / kKeepTile);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) local_amax = k < count[b] ? act::max_abs(local_amax, out[k]) : local_amax;
      act::store_floats<OUT>(y + base + b * stride, out, scale, count[b]);
    }
  }
  if (amax != nullptr) block_amax_atomic(local_amax, amax);
}

template <Activation A, DType D, int VEC>
__global__ void __launch_bounds__(kThreads)
    activation_bwd_kernel(const StorageT<D>* __restrict__ dy, const StorageT<D>* __restrict__ x,
                          StorageT<D>* __restrict__ dx, int64_t n, int64_t out_cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC; i < n; i += stride) {
    const int count = static_cast<int>(min(static_cast<int64_t>(VEC), n - i));
    float grad[VEC];
    act::load_floats(dy + i, grad, count);
    if constexpr (A == Activation::kSwiglu) {
      const int64_t gate_at = swiglu_gate_offset(i, out_cols, n);
      float gate[VEC], up[VEC], dgate[VEC], dup[VEC];
      act::load_floats(x + gate_at, gate, count);
      act::load_floats(x + gate_at + out_cols, up, count);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        act::swiglu_backward<D != DType::kFloat32>(grad[k], gate[k], up[k], dgate[k], dup[k]);
      act::store_floats<D>(dx + gate_at, dgate, 1.0f, count);
      act::store_floats<D>(dx + gate_at + out_cols, dup, 1.0f, count);
    } else {
      float in[VEC], out[VEC];
      act::load_floats(x + i, in, count);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = act::backward<A>(grad[k], in[k]);
      act::store_floats<D>(dx + i, out, 1.0f, count);
    }
  }
}

// Elements per vector: one 16-byte access of T.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// SwiGLU vectors must not straddle a row (gate and up are out_cols apart); GELU / ReLU read flat memory.
bool rows_hold_whole_vectors(Activation act, int64_t out_cols, int vec) {
  return act != Activation::kSwiglu || out_cols % vec == 0;
}

// TFP8_ACTIVATION_FLAT set (read once): the high-precision forward keeps the flat kernel instead of
// activation_rows.cu's (a before/after switch for benchmarks).
bool rows_kernels_enabled() {
  static const bool enabled = std::getenv("TFP8_ACTIVATION_FLAT") == nullptr;
  return enabled;
}

int64_t grid_size(int64_t n, int vec) {
  const int64_t needed = (n + static_cast<int64_t>(kThreads) * vec - 1) / (static_cast<int64_t>(kThreads) * vec);
  return std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(act::sm_count()) * kBlocksPerSm));
}

// Blocks of kKernel that one SM holds at once (its registers decide; read once per kernel).
template <auto kKernel>
int resident_blocks_per_sm() {
  static const int blocks = [] {
    int count = 0;
    TFP8_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kKernel, kThreads, 0));
    return std::max(1, count);
  }();
  return blocks;
}

// Grid of a grid-stride kernel: one block per VEC * kThreads elements, at most as many as the GPU holds at once (a
// second wave would only wait for the first).
template <auto kKernel>
unsigned resident_grid_size(int64_t n, int vec) {
  const int64_t needed = (n + static_cast<int64_t>(kThreads) * vec - 1) / (static_cast<int64_t>(kThreads) * vec);
  const int64_t resident = static_cast<int64_t>(act::sm_count()) * resident_blocks_per_sm<kKernel>();
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, resident)));
}

// activation_fwd_kernel<A, IN, OUT, VEC, KEEP> on the grid the GPU holds at once.
template <Activation A, DType IN, DType OUT, int VEC, bool KEEP>
void launch_fwd_kernel(const StorageT<IN>* x, StorageT<OUT>* y, int64_t n, int64_t out_cols, const float* scale,
                       float* amax, float* scale_inv, uint8_t* x8, float* x8_scale_inv, cudaStream_t stream) {
  constexpr auto kKernel = activation_fwd_kernel<A, IN, OUT, VEC, KEEP>;
  kKernel<<<resident_grid_size<kKernel>(n, VEC), kThreads, 0, stream>>>(x, y, n, out_cols, scale, amax, scale_inv, x8,
                                                                        x8_scale_inv);
}

}  // namespace

void launch_activation_fwd(const void* x, DType in_dtype, void* y, DType out_dtype, int64_t out_elems, int64_t out_cols,
                           Activation act, const float* scale, float* amax, float* scale_inv, cudaStream_t stream) {
  if (out_dtype == in_dtype && amax == nullptr && scale_inv == nullptr && out_cols >= kRowsKernelMinCols &&
      rows_kernels_enabled()) {
    launch_activation_rows_fwd(x, y, in_dtype, out_elems / out_cols, out_cols, act, stream);
    return;
  }
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(in_dtype, [&](auto in) {
      constexpr Activation A = decltype(a)::value;
      constexpr DType IN = decltype(in)::value;
      using TI = StorageT<IN>;
      auto launch = [&](auto out) {
        constexpr DType OUT = decltype(out)::value;
        using TO = StorageT<OUT>;
        const auto* xp = static_cast<const TI*>(x);
        auto* yp = static_cast<TO*>(y);
        if (rows_hold_whole_vectors(act, out_cols, kVec<TI>) && act::aligned(x, 16) &&
            act::aligned(y, kVec<TI> * sizeof(TO))) {
          launch_fwd_kernel<A, IN, OUT, kVec<TI>, false>(xp, yp, out_elems, out_cols, scale, amax, scale_inv, nullptr,
                                                         nullptr, stream);
        } else {
          launch_fwd_kernel<A, IN, OUT, 1, false>(xp, yp, out_elems, out_cols, scale, amax, scale_inv, nullptr, nullptr,
                                                  stream);
        }
      };
      if (out_dtype == in_dtype) launch(in);
      else act::with_fp8(out_dtype, launch);
    });
  });
  TFP8_CUDA_CHECK(cudaGetLastError());
}

bool activation_fwd_can_keep_input(DType in_dtype, int64_t out_elems, int64_t out_cols) {
  // (a float32 input has VEC = 4: a half-warp would not hold a whole tile)
  return (in_dtype == DType::kBFloat16 || in_dtype == DType::kFloat16) && out_cols % kKeepTile == 0 &&
         out_elems % kKeepTile == 0;
}

void launch_activation_fwd_keep_input(const void* x, DType in_dtype, uint8_t* y, DType out_dtype, int64_t out_elems,
                                      int64_t out_cols, Activation act, const float* scale, float* amax,
                                      float* scale_inv, uint8_t* x8, float* x8_scale_inv, cudaStream_t stream) {
  if (!activation_fwd_can_keep_input(in_dtype, out_elems, out_cols) || !act::aligned(x, 16) || !act::aligned(x8, 8) ||
      !act::aligned(y, 8))
    throw std::invalid_argument("activation_fwd_keep_input: needs a 16-bit input whose output rows are whole "
                                "128-element tiles, 16-byte aligned");
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(in_dtype, [&](auto in) {
      act::with_fp8(out_dtype, [&](auto out) {
        constexpr DType IN = decltype(in)::value;
        if constexpr (IN != DType::kFloat32) {
          constexpr Activation A = decltype(a)::value;
          constexpr DType OUT = decltype(out)::value;
          using TI = StorageT<IN>;
          launch_fwd_kernel<A, IN, OUT, kVec<TI>, true>(static_cast<const TI*>(x), y, out_elems, out_cols, scale, amax,
                                                        scale_inv, x8, x8_scale_inv, stream);
        }
      });
    });
  });
  TFP8_CUDA_CHECK(cudaGetLastError());
}

void launch_activation_bwd(const void* dy, const void* x, void* dx, DType dtype, int64_t out_elems, int64_t out_cols,
                           Activation act, cudaStream_t stream) {
  if (out_elems == 0) return;
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(dtype, [&](auto d) {
      constexpr Activation A = decltype(a)::value;
      constexpr DType D = decltype(d)::value;
      using T = StorageT<D>;
      const auto* dyp = static_cast<const T*>(dy);
      const auto* xp = static_cast<const T*>(x);
      auto* dxp = static_cast<T*>(dx);
      if (rows_hold_whole_vectors(act, out_cols, kVec<T>) && act::aligned(dy, 16) && act::aligned(x, 16) &&
          act::aligned(dx, 16)) {
        activation_bwd_kernel<A, D, kVec<T>>
            <<<grid_size(out_elems, kVec<T>), kThreads, 0, stream>>>(dyp, xp, dxp, out_elems, out_cols);
      } else {
        activation_bwd_kernel<A, D, 1>
            <<<grid_size(out_elems, 1), kThreads, 0, stream>>>(dyp, xp, dxp, out_elems, out_cols);
      }
    });
  });
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
