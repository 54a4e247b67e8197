// The block-scaled grouped GEMM's fprop / dgrad configuration (csrc/grouped_block_kernel.cuh): A in 1x128 tiles, B in
// 128x128 blocks, cooperative 128x128x128 tiles, clusters of 1x2.
#include "grouped_block_kernel.cuh"

namespace tfp8::grouped {

BlockConfigEntry block_rows_config() {
  return block_entry_of<BlockGemmConfig<1, 128, cute::Shape<cute::_128, cute::_128, cute::_128>,
                                        cute::Shape<cute::_1, cute::_2, cute::_1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
