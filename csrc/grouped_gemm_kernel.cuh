// The CUTLASS 3 grouped FP8 GEMM of the grouped family, as a template over its tile configuration: each
// csrc/grouped_gemm_<config>.cu instantiates one (they compile in parallel; one CUTLASS kernel per file), and
// csrc/grouped_gemm_launch.cu writes the per-group arrays and picks the configuration.
// Operands: A [M, K] row-major (K-major), B per group [N, K] (K-major: CUTLASS's column-major B), D [M, N] row-major
// bfloat16, no C operand (beta = 0), D = alpha[g] * A_g B_gᵀ with alpha[g] = a_scale_inv * b_scale_inv[g]. The same
// kernel serves the wgrad: there A_g = a_t[:, columns of g] and B_g = b_t[:, columns of g], leading dimension = rows.
#pragma once
// Device asserts left in (torch's extension build has no NDEBUG) become function calls in the kernel, which make ptxas
// serialize the wgmma pipeline (warning C7510, a large slowdown): these files are built without them.
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cute/tensor.hpp>

#include "grouped_gemm.h"
#include "grouped_gemm_arrays.h"

namespace tfp8::grouped {

using ElementAB = cutlass::float_e4m3_t;
using ElementOut = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // elements of 16 bytes: TMA's alignment
constexpr int kAlignD = 8;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct GroupedGemmConfig {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementOut, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB, LayoutB*, kAlignAB,
      float, TileShape, ClusterShape,
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
typename Config::Gemm::Arguments grouped_arguments(int groups, const GroupArrays& arrays, const Device& device) {
  using Kernel = typename Config::Kernel;
  typename Config::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(arrays.shapes),
                        nullptr};  // (no host shapes: they live on the device only)
  args.mainloop.ptr_A = reinterpret_cast<const ElementAB**>(arrays.a);
  args.mainloop.dA = reinterpret_cast<typename Kernel::InternalStrideA*>(arrays.lda);
  args.mainloop.ptr_B = reinterpret_cast<const ElementAB**>(arrays.b);
  args.mainloop.dB = reinterpret_cast<typename Kernel::InternalStrideB*>(arrays.ldb);
  auto& fusion = args.epilogue.thread;
  fusion.alpha_ptr = arrays.alpha;  // alpha of group l: alpha_ptr[l] (batch stride 1)
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
  fusion.beta = 0.0f;
  args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(arrays.d);
  args.epilogue.dD = reinterpret_cast<typename Kernel::InternalStrideD*>(arrays.ldd);
  args.hw_info.device_id = device.id;
  args.hw_info.sm_count = device.sm_count;
  return args;
}

template <class Config>
size_t grouped_cutlass_workspace(int groups, const Device& device) {
  return Config::Gemm::get_workspace_size(grouped_arguments<Config>(groups, GroupArrays{}, device));
}

template <class Config>
const char* run_grouped(int groups, const GroupArrays& arrays, void* cutlass_workspace, const Device& device,
                        cudaStream_t stream) {
  auto args = grouped_arguments<Config>(groups, arrays, device);
  typename Config::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this grouped problem";
  if (gemm.initialize(args, cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS grouped GEMM initialization failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS grouped GEMM launch failed";
  return nullptr;
}

// The entry of one tile configuration: each csrc/grouped_gemm_<accumulation>_<tiles>.cu instantiates one (one
// configuration per file, so that they compile in parallel).
template <typename Config>
GroupedConfigEntry entry_of() {
  return {&grouped_cutlass_workspace<Config>, &run_grouped<Config>};
}

}  // namespace tfp8::grouped
