// The attention tile loop, compiled as a baseline loop and an AVX2+FMA clone (simd.h); the clone is used only
// when the CPU supports it.
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

#include "attention_core.h"
#include "simd.h"

namespace msa_ops {
namespace cpu {
namespace {

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
  scores_2x4<L>(q, nq, D, kf, need_lo, need_hi, s, BN);
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

}  // namespace

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
