// CPU handlers of the MHA family: ragged/padded x paged/no-cache (SEMANTICS.md §1-§6).
#include <algorithm>
#include <cstring>
#include <vector>

#include "attention_core.h"
#include "handler_util.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/mask.h"
#include "msa_ops/paged.h"
#include "split_k.h"
#include "thread_pool.h"

namespace msa_ops {
namespace cpu {
namespace {

// One sequence as the attention loop sees it.
struct SeqDesc {
  int64_t row_begin;  // first flat row in q/out
  int64_t n_rows;
  int64_t pos0;      // position of the first row
  int64_t num_keys;  // N (split-K, null mask)
  int64_t kmax;      // keys >= kmax cannot exist
  int64_t b;         // page-table row (paged)
  int64_t kv_row0;   // first K/V row (contiguous)
};

struct MhaProblem {
  DataType dtype;
  const void* q;
  const void* k;  // kv_blocks (paged) or k
  const void* v;  // v (contiguous)
  bool paged;
  PagedKV geo;
  const int32_t* table;
  int64_t H, Hkv, D;
  int64_t mask, window;
  float scale;
  int64_t block_n;
  AttnOutput out;
};

struct WorkItem {
  int64_t seq, r0, r1, g, p;
};

struct ThreadScratch {
  std::vector<float> q, acc;
  std::vector<int64_t> lo, hi;
  std::vector<OnlineSoftmax> st;
  AttnScratch tile;
};

template <typename T>
void run_mha(const MhaProblem& pr, const std::vector<SeqDesc>& seqs) {
  const int64_t H = pr.H, D = pr.D, Hkv = pr.Hkv, group = H / Hkv, np = pr.out.np;
  std::memset(pr.out.out, 0, static_cast<size_t>(pr.out.rows * H * D) *
                                 (pr.dtype == DataType::F32 ? 4 : 2));
  const int64_t bm = std::max<int64_t>(1, std::min<int64_t>(32, 64 / group));
  std::vector<WorkItem> items;
  std::vector<int64_t> rows;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    const SeqDesc& sd = seqs[s];
    for (int64_t r = 0; r < sd.n_rows; ++r) rows.push_back(sd.row_begin + r);
    for (int64_t r0 = 0; r0 < sd.n_rows; r0 += bm)
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t p = 0; p < np; ++p) items.push_back({s, r0, std::min(sd.n_rows, r0 + bm), g, p});
  }
  const AttendFn<T> attend = attend_fn<T>();
  const T* qp = static_cast<const T*>(pr.q);
  const float qmul = pr.scale * kLog2e;

  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t wi) {
    thread_local ThreadScratch ts;
    const WorkItem& it = items[wi];
    const SeqDesc& sd = seqs[it.seq];
    const int64_t nq = (it.r1 - it.r0) * group;
    ts.q.resize(nq * D);
    ts.acc.assign(nq * D, 0.f);
    ts.lo.resize(nq);
    ts.hi.resize(nq);
    ts.st.resize(nq);
    int64_t plo = 0, phi = sd.num_keys;
    if (np > 1) split_k_partition_range(sd.num_keys, np, pr.block_n, it.p, &plo, &phi);
    int64_t scan_lo = INT64_MAX, scan_hi = INT64_MIN;
    for (int64_t r = it.r0; r < it.r1; ++r) {
      const int64_t row = sd.row_begin + r;
      const KeyInterval iv = visible_keys(pr.mask, pr.window, sd.pos0 + r, sd.kmax);
      const int64_t lo = std::max(iv.lo, plo), hi = std::min(iv.hi, phi);
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t i = (r - it.r0) * group + hh;
        const int64_t h = it.g * group + hh;
        const T* src = qp + (row * H + h) * D;
        float* dst = ts.q.data() + i * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * qmul;
        ts.lo[i] = lo;
        ts.hi[i] = hi;
        ts.st[i].init();
      }
      if (lo < hi) {
        scan_lo = std::min(scan_lo, lo);
        scan_hi = std::max(scan_hi, hi);
      }
    }
    if (scan_lo < scan_hi) {
      KvRows<T> kv;
      kv.k_base = static_cast<const T*>(pr.k);
      kv.v_base = static_cast<const T*>(pr.v);
      kv.paged = pr.paged;
      kv.geo = pr.geo;
      kv.table_row = pr.paged ? pr.table + sd.b * pr.geo.max_pages : nullptr;
      kv.row0 = sd.kv_row0;
      kv.n_kv_heads = Hkv;
      kv.num_keys = sd.kmax;
      kv.head = it.g;
      kv.head_dim = D;
      attend(kv, nq, ts.q.data(), ts.lo.data(), ts.hi.data(), &scan_lo, &scan_hi, 1, ts.acc.data(), ts.st.data(),
             ts.tile);
    }
    for (int64_t r = it.r0; r < it.r1; ++r)
      for (int64_t hh = 0; hh < group; ++hh) {
        const int64_t i = (r - it.r0) * group + hh;
        finish_query(pr.out, sd.row_begin + r, it.g * group + hh, it.p, ts.st[i], ts.acc.data() + i * D);
      }
  });
  combine_rows(pr.out, rows);
}

