// CUDA handler of mo.msa.attention.ragged.paged (MiniMax Sparse Attention, SEMANTICS.md §7).
//
// One CTA = one query token, one kv head, one block of 16 query heads of its group, one split-K partition of
// the token's top-k slots. The CTA compacts its slots into a list of key tiles (valid, first occurrence, inside
// the sequence, at or before the token's position) and streams them through a cp.async ring into swizzled
// shared memory and mma.sync, with the four warps splitting each tile's keys (KvTraits below). FP8 (e4m3) runs
// Q.K^T on the e4m3 MMA as loaded and widens V in registers for the f16 P.V MMA; softmax and accumulation are
// f32, output bf16. On sm_90a, fp8 with at most 8 heads per kv head runs Q.K^T on the warpgroup MMA instead
// (wgmma e4m3, K and Q read from shared memory as loaded; kWg in the kernel). Rows owned by no sequence are
// zeroed by the kernel itself when the call is unsplit.
// Split-K partials merge in split_k_combine_kernel (attention.cuh), which also zeroes padding rows.
// This kernel serves decode, speculative decode, and the prefill calls the block-reusing kernel does not take:
// bf16 prefill with one partition on compute capability 9.0 runs msa_prefill_sm90_kernel, which reads each
// selected block once per 128-row query tile instead of once per token.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "attention.cuh"
#include "msa_prefill_sm90.cuh"
#include "msa_prefill_ws_sm90.cuh"
#include "msa_ops/checks.h"
#include "msa_ops/common.h"
#include "msa_ops/ffi.h"
#include "msa_ops/ffi_signatures.h"

