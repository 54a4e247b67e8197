// FP8 GEMM through cuBLASLt. Row-major TN maps onto cuBLASLt's column-major as out^T = b . a^T:
// cuBLASLt A = b (TRANSA = T), B = a (TRANSB = N), m = n, n = m, k = k, lda = ldb = k, ldc = ldd = ld_out.
// One handle per device (created on first use, kept for the process); the heuristic's algorithm is cached per
// problem key, so a repeated call makes no heuristic query.
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "gemm.h"

namespace tfp8 {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt: ") + what + " failed: " + cublasLtGetStatusString(status));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kE4M3: return CUDA_R_8F_E4M3;
    case DType::kE5M2: return CUDA_R_8F_E5M2;
  }
  throw std::invalid_argument("unknown DType");
}

const char* torch_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kE4M3: return "float8_e4m3fn";
    case DType::kE5M2: return "float8_e5m2";
  }
  return "?";
}

bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

cublasLtHandle_t handle_for_current_device() {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  int device = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  cublasLtHandle_t& handle = handles[device];
  if (handle == nullptr) check_cublas(cublasLtCreate(&handle), "cublasLtCreate");
  return handle;
}

// Largest power of two <= 256 dividing the address: the alignment the chosen algorithm may assume.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// RAII owners of the cuBLASLt descriptors.
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  MatmulDesc() { check_cublas(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate"); }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(desc); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    check_cublas(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), "MatmulDescSetAttribute");
  }
};

struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  Layout(DType type, int64_t rows, int64_t cols, int64_t ld) {
    check_cublas(cublasLtMatrixLayoutCreate(&layout, cuda_type(type), rows, cols, ld), "MatrixLayoutCreate");
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(layout); }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { check_cublas(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate"); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(pref); }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), "PreferenceSetAttribute");
  }
};

cublasLtEpilogue_t epilogue_of(const Fp8GemmArgs& g) {
  if (g.pre_gelu != nullptr) return g.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  return g.bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// C's dtype: the output's, except for FP8 outputs, where cuBLASLt wants BF16 or FP16 (the bias dtype).
DType c_type_of(const Fp8GemmArgs& g) {
  if (!is_fp8(g.out_type)) return g.out_type;
  return g.bias != nullptr ? g.bias_type : DType::kBFloat16;
}

// Everything the algorithm choice depends on.
using AlgoKey = std::array<int64_t, 17>;

AlgoKey key_of(const Fp8GemmArgs& g, int device) {
  return {device, g.m, g.n, g.k, g.ld_out, int64_t(g.a_type), int64_t(g.b_type), int64_t(g.out_type),
          int64_t(c_type_of(g)), g.bias ? int64_t(g.bias_type) : -1, g.pre_gelu ? int64_t(g.pre_gelu_type) : -1,
          int64_t(epilogue_of(g)), int64_t(g.accumulate) * 2 + int64_t(g.fast_accum) + 4 * (g.amax_scratch != nullptr),
          alignment(g.a), alignment(g.b), alignment(g.out), g.pre_gelu ? alignment(g.pre_gelu) : 0};
}

std::string describe(const Fp8GemmArgs& g) {
  return std::string("a ") + torch_name(g.a_type) + ", b " + torch_name(g.b_type) + ", out " + torch_name(g.out_type) +
         (g.bias ? std::string(", bias ") + torch_name(g.bias_type) : "") +
         (g.pre_gelu ? std::string(", gelu (pre_gelu ") + torch_name(g.pre_gelu_type) + ")" : "") +
         (g.accumulate ? ", accumulate" : "") + ", M=" + std::to_string(g.m) + " N=" + std::to_string(g.n) +
         " K=" + std::to_string(g.k);
}

cublasLtMatmulAlgo_t heuristic_algo(cublasLtHandle_t handle, MatmulDesc& desc, const Layout& A, const Layout& B,
                                    const Layout& C, const Layout& D, const Fp8GemmArgs& g) {
  Preference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kGemmWorkspaceBytes));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.b));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.a));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.out));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.out));
  cublasLtMatmulHeuristicResult_t result = {};
  int count = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, A.layout, B.layout, C.layout, D.layout,
                                                         pref.pref, 1, &result, &count);
  if (status != CUBLAS_STATUS_SUCCESS || count == 0)
    throw std::runtime_error("fp8_gemm: this combination is not supported by cuBLASLt (" + describe(g) +
                             "): " + cublasLtGetStatusString(status));
  return result.algo;
}

cublasLtMatmulAlgo_t cached_algo(cublasLtHandle_t handle, MatmulDesc& desc, const Layout& A, const Layout& B,
                                 const Layout& C, const Layout& D, const Fp8GemmArgs& g) {
  static std::mutex mutex;
  static std::map<AlgoKey, cublasLtMatmulAlgo_t> cache;
  int device = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  const AlgoKey key = key_of(g, device);
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  cublasLtMatmulAlgo_t algo = heuristic_algo(handle, desc, A, B, C, D, g);
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, algo);
  return algo;
}

}  // namespace

void fp8_gemm_cublaslt(const Fp8GemmArgs& g, cudaStream_t stream) {
  cublasLtHandle_t handle = handle_for_current_device();
  MatmulDesc desc;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.b_scale_inv);  // cuBLASLt's A is our b
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.a_scale_inv);
  desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(g.fast_accum ? 1 : 0));
  if (is_fp8(g.out_type)) {
    desc.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, g.out_scale);
    if (g.amax_scratch != nullptr) desc.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, g.amax_scratch);
  }
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue_of(g));
  if (g.bias != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(cuda_type(g.bias_type)));
  }
  if (g.pre_gelu != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.pre_gelu);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ld_out);
    if (g.pre_gelu_type != g.out_type)
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, int32_t(cuda_type(g.pre_gelu_type)));
  }
  const Layout A(g.b_type, g.k, g.n, g.k);
  const Layout B(g.a_type, g.k, g.m, g.k);
  const Layout C(c_type_of(g), g.n, g.m, g.ld_out);
  const Layout D(g.out_type, g.n, g.m, g.ld_out);
  const cublasLtMatmulAlgo_t algo = cached_algo(handle, desc, A, B, C, D, g);
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // C is read only when accumulating (then C = D = out, float32). Otherwise beta = 0 and C is null: passing D there
  // with a C dtype that differs from D's (FP8 outputs) is refused as an in-place call with mismatched layouts.
  const void* c = g.accumulate ? g.out : nullptr;
  check_cublas(cublasLtMatmul(handle, desc.desc, &alpha, g.b, A.layout, g.a, B.layout, &beta, c, C.layout, g.out,
                              D.layout, &algo, g.workspace, kGemmWorkspaceBytes, stream),
               "cublasLtMatmul");
}

}  // namespace tfp8
