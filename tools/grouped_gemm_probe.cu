// Kernel probe for the grouped family, no torch: times CUTLASS grouped (pointer-array) FP8 GEMMs with uneven, equal
// and single groups, CUTLASS's plain FP8 GEMM on the same tiles, and cuBLASLt's dense FP8 GEMM (its heuristic's
// first choice and each of its next candidates, with their tile / stage / cluster ids), at given shapes; checks every
// output against cuBLASLt run group by group. Fast accumulation throughout (the forward's form).
// Build: tools/grouped_gemm_probe.sh. Run: grouped_gemm_probe [rounds] [cuBLASLt candidates] [G M K N]... (env
// PROBE_SELECT=i,j: only these kernels; PROBE_CHUNK_N=c: also the groups split into column chunks of c). Prints one
// line per shape and variant: median TFLOP/s over rounds (rounds interleaved across variants), ratio to cuBLASLt
// dense, the error.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../csrc/gemm.h"
#include "../csrc/grouped_gemm_rows.h"
#include "grouped_gemm_probe.h"

using namespace tfp8;
using probe::ProbeKernel;
using probe::ProbeOptions;
using probe::ProbeProblem;

namespace {

#define CHECK(expr) TFP8_CUDA_CHECK(expr)
#define CHECK_LT(expr) \
  do { \
    cublasStatus_t s_ = (expr); \
    if (s_ != CUBLAS_STATUS_SUCCESS) { \
      std::fprintf(stderr, "%s: %s\n", #expr, cublasLtGetStatusString(s_)); \
      std::exit(1); \
    } \
  } while (0)

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(size_t bytes) { CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 16))); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill_fp8(Buffer& buf, size_t count, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 0.5f);
  std::vector<__nv_fp8_e4m3> host(count);
  for (auto& v : host) v = __nv_fp8_e4m3(dist(rng));
  CHECK(cudaMemcpy(buf.ptr, host.data(), count, cudaMemcpyHostToDevice));
}

std::vector<float> to_host_bf16(const Buffer& buf, size_t count) {
  std::vector<__nv_bfloat16> host(count);
  CHECK(cudaMemcpy(host.data(), buf.ptr, count * 2, cudaMemcpyDeviceToHost));
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = __bfloat162float(host[i]);
  return out;
}

double relative_error(const std::vector<float>& x, const std::vector<float>& ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(static_cast<double>(x[i]) - ref[i]);
    if (!std::isfinite(d)) return INFINITY;  // (an output left unwritten reads as NaN)
    diff = std::max(diff, d);
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

float time_ms(const std::function<void()>& launch, int runs) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  for (int i = 0; i < runs; ++i) launch();
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / runs;
}

// Group sizes summing to rows from a skewed distribution, one group empty (benchmarks/bench_moe.py's recipe).
std::vector<int64_t> uneven_sizes(int groups, int64_t rows, std::mt19937& rng) {
  std::uniform_real_distribution<double> dist(0.0, 1.0);
  std::vector<double> w(groups);
  for (auto& x : w) x = dist(rng) * dist(rng);
  if (groups > 1) w[groups / 2] = 0;
  double sum = 0;
  for (double x : w) sum += x;
  std::vector<int64_t> sizes(groups);
  int64_t total = 0;
  for (int g = 0; g < groups; ++g) total += sizes[g] = static_cast<int64_t>(std::floor(w[g] / sum * rows));
  sizes[std::max_element(w.begin(), w.end()) - w.begin()] += rows - total;
  return sizes;
}

// Per-group device arrays for groups of rows of a [m, k] with weights b + g * n * k, outputs in d [m, n]. chunk_n > 0
// splits every group's n columns into chunks of chunk_n (the last one shorter), one problem each, listed chunk by
// chunk across the groups (chunk 0 of every group, then chunk 1, ...): the tiles that run at the same time then span
// several experts' weights instead of about one.
struct DeviceArrays {
  std::unique_ptr<Buffer> storage;
  grouped::GroupArrays arrays;
  std::vector<int64_t> sizes;  // rows per group
  int problems = 0;
};

