// Flash attention over a paged or contiguous KV cache, for prefill, decode and mixed batches.
//
// One kernel template serves every dense mo.mha.* op. A CTA owns one query tile of one sequence and one kv
// head: its rows are (token, query head of the kv head's group) pairs, packed token-major, so decode packs the
// group's heads into one MMA tile. Keys stream through shared memory in BLOCK_N tiles with a cp.async pipeline;
// Q K^T and P V run on mma.sync (m16n8k16, bf16 or f16, f32 accumulation) with an online softmax in log2 units.
// Four warps split the tile either along rows (BLOCK_M = 64: prefill) or along keys (BLOCK_M = 16: decode;
// the warps' partial softmax states are merged in shared memory at the end). gridDim.z splits the key range
// into partitions (split-K, SEMANTICS.md §6); the partials are merged by attention_epilogue_kernel.
// Windowed and chunked masks shrink the key range of a tile instead of masking it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "msa_ops/common.h"
#include "msa_ops/mask.h"
#include "msa_ops/softmax.h"  // fast_exp2

namespace msa_ops {
namespace cuda {

// Host: how many times each attention kernel was launched in this process, by kind, so that a caller (the GPU
// tests) can tell which kernel served a call (msa_ops_cuda_launch_counts; msa_ops._native.launch_counts). A launch
// counts when its handler issues it: a call captured in a CUDA graph counts once, when it is recorded.
enum LaunchKind : int {
  kLaunchMma = 0,           // attention_kernel (mma.sync)
  kLaunchMmaCluster,        // attention_kernel, its split-K partitions merged in a cluster
  kLaunchSm90Cta,           // attention_sm90_kernel (warpgroup MMA, one CTA per tile)
  kLaunchSm90Ws,            // attention_ws_sm90_kernel (persistent, 128-row items)
  kLaunchSm90Pair,          // attention_ws_pair_sm90_kernel (persistent, 64-row items)
  kLaunchCombine,           // split_k_combine_kernel
  kLaunchZeroRows,          // zero_unowned_rows_kernel
  kLaunchMsaDecode,         // msa_attention_kernel
  kLaunchMsaDecodeCluster,  // msa_attention_kernel, its split-K partitions merged in a cluster
  kLaunchMsaPrefillCta,     // msa_prefill_sm90_kernel
  kLaunchMsaPrefillWs,      // msa_prefill_ws_sm90_kernel
  kLaunchSm90Ws3,           // attention_ws_sm90_kernel with three consumer warpgroups (head dim 64, 192-row items)
  kLaunchMsaDecodeLoader,   // msa_attention_kernel with its loader warp (counted as kLaunchMsaDecode too)
  kLaunchMsaDecodeShare,    // the loader-warp kernel sharing tiles in clusters (counted as both above too)
  kLaunchKinds
};
inline constexpr char kLaunchNames[] =
    "mma,mma_cluster,sm90_cta,sm90_ws,sm90_pair,combine,zero_rows,msa_decode,msa_decode_cluster,msa_prefill_cta,"
    "msa_prefill_ws,sm90_ws3,msa_decode_loader,msa_decode_share";
inline std::atomic<unsigned long long> g_launch_counts[kLaunchKinds];
inline void note_launch(LaunchKind k) { g_launch_counts[k].fetch_add(1, std::memory_order_relaxed); }

enum KvMode : int { kKvPaged = 0, kKvRagged = 1, kKvPadded = 2 };
enum QMode : int { kQRagged = 0, kQPadded = 1 };

struct AttentionArgs {
  const void* q;  // [rows, H, D]
  void* out;      // [rows, H, D]
  int q_mode;
  int total_rows;  // T (ragged) or B*S (padded)
  int seq_rows;    // S (padded)
  int batch;
  const int32_t* q_offsets;      // ragged: [B+1]
  const int32_t* valid_lengths;  // padded: [B]
  int H, Hkv, group;
  // keys
  int kv_mode;
  const int32_t* cache_lengths;  // paged: [B]
  const void* kv_blocks;         // paged: [NB, 2, L, P, Hkv, D]
  const int32_t* lookup;         // paged: [B, MP]
  const int32_t* layer_ptr;      // paged: scalar
  int num_blocks, num_layers, page_size, max_pages;
  int page_shift;  // log2(page_size) when it is a power of two, else -1
  const void* k;  // contiguous: [Tk, Hkv, D] or [B, Sk, Hkv, D]
  const void* v;
  const int32_t* kv_offsets;  // ragged contiguous: [B+1]
  int total_keys;             // Tk or Sk
  // attributes
  int mask;
  int window;
  float scale_log2;  // scale * log2(e)
  float rescale_slack_log2;  // the sm_90 kernels' lazy rescale (wg_softmax_finish): rescale_slack_log2()
  const void* sink;  // [H] or null
  int num_partitions;
  int split_block_n;
  float* ws_o;    // [NP, rows, H, D]
  float* ws_lse;  // [NP, rows, H]
  int wg_tail_skip;  // attention_ws_sm90_kernel, 64-key tiles: a warpgroup skips the MMAs of tiles past its rows' keys
                     // (mha.cu: on unless MSA_OPS_WG_TAIL_SKIP=0, read at each launch)
};

// Host: how far (log2 units) a row's max may rise above the running max before the sm_90 wgmma kernels move it and
// rescale O (wg_softmax_finish): 8 (the exponentials stay below 2^8), or MSA_OPS_LAZY_RESCALE (read at each
// launch; 0 moves it at every rise, as the other kernels do). At most 15, so that an f16 P (up to 2^15) stays
// finite; anything else (not a number, out of range) reads as 8.
inline float rescale_slack_log2() {
  const char* env = std::getenv("MSA_OPS_LAZY_RESCALE");
  if (env == nullptr || env[0] == 0) return 8.f;
  char* end = nullptr;
  const float v = std::strtof(env, &end);
  return end != env && *end == 0 && v >= 0.f && v <= 15.f ? v : 8.f;
}

// ------------------------------------------------------------------------------------------------ helpers

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

// Two packed 16-bit floats (T: bf16 or f16) with each NaN or Inf half replaced by 0. In every key tile that is not full
// (some row does not see some key, or a key is missing) the mma.sync kernel passes V through it before P V (as
// fragments; the 8-row tile in shared memory, finite_or_zero_rows), so that such a key's NaN V does not reach that
// row as 0 * NaN (SEMANTICS.md §5).
template <typename T>
__device__ __forceinline__ uint32_t finite_or_zero(uint32_t x) {
  constexpr uint32_t e = std::is_same_v<T, __half> ? 0x7c00u : 0x7f80u;  // a half's exponent bits
  const uint32_t lo = (x & e) == e ? 0x0000ffffu : 0u;
  const uint32_t hi = (x & (e << 16)) == (e << 16) ? 0xffff0000u : 0u;
  return x & ~(lo | hi);
}
template <typename T>
__device__ __forceinline__ void finite_or_zero4(uint32_t* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = finite_or_zero<T>(f[i]);
}
// finite_or_zero over one 16-byte chunk of shared memory, stored back only where it held NaN or Inf.
template <typename T>
__device__ __forceinline__ void finite_or_zero_chunk(uint4* p) {
  const uint4 v = *p;
  const uint4 w = make_uint4(finite_or_zero<T>(v.x), finite_or_zero<T>(v.y), finite_or_zero<T>(v.z),
                             finite_or_zero<T>(v.w));
  if (w.x != v.x || w.y != v.y || w.z != v.z || w.w != v.w) *p = w;
}

// An attention sink's term in a softmax denominator whose running max (log2 units) is m: 2^(sink * log2(e) - m).
template <typename T>
__device__ __forceinline__ float sink_term(const T* sink, int h, float m) {
  return exp2f(sink_log2(Mma<T>::to_float(sink[h])) - m);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The dynamic shared memory rounded up to 1024 bytes, the 128-byte swizzle's atom (the sm_90 kernels' kSmemAlloc
// holds the pad): *base the generic pointer, returned the shared-space address.
__device__ __forceinline__ uint32_t smem_align_1024(unsigned char* raw, unsigned char** base) {
  const uint32_t raw_addr = smem_addr(raw);
  const uint32_t pad = (1024u - (raw_addr & 1023u)) & 1023u;
  *base = raw + pad;
  return raw_addr + pad;
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {  // all 16 bytes exist
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// Copies of K/V that a decode kernel reads exactly once can carry an L2 policy that evicts their lines first, so
// the stream does not push out what is read again (page tables, offsets, Q). On the H200 this took split-K decode
// at B=1/128k up 2.6% and B=4/64k 0.5% (benchmarks/NOTES_mha.md v22).
// The destination is the generic address of the shared-memory bytes, converted inside the asm: from a 32-bit
// shared address that is a uniform base plus a register, ptxas (CUDA 13.0, sm_90a) may emit the hinted copy as
// `LDGSTS [Rx+UR0], desc[UR1]`, a form with which a kernel faulted on the H200 (NOTES_mha v21).
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
// 16 bytes (or, valid false, 16 zero bytes) from src to the shared-memory bytes at dst, with an L2 cache policy.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid, uint64_t policy) {
  const int n = valid ? 16 : 0;
  asm volatile(
      "{\n.reg .u64 a;\n.reg .u32 s;\ncvta.to.shared.u64 a, %0;\ncvt.u32.u64 s, a;\n"
      "cp.async.cg.shared.global.L2::cache_hint [s], [%1], 16, %2, %3;\n}\n" ::"l"(dst), "l"(src), "r"(n), "l"(policy));
}
// The same, to the shared-memory bytes OFF bytes past the generic address dst: copies that share dst share its
// conversion.
template <int OFF>
__device__ __forceinline__ void cp_async16_at(void* dst, const void* src, bool valid, uint64_t policy) {
  const int n = valid ? 16 : 0;
  asm volatile(
      "{\n.reg .u64 a;\n.reg .u32 s;\ncvta.to.shared.u64 a, %0;\ncvt.u32.u64 s, a;\n"
      "cp.async.cg.shared.global.L2::cache_hint [s+%4], [%1], 16, %2, %3;\n}\n" ::"l"(dst), "l"(src), "r"(n),
      "l"(policy), "n"(OFF));
}
// f(std::integral_constant<int, I>{}) for I = 0 .. N - 1, in order: a loop whose index is a constant in each body.
template <typename F, int... I>
__device__ __forceinline__ void unroll_constants(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void unroll_constants(F&& f) {
  unroll_constants(f, std::make_integer_sequence<int, N>{});
}
// A K/V copy: streamed (kStream, with the evict-first policy) or with the default policy.
// dst: the generic address of the destination (the streamed copy converts it in its asm), dst_s: the same as a
// shared-memory address (the other copy).
template <bool kStream>
__device__ __forceinline__ void cp_async16_kv(void* dst, uint32_t dst_s, const void* src, bool valid,
                                              uint64_t policy) {
  if constexpr (kStream) cp_async16(dst, src, valid, policy);
  else cp_async16(dst_s, src, valid);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {  // 4 bytes (through L1: .ca)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// One line of global memory into L2, without waiting: its address translation is resolved before later copies
// from the same page need it (the MSA decode loader, for blocks spread over a large pool).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The transpose of an 8x8 matrix of 16-bit elements held as an mma fragment (lane l: row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1), as the same kind of fragment.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The key row and 16-byte chunk this lane points ldmatrix .x4 at, for the 16 keys from key0 and the chunks ch0,
// ch0 + 1 of a K or V tile. K (the B operand of Q K^T) orders the four 8x8 matrices (keys 0-7, ch0), (0-7,
// ch0 + 1), (8-15, ch0), (8-15, ch0 + 1); V (the B operand of P V, read with .trans) orders them (keys 0-7,
// ch0), (8-15, ch0), (0-7, ch0 + 1), (8-15, ch0 + 1).
struct FragAddr {
  int key, ch;
};
__device__ __forceinline__ FragAddr k_frag_addr(int lane, int key0, int ch0) {
  return FragAddr{key0 + lane % 8 + (lane / 16) * 8, ch0 + (lane / 8) % 2};
}
__device__ __forceinline__ FragAddr v_frag_addr(int lane, int key0, int ch0) {
  return FragAddr{key0 + lane % 8 + ((lane / 8) % 2) * 8, ch0 + lane / 16};
}

// Shared-memory tile of ROWS x D 16-bit elements, 16-byte chunks XOR-swizzled by row so that ldmatrix reads
// of 8 rows at one column hit 8 different bank groups.
template <int D>
struct SwizzledTile {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static __device__ __forceinline__ int offset(int row, int chunk) {  // in elements
    return row * D + ((chunk ^ (row & 7)) * 8);
  }
};

// finite_or_zero over kRows rows of a swizzled tile of D 16-bit values a row in shared memory (SwizzledTile), from row
// r0, by one warp (finite_or_zero_chunk).
template <typename T, int D, int kRows>
__device__ __forceinline__ void finite_or_zero_rows(T* tile, int r0, int lane) {
  constexpr int kCh = SwizzledTile<D>::kChunks;
#pragma unroll
  for (int c = lane; c < kRows * kCh; c += 32)
    finite_or_zero_chunk<T>(reinterpret_cast<uint4*>(tile + SwizzledTile<D>::offset(r0 + c / kCh, c % kCh)));
}

// ------------------------------------------------------------------------------------------------ sequences

struct SeqTile {
  int b;          // sequence; -1 past the last tile (ragged queries: then row0 = tiles, pos0 = end of owned rows)
  int row0;       // first packed row of this tile within the sequence (packed row = token * group + g)
  int n_q;        // query tokens of the sequence
  int q_base;     // query row index (into q's leading dims flattened) of token 0
  int64_t pos0;   // position of token 0
  int64_t n_keys; // keys of the sequence (existing ones are < kmax)
  int64_t kmax;   // upper bound of existing keys
  int kv_base;    // contiguous modes: first key row of the sequence
};

// max(offsets[0..last]) computed by the calling warp (every lane gets it); strided loads in parallel.
__device__ __forceinline__ int64_t warp_max_prefix(const int32_t* offsets, int last) {
  const int lane = threadIdx.x & 31;
  int64_t m = INT64_MIN;
  for (int i = lane; i <= last; i += 32) m = imax(m, static_cast<int64_t>(offsets[i]));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = imax(m, __shfl_xor_sync(0xffffffff, m, d));
  return m;
}

// Ragged queries: the rows the sequences own, [eff[0], eff[B]) of the repaired offsets (running max, clamped to
// [0, T]); the others output 0.
struct OwnedRows {
  int64_t lo, hi;  // lo <= hi
};
__device__ __forceinline__ int64_t first_owned_row(const AttentionArgs& a) {  // eff[0]
  return imin(imax(0, a.q_offsets[0]), a.total_rows);
}
// Called by a whole warp (warp_max_prefix).
__device__ __forceinline__ OwnedRows owned_rows(const AttentionArgs& a) {
  const int64_t lo = first_owned_row(a);
  return OwnedRows{lo, imin(imax(lo, warp_max_prefix(a.q_offsets, a.batch)), a.total_rows)};
}
// A page-table entry as a page of the pool, or -1 when it names none (negative, or past the pool).
__device__ __forceinline__ int pool_page(const AttentionArgs& a, int32_t entry) {
  return (entry >= 0 && entry < a.num_blocks) ? entry : -1;
}
// Key `key`'s slot within its page (a mask when the page size is a power of two).
__device__ __forceinline__ int page_slot(const AttentionArgs& a, int key) {
  return a.page_shift >= 0 ? (key & (a.page_size - 1)) : key % a.page_size;
}

// The raw offsets[b + 1] of sequence b for the repaired-offsets scan (INT64_MIN past the last sequence).
__device__ __forceinline__ int64_t seq_end_raw(const AttentionArgs& a, int b) {
  return b < a.batch ? static_cast<int64_t>(a.q_offsets[b + 1]) : INT64_MIN;
}

// One step of the repaired-offsets scan over sequences base + lane (a whole warp; raw = seq_end_raw of the lane's
// sequence b): eff[b] and eff[b + 1] of the lane's sequence, where eff is the running max of the offsets clamped
// to [0, T] and carry = eff[base]; returns the sequence's rows (0 past the last sequence).
__device__ __forceinline__ int seq_rows_step(const AttentionArgs& a, int base, int64_t raw, int64_t carry,
                                             int64_t* eff_prev, int64_t* eff_next) {
  const int lane = threadIdx.x & 31;
  const int b = base + lane;
  int64_t v = raw;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffff, v, d);
    if (lane >= d) v = imax(v, u);
  }
  *eff_next = imin(imax(carry, v), a.total_rows);
  *eff_prev = __shfl_up_sync(0xffffffff, *eff_next, 1);
  if (lane == 0) *eff_prev = carry;
  return b < a.batch ? static_cast<int>(*eff_next - *eff_prev) : 0;
}

// The key side of a found tile (st->b >= 0): its sequence's cache / key offsets, keys and bound. Called by whole
// warps (ragged keys: warp_max_prefix).
__device__ __forceinline__ void locate_keys(const AttentionArgs& a, SeqTile* stp) {
  SeqTile& st = *stp;
  const int b = st.b;
  if (a.kv_mode == kKvPaged) {
    const int64_t s_max = static_cast<int64_t>(a.max_pages) * a.page_size;
    const int64_t c = iclamp(a.cache_lengths[b], 0, s_max);
    st.pos0 = c;
    st.n_keys = c + st.n_q;
    st.kmax = imin(st.n_keys, s_max);
    st.kv_base = 0;
  } else if (a.kv_mode == kKvRagged) {
    const int64_t run = imin(imax(0, warp_max_prefix(a.kv_offsets, b)), a.total_keys);  // eff_k[b]
    const int64_t next = imin(imax(run, static_cast<int64_t>(a.kv_offsets[b + 1])), a.total_keys);
    st.kv_base = static_cast<int>(run);
    st.n_keys = next - run;
    st.kmax = st.n_keys;
    st.pos0 = st.n_keys - st.n_q;
  } else {
    const int64_t nk = iclamp(a.valid_lengths[b], 0, a.total_keys);
    st.kv_base = b * a.total_keys;
    st.n_keys = nk;
    st.kmax = nk;
    st.pos0 = nk - st.n_q;
  }
}

// seq_rows_step (same arguments) in locate_tile's numbering: *n the lane's rows, *tiles its tiles of BLOCK_M
// packed rows; returns the tiles of lanes 0..lane (inclusive sum).
template <int BLOCK_M>
__device__ __forceinline__ int seq_tiles_step(const AttentionArgs& a, int base, int64_t raw, int64_t carry,
                                              int64_t* eff_prev, int64_t* eff_next, int* n, int* tiles) {
  const int lane = threadIdx.x & 31;
  *n = seq_rows_step(a, base, raw, carry, eff_prev, eff_next);
  *tiles = (*n * a.group + BLOCK_M - 1) / BLOCK_M;
  int cs = *tiles;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffff, cs, d);
    if (lane >= d) cs += u;
  }
  return cs;
}

// One step of locate_tile's scan, over sequences base + lane (a whole warp; raw = seq_end_raw of the lane's
// sequence; *carry = eff[base], *first = the tiles before sequence `base`): true when `tile` is one of theirs (then
// st's b, n_q, q_base and row0 say where), else *carry and *first move past them.
template <int BLOCK_M>
__device__ __forceinline__ bool locate_step(const AttentionArgs& a, int base, int64_t raw, int tile, int64_t* carry,
                                            int* first, SeqTile* st) {
  const int b = base + (threadIdx.x & 31);
  int64_t eff_prev, eff_next;  // eff[b], eff[b + 1]
  int n, tiles;
  const int cs = seq_tiles_step<BLOCK_M>(a, base, raw, *carry, &eff_prev, &eff_next, &n, &tiles);
  const unsigned hit = __ballot_sync(0xffffffff, b < a.batch && tile < *first + cs);
  if (hit) {
    const int src = __ffs(hit) - 1;
    const int excl = __shfl_sync(0xffffffff, cs - tiles, src);
    st->b = base + src;
    st->n_q = __shfl_sync(0xffffffff, n, src);
    st->q_base = static_cast<int>(__shfl_sync(0xffffffff, eff_prev, src));
    st->row0 = (tile - *first - excl) * BLOCK_M;
    return true;
  }
  *first += __shfl_sync(0xffffffff, cs, 31);
  *carry = __shfl_sync(0xffffffff, eff_next, 31);
  return false;
}

// locate_tile's scan of the ragged offsets from sequence base0 (a multiple of 32; *carry = eff[base0], *first =
// the tiles before it): repaired offsets (running max, clamped to [0, T]), tiles numbered sequence by sequence.
// Each warp scans 32 sequences a step (locate_step) and loads the offsets of kLocateAhead steps at once, so it
// finds the sequence after (B - base0) / (32 kLocateAhead) dependent loads. Returns false past the last tile (st->b
// stays -1), with st->row0 the number of tiles and st->pos0 the end of the owned rows.
template <int BLOCK_M>
__device__ __forceinline__ bool scan_tiles(const AttentionArgs& a, int tile, int base0, int64_t* carry, int* first,
                                           SeqTile* st) {
  constexpr int kLocateAhead = 4;
  bool found = false;
  for (; base0 < a.batch && !found; base0 += 32 * kLocateAhead) {
    int64_t raw[kLocateAhead];
#pragma unroll
    for (int i = 0; i < kLocateAhead; ++i) raw[i] = seq_end_raw(a, base0 + 32 * i + (threadIdx.x & 31));
#pragma unroll
    for (int i = 0; i < kLocateAhead; ++i) {
      if (base0 + 32 * i >= a.batch) break;
      if (locate_step<BLOCK_M>(a, base0 + 32 * i, raw[i], tile, carry, first, st)) {
        found = true;
        break;
      }
    }
  }
  if (!found) {
    st->row0 = *first;
    st->pos0 = *carry;
  }
  return found;
}

// Finds the sequence and tile of grid x-index `tile` (-1 in .b when past the last tile). Called by whole warps.
template <int BLOCK_M>
__device__ __forceinline__ SeqTile locate_tile(const AttentionArgs& a, int tile) {
  SeqTile st;
  st.b = -1;
  const int group = a.group;
  if (a.q_mode == kQPadded) {
    const int per_seq = (a.seq_rows * group + BLOCK_M - 1) / BLOCK_M;
    const int b = tile / per_seq;
    if (b >= a.batch) return st;
    const int n_q = static_cast<int>(iclamp(a.valid_lengths[b], 0, a.seq_rows));
    st.row0 = (tile % per_seq) * BLOCK_M;
    if (st.row0 >= n_q * group) return st;
    st.b = b;
    st.n_q = n_q;
    st.q_base = b * a.seq_rows;
  } else {
    int64_t carry = first_owned_row(a);  // eff[0]
    int first = 0;
    if (!scan_tiles<BLOCK_M>(a, tile, 0, &carry, &first, &st)) return st;  // past the last tile
  }
  locate_keys(a, &st);
  return st;
}

// The keys one query tile visits: the union of its rows' intervals (each bound is monotone in the position, so
// the first and last rows give it), cut to the split-K partition `part`, in key tiles of BN.
struct TileKeys {
  int rows_seq;                    // packed rows of the sequence (tokens x group)
  KeyInterval iv_first, iv_last;   // key intervals of the tile's first and last rows
  int64_t k_lo, k_hi;              // keys [k_lo, k_hi) of this tile and partition
  int tile_first, num_tiles;       // BN-key tiles covering them
};

template <int BLOCK_M, int BN>
__device__ __forceinline__ TileKeys tile_keys(const AttentionArgs& a, const SeqTile& st, int part) {
  TileKeys tk;
  const int group = a.group;
  tk.rows_seq = st.n_q * group;
  const int row_end = min(st.row0 + BLOCK_M, tk.rows_seq);
  const int64_t p_first = st.pos0 + st.row0 / group;
  const int64_t p_last = st.pos0 + (row_end - 1) / group;
  tk.iv_first = visible_keys(a.mask, a.window, p_first, st.kmax);
  tk.iv_last = visible_keys(a.mask, a.window, p_last, st.kmax);
  int64_t k_lo = tk.iv_first.lo, k_hi = tk.iv_last.hi;
  if (a.num_partitions > 1) {  // split-K partition of the sequence's keys
    const int64_t n = st.n_keys;
    const int64_t per = n > 0 ? ceil_div(n, a.num_partitions) : 0;
    const int64_t s = imax(a.split_block_n, align_up(per, a.split_block_n));
    k_lo = imax(k_lo, imin(n, part * s));
    k_hi = imin(k_hi, imin(n, (part + 1) * s));
  }
  tk.k_lo = k_lo;
  tk.k_hi = k_hi;
  tk.tile_first = k_hi > k_lo ? static_cast<int>(k_lo / BN) : 0;
  const int tile_last = k_hi > k_lo ? static_cast<int>((k_hi + BN - 1) / BN) : 0;  // exclusive
  tk.num_tiles = tile_last - tk.tile_first;
  return tk;
}

// The keys packed row pr of a tile sees within its partition's [k_lo, k_hi) (TileKeys): [lo, hi), empty for a
// row past the sequence (pr >= rows_seq). The tile's unmasked range, the keys every row of it sees there, is
// [max(iv_last.lo, k_lo), min(iv_first.hi, k_hi)) (full_keys).
struct RowKeys {
  int lo, hi;
};
__device__ __forceinline__ RowKeys row_keys(const AttentionArgs& a, const SeqTile& st, int group, int rows_seq,
                                            int64_t k_lo, int64_t k_hi, int pr) {
  if (pr >= rows_seq) return RowKeys{0, 0};
  const KeyInterval iv = visible_keys(a.mask, a.window, st.pos0 + pr / group, st.kmax);
  return RowKeys{static_cast<int>(imax(iv.lo, k_lo)), static_cast<int>(imin(iv.hi, k_hi))};
}
__device__ __forceinline__ RowKeys full_keys(const TileKeys& tk) {
  return RowKeys{static_cast<int>(imax(tk.iv_last.lo, tk.k_lo)), static_cast<int>(imin(tk.iv_first.hi, tk.k_hi))};
}

// Epilogue of one query row (token qrow, head h) a tile finished, from the thread's share of it: columns
// j*8 + 2*(lane%4) + {0, 1} hold o[4j], o[4j+1] (the mma/wgmma accumulator layout, rows i*8 apart interleaved).
// One partition: the output row, normalized by l (plus the sink). Split-K: the partition's normalized partial
// and its log2-sum-exp.
template <typename T, int D>
__device__ __forceinline__ void store_row(const AttentionArgs& a, int64_t qrow, int h, int part, float l, float m,
                                          const float* o, int lane) {
  using M = Mma<T>;
  constexpr int ND = D / 8;
  const bool any = l > 0.f;
  if (a.num_partitions <= 1) {
    T* out = static_cast<T*>(a.out);
    const T* sink = static_cast<const T*>(a.sink);
    float den = l;
    if (sink != nullptr && any) den += sink_term(sink, h, m);
    const float inv = any ? 1.f / den : 0.f;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int col = j * 8 + (lane % 4) * 2;
      const uint32_t packed = M::pack(o[j * 4] * inv, o[j * 4 + 1] * inv);
      *reinterpret_cast<uint32_t*>(out + (qrow * a.H + h) * D + col) = packed;
    }
  } else {
    const float inv = any ? 1.f / l : 0.f;
    const int64_t ws_row = (static_cast<int64_t>(part) * a.total_rows + qrow) * a.H + h;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int col = j * 8 + (lane % 4) * 2;
      *reinterpret_cast<float2*>(a.ws_o + ws_row * D + col) = make_float2(o[j * 4] * inv, o[j * 4 + 1] * inv);
    }
    if (lane % 4 == 0) a.ws_lse[ws_row] = any ? m + log2f(l) : -INFINITY;
  }
}

// Transposed tiles: each of a thread's two row sums added over the 8 lane groups (lanes of equal lane % 4).
__device__ __forceinline__ void sum_over_lane_groups(float* l) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) l[i] += __shfl_xor_sync(0xffffffff, l[i], d);
}

