// d(SwiGLU) -> 1x128 block cast with its own transposed tiles on the wide kernel (quantize_block_wide.cuh): what
// dact_block_cast computes for SwiGLU (d(input) = [d gate | d up] from grad_out and [gate | up], float32, cast without
// a high-precision copy), bit for bit, on interior problems (m and f multiples of 128, 16-bit, aligned). Its tile
// filled the generic kernel's register file (64 float32 results plus three inputs' words in flight: 128 registers, 2
// blocks of 8 warps per SM); the wide kernel holds half of it per thread.
#include "quantize_block_fused.h"
#include "quantize_block_wide.cuh"

namespace tfp8 {
namespace block {
namespace {

template <typename T>
struct DswigluWideLoader {
  using Tile = FloatTile8;
  static constexpr int kMinBlocks = 2;  // (64 registers; 3 blocks spill)
  static constexpr bool kTwoDOk = false;
  const T* dy;     // [m, f]
  const T* input;  // [m, 2f] = [gate | up]
  int64_t f;

  // Block 2p casts d gate's tile column p, block 2p + 1 d up's (column p + f / 128), which reads the same dy and gate
  // columns, so those come from L2 for the second (DactLoader's order).
  __device__ __forceinline__ int64_t column_tile(unsigned block_x, unsigned) const {
    return block_x % 2 == 0 ? block_x / 2 : f / kBlockLen + block_x / 2;
  }

  __device__ __forceinline__ void load(int64_t row0, int64_t col, int64_t, FloatTile8& tile) const {
    const bool up_half = col >= f;
    const int64_t c = up_half ? col - f : col;
    Word4<T> d[kWideRows], g[kWideRows];
    load_words(dy, row0, c, f, d);
    load_words(input, row0, c, 2 * f, g);
    if (up_half) {  // (d up needs no up)
#pragma unroll
      for (int i = 0; i < kWideRows; ++i) dswiglu_up_row<T>(d[i], g[i], tile.v[i]);
      return;
    }
    Word4<T> u[kWideRows];
    load_words(input + f, row0, c, 2 * f, u);
#pragma unroll
    for (int i = 0; i < kWideRows; ++i) dswiglu_gate_row<T>(d[i], g[i], u[i], tile.v[i]);
  }
};

}  // namespace
}  // namespace block

bool launch_dswiglu_block_cast_wide(const DactBlockCastArgs& p, const cudaStream_t stream) {
  const BlockCastArgs& a = p.cast;
  const void* inputs[2] = {a.x, p.act_input};
  if (a.two_d || p.f <= 0 || p.f % kBlockLen != 0 || a.k != 2 * p.f || !block::wide_fits(a, inputs, 2)) return false;
  if (a.in_type == DType::kBFloat16) {
    const block::DswigluWideLoader<__nv_bfloat16> loader{static_cast<const __nv_bfloat16*>(a.x),
                                                         static_cast<const __nv_bfloat16*>(p.act_input), p.f};
    block::launch_wide(loader, a, stream);
  } else if (a.in_type == DType::kFloat16) {
    const block::DswigluWideLoader<__half> loader{static_cast<const __half*>(a.x),
                                                  static_cast<const __half*>(p.act_input), p.f};
    block::launch_wide(loader, a, stream);
  } else {
    return false;
  }
  return true;
}

}  // namespace tfp8
