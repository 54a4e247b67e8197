// The grouped FP8 GEMM's launcher (csrc/grouped_gemm.h): a setup kernel turns the groups' offsets into the per-group
// shapes, pointers, leading dimensions and alphas CUTLASS reads (on the device: no host sync), then the chosen tile
// configuration runs; the wgrad's empty groups are zero-filled by a kernel of their own (CUTLASS skips a group with no
// tiles, and an empty contraction's product is zero).
#include <cuda_bf16.h>

#include <algorithm>

#include "grouped_gemm.h"
#include "grouped_gemm_arrays.h"
#include "grouped_gemm_rows.h"
#include "grouped_rows.cuh"
#include "grouped_shared.h"

namespace tfp8 {
namespace {

using grouped::Device;
using grouped::GroupArrays;
using grouped::GroupedConfigEntry;

constexpr size_t kArrayAlign = 256;
constexpr int kSetupThreads = 128;

size_t round_up(size_t bytes) { return (bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign; }

// The byte size of the per-group arrays, and (when base is given) their places in it.
size_t layout_arrays(int groups, char* base, GroupArrays* arrays) {
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = base ? base + offset : nullptr;
    offset += round_up(bytes);
    return at;
  };
  char* shapes = take(sizeof(int) * 3 * groups);
  char* a = take(sizeof(void*) * groups);
  char* b = take(sizeof(void*) * groups);
  char* d = take(sizeof(void*) * groups);
  char* lda = take(sizeof(int64_t) * groups);
  char* ldb = take(sizeof(int64_t) * groups);
  char* ldd = take(sizeof(int64_t) * groups);
  char* alpha = take(sizeof(float) * groups);
  if (arrays) {
    *arrays = {reinterpret_cast<int*>(shapes),  reinterpret_cast<const void**>(a), reinterpret_cast<const void**>(b),
               reinterpret_cast<void**>(d),     reinterpret_cast<int64_t*>(lda),   reinterpret_cast<int64_t*>(ldb),
               reinterpret_cast<int64_t*>(ldd), reinterpret_cast<float*>(alpha)};
  }
  return offset;
}

__global__ void write_group_arrays(GroupedFp8GemmArgs args, GroupArrays arrays) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  int64_t start, end;
  grouped::group_rows(args.offs, g, args.rows, &start, &end);
  const int count = static_cast<int>(end - start);
  const auto* a = static_cast<const uint8_t*>(args.a);
  const auto* b = static_cast<const uint8_t*>(args.b);
  auto* d = static_cast<__nv_bfloat16*>(args.out);
  int* shape = arrays.shapes + 3 * g;
  arrays.alpha[g] = args.a_scale_inv[0] * args.b_scale_inv[args.b_scale_per_group ? g : 0];
  if (args.kind == GroupedKind::kRows) {
    shape[0] = count, shape[1] = static_cast<int>(args.n), shape[2] = static_cast<int>(args.k);
    arrays.a[g] = a + start * args.k;
    arrays.b[g] = b + g * args.b_group_stride;
    arrays.d[g] = d + start * args.n;
    arrays.lda[g] = args.k, arrays.ldb[g] = args.b_row_stride, arrays.ldd[g] = args.n;
  } else {  // a_t [n, rows] . b_t [k, rows]ᵀ over the group's columns; an empty group has no tiles (zero-filled)
    shape[0] = count > 0 ? static_cast<int>(args.n) : 0, shape[1] = static_cast<int>(args.k), shape[2] = count;
    arrays.a[g] = a + start;
    arrays.b[g] = b + start;
    arrays.d[g] = d + g * args.n * args.k;
    arrays.lda[g] = args.rows, arrays.ldb[g] = args.rows, arrays.ldd[g] = args.k;
  }
}

}  // namespace

