// CUDA handlers: paged KV store (§9), cache row offsets (§10), decode partition count, library info.
// No host synchronization and no allocation: every handler only enqueues work on XLA's stream and is
// declared CUDA-graph (command buffer) compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "msa_ops/checks.h"
#include "msa_ops/common.h"
#include "msa_ops/ffi.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/paged.h"
#include "msa_ops_cuda_build_info.h"

#define MSA_OPS_STR_(x) #x
#define MSA_OPS_STR(x) MSA_OPS_STR_(x)
#ifndef MSA_OPS_CUDA_ARCHS_STRING
#define MSA_OPS_CUDA_ARCHS_STRING "unknown"
#endif

namespace msa_ops {
namespace cuda {
namespace {

using ffi::PlatformStream;

Error launch_error(const char* target, const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Error::Success();
  return Error::Internal(std::string(target) + ": " + what + ": " + cudaGetErrorString(e));
}

// One block column per sequence b; rows of b are spread over gridDim.y; threads copy words of a row.
template <typename W>
__global__ void kv_store_kernel(W* __restrict__ kv, const W* __restrict__ k, const W* __restrict__ v,
                                const int32_t* __restrict__ offsets, const int32_t* __restrict__ cache_lengths,
                                const int32_t* __restrict__ table, const int32_t* __restrict__ layer_ptr,
                                PagedKV geo, int64_t total_rows, int64_t row_words) {
  const int64_t b = blockIdx.x;
  __shared__ int64_t bounds[2];
  if (threadIdx.x == 0) {
    bounds[0] = repaired_offset(offsets, b, total_rows);
    bounds[1] = repaired_offset(offsets, b + 1, total_rows);
  }
  __syncthreads();
  geo.layer = *layer_ptr;
  const int32_t* row = table + b * geo.max_pages;
  const int32_t cl = cache_lengths[b];
  for (int64_t t = bounds[0] + blockIdx.y; t < bounds[1]; t += gridDim.y) {
    const int64_t pos = store_position(cl, t - bounds[0]);
    const int64_t page = geo.page_of(row, pos);
    if (page < 0) continue;
    const int64_t slot = pos % geo.page_size;
    // Offsets in words: a row of [Hkv, D] elements is row_words words, rows start at multiples of it.
    const int64_t ko = geo.offset(page, 0, slot, 0) / (geo.n_kv_heads * geo.head_dim) * row_words;
    const int64_t vo = geo.offset(page, 1, slot, 0) / (geo.n_kv_heads * geo.head_dim) * row_words;
    for (int64_t w = threadIdx.x; w < row_words; w += blockDim.x) {
      kv[ko + w] = k[t * row_words + w];
      kv[vo + w] = v[t * row_words + w];
    }
  }
}

__global__ void row_offsets_kernel(const int32_t* __restrict__ offsets, const int32_t* __restrict__ cache_lengths,
                                   int32_t* __restrict__ out, int64_t B) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  // No query-row count is given to this op: offsets are repaired without the upper clamp.
  int64_t run = imax(0, offsets[0]);
  uint32_t acc = 0;
  out[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t next = imax(run, static_cast<int64_t>(offsets[b + 1]));
    acc += static_cast<uint32_t>(imax(0, cache_lengths[b])) + static_cast<uint32_t>(next - run);
    out[b + 1] = static_cast<int32_t>(acc);
    run = next;
  }
}

__global__ void num_partitions_kernel(const int32_t* batch, const int32_t* max_len, int64_t n_kv_heads,
                                      int64_t sm_count, int32_t* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  // sm_count // max(1, batch * n_kv_heads) without forming the product (as the CPU handler).
  const int64_t b = *batch;
  const int64_t quot = b >= 1 && n_kv_heads >= 1 ? floor_div(floor_div(sm_count, n_kv_heads), b) : sm_count;
  const int64_t by_sm = iclamp(quot, 1, 32);
  const int64_t by_len = imax(1, floor_div(*max_len, 512));
  *out = static_cast<int32_t>(imin(by_sm, by_len));
}

Error KvCacheStore(cudaStream_t stream, AnyBuffer kv, AnyBuffer k, AnyBuffer v, AnyBuffer offsets,
                   AnyBuffer cache_lengths, AnyBuffer table, AnyBuffer layer, AnyResult out) {
  const char* target = "msa_ops_kv_cache_store";
  if (auto e = check_store_operands(target, kv, k, v, offsets, cache_lengths, table, layer, *out); e.failure()) return e;
  const int64_t Hkv = dim(kv, 4), D = dim(kv, 5);
  const int64_t T = dim(k, 0);
  const int64_t B = count(cache_lengths);
  if (auto e = check_int_count(target, "B (cache_lengths)", B); e.failure()) return e;  // the grid's x
  const size_t bytes = kv.size_bytes();
  if (out->untyped_data() != kv.untyped_data() && bytes > 0) {
    cudaMemcpyAsync(out->untyped_data(), kv.untyped_data(), bytes, cudaMemcpyDeviceToDevice, stream);
    if (auto e = launch_error(target, "copy of kv_blocks"); e.failure()) return e;
  }
  const int64_t row_bytes = Hkv * D * static_cast<int64_t>(ffi::ByteWidth(kv.element_type()));
  if (B == 0 || T == 0 || row_bytes == 0 || dim(kv, 0) == 0) return Error::Success();
  const PagedKV geo{dim(kv, 0), 2, dim(kv, 2), dim(kv, 3), Hkv, D, dim(table, 1), 0};
  const uintptr_t align = reinterpret_cast<uintptr_t>(out->untyped_data()) | reinterpret_cast<uintptr_t>(k.untyped_data()) |
                          reinterpret_cast<uintptr_t>(v.untyped_data());
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>(imin(imax(T, 1), 256)));
  const int threads = 128;
  auto launch = [&](auto word) {
    using W = decltype(word);
    kv_store_kernel<W><<<grid, threads, 0, stream>>>(
        static_cast<W*>(out->untyped_data()), static_cast<const W*>(k.untyped_data()),
        static_cast<const W*>(v.untyped_data()), static_cast<const int32_t*>(offsets.untyped_data()),
        static_cast<const int32_t*>(cache_lengths.untyped_data()), static_cast<const int32_t*>(table.untyped_data()),
        static_cast<const int32_t*>(layer.untyped_data()), geo, T, row_bytes / static_cast<int64_t>(sizeof(W)));
  };
  if (row_bytes % 16 == 0 && align % 16 == 0)
    launch(uint4{});
  else if (row_bytes % 4 == 0 && align % 4 == 0)
    launch(uint32_t{});
  else if (row_bytes % 2 == 0 && align % 2 == 0)
    launch(uint16_t{});
  else
    launch(uint8_t{});
  return launch_error(target, "kv_store_kernel");
}

Error KvCacheRowOffsets(cudaStream_t stream, AnyBuffer offsets, AnyBuffer cache_lengths, AnyResult out) {
  const char* target = "msa_ops_kv_cache_row_offsets";
  if (auto e = check_row_offsets_operands(target, offsets, cache_lengths, *out); e.failure()) return e;
  const int64_t B = count(cache_lengths);
  row_offsets_kernel<<<1, 32, 0, stream>>>(static_cast<const int32_t*>(offsets.untyped_data()),
                                           static_cast<const int32_t*>(cache_lengths.untyped_data()),
                                           static_cast<int32_t*>(out->untyped_data()), B);
  return launch_error(target, "row_offsets_kernel");
}

Error GetNumPartitions(cudaStream_t stream, AnyBuffer batch, AnyBuffer max_len, int64_t n_kv_heads, int64_t sm_count,
                       AnyResult out) {
  const char* target = "msa_ops_get_num_partitions";
  if (auto e = check_num_partitions_operands(target, batch, max_len, *out); e.failure()) return e;
  num_partitions_kernel<<<1, 32, 0, stream>>>(static_cast<const int32_t*>(batch.untyped_data()),
                                              static_cast<const int32_t*>(max_len.untyped_data()), n_kv_heads, sm_count,
                                              static_cast<int32_t*>(out->untyped_data()));
  return launch_error(target, "num_partitions_kernel");
}

}  // namespace
}  // namespace cuda
}  // namespace msa_ops

using msa_ops::AnyBuffer;
namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_kv_cache_store, msa_ops::cuda::KvCacheStore,
                              MSA_OPS_SIG_KV_CACHE_STORE(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_kv_cache_row_offsets, msa_ops::cuda::KvCacheRowOffsets,
                              MSA_OPS_SIG_KV_CACHE_ROW_OFFSETS(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_get_num_partitions, msa_ops::cuda::GetNumPartitions,
                              MSA_OPS_SIG_GET_NUM_PARTITIONS(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {
__attribute__((visibility("default"))) const char* msa_ops_library_version() { return MSA_OPS_VERSION_STRING; }
__attribute__((visibility("default"))) const char* msa_ops_library_platform() { return "cuda"; }
__attribute__((visibility("default"))) const char* msa_ops_library_archs() { return MSA_OPS_CUDA_ARCHS_STRING; }
__attribute__((visibility("default"))) const char* msa_ops_library_ffi_api_version() {
  return MSA_OPS_STR(XLA_FFI_API_MAJOR) "." MSA_OPS_STR(XLA_FFI_API_MINOR);
}
}
