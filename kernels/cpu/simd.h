// Vector helpers of the CPU loops (GCC/Clang vector extensions), shared by the attention tile loop (attend.cc)
// and the indexer (indexer.cc). Each loop is compiled twice from one body: a baseline build on 4-float vectors and,
// on x86-64, an AVX2+FMA clone on 8-float vectors (a target attribute on the clone's entry point only, with the
// body and these helpers force-inlined into it, so no AVX2 code can leak into shared inline functions).
#ifndef MSA_OPS_CPU_SIMD_H_
#define MSA_OPS_CPU_SIMD_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "msa_ops/dtypes.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSA_OPS_X86_CLONE 1
#endif
#define MSA_OPS_ALWAYS_INLINE __attribute__((always_inline))

namespace msa_ops {
namespace cpu {

// True where the AVX2+FMA clones run: the CPU has both and MSA_OPS_CPU_ISA is not "generic" (read once).
bool use_avx2();

// Vectors of L floats (GCC/Clang vector extension): L = 8 in the AVX2 clone (one AVX register), L = 4 in the
// baseline build (one SSE or NEON register; 8-float vectors there would live in pairs and spill).
template <int L>
struct Vec;
template <>
struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  typedef uint16_t W __attribute__((vector_size(32)));  // 2L 16-bit lanes: the bits of one F vector
  typedef uint64_t W64 __attribute__((vector_size(32)));
};
template <>
struct Vec<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  typedef uint16_t W __attribute__((vector_size(16)));
  typedef uint64_t W64 __attribute__((vector_size(16)));
};

#if defined(__clang__)
#define MSA_OPS_SHUFFLE(I, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MSA_OPS_SHUFFLE(I, a, b, ...) __builtin_shuffle(a, b, I{__VA_ARGS__})
#endif