Error dispatch_mha(const char* target, const MhaProblem& pr, const std::vector<SeqDesc>& seqs) {
  switch (pr.dtype) {
    case DataType::F32: run_mha<float>(pr, seqs); break;
    case DataType::BF16: run_mha<bf16_t>(pr, seqs); break;
    case DataType::F16: run_mha<f16_t>(pr, seqs); break;
    default: return invalid(target, "q: expected bfloat16, float16 or float32");
  }
  return Error::Success();
}

// Shared checks of q[.., H, D] against kv_blocks[NB, 2, L, P, Hkv, D] and the page table.
Error setup_paged(const char* target, MhaProblem& pr, AnyBuffer q, AnyBuffer kv, int64_t B, AnyBuffer cache_lengths,
                  AnyBuffer table, AnyBuffer layer) {
  if (!is_attn_float(q.element_type())) return invalid(target, std::string("q: expected bfloat16, float16 or float32, got ") + dtype_name(q.element_type()));
  if (auto e = check_paged_cache(target, q, kv, pr.H, pr.D, B, cache_lengths, table, layer); e.failure()) return e;
  pr.paged = true;
  pr.Hkv = dim(kv, 4);
  pr.geo = PagedKV{dim(kv, 0), 2, dim(kv, 2), dim(kv, 3), dim(kv, 4), pr.D, dim(table, 1), read_i32_scalar(layer)};
  pr.table = idx(table);
  pr.k = kv.untyped_data();
  pr.v = nullptr;
  return Error::Success();
}

// The fields every dense handler fills the same way; the K/V source and the output come after.
MhaProblem make_problem(const AnyBuffer& q, int64_t H, int64_t D, int64_t mask, int64_t window, double scale,
                        int64_t block_n) {
  MhaProblem pr{};
  pr.dtype = q.element_type();
  pr.q = q.untyped_data();
  pr.H = H;
  pr.D = D;
  pr.mask = mask;
  pr.window = window;
  pr.scale = static_cast<float>(scale);
  pr.block_n = split_k_block_n(block_n);
  return pr;
}

