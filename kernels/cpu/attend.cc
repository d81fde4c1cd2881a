// The attention tile loop. It is compiled twice from one body: a baseline build on 4-float vectors and, on x86-64,
// an AVX2+FMA clone on 8-float vectors (target attribute on the wrapper only, with the body force-inlined into it,
// so no AVX2 code can leak into shared inline functions). The clone is used only when the CPU supports it.
//
// A scan walks its key ranges in tiles of kBlockN keys. Each tile's present K and V rows are converted to f32 once
// for all the query vectors of the work item (rows x the query heads of one kv head), while the next tile's rows
// are prefetched one by one (the page table hides them from the hardware prefetchers). Then either the blocked
// form (scores in blocks of 2 query vectors x 4 keys, the softmax on whole vectors, P V in blocks of 4 query
// vectors x 2 vectors of columns) or, where a needed V row holds a NaN or an infinity (a weight of 0 must not meet
// it) or the head dim is not a multiple of 8, the per-vector form.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "attention_core.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSA_OPS_X86_CLONE 1
#endif
#define MSA_OPS_ALWAYS_INLINE __attribute__((always_inline))

namespace msa_ops {
namespace cpu {
namespace {

// Vectors of L floats (GCC/Clang vector extension): L = 8 in the AVX2 clone (one AVX register), L = 4 in the
// baseline build (one SSE or NEON register; 8-float vectors there would live in pairs and spill).
template <int L>
struct Vec;
template <>
struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  typedef uint16_t U16 __attribute__((vector_size(16)));
};
template <>
struct Vec<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(16)));
  typedef uint16_t U16 __attribute__((vector_size(8)));
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
  typedef typename Vec<L>::I I;
  if constexpr (L == 8)
    return MSA_OPS_SHUFFLE(I, a, b, 0, 2, 8, 10, 4, 6, 12, 14) + MSA_OPS_SHUFFLE(I, a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  else
    return MSA_OPS_SHUFFLE(I, a, b, 0, 2, 4, 6) + MSA_OPS_SHUFFLE(I, a, b, 1, 3, 5, 7);
}
// out[i] = the sum of a[i]'s lanes, for eight vectors.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void reduce8(const typename Vec<L>::F* a, float* out) {
  typedef typename Vec<L>::I I;
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

// acc[i0 + m][d0, d0 + L NV) += sum_j p[(i0 + m) BN + j] v[j][d0, ...) over keys [jlo, jhi), for MQ query vectors.
template <int L, int MQ, int NV>
MSA_OPS_ALWAYS_INLINE inline void pv_block(const float* p, int64_t i0, const float* vf, int64_t D, int64_t d0,
                                           int64_t jlo, int64_t jhi, float* acc) {
  typename Vec<L>::F o[MQ][NV];
  for (int m = 0; m < MQ; ++m)
    for (int v = 0; v < NV; ++v) o[m][v] = vload<L>(acc + (i0 + m) * D + d0 + L * v);
  for (int64_t j = jlo; j < jhi; ++j) {
    typename Vec<L>::F x[NV];
    for (int v = 0; v < NV; ++v) x[v] = vload<L>(vf + j * D + d0 + L * v);
    for (int m = 0; m < MQ; ++m) {
      const float w = p[(i0 + m) * kBlockN + j];
      for (int v = 0; v < NV; ++v) o[m][v] += w * x[v];
    }
  }
  for (int m = 0; m < MQ; ++m)
    for (int v = 0; v < NV; ++v) vstore<L>(acc + (i0 + m) * D + d0 + L * v, o[m][v]);
}

// D a multiple of L: columns in blocks of two vectors, then one.
template <int L, int MQ>
MSA_OPS_ALWAYS_INLINE inline void pv_rows(const float* p, int64_t i0, const float* vf, int64_t D, int64_t jlo,
                                          int64_t jhi, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 2 * L <= D; d0 += 2 * L) pv_block<L, MQ, 2>(p, i0, vf, D, d0, jlo, jhi, acc);
  if (d0 < D) pv_block<L, MQ, 1>(p, i0, vf, D, d0, jlo, jhi, acc);
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
    typedef typename Vec<L>::I I;
    I bad = {0};
    int64_t d = 0;
    for (; d + L <= D; d += L) {
      typename Vec<L>::U16 h;
      std::memcpy(&h, src + d, sizeof(h));
      const I w = __builtin_convertvector(h, I);
      bad |= (w & 0x7f80) == 0x7f80;  // exponent all ones: infinity or NaN
      vstore<L>(dst + d, reinterpret_cast<typename Vec<L>::F>(w << 16));
    }
    bool finite = true;
    for (int u = 0; u < L; ++u) finite &= bad[u] == 0;
    return convert_row_scalar<T>(src + d, dst + d, D - d) && finite;
  }
}

