// Host helpers the grouped families' launchers share (declared in csrc/grouped_shared.h): the device's SM count and
// the wgrad's zero-fill of empty groups.
#include <cuda_bf16.h>

#include <algorithm>

#include "grouped_rows.cuh"
#include "grouped_shared.h"

namespace tfp8 {
namespace grouped {

namespace {

// out[g] = 0 for every empty group g (blockIdx.y = g; 16-byte stores: n * k bfloat16 is a multiple of 16 bytes).
__global__ void zero_empty_groups(const int32_t* offs, int64_t rows, int64_t vectors_per_group, uint4* out) {
  int64_t start, end;
  group_rows(offs, blockIdx.y, rows, &start, &end);
  if (end > start) return;
  uint4* group = out + blockIdx.y * vectors_per_group;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors_per_group;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    group[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

const char* launch_zero_empty_groups(const int32_t* offs, int64_t rows, int groups, int64_t n, int64_t k, void* out,
                                     cudaStream_t stream) {
  const int64_t vectors = n * k * static_cast<int64_t>(sizeof(__nv_bfloat16)) / 16;
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + 255) / 256, 64));
  zero_empty_groups<<<dim3(blocks, groups), 256, 0, stream>>>(offs, rows, vectors, static_cast<uint4*>(out));
  return cudaGetLastError() == cudaSuccess ? nullptr : "the grouped GEMM's zero-fill kernel failed to launch";
}

Device current_device() {
  // (the SM count per device, asked once: cudaDeviceGetAttribute is cheap, but this runs on every call)
  static int sm_counts[64] = {};
  Device device;
  cudaGetDevice(&device.id);
  if (device.id < 64 && sm_counts[device.id] == 0) {
    cudaDeviceGetAttribute(&sm_counts[device.id], cudaDevAttrMultiProcessorCount, device.id);
  }
  device.sm_count = device.id < 64 ? sm_counts[device.id] : 0;
  return device;
}

}  // namespace grouped

}  // namespace tfp8
