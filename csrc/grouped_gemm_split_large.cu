// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): float32 promotion every 128 elements of K (split accumulator), cooperative 128x128x128 tiles, clusters of 2x1.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry split_large_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