Error MhaRaggedPaged(AnyBuffer q, AnyBuffer offsets, AnyBuffer kv, AnyBuffer cache_lengths, AnyBuffer table,
                     AnyBuffer layer, AnyBuffer sink, int64_t mask, int64_t window, double scale, int64_t has_sink,
                     int64_t num_partitions, int64_t block_n, int64_t /*tile_m: CUDA only*/, AnyResult out,
                     AnyResult ws_o, AnyResult ws_lse) {
  const char* target = "msa_ops_mha_ragged_paged";
  if (rank(q) != 3) return invalid(target, "q: expected [T, H, D], got " + dims_str(q));
  const int64_t T = dim(q, 0), H = dim(q, 1), D = dim(q, 2);
  const int64_t B = static_cast<int64_t>(cache_lengths.element_count());
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  if (block_n < 1) return invalid(target, "block_n: expected >= 1");
  MhaProblem pr = make_problem(q, H, D, mask, window, scale, block_n);
  if (auto e = setup_paged(target, pr, q, kv, B, cache_lengths, table, layer); e.failure()) return e;
  // Without sinks the operand only fills its slot (the lowering passes q): neither checked nor read.
  if (auto e = check_sink(target, has_sink != 0, sink, q, H); e.failure()) return e;
  if (auto e = setup_output(target, pr.out, pr.dtype, q, out, ws_o, ws_lse, T, H, D, num_partitions); e.failure()) return e;
  std::vector<float> sink2(H);
  for (int64_t h = 0; h < H && has_sink; ++h)
    sink2[h] = sink_log2(load_float(sink.element_type(), sink.untyped_data(), h));
  pr.out.has_sink = has_sink != 0;
  pr.out.sink2 = sink2.data();

  std::vector<int64_t> eff(B + 1);
  repair_offsets(idx(offsets), B + 1, T, eff.data());
  const int32_t* cl = idx(cache_lengths);
  std::vector<SeqDesc> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = eff[b + 1] - eff[b];
    if (n <= 0) continue;
    const int64_t c = clamp_cache_length(cl[b], pr.geo.s_max());
    seqs.push_back({eff[b], n, c, c + n, std::min(c + n, pr.geo.s_max()), b, 0});
  }
  return dispatch_mha(target, pr, seqs);
}

Error MhaPaddedPaged(AnyBuffer q, AnyBuffer kv, AnyBuffer cache_lengths, AnyBuffer table, AnyBuffer layer,
                     AnyBuffer valid_lengths, int64_t mask, int64_t window, double scale, int64_t num_partitions,
                     int64_t block_n, int64_t /*tile_m: CUDA only*/, AnyResult out, AnyResult ws_o,
                     AnyResult ws_lse) {
  const char* target = "msa_ops_mha_padded_paged";
  if (rank(q) != 4) return invalid(target, "q: expected [B, S, H, D], got " + dims_str(q));
  const int64_t B = dim(q, 0), S = dim(q, 1), H = dim(q, 2), D = dim(q, 3);
  if (auto e = check_index(target, "valid_lengths", valid_lengths, B); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  if (block_n < 1) return invalid(target, "block_n: expected >= 1");
  MhaProblem pr = make_problem(q, H, D, mask, window, scale, block_n);
  if (auto e = setup_paged(target, pr, q, kv, B, cache_lengths, table, layer); e.failure()) return e;
  int64_t rows = 0;
  if (auto e = padded_rows(target, q, &rows); e.failure()) return e;
  if (auto e = setup_output(target, pr.out, pr.dtype, q, out, ws_o, ws_lse, rows, H, D, num_partitions); e.failure()) return e;
  const int32_t* cl = idx(cache_lengths);
  const int32_t* vl = idx(valid_lengths);
  std::vector<SeqDesc> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = iclamp(vl[b], 0, S);
    if (nq <= 0) continue;
    const int64_t c = clamp_cache_length(cl[b], pr.geo.s_max());
    seqs.push_back({b * S, nq, c, c + nq, std::min(c + nq, pr.geo.s_max()), b, 0});
  }
  return dispatch_mha(target, pr, seqs);
}

Error setup_no_cache(const char* target, MhaProblem& pr, AnyBuffer q, AnyBuffer k, AnyBuffer v, int64_t kv_heads_dim) {
  if (!is_attn_float(q.element_type())) return invalid(target, std::string("q: expected bfloat16, float16 or float32, got ") + dtype_name(q.element_type()));
  if (auto e = check_no_cache_kv(target, q, k, v, kv_heads_dim + 2, static_cast<int>(kv_heads_dim), pr.H, pr.D);
      e.failure())
    return e;
  const int64_t Hkv = dim(k, static_cast<int>(kv_heads_dim));
  pr.paged = false;
  pr.Hkv = Hkv;
  pr.k = k.untyped_data();
  pr.v = v.untyped_data();
  pr.table = nullptr;
  return Error::Success();
}

