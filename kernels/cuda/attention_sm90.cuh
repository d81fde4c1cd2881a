// Hopper (sm_90a) flash-attention prefill: the 128-row query tiles of attention_kernel on warpgroup MMA.
//
// Same contract, grid and epilogue as attention_kernel<T, D, 128, *> (attention.cuh): a CTA owns 128 packed
// (token, head) rows of one sequence and one kv head, and gridDim.z splits the keys into partitions. Two
// warpgroups own 64 rows each. K/V tiles of 128 keys stream through a three-stage ring that the tensor memory
// accelerator (TMA) fills, one thread issuing it, in the 128-byte-swizzled shared-memory form wgmma reads
// ([D/64][rows][64] elements, 16-byte chunks XOR row % 8); an mbarrier per stage says when a tile has landed.
// Paged K/V: one TMA box per page of the tile (a page id outside the pool points the box past the pool, which TMA
// fills with zeros); contiguous K/V: one box per tile. Keys past the sequence that a box brings in are masked in
// the softmax, and their V rows are zeroed in shared memory (0 * NaN would reach O).
//   S = Q K^T   wgmma m64n128k16, A = Q and B = K from shared memory (both K-major),
//   O += P V    wgmma m64nDk16,   A = P from registers (the S accumulators rounded to T), B = V from shared
//               memory, MN-major (the same layout as K, read transposed).
// Each warpgroup overlaps its softmax of tile j with its P V of tile j-1 on the tensor cores.
// The online softmax is attention_kernel's, on the wgmma accumulator layout (which per warp is the mma.sync
// m16n8 layout repeated over 8-column blocks). The CTAs run heaviest-first (reversed tile order), so causal
// tiles near the diagonal of late rows do not form a tail.
//
// Compiled only for sm_90a (wgmma does not exist elsewhere); the host launches it only on compute capability
// 9.0, and other GPUs run attention_kernel.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "attention.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MSA_OPS_SM90_WGMMA 1
#endif

