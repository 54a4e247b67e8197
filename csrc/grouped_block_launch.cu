// The block-scaled grouped GEMM's launcher (csrc/grouped_block_gemm.h): for the forward / dgrad, two small kernels
// repack the scales into one packed block per group (CUTLASS's grouped blockwise collective derives each group's scale
// layout from the group's shape); a setup kernel writes the per-group shapes, pointers, leading dimensions and scale
// pointers from the offsets (no host sync); then the configuration of the kind runs. The wgrad's scales are already
// packed per group when every group starts at a multiple of 128 rows (checked on the device: a trap otherwise); its
// empty groups are zero-filled.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>

#include "grouped_block_arrays.h"
#include "grouped_block_gemm.h"
#include "grouped_rows.cuh"
#include "grouped_shared.h"

namespace tfp8 {
namespace {

using grouped::BlockConfigEntry;
using grouped::BlockGroupArrays;

constexpr int64_t kBlock = 128;  // the scales' granularity along K
constexpr size_t kArrayAlign = 256;
constexpr int kThreads = 128;

size_t round_up(size_t bytes) { return (bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign; }
__host__ __device__ int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Packed {
  float* sfa = nullptr;  // kRows: group g's [cdiv(k, 128), count] at sfa + cdiv(k, 128) * start
  float* sfb = nullptr;  // kRows: group g's [cdiv(k, 128), cdiv(n, 128)] at sfb + g * cdiv(k, 128) * cdiv(n, 128)
};

// The byte size of the per-group arrays and packed scales, and (when base is given) their places in it.
size_t layout_workspace(const GroupedBlockGemmArgs& args, char* base, BlockGroupArrays* arrays, Packed* packed) {
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = base ? base + offset : nullptr;
    offset += round_up(bytes);
    return at;
  };
  const int groups = args.groups;
  char* shapes = take(sizeof(int) * 3 * groups);
  char* a = take(sizeof(void*) * groups);
  char* b = take(sizeof(void*) * groups);
  char* d = take(sizeof(void*) * groups);
  char* lda = take(sizeof(int64_t) * groups);
  char* ldb = take(sizeof(int64_t) * groups);
  char* ldd = take(sizeof(int64_t) * groups);
  char* sfa = take(sizeof(float*) * groups);
  char* sfb = take(sizeof(float*) * groups);
  const bool rows = args.kind == GroupedKind::kRows;
  char* packed_a = take(rows ? sizeof(float) * cdiv(args.k, kBlock) * args.rows : 0);
  char* packed_b = take(rows ? sizeof(float) * groups * cdiv(args.k, kBlock) * cdiv(args.n, kBlock) : 0);
  if (arrays) {
    *arrays = {
        reinterpret_cast<int*>(shapes),  reinterpret_cast<const void**>(a),    reinterpret_cast<const void**>(b),
        reinterpret_cast<void**>(d),     reinterpret_cast<int64_t*>(lda),      reinterpret_cast<int64_t*>(ldb),
        reinterpret_cast<int64_t*>(ldd), reinterpret_cast<const float**>(sfa), reinterpret_cast<const float**>(sfb)};
    *packed = {reinterpret_cast<float*>(packed_a), reinterpret_cast<float*>(packed_b)};
  }
  return offset;
}

// The group of row m: the first g with offs[g] > m (binary search; rows past offs[G-1] belong to no group: -1).
__device__ int group_of_row(const int32_t* offs, int groups, int64_t m) {
  int lo = 0, hi = groups;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (static_cast<int64_t>(offs[mid]) > m) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo < groups ? lo : -1;
}

// a's tile scales (element (m, kb) at a_scale[kb * ld + m]) -> per group g, [tiles, count] packed at tiles * start.
__global__ void pack_row_scales(GroupedBlockGemmArgs args, float* packed) {
  const int64_t tiles = cdiv(args.k, kBlock);
  const int64_t total = tiles * args.rows;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i % args.rows, kb = i / args.rows;
    const int g = group_of_row(args.offs, args.groups, m);
    if (g < 0) continue;
    int64_t start, end;
    grouped::group_rows(args.offs, g, args.rows, &start, &end);
    packed[tiles * start + kb * (end - start) + (m - start)] = args.a_scale[kb * args.a_scale_ld + m];
  }
}

// b's block scales (element (g, nb, kb) at b_scale[g * s0 + nb * s1 + kb * s2]) -> per group [cdiv(k, 128),
// cdiv(n, 128)] packed (MN-major).
__global__ void pack_block_scales(GroupedBlockGemmArgs args, float* packed) {
  const int64_t n_blocks = cdiv(args.n, kBlock), k_blocks = cdiv(args.k, kBlock);
  const int64_t total = args.groups * n_blocks * k_blocks;
  const int64_t* s = args.b_scale_strides;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t nb = i % n_blocks, kb = (i / n_blocks) % k_blocks, g = i / (n_blocks * k_blocks);
    packed[i] = args.b_scale[g * s[0] + nb * s[1] + kb * s[2]];
  }
}