DeviceArrays make_arrays(const std::vector<int64_t>& sizes, const Buffer& a, const Buffer& b, Buffer& d, int64_t n,
                         int64_t k, int64_t chunk_n = 0) {
  const int groups = static_cast<int>(sizes.size());
  if (chunk_n <= 0) chunk_n = n;
  const int chunks = static_cast<int>((n + chunk_n - 1) / chunk_n);
  const int problems = groups * chunks;
  const size_t slot = ((problems * 12 + 255) / 256) * 256;  // each array in a 256-byte aligned slot (shapes: 12 bytes)
  DeviceArrays out;
  out.sizes = sizes;
  out.problems = problems;
  out.storage = std::make_unique<Buffer>(slot * 8);
  std::vector<uint8_t> host(slot * 8, 0);
  auto* shapes = reinterpret_cast<int*>(host.data());
  auto* pa = reinterpret_cast<const void**>(host.data() + slot);
  auto* pb = reinterpret_cast<const void**>(host.data() + 2 * slot);
  auto* pd = reinterpret_cast<void**>(host.data() + 3 * slot);
  auto* lda = reinterpret_cast<int64_t*>(host.data() + 4 * slot);
  auto* ldb = reinterpret_cast<int64_t*>(host.data() + 5 * slot);
  auto* ldd = reinterpret_cast<int64_t*>(host.data() + 6 * slot);
  auto* alpha = reinterpret_cast<float*>(host.data() + 7 * slot);
  std::vector<int64_t> starts(groups, 0);
  for (int g = 1; g < groups; ++g) starts[g] = starts[g - 1] + sizes[g - 1];
  for (int c = 0; c < chunks; ++c) {
    const int64_t col = c * chunk_n, cols = std::min(chunk_n, n - col);
    for (int g = 0; g < groups; ++g) {
      const int p = c * groups + g;
      shapes[3 * p] = static_cast<int>(sizes[g]), shapes[3 * p + 1] = static_cast<int>(cols);
      shapes[3 * p + 2] = static_cast<int>(k);
      pa[p] = static_cast<const uint8_t*>(a.ptr) + starts[g] * k;
      pb[p] = static_cast<const uint8_t*>(b.ptr) + (g * n + col) * k;
      pd[p] = static_cast<__nv_bfloat16*>(d.ptr) + starts[g] * n + col;
      lda[p] = k, ldb[p] = k, ldd[p] = n, alpha[p] = 1.0f;
    }
  }
  CHECK(cudaMemcpy(out.storage->ptr, host.data(), host.size(), cudaMemcpyHostToDevice));
  auto* base = static_cast<uint8_t*>(out.storage->ptr);
  out.arrays = {reinterpret_cast<int*>(base),
                reinterpret_cast<const void**>(base + slot),
                reinterpret_cast<const void**>(base + 2 * slot),
                reinterpret_cast<void**>(base + 3 * slot),
                reinterpret_cast<int64_t*>(base + 4 * slot),
                reinterpret_cast<int64_t*>(base + 5 * slot),
                reinterpret_cast<int64_t*>(base + 6 * slot),
                reinterpret_cast<float*>(base + 7 * slot)};
  return out;
}