namespace {

using grouped::current_device;

// kAuto's choice, from H100 runs of benchmarks/bench_moe.py over three shapes of uneven groups (8 experts of 2048 rows
// on average, 64 of 768 and 64 of 256) and the MoE layer (RESULTS.md, MoE sections of 2026-11-26 sessions 3 and 6),
// and of tools/grouped_gemm_probe.cu (RESULTS.md, 2026-11-27 session 9). Forward with fast accumulation: groups of
// many rows take 128x256 tiles without clusters (solo: no group's M or N tiles rounded up to a cluster's, and the
// wider tile reads B once per 256 columns), smaller groups our own kernel (csrc/grouped_gemm_rows_kernel.cuh: one
// descriptor per operand, half-tile MMAs at group ends; +2% over CUTLASS's pingpong 128x192 at 64 experts of 768 rows
// and +9% at 64 of 256 in one bench_moe run, RESULTS.md 2026-11-27 session 10), else CUTLASS's pingpong 128x192
// tiles. Split accumulator: the 128x192 tiles, in 1x2 clusters (wide) for the rows form (the dgrad) and for the wgrad
// of long groups, in 2x1 clusters otherwise. Fast-accumulation wgrad: the large tiles.
constexpr int64_t kLargeGroupRows = 1024;

GroupedTile auto_tile(const GroupedFp8GemmArgs& args) {
  const bool large_groups = args.rows >= kLargeGroupRows * std::max(args.groups, 1);
  if (args.kind == GroupedKind::kContraction) {
    if (args.fast_accumulation) return GroupedTile::kLarge;
    return large_groups ? GroupedTile::kWide : GroupedTile::kAlt;
  }
  if (!args.fast_accumulation) return GroupedTile::kWide;
  if (large_groups) return GroupedTile::kSolo;
  return grouped::rows_kernel_supports(args) ? GroupedTile::kOurs : GroupedTile::kPing;
}

// The tile that runs: the one asked for, else kAuto's choice (also for kOurs where our kernel does not take the
// arguments).
GroupedTile resolved_tile(const GroupedFp8GemmArgs& args) {
  if (args.tile == GroupedTile::kOurs) {
    return grouped::rows_kernel_supports(args) ? GroupedTile::kOurs : auto_tile(args);
  }
  return args.tile == GroupedTile::kAuto ? auto_tile(args) : args.tile;
}

GroupedConfigEntry pick_config(GroupedTile tile, const GroupedFp8GemmArgs& args) {
  switch (tile) {
    case GroupedTile::kSmall:
      return args.fast_accumulation ? grouped::fast_small_config() : grouped::split_small_config();
    case GroupedTile::kAlt: return args.fast_accumulation ? grouped::fast_alt_config() : grouped::split_alt_config();
    case GroupedTile::kWide: return args.fast_accumulation ? grouped::fast_wide_config() : grouped::split_wide_config();
    case GroupedTile::kSolo: return args.fast_accumulation ? grouped::fast_solo_config() : grouped::split_solo_config();
    case GroupedTile::kPing: return args.fast_accumulation ? grouped::fast_ping_config() : grouped::split_solo_config();
    default: return args.fast_accumulation ? grouped::fast_large_config() : grouped::split_large_config();
  }
}

}  // namespace

size_t grouped_fp8_gemm_workspace_bytes(const GroupedFp8GemmArgs& args) {
  const GroupedTile tile = resolved_tile(args);
  if (tile == GroupedTile::kOurs) return 0;  // (our kernel reads the offsets itself: no per-group arrays)
  return layout_arrays(args.groups, nullptr, nullptr) +
         pick_config(tile, args).workspace(args.groups, current_device());
}

const char* launch_grouped_fp8_gemm(const GroupedFp8GemmArgs& args, void* workspace, cudaStream_t stream) {
  const GroupedTile tile = resolved_tile(args);
  if (tile == GroupedTile::kOurs) return grouped::launch_rows_kernel(args, stream);
  GroupArrays arrays;
  char* base = static_cast<char*>(workspace);
  const size_t arrays_bytes = layout_arrays(args.groups, base, &arrays);
  const int setup_blocks = (args.groups + kSetupThreads - 1) / kSetupThreads;
  write_group_arrays<<<setup_blocks, kSetupThreads, 0, stream>>>(args, arrays);
  if (cudaGetLastError() != cudaSuccess) return "the grouped GEMM's setup kernel failed to launch";
  if (args.kind == GroupedKind::kContraction) {
    const char* error = grouped::launch_zero_empty_groups(args.offs, args.rows, args.groups, args.n, args.k, args.out,
                                                          stream);
    if (error) return error;
  }
  return pick_config(tile, args).run(args.groups, arrays, base + arrays_bytes, current_device(), stream);
}

}  // namespace tfp8
