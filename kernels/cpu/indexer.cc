// CPU handler of the MSA block indexer (SEMANTICS.md §8): per query row and index head, score every
// eligible 128-token block by its max visible key score and pick top-k (forced init/local blocks first). The
// scoring loop is compiled as a baseline loop and an AVX2+FMA clone (simd.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "handler_util.h"
#include "simd.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/paged.h"
#include "thread_pool.h"

namespace msa_ops {
namespace cpu {
namespace {

constexpr int64_t kRowsPerItem = 8;

struct IndexerProblem {
  DataType q_type;
  const void* q;
  const void* k;
  PagedKV geo;
  const int32_t* table;
  int64_t T, Hi, Di, topk, init_blocks, local_blocks;
  float scale;
  int32_t* out;
};

struct IndexerItem {
  int64_t b, r0, r1;  // rows [r0, r1) of sequence b (flat rows)
};

struct IndexerScratch {
  std::vector<float> q, kt, s, scores;
  std::vector<unsigned char> eligible;
  std::vector<int32_t> cand, chosen;
};

// Chooses the ids for one (row, head) and writes them ascending, -1 padded.
void select_blocks(const IndexerProblem& pr, const float* score, const unsigned char* eligible, int64_t nblk,
                   IndexerScratch& ts, int32_t* dst) {
  const int64_t topk = pr.topk;
  ts.cand.clear();
  for (int64_t j = 0; j < nblk; ++j)
    if (eligible[j]) ts.cand.push_back(static_cast<int32_t>(j));
  const int64_t E = static_cast<int64_t>(ts.cand.size());
  ts.chosen.clear();
  if (E <= topk) {
    ts.chosen.assign(ts.cand.begin(), ts.cand.end());
  } else {
    const int64_t ni = pr.init_blocks, nl = pr.local_blocks;
    for (int64_t i = 0; i < ni; ++i) ts.chosen.push_back(ts.cand[i]);
    for (int64_t i = E - nl; i < E; ++i) ts.chosen.push_back(ts.cand[i]);
    const int64_t want = topk - ni - nl;
    auto mid_begin = ts.cand.begin() + ni, mid_end = ts.cand.end() - nl;
    auto better = [&](int32_t a, int32_t b) {
      const float sa = score[a], sb = score[b];
      if (sa != sb) return sa > sb;
      return a < b;
    };
    if (want > 0) {
      std::partial_sort(mid_begin, mid_begin + want, mid_end, better);
      ts.chosen.insert(ts.chosen.end(), mid_begin, mid_begin + want);
    }
    std::sort(ts.chosen.begin(), ts.chosen.end());
  }
  const int64_t n = static_cast<int64_t>(ts.chosen.size());
  for (int64_t i = 0; i < topk; ++i) dst[i] = i < n ? ts.chosen[i] : -1;
}

// The scores of one work item: for each of its rows r, index heads h and blocks j, the max over the block's keys
// k <= the row's position of q.k (q already scaled); ts.eligible[r][j] where the row sees a key of block j. Each
// block's rows are converted to f32 once for all nr x Hi query vectors, while the next block's rows are prefetched
// (its page is elsewhere in the pool), and scored in blocks of 2 query vectors x 4 keys (simd.h).
template <typename T, int L>
MSA_OPS_ALWAYS_INLINE inline void score_item_impl(const IndexerProblem& pr, const IndexerItem& it, int64_t c,
                                                  int64_t key_end, int64_t nblk, int64_t row0, IndexerScratch& ts) {
  constexpr int64_t BS = kMsaBlockSize;
  const int64_t Hi = pr.Hi, Di = pr.Di, nr = it.r1 - it.r0, nv = nr * Hi;
  const int64_t row_bytes = Di * static_cast<int64_t>(sizeof(T));
  const T* kbase = static_cast<const T*>(pr.k);
  const int32_t* table_row = pr.table + it.b * pr.geo.max_pages;
  const float* q = ts.q.data();
  float* kf = ts.kt.data();  // [BS][Di]
  float* s = ts.s.data();    // [nv][BS]
  auto block_rows = [&](int64_t j) -> const T* {
    const int64_t page = j < nblk ? pr.geo.page_of(table_row, j * BS) : -1;
    return page < 0 ? nullptr : kbase + pr.geo.offset(page, 0, 0, 0);
  };
  const T* next = block_rows(0);
  for (int64_t j = 0; j < nblk; ++j) {
    const T* rows = next;
    next = block_rows(j + 1);
    if (rows == nullptr) continue;
    const int64_t k0 = j * BS, n = std::min(k0 + BS, key_end) - k0;
    if (n <= 0) continue;
    for (int64_t kk = 0; kk < n; ++kk) {
      if (next != nullptr) prefetch_row(reinterpret_cast<const char*>(next + kk * Di), row_bytes);
      convert_row<L, T>(rows + kk * Di, kf + kk * Di, Di);
    }
    if (next != nullptr)
      for (int64_t kk = n; kk < BS; ++kk)
        prefetch_row(reinterpret_cast<const char*>(next + kk * Di), row_bytes);
    // Scores of the block's keys below key_end (the keys the item's last row sees) for every query vector.
    if (Di % L == 0) {
      scores_2x4<L>(q, nv, Di, kf, 0, n, s, BS);
    } else {
      for (int64_t v = 0; v < nv; ++v)
        for (int64_t kk = 0; kk < n; kk += 4) {
          const int64_t last = n - 1;
          float r[4];
          dot4<L>(q + v * Di, kf + kk * Di, kf + std::min(kk + 1, last) * Di, kf + std::min(kk + 2, last) * Di,
                  kf + std::min(kk + 3, last) * Di, Di, r);
          for (int64_t u = 0; u < std::min<int64_t>(4, n - kk); ++u) s[v * BS + kk + u] = r[u];
        }
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t pos = c + (it.r0 + r - row0);
      const int64_t cnt = std::min(n, pos + 1 - k0);  // keys k0..k0+cnt-1 are <= pos
      if (cnt <= 0) continue;
      ts.eligible[r * nblk + j] = 1;
      for (int64_t h = 0; h < Hi; ++h) {
        const float* sv = s + (r * Hi + h) * BS;
        float m = -INFINITY;
        for (int64_t kk = 0; kk < cnt; ++kk)
          if (sv[kk] > m) m = sv[kk];  // NaN scores never win
        ts.scores[(r * Hi + h) * nblk + j] = m;
      }
    }
  }
}

template <typename T>
void score_item_generic(const IndexerProblem& pr, const IndexerItem& it, int64_t c, int64_t key_end, int64_t nblk,
                        int64_t row0, IndexerScratch& ts) {
  score_item_impl<T, 4>(pr, it, c, key_end, nblk, row0, ts);
}

#if defined(MSA_OPS_X86_CLONE)
template <typename T>
__attribute__((target("avx2,fma"))) void score_item_avx2(const IndexerProblem& pr, const IndexerItem& it, int64_t c,
                                                         int64_t key_end, int64_t nblk, int64_t row0,
                                                         IndexerScratch& ts) {
  score_item_impl<T, 8>(pr, it, c, key_end, nblk, row0, ts);
}
#endif

template <typename T>
void run_indexer(const IndexerProblem& pr, const std::vector<int64_t>& eff, const std::vector<int64_t>& cache) {
  const int64_t T_ = pr.T, Hi = pr.Hi, Di = pr.Di, topk = pr.topk, BS = kMsaBlockSize;
  for (int64_t i = 0; i < Hi * T_ * topk; ++i) pr.out[i] = -1;
  if (topk <= 0) return;
  const int64_t B = static_cast<int64_t>(cache.size());
  std::vector<IndexerItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r0 = eff[b]; r0 < eff[b + 1]; r0 += kRowsPerItem)
      items.push_back({b, r0, std::min(eff[b + 1], r0 + kRowsPerItem)});
  const int64_t s_max = pr.geo.s_max();
  auto score_item = &score_item_generic<T>;
#if defined(MSA_OPS_X86_CLONE)
  if (use_avx2()) score_item = &score_item_avx2<T>;
#endif

  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t wi) {
    thread_local IndexerScratch ts;
    const IndexerItem& it = items[wi];
    const int64_t c = cache[it.b];
    const int64_t num_keys = c + (eff[it.b + 1] - eff[it.b]);
    const int64_t kmax = std::min(num_keys, s_max);
    const int64_t nr = it.r1 - it.r0;
    const int64_t p_last = c + (it.r1 - 1 - eff[it.b]);
    const int64_t key_end = std::min(kmax, p_last + 1);
    const int64_t nblk = key_end > 0 ? ceil_div(key_end, BS) : 0;
    ts.q.resize(nr * Hi * Di);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t h = 0; h < Hi; ++h)
        for (int64_t d = 0; d < Di; ++d)
          ts.q[(r * Hi + h) * Di + d] = load_float(pr.q_type, pr.q, ((it.r0 + r) * Hi + h) * Di + d) * pr.scale;
    ts.kt.resize(Di * BS);
    ts.s.resize(nr * Hi * BS);
    ts.scores.assign(nr * Hi * std::max<int64_t>(nblk, 1), -INFINITY);
    ts.eligible.assign(nr * std::max<int64_t>(nblk, 1), 0);
    score_item(pr, it, c, key_end, nblk, eff[it.b], ts);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t h = 0; h < Hi; ++h)
        select_blocks(pr, ts.scores.data() + (r * Hi + h) * nblk, ts.eligible.data() + r * nblk, nblk, ts,
                      pr.out + (h * T_ + it.r0 + r) * topk);
  });
}

