// activation_fwd with a high-precision output as a [rows, cols] kernel: a 2-D grid (x over a row's VEC-element
// vectors, y over rows), kRowsPerThread rows per thread with every load issued before the math, and no 64-bit
// division to find a SwiGLU element's row (the flat grid-stride kernel of activation_elementwise.cu divides the flat
// index by the row width per vector). Faster than the flat kernel for SwiGLU's forward at the Llama-shaped stack's
// MLP shape, as fast for GELU (benchmarks/bench_activation.py, RESULTS). The same structure for the backward (three
// loads per row, 76 registers) ran slower than the flat backward kernel, which activation_bwd keeps. The math and
// its order are activation_common.cuh's, except SwiGLU's sigmoid for 16-bit dtypes, which takes the hardware's exp
// and reciprocal approximations (kFast): a few float32 ulps, under the 16-bit rounding but not always, so a rare
// element differs from the flat kernels' by one 16-bit ulp.
#include <algorithm>
#include <initializer_list>

#include "activation_common.cuh"

namespace tfp8 {
namespace {

using act::StorageT;
constexpr int kThreads = 256;
constexpr int kRowsPerThread = 2;
constexpr int64_t kMaxGridY = 65535;

// SwiGLU's sigmoid by the hardware's approximations for 16-bit outputs (see act::sigmoid); float32 keeps IEEE math.
template <DType D>
constexpr bool kFast = D != DType::kFloat32;

// Input columns per output column: SwiGLU rows are [gate | up].
template <Activation A>
constexpr int64_t kInputWidth = A == Activation::kSwiglu ? 2 : 1;

template <Activation A, DType D, int VEC>
__global__ void __launch_bounds__(kThreads)
    activation_rows_fwd_kernel(const StorageT<D>* __restrict__ x, StorageT<D>* __restrict__ y, int64_t rows,
                               int64_t cols) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  if (c >= cols) return;
  const int count = static_cast<int>(min(static_cast<int64_t>(VEC), cols - c));
  const int64_t in_cols = kInputWidth<A> * cols;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerThread; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kRowsPerThread) {
    float a[kRowsPerThread][VEC], b[kRowsPerThread][VEC];  // SwiGLU: gate, up; else the input (b unused)
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      if (r0 + k < rows) {
        const StorageT<D>* row = x + (r0 + k) * in_cols + c;
        act::load_floats(row, a[k], count);
        if constexpr (A == Activation::kSwiglu) act::load_floats(row + cols, b[k], count);
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      if (r0 + k < rows) {
        float out[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          if constexpr (A == Activation::kSwiglu) out[v] = act::swiglu_forward<kFast<D>>(a[k][v], b[k][v]);
          else out[v] = act::forward<A>(a[k][v]);
        }
        act::store_floats<D>(y + (r0 + k) * cols + c, out, 1.0f, count);
      }
    }
  }
}

// Elements per vector: one 16-byte access of T.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

dim3 rows_grid(int64_t rows, int64_t cols, int vec) {
  const int64_t x = (cols + static_cast<int64_t>(kThreads) * vec - 1) / (static_cast<int64_t>(kThreads) * vec);
  const int64_t y = std::min(kMaxGridY, (rows + kRowsPerThread - 1) / kRowsPerThread);
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(std::max<int64_t>(1, y)));
}

// Whether every row of every tensor starts on a 16-byte boundary, so that VEC-element accesses can be used.
bool rows_aligned(int64_t cols, int vec, std::initializer_list<const void*> pointers) {
  if (cols % vec != 0) return false;
  for (const void* p : pointers) {
    if (!act::aligned(p, 16)) return false;
  }
  return true;
}

}  // namespace

void launch_activation_rows_fwd(const void* x, void* y, DType dtype, int64_t rows, int64_t cols, Activation act,
                                cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  act::with_activation(act, [&](auto a) {
    act::with_high_precision(dtype, [&](auto d) {
      constexpr Activation A = decltype(a)::value;
      constexpr DType D = decltype(d)::value;
      using T = StorageT<D>;
      const auto* xp = static_cast<const T*>(x);
      auto* yp = static_cast<T*>(y);
      if (rows_aligned(cols, kVec<T>, {x, y})) {
        activation_rows_fwd_kernel<A, D, kVec<T>>
            <<<rows_grid(rows, cols, kVec<T>), kThreads, 0, stream>>>(xp, yp, rows, cols);
      } else {
        activation_rows_fwd_kernel<A, D, 1><<<rows_grid(rows, cols, 1), kThreads, 0, stream>>>(xp, yp, rows, cols);
      }
    });
  });
  TFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tfp8
