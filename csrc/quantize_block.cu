// Block-scaled FP8 casts (recipe Float8BlockScaling) of x itself or of act(x): the loaders of the shared kernel
// (quantize_block_kernel.cuh), and block_dequantize. Layouts: transformer_fp8/quantization/block.py.
#include "activation_common.cuh"
#include "quantize_block_kernel.cuh"
#include "quantize_block_wide.cuh"

namespace tfp8 {
namespace {

using namespace block;

// What the kernel casts: x itself (kNone) or act(x) computed in float32 from x's row (kGelu, kRelu: x [m, k];
// kSwiglu: x [m, 2k] = [gate | up]). Zeros past the edges stay zeros (act(0) = 0).
enum ActKind : int {
  kNone = -1,
  kGelu = int(Activation::kGelu),
  kRelu = int(Activation::kRelu),
  kSwiglu = int(Activation::kSwiglu)
};

template <int kAct>
__device__ __forceinline__ float apply_act(float x, float up) {
  if constexpr (kAct == kSwiglu) return x * fast_sigmoid(x) * up;  // (act::swiglu_forward with fast_sigmoid)
  else if constexpr (kAct == kGelu) return act::forward<Activation::kGelu>(x);
  else if constexpr (kAct == kRelu) return act::forward<Activation::kRelu>(x);
  else return x;
}

// Loads x (kNone) or act(x) computed in float32 from x's row(s) (x [m, k], or [m, 2k] = [gate | up] for kSwiglu).
template <typename T, int kAct>
struct InputLoader {
  static constexpr bool kTwoDOk = kAct == kNone;
  const T* x;
  bool vec;

  __device__ __forceinline__ void load_packed(const BlockCastArgs& a, int64_t row0, int64_t col, bool interior,
                                              PackedTile<T>& tile) const {
    load_packed_rows(x, a.m, a.k, a.k, row0, col, vec, interior, tile);
  }