namespace msa_ops {
namespace cuda {

// The warpgroup-MMA kernels (this file, msa_prefill_sm90.cuh) run on compute capability 9.0 devices, unless
// MSA_OPS_CUDA_WGMMA=0 (then, as on every other GPU, the portable mma.sync kernels do). Host code.
inline bool use_wgmma() {
  const char* env = std::getenv("MSA_OPS_CUDA_WGMMA");
  if (env != nullptr && env[0] == '0') return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

template <typename T, int D>
struct Sm90Config {
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kBlockM = 128;
  // Head dim 256: Q takes 64 KB, so K and V run in rings of their own, two 64-key tiles each (attention_sm90_kernel).
  static constexpr bool kSplitRings = D > 128;
  static constexpr int kBlockN = kSplitRings ? 64 : 128;
  static constexpr int kStages = kSplitRings ? 2 : 3;
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kKvTileBytes = kBlockN * D * 2;  // one of K or V
  static constexpr int kChunksPerRow = D / 8;
  // Q, the K/V ring, then per stage a 128-bit mask of the tile's present keys and an mbarrier.
  static constexpr int kSmemBytes = kQBytes + kStages * 2 * kKvTileBytes + kStages * 16 + kStages * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // the base is rounded up to 1024 bytes
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
};

// The TMA descriptors of a call's K/V (a __grid_constant__ kernel parameter). Paged: one descriptor over the whole
// pool [NB, 2 * L, P, Hkv, D] (K at layer l, V at L + l), boxes of min(P, tile) key rows x 64 columns. Contiguous:
// K and V as [rows, Hkv, D], boxes of a tile's key rows (128, or 64 for the pair kernel) x 64 columns.
struct Sm90Kv {
  CUtensorMap k;
  CUtensorMap v;
  int box_rows;
};

// Host: the driver's tensor-map encoder, or nullptr.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Host: whether make_sm90_kv can describe the call's K/V: its tests ahead of encoding (it starts with them).
inline bool sm90_kv_describable(const AttentionArgs& a) {
  if (tensor_map_encoder() == nullptr) return false;
  if (a.kv_mode == kKvPaged) return a.page_shift >= 3 && a.num_blocks >= 1 && a.num_layers >= 1;
  const int64_t rows = a.kv_mode == kKvPadded ? static_cast<int64_t>(a.batch) * a.total_keys : a.total_keys;
  return rows >= 1 && rows <= INT32_MAX;
}

// Host: fills `kv` for the call, or returns false (then the mma.sync kernel serves it): paged pages must be a power
// of two of at least 8 slots (whole 1024-byte swizzle atoms per box), and the driver must offer the encoder.
// tile_rows: the kernel's key tile (128, or 64 for the pair kernel and at head dim 256), the most key rows a box
// holds. A box is 128 bytes of a row wide: 64 f16 / bf16 columns, or 128 of a one-byte type (fp8, as raw bytes).
template <typename T, int D>
bool make_sm90_kv(const AttentionArgs& a, Sm90Kv* kv, int tile_rows = 128,
                  CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  if (!sm90_kv_describable(a)) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  constexpr int E = sizeof(T);  // bytes an element
  const CUtensorMapDataType dt = E == 1                       ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  constexpr cuuint32_t kBoxCols = 128 / E;
  const cuuint64_t row = static_cast<cuuint64_t>(a.Hkv) * D * E;  // bytes of one key row (all kv heads)
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  auto enc = [&](CUtensorMap* m, const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                 const cuuint32_t* box) {
    return encode(m, dt, rank, const_cast<void*>(base), dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  if (a.kv_mode == kKvPaged) {
    kv->box_rows = a.page_size < tile_rows ? a.page_size : tile_rows;
    const cuuint64_t dims[5] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(a.Hkv),
                                static_cast<cuuint64_t>(a.page_size), 2 * static_cast<cuuint64_t>(a.num_layers),
                                static_cast<cuuint64_t>(a.num_blocks)};
    const cuuint64_t strides[4] = {D * E, row, row * a.page_size, row * a.page_size * 2 * a.num_layers};
    const cuuint32_t box[5] = {kBoxCols, 1, static_cast<cuuint32_t>(kv->box_rows), 1, 1};
    if (!enc(&kv->k, a.kv_blocks, 5, dims, strides, box)) return false;
    kv->v = kv->k;  // one pool: V is the layer coordinate L + l
    return true;
  }
  // 1 to INT32_MAX rows (sm90_kv_describable): TMA coordinates are signed 32-bit.
  const int64_t rows = a.kv_mode == kKvPadded ? static_cast<int64_t>(a.batch) * a.total_keys : a.total_keys;
  kv->box_rows = tile_rows;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(a.Hkv),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {D * E, row};
  const cuuint32_t box[3] = {kBoxCols, 1, static_cast<cuuint32_t>(tile_rows)};
  return enc(&kv->k, a.k, 3, dims, strides, box) && enc(&kv->v, a.v, 3, dims, strides, box);
}

// Byte offset of 16-byte chunk `ch` of row `r` in a [D/64][ROWS][64] tile with the 128-byte swizzle.
template <int ROWS>
__device__ __forceinline__ uint32_t sw128_offset(int r, int ch) {
  return static_cast<uint32_t>((ch >> 3) * ROWS * 128 + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

#if defined(MSA_OPS_SM90_WGMMA)
// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1). lbo/sbo in bytes.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}
// wgmma_desc(addr + off, ...) from wgmma_desc(addr, ...), for off a multiple of 16: the start address field (bits
// 0-13, the address over 16) does not carry into the next while addr + off stays below 256 KB, as shared memory
// addresses do, so one 32-bit add a step (wg_qk, wg_pv) instead of a descriptor built anew.
__device__ __forceinline__ uint64_t wgmma_desc_add(uint64_t d, uint32_t off) {
  return (d & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(d) + (off >> 4));
}
// x as lane 0 has it: a value the compiler then knows to be the same in every lane of the warp (all lanes must be
// present). The dense persistent kernel passes its ring stage through it, so that the MMAs' descriptors are built in
// uniform registers between the MMAs. Built from a stage held per thread, all of a step's descriptors (about 120
// instructions) came between the warpgroup's turn barrier and its first MMA, and the other warpgroup waited on
// them: on an H200 that cost the dense persistent kernel 8-13% at S=2k-8k (NOTES_mha v33).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One thread: n mbarriers at bar0, bar0 + 8, ..., one arrival each (the expect_tx), made visible to the async proxy.
__device__ __forceinline__ void mbar_init_stages(uint32_t bar0, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) mbar_init(bar0 + 8 * i, 1);
  mbar_init_fence();
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// TMA store of one box from shared memory (the CTA's own) to global memory, in the thread's bulk async-group; rows
// past the tensor are not written. The issuing thread commits the group and waits until the box has been read
// (bulk_wait_read), after which the shared memory may be reused.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#define MSA_WG_ACC64                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MSA_WG_ACC32                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MSA_WG_OUT8(d, i)                                                                                  \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),         \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define MSA_WG_OUT32(d) MSA_WG_OUT8(d, 0), MSA_WG_OUT8(d, 8), MSA_WG_OUT8(d, 16), MSA_WG_OUT8(d, 24)
#define MSA_WG_OUT64(d) MSA_WG_OUT32(d), MSA_WG_OUT8(d, 32), MSA_WG_OUT8(d, 40), MSA_WG_OUT8(d, 48), MSA_WG_OUT8(d, 56)

// d[N/2] (+)= A(64x16, smem) * B(Nx16, smem)^T, both K-major (N = 128, or 64 for the pair kernel's 64-key tiles).
// ACC / OUT: the N/2 accumulators as PTX operands and as asm outputs; PRED, AB: the operand numbers that follow.
#define MSA_WG_SS(NAME, TY, N, ACC, OUT, PRED, AB)                                                          \
  __device__ __forceinline__ void NAME(float* d, uint64_t da, uint64_t db, int accumulate) {              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " ACC ", " AB                 \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                    \
                 : OUT(d)                                                                                   \
                 : "l"(da), "l"(db), "r"(accumulate));                                                      \
  }
// d[N/2] += A(64x16, registers) * B(16xN, smem, MN-major: read transposed). N = 128 or 64; OPS: A's four registers
// and B's descriptor as PTX operands.
#define MSA_WG_RS(NAME, TY, N, ACC, OUT, OPS)                                                               \
  __device__ __forceinline__ void NAME(float* d, const uint32_t* a, uint64_t db) {                        \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TY "." TY " " ACC ", " OPS ", 1, 1, 1, 1;\n" \
                 : OUT(d)                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                                    \
  }
MSA_WG_SS(wgmma_ss_n128_bf16, "bf16", "128", MSA_WG_ACC64, MSA_WG_OUT64, "%66", "%64, %65")
MSA_WG_SS(wgmma_ss_n128_f16, "f16", "128", MSA_WG_ACC64, MSA_WG_OUT64, "%66", "%64, %65")
MSA_WG_SS(wgmma_ss_n64_bf16, "bf16", "64", MSA_WG_ACC32, MSA_WG_OUT32, "%34", "%32, %33")
MSA_WG_SS(wgmma_ss_n64_f16, "f16", "64", MSA_WG_ACC32, MSA_WG_OUT32, "%34", "%32, %33")
MSA_WG_RS(wgmma_rs_n128_bf16, "bf16", "128", MSA_WG_ACC64, MSA_WG_OUT64, "{%64, %65, %66, %67}, %68")
MSA_WG_RS(wgmma_rs_n128_f16, "f16", "128", MSA_WG_ACC64, MSA_WG_OUT64, "{%64, %65, %66, %67}, %68")
MSA_WG_RS(wgmma_rs_n64_bf16, "bf16", "64", MSA_WG_ACC32, MSA_WG_OUT32, "{%32, %33, %34, %35}, %36")
MSA_WG_RS(wgmma_rs_n64_f16, "f16", "64", MSA_WG_ACC32, MSA_WG_OUT32, "{%32, %33, %34, %35}, %36")
#undef MSA_WG_SS
#undef MSA_WG_RS

// The pieces of one key-tile step that the dense (below) and the MSA prefill (msa_prefill_sm90.cuh) kernels share.
// Thread layout: each thread holds rows lane/4 and lane/4 + 8 of its warp's 16 (the wgmma accumulator layout,
// per warp the mma.sync m16n8 layout repeated over 8-column blocks); S has NS 8-key column blocks.

// S (64 x BN per warpgroup) = Q K^T. q_wg: the warpgroup's 64 rows of the swizzled [D/64][BM][64] Q tile; sK: the
// swizzled [D/64][BN][64] K tile. Commits one wgmma group. kStepAdd: each MMA's descriptor is the tile's plus a
// constant (wgmma_desc_add; the dense kernels), else built anew from the address (the MSA prefill kernels, whose
// schedule was measured faster that way: NOTES_msa v24).
template <typename T, int BM, int BN, int D, bool kStepAdd = true>
__device__ __forceinline__ void wg_qk(float* s, uint32_t q_wg, uint32_t sK) {
  // (The tiles' own descriptors only for kStepAdd; otherwise each MMA's is built from its address below.)
  const uint64_t dq = kStepAdd ? wgmma_desc(q_wg, 16, 1024) : 0, dk = kStepAdd ? wgmma_desc(sK, 16, 1024) : 0;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t koff = (kk % 4) * 32;  // 16 elements into the 128-byte row
    const uint32_t oq = (kk / 4) * BM * 128 + koff, ok = (kk / 4) * BN * 128 + koff;
    const uint64_t da = kStepAdd ? wgmma_desc_add(dq, oq) : wgmma_desc(q_wg + oq, 16, 1024);
    const uint64_t db = kStepAdd ? wgmma_desc_add(dk, ok) : wgmma_desc(sK + ok, 16, 1024);
    if constexpr (BN == 64) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) wgmma_ss_n64_bf16(s, da, db, kk > 0 ? 1 : 0);
      else wgmma_ss_n64_f16(s, da, db, kk > 0 ? 1 : 0);
    } else {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) wgmma_ss_n128_bf16(s, da, db, kk > 0 ? 1 : 0);
      else wgmma_ss_n128_f16(s, da, db, kk > 0 ? 1 : 0);
    }
  }
  wgmma_commit();
}

// O (64 x D per warpgroup) += P V. pf: P rounded to T in registers; sV: the V tile (K's layout, read MN-major).
// Commits one wgmma group. kStepAdd: as in wg_qk.
template <typename T, int BN, int D, bool kStepAdd = true>
__device__ __forceinline__ void wg_pv(float* o, const uint32_t (*pf)[4], uint32_t sV) {
  const uint64_t dv = kStepAdd ? wgmma_desc(sV, BN * 128, 1024) : 0;
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    const uint64_t db = kStepAdd ? wgmma_desc_add(dv, ks * 16 * 128) : wgmma_desc(sV + ks * 16 * 128, BN * 128, 1024);
    if constexpr (D == 256) {  // two N=128 halves: V's column blocks 2 and 3 lie 2 * BN * 128 bytes on
      const uint64_t db2 = wgmma_desc_add(db, 2 * BN * 128);
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        wgmma_rs_n128_bf16(o, pf[ks], db);
        wgmma_rs_n128_bf16(o + 64, pf[ks], db2);
      } else {
        wgmma_rs_n128_f16(o, pf[ks], db);
        wgmma_rs_n128_f16(o + 64, pf[ks], db2);
      }
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if constexpr (D == 128) wgmma_rs_n128_bf16(o, pf[ks], db);
      else wgmma_rs_n64_bf16(o, pf[ks], db);
    } else {
      if constexpr (D == 128) wgmma_rs_n128_f16(o, pf[ks], db);
      else wgmma_rs_n64_f16(o, pf[ks], db);
    }
  }
  wgmma_commit();
}

// m_new = max(m_new, sl2 * the row's largest raw score), for a tile every key of which both rows see (sl2 > 0).
template <int NS>
__device__ __forceinline__ void wg_raw_max(const float* s, float* m_new, float sl2) {
  float raw[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) raw[e / 2] = fmaxf(raw[e / 2], s[j * 4 + e]);
  m_new[0] = fmaxf(m_new[0], raw[0] * sl2);
  m_new[1] = fmaxf(m_new[1], raw[1] * sl2);
}

// The online-softmax step of one key tile for the thread's two rows, in log2 units (attention_kernel's), once the
// kernel has masked s and taken each row's max into m_new: the quad-wide max, the factors O must be rescaled by
// (corr), the exponentials (left in s) and the running max and sum. full: s holds raw scores, scaled here by sl2;
// otherwise s holds scaled, masked scores.
// The running max moves only when the tile's max exceeds it by more than `slack` (AttentionArgs'
// rescale_slack_log2; a row's first finite max always moves it from -inf): the exponentials are then at most
// 2^slack, which f32 sums and the bf16 / f16 P hold with the same relative precision, and O / l is the same
// quotient. Past a row's first tiles its max rarely rises that far, so corr stays 1 and wg_rescale_and_pack skips
// the rescale of O (fewer instructions per tile: under the H200's power cap, energy per tile sets the clock).
template <int NS>
__device__ __forceinline__ void wg_softmax_finish(float* s, float* m_new, float* m_run, float* l_run, float* corr,
                                                  bool full, float sl2, float slack) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 1));
    m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 2));
    const bool up = m_new[i] > m_run[i] + slack;  // false while both are -inf
    corr[i] = up ? fast_exp2(m_run[i] - m_new[i]) : 1.f;
    m_run[i] = up ? m_new[i] : m_run[i];
    l_run[i] *= corr[i];
  }
  const float neg_m[2] = {m_run[0] == -INFINITY ? 0.f : -m_run[0], m_run[1] == -INFINITY ? 0.f : -m_run[1]};
  const float mul = full ? sl2 : 1.f;  // masked tiles hold scaled scores already