namespace msa_ops {
namespace cuda {
namespace {

constexpr int kD = 128;       // MSA head dim
constexpr int kBlock = 128;   // keys per selected block (one page)
constexpr int kWarps = 4;     // they split each tile's keys and merge at the end
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;
// The decode kernel with a loader warp (kProd, groups of at most 8 heads, partitions not merged in a cluster): a
// fifth warp issues every K/V tile copy, kProdAhead tiles in flight, the next one issued as soon as the oldest
// lands, into a ring of kProdStages stages that the four compute warps hand back through mbarriers; so the copies
// no longer wait for the compute warps to finish the tile before (NOTES_msa v47). The copies themselves arrive on
// their stage's mbarrier as they land (v49). MSA_OPS_MSA_LOADER_WARP=0 turns it off (read once per process).
constexpr int kProdStages = 4;
constexpr int kProdAhead = 2;
constexpr int kProdThreads = kThreads + 32;  // the loader warp is warp kWarps
constexpr int kMaxTopk = 256;  // slots one CTA compacts in shared memory (larger topk: reference)
// Page tables of at most this many entries a sequence (128k keys) are read whole at the CTA's start (4 KB).
constexpr int kMaxLutRow = 1024;

struct MsaArgs {
  const void* q;  // [T, H, 128]
  __nv_bfloat16* out;
  const int32_t* offsets;
  const int32_t* cache_lengths;
  const void* kv;  // [NB, 2, L, 128, Hkv, 128]
  const int32_t* lookup;
  const int32_t* layer_ptr;
  const int32_t* d_indices;  // [Hkv, T, topk]
  int T, B, H, Hkv, group, topk;
  int num_blocks, num_layers, max_pages;
  float scale_log2;
  int num_partitions;
  int max_q;  // the plan's bound on one sequence's query tokens (its route)
  float* ws_o;
  float* ws_lse;
  // The loader-warp kernel on compute capability 9.0: the pool as a 5-D tensor map (dims, kv heads, slots, K then V
  // layers, pages; 128-byte swizzle; fp8: one box = a whole block's 128 rows of one kv head, bf16: 64 dims x 64 rows)
  // that the loader reads whole tiles through (TMA), kv_tma set; otherwise every tile by cp.async.
  CUtensorMap kv_map;
  int kv_tma;
};

// Work sharing's accesses to the shared memory of another cluster CTA, at a shared::cluster address (cluster_addr,
// attention.cuh; sm_90+, a trap or no-op before), beside attention.cuh's ld_cluster_u4: a 32-bit load, a 128-bit
// store, and the atomic, relaxed at cluster scope so that the owner's and the other members' claims on one word are
// atomic with each other.
__device__ __forceinline__ uint32_t atom_add_cluster(uint32_t raddr, uint32_t v) {
  uint32_t old = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("atom.relaxed.cluster.shared::cluster.add.u32 %0, [%1], %2;\n" : "=r"(old) : "r"(raddr), "r"(v) : "memory");
#else
  __trap();  // (the launch takes the sharing kernel only where its code was compiled for 9.0+)
#endif
  return old;
}
__device__ __forceinline__ uint32_t ld_relaxed_cluster_u32(uint32_t raddr) {
  uint32_t v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.relaxed.cluster.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(raddr) : "memory");
#endif
  return v;
}
__device__ __forceinline__ void st_cluster_u4(uint32_t raddr, uint4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(raddr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
#endif
}
__device__ __forceinline__ uint4 f4_bits(float a, float b, float c, float d) {
  return make_uint4(__float_as_uint(a), __float_as_uint(b), __float_as_uint(c), __float_as_uint(d));
}

// Sequence owning row t (attention.cuh's row_owner). Whole-warp call.
__device__ __forceinline__ int owner_of(const MsaArgs& a, int t, int64_t* eff_b, int64_t* eff_b1) {
  return row_owner(a.offsets, a.B, a.T, t, eff_b, eff_b1);
}

// Per KV dtype: the bytes of one key row, the keys per ring tile (split over the kWarps warps), and the MMA of
// Q.K^T. Both tiles are 32 KB of K + V per stage, so the ring holds the same bytes in flight for both dtypes.
// (On the H200, fp8 with 8 warps or 6 stages measured no faster; NOTES_msa.md.)
//   bf16: 64-key tiles (16 keys per warp); Q.K^T and P.V on the bf16 m16n8k16 MMA.
//   fp8:  128-key tiles (a whole block, 32 keys per warp); Q.K^T on the e4m3 m16n8k32 MMA straight from the
//         loaded tile (q is e4m3 too; on sm_90 ptxas widens both operands to f16 per MMA; the transposed form
//         on sm_90a uses wgmma instead, which takes e4m3 natively), P.V on the f16 m16n8k16 MMA with V widened
//         in registers (e4m3 -> f16 is exact): ldmatrix .trans hands each lane two keys of one pair of adjacent
//         columns, a byte permute splits the pair, and the even and odd columns run as two MMAs whose output
//         columns are interleaved (col_of below).
// Two e4m3 values (the low 16 bits) -> f16x2, the low byte in the low half (exact).
__device__ __forceinline__ uint32_t pair_to_f16x2(uint32_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

template <typename KV>
struct KvTraits;
template <>
struct KvTraits<__nv_bfloat16> {
  static constexpr int kRowBytes = kD * 2;
  static constexpr int kBN = 64;
  using Pv = __nv_bfloat16;  // P.V MMA operand type
  static __device__ __forceinline__ void qk(float* c, const uint32_t* a, const uint32_t* b) {
    Mma<__nv_bfloat16>::run(c, a, b);
  }
  // D column of accumulator element e (0/1: the pair in one register row) of output tile j, for this lane.
  static __device__ __forceinline__ int col_of(int j, int lane, int e) { return j * 8 + (lane % 4) * 2 + e; }
};
template <>
struct KvTraits<__nv_fp8_e4m3> {
  static constexpr int kRowBytes = kD;
  static constexpr int kBN = 128;
  using Pv = __half;
  static __device__ __forceinline__ void qk(float* c, const uint32_t* a, const uint32_t* b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // No e4m3 MMA before sm_89: the same 32 products as two f16 MMAs over widened fragments. A register holds 4
    // consecutive k; its low and high pairs take the k16 MMA's (2t, 2t+1) and (2t+8, 2t+9) positions, the same
    // permutation of k for both operands.
    auto lo = [](uint32_t x) { return pair_to_f16x2(x & 0xffffu); };
    auto hi = [](uint32_t x) { return pair_to_f16x2(x >> 16); };
    for (int h = 0; h < 2; ++h) {
      const uint32_t af[4] = {lo(a[2 * h]), lo(a[2 * h + 1]), hi(a[2 * h]), hi(a[2 * h + 1])};
      const uint32_t bf[2] = {lo(b[h]), hi(b[h])};
      Mma<__half>::run(c, af, bf);
    }
#endif
  }
  // Tile j = 2 * chunk + parity covers columns 16 * chunk + 2 * n + parity, n = 0..7.
  static __device__ __forceinline__ int col_of(int j, int lane, int e) {
    return (j / 2) * 16 + (lane % 4) * 4 + e * 2 + (j % 2);
  }
};

// Two e4m3 keys x two adjacent columns (bytes: key a col 2c, key a col 2c+1, key b col 2c, key b col 2c+1, as
// ldmatrix .trans delivers them) -> f16x2 {a, b} of column 2c and of column 2c+1.
__device__ __forceinline__ void widen_key_pair(uint32_t r, uint32_t* even, uint32_t* odd) {
  const uint32_t x = __byte_perm(r, 0, 0x3120);  // bytes: a.2c, b.2c, a.2c+1, b.2c+1
  *even = pair_to_f16x2(x & 0xffffu);
  *odd = pair_to_f16x2(x >> 16);
}

// Byte offset of 16-byte chunk ch of row r in a tile of kRowBytes rows, XOR-swizzled for ldmatrix.
template <int kRowBytes>
__device__ __forceinline__ int swz(int r, int ch) {
  return r * kRowBytes + ((ch ^ (r & 7)) << 4);
}

// Work sharing in the loader-warp kernel (kShare): the CTAs of up to kMaxShare consecutive tokens of one kv head form
// a cluster and take key tiles from each other's lists at run time (see the kernel).
constexpr int kMaxShare = 4;
// A victim must have at least this many tiles nobody has claimed yet for a member to take one from it: its last tile
// taken from it would end no sooner at the taker, which still has its own tiles in flight.
constexpr int kMinSteal = 2;

template <typename KV, int kRing = kStages, bool kShare = false>
struct MsaSmem {
  static constexpr int kRowBytes = KvTraits<KV>::kRowBytes;
  static constexpr int kStageBytes = 2 * KvTraits<KV>::kBN * kRowBytes;  // K + V tile
  static constexpr int kQBytes = 16 * kRowBytes;
  // key0[2*topk], page[2*topk], ids[topk], count and the sequence's cache length and layer (64 bytes), then the
  // loader warp's mbarriers (full and empty per stage, 8 bytes each)
  static constexpr int kBarOff = kQBytes + 5 * kMaxTopk * 4 + 64;
  static constexpr int kListBytes = kBarOff - kQBytes + 2 * kRing * 8;
  // The page-table row of the sequence the CTA guesses it serves (kMaxLutRow entries; see the kernel's start).
  static constexpr int kLutBytes = kMaxLutRow * 4;
  static constexpr int kMergeBytes = kWarps * (16 * kD + 32) * 4;
  static constexpr int kMain = kRing * kStageBytes;
  // fp8, and the loader-warp kernel of either dtype: the ring starts on a 1024-byte boundary of a 1024-aligned base
  // (the 128-byte swizzle atoms that the sm_90a warpgroup MMA reads K and Q as, and that TMA writes tiles in),
  // hence the padding and the extra 1024 bytes for aligning the base.
  static constexpr int kAlign = sizeof(KV) == 1 || kRing == kProdStages ? 1024 : 1;
  static constexpr int kRingOff = (kQBytes + kListBytes + kLutBytes + kAlign - 1) / kAlign * kAlign;
  static constexpr int kEnd = kRingOff + (kMain > kMergeBytes ? kMain : kMergeBytes);
  // Work sharing (kShare), after the ring: per cluster rank, a copy of that CTA's Q (for the tiles taken from it;
  // 1024-aligned like Q, the warpgroup MMA reads it as loaded) and the slot that this CTA's partial of that CTA's
  // unit lands in, in the owner's memory ([8][kD] unnormalized sums, then [8] (m, l)); the compute warps' merge
  // scratch ([warps][8][kShareMS] + [warps][8][2]); then ints: the claim word (owner's tiles claimed from the
  // front << 16 | tiles claimed from the back), the tile count, each rank's (p, kmax), each stage's (key0, unit).
  static constexpr int kShareMS = kD + 4;
  static constexpr int kSlotFloats = 8 * kD + 16;
  static constexpr int kScrFloats = kWarps * 8 * kShareMS + kWarps * 16;
  static constexpr int kShareOff = (kEnd + 1023) / 1024 * 1024;
  static constexpr int kSlotsOff = kShareOff + kMaxShare * kQBytes;
  static constexpr int kScrOff = kSlotsOff + kMaxShare * kSlotFloats * 4;
  static constexpr int kShIntOff = kScrOff + kScrFloats * 4;
  static constexpr int kShInts = 2 + 2 * kMaxShare + 2 * kRing;
  static constexpr int kShareEnd = kShIntOff + kShInts * 4;
  static constexpr int kBytesTotal = (kShare ? kShareEnd : kEnd) + (kAlign > 1 ? kAlign : 0);
};

#if defined(MSA_OPS_SM90_WGMMA)
// d[4] (+)= A(64x32 e4m3, shared memory, K-major) * B(8x32 e4m3, shared memory, K-major)^T.
__device__ __forceinline__ void wgmma_ss_n8_e4m3(float* d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(accumulate));
}
#endif

// Per-CTA phase stamps of the decode kernel, for profiling builds only (CMake -DMSA_OPS_MSA_STAMPS=ON): thread 0 of
// each of the first kMsaStampCtas CTAs (x fastest, then y, then z) writes clock64() at kMsaStampPoints points, the
// global timer (ns) at the first and last, and its SM, read back after a call by msa_ops_msa_stamps() (below;
// scripts/probe_msa_stamps.py). The points: 0 start, 1 past the wait for the previous kernel, 2 owner found, 3 Q,
// slots and page-table row landed, 4 tile list built, 5 first tile landed, 6 last tile issued (by the loader
// warp's lane 0 where it runs; else when thread 0 has the last tile), 7 last tile done, 8 every warp at the
// epilogue's first barrier, 9 output stored (the last five in the transposed form, groups of at most 8 heads).
// Compiled out otherwise.
[[maybe_unused]] constexpr int kMsaStampCtas = 4096, kMsaStampPoints = 10, kMsaStampCols = kMsaStampPoints + 3;
#if defined(MSA_OPS_MSA_STAMPS)
__device__ long long g_msa_stamps[kMsaStampCtas][kMsaStampCols];
__device__ __forceinline__ void msa_stamp(int point, int by = 0) {
  const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != by || cta >= kMsaStampCtas) return;
  g_msa_stamps[cta][point] = clock64();
  if (point == 0 || point == kMsaStampPoints - 1) {
    long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    g_msa_stamps[cta][kMsaStampPoints + (point == 0 ? 0 : 1)] = ns;
  }
  if (point == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_msa_stamps[cta][kMsaStampPoints + 2] = sm;
  }
}
#else
__device__ __forceinline__ void msa_stamp(int, int = 0) {}
#endif

// kT: the transposed form for groups of at most 8 heads (one row block).
// kCluster (with kT only): the launch groups each token's split-K partitions into one cluster along z, and they
// merge here (cluster_merge) instead of in split_k_combine_kernel.
// kProd (with kT, not kCluster): a fifth warp loads the K/V tiles (kProdStages, kProdAhead above).
// kShare (with kProd): the launch groups the CTAs of consecutive tokens of one kv head (blockIdx.x) into clusters
// of 2..kMaxShare, whose members share their key tiles at run time. Each CTA's loader claims its own tiles from the
// front of its list, one at a time, through a claim word in its shared memory; once its list is exhausted, it
// claims the last unclaimed tile of the member with the most left (at least kMinSteal), through that member's
// word, and loads that tile with that member's Q (copied once) into its own ring. Each stage carries a tag (the
// tile's first key and whose unit it is), and the compute warps, when the unit changes, merge their partial state
// (the four warps through shared memory) into the slot that the unit's owner keeps for them, merging with what
// they put there before. After a cluster barrier each CTA merges its slots into its output. So the members of a
// cluster end together, at the mean of their work rather than at their slowest's (NOTES_msa v56).
template <typename KV, bool kT, bool kCluster = false, bool kProd = false, bool kShare = false>
__global__ void __launch_bounds__(kProd ? kProdThreads : kThreads)
    msa_attention_kernel(const __grid_constant__ MsaArgs a) {
  static_assert(!kProd || (kT && !kCluster), "the loader warp serves the transposed, unclustered kernel");
  static_assert(!kShare || kProd, "work sharing is the loader-warp kernel's");
  using T = KvTraits<KV>;
  using PvMma = Mma<typename T::Pv>;
  constexpr int kRing = kProd ? kProdStages : kStages;  // ring stages
  constexpr int kCta = kProd ? kProdThreads : kThreads;  // threads
  using S = MsaSmem<KV, kRing, kShare>;
  constexpr int kBN = T::kBN;
  constexpr int kRowBytes = T::kRowBytes;
  constexpr int kChunksRow = kRowBytes / 16;  // 16 (bf16) or 8 (fp8)
  constexpr int KS = kChunksRow / 2;          // Q.K^T k-steps (two chunks each)
  constexpr int kWarpKeys = kBN / kWarps;     // the warp's keys of each tile
  constexpr int NT = kWarpKeys / 8;           // score tiles of 8 keys per warp
  static_assert(kWarpKeys % 16 == 0, "whole P.V k-steps per warp and tile");
  constexpr int ND = kD / 8;                  // output tiles
  // kWg: fp8 with at most 8 heads on sm_90a runs S^T = K Q^T on the warpgroup MMA (wgmma m64n8k32, e4m3 operands
  // as loaded, no widening), the four warps being one warpgroup; each warp then holds keys 16 w + (0..15) of each
  // 64-key half of the tile. Elsewhere the mma.sync form below.
#if defined(MSA_OPS_SM90_WGMMA)
  constexpr bool kWg = kT && std::is_same_v<KV, __nv_fp8_e4m3>;
#else
  constexpr bool kWg = false;
#endif
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((S::kAlign - (smem_addr(smem_raw) & (S::kAlign - 1))) & (S::kAlign - 1));
  unsigned char* sQ = smem;
  int* sTiles = reinterpret_cast<int*>(smem + S::kQBytes);  // key0 of each tile
  int* sPages = sTiles + 2 * kMaxTopk;                        // its page
  int* sIds = sTiles + 4 * kMaxTopk;                          // the token's slots
  int* sCount = sIds + kMaxTopk;
  int* sMeta = sCount + 4;  // the guessed sequence's cache length, the layer
  int* sLut = reinterpret_cast<int*>(smem + S::kQBytes + S::kListBytes);
  unsigned char* ring = smem + S::kRingOff;
  // Work sharing (kShare; S above): this CTA's rank and its cluster's size, the members' Q copies, the slots, the
  // merge scratch, the claim word, the tile count, the ranks' (p, kmax) and the stages' tags.
  uint32_t crank = 0, csize = 1;
  if constexpr (kShare) {
    crank = cluster_rank_and_size(&csize);
    if (csize > static_cast<uint32_t>(kMaxShare)) __trap();  // (the launch's clusters are of 2 or kMaxShare)
  }
  unsigned char* sQf = smem + S::kShareOff;
  float* sSlots = reinterpret_cast<float*>(smem + S::kSlotsOff);
  float* sScr = reinterpret_cast<float*>(smem + S::kScrOff);
  int* sClaim = reinterpret_cast<int*>(smem + S::kShIntOff);
  int* sN = sClaim + 1;
  int* sUnit = sClaim + 2;              // [kMaxShare][2]: p (clamped to 2^30), kmax
  int* sTag = sUnit + 2 * kMaxShare;    // [kRing][2]: key0, unit (-1: the end of the stream)
  if constexpr (kShare) {  // every slot empty, nothing to claim here until the list is built (before any member reads)
    for (int i = threadIdx.x; i < kMaxShare * 8; i += kCta) {
      float* ml = sSlots + (i / 8) * S::kSlotFloats + 8 * kD + (i % 8) * 2;
      ml[0] = -INFINITY;
      ml[1] = 0.f;
    }
    if (threadIdx.x == 0) *sClaim = 0, *sN = 0;
  }

  // Launched with programmatic dependent launch (launch_pdl): nothing is read before the previous kernel in the
  // stream has completed, and the next one may launch its CTAs (which wait likewise) at once.
  msa_stamp(0);
  pdl_wait();
  pdl_trigger();
  msa_stamp(1);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row_blocks = (a.group + 15) / 16;
  const int t = blockIdx.x / row_blocks;
  const int g0 = (blockIdx.x % row_blocks) * 16;
  const int hkv = blockIdx.y, part = blockIdx.z;

  // ---- first, by cp.async: Q rows (16 heads of the group, zero past the group) as stored (bf16 or e4m3),
  // swizzled, and the token's slots. Both depend on the token and head only, so their latency overlaps the owner
  // search and the reads that follow it instead of adding to the CTA's start.
  const int rows = min(16, a.group - g0);
  for (int cidx = tid; cidx < 16 * kChunksRow; cidx += kCta) {
    const int r = cidx / kChunksRow, ch = cidx % kChunksRow;
    const int64_t h = static_cast<int64_t>(hkv) * a.group + g0 + r;
    const unsigned char* src =
        static_cast<const unsigned char*>(a.q) + (static_cast<int64_t>(t) * a.H + h) * kRowBytes + ch * 16;
    cp_async16(smem_addr(sQ + swz<kRowBytes>(r, ch)), r < rows ? src : a.q, r < rows);
  }
  const int topk = min(a.topk, kMaxTopk);
  const int32_t* ids = a.d_indices + (static_cast<int64_t>(hkv) * a.T + t) * a.topk;
  for (int i = tid; i < topk; i += kCta) cp_async4(smem_addr(sIds + i), ids + i);
  // The page-table entries wait for the slots and the slots' sequence for the row offsets: two memory latencies
  // in a row before the first K/V copy. So the CTA guesses its sequence as if each held max_q rows (exact for
  // decode batches), and copies that sequence's whole page-table row (when short enough) and cache length, and
  // the layer, together with Q and the slots; a wrong guess falls back to reading them after the owner search.
  const int b_guess = min(t / max(a.max_q, 1), a.B - 1);
  const bool lut_whole = a.max_pages <= kMaxLutRow && b_guess >= 0;
  if (b_guess >= 0) {
    const int32_t* row = a.lookup + static_cast<int64_t>(b_guess) * a.max_pages;
    if (lut_whole && (a.max_pages & 3) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
      for (int i = tid * 4; i < a.max_pages; i += kCta * 4) cp_async16(smem_addr(sLut + i), row + i);
    } else if (lut_whole) {
      for (int i = tid; i < a.max_pages; i += kCta) cp_async4(smem_addr(sLut + i), row + i);
    }
    if (tid == 0) cp_async4(smem_addr(sMeta), a.cache_lengths + b_guess);
    if (tid == 1) cp_async4(smem_addr(sMeta + 1), a.layer_ptr);
  }
  cp_async_commit();
  // The loader warp's mbarriers: full[s] (32 arrivals a phase: each loader lane's once its copies of the stage's
  // tile have landed, cp_async_mbar_arrive; or, for a TMA tile, lane 0's with the tile's bytes expected and the
  // other lanes' at once, the phase then completing with the bytes: stage s holds its tile), then empty[s] (one
  // arrival from each compute warp: stage s is free again); the barrier after Q lands orders their set-up.
  const uint32_t sFull = smem_addr(smem + S::kBarOff), sEmpty = sFull + 8 * kRing;
  if (kProd && tid == kThreads) {
    for (int st = 0; st < kRing; ++st) {
      mbar_init(sFull + 8 * st, kShare ? 33 : 32);  // (kShare: lane 0 arrives once more, with the stage's tag)
      mbar_init(sEmpty + 8 * st, kWarps);
    }
#if defined(MSA_OPS_SM90_WGMMA)
    mbar_init_fence();  // (the TMA copies complete on the full barriers)
#endif
  }

  int64_t e0 = 0, e1 = 0;
  const int b = owner_of(a, t, &e0, &e1);
  msa_stamp(2);
  if (b < 0) {  // a padding row: zero here when the partitions merge here; split-K's combine zeroes it otherwise
    cp_async_wait<0>();  // no copy outlives the CTA
    if (a.num_partitions <= 1 || (kCluster && part == 0)) {
      __nv_bfloat16* dst = a.out + (static_cast<int64_t>(t) * a.H + static_cast<int64_t>(hkv) * a.group + g0) * kD;
      for (int i = tid; i < rows * kD / 8; i += kCta) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kShare) {  // nothing to give (no tiles): stay until no member can read this CTA's memory
      cluster_arrive();
      cluster_wait();
      cluster_arrive();
      cluster_wait();
    }
    return;
  }
  const bool guessed = b == b_guess;  // a wrong guess reads the cache length and the page table from memory
  const int32_t* lut_row = guessed && lut_whole ? sLut : a.lookup + static_cast<int64_t>(b) * a.max_pages;
  const int cl_mem = guessed ? 0 : a.cache_lengths[b];
  cp_async_wait<0>();  // Q, the slots, the guessed sequence's page-table row and cache length, the layer
#if defined(MSA_OPS_SM90_WGMMA)
  if constexpr (kWg) fence_proxy_async();  // Q's copies, before the warpgroup MMA reads them
#endif
  __syncthreads();
  msa_stamp(3);
  const int64_t s_max = static_cast<int64_t>(a.max_pages) * kBlock;
  const int64_t c = iclamp(guessed ? sMeta[0] : cl_mem, 0, s_max);
  const int64_t p = c + (t - e0);
  const int64_t n_keys = c + (e1 - e0);
  // Every row of the CTA is this token's (one position), so no key past p is visible to any of them: the tiles hold
  // keys below kmax and zero-fill the rest, and a later token's V (in speculative decode and the per-token prefill
  // route) never meets a zero weight here (SEMANTICS.md §5: not even as 0 * NaN).
  const int kmax = static_cast<int>(imin(imin(n_keys, p + 1), s_max));
  const int layer = sMeta[1];
  const bool layer_ok = layer >= 0 && layer < a.num_layers;

  // Pages of the KV cache: K rows of head hkv at head_off in a page, V rows kv_half further.
  const unsigned char* kvb = static_cast<const unsigned char*>(a.kv);
  const int64_t row_stride = static_cast<int64_t>(a.Hkv) * kRowBytes;  // bytes
  const int64_t kv_half = static_cast<int64_t>(a.num_layers) * kBlock * row_stride;
  const int64_t head_off = static_cast<int64_t>(layer) * kBlock * row_stride + static_cast<int64_t>(hkv) * kRowBytes;
  // The selected blocks lie anywhere in the pool. One line of each block's K is prefetched into L2 ahead of its
  // copies, so that the translation of its address is done before they are issued: for the first tiles while
  // the slots are compacted, for the others kPrefetchTiles tiles ahead of the tile being loaded (await_tile, or
  // the loader warp's loop).
  // On H200s at topk 64 this took bf16 from 142 to 137-140 us on some machines and changed nothing on others;
  // fp8 measured the same (NOTES_msa.md v7).
  constexpr int kPrefetchTiles = 8;
  auto prefetch_block = [&](int page) { prefetch_l2(kvb + static_cast<int64_t>(page) * 2 * kv_half + head_off); };

  const int per = (topk + a.num_partitions - 1) / a.num_partitions;
  const int s_lo = min(topk, part * per), s_hi = min(topk, (part + 1) * per);

  // ---- tile loader: kBN consecutive key slots of one page, K and V, 16-byte chunks; by every thread, or by the
  // loader warp alone (kProd).
  constexpr int kLoaders = kProd ? 32 : kThreads;
  const int me = kProd ? lane : tid;
  // Where chunk ch of key row r lies in a ring tile: swz, except in the bf16 loader-warp kernel, whose tiles are two
  // [kBN][64] column halves with the 128-byte swizzle (the TMA boxes' layout; the ring is 1024-aligned there).
  auto tile_off = [](int r, int ch) {
    if constexpr (kProd && kBN < kBlock) return static_cast<int>(sw128_offset<kBN>(r, ch));
    else return swz<kRowBytes>(r, ch);
  };
  // Returns whether the loader warp's lanes have arrived on the stage's full barrier themselves (a TMA tile), else
  // they arrive once their copies land (cp_async_mbar_arrive, the caller's).
  auto load_tile_at = [&](int key0, int page, int stage, int kmax) {
    unsigned char* sK = ring + stage * S::kStageBytes;
    unsigned char* sV = sK + kBN * kRowBytes;
#if defined(MSA_OPS_SM90_WGMMA)
    // The loader warp, every key of the tile present: the tile's K and V as TMA boxes of 128-byte column blocks
    // (fp8: one a row, the whole block; bf16: two column halves), 32 KB against the stage's full barrier; lane 0
    // arrives with the bytes expected, the others plainly.
    if constexpr (kProd) {
      if (a.kv_tma && key0 + kBN <= kmax) {
        constexpr int kBoxes = kRowBytes / 128, kBoxCols = 128 / static_cast<int>(sizeof(KV));
        const uint32_t bar = sFull + 8 * stage;
        if (lane == 0) {
          mbar_expect_tx(bar, S::kStageBytes);
#pragma unroll
          for (int h = 0; h < kBoxes; ++h) {
            tma_load_5d(smem_addr(sK) + h * kBN * 128, &a.kv_map, bar, h * kBoxCols, hkv, key0 % kBlock, layer,
                        page);
            tma_load_5d(smem_addr(sV) + h * kBN * 128, &a.kv_map, bar, h * kBoxCols, hkv, key0 % kBlock,
                        a.num_layers + layer, page);
          }
        } else {
          mbar_arrive(bar);
        }
        return true;
      }
    }
#endif
    const int64_t page_off = static_cast<int64_t>(page) * 2 * kv_half + head_off;
    constexpr int kRowsPass = kLoaders / kChunksRow;  // key rows one pass of the loaders covers
    // fp8, every key of the tile present (the common case): addresses at a fixed stride, no per-row checks. (The
    // same form for bf16 measured 12% slower at topk 64 on an H200, benchmarks/NOTES_msa.md; bf16 keeps the loop.)
    if (sizeof(KV) == 1 && key0 + kBN <= kmax) {
      const int r = me / kChunksRow, ch = me % kChunksRow;
      const unsigned char* src = kvb + page_off + static_cast<int64_t>((key0 + r) % kBlock) * row_stride + ch * 16;
      const int64_t pass_bytes = kRowsPass * row_stride;
#pragma unroll
      for (int j = 0; j < kBN / kRowsPass; ++j) {
        const int dst = tile_off(r + j * kRowsPass, ch);
        cp_async16(smem_addr(sK + dst), src + j * pass_bytes);
        cp_async16(smem_addr(sV + dst), src + j * pass_bytes + kv_half);
      }
      return false;
    }
    for (int cidx = me; cidx < kBN * kChunksRow; cidx += kLoaders) {
      const int r = cidx / kChunksRow, ch = cidx % kChunksRow;
      const int key = key0 + r;
      const bool ok = key < kmax;
      const unsigned char* srcK = kvb + page_off + static_cast<int64_t>(key % kBlock) * row_stride + ch * 16;
      const int dst = tile_off(r, ch);
      cp_async16(smem_addr(sK + dst), ok ? srcK : kvb, ok);
      cp_async16(smem_addr(sV + dst), ok ? srcK + kv_half : kvb, ok);
    }
    return false;
  };
  auto load_tile = [&](int i, int stage) { return load_tile_at(sTiles[i], sPages[i], stage, kmax); };
  // kShare: the tag of the tile just issued into `stage` (its first key and whose unit it is), then lane 0's own
  // arrival on the stage's full barrier, which publishes the tag with the tile.
  auto tag_stage = [&](int stage, int key0, int unit) {
    if constexpr (kShare) {
      if (lane == 0) {
        sTag[2 * stage] = key0;
        sTag[2 * stage + 1] = unit;
        mbar_arrive(sFull + 8 * stage);
      }
    }
  };

  // What the compaction keeps of a slot (repeats aside): an id inside the page table whose block starts before
  // n_keys and at or before p, on a page inside the pool (page: the entry, -1 for an id outside the table); and
  // whether a kept block gives a second 64-key tile (its second half holds keys <= p and < kmax).
  auto block_ok = [&](int id, int page) {
    const int64_t key0 = static_cast<int64_t>(id) * kBlock;
    return id >= 0 && id < a.max_pages && key0 < n_keys && key0 <= p && page >= 0 && page < a.num_blocks;
  };
  auto second_tile = [&](int key0) { return kBN < kBlock && key0 + kBN <= p && key0 + kBN < kmax; };

  // ---- the first tiles before the compaction: the partition's first slot, if valid and not a repeat of an
  // earlier partition's slot, gives the first tile (and with 64-key tiles the second, from the same block) exactly
  // as the compaction below will list them. Every thread decides alike from shared memory, and the copies are in
  // flight while warp 0 compacts (NOTES_msa v46: the compaction held the first copy back 0.6 us at topk 16, 1.4
  // at 64). Only where the page-table row is in shared memory (a right guess of the sequence).
  // With the loader warp (kProd), the loader warp alone decides and loads, and compacts after.
  constexpr int kEarlyMax = kProd ? kProdAhead : kStages - 1;
  const int compactor = kProd ? kWarps : 0;  // the warp that compacts
  int n_early = 0;
  if (s_lo < s_hi && layer_ok && lut_row == sLut && (!kProd || warp == compactor)) {
    const int id = sIds[s_lo];
    const int page = id >= 0 && id < a.max_pages ? sLut[id] : -1;
    bool ok = block_ok(id, page);
    if (s_lo > 0) {  // a repeat of a slot of an earlier partition counts there
      bool dup = false;
      for (int j = me; j < s_lo; j += kLoaders) dup |= sIds[j] == id;
      if constexpr (kProd) ok = !__any_sync(0xffffffff, dup) && ok;
      else ok = !__syncthreads_or(dup) && ok;
    }
    if (ok) {
      const int key0 = id * kBlock;
      n_early = second_tile(key0) && kEarlyMax >= 2 ? 2 : 1;
      for (int s = 0; s < n_early; ++s) {
        const bool arrived = load_tile_at(key0 + s * kBN, page, s, kmax);
        cp_async_commit();
        if (kProd && !arrived) cp_async_mbar_arrive(sFull + 8 * s);
        tag_stage(s, key0 + s * kBN, static_cast<int>(crank));
      }
    }
  }

  // ---- compact this partition's slots into tiles: valid id, first occurrence, key range before p.
  if (warp == compactor) {
    int count = 0;
    for (int base = s_lo; base < s_hi; base += 32) {
      const int slot = base + lane;
      bool ok = false;
      int id = -1, page = -1;
      if (slot < s_hi && layer_ok) {
        id = sIds[slot];
        // The page-table read needs only an id inside the table: issued before the checks against the cache
        // length (whose read may still be in flight) and before the duplicate scan, which run under its latency.
        if (id >= 0 && id < a.max_pages) page = lut_row[id];
        ok = block_ok(id, page);
      }
      // A repeated id counts at its first slot: against the earlier chunks' slots one by one, within this chunk
      // by the lanes holding the same id (slots past s_hi or invalid hold -1 and are never kept).
      bool dup = false;
      for (int j = 0; j < base; ++j) dup |= sIds[j] == id;
      dup |= (__match_any_sync(0xffffffff, id) & ((1u << lane) - 1)) != 0;
      ok = ok && !dup;
      // Each valid block gives one tile, and with 64-key tiles a second one if it holds keys <= p and < kmax.
      const int key0 = id * kBlock;
      const bool second = ok && second_tile(key0);
      const int n_here = (ok ? 1 : 0) + (second ? 1 : 0);
      int pre = n_here;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffff, pre, d);
        if (lane >= d) pre += u;
      }
      const int at = count + pre - n_here;
      if (ok) {
        sTiles[at] = key0;
        sPages[at] = page;
        if (at < kRing + kPrefetchTiles) prefetch_block(page);
      }
      if (second) {
        sTiles[at + 1] = key0 + kBN;
        sPages[at + 1] = page;
      }
      count += __shfl_sync(0xffffffff, pre, 31);
    }
    if (lane == 0) *sCount = count;
    if constexpr (kShare) {  // the list open to the members: the first n_early tiles are in flight (claimed)
      if (lane == 0) {
        *sN = count;
        *sClaim = n_early << 16;
        sUnit[2 * crank] = static_cast<int>(imin(p, static_cast<int64_t>(1) << 30));
        sUnit[2 * crank + 1] = kmax;
      }
    }
  }

