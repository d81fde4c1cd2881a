// Operand checks of the FFI handlers, shared by the CPU and CUDA libraries so that a direct FFI call with buffers
// that disagree is rejected the same way on both, with an error naming the target and the operand, before any
// kernel reads or writes through a size the buffers do not have. What a platform supports beyond the contract
// (the CUDA kernels' dtypes and head dims, topk and max_pages limits) is checked by its handler.
#ifndef MSA_OPS_CHECKS_H_
#define MSA_OPS_CHECKS_H_

#include <cstdint>
#include <string>

#include "msa_ops/common.h"
#include "msa_ops/ffi.h"
#include "msa_ops/mask.h"

namespace msa_ops {

inline std::string dims_str(const AnyBuffer& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

inline const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::F32: return "float32";
    case DataType::BF16: return "bfloat16";
    case DataType::F16: return "float16";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    case DataType::S32: return "int32";
    case DataType::U32: return "uint32";
    default: return "other";
  }
}

inline int64_t count(const AnyBuffer& b) { return static_cast<int64_t>(b.element_count()); }

inline bool is_index_type(const AnyBuffer& b) {
  return b.element_type() == DataType::S32 || b.element_type() == DataType::U32;
}

// An int32/uint32 operand of exactly `n` elements (rank-free: the lowering decides shapes).
inline Error check_index(const char* target, const char* name, const AnyBuffer& b, int64_t n) {
  if (!is_index_type(b))
    return invalid(target, std::string(name) + ": expected int32 or uint32, got " + dtype_name(b.element_type()));
  if (count(b) != n)
    return invalid(target, std::string(name) + ": expected " + std::to_string(n) + " elements, got shape " + dims_str(b));
  return Error::Success();
}

// A page table int32[B, max_pages].
inline Error check_table(const char* target, const char* name, const AnyBuffer& table, int64_t B) {
  if (!is_index_type(table) || rank(table) != 2 || dim(table, 0) != B)
    return invalid(target, std::string(name) + ": expected int32[" + std::to_string(B) + ", max_pages], got " +
                               dtype_name(table.element_type()) + dims_str(table));
  return Error::Success();
}

inline Error check_mask(const char* target, int64_t mask, int64_t window) {
  if (!mask_code_valid(mask)) return invalid(target, "mask: expected a code in [0, 4], got " + std::to_string(mask));
  if (mask_needs_window(mask) && window <= 0)
    return invalid(target, "window: the mask needs local_window_size > 0, got " + std::to_string(window));
  return Error::Success();
}

// q's query heads: at least one.
inline Error check_heads(const char* target, const AnyBuffer& q, int64_t H) {
  if (H < 1) return invalid(target, "q: expected at least one query head, got " + dims_str(q));
  return Error::Success();
}

// kv_blocks[NB, 2, L, P, Hkv, D] in q's dtype, with q's head dim, Hkv dividing q's H; cache_lengths[B], the page
// table [B, max_pages] and the scalar layer_idx, all int32/uint32.
inline Error check_paged_cache(const char* target, const AnyBuffer& q, const AnyBuffer& kv, int64_t H, int64_t D,
                               int64_t B, const AnyBuffer& cache_lengths, const AnyBuffer& table,
                               const AnyBuffer& layer) {
  if (auto e = check_heads(target, q, H); e.failure()) return e;
  if (kv.element_type() != q.element_type())
    return invalid(target, std::string("kv_blocks: expected q's dtype ") + dtype_name(q.element_type()) + ", got " +
                               dtype_name(kv.element_type()));
  if (rank(kv) != 6 || dim(kv, 1) != 2)
    return invalid(target, "kv_blocks: expected [num_blocks, 2, num_layers, page_size, n_kv_heads, head_dim], got " +
                               dims_str(kv));
  if (dim(kv, 5) != D) return invalid(target, "kv_blocks: head_dim must equal q's head_dim " + std::to_string(D));
  if (dim(kv, 4) <= 0 || H % dim(kv, 4) != 0)
    return invalid(target, "kv_blocks: n_kv_heads must divide q's heads " + std::to_string(H) + ", got " + dims_str(kv));
  if (dim(kv, 3) <= 0) return invalid(target, "kv_blocks: page_size must be > 0");
  if (auto e = check_index(target, "cache_lengths", cache_lengths, B); e.failure()) return e;
  if (auto e = check_table(target, "kv_lookup_table", table, B); e.failure()) return e;
  return check_index(target, "layer_idx", layer, 1);
}