// One step of the online softmax once m_new holds the maxima of the thread's two rows over its own keys: the
// maxima over the lanes that share the rows, the correction of l_run and of the accumulator o (NJ MMA tiles), and
// m_run moved on. 16-row tiles: the rows are g and g + 8, shared by the 4 lanes of a quad; elements 0, 1 of an
// accumulator tile belong to row g. Transposed tiles (kT): the rows are 2t and 2t + 1, shared by the 8 lane
// groups; elements 0, 2 belong to row 2t. kFastExp: ex2.approx.ftz (dense kernel) or exp2f (MSA kernel).
template <int NJ, bool kT, bool kFastExp>
__device__ __forceinline__ void rescale_rows(float (&m_new)[2], float (&m_run)[2], float (&l_run)[2],
                                             float (&o)[NJ][4]) {
  float corr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int d = kT ? 4 : 1; d < (kT ? 32 : 4); d <<= 1)
      m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], d));
    const float x = m_run[i] - m_new[i];
    corr[i] = m_new[i] == -INFINITY ? 1.f : (kFastExp ? fast_exp2(x) : exp2f(x));
    m_run[i] = m_new[i];
    l_run[i] *= corr[i];
  }
  // The accumulator is rescaled only when some row of the warp raised its running max (rare after the first
  // tiles): a warp-uniform branch saves the multiplies otherwise.
  if (__any_sync(0xffffffff, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] *= corr[kT ? e % 2 : e / 2];
  }
}

