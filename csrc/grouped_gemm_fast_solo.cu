// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, cooperative
// 128x256x128 tiles, no clusters (no multicast, and no rounding of a group's M or N tiles up to a cluster's).
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry fast_solo_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_128, cute::_256, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>();
}

}  // namespace tfp8::grouped
