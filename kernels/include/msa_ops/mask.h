// Mask predicates (SPEC.md "Masks", SEMANTICS.md §3). For every mask the keys visible to the query at
// position p form one interval [lo, hi) of key indices, intersected with [0, kmax) where
// kmax = min(num_keys, S_max) bounds the keys that can exist.
#ifndef MSA_OPS_MASK_H_
#define MSA_OPS_MASK_H_

#include <cstdint>

#include "msa_ops/common.h"

namespace msa_ops {

struct KeyInterval {
  int64_t lo;
  int64_t hi;  // exclusive
  MSA_HD bool empty() const { return hi <= lo; }
};

// Windowed masks need W > 0; the handlers reject W <= 0 before calling this. W is clamped to keep the
// arithmetic in range for any int64 attribute.
MSA_HD inline KeyInterval visible_keys(int64_t mask, int64_t window, int64_t p, int64_t kmax) {
  const int64_t w = iclamp(window, 1, int64_t{1} << 40);
  int64_t lo = 0, hi = kmax;
  switch (mask) {
    case kMaskNull:
      break;
    case kMaskCausal:
      hi = imin(kmax, p + 1);
      break;
    case kMaskSlidingWindowCausal:  // k <= p and p - k < W
      lo = p - w + 1;
      hi = imin(kmax, p + 1);
      break;
    case kMaskSlidingWindowNonCausal:  // k + W > p
      lo = p - w + 1;
      break;
    case kMaskChunkedCausal:  // k <= p and p // W == k // W
      lo = floor_div(p, w) * w;
      hi = imin(kmax, p + 1);
      break;
    default:
      hi = 0;
      break;
  }
  lo = imax(lo, 0);
  if (hi < lo) hi = lo;
  return KeyInterval{lo, hi};
}

MSA_HD inline bool mask_visible(int64_t mask, int64_t window, int64_t p, int64_t k, int64_t kmax) {
  KeyInterval iv = visible_keys(mask, window, p, kmax);
  return k >= iv.lo && k < iv.hi;
}

MSA_HD inline bool mask_code_valid(int64_t mask) { return mask >= kMaskNull && mask <= kMaskChunkedCausal; }
MSA_HD inline bool mask_needs_window(int64_t mask) {
  return mask == kMaskSlidingWindowCausal || mask == kMaskSlidingWindowNonCausal || mask == kMaskChunkedCausal;
}

}  // namespace msa_ops

#endif  // MSA_OPS_MASK_H_