#pragma unroll
  for (int j = 0; j < NS; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e / 2;
      s[j * 4 + e] = fast_exp2(fmaf(s[j * 4 + e], mul, neg_m[i]));
      l_run[i] += s[j * 4 + e];
    }
  }
}

// The dense kernels' online softmax of a 128-key (NS 16) or 64-key (NS 8) tile whose first key is tile_key0 (log2
// units; the exponentials stay in s). A key counts for row i when it lies in [row_lo[i], row_hi[i]) and its bit of
// `present` (the tile's keys that the page table maps) is set. A tile every key of which both rows see (all present,
// inside [full_lo, full_hi)) skips the per-key tests and scales its scores inside the exponential instead.
template <int NS>
__device__ __forceinline__ void wg_dense_softmax(float* s, const uint32_t* present, int tile_key0, int full_lo,
                                                 int full_hi, const int* row_lo, const int* row_hi, float* m_run,
                                                 float* l_run, float* corr, float sl2, float slack, int lane) {
  static_assert(NS == 8 || NS == 16, "64- or 128-key tiles: two or four 32-bit words of present keys");
  const uint32_t both = NS == 16 ? (present[0] & present[1] & present[2] & present[3]) : (present[0] & present[1]);
  const bool all = both == 0xffffffffu;
  const bool full = sl2 > 0.f && all && tile_key0 >= full_lo && tile_key0 + NS * 8 <= full_hi;
  float m_new[2] = {m_run[0], m_run[1]};
  if (full) {
    wg_raw_max<NS>(s, m_new, sl2);
  } else {
#pragma unroll
    for (int j = 0; j < NS; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        const int kl = j * 8 + (lane % 4) * 2 + (e % 2);
        const int key = tile_key0 + kl;
        const bool vis = key >= row_lo[i] && key < row_hi[i] && ((present[j / 4] >> (kl % 32)) & 1u);
        s[j * 4 + e] = vis ? s[j * 4 + e] * sl2 : -INFINITY;
        m_new[i] = fmaxf(m_new[i], s[j * 4 + e]);
      }
    }
  }
  wg_softmax_finish<NS>(s, m_new, m_run, l_run, corr, full, sl2, slack);
}

