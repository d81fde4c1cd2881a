// Row ownership (offsets repair), cache-length clamp and paged-KV addressing (SEMANTICS.md §1, §2, §9).
#ifndef MSA_OPS_PAGED_H_
#define MSA_OPS_PAGED_H_

#include <cstdint>

#include "msa_ops/common.h"

namespace msa_ops {

// eff[j] = min(T, max(0, max_{i<=j} offsets[i])). O(j); used on the device where no scratch exists.
MSA_HD inline int64_t repaired_offset(const int32_t* offsets, int64_t j, int64_t total_rows) {
  int64_t run = 0;  // max(0, running max)
  for (int64_t i = 0; i <= j; ++i) run = imax(run, static_cast<int64_t>(offsets[i]));
  return imin(total_rows, run);
}

// All n entries at once (host): eff[0..n).
inline void repair_offsets(const int32_t* offsets, int64_t n, int64_t total_rows, int64_t* eff) {
  int64_t run = 0;
  for (int64_t i = 0; i < n; ++i) {
    run = imax(run, static_cast<int64_t>(offsets[i]));
    eff[i] = imin(total_rows, run);
  }
}

// c_b = clamp(cache_lengths[b], 0, S_max) for attention (§2).
MSA_HD inline int64_t clamp_cache_length(int32_t c, int64_t s_max) {
  return iclamp(static_cast<int64_t>(c), 0, s_max);
}

// Geometry of kv_blocks[NB, KV, L, P, Hkv, D] (KV = 2 for K/V, 1 for the indexer's k_blocks),
// a page-table row and the layer. Offsets are in elements.
struct PagedKV {
  int64_t num_blocks;  // NB
  int64_t kv;          // 2 (K,V) or 1
  int64_t num_layers;  // L
  int64_t page_size;   // P
  int64_t n_kv_heads;  // Hkv
  int64_t head_dim;    // D
  int64_t max_pages;   // MP (page-table width)
  int64_t layer;       // layer_idx as read

  MSA_HD int64_t s_max() const { return max_pages * page_size; }
  MSA_HD bool layer_ok() const { return layer >= 0 && layer < num_layers; }

  // Page of key k for the page-table row `table_row` (length MP), or -1 when the key has no page:
  // k outside [0, S_max), page id outside [0, NB) or layer outside [0, L).
  MSA_HD int64_t page_of(const int32_t* table_row, int64_t k) const {
    if (!layer_ok() || k < 0 || k >= s_max()) return -1;
    int64_t page = static_cast<int64_t>(table_row[k / page_size]);
    return (page >= 0 && page < num_blocks) ? page : -1;
  }
  // Element offset of kv_blocks[page, which, layer, slot, head, 0].
  MSA_HD int64_t offset(int64_t page, int64_t which, int64_t slot, int64_t head) const {
    return ((((page * kv + which) * num_layers + layer) * page_size + slot) * n_kv_heads + head) * head_dim;
  }
  // Key k exists for a sequence with num_keys keys (§2).
  MSA_HD bool key_exists(const int32_t* table_row, int64_t k, int64_t num_keys) const {
    return k < num_keys && page_of(table_row, k) >= 0;
  }
};

// Write position of a stored row (§9): c_b clamped only below at 0.
MSA_HD inline int64_t store_position(int32_t cache_length, int64_t row_in_seq) {
  return imax(0, static_cast<int64_t>(cache_length)) + row_in_seq;
}

}  // namespace msa_ops

#endif  // MSA_OPS_PAGED_H_
