// Online softmax (log2 domain), split-K partition ranges and the combine (SEMANTICS.md §5, §6, §7).
#ifndef MSA_OPS_SOFTMAX_H_
#define MSA_OPS_SOFTMAX_H_

#include <cmath>
#include <cstdint>

#include "msa_ops/common.h"

namespace msa_ops {

constexpr float kLog2e = 1.4426950408889634f;

MSA_HD inline float neg_inf() { return -INFINITY; }
// 2^x. On the GPU one SFU instruction (MUFU.EX2; exp2f adds a subnormal fix-up around it): subnormal results
// flush to 0 and -inf gives 0, far below what rounding the softmax weights to 16 bits discards.
MSA_HD inline float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

MSA_HD inline float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  return log2f(x);
#else
  return std::log2(x);
#endif
}

// Running state of one query vector: scores are kept in log2 units (s2 = scale*log2e * q.k),
// m = running max, l = sum 2^(s2 - m). The accumulator (sum 2^(s2-m) v) is held by the caller.
struct OnlineSoftmax {
  float m;
  float l;
  MSA_HD void init() { m = neg_inf(); l = 0.f; }
  // Begin a tile whose maximum score is tile_max; returns the factor to rescale the accumulator by.
  MSA_HD float rescale(float tile_max) {
    float m_new = m > tile_max ? m : tile_max;
    float alpha = (m == neg_inf()) ? 0.f : fast_exp2(m - m_new);
    l *= alpha;
    m = m_new;
    return alpha;
  }
  // Probability weight of score s2 under the current max (also adds it to l).
  MSA_HD float weight(float s2) {
    float p = fast_exp2(s2 - m);
    l += p;
    return p;
  }
  MSA_HD bool empty() const { return !(l > 0.f); }
  // lse_p = log2(sum e^{s_j}) = m + log2(l); -inf when no key was seen.
  MSA_HD float lse2() const { return empty() ? neg_inf() : m + fast_log2(l); }
};

// The dense handlers' block_n attribute (>= 1, checked) as both take it: past 2^20, more keys than a partition's
// alignment ever needs, it reads as 2^20, which keeps the partition arithmetic below (p * s, align_up) far from int64
// overflow.
MSA_HD inline int64_t split_k_block_n(int64_t block_n) { return iclamp(block_n, 1, int64_t{1} << 20); }

// Split-K partition size s = max(BN, align_up(ceil(N/np), BN)); partition p covers [p*s, min(N,(p+1)*s)).
MSA_HD inline int64_t split_k_partition_size(int64_t num_keys, int64_t num_partitions, int64_t block_n) {
  const int64_t np = imax(num_partitions, 1);
  const int64_t bn = imax(block_n, 1);
  const int64_t n = imax(num_keys, 0);
  return imax(bn, align_up(ceil_div(n, np), bn));
}
MSA_HD inline void split_k_partition_range(int64_t num_keys, int64_t num_partitions, int64_t block_n,
                                           int64_t p, int64_t* lo, int64_t* hi) {
  const int64_t s = split_k_partition_size(num_keys, num_partitions, block_n);
  const int64_t n = imax(num_keys, 0);
  *lo = imin(n, p * s);
  *hi = imin(n, (p + 1) * s);
}

// MSA decode split-K over top-k slots (§7): partition p takes slots [p*c, min(topk,(p+1)*c)), c = ceil(topk/np).
MSA_HD inline void msa_slot_range(int64_t topk, int64_t num_partitions, int64_t p, int64_t* lo, int64_t* hi) {
  const int64_t np = imax(num_partitions, 1);
  const int64_t c = ceil_div(imax(topk, 0), np);
  *lo = imin(topk, p * c);
  *hi = imin(topk, (p + 1) * c);
}

// Sink term in log2 units: the sink enters as 2^(sink*log2e - m) (natural-log weight, not scaled).
MSA_HD inline float sink_log2(float sink_natural) { return sink_natural * kLog2e; }

// Combine of normalized partials (§6): m = max lse_p; w_p = 2^(lse_p - m);
// O = sum w_p O_p / (sum w_p + 2^(sink2 - m)). A row with every partition empty outputs 0.
// Usage: m = combine_max(...); then for each p: w_p = combine_weight(lse_p, m); denominator via
// combine_denominator(sum_w, has_sink, sink2, m).
MSA_HD inline float combine_weight(float lse_p, float m) {
  return (lse_p == neg_inf()) ? 0.f : fast_exp2(lse_p - m);
}
MSA_HD inline float combine_denominator(float sum_w, bool has_sink, float sink2, float m) {
  return has_sink ? sum_w + fast_exp2(sink2 - m) : sum_w;
}
// Scale applied to one partition's normalized output: w_p / denominator; 0 when m == -inf (no key at all).
MSA_HD inline float combine_scale(float w_p, float denom, float m) {
  if (m == neg_inf() || !(denom > 0.f)) return 0.f;
  return w_p / denom;
}

}  // namespace msa_ops

#endif  // MSA_OPS_SOFTMAX_H_
