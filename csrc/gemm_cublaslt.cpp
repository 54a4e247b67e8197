// FP8 GEMM through cuBLASLt. Row-major TN maps onto cuBLASLt's column-major as out^T = b . a^T:
// cuBLASLt A = b (TRANSA = T), B = a (TRANSB = N), m = n, n = m, k = k, lda = ldb = k, ldc = ldd = ld_out.
//
// Host cost: the setup of a problem (the matmul descriptor with its fixed attributes, the four matrix layouts, the
// heuristic's algorithm and its workspace size) is a Plan, built once per thread and PlanKey (every argument but the
// pointers' values) and kept in a thread_local table. A call looks its plan up, sets the pointer attributes (scales,
// amax, bias, GELU aux) on the plan's descriptor and runs: no lock, no descriptor creation, no heuristic query.
// A descriptor is only ever used by the thread that owns it. One handle per device, shared, kept for the process.
//
// Algorithm choice (autotuning, on unless TFP8_GEMM_AUTOTUNE=0): the fastest of the heuristic's first
// kAutotuneCandidates answers, timed on the plan's first call outside CUDA graph capture: each candidate runs once to
// warm up and kAutotuneRuns times to size its timed stretch (enough runs for kAutotuneStretchMs), then kAutotuneRounds
// rounds time every candidate's stretch between two events on the call's stream, round-robin, each candidate keeping
// its best round (stretches of 3 runs, or sized from one cold run, let launch and clock jitter pick kernels that were
// slower in steady state). The host waits for the events; once per plan. The candidates write the call's own
// output, workspace and GELU aux; the chosen algorithm then runs once more, so the output is its result.
// Accumulating calls (C = D), calls inside a capture and TFP8_GEMM_AUTOTUNE=0 take the heuristic's first answer.
// (H100: the first answer was the fastest for most split-accumulator GEMMs, and 10-18% slower than the best for
// fast-accumulation ones at M*N*K >= 1.4e11: benchmarks/RESULTS.md.)
// TFP8_GEMM_AUTOTUNE_CANDIDATES=n asks for n answers instead of 8 (block-scaled GEMMs, H200: the heuristic offered
// 1 algorithm for 1x128 x 128x128 and 3-7 for 1x128 x 1x128, so 8 already takes them all).
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstdio>
#include <vector>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "gemm.h"

