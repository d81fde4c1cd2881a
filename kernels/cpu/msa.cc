// CPU handler of MiniMax sparse attention (SEMANTICS.md §7): exact softmax over the union of the
// selected 128-token blocks (one page each), causal, shared by the `group` query heads of a kv head.
// Split-K (num_partitions > 1) splits the top-k slots; partials are combined as in §6.
#include <algorithm>
#include <cstring>
#include <vector>

#include "attention_core.h"
#include "handler_util.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/paged.h"
#include "split_k.h"
#include "thread_pool.h"

namespace msa_ops {
namespace cpu {
namespace {

struct MsaItem {
  int64_t b, t, g, p;
};

struct MsaScratch {
  std::vector<float> q, acc;
  std::vector<int64_t> lo, hi;
  std::vector<int64_t> seg_lo, seg_hi;  // the key ranges of the selected blocks this item scans
  std::vector<OnlineSoftmax> st;
  std::vector<unsigned char> seen;
  AttnScratch tile;
};

struct MsaProblem {
  const void* q;
  const void* kv;
  PagedKV geo;
  const int32_t* table;
  const int32_t* d_indices;
  int64_t T, H, Hkv, D, topk;
  float scale;
  AttnOutput out;
};

template <typename T>
void run_msa(const MsaProblem& pr, const std::vector<int64_t>& eff, const std::vector<int64_t>& cache) {
  const int64_t H = pr.H, D = pr.D, Hkv = pr.Hkv, group = H / Hkv, np = pr.out.np, T_ = pr.T, MP = pr.geo.max_pages;
  std::memset(pr.out.out, 0, static_cast<size_t>(T_ * H * D) * 2);
  const int64_t B = static_cast<int64_t>(cache.size());
  std::vector<MsaItem> items;
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = eff[b]; t < eff[b + 1]; ++t) {
      rows.push_back(t);
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t p = 0; p < np; ++p) items.push_back({b, t, g, p});
    }
  const AttendFn<T> attend = attend_fn<T>();
  const T* qp = static_cast<const T*>(pr.q);
  const float qmul = pr.scale * kLog2e;
  const int64_t s_max = pr.geo.s_max();

  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t wi) {
    thread_local MsaScratch ts;
    const MsaItem& it = items[wi];
    const int64_t n_b = eff[it.b + 1] - eff[it.b];
    const int64_t c = cache[it.b];
    const int64_t num_keys = c + n_b;
    const int64_t kmax = std::min(num_keys, s_max);
    const int64_t pos = c + (it.t - eff[it.b]);
    const int64_t hi_vis = std::min(kmax, pos + 1);
    const int64_t nq = group;
    ts.q.resize(nq * D);
    ts.acc.assign(nq * D, 0.f);
    ts.lo.assign(nq, 0);
    ts.hi.assign(nq, hi_vis);
    ts.st.resize(nq);
    for (int64_t hh = 0; hh < group; ++hh) {
      const T* src = qp + (it.t * H + it.g * group + hh) * D;
      for (int64_t d = 0; d < D; ++d) ts.q[hh * D + d] = to_float(src[d]) * qmul;
      ts.st[hh].init();
    }
    int64_t slo = 0, shi = pr.topk;
    if (np > 1) msa_slot_range(pr.topk, np, it.p, &slo, &shi);
    if (static_cast<int64_t>(ts.seen.size()) < MP) ts.seen.assign(MP, 0);
    KvRows<T> kv;
    kv.k_base = static_cast<const T*>(pr.kv);
    kv.paged = true;
    kv.geo = pr.geo;
    kv.table_row = pr.table + it.b * MP;
    kv.num_keys = kmax;
    kv.head = it.g;
    kv.head_dim = D;
    const int32_t* sel = pr.d_indices + (it.g * T_ + it.t) * pr.topk;
    ts.seg_lo.clear();
    ts.seg_hi.clear();
    for (int64_t s = 0; s < shi; ++s) {
      const int64_t j = sel[s];
      if (j < 0 || j >= MP || j * kMsaBlockSize >= num_keys || ts.seen[j]) continue;
      ts.seen[j] = 1;  // a duplicate counts only at its first slot
      if (s < slo) continue;
      const int64_t k0 = j * kMsaBlockSize;
      const int64_t k1 = std::min(k0 + kMsaBlockSize, hi_vis);
      if (k0 < k1) {
        ts.seg_lo.push_back(k0);
        ts.seg_hi.push_back(k1);
      }
    }
    // One scan over the blocks in slot order (the rows of the blocks ahead are prefetched across blocks).
    if (!ts.seg_lo.empty())
      attend(kv, nq, ts.q.data(), ts.lo.data(), ts.hi.data(), ts.seg_lo.data(), ts.seg_hi.data(),
             static_cast<int64_t>(ts.seg_lo.size()), ts.acc.data(), ts.st.data(), ts.tile);
    for (int64_t s = 0; s < shi; ++s) {
      const int64_t j = sel[s];
      if (j >= 0 && j < MP) ts.seen[j] = 0;
    }
    for (int64_t hh = 0; hh < group; ++hh)
      finish_query(pr.out, it.t, it.g * group + hh, it.p, ts.st[hh], ts.acc.data() + hh * D);
  });
  combine_rows(pr.out, rows);
}

Error MsaAttention(AnyBuffer q, AnyBuffer offsets, AnyBuffer cache_row_offsets, AnyBuffer kv, AnyBuffer cache_lengths,
                   AnyBuffer table, AnyBuffer layer, AnyBuffer d_indices, double scale, int64_t num_partitions,
                   int64_t max_q, AnyResult out, AnyResult ws_o, AnyResult ws_lse) {
  const char* target = "msa_ops_msa_attention";
  (void)max_q;  // the route bound: one algorithm serves every route on the CPU
  if (auto e = check_msa_operands(target, q, offsets, cache_row_offsets, kv, cache_lengths, table, layer, d_indices,
                                  *out, *ws_o, *ws_lse, num_partitions);
      e.failure())
    return e;
  const DataType dt = q.element_type();
  const int64_t T = dim(q, 0), H = dim(q, 1), D = kMsaHeadDim, Hkv = dim(kv, 4), B = count(cache_lengths);
  MsaProblem pr{};
  if (auto e = setup_output(target, pr.out, DataType::BF16, q, out, ws_o, ws_lse, T, H, D, num_partitions); e.failure())
    return e;
  pr.q = q.untyped_data();
  pr.kv = kv.untyped_data();
  pr.geo = PagedKV{dim(kv, 0), 2, dim(kv, 2), kMsaBlockSize, Hkv, D, dim(table, 1), read_i32_scalar(layer)};
  pr.table = idx(table);
  pr.d_indices = idx(d_indices);
  pr.T = T;
  pr.H = H;
  pr.Hkv = Hkv;
  pr.D = D;
  pr.topk = dim(d_indices, 2);
  pr.scale = static_cast<float>(scale);
  std::vector<int64_t> eff(B + 1), cache(B);
  repair_offsets(idx(offsets), B + 1, T, eff.data());
  for (int64_t b = 0; b < B; ++b) cache[b] = clamp_cache_length(idx(cache_lengths)[b], pr.geo.s_max());
  if (dt == DataType::BF16)
    run_msa<bf16_t>(pr, eff, cache);
  else
    run_msa<f8e4m3_t>(pr, eff, cache);
  return Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace msa_ops

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_msa_attention, msa_ops::cpu::MsaAttention,
                              MSA_OPS_SIG_MSA_ATTENTION(ffi::Ffi::Bind()));