template <int L>
MSA_OPS_ALWAYS_INLINE inline typename Vec<L>::F vload(const float* p) {
  typename Vec<L>::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int L>
MSA_OPS_ALWAYS_INLINE inline void vstore(float* p, typename Vec<L>::F v) {
  std::memcpy(p, &v, sizeof(v));
}
template <int L>
MSA_OPS_ALWAYS_INLINE inline typename Vec<L>::F splat(float x) {
  return typename Vec<L>::F{} + x;
}
template <int L>  // lanes of m all ones: a; all zeros: b
MSA_OPS_ALWAYS_INLINE inline typename Vec<L>::F vselect(typename Vec<L>::I m, typename Vec<L>::F a,
                                                        typename Vec<L>::F b) {
  typedef typename Vec<L>::I I;
  typedef typename Vec<L>::F F;
  return reinterpret_cast<F>((m & reinterpret_cast<I>(a)) | (~m & reinterpret_cast<I>(b)));
}
template <int L>
MSA_OPS_ALWAYS_INLINE inline float hsum(typename Vec<L>::F v) {
  if constexpr (L == 8) return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
  return (v[0] + v[2]) + (v[1] + v[3]);
}
template <int L>
MSA_OPS_ALWAYS_INLINE inline float hmax(typename Vec<L>::F v) {
  float m = v[0];
  for (int u = 1; u < L; ++u) m = v[u] > m ? v[u] : m;
  return m;
}

// [a0+a1, a2+a3, b0+b1, b2+b3] per group of four lanes (vhaddps).
template <int L>
MSA_OPS_ALWAYS_INLINE inline typename Vec<L>::F hadd(typename Vec<L>::F a, typename Vec<L>::F b) {
  using I [[maybe_unused]] = typename Vec<L>::I;  // the shuffle's mask type (GCC; Clang takes the indices alone)
  if constexpr (L == 8)
    return MSA_OPS_SHUFFLE(I, a, b, 0, 2, 8, 10, 4, 6, 12, 14) + MSA_OPS_SHUFFLE(I, a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  else
    return MSA_OPS_SHUFFLE(I, a, b, 0, 2, 4, 6) + MSA_OPS_SHUFFLE(I, a, b, 1, 3, 5, 7);
}
// out[i] = the sum of a[i]'s lanes, for eight vectors.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void reduce8(const typename Vec<L>::F* a, float* out) {
  using I [[maybe_unused]] = typename Vec<L>::I;
  if constexpr (L == 8) {
    const auto g0 = hadd<8>(hadd<8>(a[0], a[1]), hadd<8>(a[2], a[3]));
    const auto g1 = hadd<8>(hadd<8>(a[4], a[5]), hadd<8>(a[6], a[7]));
    vstore<8>(out, MSA_OPS_SHUFFLE(I, g0, g1, 0, 1, 2, 3, 8, 9, 10, 11) +
                       MSA_OPS_SHUFFLE(I, g0, g1, 4, 5, 6, 7, 12, 13, 14, 15));
  } else {
    vstore<4>(out, hadd<4>(hadd<4>(a[0], a[1]), hadd<4>(a[2], a[3])));
    vstore<4>(out + 4, hadd<4>(hadd<4>(a[4], a[5]), hadd<4>(a[6], a[7])));
  }
}

// 2^x on L lanes for x <= 0 (score minus running max): range reduction to [-0.5, 0.5] and a degree-6
// polynomial, relative error about 2e-7. x below -127 (and -inf) gives 0: weights under 2^-126 are flushed, far
// below what the f32 accumulation keeps. NaN stays NaN.
template <int L>
MSA_OPS_ALWAYS_INLINE inline typename Vec<L>::F exp2v(typename Vec<L>::F x) {
  typedef typename Vec<L>::F F;
  typedef typename Vec<L>::I I;
  const F floor_ = splat<L>(-127.f);
  x = vselect<L>(x < floor_, floor_, x);
  const F magic = splat<L>(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const F r = (x + magic) - magic;
  const F f = x - r;
  const I n = __builtin_convertvector(r, I);
  const F scale = reinterpret_cast<F>((n + 127) << 23);  // 2^n; n = -127 gives +0
  F p = splat<L>(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910072e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.f;
  return p * scale;
}

// Dot products of one query vector with 4 key rows at once.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void dot4(const float* q, const float* k0, const float* k1, const float* k2,
                                       const float* k3, int64_t D, float* out) {
  typename Vec<L>::F a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  int64_t d = 0;
  for (; d + L <= D; d += L) {
    const auto qv = vload<L>(q + d);
    a0 += qv * vload<L>(k0 + d);
    a1 += qv * vload<L>(k1 + d);
    a2 += qv * vload<L>(k2 + d);
    a3 += qv * vload<L>(k3 + d);
  }
  float r0 = hsum<L>(a0), r1 = hsum<L>(a1), r2 = hsum<L>(a2), r3 = hsum<L>(a3);
  for (; d < D; ++d) {
    r0 += q[d] * k0[d];
    r1 += q[d] * k1[d];
    r2 += q[d] * k2[d];
    r3 += q[d] * k3[d];
  }
  out[0] = r0;
  out[1] = r1;
  out[2] = r2;
  out[3] = r3;
}

// Dot products of two query vectors with four key rows (D a multiple of L): out = [q0.k0 .. q0.k3, q1.k0 .. q1.k3].
template <int L>
MSA_OPS_ALWAYS_INLINE inline void dots_2x4(const float* q0, const float* q1, const float* k0, const float* k1,
                                           const float* k2, const float* k3, int64_t D, float* out) {
  typename Vec<L>::F a[8] = {};
  for (int64_t d = 0; d < D; d += L) {
    const auto x0 = vload<L>(q0 + d), x1 = vload<L>(q1 + d);
    const auto y0 = vload<L>(k0 + d), y1 = vload<L>(k1 + d), y2 = vload<L>(k2 + d), y3 = vload<L>(k3 + d);
    a[0] += x0 * y0;
    a[1] += x0 * y1;
    a[2] += x0 * y2;
    a[3] += x0 * y3;
    a[4] += x1 * y0;
    a[5] += x1 * y1;
    a[6] += x1 * y2;
    a[7] += x1 * y3;
  }
  reduce8<L>(a, out);
}

// Scores of nv query vectors q[nv][D] against the key rows kf[j][D], j in [jlo, jhi) (D a multiple of L), in blocks
// of 2 vectors x 4 keys: s[v * ld + j] = q_v . k_j. A short last block of keys repeats the last key; an odd last
// vector is scored as its own pair.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void scores_2x4(const float* q, int64_t nv, int64_t D, const float* kf, int64_t jlo,
                                             int64_t jhi, float* s, int64_t ld) {
  const int64_t last = jhi - 1;
  for (int64_t v = 0; v < nv; v += 2) {
    const float* q0 = q + v * D;
    const float* q1 = v + 1 < nv ? q0 + D : q0;
    for (int64_t j = jlo; j < jhi; j += 4) {
      float r[8];
      dots_2x4<L>(q0, q1, kf + j * D, kf + std::min(j + 1, last) * D, kf + std::min(j + 2, last) * D,
                  kf + std::min(j + 3, last) * D, D, r);
      const int64_t cnt = std::min<int64_t>(4, jhi - j);
      for (int64_t u = 0; u < cnt; ++u) s[v * ld + j + u] = r[u];
      if (v + 1 < nv)
        for (int64_t u = 0; u < cnt; ++u) s[(v + 1) * ld + j + u] = r[4 + u];
    }
  }
}

// One row of K or V to f32; returns false when the row holds a NaN or an infinity.
template <typename T>
MSA_OPS_ALWAYS_INLINE inline bool convert_row_scalar(const T* src, float* dst, int64_t D) {
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    dst[d] = to_float(src[d]);
    finite &= dst[d] - dst[d] == 0.f;
  }
  return finite;
}
template <int L, typename T>
MSA_OPS_ALWAYS_INLINE inline bool convert_row(const T* src, float* dst, int64_t D) {
  if constexpr (!std::is_same<T, bf16_t>::value) {
    return convert_row_scalar<T>(src, dst, D);
  } else {
    // 2L bf16 values at a time: interleaved with zeros they are the bits of two f32 vectors (an unpack each, and on
    // 8-float vectors a 64-bit lane permute: fewer instructions than widening 16-bit lanes to 32-bit ones).
    typedef typename Vec<L>::W W;
    W bad = {0};
    int64_t d = 0;
    for (; d + 2 * L <= D; d += 2 * L) {
      W h;
      std::memcpy(&h, src + d, sizeof(h));
      const W z = {0};
      W lo, hi;
      if constexpr (L == 8) {
        lo = MSA_OPS_SHUFFLE(W, z, h, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23);
        hi = MSA_OPS_SHUFFLE(W, z, h, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31);
      } else {
        lo = MSA_OPS_SHUFFLE(W, z, h, 0, 8, 0, 9, 0, 10, 0, 11);
        hi = MSA_OPS_SHUFFLE(W, z, h, 0, 12, 0, 13, 0, 14, 0, 15);
      }
      bad |= reinterpret_cast<W>((h & 0x7f80) == 0x7f80);  // exponent all ones: infinity or NaN
      std::memcpy(dst + d, &lo, sizeof(lo));
      std::memcpy(dst + d + L, &hi, sizeof(hi));
    }
    const auto b64 = reinterpret_cast<typename Vec<L>::W64>(bad);
    uint64_t any = 0;
    for (int u = 0; u < L / 2; ++u) any |= b64[u];
    return convert_row_scalar<T>(src + d, dst + d, D - d) && any == 0;
  }
}

// Software prefetch of a row of `bytes` bytes, or of one row of K and one of V (the cache is read once, through
// the page table: the hardware prefetchers do not follow it), into L2 (prefetcht1): the rows are used one tile
// later, and L1 keeps the tile's f32 copies.
MSA_OPS_ALWAYS_INLINE inline void prefetch_row(const char* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}
MSA_OPS_ALWAYS_INLINE inline void prefetch_row(const char* k, const char* v, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(v + off, 0, 2);
  }
}

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_SIMD_H_