// Sink weights [H] in q's dtype, when the call has them (without, the operand only fills its slot).
inline Error check_sink(const char* target, bool has_sink, const AnyBuffer& sink, const AnyBuffer& q, int64_t H) {
  if (has_sink && (sink.element_type() != q.element_type() || count(sink) != H))
    return invalid(target, std::string("sink_weights: expected ") + dtype_name(q.element_type()) + "[" +
                               std::to_string(H) + "], got " + dtype_name(sink.element_type()) + dims_str(sink));
  return Error::Success();
}

// No-cache k and v: q's dtype, one shape, rank `kv_rank` with n_kv_heads at `heads_axis` dividing H and q's head
// dim after it.
inline Error check_no_cache_kv(const char* target, const AnyBuffer& q, const AnyBuffer& k, const AnyBuffer& v,
                               int64_t kv_rank, int heads_axis, int64_t H, int64_t D) {
  if (auto e = check_heads(target, q, H); e.failure()) return e;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid(target, std::string("k, v: expected q's dtype ") + dtype_name(q.element_type()));
  if (rank(k) != kv_rank)
    return invalid(target, "k: expected rank " + std::to_string(kv_rank) + ", got " + dims_str(k));
  if (dims_str(v) != dims_str(k)) return invalid(target, "v: expected k's shape " + dims_str(k) + ", got " + dims_str(v));
  const int64_t Hkv = dim(k, heads_axis);
  if (dim(k, heads_axis + 1) != D)
    return invalid(target, "k: head_dim must equal q's head_dim " + std::to_string(D) + ", got " + dims_str(k));
  if (Hkv <= 0 || H % Hkv != 0)
    return invalid(target, "k: n_kv_heads must divide q's heads " + std::to_string(H) + ", got " + dims_str(k));
  return Error::Success();
}

// a * b for a, b >= 0, false where the product would pass INT64_MAX (a direct call's dims: an empty q, D = 0, may
// carry any T and H, and np * T * H could wrap onto the element count of a small workspace).
inline bool mul_fits(int64_t a, int64_t b, int64_t* r) {
  if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a)) return false;
  *r = a * b;
  return true;
}

// q[B, S, H, D]'s rows, B * S, where it fits in int64 (an empty q may carry any B and S).
inline Error padded_rows(const char* target, const AnyBuffer& q, int64_t* rows) {
  if (!mul_fits(dim(q, 0), dim(q, 1), rows)) return invalid(target, "q: B * S must fit in int64, got " + dims_str(q));
  return Error::Success();
}

// The attention output (`rows` x H x D in `dt`) and, split (np > 1), the float32 workspaces ws_o[np, rows, H, D]
// and ws_lse[np, rows, H].
inline Error check_attention_output(const char* target, DataType dt, const AnyBuffer& q, const AnyBuffer& out,
                                    const AnyBuffer& ws_o, const AnyBuffer& ws_lse, int64_t rows, int64_t H, int64_t D,
                                    int64_t np) {
  int64_t rows_h = 0, elems = 0;
  if (!mul_fits(rows, H, &rows_h) || !mul_fits(rows_h, D, &elems) || out.element_type() != dt || count(out) != elems)
    return invalid(target, std::string("out: expected ") + dtype_name(dt) + " of q's shape " + dims_str(q) + ", got " +
                               dtype_name(out.element_type()) + dims_str(out));
  if (np < 1 || np > kMaxPartitions)
    return invalid(target, "num_partitions: expected 1 to " + std::to_string(kMaxPartitions) + ", got " +
                               std::to_string(np));
  if (np == 1) return Error::Success();
  int64_t ws_o_n = 0, ws_lse_n = 0;
  if (!mul_fits(np, elems, &ws_o_n) || ws_o.element_type() != DataType::F32 || count(ws_o) != ws_o_n)
    return invalid(target, "ws_o: expected float32[" + std::to_string(np) + "," + std::to_string(rows) + "," +
                               std::to_string(H) + "," + std::to_string(D) + "], got " + dims_str(ws_o));
  if (!mul_fits(np, rows_h, &ws_lse_n) || ws_lse.element_type() != DataType::F32 || count(ws_lse) != ws_lse_n)
    return invalid(target, "ws_lse: expected float32[" + std::to_string(np) + "," + std::to_string(rows) + "," +
                               std::to_string(H) + "], got " + dims_str(ws_lse));
  return Error::Success();
}

