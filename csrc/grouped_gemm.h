// Launcher of the grouped family's CUDA kernel (csrc/grouped_gemm_*.cu): our Hopper grouped FP8 GEMM, a CUTLASS 3
// pointer-array kernel (TMA, warp-specialized, one FP32 alpha per group) whose per-group shapes, pointers and alphas
// are written on the device from the groups' offsets by a small setup kernel: no host sync, empty groups allowed.
// Plain pointers, no torch. Contract (the op grouped_fp8_gemm_sm90): csrc/ops.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tfp8 {

// Which grouped product the kernel computes.
enum class GroupedKind : int {
  // fprop / dgrad: out [rows, n], rows of group g = a[rows of g] [*, k] . b[g] [n, k]ᵀ (a contiguous).
  kRows = 0,
  // wgrad: out [G, n, k], out[g] = a_t [n, columns of g] . b_t [k, columns of g]ᵀ (a_t, b_t contiguous, rows columns).
  kContraction = 1,
};

// The compiled kernel configurations (CTA tile M x N x 128 of FP8 K), six CUTLASS ones with fast accumulation and five
// with the split accumulator, and our own kernel; kAuto picks one from the kind, the accumulation and the groups'
// average size (csrc/grouped_gemm_launch.cu says which and why).
enum class GroupedTile : int {
  kAuto = 0,
  kLarge = 1,  // fast accumulation: cooperative 128x256, clusters 2x1; split: cooperative 128x128, clusters 2x1
  kSmall = 2,  // fast accumulation: pingpong 128x128, clusters 1x2; split: pingpong 64x128, clusters 1x2
  kAlt = 3,    // fast accumulation: pingpong 64x256, clusters 1x2; split: cooperative 128x192, clusters 2x1
  kWide = 4,   // fast accumulation: cooperative 128x256, clusters 1x2; split: cooperative 128x192, clusters 1x2
  kSolo = 5,   // fast accumulation: cooperative 128x256, no clusters; split: cooperative 128x192, no clusters
  kPing = 6,   // fast accumulation: pingpong 128x192, no clusters; split: solo's (no room for the promoted sums)
  kOurs = 7,   // fast-accumulation rows form: our own kernel (csrc/grouped_gemm_rows_kernel.cuh), pingpong 128 x 128,
               // 176 or 192 (from n); anything else it does not take: kAuto's CUTLASS choice
};

struct GroupedFp8GemmArgs {
  GroupedKind kind = GroupedKind::kRows;
  const void* a = nullptr;  // E4M3; kRows: [rows, k]; kContraction: a_t [n, rows]
  const void* b =
      nullptr;  // E4M3; kRows: group g at b + g * b_group_stride, row stride b_row_stride; kContraction: [k, rows]
  void* out = nullptr;            // bfloat16; kRows: [rows, n]; kContraction: [G, n, k]
  const int32_t* offs = nullptr;  // [groups] cumulative ends (device)
  int groups = 0;
  int64_t rows = 0, n = 0, k = 0;
  int64_t b_group_stride = 0, b_row_stride = 0;  // kRows only, in elements
  const float* a_scale_inv = nullptr;            // [1]
  const float* b_scale_inv = nullptr;            // [1], or [groups] when b_scale_per_group
  bool b_scale_per_group = false;
  bool fast_accumulation = false;  // false: float32 promotion of the partial sums every 128 elements of K (split)
  GroupedTile tile = GroupedTile::kAuto;
};

// Bytes of device workspace launch_grouped_fp8_gemm needs for these arguments (host only, no device access).
size_t grouped_fp8_gemm_workspace_bytes(const GroupedFp8GemmArgs& args);

// Runs the grouped GEMM on stream with a workspace of grouped_fp8_gemm_workspace_bytes(args) bytes (256-byte
// aligned). Returns nullptr, or a message saying why CUTLASS refused the problem.
const char* launch_grouped_fp8_gemm(const GroupedFp8GemmArgs& args, void* workspace, cudaStream_t stream);

}  // namespace tfp8
