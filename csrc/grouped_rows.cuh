// The group bookkeeping the grouped families' setup kernels share (device code, included: no relocatable device code).
#pragma once
#include <cstdint>

namespace tfp8::grouped {

// Group g's rows [start, end) of the grouped dimension, clamped to [0, rows] (an end past rows is the contract's
// "unspecified" case: clamping keeps every access in bounds).
inline __device__ void group_rows(const int32_t* offs, int g, int64_t rows, int64_t* start, int64_t* end) {
  const int64_t hi = min(static_cast<int64_t>(offs[g]), rows);
  const int64_t lo = g == 0 ? 0 : min(static_cast<int64_t>(offs[g - 1]), rows);
  *start = max(lo, int64_t{0});
  *end = max(hi, *start);
}

}  // namespace tfp8::grouped