// Transposed tiles, after the key loop: each warp's unnormalized O^T and (m, l) of the tile's 8 rows into shared
// memory, mo [warps][8][MS] and ml [warps][8][2]; dim_of(j, e) is the output column of element e of O^T tile j,
// which belongs to row 2t + e % 2.
template <int NJ, int MS, typename DimOf>
__device__ __forceinline__ void stash_rows_t(float* mo, float* ml, int warp, int lane, const float (&o)[NJ][4],
                                             const float (&m_run)[2], const float (&l_run)[2], DimOf dim_of) {
  const int t2 = (lane % 4) * 2;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mo[(warp * 8 + t2 + e % 2) * MS + dim_of(j, e)] = o[j][e];
  if (lane < 4) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ml[(warp * 8 + t2 + i) * 2 + 0] = m_run[i];
      ml[(warp * 8 + t2 + i) * 2 + 1] = l_run[i];
    }
  }
}

// Row r's N columns from d0 of the W warps' states in mo (stash_rows_t), weighted by f (merge_weights).
template <int W, int N, int MS>
__device__ __forceinline__ void sum_warp_rows(const float* mo, int r, int d0, const float* f, float (&acc)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    acc[j] = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) acc[j] += f[w] * mo[(w * 8 + r) * MS + d0 + j];
  }
}

// Merge weights of one row's partial states from the key-split warps of a CTA: ml is [W][rows][2] (m, l per warp
// and row). Returns the merged m and l, and f[w] = 2^(m_w - m) (0 for a warp that saw no key of the row).
template <int W>
__device__ __forceinline__ void merge_weights(const float* ml, int rows, int r, float* mt, float* lt, float* f) {
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < W; ++w) m = fmaxf(m, ml[(w * rows + r) * 2]);
  float l = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const float mw = ml[(w * rows + r) * 2];
    f[w] = mw == -INFINITY ? 0.f : exp2f(mw - m);
    l += f[w] * ml[(w * rows + r) * 2 + 1];
  }
  *mt = m;
  *lt = l;
}

// ------------------------------------------------------------------------------------------------ kernel

// ---- split-K partitions merged inside a thread-block cluster (sm_90+)
// When the partitions of one (query tile, kv head) are launched as one cluster along z (cluster rank = partition,
// 2..8 of them), they merge through distributed shared memory at the end of the kernel instead of through the
// workspace and a second kernel. Transposed (8-row) epilogues: thread (r, c) of 16 per row holds row r's partial
// for dims c * DPT onwards: m (log2 units), l and the unnormalized sum acc. Every thread of every CTA of the
// cluster calls this (it holds two cluster barriers). `xchg` is kClusterXchgFloats(DPT) floats of the CTA's
// shared memory, 16-byte aligned, that nothing else uses now. Chunk c of row r is finished by the CTA of rank
// c % partitions: it returns true with the normalized output in res (zeros when no partition saw a key),
// sink_log2 (the sink logit in log2 units, or -inf) counted once in the denominator.
// A cluster barrier, whole or in its two halves (all threads of a warp together); no-ops before sm_90.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_barrier() {
  cluster_arrive();
  cluster_wait();
}
__device__ __forceinline__ uint32_t cluster_rank_and_size(uint32_t* size) {
  uint32_t rank = 0, n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
#endif
  *size = n;
  return rank;
}
// The shared::cluster address of the shared memory of cluster CTA `rank` at the address `addr` has in this CTA's.
__device__ __forceinline__ uint32_t cluster_addr(uint32_t addr, uint32_t rank) {
  uint32_t remote = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
#endif
  return remote;
}
// 16 bytes at the shared::cluster address `raddr` (cluster_addr); zeros before sm_90.
__device__ __forceinline__ uint4 ld_cluster_u4(uint32_t raddr) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(raddr)
               : "memory");
