// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, pingpong 128x128x128 tiles, clusters of 1x2.
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {
namespace {

using Config =
    GroupedGemmConfig<cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

size_t workspace(int groups, const Device& device) { return grouped_cutlass_workspace<Config>(groups, device); }

const char* run(int groups, const GroupArrays& arrays, void* cutlass_workspace, const Device& device,
                cudaStream_t stream) {
  return run_grouped<Config>(groups, arrays, cutlass_workspace, device, stream);
}

}  // namespace

GroupedConfigEntry fast_small_config() { return {&workspace, &run}; }

}  // namespace tfp8::grouped
