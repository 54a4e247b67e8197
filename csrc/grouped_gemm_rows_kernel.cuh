// Our own Hopper kernel for the grouped FP8 GEMM's rows form with fast accumulation (the MoE forward):
// out[rows of g] = alpha_g * a[rows of g] . b[g]ᵀ, bfloat16 out, alpha_g = a_scale_inv * b_scale_inv[g].
//
// Why not CUTLASS's pointer-array kernel: that one rewrites its TMA descriptors in shared memory at every group switch
// and clips tiles at group ends through them, and computes a whole 128-row tile at every group's end. Here every
// operand has one descriptor for the whole call: a is one 2D tensor [rows, k] whose tiles start at any row (TMA
// coordinates are element-exact), the weights one 3D tensor [G, n, k], and the group's end is a row mask in the
// epilogue (rows loaded past it belong to the next group or read as zeros, and are never stored). A tile whose group
// ends in its first 64 rows skips the second half's MMAs. (RESULTS.md, 2026-11-27 session 10, has the measurements.)
//
// Layout: a persistent CTA per SM, 384 threads: warp 0 issues the TMA loads into a ring of kStages (A 128 x 128,
// B kBlockN x 128, 128-byte swizzled), two consumer warpgroups take the CTA's tiles in turn (pingpong): each owns a
// whole 128 x kBlockN tile, issues its MMAs (wgmma m64 n kBlockN k32, two 64-row halves) after the other has issued
// its own, and stores its tile from the accumulators while the other computes (16-byte stores after a transpose
// within each lane quad: 4-byte stores made the epilogue the bottleneck). Tiles are ordered group by group, then in
// panels of kPanelRows row blocks, column blocks outer and row blocks inner: the CTAs at work at any moment share an
// expert's weight and a few row blocks in L2, and consecutive tiles share their weight tile. The plain launch matters:
// it places blocks 2i and 2i + 1 on the two SMs of one TPC, which then load the same weight tile together; a cluster
// launch (even of size 1) or a scrambled tile order breaks those pairs and runs 15-25% slower (RESULTS.md, sessions
// 10-11: 2-CTA clusters with the A tile multicast, and cooperative 256-row tiles, were no faster).
#pragma once
#ifndef NDEBUG
#define NDEBUG  // (device asserts make ptxas serialize the wgmma pipeline: see grouped_gemm_kernel.cuh)
#endif
#include <cuda.h>
#include <cuda_bf16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cstdint>
#include <utility>

#include "grouped_rows.cuh"

namespace tfp8::grouped::rows {

constexpr int kBlockM = 128;  // rows per tile (two 64-row wgmma halves)
constexpr int kHalfM = 64;
constexpr int kBlockK = 128;   // FP8 elements = bytes per row of a stage: one 128-byte swizzle row
constexpr int kMmaK = 32;      // K of one FP8 wgmma
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kWarpgroup = 128;
constexpr int kMaxGroups = 1024;  // the per-group table lives in shared memory
constexpr int kPanelRows = 8;     // 128-row blocks per panel of the tile order (TileCursor)
constexpr int kATileBytes = kBlockM * kBlockK;

// The CTA's shared memory: the stage ring, then the per-stage barriers, then the group table.
template <int kBlockN, int kStages>
struct SharedLayout {
  static constexpr int kBTileBytes = kBlockN * kBlockK;
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  // (+1024: the ring is aligned to 1024 bytes, the 128-byte swizzle's period, inside the dynamic allocation)
  static constexpr int bytes(int groups) { return 1024 + kRingBytes + kBarrierBytes + 3 * 4 * groups; }
};

struct RowsParams {
  __nv_bfloat16* out;        // [rows, n]
  const int32_t* offs;       // [groups] cumulative ends
  const float* a_scale_inv;  // [1]
  const float* b_scale_inv;  // [1] or [groups]
  int b_scale_per_group;
  int groups;
  int rows, n, k;
};

// A wgmma shared-memory descriptor of a K-major tile written by TMA with the 128-byte swizzle: rows of 128 bytes in
// groups of 8 (stride 1024 bytes); stepping K by 32 bytes inside the swizzle row moves the start address only.
__device__ inline uint64_t smem_descriptor(const void* smem) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ inline void tma_load_2d(void* smem, const CUtensorMap* map, uint64_t* barrier, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               :
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "l"(map),
                 "r"(static_cast<uint32_t>(__cvta_generic_to_shared(barrier))), "r"(x), "r"(y)
               : "memory");
}