Error MhaRaggedNoCache(AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer offsets, AnyBuffer kv_offsets, int64_t mask,
                       int64_t window, double scale, AnyResult out) {
  const char* target = "msa_ops_mha_ragged_no_cache";
  if (rank(q) != 3) return invalid(target, "q: expected [T, H, D], got " + dims_str(q));
  if (rank(k) != 3) return invalid(target, "k: expected [Tk, Hkv, D], got " + dims_str(k));
  const int64_t T = dim(q, 0), H = dim(q, 1), D = dim(q, 2), Tk = dim(k, 0);
  const int64_t B = static_cast<int64_t>(offsets.element_count()) - 1;
  if (B < 0) return invalid(target, "input_row_offsets: expected at least one element");
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "kv_input_row_offsets", kv_offsets, B + 1); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  MhaProblem pr = make_problem(q, H, D, mask, window, scale, kSplitKBlockN);
  if (auto e = setup_no_cache(target, pr, q, k, v, 1); e.failure()) return e;
  if (auto e = setup_output(target, pr.out, pr.dtype, q, out, out, out, T, H, D, 1); e.failure()) return e;
  std::vector<int64_t> eq(B + 1), ek(B + 1);
  repair_offsets(idx(offsets), B + 1, T, eq.data());
  repair_offsets(idx(kv_offsets), B + 1, Tk, ek.data());
  std::vector<SeqDesc> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = eq[b + 1] - eq[b], nk = ek[b + 1] - ek[b];
    if (n <= 0) continue;
    seqs.push_back({eq[b], n, nk - n, nk, nk, b, ek[b]});
  }
  return dispatch_mha(target, pr, seqs);
}

Error MhaPaddedNoCache(AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer valid_length, int64_t mask, int64_t window,
                       double scale, AnyResult out) {
  const char* target = "msa_ops_mha_padded_no_cache";
  if (rank(q) != 4) return invalid(target, "q: expected [B, S, H, D], got " + dims_str(q));
  const int64_t B = dim(q, 0), S = dim(q, 1), H = dim(q, 2), D = dim(q, 3);
  if (rank(k) != 4 || dim(k, 0) != B) return invalid(target, "k: expected [B, Sk, Hkv, D] with B = " + std::to_string(B) + ", got " + dims_str(k));
  const int64_t Sk = dim(k, 1);
  if (auto e = check_index(target, "valid_length", valid_length, B); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  MhaProblem pr = make_problem(q, H, D, mask, window, scale, kSplitKBlockN);
  if (auto e = setup_no_cache(target, pr, q, k, v, 2); e.failure()) return e;
  int64_t rows = 0;
  if (auto e = padded_rows(target, q, &rows); e.failure()) return e;
  if (auto e = setup_output(target, pr.out, pr.dtype, q, out, out, out, rows, H, D, 1); e.failure()) return e;
  const int32_t* vl = idx(valid_length);
  std::vector<SeqDesc> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = iclamp(vl[b], 0, S), nk = iclamp(vl[b], 0, Sk);
    if (nq <= 0) continue;
    seqs.push_back({b * S, nq, nk - nq, nk, nk, b, b * Sk});
  }
  return dispatch_mha(target, pr, seqs);
}

}  // namespace
}  // namespace cpu
}  // namespace msa_ops

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_ragged_paged, msa_ops::cpu::MhaRaggedPaged,
                              MSA_OPS_SIG_MHA_RAGGED_PAGED(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_padded_paged, msa_ops::cpu::MhaPaddedPaged,
                              MSA_OPS_SIG_MHA_PADDED_PAGED(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_ragged_no_cache, msa_ops::cpu::MhaRaggedNoCache,
                              MSA_OPS_SIG_MHA_RAGGED_NO_CACHE(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_padded_no_cache, msa_ops::cpu::MhaPaddedNoCache,
                              MSA_OPS_SIG_MHA_PADDED_NO_CACHE(ffi::Ffi::Bind()));