#endif
  return v;
}
// A float4 / float2 of the shared memory of cluster CTA `rank`, at the address `addr` has in this CTA's.
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  const uint4 v = ld_cluster_u4(cluster_addr(addr, rank));
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}
__device__ __forceinline__ float2 ld_cluster_f2(uint32_t addr, uint32_t rank) {
  float2 v = make_float2(0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t remote = cluster_addr(addr, rank);
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
#endif
  return v;
}
constexpr int kMaxClusterPartitions = 8;
// 8 rows, each of 16 chunks, then (m, l) and padding.
__host__ __device__ constexpr int kClusterXchgFloats(int dpt) { return 8 * (dpt * 16 + 4); }

template <int DPT>
__device__ __forceinline__ bool cluster_merge(float* xchg, int r, int c, float m, float l, const float* acc,
                                              float sink_log2, float* res) {
  static_assert(DPT % 4 == 0, "float4 chunks");
  float* row = xchg + r * (DPT * 16 + 4);  // the row's 16 chunks, then (m, l), padded to 16 bytes
#pragma unroll
  for (int j = 0; j < DPT / 4; ++j)
    reinterpret_cast<float4*>(row + c * DPT)[j] =
        make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  if (c == 0) *reinterpret_cast<float2*>(row + DPT * 16) = make_float2(m, l);
  cluster_barrier();  // every partition's partial written and visible across the cluster
  uint32_t np = 1;
  const uint32_t rank = cluster_rank_and_size(&np);
  const bool mine = static_cast<uint32_t>(c) % np == rank;
  if (mine) {
    float mq[kMaxClusterPartitions], lq[kMaxClusterPartitions];
    float mx = -INFINITY;
#pragma unroll
    for (int q = 0; q < kMaxClusterPartitions; ++q) {
      const float2 v =
          q < static_cast<int>(np) ? ld_cluster_f2(smem_addr(row + DPT * 16), q) : make_float2(-INFINITY, 0.f);
      mq[q] = v.x;
      lq[q] = v.y;
      mx = fmaxf(mx, v.y > 0.f ? v.x : -INFINITY);
    }
    float den = 0.f;
#pragma unroll
    for (int j = 0; j < DPT; ++j) res[j] = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int q = 0; q < kMaxClusterPartitions; ++q) {
        if (q >= static_cast<int>(np) || !(lq[q] > 0.f)) continue;
        const float w = exp2f(mq[q] - mx);
        den += w * lq[q];
#pragma unroll
        for (int j = 0; j < DPT / 4; ++j) {
          const float4 v = ld_cluster_f4(smem_addr(row + c * DPT + 4 * j), q);
          res[4 * j] += w * v.x;
          res[4 * j + 1] += w * v.y;
          res[4 * j + 2] += w * v.z;
          res[4 * j + 3] += w * v.w;
        }
      }
      if (sink_log2 != -INFINITY) den += exp2f(sink_log2 - mx);
      const float inv = 1.f / den;
#pragma unroll
      for (int j = 0; j < DPT; ++j) res[j] *= inv;
    }
  }
  cluster_barrier();  // no CTA leaves (and frees its shared memory) while another may still read it
  return mine;
}

// Host: the launch attribute for clusters of cx x cy x cz CTAs (cluster_z_attr: cz along z), and a launch
// configuration carrying it (`attr` must outlive the configuration).
inline cudaLaunchAttribute cluster_attr(int cx, int cy, int cz) {
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = static_cast<unsigned>(cx);
  at.val.clusterDim.y = static_cast<unsigned>(cy);
  at.val.clusterDim.z = static_cast<unsigned>(cz);
  return at;
}
inline cudaLaunchAttribute cluster_z_attr(int cz) { return cluster_attr(1, 1, cz); }
inline cudaLaunchConfig_t cluster_launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                                cudaLaunchAttribute* attr, int num_attrs = 1) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = num_attrs;
  return cfg;
}

// mbarriers in shared memory (compute capability 8.0+): set-up (count arrivals a phase), one arrival, and the
// wait for the phase of the given parity to complete (polled with the test form before 9.0).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival on the mbarrier once every cp.async the thread has issued so far has landed (.noinc: it counts among
// the arrivals mbar_init set), the copies' data then visible to the threads that wait for the phase.
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
#endif
}

// Programmatic dependent launch (compute capability 9.0+). A kernel launched with pdl_attr() may start while the
// kernel before it in the stream is still running, once every CTA of that one has called pdl_trigger() (or
// exited); it must call pdl_wait(), which returns when that kernel has completed and its writes are visible,
// before it reads any input. What this hides is the launch: the CTAs are resident and waiting when the previous
// kernel ends. Both are no-ops for a kernel launched without the attribute, or whose predecessor never triggers.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Host: whether the current device has compute capability 9.0+ and `kernel`'s code was compiled for 9.0+ (so its
// sm_90 instructions, griddepcontrol or the cluster ones, are there). Kept per (device, kernel).
inline bool runs_sm90_code(const void* kernel) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, kernel);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int major = 0;
  cudaFuncAttributes fa{};
  bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 &&
            cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90 && fa.binaryVersion >= 90;
  if (!ok) cudaGetLastError();  // a failed query leaves no sticky error behind
  known[key] = ok;
  return ok;
}
// Host: whether a launch of `kernel` asks for it: MSA_OPS_PDL is not 0 / off / false / no (read once), the current
// device has compute capability 9.0+, and the kernel's code was compiled for 9.0+ (a build for older targets that
// the driver compiles for this GPU lacks the griddepcontrol instructions: launched so, it would not wait). Kept
// per (device, kernel).
inline bool pdl_enabled(const void* kernel) {
  static const bool allowed = [] {
    const char* env = std::getenv("MSA_OPS_PDL");
    if (env == nullptr) return true;
    for (const char* off : {"0", "off", "false", "no"})
      if (std::strcmp(env, off) == 0) return false;
    return true;
  }();
  return allowed && runs_sm90_code(kernel);
}
inline cudaLaunchAttribute pdl_attr() {
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at.val.programmaticStreamSerializationAllowed = 1;
  return at;
}
// Host: kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch where pdl_enabled().
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  if (!pdl_enabled(reinterpret_cast<const void*>(kernel))) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1] = {pdl_attr()};
  const cudaLaunchConfig_t cfg = cluster_launch_config(grid, block, smem, stream, attr);
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Host: whether the split-K partitions of `kernel` (128 threads, `smem` bytes of dynamic shared memory) run as
// clusters of `np` along z that merge in the kernel: np within kClusterMergeMaxPartitions, a cluster of them fits
// the GPU (compute capability 9.0+), and MSA_OPS_CLUSTER_MERGE is not 0. The answer is kept per np for all the
// kernels of one signature (the first one asked answers for the others): every kernel that takes this path is a
// 128-thread CTA that fits an SM alone (~105 KB of shared memory; ~200 KB at head dim 256), for which a cluster of two
// fits wherever clusters exist.
// The merge itself handles up to kMaxClusterPartitions (and passes the GPU tests at 2..8 on an H200), but the
// launch uses it for two partitions only: at eight, B=4 / 64k dense decode ran at half speed on an H200 (one
// cluster of 8 holds 8 of a GPC's CTA slots at once; the grid no longer fits one wave), benchmarks/NOTES_mha.md.
constexpr int kClusterMergeMaxPartitions = 2;
template <typename... KArgs>
bool cluster_merge_ok(void (*kernel)(KArgs...), int np, size_t smem) {
  if (np < 2 || np > kClusterMergeMaxPartitions) return false;
  const char* env = std::getenv("MSA_OPS_CLUSTER_MERGE");
  if (env != nullptr && env[0] == '0') return false;
  static int known[kMaxClusterPartitions + 1] = {};  // 0 not asked, 1 yes, 2 no
  if (known[np] == 0) {
    int dev = 0, major = 0, clusters = 0;
    bool ok = cudaGetDevice(&dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
    if (ok) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      cudaLaunchAttribute attr[1] = {cluster_z_attr(np)};
      const cudaLaunchConfig_t cfg = cluster_launch_config(dim3(1, 1, np), dim3(128), smem, nullptr, attr);
      ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
      cudaGetLastError();  // a refusal leaves no sticky error behind
    }
    known[np] = ok ? 1 : 2;
  }
  return known[np] == 1;
}

// Host: where cluster_merge_ok(kernel, np, smem) says so, launches kernel<<<grid, 128, smem, stream>>>(args...)
// with its split-K partitions (grid z = np) as clusters of np, and returns true (the launch's error is left for
// cudaGetLastError, as after any launch); else launches nothing and returns false. waits: the kernel calls
// pdl_wait() before it reads anything, so it may take programmatic dependent launch (where pdl_enabled()).
template <typename... KArgs, typename... Args>
bool launch_cluster_merge(void (*kernel)(KArgs...), int np, dim3 grid, size_t smem, cudaStream_t stream, bool waits,
                          Args&&... args) {
  if (!cluster_merge_ok(kernel, np, smem)) return false;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const bool pdl = waits && pdl_enabled(reinterpret_cast<const void*>(kernel));
  cudaLaunchAttribute attr[2] = {cluster_z_attr(np), pdl_attr()};
  const cudaLaunchConfig_t cfg = cluster_launch_config(grid, dim3(128), smem, stream, attr, pdl ? 2 : 1);
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return true;
}