  __syncthreads();  // the tile list
  if constexpr (kShare) cluster_arrive();  // (phase 0: every member's list, claim word and slots set up)
  msa_stamp(4);
  const int num_tiles = *sCount;

  for (int s = n_early; s < kStages - 1 && !kProd; ++s) {  // (the first n_early tiles are in flight, one group each)
    if (s < num_tiles) load_tile(s, s);
    cp_async_commit();
  }
  // The loader warp (kProd): tile i goes into stage i % kRing once the compute warps have handed that stage back
  // (tile i - kRing done) and tile i - kProdAhead has landed (kProdAhead tiles in flight); each lane's copies of a
  // tile arrive on the stage's full barrier as they land, so the compute warps learn of a tile from the copies
  // themselves, and the loader waits for nothing but its ring.
  auto wait_landed = [&](int i) { mbar_wait(sFull + 8 * (i % kRing), (i / kRing) & 1); };  // tile i's copies
  auto run_loader = [&]() {
    for (int i = n_early; i < num_tiles; ++i) {
      const int st = i % kRing;
      if (i >= kRing) mbar_wait(sEmpty + 8 * st, (i / kRing - 1) & 1);
      if (i >= kProdAhead) wait_landed(i - kProdAhead);
#if defined(MSA_OPS_MSA_NOCOPY)
      const bool arrived = i < kRing && load_tile(i, st);  // a diagnostic build: the stages keep their first tiles
#else
      const bool arrived = load_tile(i, st);
#endif
      cp_async_commit();
      if (!arrived) cp_async_mbar_arrive(sFull + 8 * st);
      if (lane == 0 && i + kPrefetchTiles < num_tiles) prefetch_block(sPages[i + kPrefetchTiles]);
    }
    msa_stamp(6, kThreads);
  };
  // kShare: the loader's stream through the ring, tile `seq` (counted over every unit) into stage seq % kRing as in
  // run_loader, with its tag; first its own tiles, claimed one at a time from the front of its list, then the
  // members' (above), then the end of the stream (a tag of unit -1, no copies).
  auto run_loader_share = [&]() {
    int seq = n_early;
    auto issue = [&](int key0, int page, int unit, int kmax_u) {
      const int st = seq % kRing;
      if (seq >= kRing) mbar_wait(sEmpty + 8 * st, (seq / kRing - 1) & 1);
      if (seq >= kProdAhead) wait_landed(seq - kProdAhead);
      const bool arrived = load_tile_at(key0, page, st, kmax_u);
      cp_async_commit();
      if (!arrived) cp_async_mbar_arrive(sFull + 8 * st);
      tag_stage(st, key0, unit);
      ++seq;
    };
    const uint32_t claim_addr = smem_addr(sClaim);
    for (;;) {
      uint32_t old = 0;
      if (lane == 0) old = atom_add_cluster(claim_addr, 1u << 16);
      old = __shfl_sync(0xffffffff, old, 0);
      const int i = static_cast<int>(old >> 16), back = static_cast<int>(old & 0xffff);
      if (i + back >= num_tiles) break;
      issue(sTiles[i], sPages[i], static_cast<int>(crank), kmax);
      if (lane == 0 && i + kPrefetchTiles < num_tiles) prefetch_block(sPages[i + kPrefetchTiles]);
    }
    msa_stamp(6, kThreads);
    __syncwarp();
    cluster_wait();  // (phase 0) every member's list and claim word are set up
    uint32_t have_q = 1u << crank;  // the members whose Q and (p, kmax) this CTA holds
    for (;;) {
      int left = -1, n_m = 0;
      if (lane < static_cast<int>(csize) && lane != static_cast<int>(crank)) {
        const uint32_t w = ld_relaxed_cluster_u32(cluster_addr(claim_addr, lane));
        n_m = static_cast<int>(ld_relaxed_cluster_u32(cluster_addr(smem_addr(sN), lane)));
        left = n_m - static_cast<int>(w >> 16) - static_cast<int>(w & 0xffff);
      }
      int best = left, who = lane;  // the member with the most tiles left (the lowest rank among equals)
#pragma unroll
      for (int d = 1; d < kMaxShare; d <<= 1) {
        const int b2 = __shfl_xor_sync(0xffffffff, best, d), w2 = __shfl_xor_sync(0xffffffff, who, d);
        if (b2 > best || (b2 == best && w2 < who)) best = b2, who = w2;
      }
      best = __shfl_sync(0xffffffff, best, 0);
      who = __shfl_sync(0xffffffff, who, 0);
      if (best < kMinSteal) break;
      const int n_v = __shfl_sync(0xffffffff, n_m, who);
      int idx = -1, key0 = 0, page = 0;
      if (lane == 0) {
        const uint32_t old = atom_add_cluster(cluster_addr(claim_addr, who), 1u);
        const int front = static_cast<int>(old >> 16), back = static_cast<int>(old & 0xffff);
        if (front + back < n_v) {
          idx = n_v - 1 - back;
          key0 = static_cast<int>(ld_relaxed_cluster_u32(cluster_addr(smem_addr(sTiles + idx), who)));
          page = static_cast<int>(ld_relaxed_cluster_u32(cluster_addr(smem_addr(sPages + idx), who)));
        }
      }
      idx = __shfl_sync(0xffffffff, idx, 0);
      if (idx < 0) continue;  // another member took it first
      key0 = __shfl_sync(0xffffffff, key0, 0);
      page = __shfl_sync(0xffffffff, page, 0);
      if (!(have_q >> who & 1)) {  // the member's 8 Q rows as stored (swizzled), and its (p, kmax)
        const uint32_t src = smem_addr(sQ);
        for (int c = lane; c < 8 * kChunksRow; c += 32) {
          const uint4 v = ld_cluster_u4(cluster_addr(src + 16 * c, who));
          *reinterpret_cast<uint4*>(sQf + who * S::kQBytes + 16 * c) = v;
        }
        if (lane < 2) sUnit[2 * who + lane] =
            static_cast<int>(ld_relaxed_cluster_u32(cluster_addr(smem_addr(sUnit + 2 * who + lane), who)));
#if defined(MSA_OPS_SM90_WGMMA)
        if constexpr (kWg) fence_proxy_async();  // the copy of Q, read by the warpgroup MMA
#endif
        __threadfence_block();  // every lane's stores above, before lane 0's arrival with the tile's tag
        __syncwarp();
        have_q |= 1u << who;
      }
      issue(key0, page, who, sUnit[2 * who + 1]);
    }
    // The end of the stream.
    const int st = seq % kRing;
    if (seq >= kRing) mbar_wait(sEmpty + 8 * st, (seq / kRing - 1) & 1);
    if (lane == 0) sTag[2 * st + 1] = -1;
    __syncwarp();
    mbar_arrive(sFull + 8 * st);
    if (lane == 0) mbar_arrive(sFull + 8 * st);
    cp_async_wait<0>();  // no copy outlives the CTA
  };
  // Both paths below start tile `it` alike: wait for tile `it`, then issue the load kStages-1 tiles ahead (and
  // the prefetch of the tile kPrefetchTiles past that) into the stage of tile it - 1, which every warp has left
  // once past the barrier here: one barrier per tile. Returns where the tile's K lies in the ring. With the
  // loader warp: wait until the copies of tile `it` have landed (its stage's full barrier).
  auto await_tile = [&](int it) {
    if constexpr (kProd) {
      wait_landed(it);
#if defined(MSA_OPS_SM90_WGMMA)
      if constexpr (kWg) fence_proxy_async();  // the loader's copies (seen through the barrier), before the MMA
#endif
      return ring + (it % kRing) * S::kStageBytes;
    }
    cp_async_wait<kStages - 2>();
#if defined(MSA_OPS_SM90_WGMMA)
    if constexpr (kWg) fence_proxy_async();  // this thread's copies, before the warpgroup MMA reads the tile
#endif
    __syncthreads();
    const int nxt = it + kStages - 1;
    if (nxt < num_tiles) load_tile(nxt, nxt % kStages);
    if (tid == 0 && nxt + kPrefetchTiles < num_tiles) prefetch_block(sPages[nxt + kPrefetchTiles]);
    cp_async_commit();
    return ring + (it % kStages) * S::kStageBytes;  // the tile's K; its V follows kBN rows later
  };
  const int key_w0 = warp * kWarpKeys;
  const float sl2 = a.scale_log2;
  const int p32 = static_cast<int>(imin(p, static_cast<int64_t>(1) << 30));