// mo.msa.attention.ragged.paged: q[T, H, 128] and kv_blocks[NB, 2, L, 128, Hkv, 128], both bf16 or both e4m3;
// offsets (both) [B+1], cache_lengths[B], the page table, layer_idx and d_indices[Hkv, T, topk]; the output and
// workspaces as check_attention_output.
inline Error check_msa_operands(const char* target, const AnyBuffer& q, const AnyBuffer& offsets,
                                const AnyBuffer& cache_row_offsets, const AnyBuffer& kv,
                                const AnyBuffer& cache_lengths, const AnyBuffer& table, const AnyBuffer& layer,
                                const AnyBuffer& d_indices, const AnyBuffer& out, const AnyBuffer& ws_o,
                                const AnyBuffer& ws_lse, int64_t num_partitions) {
  const DataType dt = q.element_type();
  if (dt != DataType::BF16 && dt != DataType::F8E4M3FN)
    return invalid(target, std::string("q: expected bfloat16 or float8_e4m3fn, got ") + dtype_name(dt));
  if (kv.element_type() != dt)
    return invalid(target, std::string("kv_blocks: expected q's dtype ") + dtype_name(dt) + ", got " +
                               dtype_name(kv.element_type()));
  if (rank(q) != 3 || dim(q, 2) != kMsaHeadDim) return invalid(target, "q: expected [T, H, 128], got " + dims_str(q));
  const int64_t T = dim(q, 0), H = dim(q, 1);
  if (auto e = check_heads(target, q, H); e.failure()) return e;
  if (rank(kv) != 6 || dim(kv, 1) != 2 || dim(kv, 3) != kMsaBlockSize || dim(kv, 5) != kMsaHeadDim)
    return invalid(target, "kv_blocks: expected [num_blocks, 2, num_layers, 128, n_kv_heads, 128], got " + dims_str(kv));
  const int64_t Hkv = dim(kv, 4);
  if (Hkv <= 0 || H % Hkv != 0)
    return invalid(target, "kv_blocks: n_kv_heads must divide q's heads " + std::to_string(H) + ", got " + dims_str(kv));
  const int64_t B = count(cache_lengths);
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "cache_row_offsets", cache_row_offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "cache_lengths", cache_lengths, B); e.failure()) return e;
  if (auto e = check_table(target, "kv_lookup_table", table, B); e.failure()) return e;
  if (auto e = check_index(target, "layer_idx", layer, 1); e.failure()) return e;
  if (!is_index_type(d_indices) || rank(d_indices) != 3 || dim(d_indices, 0) != Hkv || dim(d_indices, 1) != T)
    return invalid(target, "d_indices: expected int32[" + std::to_string(Hkv) + ", " + std::to_string(T) +
                               ", topk], got " + dtype_name(d_indices.element_type()) + dims_str(d_indices));
  return check_attention_output(target, DataType::BF16, q, out, ws_o, ws_lse, T, H, kMsaHeadDim, num_partitions);
}

// mo.msa.indexer.ragged.paged: q[T, Hi, Di] and k_blocks[NB, 1, L, 128, 1, Di] in one dtype (bf16, f16, f32 or
// e4m3), offsets[B+1], k_cache_lengths[B], the page table, layer_idx, 0 <= init + local <= topk, out int32[Hi, T, topk].
inline Error check_indexer_operands(const char* target, const AnyBuffer& q, const AnyBuffer& offsets,
                                    const AnyBuffer& k_blocks, const AnyBuffer& cache_lengths, const AnyBuffer& table,
                                    const AnyBuffer& layer, int64_t topk, int64_t init_blocks, int64_t local_blocks,
                                    const AnyBuffer& out) {
  const DataType dt = q.element_type();
  if (dt != DataType::BF16 && dt != DataType::F16 && dt != DataType::F32 && dt != DataType::F8E4M3FN)
    return invalid(target, std::string("q: expected bfloat16, float16, float32 or float8_e4m3fn, got ") + dtype_name(dt));
  if (k_blocks.element_type() != dt)
    return invalid(target, std::string("k_blocks: expected q's dtype ") + dtype_name(dt) + ", got " +
                               dtype_name(k_blocks.element_type()));
  if (rank(q) != 3) return invalid(target, "q: expected [T, Hi, Di], got " + dims_str(q));
  const int64_t T = dim(q, 0), Hi = dim(q, 1), Di = dim(q, 2);
  if (Hi < 1) return invalid(target, "q: expected at least one index head, got " + dims_str(q));
  if (rank(k_blocks) != 6 || dim(k_blocks, 1) != 1 || dim(k_blocks, 3) != kMsaBlockSize || dim(k_blocks, 4) != 1 ||
      dim(k_blocks, 5) != Di)
    return invalid(target, "k_blocks: expected [num_blocks, 1, num_layers, 128, 1, " + std::to_string(Di) + "], got " +
                               dims_str(k_blocks));
  const int64_t B = count(cache_lengths);
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "k_cache_lengths", cache_lengths, B); e.failure()) return e;
  if (auto e = check_table(target, "k_lookup_table", table, B); e.failure()) return e;
  if (auto e = check_index(target, "layer_idx", layer, 1); e.failure()) return e;
  if (topk < 0 || init_blocks < 0 || local_blocks < 0 || init_blocks > topk || local_blocks > topk - init_blocks)
    return invalid(target, "topk/init_blocks/local_blocks: expected 0 <= init_blocks + local_blocks <= topk, got " +
                               std::to_string(topk) + "/" + std::to_string(init_blocks) + "/" +
                               std::to_string(local_blocks));
  if (out.element_type() != DataType::S32 || rank(out) != 3 || dim(out, 0) != Hi || dim(out, 1) != T ||
      dim(out, 2) != topk)
    return invalid(target, "out: expected int32[" + std::to_string(Hi) + ", " + std::to_string(T) + ", " +
                               std::to_string(topk) + "], got " + dtype_name(out.element_type()) + dims_str(out));
  return Error::Success();
}

