// Folds the amax cuBLASLt writes for an FP8 output into the caller's max-accumulated amax.
#include "gemm.h"

namespace tfp8 {

__global__ void fold_amax_kernel(const float* value, float* amax) { atomic_max_nonneg(amax, *value); }

void launch_fold_amax(const float* value, float* amax, cudaStream_t stream) {
  fold_amax_kernel<<<1, 1, 0, stream>>>(value, amax);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