namespace tfp8 {
namespace {

// Plans a thread keeps before it drops them all (a bound for workloads whose shapes keep changing).
constexpr size_t kMaxPlansPerThread = 1024;
constexpr int kAutotuneCandidates = 8;
constexpr int kAutotuneRuns = 3;            // timed runs per stretch, at least
constexpr int kAutotuneMaxRuns = 256;       // ... and at most
constexpr float kAutotuneStretchMs = 1.0f;  // a stretch's length sought
constexpr int kAutotuneRounds = 2;

// TFP8_GEMM_AUTOTUNE: "0" off, unset or anything else on, "verbose" on and printing each plan's candidate times.
int autotune_mode() {
  static const int mode = [] {
    const char* value = std::getenv("TFP8_GEMM_AUTOTUNE");
    if (value == nullptr) return 1;
    return std::string(value) == "0" ? 0 : std::string(value) == "verbose" ? 2 : 1;
  }();
  return mode;
}

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

// Heuristic answers to time: TFP8_GEMM_AUTOTUNE_CANDIDATES when set to a positive number, else kAutotuneCandidates.
int autotune_candidates() {
  static const int count = [] {
    const char* value = std::getenv("TFP8_GEMM_AUTOTUNE_CANDIDATES");
    const int n = value == nullptr ? 0 : std::atoi(value);
    return n > 0 ? n : kAutotuneCandidates;
  }();
  return count;
}

cublasLtMatmulMatrixScale_t cublas_scale_mode(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kTensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case ScaleMode::kVec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::kBlock128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  throw std::invalid_argument("unknown ScaleMode");
}

const char* scale_mode_name(ScaleMode mode) {
  return mode == ScaleMode::kVec128 ? "1x128" : mode == ScaleMode::kBlock128 ? "128x128" : "tensor";
}

cublasLtHandle_t handle_for_device(int device) {
  static std::mutex mutex;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  cublasLtHandle_t& handle = handles[device];
  if (handle == nullptr) check_cublas(cublasLtCreate(&handle), "cublasLtCreate");
  return handle;
}

// Largest power of two <= 256 dividing the address: the alignment the chosen algorithm may assume.
uint32_t alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  return address % 256 == 0 ? 256 : uint32_t(1) << __builtin_ctzll(address);
}

cublasLtEpilogue_t epilogue_of(const Fp8GemmArgs& g) {
  if (g.pre_gelu != nullptr) return g.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  return g.bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// C's dtype: the output's, except for FP8 outputs, where cuBLASLt wants BF16 or FP16 (the bias dtype).
DType c_type_of(const Fp8GemmArgs& g) {
  if (!is_fp8(g.out_type)) return g.out_type;
  return g.bias != nullptr ? g.bias_type : DType::kBFloat16;
}

// Everything the descriptor, the layouts and the algorithm choice depend on: device, shape, dtypes, epilogue, which
// optional pointers are set, accumulation mode and the operands' alignment classes. Two calls with equal keys differ
// only in pointer values, which are set on the descriptor per call.
using PlanKey = std::array<int64_t, 18>;

PlanKey key_of(const Fp8GemmArgs& g, int device) {
  const int64_t flags = int64_t(g.accumulate) | int64_t(g.fast_accum) << 1 | int64_t(g.amax_scratch != nullptr) << 2 |
                        int64_t(g.residual != nullptr) << 3 | int64_t(g.a_scale_mode) << 4 |
                        int64_t(g.b_scale_mode) << 6;
  return {device,
          g.m,
          g.n,
          g.k,
          g.ld_out,
          int64_t(g.a_type),
          int64_t(g.b_type),
          int64_t(g.out_type),
          int64_t(c_type_of(g)),
          g.bias ? int64_t(g.bias_type) : -1,
          g.pre_gelu ? int64_t(g.pre_gelu_type) : -1,
          int64_t(epilogue_of(g)),
          flags,
          alignment(g.a),
          alignment(g.b),
          alignment(g.out),
          g.pre_gelu ? alignment(g.pre_gelu) : 0,
          g.residual ? alignment(g.residual) : 0};
}

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t v : key) h = (h ^ uint64_t(v)) * 0x100000001b3ull;
    return size_t(h ^ (h >> 32));
  }
};

std::string describe(const Fp8GemmArgs& g) {
  return std::string("a ") + torch_name(g.a_type) + ", b " + torch_name(g.b_type) + ", out " + torch_name(g.out_type) +
         (g.bias ? std::string(", bias ") + torch_name(g.bias_type) : "") +
         (g.pre_gelu ? std::string(", gelu (pre_gelu ") + torch_name(g.pre_gelu_type) + ")" : "") +
         (g.accumulate ? ", accumulate" : "") + (g.residual ? ", residual" : "") +
         (g.a_scale_mode != ScaleMode::kTensor || g.b_scale_mode != ScaleMode::kTensor
              ? std::string(", block scales a ") + scale_mode_name(g.a_scale_mode) + " b " +
                    scale_mode_name(g.b_scale_mode)
              : "") +
         ", M=" + std::to_string(g.m) + " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k);
}

// RAII owners of the cuBLASLt descriptors (not copyable: each destroys its own).
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  MatmulDesc() { check_cublas(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate"); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
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
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
  ~Layout() { cublasLtMatrixLayoutDestroy(layout); }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { check_cublas(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate"); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  ~Preference() { cublasLtMatmulPreferenceDestroy(pref); }
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), "PreferenceSetAttribute");
  }
};