  if constexpr (kT) {
    // At most 8 heads (group <= 8): S^T = K Q^T and O^T = V^T P^T put the warp's keys on the MMA's M side and the
    // heads on its N side (attention_kernel's 8-row tiles), so the 8 empty rows of a 16-row tile cost nothing.
    // Thread (g, t) = (lane / 4, lane % 4) holds S^T at keys g, g + 8 of each 16-key block and heads 2t, 2t + 1.
    constexpr int NK = kWarpKeys / 16;  // 16-key blocks per warp and tile
    static_assert(!kWg || NK * 64 == kBN, "wgmma: one 64-key M block per 16-key block of each warp");
    // The first key (within the tile) of the warp's 16-key block kb.
    auto kofs = [&](int kb) { return kWg ? kb * 64 + warp * 16 : key_w0 + kb * 16; };
    uint32_t qb[KS][2];  // Q^T, the B operand: heads 0-7 x the k step's two chunks
    uint32_t q_addr = smem_addr(sQ);  // (the unit's Q: kShare switches it to a member's copy)
    auto load_qb = [&]() {
#pragma unroll
      for (int kk = 0; kk < KS && !kWg; kk += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, q_addr + swz<kRowBytes>(lane % 8, kk * 2 + lane / 8));
        qb[kk][0] = r[0];
        qb[kk][1] = r[1];
        qb[kk + 1][0] = r[2];
        qb[kk + 1][1] = r[3];
      }
    };
    load_qb();
    // O^T: M tile j covers dims 16j..16j+15; bf16 holds dims 16j + g (+ 8), fp8 dims 16j + 2g (+ 1) (dim_of).
    auto dim_of = [&](int j, int e) {
      return std::is_same_v<KV, __nv_bfloat16> ? j * 16 + lane / 4 + (e / 2) * 8 : j * 16 + (lane / 4) * 2 + e / 2;
    };
    float o[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    const bool loader = kProd && warp == kWarps;
    int vis_p = p32, vis_k = kmax;  // the unit's visible keys (kShare: of the unit the tile belongs to)
    // kShare: the unit of the compute warps' running state, how many tiles it holds, the members whose slots
    // this CTA has written. flush(): the four warps' states merged (through the scratch) into the unit owner's slot
    // for this CTA, with what this CTA put there before; the state reset.
    int cur = static_cast<int>(crank), seg = 0;
    uint32_t pushed = 0;
    constexpr int SMS = S::kShareMS;
    auto flush = [&]() {
      if constexpr (kShare) {
        float ls[2] = {l_run[0], l_run[1]};
        sum_over_lane_groups(ls);
        float* scr_ml = sScr + kWarps * 8 * SMS;
        const int r = tid / 16, d0 = (tid % 16) * 8;
        float* slot = sSlots + crank * S::kSlotFloats;  // (in CTA cur's memory)
        const bool again = (pushed >> cur & 1) != 0;    // merge with this CTA's earlier partial of the unit
        asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");  // the scratch's readers before are done
        // The earlier (m, l) of row r, read by the row's 16 threads before its first thread writes the new one.
        const float2 old = again && r < rows ? ld_cluster_f2(smem_addr(slot + 8 * kD + 2 * r), cur)
                                             : make_float2(-INFINITY, 0.f);
        stash_rows_t<8, SMS>(sScr, scr_ml, warp, lane, o, m_run, ls, dim_of);
        asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");  // (the compute warps alone)
        if (r < rows) {
          float mt, lt, f[kWarps], acc[8];
          merge_weights<kWarps>(scr_ml, 8, r, &mt, &lt, f);
          sum_warp_rows<kWarps, 8, SMS>(sScr, r, d0, f, acc);
          const uint32_t acc_at = cluster_addr(smem_addr(slot + r * kD + d0), cur);
          const uint32_t ml_at = cluster_addr(smem_addr(slot + 8 * kD + 2 * r), cur);
          if (again) {
            const float mn = fmaxf(mt, old.x);
            const float wn = mt == -INFINITY ? 0.f : exp2f(mt - mn), wo = old.x == -INFINITY ? 0.f : exp2f(old.x - mn);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float4 v = ld_cluster_f4(smem_addr(slot + r * kD + d0 + 4 * h), cur);
              acc[4 * h] = wn * acc[4 * h] + wo * v.x;
              acc[4 * h + 1] = wn * acc[4 * h + 1] + wo * v.y;
              acc[4 * h + 2] = wn * acc[4 * h + 2] + wo * v.z;
              acc[4 * h + 3] = wn * acc[4 * h + 3] + wo * v.w;
            }
            mt = mn;
            lt = wn * lt + wo * old.y;
          }
          st_cluster_u4(acc_at, f4_bits(acc[0], acc[1], acc[2], acc[3]));
          st_cluster_u4(acc_at + 16, f4_bits(acc[4], acc[5], acc[6], acc[7]));
          if (tid % 16 == 0) {
            uint32_t ml2[2] = {__float_as_uint(mt), __float_as_uint(lt)};
            asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};\n" ::"r"(ml_at), "r"(ml2[0]), "r"(ml2[1])
                         : "memory");
          }
        }
        pushed |= 1u << cur;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
        m_run[0] = m_run[1] = -INFINITY;
        l_run[0] = l_run[1] = 0.f;
      }
    };
    if (loader) {
      if constexpr (kShare) run_loader_share();
      else run_loader();
    }
    for (int it = 0; !loader && (kShare || it < num_tiles); ++it) {
      const unsigned char* sK = await_tile(it);
      if (it == 0) msa_stamp(5);
      if (!kProd && it == num_tiles - 1) msa_stamp(6);
      const unsigned char* sV = sK + kBN * kRowBytes;
      int key0;
      if constexpr (kShare) {
        key0 = sTag[2 * (it % kRing)];
        const int unit = sTag[2 * (it % kRing) + 1];
        if (unit < 0) break;  // the end of the stream
        if (unit != cur) {    // a member's tiles from here: this unit's state goes to its slot
          if (seg > 0) flush();
          cur = unit;
          seg = 0;
          vis_p = sUnit[2 * unit];
          vis_k = sUnit[2 * unit + 1];
          q_addr = unit == static_cast<int>(crank) ? smem_addr(sQ) : smem_addr(sQf + unit * S::kQBytes);
          load_qb();
        }
        ++seg;
      } else {
        key0 = sTiles[it];
      }

      float s[NK][4];
#pragma unroll
      for (int kb = 0; kb < NK; ++kb) s[kb][0] = s[kb][1] = s[kb][2] = s[kb][3] = 0.f;
      if constexpr (kWg) {
#if defined(MSA_OPS_SM90_WGMMA)
        // M block kb = keys 64 kb .. 64 kb + 63 of the tile (8 KB of K, whole swizzle atoms); k steps of 32 dims
        // advance the start address by 32 bytes inside the 128-byte rows, as in attention_sm90.cuh.
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < NK; ++kb) {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            const uint64_t da = wgmma_desc(smem_addr(sK) + kb * 64 * kRowBytes + kk * 32, 16, 1024);
            const uint64_t db = wgmma_desc(q_addr + kk * 32, 16, 1024);
            wgmma_ss_n8_e4m3(s[kb], da, db, kk > 0 ? 1 : 0);
          }
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int kb = 0; kb < NK; ++kb) fence_regs<4>(s[kb]);
#endif
      } else {
#pragma unroll
        for (int kb = 0; kb < NK; ++kb) {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            uint32_t kf[4];  // K as the A operand: (keys 0-7, c), (8-15, c), (0-7, c + 1), (8-15, c + 1)
            const FragAddr f = v_frag_addr(lane, key_w0 + kb * 16, kk * 2);
            ldmatrix_x4(kf, smem_addr(sK + tile_off(f.key, f.ch)));
            T::qk(s[kb], kf, qb[kk]);
          }
        }
      }
      float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int kb = 0; kb < NK; ++kb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + kofs(kb) + lane / 4 + (e / 2) * 8;
          const bool vis = key <= vis_p && key < vis_k;
          s[kb][e] = vis ? s[kb][e] * sl2 : -INFINITY;
          m_new[e % 2] = fmaxf(m_new[e % 2], s[kb][e]);
        }
      }
      rescale_rows<8, true, false>(m_new, m_run, l_run, o);
      const float nm[2] = {m_run[0] == -INFINITY ? 0.f : -m_run[0], m_run[1] == -INFINITY ? 0.f : -m_run[1]};
