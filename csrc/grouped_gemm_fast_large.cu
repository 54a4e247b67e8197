// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, cooperative 128x256x128 tiles, clusters of 2x1.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry fast_large_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_128, cute::_256, cute::_128>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