// Rescales O by corr (only when some row of the warp raised its running max: a warp-uniform branch) and rounds
// the exponentials in s to P, the A operand of wg_pv.
template <typename T, int NS, int ND>
__device__ __forceinline__ void wg_rescale_and_pack(float* o, const float* s, uint32_t (*pf)[4], const float* corr) {
  if (__any_sync(0xffffffff, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      o[j * 4 + 0] *= corr[0];
      o[j * 4 + 1] *= corr[0];
      o[j * 4 + 2] *= corr[1];
      o[j * 4 + 3] *= corr[1];
    }
  }
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    pf[j / 2][(j % 2) * 2 + 0] = Mma<T>::pack(s[j * 4 + 0], s[j * 4 + 1]);
    pf[j / 2][(j % 2) * 2 + 1] = Mma<T>::pack(s[j * 4 + 2], s[j * 4 + 3]);
  }
}

// Zeroes key rows [r0, BN) of a swizzled [D/64][BN][64] tile (the swizzle only permutes a row's chunks, so whole
// rows stay whole): the V rows of slots past a sequence's keys that a TMA box brought in. Every thread calls it.
template <int BN, int D, int kThreads>
__device__ __forceinline__ void zero_rows_sw128(unsigned char* tile, int r0, int tid) {
  for (int c = tid; c < (BN - r0) * (D / 8); c += kThreads)
    *reinterpret_cast<uint4*>(tile + sw128_offset<BN>(r0 + c / (D / 8), c % (D / 8))) = make_uint4(0, 0, 0, 0);
}

// The epilogue of a warp's two rows (warp_row0 + lane/4 and + 8 of the tile): the quad's row sums, then
// attention_kernel's store_row (the output, or the partition's partial and log2-sum-exp).
template <typename T, int D>
__device__ __forceinline__ void wg_store_rows(const AttentionArgs& a, const SeqTile& st, int rows_seq, int warp_row0,
                                              int hkv, int part, float* l_run, const float* m_run, const float* o,
                                              int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int pr = st.row0 + warp_row0 + lane / 4 + i * 8;
    if (pr >= rows_seq) continue;
    store_row<T, D>(a, st.q_base + pr / a.group, hkv * a.group + pr % a.group, part, l_run[i], m_run[i], &o[i * 2],
                    lane);
  }
}
#endif

// The epilogue of a warp's 16 rows through shared memory, in two steps. wg_stage_rows: the rows, normalized and
// packed, go into the warp's `stage`: per 64 columns, 16 rows of 128 bytes with the 16-byte chunks XOR-swizzled
// by the row (no bank conflicts on either side), the D/64 column halves half_stride bytes apart. Unsplit calls
// only (store_row's first branch). The caller owns `stage` for the warp (no other warp touches it) until
// warp_store_staged, after a __syncwarp, has read it back.
template <typename T, int D>
__device__ __forceinline__ void wg_stage_rows(const AttentionArgs& a, const SeqTile& st, int rows_seq, int warp_row0,
                                              int hkv, float* l_run, const float* m_run, const float* o, int lane,
                                              unsigned char* stage, int half_stride) {
  // The lane's offsets into `stage` are formed here, at each call: laundered, the lane keeps the compiler from
  // hoisting them out of the caller's loops into registers (which spilled).
  asm volatile("" : "+r"(lane));
  using M = Mma<T>;
  static_assert(D % 64 == 0, "64-column halves");
  constexpr int ND = D / 8;
  const T* sink = static_cast<const T*>(a.sink);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 2);
    const int r = lane / 4 + i * 8;  // row within the warp's 16
    const int pr = st.row0 + warp_row0 + r;
    const bool any = l_run[i] > 0.f;
    float den = l_run[i];
    if (sink != nullptr && any && pr < rows_seq)
      den += sink_term(sink, hkv * a.group + pr % a.group, m_run[i]);
    const float inv = any ? 1.f / den : 0.f;