#pragma unroll
      for (int kb = 0; kb < NK; ++kb) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pv[e] = exp2f(s[kb][e] + nm[e % 2]);
          l_run[e % 2] += pv[e];
        }
        // P^T, the B operand of O^T = V^T P^T: the two 8x8 (key x head) blocks transposed in registers.
        const uint32_t pb[2] = {movmatrix_trans(PvMma::pack(pv[0], pv[1])),
                                movmatrix_trans(PvMma::pack(pv[2], pv[3]))};
#pragma unroll
        for (int c = 0; c < kChunksRow; c += 2) {
          uint32_t vf[4];
          if constexpr (std::is_same_v<KV, __nv_bfloat16>) {
            // V^T as the A operand, read transposed: (keys 0-7, c), (0-7, c + 1), (8-15, c), (8-15, c + 1).
            const FragAddr f = k_frag_addr(lane, key_w0 + kb * 16, c);
            ldmatrix_x4_trans(vf, smem_addr(sV + tile_off(f.key, f.ch)));
            PvMma::run(o[c / 2], vf, pb);
          } else {
            // (keys 0-7, c), (8-15, c), (0-7, c + 1), (8-15, c + 1): each .trans register is two keys of one pair
            // of adjacent dims; widened, the even dim is an A row 0-7 of M tile c and the odd dim its row 8-15.
            const FragAddr f = v_frag_addr(lane, kofs(kb), c);
            ldmatrix_x4_trans(vf, smem_addr(sV + tile_off(f.key, f.ch)));
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              uint32_t af[4];
              widen_key_pair(vf[2 * u], &af[0], &af[1]);
              widen_key_pair(vf[2 * u + 1], &af[2], &af[3]);
              PvMma::run(o[c + u], af, pb);
            }
          }
        }
      }
      if constexpr (kProd) {  // this warp is done with the stage (its reads are in registers by now)
        __syncwarp();
        if (lane == 0) mbar_arrive(sEmpty + 8 * (it % kRing));
      }
    }
    // Thread tid finishes head r = tid / 16, dims d0 = (tid % 16) * 8 onwards: store_out writes them to the output
    // (bf16 for both KV dtypes, times `scale`); store_row, from the unnormalized sums and their (m, l), writes the
    // output row or, split, the workspace's normalized partial and its lse.
    const int r = tid / 16, d0 = (tid % 16) * 8;
    const int64_t h = static_cast<int64_t>(hkv) * a.group + r;
    auto store_out = [&](const float* v, float scale) {
      uint32_t pk[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) pk[j] = Mma<__nv_bfloat16>::pack(v[2 * j] * scale, v[2 * j + 1] * scale);
      *reinterpret_cast<uint4*>(a.out + (static_cast<int64_t>(t) * a.H + h) * kD + d0) =
          make_uint4(pk[0], pk[1], pk[2], pk[3]);
    };
    auto store_row = [&](const float* acc, float mt, float lt) {
      const bool any = lt > 0.f;
      const float inv = any ? 1.f / lt : 0.f;
      if (a.num_partitions <= 1) {
        store_out(acc, inv);
        return;
      }
      const int64_t wr = (static_cast<int64_t>(part) * a.T + t) * a.H + h;
      float4* dst = reinterpret_cast<float4*>(a.ws_o + wr * kD + d0);
      dst[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      dst[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
      if (tid % 16 == 0) a.ws_lse[wr] = any ? mt + log2f(lt) : -INFINITY;
    };
    if constexpr (kShare) {
      if (!loader && seg > 0) flush();
      msa_stamp(7);
      __syncwarp();
      if (!loader) cluster_wait();  // (phase 0; the loader waited for it before taking tiles)
      cluster_arrive();
      cluster_wait();  // (phase 1) every member's partials are in the slots; no member reads another's memory after
      msa_stamp(8);
      if (loader || r >= rows) return;
      float mx = -INFINITY;
      for (int q = 0; q < static_cast<int>(csize); ++q) {
        const float* ml = sSlots + q * S::kSlotFloats + 8 * kD + 2 * r;
        if (ml[1] > 0.f) mx = fmaxf(mx, ml[0]);
      }
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, lt = 0.f;
      for (int q = 0; q < static_cast<int>(csize) && mx != -INFINITY; ++q) {
        const float* slot = sSlots + q * S::kSlotFloats;
        const float mq = slot[8 * kD + 2 * r], lq = slot[8 * kD + 2 * r + 1];
        if (!(lq > 0.f)) continue;  // (a slot nobody wrote holds no sums)
        const float w = exp2f(mq - mx);
        lt += w * lq;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += w * slot[r * kD + d0 + j];
      }
      store_row(acc, mx, lt);
      msa_stamp(9);
      return;
    }
    cp_async_wait<0>();
    msa_stamp(7);

    // Head sums across g; the four warps merge through shared memory, and thread tid finishes row r, dims d0 on.
    sum_over_lane_groups(l_run);
    __syncthreads();
    msa_stamp(8);
    constexpr int MS = kD + 4;  // padded rows: conflict-free stores
    float* mo = reinterpret_cast<float*>(ring);  // [warps][8][MS]
    float* ml = mo + kWarps * 8 * MS;           // [warps][8][2] (m, l)
    if (!loader) stash_rows_t<8, MS>(mo, ml, warp, lane, o, m_run, l_run, dim_of);
    __syncthreads();
    const bool live = r < rows;  // (false for the loader warp: rows <= 8)
    if (!live && !kCluster) return;  // (every thread of a cluster reaches its barriers)
    float mt, lt, f[kWarps];
    merge_weights<kWarps>(ml, 8, r, &mt, &lt, f);
    float acc[8];
    sum_warp_rows<kWarps, 8, MS>(mo, r, d0, f, acc);
    if constexpr (kCluster) {  // the token's partitions are one cluster: merge them here
      static_assert((kWarps * 8 * MS + kWarps * 16 + kClusterXchgFloats(8)) * 4 <= S::kMergeBytes,
                    "merge scratch within the merge area");
      if (!live) mt = -INFINITY, lt = 0.f;
      float res[8];
      if (cluster_merge<8>(ml + kWarps * 16, r, tid % 16, mt, lt, acc, -INFINITY, res) && live) store_out(res, 1.f);
    } else {
      store_row(acc, mt, lt);
    }
    msa_stamp(9);
  } else {
    uint32_t qf[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int r = lane % 16, ch = kk * 2 + lane / 16;
      ldmatrix_x4(qf[kk], smem_addr(sQ + swz<kRowBytes>(r, ch)));
    }

    float o[ND][4];
#pragma unroll
    for (int j = 0; j < ND; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    for (int it = 0; it < num_tiles; ++it) {
      const unsigned char* sK = await_tile(it);
      const unsigned char* sV = sK + kBN * kRowBytes;
      const int key0 = sTiles[it];

      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int jp = 0; jp < NT / 2; ++jp) {
          uint32_t kf[4];
          const FragAddr f = k_frag_addr(lane, key_w0 + jp * 16, kk * 2);
          ldmatrix_x4(kf, smem_addr(sK + swz<kRowBytes>(f.key, f.ch)));
          T::qk(s[2 * jp], qf[kk], kf);
          T::qk(s[2 * jp + 1], qf[kk], kf + 2);
        }
      }
      float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + key_w0 + j * 8 + (lane % 4) * 2 + (e % 2);
          const bool vis = key <= p32 && key < kmax;
          s[j][e] = vis ? s[j][e] * sl2 : -INFINITY;
          m_new[e / 2] = fmaxf(m_new[e / 2], s[j][e]);
        }
      }
      rescale_rows<ND, false, false>(m_new, m_run, l_run, o);
      // P as the A operand of P.V: k-step ks covers score tiles 2ks and 2ks+1 (16 keys).
      uint32_t pf[NT / 2][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float nm = m_run[e / 2] == -INFINITY ? 0.f : -m_run[e / 2];
          pv[e] = exp2f(s[j][e] + nm);
          l_run[e / 2] += pv[e];
        }
        pf[j / 2][(j % 2) * 2 + 0] = PvMma::pack(pv[0], pv[1]);
        pf[j / 2][(j % 2) * 2 + 1] = PvMma::pack(pv[2], pv[3]);
      }