// Rows owned by no sequence (ragged queries: [0, lo) and [hi, T), lo = offsets[0] and hi = the end of the
// repaired offsets, both clamped) output 0. Unsplit or merged in a cluster, the attention kernel's spare CTAs
// (x tiles past the last tile) write them, so no second launch is needed: the launch adds at least one x tile to
// a bound on the tiles the sequences use (mha.cu, ragged_tiles). Spare x tile `spare` of `n_spare` zeroes the kv
// head's group of heads of every n_spare-th unowned row.
template <typename T, int D>
__device__ __forceinline__ void zero_unowned_ragged(const AttentionArgs& a, int spare, int n_spare, int hkv,
                                                     int64_t hi) {
  const int64_t T_ = a.total_rows;
  const int64_t lo = imin(imax(0, a.q_offsets[0]), T_);
  const int64_t unowned = lo + (T_ - imax(hi, lo));
  const int elems = a.group * D;  // one kv head's group of heads in a row: contiguous, 16-byte aligned
  for (int64_t j = spare; j < unowned; j += n_spare) {
    const int64_t t = j < lo ? j : imax(hi, lo) + (j - lo);
    T* dst = static_cast<T*>(a.out) + (t * a.H + static_cast<int64_t>(hkv) * a.group) * D;
    for (int e = threadIdx.x * 8; e < elems; e += blockDim.x * 8)
      *reinterpret_cast<uint4*>(dst + e) = make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int D, int BLOCK_M, int STAGES>
struct AttentionConfig {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = 4;
  // Head dim 256: the 64-row tile takes 32-key tiles, so that two CTAs fit an SM (96 KB of shared memory).
  static constexpr int kBlockN = D > 128 && BLOCK_M >= 64 ? 32 : 64;
  // 8-row tiles (decode of at most 8 rows) run transposed: keys on the MMA's M side (attention_kernel).
  static constexpr bool kTransposed = BLOCK_M == 8;
  static constexpr int kWarpsM = kTransposed ? 1 : BLOCK_M / 16 < kWarps ? BLOCK_M / 16 : kWarps;  // along rows
  static constexpr int kWarpsN = kWarps / kWarpsM;                                // warps along keys
  static constexpr int kMBlocks = kTransposed ? 1 : BLOCK_M / (16 * kWarpsM);  // 16-row MMA blocks per warp
  static constexpr bool kQInRegs = kMBlocks == 1 && D <= 128;           // else Q fragments are re-read from smem
  static constexpr int kWarpKeys = kBlockN / kWarpsN;
  // Keys a warp scores at a time: two row blocks hold half as many scores in registers.
  static constexpr int kChunkKeys = kMBlocks > 1 || (D > 128 && kWarpKeys > 32) ? 32 : kWarpKeys;
  static constexpr int kKvTileElems = kBlockN * D;
  static constexpr int kSmemQ = BLOCK_M * D * 2;
  static constexpr int kSmemKv = STAGES * 2 * kKvTileElems * 2;
  static constexpr int kChunksPerRow = D / 8;
  static constexpr int kRowStep = kThreads / kChunksPerRow;  // key rows one pass of the CTA loads
  static constexpr int kPasses = kBlockN / kRowStep;
  static constexpr int kSmemValid = STAGES * (kBlockN + kRowStep) * 4;
  static constexpr int kMergeRows = kTransposed ? 8 : 16;   // rows of a warp's partial state in the merge
  static constexpr int kMergeStride = kTransposed ? D + 4 : D;  // floats per row (padded: conflict-free stores)
  static constexpr int kSmemMerge = kWarpsN > 1 ? kWarps * kMergeRows * (kMergeStride + 2) * 4 : 0;
  static constexpr int kSmemBytes =
      kSmemQ + (kSmemKv + kSmemValid > kSmemMerge ? kSmemKv + kSmemValid : kSmemMerge);
  static_assert(kWarpsM * kWarpsN == kWarps, "warp layout");
  static_assert(kWarpsN == 1 || kMBlocks == 1, "key-split warps hold one row block");
  static_assert(kWarpKeys % 16 == 0, "each warp handles whole 16-key MMA steps");
};

// Tiles of this height (decode) put the kv heads of a query tile next to each other in the grid (attention_kernel).
constexpr int kHeadsFastestRows = 16;  // and lower

// kCluster (8-row tiles only): the launch groups each tile's split-K partitions into one cluster along z, and
// they merge here (cluster_merge) instead of in split_k_combine_kernel.
// kPages: the K/V layouts the launch guarantees, each with its own loader (below), so that a kernel carries only
// the code of the calls it serves. kPagesAny: contiguous K/V or pages of any size. kPagesSmall (8-row tiles
// only): paged K/V with power-of-two pages smaller than a key tile and of at least kPasses keys. kPagesWhole (8-row
// tiles only): paged K/V with power-of-two pages of a key tile or more, so that each tile lies in one page.
enum PagesKind : int { kPagesAny = 0, kPagesSmall = 1, kPagesWhole = 2 };
template <typename T, int D, int BLOCK_M, int STAGES, bool kCluster = false, int kPages = kPagesAny>
__global__ void __launch_bounds__(128) attention_kernel(const AttentionArgs a) {
  using Cfg = AttentionConfig<T, D, BLOCK_M, STAGES>;
  using M = Mma<T>;
  constexpr int BN = Cfg::kBlockN;
  constexpr int NB_WARP = Cfg::kChunkKeys / 8;  // 8-key MMA column blocks per warp and key chunk
  constexpr int ND = D / 8;                    // 8-wide output column blocks
  constexpr int KD = D / 16;                   // 16-deep k steps over D
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = reinterpret_cast<T*>(smem_raw + Cfg::kSmemQ);
  int* sValid = reinterpret_cast<int*>(smem_raw + Cfg::kSmemQ + Cfg::kSmemKv);

  // Grid: x = query tile, y = kv head; 16-row (decode) tiles: x = query tile * Hkv + kv head, so the CTAs that run
  // together are the kv heads of a few sequences and read neighbouring bytes of the same key rows.
  constexpr bool kHeadsFastest = BLOCK_M <= kHeadsFastestRows;
  const int x_tile = kHeadsFastest ? static_cast<int>(blockIdx.x) / a.Hkv : static_cast<int>(blockIdx.x);
  const SeqTile st = locate_tile<BLOCK_M>(a, x_tile);
  const int hkv = kHeadsFastest ? static_cast<int>(blockIdx.x) - x_tile * a.Hkv : static_cast<int>(blockIdx.y);
  if (st.b < 0) {
    // Ragged, partitions merged here (one, or a cluster): the spare CTAs zero the unowned rows.
    if (a.q_mode != kQPadded && (kCluster || a.num_partitions <= 1)) {
      const int n_x = kHeadsFastest ? static_cast<int>(gridDim.x) / a.Hkv : static_cast<int>(gridDim.x);
      const int nz = kCluster ? static_cast<int>(gridDim.z) : 1;
      const int z = kCluster ? static_cast<int>(blockIdx.z) : 0;
      zero_unowned_ragged<T, D>(a, (x_tile - st.row0) * nz + z, (n_x - st.row0) * nz, hkv, st.pos0);
    }
    return;
  }
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % Cfg::kWarpsM;
  const int warp_n = warp / Cfg::kWarpsM;
  const int group = a.group;
  const T* q = static_cast<const T*>(a.q);

  // Rows of this tile: packed r in [row0, row0 + BLOCK_M): token r / group, head hkv * group + r % group.
  const TileKeys tk = tile_keys<BLOCK_M, BN>(a, st, part);
  const int rows_seq = tk.rows_seq;
  const int64_t k_lo = tk.k_lo, k_hi = tk.k_hi;
  const int tile_first = tk.tile_first, num_tiles = tk.num_tiles;

  // ---- load Q (zero rows past the sequence) into swizzled shared memory
  for (int c = tid; c < BLOCK_M * (D / 8); c += Cfg::kThreads) {
    const int r = c / (D / 8), ch = c % (D / 8);
    const int pr = st.row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (pr < rows_seq) {
      const int64_t qrow = st.q_base + pr / group;
      const int h = hkv * group + pr % group;
      val = *reinterpret_cast<const uint4*>(q + (qrow * a.H + h) * D + ch * 8);
    }
    *reinterpret_cast<uint4*>(sQ + SwizzledTile<D>::offset(r, ch)) = val;
  }

  // ---- K/V tile loader: each thread moves one 16-byte column chunk of kPasses key rows per tile. Page-table
  // reads for all its rows are issued before any address is formed, so their latencies overlap.
  constexpr int CPR = Cfg::kChunksPerRow, RSTEP = Cfg::kRowStep, NPASS = Cfg::kPasses;
  const int my_row = tid / CPR, my_ch = tid % CPR;
  const int32_t* lut_row = nullptr;
  int layer = 0;
  bool layer_ok = true;
  if (a.kv_mode == kKvPaged) {
    lut_row = a.lookup + static_cast<int64_t>(st.b) * a.max_pages;
    layer = *a.layer_ptr;
    layer_ok = layer >= 0 && layer < a.num_layers;
  }
  const T* kvb = static_cast<const T*>(a.kv_blocks);
  const T* kc = static_cast<const T*>(a.k);
  const T* vc = static_cast<const T*>(a.v);
  const int64_t row_stride = static_cast<int64_t>(a.Hkv) * D;  // elements between key slots
  const int64_t kv_half = static_cast<int64_t>(a.num_layers) * a.page_size * row_stride;  // K -> V in a page
  const int64_t page_stride = 2 * kv_half;
  const int64_t head_off = static_cast<int64_t>(layer) * a.page_size * row_stride + hkv * D + my_ch * 8;
  const int kmax = static_cast<int>(st.kmax);
  // Paged: the warp's threads cover kRowsPerWarp distinct key rows over the passes; lane l looks up the page of
  // one of them, and the others receive it by shuffle (one page-table read per key row, not per chunk). The
  // entries of a tile are read one tile ahead (`fetch_pages`) and range-checked where load_tile uses them: a
  // check right after the read would stall every warp on its latency before it issues the tile's copies.
  constexpr int kRowsPerWarp = 32 / CPR;  // rows a warp covers in one pass
  constexpr bool kShuffledPages = NPASS * kRowsPerWarp <= 32;
  // Pages of a power-of-two size of at least a key tile hold whole tiles (tiles start at multiples of BN): one
  // page-table entry per tile, the same for every thread, and each row's slot is the tile's first slot plus its
  // row, so the loader forms one base address per tile instead of a page, a slot and an address per row.
  static_assert(kPages == kPagesAny || Cfg::kTransposed, "the layout-specific loaders serve 8-row tiles");
  const bool tile_one_page =
      kPages == kPagesWhole || (a.kv_mode == kKvPaged && a.page_shift >= 0 && a.page_size >= BN);
  // kPagesSmall: the thread loads rows small_row0 .. small_row0 + kPasses - 1 of each tile, all in one page.
  const int small_row0 = my_row * NPASS;
  auto fetch_pages = [&](int tile) {
    int32_t p = -1;
    // (Unsigned: the tile one past the last, which the prologue and loop fetch ahead, may start at 2^31 or past it,
    // where an int key wrapped negative and passed key < kmax; below 2^32 as unsigned, it fails that test.)
    if constexpr (kPages == kPagesSmall) {
      const uint32_t key = static_cast<uint32_t>(tile) * BN + small_row0;
      if (key < static_cast<uint32_t>(kmax) && layer_ok) p = __ldg(lut_row + (key >> a.page_shift));
    } else if (tile_one_page) {
      const uint32_t key = static_cast<uint32_t>(tile) * BN;
      if (key < static_cast<uint32_t>(kmax) && layer_ok) p = __ldg(lut_row + (key >> a.page_shift));
    } else if (kShuffledPages && a.kv_mode == kKvPaged) {
      const int lane_ = tid % 32;
      const int r_local = lane_ % kRowsPerWarp, pass = lane_ / kRowsPerWarp;  // lane -> (row, pass)
      const uint32_t key = static_cast<uint32_t>(tile) * BN + (tid / 32) * kRowsPerWarp + r_local + pass * RSTEP;
      if (pass < NPASS && key < static_cast<uint32_t>(kmax) && layer_ok)
        p = __ldg(lut_row + (a.page_shift >= 0 ? (key >> a.page_shift) : key / static_cast<uint32_t>(a.page_size)));
    }
    return p;
  };
  // Decode tiles (16 rows or fewer: the group's heads packed, so each K/V byte is read by one CTA) stream their K/V,
  // except in the cluster-merge kernel (2.5% slower with the policy on the H200, NOTES_mha v22).
  constexpr bool kStream = BLOCK_M <= kHeadsFastestRows && !kCluster;
  // kPagesWhole: bit s tells whether the tile in ring stage s has its page (no per-row flags: every key of a
  // tile shares the tile's page, and the keys a row sees lie below kmax).
  uint32_t tile_ok_bits = 0;
  auto load_tile = [&](int tile, int stage, int32_t entry) {
    const uint64_t pol = kStream ? l2_evict_first() : 0;
    T* sK = sKV + stage * 2 * Cfg::kKvTileElems;
    T* sV = sK + Cfg::kKvTileElems;
    int* valid = sValid + stage * (BN + RSTEP);
    const int key0 = tile * BN + my_row;
    if constexpr (kPages == kPagesSmall) {
      // Power-of-two pages smaller than a tile: this thread's kPasses consecutive rows from small_row0 lie in one
      // page (the launch guarantees at least kPasses keys a page; both are powers of two), whose entry
      // fetch_pages read: one base address, each row one row stride further. In row r the thread copies chunk my_ch ^ (r & 7),
      // which the swizzle puts at column chunk my_ch: its destinations lie one row apart. Rows past kmax, or of
      // an absent page, are zero-filled and flagged absent.
      const int r0 = small_row0;
      const int key_r0 = tile * BN + r0;
      const int pg = pool_page(a, entry);
      const int n_ok = pg >= 0 ? max(0, min(NPASS, kmax - key_r0)) : 0;  // rows r0 + i, i < n_ok, exist
      const int64_t base = pg >= 0 ? static_cast<int64_t>(pg) * page_stride + head_off - my_ch * 8 +
                                         static_cast<int64_t>(key_r0 & (a.page_size - 1)) * row_stride
                                   : 0;
      const T* src = kvb + base;
      T* d0 = sK + r0 * D + my_ch * 8;
      auto pass = [&](auto ic) {
        constexpr int i = decltype(ic)::value;
        const T* s_i = src + (static_cast<int64_t>(i) * row_stride + ((my_ch ^ ((r0 + i) & 7)) * 8));
        if constexpr (kStream) {
          cp_async16_at<i * D * 2>(d0, s_i, i < n_ok, pol);
          cp_async16_at<(Cfg::kKvTileElems + i * D) * 2>(d0, s_i + kv_half, i < n_ok, pol);
        } else {
          cp_async16(smem_addr(d0 + i * D), s_i, i < n_ok);
          cp_async16(smem_addr(d0 + Cfg::kKvTileElems + i * D), s_i + kv_half, i < n_ok);
        }
      };
      unroll_constants<NPASS>(pass);
      if (my_ch == 0) {
        static_assert(NPASS % 4 == 0, "the row flags in 16-byte stores");
#pragma unroll
        for (int i = 0; i < NPASS; i += 4)
          *reinterpret_cast<int4*>(valid + r0 + i) = make_int4(i < n_ok, i + 1 < n_ok, i + 2 < n_ok, i + 3 < n_ok);
        valid[BN + my_row] = n_ok;
      }
      return;
    }
    if constexpr (kPages == kPagesWhole) {
      // One base address a tile; an absent page reads nothing (zero-filled copies) at the addresses of page 0.
      const int pg = pool_page(a, entry);
      const bool pg_ok = pg >= 0;
      const int64_t base = pg_ok ? static_cast<int64_t>(pg) * page_stride + head_off +
                                       static_cast<int64_t>(key0 & (a.page_size - 1)) * row_stride
                                 : my_ch * 8;
      const int n_ok = pg_ok ? min(NPASS, (kmax - key0 + RSTEP - 1) / RSTEP) : 0;  // rows i < n_ok exist
      tile_ok_bits = (tile_ok_bits & ~(1u << stage)) | (static_cast<uint32_t>(pg_ok) << stage);
      const T* src = kvb + base;
      if constexpr (kStream && RSTEP % 8 == 0) {
        // Row my_row + i * RSTEP has the swizzle of row my_row: its chunk lies i * RSTEP rows further.
        T* d0 = sK + SwizzledTile<D>::offset(my_row, my_ch);
        auto pass = [&](auto ic) {
          constexpr int i = decltype(ic)::value;
          const T* s_i = src + static_cast<int64_t>(i * RSTEP) * row_stride;
          cp_async16_at<i * RSTEP * D * 2>(d0, s_i, i < n_ok, pol);
          cp_async16_at<(Cfg::kKvTileElems + i * RSTEP * D) * 2>(d0, s_i + kv_half, i < n_ok, pol);
        };
        unroll_constants<NPASS>(pass);
      } else {
#pragma unroll
        for (int i = 0; i < NPASS; ++i) {
          const int off = SwizzledTile<D>::offset(my_row + i * RSTEP, my_ch);
          const T* s_i = src + static_cast<int64_t>(i * RSTEP) * row_stride;
          cp_async16_kv<kStream>(sK + off, smem_addr(sK + off), s_i, i < n_ok, pol);
          cp_async16_kv<kStream>(sV + off, smem_addr(sV + off), s_i + kv_half, i < n_ok, pol);
        }
      }
      return;
    }
    int64_t src[NPASS];
    bool ok[NPASS];
    if (tile_one_page) {
      const int pg = pool_page(a, entry);
      const int64_t base = static_cast<int64_t>(pg) * page_stride + head_off +
                           static_cast<int64_t>(key0 & (a.page_size - 1)) * row_stride;
#pragma unroll
      for (int i = 0; i < NPASS; ++i) {
        ok[i] = pg >= 0 && key0 + i * RSTEP < kmax;
        src[i] = ok[i] ? base + static_cast<int64_t>(i * RSTEP) * row_stride : 0;
      }
    } else if (a.kv_mode == kKvPaged) {
      const int warp_row0 = (tid / 32) * kRowsPerWarp;
      const int my_page = pool_page(a, entry);
#pragma unroll
      for (int i = 0; i < NPASS; ++i) {
        const int key = key0 + i * RSTEP;
        int pg = my_page;
        if (kShuffledPages) {
          pg = __shfl_sync(0xffffffff, my_page, (my_row - warp_row0) + i * kRowsPerWarp);
        } else {  // more rows than lanes: look up directly
          const int pidx = a.page_shift >= 0 ? (key >> a.page_shift) : key / a.page_size;
          pg = pool_page(a, (key < kmax && layer_ok) ? __ldg(lut_row + pidx) : -1);
        }
        const int slot = page_slot(a, key);
        ok[i] = pg >= 0;
        src[i] = ok[i] ? static_cast<int64_t>(pg) * page_stride + head_off + slot * row_stride : 0;
      }
    } else {
      const int64_t base = static_cast<int64_t>(st.kv_base) * row_stride + hkv * D + my_ch * 8;
#pragma unroll
      for (int i = 0; i < NPASS; ++i) {
        const int key = key0 + i * RSTEP;
        ok[i] = key < kmax;
        src[i] = ok[i] ? base + key * row_stride : 0;
      }
    }
    int count = 0;
#pragma unroll
    for (int i = 0; i < NPASS; ++i) {
      const int off = SwizzledTile<D>::offset(my_row + i * RSTEP, my_ch);
      if (a.kv_mode == kKvPaged) {
        cp_async16_kv<kStream>(sK + off, smem_addr(sK + off), kvb + src[i], ok[i], pol);
        cp_async16_kv<kStream>(sV + off, smem_addr(sV + off), kvb + src[i] + kv_half, ok[i], pol);
      } else {
        cp_async16_kv<kStream>(sK + off, smem_addr(sK + off), kc + src[i], ok[i], pol);
        cp_async16_kv<kStream>(sV + off, smem_addr(sV + off), vc + src[i], ok[i], pol);
      }
      count += ok[i] ? 1 : 0;
      if (my_ch == 0) valid[my_row + i * RSTEP] = ok[i] ? 1 : 0;
    }
    if (my_ch == 0) valid[BN + my_row] = count;  // per-thread count of existing keys
  };

  // Prologue: STAGES-1 tiles in flight; `entry` holds the page-table entry of the next tile to load.
  int32_t entry = fetch_pages(tile_first);
#pragma unroll
  for (int st_ = 0; st_ < STAGES - 1; ++st_) {
    if (st_ < num_tiles) {
      load_tile(tile_first + st_, st_, entry);
      entry = fetch_pages(tile_first + st_ + 1);
    }
    cp_async_commit();
  }
  __syncthreads();  // sQ visible

  // Both paths below start key tile `it` alike: issue the load STAGES-1 tiles ahead, then wait for tile `it`.
  auto await_tile = [&](int it) {
    const int nxt = it + STAGES - 1;
    if (nxt < num_tiles) {
      load_tile(tile_first + nxt, nxt % STAGES, entry);
      entry = fetch_pages(tile_first + nxt + 1);
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncthreads();
  };
  // Key tile `it` once it has landed: its K and V in the ring, the per-row validity flags (and per-thread counts
  // after BN of them), its first key, whether every key exists (the counts add up to BN), and whether it needs no
  // mask at all: every key exists and lies in [full_lo, full_hi), the keys every row of the tile sees.
  struct TileView {
    const T* sK;
    const T* sV;
    const int* valid;
    int key0;
    bool present, full;
  };
  auto next_tile = [&](int it, int full_lo, int full_hi, float sl2) {
    await_tile(it);
    const int stage = it % STAGES;
    TileView v;
    v.sK = sKV + stage * 2 * Cfg::kKvTileElems;
    v.sV = v.sK + Cfg::kKvTileElems;
    v.valid = sValid + stage * (BN + RSTEP);
    v.key0 = (tile_first + it) * BN;
    if constexpr (kPages == kPagesWhole) {
      v.present = (tile_ok_bits >> stage) & 1u;
    } else {
      int count = 0;
#pragma unroll
      for (int j = 0; j < RSTEP; ++j) count += v.valid[BN + j];
      v.present = count == BN;
    }
    v.full = sl2 > 0.f && v.present && v.key0 >= full_lo && v.key0 + BN <= full_hi;
    return v;
  };

  if constexpr (Cfg::kTransposed) {
    // Tiles of at most 8 rows (decode with group <= 8): S^T = K Q^T puts the warp's 16 keys on the MMA's M side
    // and the tile's 8 rows on its N side, and O^T = V^T P^T likewise, so no MMA or exponential is spent on the
    // 8 empty rows a 16-row tile would carry. Each warp takes 16 keys of the 64-key tile. Thread (g, t) =
    // (lane / 4, lane % 4) holds S^T at keys g, g + 8 and rows 2t, 2t + 1, and O^T at dims 16j + g, 16j + g + 8 and
    // the same rows; the row statistics reduce across g.
    const int t2 = (lane % 4) * 2;
    const int key_w0 = warp * Cfg::kWarpKeys;
    // Q^T is the B operand of every k step: fragment kk is rows 0-7 x dims 16kk..16kk+15, held in registers.
    uint32_t qb[KD][2];
#pragma unroll
    for (int kk = 0; kk < KD; kk += 2) {
      uint32_t r[4];
      ldmatrix_x4(r, smem_addr(sQ + SwizzledTile<D>::offset(lane % 8, kk * 2 + lane / 8)));
      qb[kk][0] = r[0];
      qb[kk][1] = r[1];
      qb[kk + 1][0] = r[2];
      qb[kk + 1][1] = r[3];
    }
    float o[KD][4];
#pragma unroll
    for (int j = 0; j < KD; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    int row_lo[2], row_hi[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const RowKeys rk = row_keys(a, st, group, rows_seq, k_lo, k_hi, st.row0 + t2 + i);
      row_lo[i] = rk.lo;
      row_hi[i] = rk.hi;
    }
    const RowKeys full = full_keys(tk);
    const int full_lo = full.lo, full_hi = full.hi;
    const float sl2 = a.scale_log2;

    for (int it = 0; it < num_tiles; ++it) {
      const auto [sK, sV, valid, tile_key0, present, full] = next_tile(it, full_lo, full_hi, sl2);

      // S^T = K Q^T: K (keys x dims, row-major in smem) is the A operand as it lies.
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        uint32_t kf[4];
        const FragAddr f = v_frag_addr(lane, key_w0, kk * 2);  // (keys 0-7, c), (8-15, c), (0-7, c+1), (8-15, c+1)
        ldmatrix_x4(kf, smem_addr(sK + SwizzledTile<D>::offset(f.key, f.ch)));
        M::run(s, kf, qb[kk]);
      }
      // Online softmax in log2 units; s[e] is key key_w0 + g + 8 (e / 2), row 2t + e % 2.
      float m_new[2] = {m_run[0], m_run[1]};
      if (full) {
        m_new[0] = fmaxf(m_new[0], fmaxf(s[0], s[2]) * sl2);
        m_new[1] = fmaxf(m_new[1], fmaxf(s[1], s[3]) * sl2);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e % 2;
          const int kl = key_w0 + lane / 4 + (e / 2) * 8;
          const int key = tile_key0 + kl;
          const bool vis = key >= row_lo[i] && key < row_hi[i] && (kPages == kPagesWhole ? present : valid[kl] != 0);
          s[e] = vis ? s[e] * sl2 : -INFINITY;
          m_new[i] = fmaxf(m_new[i], s[e]);
        }
      }
      rescale_rows<KD, true, true>(m_new, m_run, l_run, o);
      const float neg_m[2] = {m_run[0] == -INFINITY ? 0.f : -m_run[0], m_run[1] == -INFINITY ? 0.f : -m_run[1]};
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e % 2;
        p[e] = fast_exp2(full ? fmaf(s[e], sl2, neg_m[i]) : s[e] + neg_m[i]);
        l_run[i] += p[e];
      }
      // A tile that is not full: the warp's own 16 V rows with NaN / Inf as 0, in shared memory (only this warp reads
      // them), so that a key some row does not see cannot reach it as 0 * NaN (finite_or_zero above).
      if (!full) {
        finite_or_zero_rows<T, D, Cfg::kWarpKeys>(const_cast<T*>(sV), key_w0, lane);
        __syncwarp();
      }
      // P^T is the B operand of O^T = V^T P^T: each 8x8 (key x row) block of P, transposed in registers.
      const uint32_t pb[2] = {movmatrix_trans(M::pack(p[0], p[1])), movmatrix_trans(M::pack(p[2], p[3]))};
      // O^T += V^T P^T: V (keys x dims in smem) read transposed is the A operand.
#pragma unroll
      for (int j = 0; j < KD; ++j) {
        uint32_t vf[4];
        const FragAddr f = k_frag_addr(lane, key_w0, j * 2);  // (keys 0-7, c), (0-7, c+1), (8-15, c), (8-15, c+1)
        ldmatrix_x4_trans(vf, smem_addr(sV + SwizzledTile<D>::offset(f.key, f.ch)));
        M::run(o[j], vf, pb);
      }
      __syncthreads();  // the stage is free for the next load
    }
    cp_async_wait<0>();

    // Row sums across g, then the four warps' states merge through shared memory; thread tid then finishes row
    // tid / 16, dims (tid % 16) * D / 16 onwards.
    sum_over_lane_groups(l_run);
    __syncthreads();
    constexpr int MS = Cfg::kMergeStride;
    float* mo = reinterpret_cast<float*>(smem_raw + Cfg::kSmemQ);  // [warps][8][MS]
    float* ml = mo + Cfg::kWarps * 8 * MS;                         // [warps][8][2] (m, l)
    stash_rows_t<KD, MS>(mo, ml, warp, lane, o, m_run, l_run,
                         [&](int j, int e) { return j * 16 + lane / 4 + (e / 2) * 8; });
    __syncthreads();
    constexpr int DPT = D / 16;  // dims per thread
    const int r = tid / 16, d0 = (tid % 16) * DPT;
    const int pr = st.row0 + r;
    const bool live = pr < rows_seq;
    if (!live && !kCluster) return;  // (every thread of a cluster reaches its barriers)
    float mt, lt, f[Cfg::kWarps];
    merge_weights<Cfg::kWarps>(ml, 8, r, &mt, &lt, f);
    float acc[DPT];
    sum_warp_rows<Cfg::kWarps, DPT, MS>(mo, r, d0, f, acc);
    const int64_t qrow = st.q_base + pr / group;
    const int h = hkv * group + pr % group;
    const bool any = lt > 0.f;
    const T* sink = static_cast<const T*>(a.sink);
    auto store_out = [&](const float* v, float inv) {  // the output row's DPT dims from d0, times inv
      uint32_t packed[DPT / 2];
#pragma unroll
      for (int j = 0; j < DPT / 2; ++j) packed[j] = M::pack(v[2 * j] * inv, v[2 * j + 1] * inv);
      T* dst = static_cast<T*>(a.out) + (qrow * a.H + h) * D + d0;
      if constexpr (DPT == 8) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
#pragma unroll
        for (int j = 0; j < DPT / 2; ++j) reinterpret_cast<uint32_t*>(dst)[j] = packed[j];
      }
    };
    if constexpr (kCluster) {  // the partitions of this tile and head are one cluster: merge them here
      static_assert((Cfg::kWarps * 8 * MS + Cfg::kWarps * 16 + kClusterXchgFloats(DPT)) * 4 <= Cfg::kSmemKv,
                    "merge scratch within the K/V ring");
      if (!live) mt = -INFINITY, lt = 0.f;
      const float sink_l2 = live && sink != nullptr ? sink_log2(M::to_float(sink[h])) : -INFINITY;
      float res[DPT];
      if (cluster_merge<DPT>(ml + Cfg::kWarps * 16, r, tid % 16, mt, lt, acc, sink_l2, res) && live)
        store_out(res, 1.f);
    } else if (a.num_partitions <= 1) {
      float den = lt;
      if (sink != nullptr && any) den += sink_term(sink, h, mt);
      store_out(acc, any ? 1.f / den : 0.f);
    } else {
      const float inv = any ? 1.f / lt : 0.f;
      const int64_t ws_row = (static_cast<int64_t>(part) * a.total_rows + qrow) * a.H + h;
      float4* dst = reinterpret_cast<float4*>(a.ws_o + ws_row * D + d0);
#pragma unroll
      for (int j = 0; j < DPT / 4; ++j)
        dst[j] = make_float4(acc[4 * j] * inv, acc[4 * j + 1] * inv, acc[4 * j + 2] * inv, acc[4 * j + 3] * inv);
      if (tid % 16 == 0) a.ws_lse[ws_row] = any ? mt + log2f(lt) : -INFINITY;
    }
  } else {
    constexpr int MB = Cfg::kMBlocks;
    const int warp_row0_q = warp_m * 16 * MB;  // first row (within the tile) of this warp
    auto load_q_frag = [&](uint32_t* f, int mb, int kk) {
      const int r = warp_row0_q + mb * 16 + (lane % 16);
      const int ch = kk * 2 + lane / 16;
      ldmatrix_x4(f, smem_addr(sQ + SwizzledTile<D>::offset(r, ch)));
    };
    // Q fragments stay in registers when the warp holds one row block.
    uint32_t qf[Cfg::kQInRegs ? KD : 1][4];
    if constexpr (Cfg::kQInRegs) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) load_q_frag(qf[kk], 0, kk);
    }

    // Per-thread state: rows lane/4 and lane/4 + 8 of each of the warp's MB row blocks.
    float o[MB][ND][4];
    float m_run[MB][2], l_run[MB][2];
    int row_lo[MB][2], row_hi[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
      for (int j = 0; j < ND; ++j) o[mb][j][0] = o[mb][j][1] = o[mb][j][2] = o[mb][j][3] = 0.f;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_run[mb][i] = -INFINITY;
        l_run[mb][i] = 0.f;
        const int pr = st.row0 + warp_row0_q + mb * 16 + lane / 4 + i * 8;
        const RowKeys rk = row_keys(a, st, group, rows_seq, k_lo, k_hi, pr);
        row_lo[mb][i] = rk.lo;
        row_hi[mb][i] = rk.hi;
      }
    }
    const RowKeys full = full_keys(tk);
    const int full_lo = full.lo, full_hi = full.hi;
    const float sl2 = a.scale_log2;

    for (int it = 0; it < num_tiles; ++it) {
      const auto [sK, sV, valid, tile_key0, present, full] = next_tile(it, full_lo, full_hi, sl2);
      constexpr int kChunks = Cfg::kWarpKeys / Cfg::kChunkKeys;
#pragma unroll 1
      for (int kc = 0; kc < kChunks; ++kc) {
      const int key_w0 = warp_n * Cfg::kWarpKeys + kc * Cfg::kChunkKeys;  // first key of this chunk in the tile

      // S = Q K^T for this warp's keys: each K fragment feeds all MB row blocks.
      float s[MB][NB_WARP][4];
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int j = 0; j < NB_WARP; ++j) s[mb][j][0] = s[mb][j][1] = s[mb][j][2] = s[mb][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        uint32_t qtmp[MB][4];
        if constexpr (!Cfg::kQInRegs) {
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) load_q_frag(qtmp[mb], mb, kk);
        }
#pragma unroll
        for (int j = 0; j < NB_WARP; j += 2) {
          uint32_t kf[4];
          const FragAddr f = k_frag_addr(lane, key_w0 + j * 8, kk * 2);
          ldmatrix_x4(kf, smem_addr(sK + SwizzledTile<D>::offset(f.key, f.ch)));
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            const uint32_t* af = Cfg::kQInRegs ? qf[kk] : qtmp[mb];
            M::run(s[mb][j], af, kf);
            M::run(s[mb][j + 1], af, kf + 2);
          }
        }
      }

      // Online softmax in log2 units. A full tile (every key exists and is visible to every row) skips the mask
      // and folds the scale into the exponent: p = 2^(s * scale_log2 - m).
      uint32_t pf[MB][NB_WARP / 2][4];
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        float m_new[2] = {m_run[mb][0], m_run[mb][1]};
        if (full) {
          float raw[2] = {-INFINITY, -INFINITY};
#pragma unroll
          for (int j = 0; j < NB_WARP; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) raw[e / 2] = fmaxf(raw[e / 2], s[mb][j][e]);
          m_new[0] = fmaxf(m_new[0], raw[0] * sl2);
          m_new[1] = fmaxf(m_new[1], raw[1] * sl2);
        } else {
#pragma unroll
          for (int j = 0; j < NB_WARP; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = e / 2;
              const int kl = key_w0 + j * 8 + (lane % 4) * 2 + (e % 2);
              const int key = tile_key0 + kl;
              const bool vis = key >= row_lo[mb][i] && key < row_hi[mb][i] && valid[kl];
              s[mb][j][e] = vis ? s[mb][j][e] * sl2 : -INFINITY;
              m_new[i] = fmaxf(m_new[i], s[mb][j][e]);
            }
          }
        }
        rescale_rows<ND, false, true>(m_new, m_run[mb], l_run[mb], o[mb]);
        const float neg_m[2] = {m_run[mb][0] == -INFINITY ? 0.f : -m_run[mb][0],
                                m_run[mb][1] == -INFINITY ? 0.f : -m_run[mb][1]};
