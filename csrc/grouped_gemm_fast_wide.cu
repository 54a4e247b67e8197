// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, cooperative
// 128x256x128 tiles, clusters of 1x2 (A multicast across two N tiles: a group's M tiles are not rounded up to pairs,
// which the large configuration's 2x1 clusters do).
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry fast_wide_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_128, cute::_256, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