// The cuBLASLt setup of one PlanKey. The descriptor holds the fixed attributes; set_pointers writes the per-call ones.
struct Plan {
  cublasLtHandle_t handle;
  MatmulDesc desc;
  Layout a, b, c, d;  // cuBLASLt's A (our b), B (our a), C and D (out)
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes;  // what `algo` needs; until tuned, what the largest candidate needs
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;  // left to time (autotuning), else empty

  Plan(const Fp8GemmArgs& g, cublasLtHandle_t handle)
      : handle(handle),
        a(g.b_type, g.k, g.n, g.k),
        b(g.a_type, g.k, g.m, g.k),
        c(c_type_of(g), g.n, g.m, g.ld_out),
        d(g.out_type, g.n, g.m, g.ld_out) {
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(g.fast_accum ? 1 : 0));
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue_of(g));
    if (g.a_scale_mode != ScaleMode::kTensor || g.b_scale_mode != ScaleMode::kTensor) {
      desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(cublas_scale_mode(g.b_scale_mode)));  // cuBLASLt's A is our b
      desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(cublas_scale_mode(g.a_scale_mode)));
    }
    if (g.bias != nullptr) desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(cuda_type(g.bias_type)));
    if (g.pre_gelu != nullptr) {
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ld_out);
      if (g.pre_gelu_type != g.out_type)
        desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, int32_t(cuda_type(g.pre_gelu_type)));
    }
    set_pointers(g);  // the heuristic sees which of them are set (an amax pointer narrows the choice)
    choose_algo(g);
  }

  // Which pointers are set is part of the key, so each call overwrites exactly the attributes the plan was built with.
  void set_pointers(const Fp8GemmArgs& g) {
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.b_scale_inv);  // cuBLASLt's A is our b
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.a_scale_inv);
    if (is_fp8(g.out_type)) {
      desc.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, g.out_scale);
      if (g.amax_scratch != nullptr) desc.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, g.amax_scratch);
    }
    if (g.bias != nullptr) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    if (g.pre_gelu != nullptr) desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.pre_gelu);
  }

 private:
  void choose_algo(const Fp8GemmArgs& g) {
    Preference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kGemmWorkspaceBytes));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.b));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.a));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.residual != nullptr ? g.residual : g.out));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.out));
    const int wanted = autotune_mode() && !g.accumulate ? autotune_candidates() : 1;
    std::vector<cublasLtMatmulHeuristicResult_t> results(wanted);
    int count = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, a.layout, b.layout, c.layout, d.layout,
                                                           pref.pref, wanted, results.data(), &count);
    if (status != CUBLAS_STATUS_SUCCESS || count == 0)
      throw std::runtime_error("fp8_gemm: this combination is not supported by cuBLASLt (" + describe(g) +
                               "): " + cublasLtGetStatusString(status));
    algo = results[0].algo;
    workspace_bytes = results[0].workspaceSize;
    if (count > 1) {
      candidates.assign(results.begin(), results.begin() + count);
      for (const auto& r : candidates) workspace_bytes = std::max(workspace_bytes, r.workspaceSize);
    }
  }
};

// Runs the plan's algorithm `algo` on g's pointers (set on the descriptor by the caller).
void run(Plan& plan, const cublasLtMatmulAlgo_t& algo, const Fp8GemmArgs& g, cudaStream_t stream) {
  const float alpha = 1.0f, beta = g.accumulate || g.residual != nullptr ? 1.0f : 0.0f;
  // C is read only when accumulating (then C = D = out, float32) or adding a residual (C = residual, D's layout).
  // Otherwise beta = 0 and C is null: passing D there with a C dtype that differs from D's (FP8 outputs) is refused
  // as an in-place call with mismatched layouts.
  const void* c = g.accumulate ? g.out : g.residual;
  check_cublas(cublasLtMatmul(plan.handle, plan.desc.desc, &alpha, g.b, plan.a.layout, g.a, plan.b.layout, &beta, c,
                              plan.c.layout, g.out, plan.d.layout, &algo, g.workspace, g.workspace_bytes, stream),
               "cublasLtMatmul");
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TFP8_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Milliseconds of `runs` back-to-back runs of `algo` on g, between two events on the stream.
float time_runs(Plan& plan, const cublasLtMatmulAlgo_t& algo, const Fp8GemmArgs& g, cudaStream_t stream, int runs,
                cudaEvent_t start, cudaEvent_t end) {
  TFP8_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < runs; ++r) run(plan, algo, g, stream);
  TFP8_CUDA_CHECK(cudaEventRecord(end, stream));
  TFP8_CUDA_CHECK(cudaEventSynchronize(end));
  float ms = 0.0f;
  TFP8_CUDA_CHECK(cudaEventElapsedTime(&ms, start, end));
  return ms;
}