Error MsaIndexer(AnyBuffer q, AnyBuffer offsets, AnyBuffer k_blocks, AnyBuffer cache_lengths, AnyBuffer table,
                 AnyBuffer layer, int64_t topk, int64_t init_blocks, int64_t local_blocks, double scale, AnyResult out) {
  const char* target = "msa_ops_msa_indexer";
  if (auto e = check_indexer_operands(target, q, offsets, k_blocks, cache_lengths, table, layer, topk, init_blocks,
                                      local_blocks, *out);
      e.failure())
    return e;
  const int64_t T = dim(q, 0), Hi = dim(q, 1), Di = dim(q, 2);
  const int64_t B = count(cache_lengths);
  IndexerProblem pr{};
  pr.q_type = q.element_type();
  pr.q = q.untyped_data();
  pr.k = k_blocks.untyped_data();
  pr.geo = PagedKV{dim(k_blocks, 0), 1, dim(k_blocks, 2), kMsaBlockSize, 1, Di, dim(table, 1), read_i32_scalar(layer)};
  pr.table = idx(table);
  pr.T = T;
  pr.Hi = Hi;
  pr.Di = Di;
  pr.topk = topk;
  pr.init_blocks = init_blocks;
  pr.local_blocks = local_blocks;
  pr.scale = static_cast<float>(scale);
  pr.out = static_cast<int32_t*>(out->untyped_data());
  std::vector<int64_t> eff(B + 1), cache(B);
  repair_offsets(idx(offsets), B + 1, T, eff.data());
  for (int64_t b = 0; b < B; ++b) cache[b] = clamp_cache_length(idx(cache_lengths)[b], pr.geo.s_max());
  switch (k_blocks.element_type()) {
    case DataType::F32: run_indexer<float>(pr, eff, cache); break;
    case DataType::BF16: run_indexer<bf16_t>(pr, eff, cache); break;
    case DataType::F16: run_indexer<f16_t>(pr, eff, cache); break;
    default: run_indexer<f8e4m3_t>(pr, eff, cache); break;
  }
  return Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace msa_ops

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_msa_indexer, msa_ops::cpu::MsaIndexer,
                              MSA_OPS_SIG_MSA_INDEXER(ffi::Ffi::Bind()));
