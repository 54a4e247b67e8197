// The block-scaled grouped GEMM's fprop / dgrad configuration with pingpong consumers (csrc/grouped_block_kernel.cuh):
// A in 1x128 tiles, B in 128x128 blocks, 128x128x128 tiles, clusters of 1x2 (one consumer warp group's epilogue
// overlaps the other's mainloop: for groups of few tiles).
#include "grouped_block_kernel.cuh"

namespace tfp8::grouped {

BlockConfigEntry block_rows_pingpong_config() {
  return block_entry_of<BlockGemmConfig<1, 128, cute::Shape<cute::_128, cute::_128, cute::_128>,
                                        cute::Shape<cute::_1, cute::_2, cute::_1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>();
}

}  // namespace tfp8::grouped