// Times plan.candidates on g (see the file comment), keeps the fastest as plan.algo and clears the candidates.
void autotune(Plan& plan, const Fp8GemmArgs& g, cudaStream_t stream) {
  cudaEvent_t start, end;
  TFP8_CUDA_CHECK(cudaEventCreate(&start));
  TFP8_CUDA_CHECK(cudaEventCreate(&end));
  struct Timed {
    size_t index;   // into plan.candidates
    int runs;       // per timed stretch
    float best_ms;  // per run, over the rounds
  };
  std::vector<Timed> timed;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const auto& candidate = plan.candidates[i];
    if (candidate.workspaceSize > g.workspace_bytes) continue;
    run(plan, candidate.algo, g, stream);  // (warm-up: its launch gap from an idle stream would count below)
    const float estimate_ms = time_runs(plan, candidate.algo, g, stream, kAutotuneRuns, start, end) / kAutotuneRuns;
    const int runs = std::clamp(static_cast<int>(kAutotuneStretchMs / std::max(estimate_ms, 1e-3f)), kAutotuneRuns,
                                kAutotuneMaxRuns);
    timed.push_back({i, runs, -1.0f});
  }
  for (int round = 0; round < kAutotuneRounds; ++round)
    for (Timed& t : timed) {
      const float ms = time_runs(plan, plan.candidates[t.index].algo, g, stream, t.runs, start, end) / t.runs;
      if (t.best_ms < 0 || ms < t.best_ms) t.best_ms = ms;
    }
  TFP8_CUDA_CHECK(cudaEventDestroy(start));
  TFP8_CUDA_CHECK(cudaEventDestroy(end));
  size_t best = 0;
  float best_ms = -1.0f;
  std::string report;
  for (const Timed& t : timed) {
    if (best_ms < 0 || t.best_ms < best_ms) best_ms = t.best_ms, best = t.index;
    report += " " + std::to_string(t.best_ms) + " (x" + std::to_string(t.runs) + ")";
  }
  if (autotune_mode() == 2)
    std::fprintf(stderr, "tfp8 GEMM autotune (%s): ms per candidate%s; chose %zu\n", describe(g).c_str(),
                 report.c_str(), best);
  plan.algo = plan.candidates[best].algo;
  plan.workspace_bytes = plan.candidates[best].workspaceSize;
  plan.candidates.clear();
}

// This thread's plan for g on the current device, built on first use.
Plan& plan_for(const Fp8GemmArgs& g) {
  thread_local std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans;
  int device = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  const PlanKey key = key_of(g, device);
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>(g, handle_for_device(device));
  if (plans.size() >= kMaxPlansPerThread) plans.clear();
  return *plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

size_t fp8_gemm_workspace_bytes(const Fp8GemmArgs& g) { return plan_for(g).workspace_bytes; }

void fp8_gemm_cublaslt(const Fp8GemmArgs& g, cudaStream_t stream) {
  Plan& plan = plan_for(g);
  if (g.workspace_bytes < plan.workspace_bytes)
    throw std::invalid_argument("fp8_gemm_cublaslt: workspace of " + std::to_string(g.workspace_bytes) +
                                " bytes, the algorithm needs " + std::to_string(plan.workspace_bytes));
  plan.set_pointers(g);
  if (!plan.candidates.empty() && !capturing(stream)) autotune(plan, g, stream);
  run(plan, plan.algo, g, stream);
}

}  // namespace tfp8
