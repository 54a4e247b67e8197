// The block-scaled grouped GEMM's wgrad configuration (csrc/grouped_block_kernel.cuh): A and B both in 1x128 tiles
// along the contraction (the tokens), cooperative 128x128x128 tiles, clusters of 1x2.
#include "grouped_block_kernel.cuh"

namespace tfp8::grouped {

BlockConfigEntry block_contraction_config() {
  return block_entry_of<
      BlockGemmConfig<1, 1, cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