#pragma unroll
    for (int j = 0; j < ND; ++j)
      *reinterpret_cast<uint32_t*>(stage + (j / 8) * half_stride + r * 128 + (((j % 8) ^ (r % 8)) * 16) +
                                   (lane % 4) * 4) = M::pack(o[i * 2 + j * 4] * inv, o[i * 2 + j * 4 + 1] * inv);
  }
}

// The warp's staged rows (wg_stage_rows) to the output, 16 bytes per lane: each warp store writes whole rows.
// Rows past rows_seq are not written.
template <typename T, int D>
__device__ __forceinline__ void warp_store_staged(const AttentionArgs& a, const SeqTile& st, int rows_seq,
                                                  int warp_row0, int hkv, int lane, const unsigned char* stage,
                                                  int half_stride) {
  asm volatile("" : "+r"(lane));
  // All of the lane's chunks are read first, and each row's address follows from the previous one's (no
  // division per row), so that the stores do not wait on one another.
  constexpr int kChunks = D / 8;      // 16-byte chunks per row
  constexpr int kRows = 32 / kChunks;  // rows per warp store
  constexpr int kSteps = 16 / kRows;
  const int c = lane % kChunks;
  uint4 v[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int r = k * kRows + lane / kChunks;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"  // volatile: kept ahead of the stores
                 : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                 : "r"(smem_addr(stage + (c / 8) * half_stride + r * 128 + (((c % 8) ^ (r % 8)) * 16))));
  }
  const int group = a.group;
  int pr = st.row0 + warp_row0 + lane / kChunks;
  int tok = pr / group;
  int hh = pr - tok * group;
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(st.q_base) * a.H + hkv * group) * D + c * 8;
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    // One predicated 16-byte store (as C++, the uint4 store was split into four and put behind a branch).
    asm volatile(
        "{\n.reg .pred p;\nsetp.lt.s32 p, %5, %6;\n@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(
            out + (static_cast<int64_t>(tok) * a.H + hh) * D),
        "r"(v[k].x), "r"(v[k].y), "r"(v[k].z), "r"(v[k].w), "r"(pr), "r"(rows_seq)
        : "memory");
    pr += kRows;
    hh += kRows;
#pragma unroll
    for (int t = 0; t < kRows; ++t)  // group >= 1: at most kRows token steps
      if (hh >= group) {
        hh -= group;
        ++tok;
      }
  }
}

// Both steps: the warp's 16 rows of an unsplit call to the output through its `stage` (the warp's own rows of a
// finished Q tile: BM rows of 128 bytes per 64 columns), the __syncwarp between them included.
template <typename T, int D, int BM>
__device__ __forceinline__ void wg_store_rows_staged(const AttentionArgs& a, const SeqTile& st, int rows_seq,
                                                     int warp_row0, int hkv, float* l_run, const float* m_run,
                                                     const float* o, int lane, unsigned char* stage) {
  wg_stage_rows<T, D>(a, st, rows_seq, warp_row0, hkv, l_run, m_run, o, lane, stage, BM * 128);
  __syncwarp();
  warp_store_staged<T, D>(a, st, rows_seq, warp_row0, hkv, lane, stage, BM * 128);
}

// The layer of paged K/V that a TMA loader reads: *a.layer_ptr, or 0 with every page reading as missing (layer_ok
// false) when it names no layer of the pool; 0 for contiguous K/V.
__device__ __forceinline__ int tma_kv_layer(const AttentionArgs& a, bool* layer_ok) {
  int layer = 0;
  *layer_ok = true;
  if (a.kv_mode == kKvPaged) {
    layer = *a.layer_ptr;
    *layer_ok = layer >= 0 && layer < a.num_layers;
    if (!*layer_ok) layer = 0;
  }
  return layer;
}

// Lane i < nbox: the page-table entry of box i (rb key rows: one page, or a whole tile) of key tile `tile` (BN keys)
// of the sequence whose page-table row is lut_row; -1 past the keys, for contiguous K/V or a missing layer. Unchecked:
// the range check waits for the load, so it runs where the entry is used (pool_page), an iteration later.
template <int BN>
__device__ __forceinline__ int32_t box_page_entry(const AttentionArgs& a, bool paged, const int32_t* lut_row, int tile,
                                                  int lane, int nbox, int rb, int kmax, bool layer_ok) {
  int32_t e = -1;
  if (paged && lane < nbox) {
    const uint32_t key = static_cast<uint32_t>(tile) * BN + lane * rb;  // (unsigned: see fetch_pages, attention.cuh)
    if (key < static_cast<uint32_t>(kmax) && layer_ok) e = __ldg(lut_row + (key >> a.page_shift));
  }
  return e;
}

// One warp: the present-key mask of the BN keys from key0 (bit kl of word w: key key0 + 32 w + kl lies below kmax, in
// a box whose page exists; page: lane i's pool page of box i, rb = 1 << rb_shift key rows a box), lane 0 writing the
// BN / 32 words to mask slot ms (words [4 ms, 4 ms + BN / 32) of sMask). The loaders of the CTA-per-tile and the
// persistent kernels run it ahead of each tile's loads, so it stays short (attention_sm90_kernel says why).
template <int BN>
__device__ __forceinline__ void write_present_mask(uint32_t* sMask, int ms, bool paged, int lane, int nbox,
                                                   int rb_shift, int key0, int kmax, int page) {
  const unsigned boxes = paged ? __ballot_sync(0xffffffff, lane < nbox && page >= 0) : 0xffffffffu;
#pragma unroll
  for (int w = 0; w < BN / 32; ++w) {
    const int kl = w * 32 + lane;
    const bool ok = key0 + kl < kmax && ((boxes >> (kl >> rb_shift)) & 1u);
    const unsigned bits = __ballot_sync(0xffffffff, ok);
    if (lane == 0) sMask[ms * 4 + w] = bits;
  }
}

