// rope_fwd / rope_bwd: one kernel, no shared memory. A thread takes one channel block of one token (CH channel pairs
// of the rotary part, or CH pass-through channels) for up to kHeadsPerThread heads: it issues the loads of all its
// heads first, computes the cos / sin of its block's angles once while they are in flight (accurate sincosf: angles
// reach the sequence length in radians, where __sincosf's error grows with |angle|), then rotates and stores each
// head. CH = 16 bytes of T when the strides, pointers and dims allow it, else one element (two when interleaved: a
// pair). Products and sums are rounded one by one (no FMA contraction), as the CPU reference computes them.
#include <algorithm>
#include <stdexcept>

#include "rope.h"

namespace tfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kHeadsPerThread = 8;  // heads sharing one sincosf of each angle
constexpr int kBlocksPerSm = 8;

// N elements of T; VECTOR: one 16-byte access (src and v 16-byte aligned).
template <bool VECTOR, int N, typename T>
__device__ __forceinline__ void load(const T* src, T (&v)[N]) {
  if constexpr (VECTOR) {
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = src[k];
  }
}

template <bool VECTOR, int N, typename T>
__device__ __forceinline__ void store(T* dst, const T (&v)[N]) {
  if constexpr (VECTOR) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = v[k];
  }
}

// The channel pair (a, b) with angles fa, fb (as cos / sin). Forward: (a cos fa - b sin fa, b cos fb + a sin fb);
// inverse, the forward's transpose: (a cos fa + b sin fb, b cos fb - a sin fa).
template <bool INVERSE, typename T>
__device__ __forceinline__ void rotate_pair(T& a, T& b, float ca, float sa, float cb, float sb) {
  const float xa = to_float(a), xb = to_float(b);
  if constexpr (INVERSE) {
    a = from_float<T>(__fadd_rn(__fmul_rn(xa, ca), __fmul_rn(xb, sb)));
    b = from_float<T>(__fsub_rn(__fmul_rn(xb, cb), __fmul_rn(xa, sa)));
  } else {
    a = from_float<T>(__fsub_rn(__fmul_rn(xa, ca), __fmul_rn(xb, sa)));
    b = from_float<T>(__fadd_rn(__fmul_rn(xb, cb), __fmul_rn(xa, sb)));
  }
}

// Work items: (token, head group, channel block), the channel block fastest. Head group g takes heads g, g + groups,
// g + 2 * groups, .. (groups = ceil(h / kHeadsPerThread)), so a warp's loads of one step cover neighbouring heads.
// Channel blocks 0 .. rot_blocks - 1 rotate (non-interleaved: channels [c, c + CH) with [c + half, c + half + CH);
// interleaved: [c, c + CH) holding CH / 2 pairs), the next pass_blocks copy kPassCh channels from rot_dim on.
template <typename T, int CH, bool INTERLEAVED, bool INVERSE>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeArgs a, int rot_blocks, int pass_blocks, int groups) {
  constexpr bool kVector = CH * sizeof(T) == 16;
  constexpr int kPassCh = kVector ? CH : 1;
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const int blocks = rot_blocks + pass_blocks, heads = static_cast<int>(a.h), half = static_cast<int>(a.rot_dim / 2);
  const int64_t items = a.s * a.b * groups * blocks;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < items; i += int64_t{gridDim.x} * kThreads) {
    const int block = static_cast<int>(i % blocks);
    const int64_t token_group = i / blocks;
    const int group = static_cast<int>(token_group % groups);
    const int64_t tok = token_group / groups;
    const int64_t si = a.seq_first ? tok / a.b : tok % a.s;
    const int64_t bi = a.seq_first ? tok % a.b : tok / a.s;
    const T* src = x + si * a.x_stride_s + bi * a.x_stride_b;
    T* dst = out + si * a.out_stride_s + bi * a.out_stride_b;
    if (block >= rot_blocks) {
      const int col = static_cast<int>(a.rot_dim) + (block - rot_blocks) * kPassCh;
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        const int head = group + j * groups;
        if (head >= heads) break;
        alignas(16) T v[kPassCh];
        load<kVector>(src + head * a.x_stride_h + col, v);
        store<kVector>(dst + head * a.out_stride_h + col, v);
      }
      continue;
    }
    const int col_a = block * CH, col_b = INTERLEAVED ? col_a : col_a + half;
    alignas(16) T va[kHeadsPerThread][CH], vb[kHeadsPerThread][CH];
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      const int head = group + j * groups;
      if (head < heads) {
        load<kVector>(src + head * a.x_stride_h + col_a, va[j]);
        if constexpr (!INTERLEAVED) load<kVector>(src + head * a.x_stride_h + col_b, vb[j]);
      }
    }
    const float* f = a.freqs + si * a.freqs_stride_s + bi * a.freqs_stride_b;
    float ca[CH], sa[CH], cb[CH], sb[CH];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      sincosf(__ldg(f + col_a + k), &sa[k], &ca[k]);
      if constexpr (!INTERLEAVED) sincosf(__ldg(f + col_b + k), &sb[k], &cb[k]);
    }
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      const int head = group + j * groups;
      if (head < heads) {
        if constexpr (INTERLEAVED) {
#pragma unroll
          for (int k = 0; k < CH; k += 2) {
            rotate_pair<INVERSE>(va[j][k], va[j][k + 1], ca[k], sa[k], ca[k + 1], sa[k + 1]);
          }
        } else {
#pragma unroll
          for (int k = 0; k < CH; ++k) rotate_pair<INVERSE>(va[j][k], vb[j][k], ca[k], sa[k], cb[k], sb[k]);
          store<kVector>(dst + head * a.out_stride_h + col_b, vb[j]);
        }
        store<kVector>(dst + head * a.out_stride_h + col_a, va[j]);
      }
    }
  }
}

