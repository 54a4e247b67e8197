// One tile configuration of the grouped FP8 GEMM (csrc/grouped_gemm_kernel.cuh): FP8 fast accumulation, pingpong
// 128x192x128 tiles, no clusters: each consumer warpgroup owns a whole 128x192 tile (96 float32 sums a thread per
// 64 rows), so one warpgroup's epilogue and a group switch's descriptor update run under the other's MMAs, and the
// 192-wide MMAs read less shared memory per FLOP than the 128x128 pingpong tiles. There is no split-accumulator
// pingpong 128x192 kernel: its promoted sums would not fit the registers (the split form of this tile runs solo's).
#include "grouped_gemm_kernel.cuh"

namespace tfp8::grouped {

GroupedConfigEntry fast_ping_config() {
  return entry_of<
      GroupedGemmConfig<cute::Shape<cute::_128, cute::_192, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>();
}

}  // namespace tfp8::grouped