#pragma unroll
        for (int j = 0; j < NB_WARP; ++j) {
          float p[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = e / 2;
            // exp2(-inf) = 0 covers masked keys; rows with no visible key yet have m = -inf and all s = -inf.
            const float x = full ? fmaf(s[mb][j][e], sl2, neg_m[i]) : s[mb][j][e] + neg_m[i];
            p[e] = fast_exp2(x);  // one exponential per score
            l_run[mb][i] += p[e];
          }
          pf[mb][j / 2][(j % 2) * 2 + 0] = M::pack(p[0], p[1]);
          pf[mb][j / 2][(j % 2) * 2 + 1] = M::pack(p[2], p[3]);
        }
      }
      // O += P V over this warp's keys (k steps of 16 keys): each V fragment feeds all MB row blocks.
#pragma unroll
      for (int ks = 0; ks < NB_WARP / 2; ++ks) {
#pragma unroll
        for (int jd = 0; jd < ND; jd += 2) {
          uint32_t vf[4];
          const FragAddr f = v_frag_addr(lane, key_w0 + ks * 16, jd);
          ldmatrix_x4_trans(vf, smem_addr(sV + SwizzledTile<D>::offset(f.key, f.ch)));
          if (!full) finite_or_zero4<T>(vf);
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            M::run(o[mb][jd], pf[mb][ks], vf);
            M::run(o[mb][jd + 1], pf[mb][ks], vf + 2);
          }
        }
      }
      }  // key chunks
      __syncthreads();  // the stage is free for the next load
    }
    cp_async_wait<0>();

    // Row sums over the quad.
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        l_run[mb][i] += __shfl_xor_sync(0xffffffff, l_run[mb][i], 1);
        l_run[mb][i] += __shfl_xor_sync(0xffffffff, l_run[mb][i], 2);
      }

    // Merge the key-split warps (decode layout: one row block, warps along keys) through shared memory.
    if constexpr (Cfg::kWarpsN > 1) {
      __syncthreads();
      float* mo = reinterpret_cast<float*>(smem_raw + Cfg::kSmemQ);  // [warps][16][D]
      float* ml = mo + Cfg::kWarps * 16 * D;                         // [warps][16][2] (m, l)
#pragma unroll
      for (int j = 0; j < ND; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = lane / 4 + (e / 2) * 8;
          const int col = j * 8 + (lane % 4) * 2 + (e % 2);
          mo[(warp * 16 + r) * D + col] = o[0][j][e];
        }
      }
      if (lane % 4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = lane / 4 + i * 8;
          ml[(warp * 16 + r) * 2 + 0] = m_run[0][i];
          ml[(warp * 16 + r) * 2 + 1] = l_run[0][i];
        }
      }
      __syncthreads();
      if (warp != 0) return;  // warp 0 owns the merged state
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = lane / 4 + i * 8;
        float mt, lt, f[Cfg::kWarps];
        merge_weights<Cfg::kWarps>(ml, 16, r, &mt, &lt, f);
        m_run[0][i] = mt;
        l_run[0][i] = lt;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int col = j * 8 + (lane % 4) * 2 + e2;
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < Cfg::kWarps; ++w) acc += f[w] * mo[(w * 16 + r) * D + col];
            o[0][j][i * 2 + e2] = acc;
          }
        }
      }
    }

    // Epilogue: final output (one partition) or the partition's normalized partial and its log2-sum-exp.
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int pr = st.row0 + warp_row0_q + mb * 16 + lane / 4 + i * 8;
        if (pr >= rows_seq) continue;
        store_row<T, D>(a, st.q_base + pr / group, hkv * group + pr % group, part, l_run[mb][i], m_run[mb][i],
                        &o[mb][0][i * 2], lane);
      }
    }
  }
}

