// Host side of our own grouped FP8 rows kernel (csrc/grouped_gemm_rows_kernel.cuh): the TMA descriptors of a and of
// the weights (encoded per call: pointers change), the column tile chosen from n, and the launch.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "grouped_gemm_rows.h"
#include "grouped_gemm_rows_kernel.cuh"
#include "grouped_shared.h"

namespace tfp8::grouped {
namespace {

using rows::RowsParams;

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &symbol, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(symbol);
  }();
  return fn;
}

// An FP8 tensor's TMA descriptor: sizes and byte strides from the innermost dimension out, box of 128 x box_rows (x 1),
// 128-byte swizzle, zeros outside the tensor.
bool encode(CUtensorMap* map, const void* base, int rank, const cuuint64_t* sizes, const cuuint64_t* byte_strides,
            cuuint32_t box_rows) {
  const EncodeTiled fn = encode_tiled();
  if (fn == nullptr) return false;
  const cuuint32_t box[3] = {rows::kBlockK, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(base), sizes, byte_strides, box,
            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kBlockN>
const char* launch(const GroupedFp8GemmArgs& args, cudaStream_t stream) {
  constexpr int kStages = 5;
  using Layout = rows::SharedLayout<kBlockN, kStages>;
  CUtensorMap a_map, b_map;
  const cuuint64_t a_sizes[2] = {static_cast<cuuint64_t>(args.k), static_cast<cuuint64_t>(args.rows)};
  const cuuint64_t a_strides[1] = {static_cast<cuuint64_t>(args.k)};
  const cuuint64_t b_sizes[3] = {static_cast<cuuint64_t>(args.k), static_cast<cuuint64_t>(args.n),
                                 static_cast<cuuint64_t>(args.groups)};
  const cuuint64_t b_strides[2] = {static_cast<cuuint64_t>(args.b_row_stride),
                                   static_cast<cuuint64_t>(args.b_group_stride)};
  if (!encode(&a_map, args.a, 2, a_sizes, a_strides, rows::kBlockM) ||
      !encode(&b_map, args.b, 3, b_sizes, b_strides, kBlockN)) {
    return "the grouped rows kernel's TMA descriptors could not be encoded";
  }
  auto* kernel = &rows::grouped_rows_kernel<kBlockN, kStages>;
  const int smem = Layout::bytes(args.groups);
  const Device device = current_device();
  // (the shared-memory limit is raised once for each device the kernel runs on)
  static std::atomic<uint64_t> devices_set{0};
  const uint64_t bit = uint64_t{1} << (device.id % 64);
  if ((devices_set.load() & bit) == 0) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout::bytes(rows::kMaxGroups)) !=
        cudaSuccess) {
      cudaGetLastError();
      return "the grouped rows kernel could not get its shared memory";
    }
    devices_set.fetch_or(bit);
  }
  const RowsParams params{static_cast<__nv_bfloat16*>(args.out),
                          args.offs,
                          args.a_scale_inv,
                          args.b_scale_inv,
                          args.b_scale_per_group ? 1 : 0,
                          args.groups,
                          static_cast<int>(args.rows),
                          static_cast<int>(args.n),
                          static_cast<int>(args.k)};
  kernel<<<device.sm_count, rows::kThreads, smem, stream>>>(a_map, b_map, params);
  return cudaGetLastError() == cudaSuccess ? nullptr : "the grouped rows kernel failed to launch";
}

// The column tile: the wide ones (192, then 176) where they pad n by at most 1/16 (a wide tile reads less from L2
// per MMA), else the one of 192, 176 and 128 that pads n the least (ties: the wider).
int block_n_for(int64_t n) {
  auto padding = [n](int block) { return (n + block - 1) / block * block - n; };
  const int64_t p192 = padding(192), p176 = padding(176), p128 = padding(128);
  if (std::min(p192, p176) * 16 <= n) return p176 < p192 ? 176 : 192;
  if (p128 < std::min(p192, p176)) return 128;
  return p176 < p192 ? 176 : 192;
}

}  // namespace

bool rows_kernel_supports(const GroupedFp8GemmArgs& args) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return args.kind == GroupedKind::kRows && args.fast_accumulation && args.groups > 0 &&
         args.groups <= rows::kMaxGroups && args.rows > 0 && args.k > 0 && args.rows < (int64_t{1} << 31) &&
         args.k % 16 == 0 && args.n % 8 == 0 && args.n < (int64_t{1} << 31) && args.b_row_stride % 16 == 0 &&
         args.b_group_stride % 16 == 0 && args.b_row_stride >= args.k &&
         args.b_group_stride >= args.n * args.b_row_stride && aligned(args.a) && aligned(args.b) &&
         (args.rows / rows::kBlockM + args.groups + 1) * ((args.n + 127) / 128) < (int64_t{1} << 31) &&
         reinterpret_cast<uintptr_t>(args.out) % 4 == 0 && encode_tiled() != nullptr;
}

const char* launch_rows_kernel(const GroupedFp8GemmArgs& args, cudaStream_t stream) {
  switch (block_n_for(args.n)) {
    case 128: return launch<128>(args, stream);
    case 176: return launch<176>(args, stream);
    default: return launch<192>(args, stream);
  }
}

}  // namespace tfp8::grouped