// cuBLASLt's dense FP8 GEMM D [m, n] = A [m, k] . B [n, k]ᵀ (fast accumulation), with a chosen algorithm.
struct LtDense {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
  const float* one = nullptr;
  LtDense(int64_t m, int64_t n, int64_t k, const float* one_device, int wanted) : one(one_device) {
    CHECK_LT(cublasLtCreate(&handle));
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    const int8_t fast = 1;
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &one, sizeof(one)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &one, sizeof(one)));
    CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k));  // cuBLASLt's A = our b, column-major
    CHECK_LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kGemmWorkspaceBytes;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    algos.resize(wanted);
    int count = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, wanted, algos.data(), &count));
    algos.resize(count);
    cublasLtMatmulPreferenceDestroy(pref);
  }
  LtDense(const LtDense&) = delete;
  LtDense& operator=(const LtDense&) = delete;
  ~LtDense() {  // (after the stream's work: the reference runs are synchronised before the next group's)
    cudaDeviceSynchronize();
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(handle);
  }
  void run(int index, const void* a, const void* b, void* d, void* workspace) const {
    const float alpha = 1.f, beta = 0.f;
    CHECK_LT(cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &beta, nullptr, ld, d, ld, &algos[index].algo,
                            workspace, kGemmWorkspaceBytes, nullptr));
  }
  std::string config(int index) const {
    auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
      uint32_t v = 0;
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&algos[index].algo, attr, &v, sizeof(v), &written);
      return static_cast<unsigned>(v);
    };
    char text[160];
    std::snprintf(text, sizeof(text), "id %u tile %u stages %u cluster %u inner %u splitk %u swizzle %u",
                  get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
                  get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
    return text;
  }
};

struct Variant {
  std::string name;
  std::function<void()> launch;
  const Buffer* output;                // where it writes
  const std::vector<float>* expected;  // what it should write (null: not checked)
};

