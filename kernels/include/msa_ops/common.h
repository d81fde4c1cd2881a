// Shared definitions for the CPU and CUDA implementations of msa_ops.
// Everything here is usable from host and device code (MSA_HD).
#ifndef MSA_OPS_COMMON_H_
#define MSA_OPS_COMMON_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MSA_HD __host__ __device__
#else
#define MSA_HD
#endif

#define MSA_OPS_VERSION_STRING "0.1.0"

namespace msa_ops {

// Split-K granularity (SEMANTICS.md §6) and the processing tile of keys.
constexpr int64_t kSplitKBlockN = 64;
constexpr int64_t kBlockN = 64;
// MiniMax sparse attention: one block = one page of 128 tokens, head dim 128.
constexpr int64_t kMsaBlockSize = 128;
constexpr int64_t kMsaHeadDim = 128;
constexpr int64_t kMaxPartitions = 1 << 16;

// Mask codes of the FFI contract.
enum MaskCode : int64_t {
  kMaskNull = 0,
  kMaskCausal = 1,
  kMaskSlidingWindowCausal = 2,
  kMaskSlidingWindowNonCausal = 3,
  kMaskChunkedCausal = 4,
};

MSA_HD inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
MSA_HD inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
MSA_HD inline int64_t iclamp(int64_t x, int64_t lo, int64_t hi) { return imin(imax(x, lo), hi); }
MSA_HD inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MSA_HD inline int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
// Python-style floor division (b > 0).
MSA_HD inline int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

}  // namespace msa_ops

#endif  // MSA_OPS_COMMON_H_
