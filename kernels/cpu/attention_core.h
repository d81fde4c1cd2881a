// CPU attention core: one work item = a set of query vectors (rows x query heads of one kv head) that
// scan keys of one kv head in tiles of kBlockN keys with an online softmax (log2 domain).
// The tile loop (attend.cc) is compiled twice (baseline x86-64 / other arch, and AVX2+FMA on x86-64) and picked
// at run time; its entry points are templates over the K/V element type only.
#ifndef MSA_OPS_CPU_ATTENTION_CORE_H_
#define MSA_OPS_CPU_ATTENTION_CORE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "msa_ops/common.h"
#include "msa_ops/dtypes.h"
#include "msa_ops/paged.h"
#include "msa_ops/softmax.h"

namespace msa_ops {
namespace cpu {

// Where the K/V rows of one kv head of one sequence live: a paged cache or contiguous [Tk, Hkv, D] rows.
template <typename T>
struct KvRows {
  const T* k_base = nullptr;  // kv_blocks (paged) or k (contiguous)
  const T* v_base = nullptr;  // unused (paged) or v (contiguous)
  bool paged = true;
  PagedKV geo{};                       // paged
  const int32_t* table_row = nullptr;  // paged: kv_lookup_table[b, :]
  int64_t row0 = 0;                    // contiguous: first row of the sequence
  int64_t n_kv_heads = 0;              // contiguous
  int64_t num_keys = 0;                // keys >= num_keys do not exist
  int64_t head = 0;                    // kv head
  int64_t head_dim = 0;

  // The keys [k, k + n), n >= 1 and k + n <= k_end (k < k_end), that share key k's answer: all absent (returns
  // false), or present with key k + i at *kp + i * *stride and *vp + i * *stride (the slots of one page, or
  // contiguous rows).
  bool run(int64_t k, int64_t k_end, int64_t* n, const T** kp, const T** vp, int64_t* stride) const {
    *stride = n_kv_heads * head_dim;
    if (k < 0) {
      *n = (k_end < 0 ? k_end : 0) - k;
      return false;
    }
    if (k >= num_keys) {
      *n = k_end - k;
      return false;
    }
    const int64_t last = k_end < num_keys ? k_end : num_keys;  // the run ends before this key
    if (!paged) {
      *n = last - k;
      const int64_t off = ((row0 + k) * n_kv_heads + head) * head_dim;
      *kp = k_base + off;
      *vp = v_base + off;
      return true;
    }
    const int64_t slot = k % geo.page_size;
    const int64_t page_end = k - slot + geo.page_size;
    *n = (page_end < last ? page_end : last) - k;
    const int64_t page = geo.page_of(table_row, k);
    if (page < 0) return false;
    *stride = geo.n_kv_heads * geo.head_dim;
    *kp = k_base + geo.offset(page, 0, slot, head);
    *vp = k_base + geo.offset(page, 1, slot, head);
    return true;
  }
};

struct AttnScratch {
  std::vector<float> kt;      // [kBlockN][D] K tile as f32
  std::vector<float> vf;      // [kBlockN][D]
  std::vector<float> s;       // [nq][kBlockN] scores, then weights
  std::vector<int32_t> colok;  // [kBlockN]: all ones where the tile's row is present
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first key, keys) of each tile of a scan
  std::vector<const char*> prefetch;                // [kBlockN][2]: K and V rows of a tile ahead
  void ensure(int64_t nq, int64_t d) {
    if (static_cast<int64_t>(kt.size()) < d * kBlockN) kt.resize(d * kBlockN);
    if (static_cast<int64_t>(vf.size()) < d * kBlockN) vf.resize(d * kBlockN);
    if (static_cast<int64_t>(s.size()) < nq * kBlockN) s.resize(nq * kBlockN);
    colok.resize(kBlockN);
    prefetch.resize(2 * kBlockN);
  }
};

// Scans the keys of the ranges [seg_lo[g], seg_hi[g]), g < nseg, in order, for nq query vectors q[nq][D] (already
// multiplied by scale*log2e), in tiles of kBlockN keys that never span two ranges. Query vector i sees only keys in
// [lo[i], hi[i]). acc[nq][D] and st[nq] carry the running state.
template <typename T>
using AttendFn = void (*)(const KvRows<T>& src, int64_t nq, const float* q, const int64_t* lo,
                          const int64_t* hi, const int64_t* seg_lo, const int64_t* seg_hi, int64_t nseg, float* acc,
                          OnlineSoftmax* st, AttnScratch& scratch);

template <typename T>
AttendFn<T> attend_fn();

const char* attend_isa();  // "avx2" or "generic"

}  // namespace cpu
}  // namespace msa_ops

#endif  // MSA_OPS_CPU_ATTENTION_CORE_H_
