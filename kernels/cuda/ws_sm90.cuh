// Pieces shared by the warp-specialized, persistent sm_90a kernels (msa_prefill_ws_sm90.cuh,
// attention_ws_sm90.cuh): mbarrier hand-overs that trap instead of hanging, named barriers, setmaxnreg, and the
// walk of a persistent CTA over its work items.
#pragma once

#include "attention_sm90.cuh"

namespace msa_ops {
namespace cuda {

#if defined(MSA_OPS_SM90_WGMMA)
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// mbar_wait that gives up: a hand-over that never comes (a protocol error) traps after ~2^26 polls (seconds)
// instead of hanging the GPU; legitimate waits here last microseconds.
__device__ __forceinline__ void mbar_wait_ws(uint32_t bar, uint32_t parity) {
  for (uint32_t i = 0;; ++i) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (i > (1u << 26)) __trap();
  }
}
template <int kId>
__device__ __forceinline__ void named_arrive(int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
template <int kId>
__device__ __forceinline__ void named_sync(int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif

// Per-item phase stamps, for profiling builds only (CMake -DMSA_OPS_WS_STAMPS=ON): clock64() at fixed points of
// CTA kWsStampCta's first kWsStampItems items, role 0 the loader, role 1 the first consumer thread, read back after
// a call by msa_ops_ws_stamps() (mha.cu; scripts/probe_ws_stamps.py). Plain stores to a __device__ array: no
// printf, whose call would split the consumers' wgmma pipeline. Compiled out otherwise.
constexpr int kWsStampCta = 5, kWsStampItems = 64, kWsStampPoints = 8;
#if defined(MSA_OPS_WS_STAMPS)
__device__ long long g_ws_stamps[2][kWsStampItems][kWsStampPoints];
__device__ __forceinline__ void ws_stamp(int role, int item, int point) {
  if (blockIdx.x == kWsStampCta && item < kWsStampItems) g_ws_stamps[role][item][point] = clock64();
}
#else
__device__ __forceinline__ void ws_stamp(int, int, int) {}
#endif

// ---- host: the launch of a persistent kernel

// The SMs of the current device: a persistent launch's CTAs at most.
inline int device_sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n > 0 ? n : 1;
}

// Whether `kernel` was compiled with at least `regs` registers a thread: setmaxnreg hands the producer's registers
// to the consumers, so the launch must hold the whole pool.
template <typename Kernel>
bool kernel_holds_regs(Kernel kernel, int regs) {
  cudaFuncAttributes fa{};
  return cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.numRegs >= regs;
}

// Q of a call, [rows][Hkv][group][d] elements of type dt, as a TMA map in boxes of (bm / group tokens) x group heads
// x 64 columns with the 128-byte swizzle: one bm-row packed query tile per d / 64 boxes. False when the group does
// not divide bm, there are no rows, or the driver's encoder is missing.
inline bool make_heads_q_map(const void* q, CUtensorMapDataType dt, int d, int64_t rows, int H, int Hkv, int group,
                             int bm, CUtensorMap* qmap) {
  if (group < 1 || group > bm || bm % group != 0 || rows < 1) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(group),
                              static_cast<cuuint64_t>(Hkv), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(d) * 2, static_cast<cuuint64_t>(group) * d * 2,
                                 static_cast<cuuint64_t>(H) * d * 2};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(group), 1, static_cast<cuuint32_t>(bm / group)};
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  return encode(qmap, dt, 4, const_cast<void*>(q), dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// ---- device: the walk

// The walk over the work items (query tile x `per_tile` items of it: kv heads, or kv heads x split-K partitions),
// heaviest first. A tile weighs about its last row's keys (causal), so the last tiles of the sequences come first:
// with several sequences, item w is (w % per_tile, tile k = w / per_tile / B from the end of sequence
// w / per_tile % B), so that the sequences' ends are interleaved; one sequence's tiles in order would leave a
// sequence's light first tiles next to another's heavy last ones. Taken for ragged queries when at most
// kWsOrderSeqs sequences and the B x (longest sequence's tiles) slots are at most twice the tiles (each empty slot
// is an item skipped); else the tiles in reverse grid order. CTA c takes items r * grid + c in even rounds r and
// r * grid + grid - 1 - c in odd ones (ws_walk): round robin over a descending order would hand CTA 0 the heaviest
// item of every round. The items of a tile (kv heads, partitions) come fastest in that order, so only ~132 /
// Hkv CTAs at a time read one kv head's K/V, and at S = 8k each head's K/V came from DRAM several times over
// (ncu on the H200: L2 hit rate 61% against the CTA-per-tile kernel's 94%, benchmarks/NOTES_mha.md v26). Two
// other walks (WsWalk) keep the CTAs that run at once on fewer kv heads:
//   * kWsHeadsSlowest, for items of one sequence that all weigh the same (no mask): the tiles in reverse grid order,
//     the items of a tile slowest;
//   * kWsBanded: the weight order above cut into bands of kWsBand tiles, the items of a tile slowest within a band
//     (the band's weights differ by at most its tiles').
constexpr int kWsOrderSeqs = 128;  // sequences the interleaved walk takes
enum WsWalk : int { kWsHeadsFastest = 0, kWsHeadsSlowest = 1, kWsBanded = 2 };
constexpr int kWsBand = 32;
constexpr int kWsOrderHead = 5;  // order[0..4] = interleave, B, items, WsWalk, tiles; then first[], tiles[]
constexpr int kWsOrderInts = kWsOrderHead + 2 * kWsOrderSeqs;
struct WsItem {
  int x_tile, sub;  // sub: the item within the tile (w % per_tile); x_tile -1: an empty slot of the interleaved walk
};
// Builds the order in shared memory; one warp. BM: query rows per tile (locate_tile's numbering).
template <int BM>
__device__ __forceinline__ void ws_order_build(const AttentionArgs& a, int tiles_x, int per_tile, int* order,
                                               int walk = kWsHeadsFastest) {
  const bool heads_slowest = walk == kWsHeadsSlowest;
  constexpr int kSeqs = kWsOrderSeqs;
  const int lane = threadIdx.x & 31;
  int* first_t = order + kWsOrderHead;
  int* tiles_t = first_t + kSeqs;
  const bool ragged = a.q_mode == kQRagged;
  int first = 0, longest = 0;
  // With at most kSeqs ragged sequences the tiles are counted here (B / 32 steps of parallel reads): the walk then
  // holds just the tiles that exist, not tiles_x, the host's bound (up to B more), whose empty items fell unevenly
  // on the CTAs (at S=512, B=32, Hkv=16: 12 to 19 real items a CTA for a mean of 15.5).
  const bool counted = ragged && a.batch <= kSeqs;
  if (counted) {
    int64_t carry = first_owned_row(a);  // the repaired offsets of locate_tile
    for (int base = 0; base < a.batch; base += 32) {
      const int b = base + lane;
      int64_t eff_prev, eff_next;
      const int n = seq_rows_step(a, base, carry, &eff_prev, &eff_next);
      const int tiles = (n * a.group + BM - 1) / BM;
      int cs = tiles, mx = tiles;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffff, cs, d);
        if (lane >= d) cs += u;
        mx = max(mx, __shfl_xor_sync(0xffffffff, mx, d));
      }
      if (b < a.batch) {
        first_t[b] = first + cs - tiles;
        tiles_t[b] = tiles;
      }
      first += __shfl_sync(0xffffffff, cs, 31);
      carry = __shfl_sync(0xffffffff, eff_next, 31);
      longest = max(longest, mx);
    }
  }
  if (lane == 0) {
    const int64_t slots = static_cast<int64_t>(a.batch) * longest;  // (tiles_x * per_tile fits an int: the host checks)
    const bool inter = counted && !heads_slowest && a.batch > 1 && longest > 0 &&
                       slots <= 2 * static_cast<int64_t>(first) && slots * per_tile <= INT32_MAX;
    const int tiles = counted ? min(first, tiles_x) : tiles_x;  // the tiles the walk covers
    order[0] = inter ? 1 : 0;
    order[1] = a.batch;
    order[2] = static_cast<int>((inter ? slots : tiles) * static_cast<int64_t>(per_tile));
    order[3] = walk;
    order[4] = tiles;
  }
}
__device__ __forceinline__ int ws_walk(int r) {
  return r * static_cast<int>(gridDim.x) + ((r & 1) ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : blockIdx.x);
}
// Item w of the order that ws_order_build left in shared memory (read there at each item: no registers held).
__device__ __forceinline__ WsItem ws_item(const int* order, int w, int per_tile) {
  const int tiles = order[4];
  if (order[3] == kWsHeadsSlowest) return WsItem{tiles - 1 - w % tiles, w / tiles};
  int v = w / per_tile, sub = w % per_tile;
  if (order[3] == kWsBanded) {  // band w / (kWsBand x per_tile): its tiles fastest
    const int band_items = kWsBand * per_tile;
    const int band = w / band_items, r = w % band_items;
    const int vb = min(kWsBand, order[2] / per_tile - band * kWsBand);  // the last band may be short
    v = band * kWsBand + r % vb;
    sub = r / vb;
  }
  if (!order[0]) return WsItem{tiles - 1 - v, sub};
  const int B = order[1];
  const int k = v / B, b = v % B;
  const int n = order[kWsOrderHead + kWsOrderSeqs + b];
  return WsItem{k < n ? order[kWsOrderHead + b] + n - 1 - k : -1, sub};
}

}  // namespace cuda
}  // namespace msa_ops