__device__ inline void tma_load_3d(void* smem, const CUtensorMap* map, uint64_t* barrier, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      :
      : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "l"(map),
        "r"(static_cast<uint32_t>(__cvta_generic_to_shared(barrier))), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// The wgmma m64 n kBlockN k32 E4M3 x E4M3 -> F32 of CuTe, over an accumulator array.
template <int kBlockN>
struct Mma;
template <>
struct Mma<128> {
  using Op = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct Mma<176> {
  using Op = cute::SM90::GMMA::MMA_64x176x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct Mma<192> {
  using Op = cute::SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN<>;
};

template <class Op, size_t... I>
__device__ __forceinline__ void mma_call(uint64_t a, uint64_t b, float* acc, bool accumulate,
                                         std::index_sequence<I...>) {
  Op::fma(a, b, acc[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <int kCount>
__device__ __forceinline__ void fence_registers(float* acc) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// One tile's MMAs: k_blocks stages from the ring, starting at the pipeline's iteration `first`; each stage goes back
// to the producer once the MMAs after it are issued and its own are done. kTwoHalves false: the tile's group ends in
// its first 64 rows, whose MMAs are the only ones issued (a separate instantiation: a branch around wgmma would make
// ptxas serialize them).
template <class Op, int kAcc, int kStages, bool kTwoHalves>
__device__ __forceinline__ void mainloop(const uint8_t* ring, int stage_bytes, uint64_t* full, uint64_t* empty,
                                         int first, int k_blocks, float (&acc)[2][kAcc], int lane) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int iteration = first + kb;
    const int s = iteration % kStages;
    Barrier::wait(&full[s], (iteration / kStages) & 1);
    const uint8_t* a_tile = ring + s * stage_bytes;
    const uint8_t* b_tile = a_tile + kATileBytes;
    fence_registers<kAcc>(acc[0]);
    if (kTwoHalves) fence_registers<kAcc>(acc[1]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
      const uint64_t b_desc = smem_descriptor(b_tile + kk * kMmaK);
      const bool accumulate = kb > 0 || kk > 0;
      mma_call<Op>(smem_descriptor(a_tile + kk * kMmaK), b_desc, acc[0], accumulate, std::make_index_sequence<kAcc>{});
      if constexpr (kTwoHalves) {
        mma_call<Op>(smem_descriptor(a_tile + kHalfM * kBlockK + kk * kMmaK), b_desc, acc[1], accumulate,
                     std::make_index_sequence<kAcc>{});
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the previous stage's MMAs are done: hand it back to the producer
    fence_registers<kAcc>(acc[0]);
    if (kTwoHalves) fence_registers<kAcc>(acc[1]);
    if (kb > 0 && lane == 0) Barrier::arrive(&empty[(iteration - 1) % kStages]);
  }
}

__device__ __forceinline__ uint32_t bf16_pair(float x, float y) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ __forceinline__ uint32_t pick(const uint32_t (&v)[4], int i) {
  return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

// Stores one accumulator row of a thread's quad (8 rows per warp: lane / 4) as bfloat16, scaled by alpha: columns
// [0, cols) of out_row. Each quad holds 8 consecutive columns per 8-column chunk, 2 per lane; four chunks at a time are
// transposed across the quad (three shuffles) so that every lane stores 16 contiguous bytes of one chunk: full
// 32-byte sectors instead of 4-byte pieces. All lanes shuffle; only lanes with store = true write.
template <int kBlockN>
__device__ __forceinline__ void store_row(const float* acc, int upper, float alpha, __nv_bfloat16* out_row, int cols,
                                          bool store, int lane) {
  const int quad = lane % 4;
  constexpr int kChunks = kBlockN / 8, kGroups = kChunks / 4;
#pragma unroll
  for (int group = 0; group < kGroups; ++group) {
    uint32_t mine[4], theirs[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float* sums = acc + (group * 4 + c) * 4 + upper * 2;
      mine[c] = bf16_pair(sums[0] * alpha, sums[1] * alpha);
    }
    // theirs[r] = lane (quad ^ r)'s pair of chunk `quad`
    theirs[0] = pick(mine, quad);
#pragma unroll
    for (int r = 1; r < 4; ++r) theirs[r] = __shfl_xor_sync(0xffffffff, pick(mine, quad ^ r), r);
    const int col = (group * 4 + quad) * 8;
    if (store && col < cols) {
      const uint4 vector = make_uint4(pick(theirs, quad), pick(theirs, quad ^ 1), pick(theirs, quad ^ 2),
                                      pick(theirs, quad ^ 3));
      *reinterpret_cast<uint4*>(out_row + col) = vector;
    }
  }
#pragma unroll
  for (int chunk = kGroups * 4; chunk < kChunks; ++chunk) {  // (176: the last two chunks, 4 bytes a lane)
    const int col = chunk * 8 + quad * 2;
    const float* sums = acc + chunk * 4 + upper * 2;
    if (store && col < cols) {
      *reinterpret_cast<uint32_t*>(out_row + col) = bf16_pair(sums[0] * alpha, sums[1] * alpha);
    }
  }
}

// Where tile t of the call lies, found by moving a cursor forward over the group table (each thread sees its tiles
// in increasing order, so the cursor never moves back).
struct TileCursor {
  const int* tile_end;   // [groups] cumulative tile counts
  const int* row_start;  // [groups]
  const int* row_end;    // [groups]
  int groups, tiles_n;
  int group = 0;
  __device__ void locate(int t, int* g, int* row0, int* col0, int* valid_rows) {
    while (group < groups && tile_end[group] <= t) ++group;
    const int local = t - (group > 0 ? tile_end[group - 1] : 0);
    *g = group;
    // panels of kPanelRows 128-row blocks, column blocks outer and row blocks inner inside a panel
    const int tiles_m = (row_end[group] - row_start[group] + kBlockM - 1) / kBlockM;
    const int panel = local / (kPanelRows * tiles_n);
    const int rows_in_panel = min(kPanelRows, tiles_m - panel * kPanelRows);
    const int within = local - panel * kPanelRows * tiles_n;
    *row0 = row_start[group] + (panel * kPanelRows + within % rows_in_panel) * kBlockM;
    *col0 = within / rows_in_panel;
    *valid_rows = min(kBlockM, row_end[group] - *row0);
  }
};

template <int kBlockN, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_rows_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        RowsParams params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = SharedLayout<kBlockN, kStages>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) uint8_t dynamic_smem[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(dynamic_smem) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + Layout::kRingBytes);
  uint64_t* empty = full + kStages;
  int* tile_end = reinterpret_cast<int*>(empty + kStages);
  int* row_start = tile_end + params.groups;
  int* row_end = row_start + params.groups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles_n = (params.n + kBlockN - 1) / kBlockN;
  const int k_blocks = (params.k + kBlockK - 1) / kBlockK;

  // The group table: rows [start, end) of each group (clamped to [0, rows]) and cumulative tile counts (warp 0 scans
  // the groups 32 at a time); the barriers (thread 0).
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < params.groups; base += 32) {
      const int g = base + lane;
      int tiles = 0;
      if (g < params.groups) {
        int64_t start, end;
        group_rows(params.offs, g, params.rows, &start, &end);
        row_start[g] = static_cast<int>(start), row_end[g] = static_cast<int>(end);
        tiles = static_cast<int>((end - start + kBlockM - 1) / kBlockM) * tiles_n;
      }
#pragma unroll
      for (int shift = 1; shift < 32; shift *= 2) {
        const int other = __shfl_up_sync(0xffffffff, tiles, shift);
        if (lane >= shift) tiles += other;
      }
      if (g < params.groups) tile_end[g] = carry + tiles;
      carry += __shfl_sync(0xffffffff, tiles, 31);
    }
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s) {
        Barrier::init(&full[s], 1);
        Barrier::init(&empty[s], 4);  // one arrival per consumer warp
      }
      cutlass::arch::fence_barrier_init();
    }
  }
  __syncthreads();
  const int total_tiles = params.groups > 0 ? tile_end[params.groups - 1] : 0;
  TileCursor cursor{tile_end, row_start, row_end, params.groups, tiles_n};

  if (warp < 4) {  // the producer warpgroup: warp 0 loads, the others retire at once
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp != 0 || lane != 0) return;
    int iteration = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      int g, row0, col_block, valid_rows;
      cursor.locate(t, &g, &row0, &col_block, &valid_rows);
      for (int kb = 0; kb < k_blocks; ++kb, ++iteration) {
        const int s = iteration % kStages;
        Barrier::wait(&empty[s], ((iteration / kStages) & 1) ^ 1);
        uint8_t* a_tile = ring + s * Layout::kStageBytes;
        Barrier::arrive_and_expect_tx(&full[s], Layout::kStageBytes);
        tma_load_2d(a_tile, &a_map, &full[s], kb * kBlockK, row0);
        tma_load_3d(a_tile + kATileBytes, &b_map, &full[s], kb * kBlockK, col_block * kBlockN, g);
      }
    }
    return;
  }

  // The consumer warpgroups: warpgroup c takes the CTA's tiles c, c + 2, ... (in the CTA's order j).
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = warp / 4 - 1;
  const int thread = threadIdx.x % kWarpgroup;
  const int consumer_warp = thread / 32;
  constexpr int kAcc = kBlockN / 2;  // float32 sums per thread per 64-row half
  using Op = typename Mma<kBlockN>::Op;
  float acc[2][kAcc];
  const float a_scale_inv = params.a_scale_inv[0];
  for (int j = consumer;; j += 2) {
    const int t = blockIdx.x + j * gridDim.x;
    if (t >= total_tiles) break;
    int g, row0, col_block, valid_rows;
    cursor.locate(t, &g, &row0, &col_block, &valid_rows);
    const bool two_halves = valid_rows > kHalfM;
    // Pingpong order: tile j's MMAs are issued after tile j-1's (the other warpgroup's); named barriers 1 and 2.
    if (j > 0) cutlass::arch::NamedBarrier::sync(2 * kWarpgroup, 1 + (j & 1));
    const int last_iteration = (j + 1) * k_blocks - 1;
    if (two_halves) {
      mainloop<Op, kAcc, kStages, true>(ring, Layout::kStageBytes, full, empty, j * k_blocks, k_blocks, acc, lane);
    } else {
      mainloop<Op, kAcc, kStages, false>(ring, Layout::kStageBytes, full, empty, j * k_blocks, k_blocks, acc, lane);
    }
    if (blockIdx.x + (j + 1) * gridDim.x < total_tiles) {
      cutlass::arch::NamedBarrier::arrive(2 * kWarpgroup, 1 + ((j + 1) & 1));
    }
    cute::warpgroup_wait<0>();
    fence_registers<kAcc>(acc[0]);
    fence_registers<kAcc>(acc[1]);
    if (lane == 0) Barrier::arrive(&empty[last_iteration % kStages]);

    // Epilogue: alpha, bfloat16, row-masked stores (rows of this thread: warp * 16 + lane / 4, + 8, in each half).
    const float alpha = a_scale_inv * params.b_scale_inv[params.b_scale_per_group ? g : 0];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int upper = 0; upper < 2; ++upper) {
        const int row = half * kHalfM + consumer_warp * 16 + lane / 4 + upper * 8;
        const bool row_valid = row < valid_rows;
        __nv_bfloat16* out_row = params.out + static_cast<int64_t>(row0 + row) * params.n + col_block * kBlockN;
        store_row<kBlockN>(acc[half], upper, alpha, out_row, params.n - col_block * kBlockN, row_valid, lane);
      }
    }
  }
#endif
}

}  // namespace tfp8::grouped::rows
