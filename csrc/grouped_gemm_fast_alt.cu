// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, pingpong 64x256x128 tiles, clusters of 1x2.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry fast_alt_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_64, cute::_256, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>();
}

}  // namespace tfp8::grouped