// Sequence owning row t under the repaired offsets (running max clamped to [0, T]), or -1; [*eff_b, *eff_b1) are
// its rows. Called by whole warps: 32 sequences per step (max-scan of the offsets).
__device__ __forceinline__ int row_owner(const int32_t* offsets, int B, int T, int t, int64_t* eff_b,
                                         int64_t* eff_b1) {
  const int lane = threadIdx.x & 31;
  // The first 32 ends are read with offsets[0], not after it: one memory latency instead of two.
  int64_t v = lane < B ? static_cast<int64_t>(offsets[lane + 1]) : INT64_MIN;
  int64_t carry = imin(imax(0, offsets[0]), T);
  if (t < carry) return -1;
  for (int base = 0; base < B; base += 32) {
    const int b = base + lane;
    if (base > 0) v = b < B ? static_cast<int64_t>(offsets[b + 1]) : INT64_MIN;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffff, v, d);
      if (lane >= d) v = imax(v, u);
    }
    const int64_t next = imin(imax(carry, v), T);
    int64_t prev = __shfl_up_sync(0xffffffff, next, 1);
    if (lane == 0) prev = carry;
    const unsigned hit = __ballot_sync(0xffffffff, b < B && t < next);
    if (hit) {
      const int src = __ffs(hit) - 1;
      *eff_b = __shfl_sync(0xffffffff, prev, src);
      *eff_b1 = __shfl_sync(0xffffffff, next, src);
      return base + src;
    }
    carry = __shfl_sync(0xffffffff, next, 31);
  }
  return -1;
}