__global__ void write_block_group_arrays(GroupedBlockGemmArgs args, BlockGroupArrays arrays, Packed packed) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  int64_t start, end;
  grouped::group_rows(args.offs, g, args.rows, &start, &end);
  const int count = static_cast<int>(end - start);
  const auto* a = static_cast<const uint8_t*>(args.a);
  const auto* b = static_cast<const uint8_t*>(args.b);
  auto* d = static_cast<__nv_bfloat16*>(args.out);
  int* shape = arrays.shapes + 3 * g;
  if (args.kind == GroupedKind::kRows) {
    shape[0] = count, shape[1] = static_cast<int>(args.n), shape[2] = static_cast<int>(args.k);
    arrays.a[g] = a + start * args.k;
    arrays.b[g] = b + g * args.b_group_stride;
    arrays.d[g] = d + start * args.n;
    arrays.lda[g] = args.k, arrays.ldb[g] = args.b_row_stride, arrays.ldd[g] = args.n;
    arrays.sfa[g] = packed.sfa + cdiv(args.k, kBlock) * start;
    arrays.sfb[g] = packed.sfb + g * cdiv(args.k, kBlock) * cdiv(args.n, kBlock);
    return;
  }
  // a_t [n, rows] . b_t [k, rows]ᵀ over the group's columns; an empty group has no tiles (zero-filled)
  if (count > 0 && start % kBlock != 0) {
    printf("grouped_block_fp8_gemm_wgrad: group %d starts at row %lld, not a multiple of 128\n", g,
           static_cast<long long>(start));
    __trap();  // (the contract's bad input: the group's rows would straddle the tiles of the scales)
  }
  shape[0] = count > 0 ? static_cast<int>(args.n) : 0, shape[1] = static_cast<int>(args.k), shape[2] = count;
  arrays.a[g] = a + start;
  arrays.b[g] = b + start;
  arrays.d[g] = d + g * args.n * args.k;
  arrays.lda[g] = args.rows, arrays.ldb[g] = args.rows, arrays.ldd[g] = args.k;
  arrays.sfa[g] = args.a_scale + start / kBlock * args.n;
  arrays.sfb[g] = args.b_scale + start / kBlock * args.k;
}

BlockConfigEntry pick_config(const GroupedBlockGemmArgs& args) {
  return args.kind == GroupedKind::kRows ? grouped::block_rows_config() : grouped::block_contraction_config();
}

int grid_for(int64_t items) {
  return static_cast<int>(std::min<int64_t>(cdiv(std::max<int64_t>(items, 1), 256), 1024));
}

}  // namespace

size_t grouped_block_fp8_gemm_workspace_bytes(const GroupedBlockGemmArgs& args) {
  return layout_workspace(args, nullptr, nullptr, nullptr) +
         pick_config(args).workspace(args.groups, grouped::current_device());
}

const char* launch_grouped_block_fp8_gemm(const GroupedBlockGemmArgs& args, void* workspace, cudaStream_t stream) {
  BlockGroupArrays arrays;
  Packed packed;
  char* base = static_cast<char*>(workspace);
  const size_t arrays_bytes = layout_workspace(args, base, &arrays, &packed);
  if (args.kind == GroupedKind::kRows) {
    pack_row_scales<<<grid_for(cdiv(args.k, kBlock) * args.rows), 256, 0, stream>>>(args, packed.sfa);
    const int64_t blocks = args.groups * cdiv(args.n, kBlock) * cdiv(args.k, kBlock);
    pack_block_scales<<<grid_for(blocks), 256, 0, stream>>>(args, packed.sfb);
    if (cudaGetLastError() != cudaSuccess) return "the block-scaled grouped GEMM's scale packing failed to launch";
  }
  write_block_group_arrays<<<(args.groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(args, arrays, packed);
  if (cudaGetLastError() != cudaSuccess) return "the block-scaled grouped GEMM's setup kernel failed to launch";
  if (args.kind == GroupedKind::kContraction) {
    const char* error = grouped::launch_zero_empty_groups(args.offs, args.rows, args.groups, args.n, args.k, args.out,
                                                          stream);
    if (error) return error;
  }
  return pick_config(args).run(args.groups, arrays, base + arrays_bytes, grouped::current_device(), stream);
}

}  // namespace tfp8