// The blocked form of one tile, for tiles whose needed V rows are all finite (so that a weight of 0 times a
// masked key's V adds exactly 0) and D a multiple of 8. kf / vf hold the tile's rows [need_lo, need_hi) as f32,
// absent rows zeroed; colok[j] is all ones for the rows present. Scores for every query vector over the whole
// needed range, in blocks of two query vectors by four keys; then per query vector its own visible range's
// maximum, the rescale and the weights (masked keys weigh 0); then P V in blocks of four query vectors by 16
// columns.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void tile_blocked(int64_t nq, const float* q, const int64_t* lo, const int64_t* hi,
                                               int64_t t0, int64_t n, int64_t need_lo, int64_t need_hi,
                                               const float* kf, const float* vf, const int32_t* colok, int64_t D,
                                               float* s, float* acc, OnlineSoftmax* st) {
  typedef typename Vec<L>::F F;
  typedef typename Vec<L>::I I;
  constexpr int64_t BN = kBlockN;
  for (int64_t i = 0; i < nq; i += 2) {
    const float* q0 = q + i * D;
    const float* q1 = i + 1 < nq ? q0 + D : q0;
    for (int64_t j = need_lo; j < need_hi; j += 4) {
      const int64_t last = need_hi - 1;
      const int64_t j1 = std::min(j + 1, last), j2 = std::min(j + 2, last), j3 = std::min(j + 3, last);
      float r[8];
      dots_2x4<L>(q0, q1, kf + j * D, kf + j1 * D, kf + j2 * D, kf + j3 * D, D, r);
      const int64_t cnt = std::min<int64_t>(4, need_hi - j);
      for (int64_t u = 0; u < cnt; ++u) s[i * BN + j + u] = r[u];
      if (i + 1 < nq)
        for (int64_t u = 0; u < cnt; ++u) s[(i + 1) * BN + j + u] = r[4 + u];
    }
  }
  I iota;
  for (int u = 0; u < L; ++u) iota[u] = u;
  const F ninf = splat<L>(neg_inf());
  const int64_t c_lo = need_lo / L * L;
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * BN;
    const int64_t a = std::min(std::max(lo[i], t0) - t0, n);  // [a, b) within [0, n]
    const int64_t b = std::max(std::min(hi[i], t0 + n) - t0, a);
    F vmax = ninf;
    for (int64_t c = c_lo; c < need_hi; c += L) {
      const I col = iota + static_cast<int32_t>(c);
      I m;
      std::memcpy(&m, colok + c, sizeof(m));
      m &= (col >= static_cast<int32_t>(a)) & (col < static_cast<int32_t>(b));
      const F x = vselect<L>(m, vload<L>(si + c), ninf);
      vstore<L>(si + c, x);
      vmax = vselect<L>(x > vmax, x, vmax);
    }
    const float tmax = hmax<L>(vmax);
    if (!(tmax > neg_inf())) {
      for (int64_t c = c_lo; c < need_hi; c += L) vstore<L>(si + c, splat<L>(0.f));
      continue;
    }
    OnlineSoftmax& sti = st[i];
    const float alpha = sti.rescale(tmax);
    float* ai = acc + i * D;
    if (alpha != 1.f) {
      const F va = splat<L>(alpha);
      for (int64_t d = 0; d < D; d += L) vstore<L>(ai + d, vload<L>(ai + d) * va);
    }
    const F vm = splat<L>(sti.m);
    F vsum = splat<L>(0.f);
    for (int64_t c = c_lo; c < need_hi; c += L) {
      const F pw = exp2v<L>(vload<L>(si + c) - vm);
      vstore<L>(si + c, pw);
      vsum += pw;
    }
    sti.l += hsum<L>(vsum);
  }
  int64_t i = 0;
  for (; i + 4 <= nq; i += 4) pv_rows<L, 4>(s, i, vf, D, need_lo, need_hi, acc);
  switch (nq - i) {
    case 3: pv_rows<L, 3>(s, i, vf, D, need_lo, need_hi, acc); break;
    case 2: pv_rows<L, 2>(s, i, vf, D, need_lo, need_hi, acc); break;
    case 1: pv_rows<L, 1>(s, i, vf, D, need_lo, need_hi, acc); break;
    default: break;
  }
}