// mo.kv_cache.store.ragged.paged: the result is kv_blocks' dtype and shape; k and v [T, Hkv, D] in its dtype;
// offsets[B+1], cache_lengths[B], the page table, layer_idx.
inline Error check_store_operands(const char* target, const AnyBuffer& kv, const AnyBuffer& k, const AnyBuffer& v,
                                  const AnyBuffer& offsets, const AnyBuffer& cache_lengths, const AnyBuffer& table,
                                  const AnyBuffer& layer, const AnyBuffer& out) {
  if (rank(kv) != 6 || dim(kv, 1) != 2 || dim(kv, 3) <= 0)
    return invalid(target, "kv_blocks: expected [num_blocks, 2, num_layers, page_size, n_kv_heads, head_dim] with "
                           "page_size > 0, got " + dims_str(kv));
  if (out.element_type() != kv.element_type() || dims_str(out) != dims_str(kv))
    return invalid(target, "result: expected kv_blocks' dtype and shape " + dims_str(kv));
  const int64_t Hkv = dim(kv, 4), D = dim(kv, 5);
  if (k.element_type() != kv.element_type() || v.element_type() != kv.element_type())
    return invalid(target, std::string("k, v: expected kv_blocks' dtype ") + dtype_name(kv.element_type()));
  if (rank(k) != 3 || dim(k, 1) != Hkv || dim(k, 2) != D)
    return invalid(target, "k: expected [T, " + std::to_string(Hkv) + ", " + std::to_string(D) + "], got " + dims_str(k));
  if (dims_str(v) != dims_str(k)) return invalid(target, "v: expected k's shape " + dims_str(k) + ", got " + dims_str(v));
  const int64_t B = count(cache_lengths);
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "cache_lengths", cache_lengths, B); e.failure()) return e;
  if (auto e = check_table(target, "kv_lookup_table", table, B); e.failure()) return e;
  return check_index(target, "layer_idx", layer, 1);
}

// A count a kernel holds in an int (rows, keys, topk): past 2^31 only through buffers of hundreds of GiB, or an
// attribute of a direct call.
inline Error check_int_count(const char* target, const char* what, int64_t n) {
  if (n >= (int64_t{1} << 31)) return invalid(target, std::string(what) + " must be < 2^31, got " + std::to_string(n));
  return Error::Success();
}

// mo.kv_cache.row_offsets.ragged.paged: offsets[B+1], cache_lengths[B], out int32[B+1].
inline Error check_row_offsets_operands(const char* target, const AnyBuffer& offsets, const AnyBuffer& cache_lengths,
                                        const AnyBuffer& out) {
  const int64_t B = count(cache_lengths);
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "cache_lengths", cache_lengths, B); e.failure()) return e;
  return check_index(target, "out", out, B + 1);
}

// mo.mha.decode.get_num_partitions: three int32 scalars.
inline Error check_num_partitions_operands(const char* target, const AnyBuffer& batch, const AnyBuffer& max_len,
                                           const AnyBuffer& out) {
  if (auto e = check_index(target, "batch", batch, 1); e.failure()) return e;
  if (auto e = check_index(target, "max_cache_valid_length", max_len, 1); e.failure()) return e;
  return check_index(target, "out", out, 1);
}

}  // namespace msa_ops

#endif  // MSA_OPS_CHECKS_H_
