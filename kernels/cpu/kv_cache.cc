// CPU handlers: paged KV store (§9), cache row offsets (§10), decode partition count, library info.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "attention_core.h"
#include "handler_util.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/paged.h"
#include "thread_pool.h"

#define MSA_OPS_STR_(x) #x
#define MSA_OPS_STR(x) MSA_OPS_STR_(x)

namespace msa_ops {
namespace cpu {
namespace {

Error KvCacheStore(AnyBuffer kv, AnyBuffer k, AnyBuffer v, AnyBuffer offsets, AnyBuffer cache_lengths, AnyBuffer table,
                   AnyBuffer layer, AnyResult out) {
  const char* target = "msa_ops_kv_cache_store";
  if (auto e = check_store_operands(target, kv, k, v, offsets, cache_lengths, table, layer, *out); e.failure()) return e;
  const int64_t Hkv = dim(kv, 4), D = dim(kv, 5), P = dim(kv, 3);
  const int64_t T = dim(k, 0);
  const int64_t B = count(cache_lengths);

  const size_t bytes = kv.size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != kv.untyped_data() && bytes > 0) std::memcpy(dst, kv.untyped_data(), bytes);

  const PagedKV geo{dim(kv, 0), 2, dim(kv, 2), P, Hkv, D, dim(table, 1), read_i32_scalar(layer)};
  std::vector<int64_t> eff(B + 1);
  repair_offsets(idx(offsets), B + 1, T, eff.data());
  const size_t esize = ffi::ByteWidth(kv.element_type());
  const size_t row_bytes = static_cast<size_t>(Hkv * D) * esize;
  const char* ks = static_cast<const char*>(k.untyped_data());
  const char* vs = static_cast<const char*>(v.untyped_data());
  const int32_t* cl = idx(cache_lengths);
  const int32_t* tab = idx(table);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = tab + b * geo.max_pages;
    for (int64_t t = eff[b]; t < eff[b + 1]; ++t) {
      const int64_t pos = store_position(cl[b], t - eff[b]);
      const int64_t page = geo.page_of(row, pos);
      if (page < 0) continue;
      const int64_t slot = pos % P;
      std::memcpy(dst + geo.offset(page, 0, slot, 0) * esize, ks + t * row_bytes, row_bytes);
      std::memcpy(dst + geo.offset(page, 1, slot, 0) * esize, vs + t * row_bytes, row_bytes);
    }
  }
  return Error::Success();
}

Error KvCacheRowOffsets(AnyBuffer offsets, AnyBuffer cache_lengths, AnyResult out) {
  const char* target = "msa_ops_kv_cache_row_offsets";
  if (auto e = check_row_offsets_operands(target, offsets, cache_lengths, *out); e.failure()) return e;
  const int64_t B = count(cache_lengths);
  // No query-row count is given to this op: offsets are repaired without the upper clamp (T = +inf).
  std::vector<int64_t> eff(B + 1);
  repair_offsets(idx(offsets), B + 1, INT64_MAX, eff.data());
  const int32_t* cl = idx(cache_lengths);
  int32_t* o = static_cast<int32_t*>(out->untyped_data());
  uint32_t acc = 0;  // int32 arithmetic wraps (defined via uint32)
  o[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    acc += static_cast<uint32_t>(std::max<int32_t>(0, cl[b])) + static_cast<uint32_t>(eff[b + 1] - eff[b]);
    o[b + 1] = static_cast<int32_t>(acc);
  }
  return Error::Success();
}

Error GetNumPartitions(AnyBuffer batch, AnyBuffer max_len, int64_t n_kv_heads, int64_t sm_count, AnyResult out) {
  const char* target = "msa_ops_get_num_partitions";
  if (auto e = check_num_partitions_operands(target, batch, max_len, *out); e.failure()) return e;
  // sm_count // max(1, batch * n_kv_heads) without forming the product (n_kv_heads is any int64): for positive
  // divisors floor(floor(s / n) / b) = floor(s / (n b)).
  const int64_t b = read_i32_scalar(batch);
  const int64_t quot = b >= 1 && n_kv_heads >= 1 ? floor_div(floor_div(sm_count, n_kv_heads), b) : sm_count;
  const int64_t by_sm = iclamp(quot, 1, 32);
  const int64_t by_len = std::max<int64_t>(1, floor_div(read_i32_scalar(max_len), 512));
  *static_cast<int32_t*>(out->untyped_data()) = static_cast<int32_t>(std::min(by_sm, by_len));
  return Error::Success();
}

}  // namespace
}  // namespace cpu
}  // namespace msa_ops

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_kv_cache_store, msa_ops::cpu::KvCacheStore,
                              MSA_OPS_SIG_KV_CACHE_STORE(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_kv_cache_row_offsets, msa_ops::cpu::KvCacheRowOffsets,
                              MSA_OPS_SIG_KV_CACHE_ROW_OFFSETS(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_get_num_partitions, msa_ops::cpu::GetNumPartitions,
                              MSA_OPS_SIG_GET_NUM_PARTITIONS(ffi::Ffi::Bind()));

extern "C" {
__attribute__((visibility("default"))) const char* msa_ops_library_version() { return MSA_OPS_VERSION_STRING; }
__attribute__((visibility("default"))) const char* msa_ops_library_platform() { return "cpu"; }
// XLA FFI C API version the library was compiled against ("major.minor").
__attribute__((visibility("default"))) const char* msa_ops_library_ffi_api_version() {
  return MSA_OPS_STR(XLA_FFI_API_MAJOR) "." MSA_OPS_STR(XLA_FFI_API_MINOR);
}
// For the CPU library: the ISA the attention tile loop runs with on this machine.
__attribute__((visibility("default"))) const char* msa_ops_library_archs() {
  static const std::string s = std::string(
#if defined(__x86_64__)
                                   "x86-64;"
#elif defined(__aarch64__)
                                   "aarch64;"
#else
                                   "cpu;"
#endif
                                   ) +
                               msa_ops::cpu::attend_isa();
  return s.c_str();
}
__attribute__((visibility("default"))) int msa_ops_library_num_threads() {
  return msa_ops::cpu::ThreadPool::instance().num_threads();
}
}
