// The attention tile loop. It is compiled twice from one body: a baseline build and, on x86-64, an
// AVX2+FMA clone (target attribute on the wrapper only, with the body force-inlined into it, so no
// AVX2 code can leak into shared inline functions). The clone is used only when the CPU supports it.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "attention_core.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSA_OPS_X86_CLONE 1
#endif
#define MSA_OPS_ALWAYS_INLINE __attribute__((always_inline))

namespace msa_ops {
namespace cpu {
namespace {

// Dot products of one query vector with 4 key rows at once, on 8-float vectors (GCC/Clang vector
// extension: one AVX register in the AVX2 clone, two SSE registers in the baseline build).
typedef float v8f __attribute__((vector_size(32)));
MSA_OPS_ALWAYS_INLINE inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
MSA_OPS_ALWAYS_INLINE inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

MSA_OPS_ALWAYS_INLINE inline void dot4(const float* q, const float* k0, const float* k1, const float* k2,
                                       const float* k3, int64_t D, float* out) {
  v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const v8f qv = load8(q + d);
    a0 += qv * load8(k0 + d);
    a1 += qv * load8(k1 + d);
    a2 += qv * load8(k2 + d);
    a3 += qv * load8(k3 + d);
  }
  float r0 = hsum8(a0), r1 = hsum8(a1), r2 = hsum8(a2), r3 = hsum8(a3);
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

template <typename T>
MSA_OPS_ALWAYS_INLINE inline void convert_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
}

template <typename T>
MSA_OPS_ALWAYS_INLINE inline void attend_impl(const KvRows<T>& src, int64_t nq, const float* q, const int64_t* lo,
                                              const int64_t* hi, int64_t k_begin, int64_t k_end, float* acc,
                                              OnlineSoftmax* st, AttnScratch& sc) {
  constexpr int64_t BN = kBlockN;
  const int64_t D = src.head_dim;
  sc.ensure(nq, D);
  float* kf = sc.kt.data();  // [BN][D]
  float* vf = sc.vf.data();  // [BN][D]
  float* s = sc.s.data();
  unsigned char* valid = sc.valid.data();

  for (int64_t t0 = k_begin; t0 < k_end; t0 += BN) {
    const int64_t n = std::min(BN, k_end - t0);
    int64_t need_lo = n, need_hi = 0;  // tile columns any query vector sees
    for (int64_t i = 0; i < nq; ++i) {
      need_lo = std::min(need_lo, std::max(lo[i], t0) - t0);
      need_hi = std::max(need_hi, std::min(hi[i], t0 + n) - t0);
    }
    if (need_lo >= need_hi) continue;

    // Prefetch the next tile's rows (the cache is read once, with page-table indirection: hide latency).
    {
      const int64_t n_next = std::min(BN, k_end - (t0 + 2 * BN));
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < n_next; ++j) {
        const T* kp = nullptr;
        const T* vp = nullptr;
        if (!src.get(t0 + 2 * BN + j, &kp, &vp)) continue;
        for (int64_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kp) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(vp) + off);
        }
      }
    }
    // Gather + convert the needed rows once for all query vectors.
    int64_t nvalid = 0;
    for (int64_t j = need_lo; j < need_hi; ++j) {
      const T* kp = nullptr;
      const T* vp = nullptr;
      const bool ok = src.get(t0 + j, &kp, &vp);
      valid[j] = ok ? 1 : 0;
      if (ok) {
        ++nvalid;
        convert_row<T>(kp, kf + j * D, D);
        convert_row<T>(vp, vf + j * D, D);
      }
    }
    if (nvalid == 0) continue;

    for (int64_t i = 0; i < nq; ++i) {
      const int64_t a = std::max(lo[i], t0) - t0;
      const int64_t b = std::min(hi[i], t0 + n) - t0;
      if (a >= b) continue;
      const float* qi = q + i * D;
      float* si = s + i * BN;
      // Scores of the valid keys in [a, b), four at a time (invalid ones point at a valid row and are ignored).
      int64_t idx[4];
      int64_t cnt = 0;
      float tmp[4];
      for (int64_t j = a; j < b; ++j) {
        if (!valid[j]) continue;
        idx[cnt++] = j;
        if (cnt == 4) {
          dot4(qi, kf + idx[0] * D, kf + idx[1] * D, kf + idx[2] * D, kf + idx[3] * D, D, tmp);
          for (int u = 0; u < 4; ++u) si[idx[u]] = tmp[u];
          cnt = 0;
        }
      }
      if (cnt > 0) {
        for (int64_t u = cnt; u < 4; ++u) idx[u] = idx[0];
        dot4(qi, kf + idx[0] * D, kf + idx[1] * D, kf + idx[2] * D, kf + idx[3] * D, D, tmp);
        for (int64_t u = 0; u < cnt; ++u) si[idx[u]] = tmp[u];
      }
      float tmax = neg_inf();
      for (int64_t j = a; j < b; ++j)
        if (valid[j]) tmax = std::max(tmax, si[j]);
      if (!(tmax > neg_inf())) continue;
      OnlineSoftmax& sti = st[i];
      float* ai = acc + i * D;
      const float alpha = sti.rescale(tmax);
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
      for (int64_t j = a; j < b; ++j) {
        if (!valid[j]) continue;
        const float p = sti.weight(si[j]);
        const float* vrow = vf + j * D;
        for (int64_t d = 0; d < D; ++d) ai[d] += p * vrow[d];
      }
    }
  }
}

template <typename T>
void attend_generic(const KvRows<T>& src, int64_t nq, const float* q, const int64_t* lo, const int64_t* hi,
                    int64_t k_begin, int64_t k_end, float* acc, OnlineSoftmax* st, AttnScratch& sc) {
  attend_impl<T>(src, nq, q, lo, hi, k_begin, k_end, acc, st, sc);
}

#if defined(MSA_OPS_X86_CLONE)
template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const KvRows<T>& src, int64_t nq, const float* q,
                                                    const int64_t* lo, const int64_t* hi, int64_t k_begin,
                                                    int64_t k_end, float* acc, OnlineSoftmax* st,
                                                    AttnScratch& sc) {
  attend_impl<T>(src, nq, q, lo, hi, k_begin, k_end, acc, st, sc);
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
