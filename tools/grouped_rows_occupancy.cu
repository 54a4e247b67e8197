// How many CTAs / clusters of our grouped rows kernel (csrc/grouped_gemm_rows_kernel.cuh) can be resident at once,
// for cluster sizes 1, 2 and 4 (the kernel is persistent: one CTA per SM is its plan). Session 10 measured a cluster
// launch, even of size 1, 15-26% slower than a plain one; this says whether fewer CTAs fit then.
// Build: tools/grouped_gemm_probe.sh (next to the probe). Run: grouped_rows_occupancy.
#include <cstdio>

#include "../csrc/grouped_gemm_rows_kernel.cuh"
using namespace tfp8::grouped::rows;
// Prints the resident clusters and CTAs of the kernel with an N-wide column tile (64 groups' shared memory).
template <int N>
void query() {
  auto* kernel = &grouped_rows_kernel<N, 5>;
  const int smem = SharedLayout<N, 5>::bytes(64);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SharedLayout<N, 5>::bytes(kMaxGroups));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int cluster : {1, 2, 4}) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
    config.gridDim = dim3(sms / cluster * cluster), config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem, config.attrs = &attribute, config.numAttrs = 1;
    int clusters = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    std::printf("BN %d smem %d: cluster %d -> max active clusters %d (%d CTAs of %d SMs) %s\n", N, smem, cluster,
                clusters, clusters * cluster, sms, cudaGetErrorString(e));
  }
  int blocks = -1;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem);
  std::printf("BN %d: blocks per SM %d\n", N, blocks);
}
int main() {
  query<176>();
  query<192>();
  query<128>();
  return 0;
}