#if defined(MSA_OPS_SM90_WGMMA)
// One warp: column blocks h0 .. h0 + NB - 1 (64 columns each) of the K or V tile of kv head hkv from key0, block i
// into dst + i BN 128 (a [BN][64] block each), against mbarrier bar; map: kvm.k or kvm.v, layer_slot: the layer's
// index in the map's layer axis (V's layers follow K's). Paged, lane i < nbox loads its box i (rb key rows of pool
// page `page`; past the pool, TMA writes zeros); contiguous, lane 0 the whole tile (rows past the tensor: zeros).
template <int NB, int BN>
__device__ __forceinline__ void tma_load_kv_blocks(const AttentionArgs& a, bool paged, uint32_t dst,
                                                   const CUtensorMap* map, uint32_t bar, int h0, int hkv, int lane,
                                                   int nbox, int rb, int key0, int page, int layer_slot,
                                                   int64_t kv_base) {
  if (paged) {
    if (lane < nbox) {
      const int slot = key0 & (a.page_size - 1);  // the tile's first slot in its page (0 when pages are shorter)
      const int blk = page >= 0 ? page : a.num_blocks;
      for (int h = h0; h < h0 + NB; ++h)
        tma_load_5d(dst + (h - h0) * BN * 128 + lane * rb * 128, map, bar, h * 64, hkv, slot, layer_slot, blk);
    }
  } else if (lane == 0) {
    for (int h = h0; h < h0 + NB; ++h) tma_load_3d(dst + (h - h0) * BN * 128, map, bar, h * 64, hkv, kv_base + key0);
  }
}
#endif

