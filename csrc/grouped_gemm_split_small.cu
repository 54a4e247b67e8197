// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): float32 promotion every 128 elements of K (split accumulator), pingpong 64x128x128 tiles, clusters of 1x2.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry split_small_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_64, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>();
}

}  // namespace tfp8::grouped