// The per-query-vector form of one tile (any D; V rows that may hold NaN or infinities): each query vector's
// scores over its visible present keys, four at a time, and its weights applied key by key.
template <int L>
MSA_OPS_ALWAYS_INLINE inline void tile_rows(int64_t nq, const float* q, const int64_t* lo, const int64_t* hi,
                                            int64_t t0, int64_t n, const float* kf, const float* vf,
                                            const int32_t* colok, int64_t D, float* s, float* acc,
                                            OnlineSoftmax* st) {
  constexpr int64_t BN = kBlockN;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t a = std::max(lo[i], t0) - t0;
    const int64_t b = std::min(hi[i], t0 + n) - t0;
    if (a >= b) continue;
    const float* qi = q + i * D;
    float* si = s + i * BN;
    // Scores of the present keys in [a, b), four at a time (absent ones point at a present row and are ignored).
    int64_t idx[4];
    int64_t cnt = 0;
    float tmp[4];
    for (int64_t j = a; j < b; ++j) {
      if (!colok[j]) continue;
      idx[cnt++] = j;
      if (cnt == 4) {
        dot4<L>(qi, kf + idx[0] * D, kf + idx[1] * D, kf + idx[2] * D, kf + idx[3] * D, D, tmp);
        for (int u = 0; u < 4; ++u) si[idx[u]] = tmp[u];
        cnt = 0;
      }
    }
    if (cnt > 0) {
      for (int64_t u = cnt; u < 4; ++u) idx[u] = idx[0];
      dot4<L>(qi, kf + idx[0] * D, kf + idx[1] * D, kf + idx[2] * D, kf + idx[3] * D, D, tmp);
      for (int64_t u = 0; u < cnt; ++u) si[idx[u]] = tmp[u];
    }
    float tmax = neg_inf();
    for (int64_t j = a; j < b; ++j)
      if (colok[j]) tmax = std::max(tmax, si[j]);
    if (!(tmax > neg_inf())) continue;
    OnlineSoftmax& sti = st[i];
    float* ai = acc + i * D;
    const float alpha = sti.rescale(tmax);
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
    for (int64_t j = a; j < b; ++j) {
      if (!colok[j]) continue;
      const float p = sti.weight(si[j]);
      const float* vrow = vf + j * D;
      for (int64_t d = 0; d < D; ++d) ai[d] += p * vrow[d];
    }
  }
}

// Software prefetch of one row of K and of V (the cache is read once, through the page table: the hardware
// prefetchers do not follow it).
MSA_OPS_ALWAYS_INLINE inline void prefetch_row(const char* k, const char* v, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off);
    __builtin_prefetch(v + off);
  }
}