#pragma unroll
      for (int ks = 0; ks < NT / 2; ++ks) {
#pragma unroll
        for (int ch2 = 0; ch2 < kChunksRow; ch2 += 2) {
          uint32_t vf[4];
          const FragAddr f = v_frag_addr(lane, key_w0 + ks * 16, ch2);
          ldmatrix_x4_trans(vf, smem_addr(sV + swz<kRowBytes>(f.key, f.ch)));
          if constexpr (std::is_same_v<KV, __nv_bfloat16>) {  // chunk = output tile of 8 columns
            PvMma::run(o[ch2], pf[ks], vf);
            PvMma::run(o[ch2 + 1], pf[ks], vf + 2);
          } else {  // chunk c = 16 columns = output tiles 2c (even columns) and 2c + 1 (odd)
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              uint32_t ev[2], od[2];
              widen_key_pair(vf[2 * u], &ev[0], &od[0]);
              widen_key_pair(vf[2 * u + 1], &ev[1], &od[1]);
              PvMma::run(o[2 * (ch2 + u)], pf[ks], ev);
              PvMma::run(o[2 * (ch2 + u) + 1], pf[ks], od);
            }
          }
        }
      }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffff, l_run[i], 2);
    }
    // Merge the four key-split warps.
    __syncthreads();
    float* mo = reinterpret_cast<float*>(ring);
    float* ml = mo + kWarps * 16 * kD;
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        mo[(warp * 16 + lane / 4 + (e / 2) * 8) * kD + T::col_of(j, lane, e % 2)] = o[j][e];
    if (lane % 4 == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        ml[(warp * 16 + lane / 4 + i * 8) * 2 + 0] = m_run[i];
        ml[(warp * 16 + lane / 4 + i * 8) * 2 + 1] = l_run[i];
      }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lane / 4 + i * 8;
      float mt, lt, f[kWarps];
      merge_weights<kWarps>(ml, 16, r, &mt, &lt, f);
      if (r >= rows) continue;
      const int64_t h = static_cast<int64_t>(hkv) * a.group + g0 + r;
      const bool any = lt > 0.f;
      const float inv = any ? 1.f / lt : 0.f;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        const int col = j * 8 + (lane % 4) * 2;
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          v0 += f[w] * mo[(w * 16 + r) * kD + col];
          v1 += f[w] * mo[(w * 16 + r) * kD + col + 1];
        }
        if (a.num_partitions <= 1) {
          *reinterpret_cast<uint32_t*>(a.out + (static_cast<int64_t>(t) * a.H + h) * kD + col) =
              Mma<__nv_bfloat16>::pack(v0 * inv, v1 * inv);  // the output is bf16 for both KV dtypes
        } else {
          const int64_t wr = (static_cast<int64_t>(part) * a.T + t) * a.H + h;
          *reinterpret_cast<float2*>(a.ws_o + wr * kD + col) = make_float2(v0 * inv, v1 * inv);
          if (j == 0 && lane % 4 == 0) a.ws_lse[wr] = any ? mt + log2f(lt) : -INFINITY;
        }
      }
    }
  }
}

