// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, cooperative 128x256x128 tiles, clusters of 2x1.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {
namespace {

using Config =
    GroupedGemmConfig<cute::Shape<cute::_128, cute::_256, cute::_128>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

size_t workspace(int groups, const Device& device) { return grouped_cutlass_workspace<Config>(groups, device); }

const char* run(int groups, const GroupArrays& arrays, void* cutlass_workspace, const Device& device,
                cudaStream_t stream) {
  return run_grouped<Config>(groups, arrays, cutlass_workspace, device, stream);
}

}  // namespace

GroupedConfigEntry fast_large_config() { return {&workspace, &run}; }

}  // namespace tfp8::grouped