// Called by a whole warp: row t is owned iff eff[0] <= t < eff[B].
__device__ __forceinline__ bool row_owned(const AttentionArgs& a, int t) {
  if (a.q_mode == kQPadded) {
    const int b = t / a.seq_rows, i = t % a.seq_rows;
    return i < iclamp(a.valid_lengths[b], 0, a.seq_rows);
  }
  const OwnedRows own = owned_rows(a);
  return t >= own.lo && t < own.hi;
}

// Output row t zeroed by `n` threads (this one the i-th): 16-byte stores where every row starts 16-byte aligned.
template <typename T>
__device__ __forceinline__ void zero_out_row(const AttentionArgs& a, int row_elems, int64_t t, int i, int n) {
  using M = Mma<T>;
  T* out = static_cast<T*>(a.out) + t * row_elems;
  if ((reinterpret_cast<uintptr_t>(a.out) & 15) == 0 && (row_elems * sizeof(T)) % 16 == 0) {
    for (int e = i * 8; e < row_elems; e += n * 8) *reinterpret_cast<uint4*>(out + e) = make_uint4(0, 0, 0, 0);
  } else {
    for (int e = i; e < row_elems; e += n) out[e] = M::from_float(0.f);
  }
}

// Rows owned by no sequence output 0. A grid of at most kZeroRowsBlocks blocks strides over them: ragged, each block
// finds the owned range [eff[0], eff[B]) once and visits only the rows outside it, so that a call whose rows are all
// owned costs one small wave (one block per row of a 16k-row call took 12.4 us on an H200, 5% of a dense prefill
// call at S = 512; benchmarks/NOTES_mha.md v27); padded, each block tests its rows. (The persistent sm_90 kernels
// zero them with a warp of their own instead: zero_unowned_rows_warp.)
constexpr int kZeroRowsBlocks = 1024;
template <typename T>
__global__ void zero_unowned_rows_kernel(const AttentionArgs a, int row_elems) {
  const int64_t T_ = a.total_rows;
  auto zero_row = [&](int64_t t) { zero_out_row<T>(a, row_elems, t, threadIdx.x, blockDim.x); };
  if (a.q_mode == kQPadded) {
    for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
      if (!row_owned(a, static_cast<int>(t))) zero_row(t);  // the same test in every thread
    }
    return;
  }
  __shared__ OwnedRows own_s;
  if (threadIdx.x < 32) {
    const OwnedRows own = owned_rows(a);
    if (threadIdx.x == 0) own_s = own;
  }
  __syncthreads();
  const int64_t lo = own_s.lo, hi = own_s.hi;
  const int64_t unowned = lo + (T_ - hi);
  for (int64_t j = blockIdx.x; j < unowned; j += gridDim.x) zero_row(j < lo ? j : hi + (j - lo));
}

// What zero_unowned_rows_kernel does, by `parts` whole warps (this one takes every parts-th row from row `part`):
// for the persistent kernels, which have a warp to spare, so that no launch follows them. Ragged, the rows outside
// `own`, the owned range, which the caller knows; padded (`own` unread), the lanes test 32 rows at once.
template <typename T>
__device__ __forceinline__ void zero_unowned_rows_warp(const AttentionArgs& a, int row_elems, OwnedRows own, int part,
                                                       int parts) {
  const int lane = threadIdx.x & 31;
  const int T_ = a.total_rows;
  if (a.q_mode == kQPadded) {
    for (int64_t base = part; base < T_; base += 32 * parts) {
      const int64_t t = base + lane * parts;
      const bool unowned = t < T_ && !row_owned(a, static_cast<int>(t));
      for (uint32_t m = __ballot_sync(0xffffffff, unowned); m != 0; m &= m - 1)
        zero_out_row<T>(a, row_elems, base + (__ffs(m) - 1) * parts, lane, 32);
    }
    return;
  }
  const int lo = static_cast<int>(own.lo), hi = static_cast<int>(own.hi);  // within [0, T_]
  const int unowned = lo + (T_ - hi);
  for (int64_t j = part; j < unowned; j += parts)
    zero_out_row<T>(a, row_elems, j < lo ? j : hi + (j - lo), lane, 32);
}
// The launch of zero_unowned_rows_kernel for a call of total_rows rows (> 0).
template <typename T>
void launch_zero_unowned_rows(const AttentionArgs& a, int row_elems, cudaStream_t stream) {
  const int blocks = static_cast<int>(imin(a.total_rows, static_cast<int64_t>(kZeroRowsBlocks)));
  note_launch(kLaunchZeroRows);
  zero_unowned_rows_kernel<T><<<blocks, 128, 0, stream>>>(a, row_elems);
}

// Split-K: owned rows merge their partitions in log2 space, the sink entering once; unowned rows output 0.
// Grid (rows, H), D threads: thread d of block (t, h) writes out[t, h, d]. Each thread asks for its column of the
// first kCombineAhead partials before the block's one barrier, so that they arrive together with the owner test
// (warp 1) and the log2-sum-exps (warp 0) (one memory latency for the block rather than one per partition).
constexpr int kCombineAhead = 32;
template <typename T, int D>
__global__ void __launch_bounds__(D) split_k_combine_kernel(const AttentionArgs a) {
  using M = Mma<T>;
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  __shared__ int owned_s;
  __shared__ float scale_s[2];               // m, 1 / denominator
  __shared__ float w_s[kCombineAhead];       // weights of the first partitions, the denominator folded in
  const int np = a.num_partitions;
  const int64_t lse_stride = static_cast<int64_t>(a.total_rows) * a.H;
  const float* lse = a.ws_lse + static_cast<int64_t>(t) * a.H + h;
  const float* o = a.ws_o + (static_cast<int64_t>(t) * a.H + h) * D + d;  // partition p: o[p * lse_stride * D]
  float v[kCombineAhead];
#pragma unroll
  for (int j = 0; j < kCombineAhead; ++j) v[j] = j < np ? o[j * lse_stride * D] : 0.f;
  if (d >= 32 && d < 64) {  // warp 1: the owner test
    const bool owned = row_owned(a, t);
    if (d == 32) owned_s = owned ? 1 : 0;
  } else if (d < 32) {  // warp 0: the partitions' log2-sum-exps
    float m = -INFINITY;
    for (int p = d; p < np; p += 32) m = fmaxf(m, lse[p * lse_stride]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    float den = 0.f, w = 0.f;
    if (m != -INFINITY)
      for (int p = d; p < np; p += 32) {
        const float e = exp2f(lse[p * lse_stride] - m);
        den += e;
        if (p == d) w = e;
      }
    for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(0xffffffff, den, off);
    const T* sink = static_cast<const T*>(a.sink);
    if (sink != nullptr && m != -INFINITY) den += sink_term(sink, h, m);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    if (d < kCombineAhead) w_s[d] = w * inv;
    if (d == 0) {
      scale_s[0] = m;
      scale_s[1] = inv;
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(t) * a.H + h) * D;
  if (!owned_s) {
    out[d] = M::from_float(0.f);
    return;
  }
  float acc = 0.f;  // a partition of no keys (weight 0) is skipped, whatever its partial holds; NaN propagates
#pragma unroll
  for (int j = 0; j < kCombineAhead; ++j) acc = j < np && w_s[j] != 0.f ? fmaf(w_s[j], v[j], acc) : acc;
  const float m = scale_s[0], inv = scale_s[1];
  for (int p = kCombineAhead; p < np; ++p) {
    const float w = m != -INFINITY ? exp2f(lse[p * lse_stride] - m) * inv : 0.f;
    if (w != 0.f) acc = fmaf(w, o[p * lse_stride * D], acc);
  }
  out[d] = M::from_float(acc);
}

}  // namespace cuda
}  // namespace msa_ops