// The call as a paged ragged attention (what the shared tile locator, epilogues and the prefill kernel read).
AttentionArgs as_attention(const MsaArgs& m) {
  AttentionArgs a{};
  a.q = m.q;
  a.out = m.out;
  a.q_mode = kQRagged;
  a.total_rows = m.T;
  a.batch = m.B;
  a.q_offsets = m.offsets;
  a.H = m.H;
  a.Hkv = m.Hkv;
  a.group = m.group;
  a.kv_mode = kKvPaged;
  a.cache_lengths = m.cache_lengths;
  a.kv_blocks = m.kv;
  a.lookup = m.lookup;
  a.layer_ptr = m.layer_ptr;
  a.num_blocks = m.num_blocks;
  a.num_layers = m.num_layers;
  a.page_size = kBlock;
  a.max_pages = m.max_pages;
  a.page_shift = 7;
  a.scale_log2 = m.scale_log2;
  a.rescale_slack_log2 = rescale_slack_log2();
  a.num_partitions = m.num_partitions;
  a.ws_o = m.ws_o;
  a.ws_lse = m.ws_lse;
  return a;
}

// The prefill route (more than 8 queries per sequence) of bf16 runs the block-reusing wgmma kernel
// (msa_prefill_sm90.cuh) on compute capability 9.0 when it takes the call: one partition, max_pages within its
// bitmap. Everything else runs the per-token kernel.
template <typename KV>
bool use_prefill_sm90(const MsaArgs& m) {
  return std::is_same_v<KV, __nv_bfloat16> && m.max_q > 8 && m.num_partitions <= 1 &&
         m.max_pages <= MsaPrefillSm90::kMaxPages && use_wgmma();
}

// Q of the prefill route for the warp-specialized kernel's loader (make_heads_q_map). False when the group does not
// divide 128, the encoder is missing, or MSA_OPS_MSA_PREFILL_WS=0.
bool make_msa_q_map(const MsaArgs& m, CUtensorMap* qmap) {
  const char* env = std::getenv("MSA_OPS_MSA_PREFILL_WS");
  if (env != nullptr && env[0] == '0') return false;
  return make_heads_q_map(m.q, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kD, m.T, m.H, m.Hkv, m.group, MsaPrefillWs::kBlockM,
                          qmap);
}

// Whether the decode launch may take the loader-warp kernel (kProd): MSA_OPS_MSA_LOADER_WARP is not 0 (read once).
bool loader_warp_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("MSA_OPS_MSA_LOADER_WARP");
    return env == nullptr || env[0] != '0';
  }();
  return on;
}

// The work-sharing cluster size for a loader-warp launch of `grid` (kShare): the largest of kMaxShare, 2 that
// divides the tokens (grid.x) and whose clusters the GPU holds all at once (one CTA an SM: the grid must stay one
// wave), else 0 (the kernel without sharing). MSA_OPS_MSA_SHARE (read once) sets the largest size tried: 2 or 4
// (3 reads as 2); unset or 0, sharing is off (kShareDefault: on an H200 it read 2.1-2.8 us a topk-16 call slower
// than the kernel without it, benchmarks/NOTES_msa.md v57). Kept per (device, kernel, size).
constexpr int kShareDefault = 0;
template <typename Kernel>
int share_cluster_size(Kernel kernel, dim3 grid, int smem) {
  static const int cap = [] {
    const char* env = std::getenv("MSA_OPS_MSA_SHARE");
    if (env == nullptr || env[0] == '\0') return kShareDefault;
    const int v = std::atoi(env);
    return v >= kMaxShare ? kMaxShare : v >= 2 ? 2 : 0;
  }();
  int dev = 0;
  if (cap < 2 || !runs_sm90_code(reinterpret_cast<const void*>(kernel))) return 0;  // (its cluster instructions)
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int>, int> known;  // clusters of the size the GPU holds at once
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  for (int c = cap; c >= 2; c /= 2) {
    if (grid.x % c != 0) continue;
    int clusters = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto key = std::make_tuple(dev, reinterpret_cast<const void*>(kernel), c);
      if (auto it = known.find(key); it != known.end()) {
        clusters = it->second;
      } else {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaLaunchAttribute attr[1] = {cluster_attr(c, 1, 1)};
        const cudaLaunchConfig_t cfg = cluster_launch_config(dim3(c, 1, 1), dim3(kProdThreads), smem, nullptr, attr);
        if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
          cudaGetLastError();
          clusters = 0;
        }
        known[key] = clusters;
      }
    }
    if (static_cast<int64_t>(clusters) * c >= ctas) return c;
  }
  return 0;
}

