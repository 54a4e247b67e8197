// The shared-memory FP8 tile of the cast-transpose kernels (quantize_transpose.cu's cast_transpose and
// activation_dact_cast_transpose.cu's dact_cast_transpose): 128 x 128 bytes, written in phase 1 as 16-byte chunks
// along rows and read in phase 2 as 16 rows x 4 columns per thread, whose bytes are transposed in registers. The
// chunks are XOR-swizzled (chunk ^ 4 in odd 16-row groups) so that both phases are free of bank conflicts.
#pragma once

#include <cstdint>

namespace tfp8 {
namespace fp8_tile {

constexpr int kSide = 128;       // rows and columns (bytes) of the tile
constexpr int kChunkBytes = 16;  // phase 1's unit along a row
constexpr int kThreads = 256;    // phase 2: one thread per 16 rows x 4 columns
static_assert(kSide / 16 * kSide / 4 == kThreads, "phase 2: one thread per 16 rows x 4 columns of the tile");

// Byte offset of the 16-byte chunk `chunk` of tile row `row`.
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  return row * kSide + (chunk ^ (((row >> 4) & 1) << 2)) * kChunkBytes;
}

// 4x4 byte transpose: out[j] holds byte j of a, b, c, d (in that order).
__device__ __forceinline__ void transpose_4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// This thread's place in phase 2: tile columns 4 * word_col .. + 3 and tile rows 16 * row_group .. + 15.
struct Phase2Place {
  int word_col;
  int row_group;
};

__device__ __forceinline__ Phase2Place phase2_place() {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  return {(warp % 2) * 16 + lane % 16, (warp / 2) * 2 + lane / 16};
}

// Phase 2's read: out[k][j] holds the bytes of transposed row 4 * word_col + j, columns 4k .. 4k + 3 of the 16
// (tile rows 16 * row_group + 4k .. + 3).
__device__ __forceinline__ void read_transposed(const uint8_t* tile, Phase2Place p, uint32_t (&out)[4][4]) {
  uint32_t words[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int row = p.row_group * 16 + i;
    words[i] = *reinterpret_cast<const uint32_t*>(tile + tile_offset(row, p.word_col / 4) + (p.word_col % 4) * 4);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) transpose_4x4(words[4 * k], words[4 * k + 1], words[4 * k + 2], words[4 * k + 3], out[k]);
}

}  // namespace fp8_tile
}  // namespace tfp8
