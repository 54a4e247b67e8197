// The activation backward fused with the 1x128 block cast (dact_block_cast): d(input) = act'(input) * grad_out is
// computed in float32 as the cast kernel loads it (activation_common.cuh's math, as activation_bwd), then cast with
// 1x128 tiles and its own transposed tiles; d(input) is never stored in high precision.
#include "activation_common.cuh"
#include "quantize_block_fused.h"
#include "quantize_block_kernel.cuh"

namespace tfp8 {
namespace {

using namespace block;

// Loads d(input) [m, k]: GELU / ReLU: dy [m, k], input [m, k]; SwiGLU: dy [m, f], input [m, 2f] = [gate | up],
// d(input) = [d gate | d up]. vec: f % 4 == 0 and both pointers 16-byte aligned, so a lane's 4 columns lie in one
// half of a SwiGLU row and load as words.
template <typename T, Activation A>
struct DactLoader {
  static constexpr bool kTwoDOk = false;
  const T* dy;
  const T* input;
  int64_t f;
  bool vec;

  __device__ __forceinline__ void load(const BlockCastArgs& a, int64_t row0, int64_t col, bool interior,
                                       float (&v)[kRows][kCols]) const {
    if (interior) {
      load_interior_tile(a, row0, col, v);
      return;
    }
    if constexpr (A != Activation::kSwiglu) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float d[kCols], x[kCols];
        load_row(dy, a.m, a.k, a.k, row0 + i, col, vec, interior, d);
        load_row(input, a.m, a.k, a.k, row0 + i, col, vec, interior, x);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = act::backward<A>(d[j], x[j]);
      }
    } else if (vec) {
      const bool up_half = col >= f;  // (columns past 2f: c >= f, every load below gives 0, and so d(input))
      const int64_t c = up_half ? col - f : col;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float d[kCols], gate[kCols], up[kCols] = {0.0f, 0.0f, 0.0f, 0.0f};
        load_row(dy, a.m, f, f, row0 + i, c, true, interior, d);
        load_row(input, a.m, f, 2 * f, row0 + i, c, true, interior, gate);
        if (!up_half) load_row(input + f, a.m, f, 2 * f, row0 + i, c, true, interior, up);  // (d up needs no up)
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = swiglu_grad(d[j], gate[j], up[j], up_half);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = swiglu_element(a, row0 + i, col + j);
    }
  }

  // SwiGLU with f a multiple of 128: block 2p casts d gate's tile column p, block 2p + 1 d up's (tile column p plus
  // f / 128), which reads the same dy and gate columns, so those come from L2 for the second of the two; else the
  // launch order.
  __device__ __forceinline__ int64_t column_tile(unsigned block_x, unsigned blocks) const {
    if (A != Activation::kSwiglu || f % kBlockLen != 0 || blocks != 2 * (f / kBlockLen)) return block_x;
    return block_x % 2 == 0 ? block_x / 2 : f / kBlockLen + block_x / 2;
  }

  // An interior tile (in bounds, vec): every word of every input in flight before the first use (see load_words).
  __device__ __forceinline__ void load_interior_tile(const BlockCastArgs& a, int64_t row0, int64_t col,
                                                     float (&v)[kRows][kCols]) const {
    Word4<T> d[kRows], x[kRows];
    if constexpr (A != Activation::kSwiglu) {
      load_words(dy, row0, col, a.k, d);
      load_words(input, row0, col, a.k, x);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float dv[kCols], xv[kCols];
        word_floats<T>(d[i], dv);
        word_floats<T>(x[i], xv);
#pragma unroll
        for (int j = 0; j < kCols; ++j) v[i][j] = act::backward<A>(dv[j], xv[j]);
      }
    } else {
      const bool up_half = col >= f;  // (a tile lies in one half: f % 4 == 0, and interior keeps it in bounds)
      const int64_t c = up_half ? col - f : col;
      load_words(dy, row0, c, f, d);
      load_words(input, row0, c, 2 * f, x);  // (x: gate; d up needs no up)
      if (up_half) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) dswiglu_up_row<T>(d[i], x[i], v[i]);
        return;
      }
      Word4<T> u[kRows];
      load_words(input + f, row0, c, 2 * f, u);
#pragma unroll
      for (int i = 0; i < kRows; ++i) dswiglu_gate_row<T>(d[i], x[i], u[i], v[i]);
    }
  }

  // One element of d(input) (any f, any alignment), 0 past the edges.
  __device__ __forceinline__ float swiglu_element(const BlockCastArgs& a, int64_t row, int64_t col) const {
    if (row >= a.m || col >= a.k) return 0.0f;
    const int64_t c = col >= f ? col - f : col;
    return swiglu_grad(to_float(dy[row * f + c]), to_float(input[row * 2 * f + c]),
                       to_float(input[row * 2 * f + f + c]), col >= f);
  }
};

template <typename T, Activation A>
void launch_typed(const DactBlockCastArgs& p, cudaStream_t stream) {
  const T* dy = static_cast<const T*>(p.cast.x);
  const T* input = static_cast<const T*>(p.act_input);
  const DactLoader<T, A> loader{dy, input, p.f, p.f % kCols == 0 && aligned16(dy) && aligned16(input)};
  launch_with_loader(loader, p.cast, stream);
}

}  // namespace

void launch_dact_block_cast(const DactBlockCastArgs& p, cudaStream_t stream) {
  if (p.cast.two_d) throw std::invalid_argument("dact_block_cast: 1x128 tiles only");
  if (static_cast<Activation>(p.activation) == Activation::kSwiglu && launch_dswiglu_block_cast_wide(p, stream)) return;
  TFP8_DISPATCH_HIGH_PRECISION(
      p.cast.in_type, T, switch (static_cast<Activation>(p.activation)) {
        case Activation::kGelu: launch_typed<T, Activation::kGelu>(p, stream); break;
        case Activation::kRelu: launch_typed<T, Activation::kRelu>(p, stream); break;
        case Activation::kSwiglu: launch_typed<T, Activation::kSwiglu>(p, stream); break;
        default: throw std::invalid_argument("dact_block_cast: unknown activation");
      });
}

}  // namespace tfp8