template <typename T, int D>
__global__ void __launch_bounds__(256, 1) attention_sm90_kernel(const AttentionArgs a, const __grid_constant__ Sm90Kv kvm) {
#if defined(MSA_OPS_SM90_WGMMA)
  using Cfg = Sm90Config<T, D>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, STAGES = Cfg::kStages;
  constexpr int NS = BN / 8;  // 8-key column blocks of S per thread row pair
  constexpr int ND = D / 8;   // 8-wide output column blocks
  extern __shared__ unsigned char smem_raw[];
  // Swizzle atoms are 1024-byte aligned: round the dynamic shared memory base up.
  unsigned char* sbase;
  const uint32_t sQ = smem_align_1024(smem_raw, &sbase);
  const uint32_t sKV = sQ + Cfg::kQBytes;  // stage s: K at sKV + 2 s kKvTileBytes, V kKvTileBytes after it
  uint32_t* sMask = reinterpret_cast<uint32_t*>(sbase + Cfg::kQBytes + STAGES * 2 * Cfg::kKvTileBytes);
  const uint32_t sBar = smem_addr(sMask + STAGES * 4);  // stage s's mbarrier at sBar + 8 s

  const SeqTile st = locate_tile<BM>(a, static_cast<int>(gridDim.x - 1 - blockIdx.x));  // heaviest first
  if (st.b < 0) return;
  const int hkv = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int wg = tid / 128;
  const int warp_row0 = wg * 64 + ((tid / 32) % 4) * 16;  // first tile row of this warp
  const int group = a.group;
  const T* q = static_cast<const T*>(a.q);

  const TileKeys tk = tile_keys<BM, BN>(a, st, part);
  const int rows_seq = tk.rows_seq;
  const int64_t k_lo = tk.k_lo, k_hi = tk.k_hi;
  const int tile_first = tk.tile_first, num_tiles = tk.num_tiles;

  if (tid == 0) mbar_init_stages(sBar, STAGES);
  // ---- Q (zero rows past the sequence) into the swizzled [D/64][BM][64] tile
  constexpr int CPR = Cfg::kChunksPerRow;
  for (int c = tid; c < BM * CPR; c += Cfg::kThreads) {
    const int r = c / CPR, ch = c % CPR;
    const int pr = st.row0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (pr < rows_seq) {
      const int64_t qrow = st.q_base + pr / group;
      const int h = hkv * group + pr % group;
      val = *reinterpret_cast<const uint4*>(q + (qrow * a.H + h) * D + ch * 8);
    }
    *reinterpret_cast<uint4*>(sbase + sw128_offset<BM>(r, ch)) = val;
  }
  __syncthreads();  // the mbarriers are initialized before anyone waits on them

  // ---- K/V tiles by TMA, issued by warps 0-3. Paged: box i of a tile holds key rows [i rb, (i+1) rb), one page
  // each; lane i of each of these warps fetches box i's page id a tile ahead and issues that box's loads.
  const bool paged = a.kv_mode == kKvPaged;
  const int32_t* lut_row = paged ? a.lookup + static_cast<int64_t>(st.b) * a.max_pages : nullptr;
  bool layer_ok = true;
  const int layer = tma_kv_layer(a, &layer_ok);
  const int kmax = static_cast<int>(st.kmax);
  const int rb = kvm.box_rows;
  const int nbox = BN / rb;
  // Warps 0-3: lane i < nbox gets the page-table entry of box i of `tile`, checked where issue_tile uses it (checked
  // here, the load's latency stalled warp 0, ahead of its warpgroup's MMAs, on every tile).
  auto fetch_page = [&](int tile) {
    return box_page_entry<BN>(a, paged, lut_row, tile, lane, nbox, rb, kmax, layer_ok);
  };
  // Warpgroup 0 runs this ahead of its MMAs on every tile, so it is kept short: a box's presence comes from
  // one ballot, a key's box from a shift (rb is a power of two), and lane i issues box i's loads itself. With a
  // division and a shuffle per mask word here, paged K/V ran at 0.78x of contiguous at S=8k on the H200; 0.99x
  // without (ncu: its warpgroup's MMAs waited on warp 0, and every load left later).
  const int rb_shift = __ffs(rb) - 1;
  // Warp 0: the present-key mask of the tile from key0 into mask slot `ms`; page: lane i's pool page of box i.
  auto write_mask = [&](int key0, int page, int ms) {
    write_present_mask<BN>(sMask, ms, paged, lane, nbox, rb_shift, key0, kmax, page);
  };
  // One warp: column block h of the K or V tile (map: kvm.k or kvm.v) from key0 into dst, against mbarrier bar.
  auto load_block = [&](uint32_t dst, const CUtensorMap* map, bool is_v, int h, int key0, int page, uint32_t bar) {
    tma_load_kv_blocks<1, BN>(a, paged, dst, map, bar, h, hkv, lane, nbox, rb, key0, page,
                              (is_v ? a.num_layers : 0) + layer, st.kv_base);
  };
  // The warps of warpgroup 0 share the issue: warp w loads half w / 2 of K (w even) or V (w odd), lane i its box
  // i, so no warp issues more than one copy per box (warp 0 alone issued four). Warp 0 also writes the mask and
  // the expected bytes. Every one of these warps reads the tile's page entries (lane i: box i).
  auto issue_tile = [&](int tile, int stage, int32_t entry) {  // warps 0-3
    const int my_page = pool_page(a, entry);
    const int w4 = tid >> 5;
    const uint32_t bar = sBar + 8 * stage;
    const uint32_t sK = sKV + stage * 2 * Cfg::kKvTileBytes;
    const int key0 = tile * BN;
    if (w4 == 0) {
      write_mask(key0, my_page, stage);
      // Before or after the other warps' copies complete: the phase needs this arrival either way.
      if (lane == 0) mbar_expect_tx(bar, 2 * Cfg::kKvTileBytes);
    }
    const int h = w4 >> 1;
    const bool is_v = (w4 & 1) != 0;
    if (h < D / 64)
      load_block(sK + (is_v ? Cfg::kKvTileBytes : 0) + h * BN * 128, is_v ? &kvm.v : &kvm.k, is_v, h, key0, my_page,
                 bar);
  };

  // Split rings (head dim 256): group g = K of tile g (K slot g % 2) with V of tile g - 1 (V slot (g - 1) % 2), one
  // mbarrier per group slot g % 2; entry_k / entry_v: lane i's page-table entry of box i of each tile. Iteration it
  // waits for group it (its K, and the V its P V reads) and then issues group it + 1 into the K slot of tile it - 1
  // (its Q K^T done) and the V slot of tile it - 2 (its P V done): a tile's lead for both, as the shared ring's three
  // stages give. Warps 0-3: warp w issues K (w even) or V (w odd) column blocks w / 2 and w / 2 + 2.
  auto issue_group = [&](int g, int32_t entry_k, int32_t entry_v) {
    const bool has_k = g < num_tiles, has_v = g >= 1;
    const int w4 = tid >> 5;
    const uint32_t bar = sBar + 8 * (g & 1);
    const int key0k = (tile_first + g) * BN, key0v = (tile_first + g - 1) * BN;
    const int page_k = pool_page(a, entry_k), page_v = pool_page(a, entry_v);
    if (w4 == 0) {
      if (has_k) write_mask(key0k, page_k, g & 1);
      if (lane == 0) mbar_expect_tx(bar, (has_k ? Cfg::kKvTileBytes : 0) + (has_v ? Cfg::kKvTileBytes : 0));
    }
    const bool is_v = (w4 & 1) != 0;
    if (is_v ? has_v : has_k) {
      const int key0 = is_v ? key0v : key0k;
      const int page = is_v ? page_v : page_k;
      const uint32_t dst0 = sKV + (is_v ? (2 + ((g - 1) & 1)) : (g & 1)) * Cfg::kKvTileBytes;
      const CUtensorMap* map = is_v ? &kvm.v : &kvm.k;
#pragma unroll
      for (int h = w4 >> 1; h < D / 64; h += 2) load_block(dst0 + h * BN * 128, map, is_v, h, key0, page, bar);
    }
  };

  int page_next = -1;
  int page_cur = -1;  // split rings: the entry of the K tile issued last (its V goes out with the next group)
  if (num_tiles > 0 && tid < 128) {
    if constexpr (Cfg::kSplitRings) {
      page_cur = fetch_page(tile_first);
      issue_group(0, page_cur, -1);
    } else {
      issue_tile(tile_first, 0, fetch_page(tile_first));
    }
    page_next = fetch_page(tile_first + 1);
  }

  // Per-thread state: rows warp_row0 + lane/4 and + 8.
  float o[ND * 4];
#pragma unroll
  for (int i = 0; i < ND * 4; ++i) o[i] = 0.f;
  float m_run[2], l_run[2];
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
    const RowKeys rk = row_keys(a, st, group, rows_seq, k_lo, k_hi, st.row0 + warp_row0 + lane / 4 + i * 8);
    row_lo[i] = rk.lo;
    row_hi[i] = rk.hi;
  }
  const RowKeys full = full_keys(tk);
  const int full_lo = full.lo, full_hi = full.hi;
  const float sl2 = a.scale_log2;
  const uint32_t q_wg = sQ + wg * 64 * 128;  // this warpgroup's 64 rows in each 64-column block

  // Software pipeline over key tiles: iteration `it` issues S_it = Q K_it^T and O += P_{it-1} V_{it-1} together,
  // runs the softmax of S_it while the tensor cores do P V, then rescales O and rounds S_it to P_it. The load of
  // tile it+1 is issued right after iteration it's barrier (every warp is done with the stage it reuses, tile
  // it-2's), and it lands before iteration it+1 reads it: three stages. Every wgmma is issued and waited on
  // in one straight-line block (a wgmma under a data-dependent branch would make ptxas serialize them all).
  float s[NS * 4];
  uint32_t pf[BN / 16][4];
  float corr[2];
  // The ring's hooks. Shared ring (D <= 128): stage it % STAGES holds K and V of tile it. Split rings (D = 256): K of
  // tile it in K slot it % 2, V in V slot it % 2, landed with group it and group it + 1 (issue_group).
  auto k_slot = [&](int it) {
    return Cfg::kSplitRings ? sKV + (it & 1) * Cfg::kKvTileBytes : sKV + (it % STAGES) * 2 * Cfg::kKvTileBytes;
  };
  auto v_slot = [&](int it) {
    return Cfg::kSplitRings ? sKV + (2 + (it & 1)) * Cfg::kKvTileBytes : k_slot(it) + Cfg::kKvTileBytes;
  };
  // Stage (group) `it` has landed, and every warp is done with iteration it - 1.
  auto ready = [&](int it) {
    if constexpr (Cfg::kSplitRings) mbar_wait(sBar + 8 * (it & 1), (it >> 1) & 1);  // two group slots
    else mbar_wait(sBar + 8 * (it % STAGES), (it / STAGES) & 1);
    fence_proxy_async();  // this thread's Q stores and V zeroing are read next by the tensor cores
    __syncthreads();
  };
  // The next loads, issued before iteration it's MMAs: with the cp.async loader that measured 5% faster on the H200
  // than after them (381 against 361 TFLOP/s at S=8k), with TMA 10% (504 against 450). Shared ring: tile it+1 (into
  // the stage tile it-2 used). Split rings: group it + 1, K of tile it + 1 (if any) and V of tile it.
  auto load_next = [&](int it) {
    if constexpr (Cfg::kSplitRings) {
      if (tid < 128) {
        issue_group(it + 1, it + 1 < num_tiles ? page_next : -1, page_cur);
        page_cur = page_next;
        page_next = fetch_page(tile_first + it + 2);
      }
    } else if (tid < 128 && it + 1 < num_tiles) {
      issue_tile(tile_first + it + 1, (it + 1) % STAGES, page_next);
      page_next = fetch_page(tile_first + it + 2);
    }
  };
  // V rows of keys past the sequence that tile j's boxes brought in (the sequence's last tile): zero. r0 < 0: a tile
  // wholly past the keys (a window past a cache that overflows its page table).
  auto zero_tail = [&](int j) {
    const int r0 = kmax - (tile_first + j) * BN;
    if (r0 < BN) zero_rows_sw128<BN, D, Cfg::kThreads>(sbase + (v_slot(j) - sQ), max(r0, 0), tid);
  };
  // Split rings: tile j's V rows past the keys zeroed and fenced before this iteration's P V reads them (a barrier
  // of its own, on that tile only; CTA-uniform).
  auto zero_prev = [&](int j) {
    if (kmax - (tile_first + j) * BN < BN) {
      zero_tail(j);
      fence_proxy_async();
      __syncthreads();
    }
  };
  // Iteration it's start (first: it == 0): its tile ready, the next loads out, V rows past the keys zeroed. Shared
  // ring: tile it's own V, seen by the tensor cores after the next ready's fence and barrier. Split rings: tile
  // it - 1's V, which landed with group it and is read in this iteration.
  auto begin = [&](int it, bool first) {
    ready(it);
    load_next(it);
    if constexpr (Cfg::kSplitRings) {
      if (!first) zero_prev(it - 1);
    } else {
      zero_tail(it);
    }
  };
  // After the last tile's step: its V (split rings: the last group, V alone) ready for every warp's P V.
  auto end = [&]() {
    if constexpr (Cfg::kSplitRings) {
      ready(num_tiles);
      zero_prev(num_tiles - 1);
    } else {
      fence_proxy_async();  // the last tile's zeroed V rows, for every warp's P V
      __syncthreads();
    }
  };
  auto issue_qk = [&](int it) { wg_qk<T, BM, BN, D>(s, q_wg, k_slot(it)); };
  auto issue_pv = [&](int it) { wg_pv<T, BN, D>(o, pf, v_slot(it)); };
  // Online softmax of tile `it` (wg_dense_softmax); the exponentials stay in s.
  auto softmax = [&](int it) {
    const uint32_t* vm = sMask + (it % STAGES) * 4;
    uint32_t present[BN / 32];
#pragma unroll
    for (int w = 0; w < BN / 32; ++w) present[w] = vm[w];
    wg_dense_softmax<NS>(s, present, (tile_first + it) * BN, full_lo, full_hi, row_lo, row_hi, m_run, l_run, corr,
                         sl2, a.rescale_slack_log2, lane);
  };
  auto rescale_and_pack = [&]() { wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr); };

  if (num_tiles > 0) {
    begin(0, true);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs<NS * 4>(s);
    softmax(0);
    rescale_and_pack();
    for (int it = 1; it < num_tiles; ++it) {
      begin(it, false);
      fence_regs<ND * 4>(o);
      wgmma_fence();
      issue_qk(it);
      issue_pv(it - 1);
      wgmma_wait<1>();
      fence_regs<NS * 4>(s);
      softmax(it);
      wgmma_wait<0>();
      fence_regs<ND * 4>(o);
      rescale_and_pack();
    }
    end();
    fence_regs<ND * 4>(o);
    wgmma_fence();
    issue_pv(num_tiles - 1);
    wgmma_wait<0>();
    fence_regs<ND * 4>(o);
  }

  if (a.num_partitions <= 1) {  // the warp's rows leave through its own rows of the Q tile (the MSA kernel's way)
    wg_store_rows_staged<T, D, BM>(a, st, rows_seq, warp_row0, hkv, l_run, m_run, o, lane, sbase + warp_row0 * 128);
  } else {
    wg_store_rows<T, D>(a, st, rows_seq, warp_row0, hkv, part, l_run, m_run, o, lane);
  }
#else
  __trap();  // launched only on sm_90 (see launch_attention)
#endif
}

}  // namespace cuda
}  // namespace msa_ops
