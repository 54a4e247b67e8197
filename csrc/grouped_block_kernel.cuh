// The CUTLASS sm90 pointer-array grouped GEMM with blockwise scaling (collective
// sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling), as a template over its scale granularity and
// tiles: csrc/grouped_block_rows.cu and csrc/grouped_block_contraction.cu instantiate one each.
// Operands: A [M, K] row-major (K-major), B per group [N, K] (K-major), D [M, N] row-major bfloat16, no C operand,
// D = sum over K steps of (A_k B_kᵀ) * sfa[m, k step] * sfb[n, k step]. In grouped mode the collective rebuilds each
// group's scale layout from the group's shape: MN-major and packed ([cdiv(K, 128), M / granularity] for A, the same
// for B), hence the per-group pointers into packed scale blocks.
#pragma once
// (device asserts serialize the wgmma pipeline: see csrc/grouped_gemm_kernel.cuh)
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cute/tensor.hpp>

#include "grouped_block_arrays.h"

namespace tfp8::grouped {

template <int GranularityM, int GranularityN, class TileShape, class ClusterShape, class KernelSchedule,
          class EpilogueSchedule>
struct BlockGemmConfig {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;  // elements of 16 bytes: TMA's alignment
  static constexpr int kAlignD = 8;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<GranularityM, GranularityN, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementOut, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  // The setup kernel writes the strides as plain int64 leading dimensions and the shapes as three ints.
  static_assert(sizeof(typename Kernel::InternalStrideA) == sizeof(int64_t), "StrideA: one int64 expected");
  static_assert(sizeof(typename Kernel::InternalStrideB) == sizeof(int64_t), "StrideB: one int64 expected");
  static_assert(sizeof(typename Kernel::InternalStrideD) == sizeof(int64_t), "StrideD: one int64 expected");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int), "shape: 3 ints expected");
};

template <class Config>
typename Config::Gemm::Arguments block_arguments(int groups, const BlockGroupArrays& arrays, const Device& device) {
  using Kernel = typename Config::Kernel;
  using ElementAB = typename Config::ElementAB;
  using ElementOut = typename Config::ElementOut;
  typename Config::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, reinterpret_cast<typename Config::ProblemShape::UnderlyingProblemShape*>(arrays.shapes),
                        nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const ElementAB**>(arrays.a);
  args.mainloop.dA = reinterpret_cast<typename Kernel::InternalStrideA*>(arrays.lda);
  args.mainloop.ptr_B = reinterpret_cast<const ElementAB**>(arrays.b);
  args.mainloop.dB = reinterpret_cast<typename Kernel::InternalStrideB*>(arrays.ldb);
  // (in grouped mode the collective derives each group's scale layout from its shape: no layout arrays are read)
  args.mainloop.ptr_SFA = arrays.sfa;
  args.mainloop.layout_SFA = nullptr;
  args.mainloop.ptr_SFB = arrays.sfb;
  args.mainloop.layout_SFB = nullptr;
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;  // (the scales are applied in the mainloop)
  fusion.beta = 0.0f;
  args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(arrays.d);
  args.epilogue.dD = reinterpret_cast<typename Kernel::InternalStrideD*>(arrays.ldd);
  args.hw_info.device_id = device.id;
  args.hw_info.sm_count = device.sm_count;
  return args;
}

template <class Config>
size_t block_cutlass_workspace(int groups, const Device& device) {
  return Config::Gemm::get_workspace_size(block_arguments<Config>(groups, BlockGroupArrays{}, device));
}

template <class Config>
const char* run_block(int groups, const BlockGroupArrays& arrays, void* cutlass_workspace, const Device& device,
                      cudaStream_t stream) {
  auto args = block_arguments<Config>(groups, arrays, device);
  typename Config::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return "CUTLASS cannot implement this block-scaled grouped problem";
  }
  if (gemm.initialize(args, cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS block-scaled grouped GEMM initialization failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS block-scaled grouped GEMM launch failed";
  return nullptr;
}

template <typename Config>
BlockConfigEntry block_entry_of() {
  return {&block_cutlass_workspace<Config>, &run_block<Config>};
}

}  // namespace tfp8::grouped