template <typename KV>
Error launch(cudaStream_t stream, const MsaArgs& m, const char* target) {
  using S = MsaSmem<KV>;
  const AttentionArgs a = as_attention(m);
  Sm90Kv kv;  // the TMA descriptors of the pool (without them the per-token kernel serves the call)
  bool clustered = false;  // split-K partitions launched as clusters that merge in the kernel
  bool zeroed = false;     // the persistent prefill kernel zeroes the rows no sequence owns itself
  const bool prefill = m.T > 0 && m.topk > 0 && m.B > 0 && use_prefill_sm90<KV>(m) &&
                       make_sm90_kv<__nv_bfloat16, kD>(a, &kv) && kv.box_rows == kBlock;
  if (prefill) {
    static_assert(MsaPrefillWs::kBlockM == MsaPrefillSm90::kBlockM, "one query tiling for both prefill kernels");
    const int64_t tiles_x = m.B + ceil_div(static_cast<int64_t>(m.T) * m.group, MsaPrefillSm90::kBlockM);
    const int64_t ws_items = tiles_x * m.Hkv;
    static const bool ws_regs_ok = kernel_holds_regs(msa_prefill_ws_sm90_kernel, MsaPrefillWs::kLaunchRegs);
    CUtensorMap qmap;
    // (The walk's int indices: the interleaved order has up to twice the items, and ws_walk one grid more.)
    if (ws_regs_ok && ws_items <= INT32_MAX / 4 && make_msa_q_map(m, &qmap)) {
      const int sms = device_sm_count();  // persistent: one CTA per SM (or per work item when there are fewer)
      const int grid = static_cast<int>(ws_items < sms ? ws_items : sms);
      auto kernel = msa_prefill_ws_sm90_kernel;
      note_launch(kLaunchMsaPrefillWs);
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, MsaPrefillWs::kSmemAlloc);
      kernel<<<grid, MsaPrefillWs::kThreads, MsaPrefillWs::kSmemAlloc, stream>>>(a, kv, qmap, m.d_indices, m.topk,
                                                                                static_cast<int>(tiles_x));
      zeroed = true;
    } else {
      auto kernel = msa_prefill_sm90_kernel;
      note_launch(kLaunchMsaPrefillCta);
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, MsaPrefillSm90::kSmemAlloc);
      kernel<<<dim3(static_cast<int>(tiles_x), m.Hkv), MsaPrefillSm90::kThreads, MsaPrefillSm90::kSmemAlloc,
               stream>>>(a, kv, m.d_indices, m.topk);
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": prefill kernel launch failed: " + cudaGetErrorString(e));
  } else if (m.T > 0 && m.topk > 0) {
    MsaArgs m2 = m;  // (with the tensor map where the loader-warp kernel reads through it)
    const int row_blocks = (m.group + 15) / 16;
    const dim3 grid(m.T * row_blocks, m.Hkv, m.num_partitions);
    // Groups of at most 8 heads split in two: each token's partitions form a cluster and merge in the kernel.
    if (m.group <= 8)
      clustered = launch_cluster_merge(msa_attention_kernel<KV, true, true>, m.num_partitions, grid, S::kBytesTotal,
                                       stream, /*waits=*/true, m);
    if (clustered) note_launch(kLaunchMsaDecodeCluster);
    if (!clustered) {
      // The loader-warp kernel takes one SM a CTA (145 KB of shared memory, where the kernel without it fits two):
      // taken where its grid fits the SMs in one wave, as at the benchmark's decode shape where it was measured.
      const bool prod = m.group <= 8 && loader_warp_enabled() &&
                        static_cast<int64_t>(grid.x) * grid.y * grid.z <= device_sm_count();
      auto kernel = prod ? msa_attention_kernel<KV, true, false, true>
                    : m.group <= 8 ? msa_attention_kernel<KV, true> : msa_attention_kernel<KV, false>;
      const int smem = prod ? MsaSmem<KV, kProdStages>::kBytesTotal : S::kBytesTotal;
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      note_launch(kLaunchMsaDecode);
      if (prod) note_launch(kLaunchMsaDecodeLoader);
      // fp8's rows of one kv head are 128 bytes: 128-byte L2 promotion, so that no row fetches the next kv head's
      // (which no CTA of the call reads); bf16's are 256 bytes, whole 256-byte promotions.
      if (prod && use_wgmma()) {
        Sm90Kv t;  // the pool's boxes: a tile's rows, 128 bytes of each
        constexpr int kBN = KvTraits<KV>::kBN;
        const CUtensorMapL2promotion promo =
            kD * sizeof(KV) <= 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
        if (make_sm90_kv<KV, kD>(a, &t, kBN, promo) && t.box_rows == kBN) m2.kv_map = t.k, m2.kv_tma = 1;
      }
      // Work sharing within clusters of consecutive tokens (kShare), where the GPU holds them in one wave.
      auto share_kernel = msa_attention_kernel<KV, true, false, true, true>;
      constexpr int kShareSmem = MsaSmem<KV, kProdStages, true>::kBytesTotal;
      const int share = prod ? share_cluster_size(share_kernel, grid, kShareSmem) : 0;
      if (share >= 2) {
        note_launch(kLaunchMsaDecodeShare);
        cudaFuncSetAttribute(share_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShareSmem);
        cudaLaunchAttribute attr[2] = {cluster_attr(share, 1, 1), pdl_attr()};
        const bool pdl = pdl_enabled(reinterpret_cast<const void*>(share_kernel));
        const cudaLaunchConfig_t cfg =
            cluster_launch_config(grid, dim3(kProdThreads), kShareSmem, stream, attr, pdl ? 2 : 1);
        cudaLaunchKernelEx(&cfg, share_kernel, m2);
      } else {
        launch_pdl(kernel, grid, dim3(prod ? kProdThreads : kThreads), smem, stream, m2);
      }
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": kernel launch failed: " + cudaGetErrorString(e));
  }
  // Split-K merges (and zeroes rows owned by no sequence) in the dense combine kernel; unsplit, the per-token
  // kernel and the persistent prefill kernel zero those rows themselves, the CTA-per-tile prefill kernel leaves
  // them to the dense zeroing epilogue.
  if (m.T > 0 && m.topk == 0) {  // nothing selected: every row is zero
    if (cudaError_t e = cudaMemsetAsync(m.out, 0, static_cast<size_t>(m.T) * m.H * kD * 2, stream); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": memset failed: " + cudaGetErrorString(e));
  } else if (m.T > 0 && ((m.num_partitions > 1 && !clustered) || (prefill && !zeroed))) {
    if (m.num_partitions > 1) {
      note_launch(kLaunchCombine);
      split_k_combine_kernel<__nv_bfloat16, kD><<<dim3(m.T, m.H), kD, 0, stream>>>(a);
    } else {
      launch_zero_unowned_rows<__nv_bfloat16>(a, m.H * kD, stream);
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": epilogue launch failed: " + cudaGetErrorString(e));
  }
  return Error::Success();
}

}  // namespace

#if defined(MSA_OPS_MSA_STAMPS)
// Profiling builds: copies the decode kernel's phase stamps (g_msa_stamps) into `out` ([kMsaStampCtas]
// [kMsaStampCols] int64); returns the cudaError_t.
extern "C" __attribute__((visibility("default"))) int msa_ops_msa_stamps(long long* out) {
  return static_cast<int>(cudaMemcpyFromSymbol(out, g_msa_stamps, sizeof(g_msa_stamps)));
}
// Overwrites the stamps with `in` (zeros, to clear them); returns the cudaError_t.
extern "C" __attribute__((visibility("default"))) int msa_ops_msa_stamps_set(const long long* in) {
  return static_cast<int>(cudaMemcpyToSymbol(g_msa_stamps, in, sizeof(g_msa_stamps)));
}
#endif

Error MsaAttention(cudaStream_t stream, AnyBuffer q, AnyBuffer offsets, AnyBuffer cache_row_offsets, AnyBuffer kv,
                   AnyBuffer cache_lengths, AnyBuffer lut, AnyBuffer layer, AnyBuffer d_indices, double scale,
                   int64_t num_partitions, int64_t max_q, AnyResult out, AnyResult ws_o, AnyResult ws_lse) {
  const char* target = "msa_ops_msa_attention";
  // cache_row_offsets is accepted for MAX compatibility and checked, never read (SEMANTICS.md §7).
  if (auto e = check_msa_operands(target, q, offsets, cache_row_offsets, kv, cache_lengths, lut, layer, d_indices,
                                  *out, *ws_o, *ws_lse, num_partitions);
      e.failure())
    return e;
  const int64_t T = dim(q, 0), H = dim(q, 1), B = count(cache_lengths), Hkv = dim(kv, 4);
  const DataType dt = q.element_type();
  const int64_t topk = dim(d_indices, 2);
  if (topk > kMaxTopk) return invalid(target, "d_indices: topk above " + std::to_string(kMaxTopk) + " is not supported on CUDA");
  if (dim(lut, 1) >= (int64_t{1} << 30) / kBlock)
    return invalid(target, "kv_lookup_table: max_pages * 128 must be < 2^30, got " + dims_str(lut));
  if (auto e = check_int_count(target, "q's rows", T); e.failure()) return e;
  if (auto e = check_int_count(target, "B (cache_lengths)", B); e.failure()) return e;
  if (auto e = check_int_count(target, "num_blocks (kv_blocks)", dim(kv, 0)); e.failure()) return e;
  MsaArgs m{};
  m.q = q.untyped_data();
  m.out = static_cast<__nv_bfloat16*>(out->untyped_data());
  m.offsets = static_cast<const int32_t*>(offsets.untyped_data());
  m.cache_lengths = static_cast<const int32_t*>(cache_lengths.untyped_data());
  m.kv = kv.untyped_data();
  m.lookup = static_cast<const int32_t*>(lut.untyped_data());
  m.layer_ptr = static_cast<const int32_t*>(layer.untyped_data());
  m.d_indices = static_cast<const int32_t*>(d_indices.untyped_data());
  m.T = static_cast<int>(T);
  m.B = static_cast<int>(B);
  m.H = static_cast<int>(H);
  m.Hkv = static_cast<int>(Hkv);
  m.group = static_cast<int>(H / Hkv);
  m.topk = static_cast<int>(topk);
  m.num_blocks = static_cast<int>(dim(kv, 0));
  m.num_layers = static_cast<int>(dim(kv, 2));
  m.max_pages = static_cast<int>(dim(lut, 1));
  m.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  m.num_partitions = static_cast<int>(num_partitions);  // in [1, kMaxPartitions]: check_attention_output
  m.max_q = static_cast<int>(iclamp(max_q, 0, int64_t{1} << 30));
  if (m.num_partitions > 1) {  // the workspaces were checked with the output
    m.ws_o = static_cast<float*>(ws_o->untyped_data());
    m.ws_lse = static_cast<float*>(ws_lse->untyped_data());
  }
  if (dt == DataType::BF16) return launch<__nv_bfloat16>(stream, m, target);
  return launch<__nv_fp8_e4m3>(stream, m, target);
}

}  // namespace cuda
}  // namespace msa_ops

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_msa_attention, msa_ops::cuda::MsaAttention,
                              MSA_OPS_SIG_MSA_ATTENTION(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});
