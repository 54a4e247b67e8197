// The kernels of tools/grouped_gemm_probe.cu: PROBE_KERNEL picks the one this object file instantiates (one CUTLASS
// kernel per object, so that they compile in parallel). Grouped kernels are the library's pointer-array template
// (csrc/grouped_gemm_kernel.cuh) with scheduler options the library leaves at their defaults; dense kernels are the
// same tiles as CUTLASS's plain (one problem) sm90 FP8 GEMM, to split the grouped kernel's gap to cuBLASLt into what
// the pointer-array form costs and what the tiles cost.
#include "../csrc/grouped_gemm_kernel.cuh"
#include "grouped_gemm_probe.h"

namespace tfp8::probe {
namespace {

using namespace cute;
using cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
using cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum;
using cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
using cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;

// Applies the scheduler options to args and runs Config's kernel on them.
template <class Config>
const char* launch(typename Config::Gemm::Arguments& args, const ProbeProblem& p, const ProbeOptions& o,
                   void* workspace, cudaStream_t stream) {
  args.scheduler.max_swizzle_size = o.swizzle;
  args.scheduler.raster_order = static_cast<decltype(args.scheduler.raster_order)>(o.raster);
  typename Config::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "cannot implement";
  if (Config::Gemm::get_workspace_size(args) > p.workspace_bytes) return "workspace too small";
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return "initialize failed";
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "launch failed";
  return nullptr;
}

template <class Config>
const char* run_grouped(const ProbeProblem& p, const ProbeOptions& o, void* workspace, cudaStream_t stream) {
  grouped::Device device{0, p.sm_count};
  auto args = grouped::grouped_arguments<Config>(p.groups, p.arrays, device);
  return launch<Config>(args, p, o, workspace, stream);
}

// CUTLASS's plain sm90 FP8 GEMM: D [m, n] row-major bfloat16 = alpha * A [m, k] . B [n, k]ᵀ (one problem).
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct DenseConfig {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, ElementOut,
      cutlass::layout::RowMajor, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cutlass::layout::RowMajor, 16, ElementAB,
      cutlass::layout::ColumnMajor, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// A packed (leading dimension, 1, batch stride) stride of CUTLASS's K-major / row-major operands.
template <class Stride>
Stride packed(int64_t ld, int64_t batch) {
  Stride s{};
  get<0>(s) = ld;
  get<2>(s) = batch;
  return s;
}

template <class Config>
const char* run_dense(const ProbeProblem& p, const ProbeOptions& o, void* workspace, cudaStream_t stream) {
  using Kernel = typename Config::Kernel;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  typename Config::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = static_cast<const cutlass::float_e4m3_t*>(p.a);
  args.mainloop.dA = packed<StrideA>(k, int64_t(m) * k);
  args.mainloop.ptr_B = static_cast<const cutlass::float_e4m3_t*>(p.b);
  args.mainloop.dB = packed<StrideB>(k, int64_t(n) * k);
  args.epilogue.thread.alpha_ptr = p.alpha;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_D = static_cast<cutlass::bfloat16_t*>(p.d);
  args.epilogue.dD = packed<StrideD>(n, int64_t(m) * n);
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = p.sm_count;
  return launch<Config>(args, p, o, workspace, stream);
}

template <int M, int N, int CM, int CN, class KernelSchedule, class EpilogueSchedule>
using Grouped = grouped::GroupedGemmConfig<Shape<Int<M>, Int<N>, _128>, Shape<Int<CM>, Int<CN>, _1>, KernelSchedule,
                                           EpilogueSchedule>;
template <int M, int N, int CM, int CN, class KernelSchedule, class EpilogueSchedule>
using Dense = DenseConfig<Shape<Int<M>, Int<N>, _128>, Shape<Int<CM>, Int<CN>, _1>, KernelSchedule, EpilogueSchedule>;

using GroupedCoop = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using GroupedPing = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using DenseCoop = cutlass::epilogue::TmaWarpSpecializedCooperative;
using DensePing = cutlass::epilogue::TmaWarpSpecialized;

}  // namespace

#if PROBE_KERNEL == 0
ProbeKernel probe_kernel_0() {
  return {"grouped ping 128x128 1x2", true,
          &run_grouped<Grouped<128, 128, 1, 2, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 1
ProbeKernel probe_kernel_1() {
  return {"grouped coop 128x256 1x1", true,
          &run_grouped<Grouped<128, 256, 1, 1, KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum, GroupedCoop>>};
}
#elif PROBE_KERNEL == 2
ProbeKernel probe_kernel_2() {
  return {"grouped coop 128x256 2x1", true,
          &run_grouped<Grouped<128, 256, 2, 1, KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum, GroupedCoop>>};
}
#elif PROBE_KERNEL == 3
ProbeKernel probe_kernel_3() {
  return {"grouped ping 64x256 1x1", true,
          &run_grouped<Grouped<64, 256, 1, 1, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 4
ProbeKernel probe_kernel_4() {
  return {"dense coop 128x256 2x1", false,
          &run_dense<Dense<128, 256, 2, 1, KernelTmaWarpSpecializedCooperativeFP8FastAccum, DenseCoop>>};
}
#elif PROBE_KERNEL == 5
ProbeKernel probe_kernel_5() {
  return {"dense coop 128x256 1x1", false,
          &run_dense<Dense<128, 256, 1, 1, KernelTmaWarpSpecializedCooperativeFP8FastAccum, DenseCoop>>};
}
#elif PROBE_KERNEL == 6
ProbeKernel probe_kernel_6() {
  return {"dense ping 64x256 1x1", false,
          &run_dense<Dense<64, 256, 1, 1, KernelTmaWarpSpecializedPingpongFP8FastAccum, DensePing>>};
}
#elif PROBE_KERNEL == 7
ProbeKernel probe_kernel_7() {
  return {"dense ping 128x128 1x2", false,
          &run_dense<Dense<128, 128, 1, 2, KernelTmaWarpSpecializedPingpongFP8FastAccum, DensePing>>};
}
#elif PROBE_KERNEL == 8
ProbeKernel probe_kernel_8() {
  return {"grouped ping 128x192 1x1", true,
          &run_grouped<Grouped<128, 192, 1, 1, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 9
ProbeKernel probe_kernel_9() {
  return {"grouped ping 128x176 1x1", true,
          &run_grouped<Grouped<128, 176, 1, 1, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 10
ProbeKernel probe_kernel_10() {
  return {"grouped ping 128x192 1x2", true,
          &run_grouped<Grouped<128, 192, 1, 2, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 11
ProbeKernel probe_kernel_11() {
  return {"grouped ping 128x176 1x2", true,
          &run_grouped<Grouped<128, 176, 1, 2, KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum, GroupedPing>>};
}
#elif PROBE_KERNEL == 12
ProbeKernel probe_kernel_12() {
  return {"dense ping 128x176 1x2", false,
          &run_dense<Dense<128, 176, 1, 2, KernelTmaWarpSpecializedPingpongFP8FastAccum, DensePing>>};
}
#else
ProbeKernel probe_kernel_13() {
  return {"dense ping 128x192 1x2", false,
          &run_dense<Dense<128, 192, 1, 2, KernelTmaWarpSpecializedPingpongFP8FastAccum, DensePing>>};
}
#endif

}  // namespace tfp8::probe