void probe_shape(int groups, int64_t m, int64_t k, int64_t n, int rounds, int lt_candidates, std::mt19937& rng) {
  int sm_count = 0;
  CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  Buffer a(m * k), b(groups * n * k), d(m * n * 2), ref(m * n * 2), ref_dense(m * n * 2), one(4);
  Buffer lt_workspace(kGemmWorkspaceBytes), cutlass_workspace(size_t(64) << 20);
  fill_fp8(a, m * k, rng);
  fill_fp8(b, groups * n * k, rng);
  const float unit = 1.f;
  CHECK(cudaMemcpy(one.ptr, &unit, 4, cudaMemcpyHostToDevice));
  const auto uneven = make_arrays(uneven_sizes(groups, m, rng), a, b, d, n, k);
  std::vector<int64_t> equal_sizes(groups, m / groups);
  equal_sizes.back() += m - m / groups * groups;
  const auto equal = make_arrays(equal_sizes, a, b, d, n, k);
  const auto single = make_arrays({m}, a, b, d, n, k);
  // PROBE_CHUNK_N=c: also the uneven and equal groups split into column chunks of c, listed chunk-major
  const int64_t chunk_n = std::getenv("PROBE_CHUNK_N") ? std::atoll(std::getenv("PROBE_CHUNK_N")) : 0;
  const auto uneven_chunked = make_arrays(uneven.sizes, a, b, d, n, k, chunk_n);
  const auto equal_chunked = make_arrays(equal_sizes, a, b, d, n, k, chunk_n);

  // References: cuBLASLt group by group (uneven and equal groups), and dense with group 0's weight.
  auto reference = [&](const std::vector<int64_t>& sizes, Buffer& out) {
    int64_t start = 0;
    for (size_t g = 0; g < sizes.size(); ++g) {
      if (sizes[g] > 0) {
        LtDense lt(sizes[g], n, k, static_cast<const float*>(one.ptr), 1);
        lt.run(0, static_cast<const uint8_t*>(a.ptr) + start * k, static_cast<const uint8_t*>(b.ptr) + g * n * k,
               static_cast<__nv_bfloat16*>(out.ptr) + start * n, lt_workspace.ptr);
      }
      start += sizes[g];
    }
    CHECK(cudaDeviceSynchronize());
    return to_host_bf16(out, m * n);
  };
  const auto expected_uneven = reference(uneven.sizes, ref);
  const auto expected_equal = reference(equal.sizes, ref);
  const auto expected_dense = reference({m}, ref_dense);

  std::vector<Variant> variants;
  LtDense lt(m, n, k, static_cast<const float*>(one.ptr), lt_candidates);
  for (int i = 0; i < static_cast<int>(lt.algos.size()); ++i) {
    variants.push_back({"cublaslt dense #" + std::to_string(i) + " (" + lt.config(i) + ")",
                        [&, i] { lt.run(i, a.ptr, b.ptr, d.ptr, lt_workspace.ptr); }, &d, &expected_dense});
  }
  const ProbeKernel kernels[] = {probe::probe_kernel_0(),  probe::probe_kernel_1(),  probe::probe_kernel_2(),
                                 probe::probe_kernel_3(),  probe::probe_kernel_4(),  probe::probe_kernel_5(),
                                 probe::probe_kernel_6(),  probe::probe_kernel_7(),  probe::probe_kernel_8(),
                                 probe::probe_kernel_9(),  probe::probe_kernel_10(), probe::probe_kernel_11(),
                                 probe::probe_kernel_12(), probe::probe_kernel_13()};
  // PROBE_SELECT=i,j,...: only these kernels (indices into the list above)
  const char* select = std::getenv("PROBE_SELECT");
  auto selected = [&](int index) {
    if (select == nullptr || *select == 0) return true;
    const std::string list = std::string(",") + select + ",";
    return list.find("," + std::to_string(index) + ",") != std::string::npos;
  };
  auto problem_of = [&](const DeviceArrays& arrays) {
    ProbeProblem p;
    p.groups = arrays.problems;
    p.arrays = arrays.arrays;
    p.a = a.ptr, p.b = b.ptr, p.d = d.ptr, p.alpha = static_cast<const float*>(one.ptr);
    p.m = m, p.n = n, p.k = k;
    p.sm_count = sm_count;
    p.workspace_bytes = size_t(64) << 20;
    return p;
  };
  // Our own rows kernel (csrc/grouped_gemm_rows_kernel.cuh) on the same groups: it reads the groups' cumulative ends.
  auto offsets_of = [&](const std::vector<int64_t>& sizes) {
    std::vector<int32_t> ends(sizes.size());
    int64_t end = 0;
    for (size_t g = 0; g < sizes.size(); ++g) ends[g] = static_cast<int32_t>(end += sizes[g]);
    auto buffer = std::make_unique<Buffer>(ends.size() * 4);
    CHECK(cudaMemcpy(buffer->ptr, ends.data(), ends.size() * 4, cudaMemcpyHostToDevice));
    return buffer;
  };
  const auto uneven_offs = offsets_of(uneven.sizes), equal_offs = offsets_of(equal_sizes), single_offs = offsets_of({m});
  auto add_ours = [&](const std::string& label, const Buffer& offs, int problem_groups,
                      const std::vector<float>* expected) {
    GroupedFp8GemmArgs args;
    args.a = a.ptr, args.b = b.ptr, args.out = d.ptr, args.offs = static_cast<const int32_t*>(offs.ptr);
    args.groups = problem_groups, args.rows = m, args.n = n, args.k = k;
    args.b_group_stride = n * k, args.b_row_stride = k;
    args.a_scale_inv = args.b_scale_inv = static_cast<const float*>(one.ptr);
    args.fast_accumulation = true;
    if (!grouped::rows_kernel_supports(args)) return;
    variants.push_back({"ours " + label,
                        [args, label] {
                          const char* error = grouped::launch_rows_kernel(args, nullptr);
                          if (error) {
                            std::fprintf(stderr, "ours %s: %s\n", label.c_str(), error);
                            std::exit(1);
                          }
                        },
                        &d, expected});
  };
  add_ours("uneven", *uneven_offs, groups, &expected_uneven);
  add_ours("equal", *equal_offs, groups, &expected_equal);
  add_ours("one group", *single_offs, 1, &expected_dense);
  auto add = [&](const ProbeKernel& kernel, const std::string& label, const ProbeProblem& p, ProbeOptions options,
                 const std::vector<float>* expected) {
    const std::string name = std::string(kernel.name) + " " + label + " sw" + std::to_string(options.swizzle) + " r" +
                             std::to_string(options.raster);
    variants.push_back({name,
                        [&, kernel, p, options, name] {
                          const char* error = kernel.run(p, options, cutlass_workspace.ptr, nullptr);
                          if (error) {
                            std::fprintf(stderr, "%s: %s\n", name.c_str(), error);
                            std::exit(1);
                          }
                        },
                        &d, expected});
  };
  for (int index = 0; index < static_cast<int>(std::size(kernels)); ++index) {
    const ProbeKernel& kernel = kernels[index];
    if (!selected(index)) continue;
    if (kernel.grouped) {
      add(kernel, "uneven", problem_of(uneven), {1, 1}, &expected_uneven);
      add(kernel, "equal", problem_of(equal), {1, 1}, &expected_equal);
      add(kernel, "one group", problem_of(single), {1, 1}, &expected_dense);
      add(kernel, "uneven", problem_of(uneven), {2, 1}, &expected_uneven);
      if (chunk_n > 0) {
        add(kernel, "uneven chunked", problem_of(uneven_chunked), {1, 1}, &expected_uneven);
        add(kernel, "equal chunked", problem_of(equal_chunked), {1, 1}, &expected_equal);
      }
    } else {
      add(kernel, "dense", problem_of(single), {1, 0}, &expected_dense);
      add(kernel, "dense", problem_of(single), {1, 2}, &expected_dense);
    }
  }

  std::vector<double> errors(variants.size(), 0.0);
  for (size_t v = 0; v < variants.size(); ++v) {
    std::fprintf(stderr, "checking %s\n", variants[v].name.c_str());
    CHECK(cudaMemset(d.ptr, 0xff, m * n * 2));
    variants[v].launch();
    CHECK(cudaDeviceSynchronize());
    errors[v] = relative_error(to_host_bf16(*variants[v].output, m * n), *variants[v].expected);
  }
  const double flop = 2.0 * m * n * k;
  std::vector<int> runs(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    const float once = time_ms(variants[v].launch, 3);
    runs[v] = std::max(5, static_cast<int>(2.0 / std::max(once, 1e-3f)));
  }
  std::vector<std::vector<double>> tflops(variants.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < variants.size(); ++i) {
      const size_t v = (i + r) % variants.size();
      tflops[v].push_back(flop / (time_ms(variants[v].launch, runs[v]) * 1e-3) / 1e12);
    }
  }
  std::vector<double> medians(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    auto t = tflops[v];
    std::sort(t.begin(), t.end());
    medians[v] = t[t.size() / 2];
  }
  std::printf("\n## G=%d M=%lld K=%lld N=%lld (uneven sizes min %lld max %lld)\n", groups, static_cast<long long>(m),
              static_cast<long long>(k), static_cast<long long>(n),
              static_cast<long long>(*std::min_element(uneven.sizes.begin(), uneven.sizes.end())),
              static_cast<long long>(*std::max_element(uneven.sizes.begin(), uneven.sizes.end())));
  for (size_t v = 0; v < variants.size(); ++v) {
    std::printf("%-80s %8.1f TFLOP/s (min %7.1f max %7.1f) / cublaslt #0 %.3f  err %.1e\n", variants[v].name.c_str(),
                medians[v], *std::min_element(tflops[v].begin(), tflops[v].end()),
                *std::max_element(tflops[v].begin(), tflops[v].end()), medians[v] / medians[0], errors[v]);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const int lt_candidates = argc > 2 ? std::atoi(argv[2]) : 6;
  std::mt19937 rng(1234);
  std::vector<int64_t> shapes;
  for (int i = 3; i + 3 < argc; i += 4) {
    shapes.insert(shapes.end(),
                  {std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3])});
  }
  if (shapes.empty()) {
    // bench_moe.py's grouped shapes: DeepSeek-V2-Lite's routed experts, 64 x 256 rows, 8 experts of 2048 rows.
    shapes = {64, 49152, 2048, 2816, 64, 16384, 2048, 1536, 8, 16384, 4096, 28672};
  }
  for (size_t i = 0; i < shapes.size(); i += 4) {
    probe_shape(static_cast<int>(shapes[i]), shapes[i + 1], shapes[i + 2], shapes[i + 3], rounds, lt_candidates, rng);
  }
  return 0;
}