int sm_count() {
  int device = 0, count = 0;
  TFP8_CUDA_CHECK(cudaGetDevice(&device));
  TFP8_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether 16-byte accesses of T fit: every row, head and channel block the kernel touches starts 16-byte aligned.
template <typename T>
bool vector_fits(const RopeArgs& a) {
  constexpr int v = 16 / sizeof(T);
  const int64_t pair_span = a.interleaved ? a.rot_dim : a.rot_dim / 2;
  return aligned(a.x, 16) && aligned(a.out, 16) && a.d % v == 0 && a.rot_dim % v == 0 && pair_span % v == 0 &&
         a.x_stride_s % v == 0 && a.x_stride_b % v == 0 && a.x_stride_h % v == 0 && a.out_stride_s % v == 0 &&
         a.out_stride_b % v == 0 && a.out_stride_h % v == 0;
}

template <typename T, int CH, bool INTERLEAVED, bool INVERSE>
void launch(const RopeArgs& a, cudaStream_t stream) {
  constexpr int pass_ch = CH * sizeof(T) == 16 ? CH : 1;
  const int rot_blocks = static_cast<int>((INTERLEAVED ? a.rot_dim : a.rot_dim / 2) / CH);
  const int pass_blocks = static_cast<int>((a.d - a.rot_dim) / pass_ch);
  const int groups = static_cast<int>((a.h + kHeadsPerThread - 1) / kHeadsPerThread);
  const int64_t items = a.s * a.b * groups * (rot_blocks + pass_blocks);
  const int grid = static_cast<int>(
      std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t{sm_count()} * kBlocksPerSm));
  rope_kernel<T, CH, INTERLEAVED, INVERSE><<<grid, kThreads, 0, stream>>>(a, rot_blocks, pass_blocks, groups);
  TFP8_CUDA_CHECK(cudaGetLastError());
}

template <typename T, bool INTERLEAVED, bool INVERSE>
void launch_for_layout(const RopeArgs& a, cudaStream_t stream) {
  if (vector_fits<T>(a)) launch<T, 16 / sizeof(T), INTERLEAVED, INVERSE>(a, stream);
  else launch<T, INTERLEAVED ? 2 : 1, INTERLEAVED, INVERSE>(a, stream);
}

template <typename T>
void launch_for_type(const RopeArgs& a, bool inverse, cudaStream_t stream) {
  if (a.interleaved) {
    inverse ? launch_for_layout<T, true, true>(a, stream) : launch_for_layout<T, true, false>(a, stream);
  } else {
    inverse ? launch_for_layout<T, false, true>(a, stream) : launch_for_layout<T, false, false>(a, stream);
  }
}

}  // namespace

void launch_rope(const RopeArgs& args, DType dtype, bool inverse, cudaStream_t stream) {
  if (args.s * args.b * args.h * args.d == 0) return;
  switch (dtype) {
    case DType::kFloat32: launch_for_type<float>(args, inverse, stream); break;
    case DType::kFloat16: launch_for_type<__half>(args, inverse, stream); break;
    case DType::kBFloat16: launch_for_type<__nv_bfloat16>(args, inverse, stream); break;
    default: throw std::invalid_argument("rope: expected a float32, float16 or bfloat16 dtype");
  }
}

}  // namespace tfp8