template <typename T, int L>
MSA_OPS_ALWAYS_INLINE inline void attend_impl(const KvRows<T>& src, int64_t nq, const float* q, const int64_t* lo,
                                              const int64_t* hi, const int64_t* seg_lo, const int64_t* seg_hi,
                                              int64_t nseg, float* acc, OnlineSoftmax* st, AttnScratch& sc) {
  constexpr int64_t BN = kBlockN;
  constexpr int64_t kAhead = 1;  // the tile prefetched is this many after the one converted (1 measured best)
  const int64_t D = src.head_dim;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  sc.ensure(nq, D);
  float* kf = sc.kt.data();  // [BN][D]
  float* vf = sc.vf.data();  // [BN][D]
  float* s = sc.s.data();
  int32_t* colok = sc.colok.data();
  // The tiles: each range cut into tiles of BN keys, in order.
  sc.tiles.clear();
  for (int64_t g = 0; g < nseg; ++g)
    for (int64_t t0 = seg_lo[g]; t0 < seg_hi[g]; t0 += BN) sc.tiles.push_back({t0, std::min(BN, seg_hi[g] - t0)});
  const int64_t ntiles = static_cast<int64_t>(sc.tiles.size());
  // Rows of the tile kAhead ahead, prefetched one by one as this tile's rows are converted.
  const char** pf = sc.prefetch.data();
  auto list_rows = [&](int64_t ti) -> int64_t {
    if (ti >= ntiles) return 0;
    const int64_t t0 = sc.tiles[ti].first, t1 = t0 + sc.tiles[ti].second;
    int64_t m = 0;
    for (int64_t k = t0, cnt = 0; k < t1; k += cnt) {
      const T* kp = nullptr;
      const T* vp = nullptr;
      int64_t stride = 0;
      if (!src.run(k, t1, &cnt, &kp, &vp, &stride)) continue;
      for (int64_t i = 0; i < cnt; ++i, ++m) {
        pf[2 * m] = reinterpret_cast<const char*>(kp + i * stride);
        pf[2 * m + 1] = reinterpret_cast<const char*>(vp + i * stride);
      }
    }
    return m;
  };
  for (int64_t ti = 0; ti < std::min(kAhead, ntiles); ++ti) {
    const int64_t m = list_rows(ti);
    for (int64_t i = 0; i < m; ++i) prefetch_row(pf[2 * i], pf[2 * i + 1], row_bytes);
  }

  for (int64_t ti = 0; ti < ntiles; ++ti) {
    const int64_t t0 = sc.tiles[ti].first, n = sc.tiles[ti].second;
    const int64_t npf = list_rows(ti + kAhead);
    int64_t ipf = 0;
    int64_t need_lo = n, need_hi = 0;  // tile columns any query vector sees
    for (int64_t i = 0; i < nq; ++i) {
      need_lo = std::min(need_lo, std::max(lo[i], t0) - t0);
      need_hi = std::max(need_hi, std::min(hi[i], t0 + n) - t0);
    }
    // Gather + convert the needed rows once for all query vectors; absent rows are zeroed.
    int64_t npresent = 0;
    bool v_finite = true;
    if (need_lo < need_hi) {
      for (int64_t j = need_lo / 8 * 8; j < need_lo; ++j) colok[j] = 0;
      for (int64_t j = need_lo, cnt = 0; j < need_hi; j += cnt) {
        const T* kp = nullptr;
        const T* vp = nullptr;
        int64_t stride = 0;
        const bool ok = src.run(t0 + j, t0 + need_hi, &cnt, &kp, &vp, &stride);
        for (int64_t i = 0; i < cnt; ++i) {
          if (ipf < npf) {
            prefetch_row(pf[2 * ipf], pf[2 * ipf + 1], row_bytes);
            ++ipf;
          }
          colok[j + i] = ok ? -1 : 0;
          if (ok) {
            convert_row<L, T>(kp + i * stride, kf + (j + i) * D, D);
            v_finite &= convert_row<L, T>(vp + i * stride, vf + (j + i) * D, D);
          } else {
            std::memset(kf + (j + i) * D, 0, static_cast<size_t>(D) * sizeof(float));
            std::memset(vf + (j + i) * D, 0, static_cast<size_t>(D) * sizeof(float));
          }
        }
        if (ok) npresent += cnt;
      }
      for (int64_t j = need_hi; j < (need_hi + 7) / 8 * 8; ++j) colok[j] = 0;
    }
    for (; ipf < npf; ++ipf) prefetch_row(pf[2 * ipf], pf[2 * ipf + 1], row_bytes);
    if (npresent == 0) continue;

    if (v_finite && D % 8 == 0)
      tile_blocked<L>(nq, q, lo, hi, t0, n, need_lo, need_hi, kf, vf, colok, D, s, acc, st);
    else
      tile_rows<L>(nq, q, lo, hi, t0, n, kf, vf, colok, D, s, acc, st);
  }
}

template <typename T>
void attend_generic(const KvRows<T>& src, int64_t nq, const float* q, const int64_t* lo, const int64_t* hi,
                    const int64_t* seg_lo, const int64_t* seg_hi, int64_t nseg, float* acc, OnlineSoftmax* st,
                    AttnScratch& sc) {
  attend_impl<T, 4>(src, nq, q, lo, hi, seg_lo, seg_hi, nseg, acc, st, sc);
}

#if defined(MSA_OPS_X86_CLONE)
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const KvRows<T>& src, int64_t nq, const float* q,
                                                    const int64_t* lo, const int64_t* hi, const int64_t* seg_lo,
                                                    const int64_t* seg_hi, int64_t nseg, float* acc,
                                                    OnlineSoftmax* st, AttnScratch& sc) {
  attend_impl<T, 8>(src, nq, q, lo, hi, seg_lo, seg_hi, nseg, acc, st, sc);
}
#endif

bool use_avx2() {
#if defined(MSA_OPS_X86_CLONE)
  // MSA_OPS_CPU_ISA=generic forces the baseline loop (tests of the portable path).
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         !(std::getenv("MSA_OPS_CPU_ISA") && std::string(std::getenv("MSA_OPS_CPU_ISA")) == "generic");
  return ok;
#else
  return false;
#endif
}

}  // namespace

const char* attend_isa() { return use_avx2() ? "avx2+fma" : "generic"; }

template <typename T>
AttendFn<T> attend_fn() {
#if defined(MSA_OPS_X86_CLONE)
  if (use_avx2()) return &attend_avx2<T>;
#endif
  return &attend_generic<T>;
}

template AttendFn<float> attend_fn<float>();
template AttendFn<bf16_t> attend_fn<bf16_t>();
template AttendFn<f16_t> attend_fn<f16_t>();
template AttendFn<f8e4m3_t> attend_fn<f8e4m3_t>();

}  // namespace cpu
}  // namespace msa_ops