  __device__ __forceinline__ void load(const BlockCastArgs& a, int64_t row0, int64_t col, bool interior,
                                       float (&v)[kRows][kCols]) const {
    const int64_t ld = kAct == kSwiglu ? 2 * a.k : a.k;
    if constexpr (kAct == kSwiglu) {
      if (interior) {  // (every gate and up word in flight before the first sigmoid: see load_words)
        Word4<T> gate[kRows], up[kRows];
        load_words(x, row0, col, ld, gate);
        load_words(x + a.k, row0, col, ld, up);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float u[kCols];
          word_floats<T>(gate[i], v[i]);
          word_floats<T>(up[i], u);
#pragma unroll
          for (int j = 0; j < kCols; ++j) v[i][j] = apply_act<kAct>(v[i][j], u[j]);
        }
        return;
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {  // (edge tiles row by row: one row of up live, see load_row)
        float up[kCols];
        load_row(x, a.m, a.k, ld, row0 + i, col, vec, interior, v[i]);
        load_row(x + a.k, a.m, a.k, ld, row0 + i, col, vec, interior, up);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = apply_act<kAct>(v[i][j], up[j]);
      }
    } else {
      load_rows(x, a.m, a.k, ld, row0, col, vec, interior, v);
      if constexpr (kAct != kNone) {
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
          for (int j = 0; j < kCols; ++j) v[i][j] = apply_act<kAct>(v[i][j], 0.0f);
      }
    }
  }
};

// x itself, 16-bit: kept as loaded (PackedTile), 3 blocks per multiprocessor.
template <typename T>
struct PackedInputLoader : InputLoader<T, kNone> {
  using Tile = PackedTile<T>;
  static constexpr int kMinBlocks = 3;
};

// The wide kernel's loaders (interior tiles): 16-bit x itself, kept as loaded (1x128 or 128x128), and SwiGLU(x).
template <typename T>
struct PackedWideLoader {
  using Tile = PackedTile8<T>;
  static constexpr int kMinBlocks = 3;
  static constexpr bool kTwoDOk = true;
  const T* x;
  int64_t k;
  __device__ __forceinline__ int64_t column_tile(unsigned block_x, unsigned) const { return block_x; }
  __device__ __forceinline__ void load(int64_t row0, int64_t col, int64_t, PackedTile8<T>& tile) const {
    load_words(x, row0, col, k, tile.w);
  }
};

template <typename T>
struct SwigluWideLoader {
  using Tile = FloatTile8;
  static constexpr int kMinBlocks = 2;
  static constexpr bool kTwoDOk = false;
  const T* x;  // [m, 2k] = [gate | up]
  int64_t k;
  __device__ __forceinline__ int64_t column_tile(unsigned block_x, unsigned) const { return block_x; }
  __device__ __forceinline__ void load(int64_t row0, int64_t col, int64_t, FloatTile8& tile) const {
    Word4<T> gate[kWideRows], up[kWideRows];
    load_words(x, row0, col, 2 * k, gate);
    load_words(x + k, row0, col, 2 * k, up);
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) {
      float u[kCols];
      word_floats<T>(gate[i], tile.v[i]);
      word_floats<T>(up[i], u);
#pragma unroll
      for (int j = 0; j < kCols; ++j) tile.v[i][j] = apply_act<kSwiglu>(tile.v[i][j], u[j]);
    }
  }
};

template <typename T, int kAct>
void launch_input(const BlockCastArgs& a, cudaStream_t stream) {
  const T* x = static_cast<const T*>(a.x);
  if constexpr (sizeof(T) == 2 && (kAct == kNone || kAct == kSwiglu)) {
    const void* inputs[1] = {a.x};
    if (wide_fits(a, inputs, 1)) {
      if constexpr (kAct == kNone) launch_wide(PackedWideLoader<T>{x, a.k}, a, stream);
      else launch_wide(SwigluWideLoader<T>{x, a.k}, a, stream);
      return;
    }
  }
  const bool vec = a.k % kCols == 0 && aligned16(a.x);
  if constexpr (kAct == kNone && sizeof(T) == 2) {
    PackedInputLoader<T> loader;
    loader.x = x;
    loader.vec = vec;
    launch_with_loader(loader, a, stream);
  } else {
    launch_with_loader(InputLoader<T, kAct>{x, vec}, a, stream);
  }
}

template <DType F, typename T>
__global__ void block_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                                        int64_t scale_ld, bool two_d, int64_t m, int64_t k, T* __restrict__ out) {
  const int64_t n = m * k, stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < n; e += stride) {
    const int64_t row = e / k, col = e % k;
    const float s = two_d ? scale_inv[row / kBlockLen * scale_ld + col / kBlockLen]
                          : scale_inv[col / kBlockLen * scale_ld + row];
    out[e] = from_float<T>(fp8_to_float<F>(q[e]) * s);
  }
}

}  // namespace

void launch_block_cast(const BlockCastArgs& a, cudaStream_t stream) {
  if (a.activation >= 0 && a.two_d) throw std::invalid_argument("block_cast: a fused activation makes 1x128 tiles");
  TFP8_DISPATCH_HIGH_PRECISION(
      a.in_type, T, switch (a.activation) {
        case kNone: launch_input<T, kNone>(a, stream); break;
        case kGelu: launch_input<T, kGelu>(a, stream); break;
        case kRelu: launch_input<T, kRelu>(a, stream); break;
        case kSwiglu: launch_input<T, kSwiglu>(a, stream); break;
        default: throw std::invalid_argument("block_cast: unknown activation");
      });
}

void launch_block_dequantize(const uint8_t* q, const float* scale_inv, int64_t scale_ld, bool two_d, int64_t m,
                             int64_t k, DType fp8_type, void* out, DType out_type, cudaStream_t stream) {
  if (m == 0 || k == 0) return;
  const int threads = 256;
  const int64_t wanted = (m * k + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(wanted, int64_t{sm_count()} * 8));
  TFP8_DISPATCH_FP8(fp8_type, F,
                    TFP8_DISPATCH_HIGH_PRECISION(out_type, T,
                                                 block_dequantize_kernel<F, T><<<blocks, threads, 0, stream>>>(
                                                     q, scale_inv, scale_ld, two_d, m, k, static_cast<T*>(out))));
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
