// Pieces shared by the warp-specialized, persistent sm_90a kernels (msa_prefill_ws_sm90.cuh,
// attention_ws_sm90.cuh): mbarrier hand-overs that trap instead of hanging, named barriers, setmaxnreg, and the
// walk of a persistent CTA over its work items.
#pragma once

#include "attention_sm90.cuh"

namespace msa_ops {
namespace cuda {

#if defined(MSA_OPS_SM90_WGMMA)
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
// kWsSeqTable sequences and the B x (longest sequence's tiles) slots are at most twice the tiles (each empty slot
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
//
// The table. For ragged calls the CTA counts the tiles at its start and keeps the tiles and the repaired row offset
// before each chunk of 32 sequences (of ws_chunk_span's multiple of 32 past kWsOrderSeqs sequences, so that
// there are at most kWsOrderChunks chunks), and, for calls of at most kWsSeqTable sequences, before each sequence
// (B + 1 entries each), so that
//   * the walk holds just the tiles that exist, not tiles_x, the host's bound (up to B more), whose empty items
//     fell unevenly on the CTAs (at S=512, B=32, Hkv=16: 12 to 19 real items a CTA for a mean of 15.5);
//   * an item's sequence is found in shared memory, not by locate_tile's scan from sequence 0, which costs
//     B / 128 dependent global loads per item (~1 us each under load): a bisection of the sequences (at most
//     kWsSeqTable of them: no global load), else a bisection of the chunks and locate_tile's scan from the found
//     chunk (one round of global loads per 128 sequences of a chunk; at S=512 causal, B=32, that load cost ~7%:
//     NOTES_mha.md v30). Past kWsOrderSeqs sequences that scan once started from sequence 0: at S=32, B=2048 an
//     item took ~17 us (NOTES_mha.md v39).
// Not per sequence up to kWsOrderSeqs: shared memory past 196 KB costs the dense D=128 kernel the larger carve-out
// (L1 28 KB instead of 60), 5% at S=512 and 2k on the H200 (NOTES_mha.md v30); DenseWs asserts that it stays within.
constexpr int kWsOrderSeqs = 1024;  // sequences of the table in chunks of 32 (more: longer chunks)
constexpr int kWsSeqTable = 128;    // sequences with entries of their own (and of the interleaved walk)
constexpr int kWsOrderChunks = kWsOrderSeqs / 32;
enum WsWalk : int { kWsHeadsFastest = 0, kWsHeadsSlowest = 1, kWsBanded = 2, kWsShortSlowest = 3 };
constexpr int kWsBand = 32;
// kWsShortSlowest: the heads slowest when every sequence has at most kWsShortTiles tiles (counted calls), else
// banded. Causal on the H200 (NOTES_mha.md v31), heads slowest against banded: S=512 200-208 against 185-186
// TFLOP/s, 1k 302-314 against 294-296, 2k 395-409 against 393-395, B=256 x 256 129-134 against 124-127; the
// CTAs that run at once then share each (sequence, kv head)'s K/V through the L2, and with short sequences every
// round holds whole sequences' tiles, so their weights balance. A long sequence's tiles (64 at 8k) span a round
// or more, and a balance model of the snake walk put heads slowest 1.3-1.7x behind banded for one or two long
// sequences at 4-8 kv heads.
constexpr int kWsShortTiles = 16;
// order[0..4] = interleave, B, items, WsWalk, tiles; then first[0..kWsSeqTable] (tiles before sequence b) and
// eff[0..kWsSeqTable] (its first row), chunk_first[kWsOrderChunks] (tiles before chunk c; the build's chunk max
// [32] before that) and chunk_eff[kWsOrderChunks] (its first row), then the build's chunk tiles and longest [32]
// each.
constexpr int kWsOrderHead = 5;
constexpr int kWsOrderFirst = kWsOrderHead;
constexpr int kWsOrderEff = kWsOrderFirst + kWsSeqTable + 1;
constexpr int kWsOrderChunkFirst = kWsOrderEff + kWsSeqTable + 1;
constexpr int kWsOrderChunkEff = kWsOrderChunkFirst + kWsOrderChunks;
constexpr int kWsOrderScratch = kWsOrderChunkEff + kWsOrderChunks;
constexpr int kWsOrderInts = kWsOrderScratch + 2 * 32;
struct WsItem {
  int x_tile, sub;  // sub: the item within the tile (w % per_tile); x_tile -1: an empty slot of the interleaved walk
};
// Whether the call's sequences are in the table (every ragged call's: ws_order_build fills it, ws_locate reads it),
// and whether they have entries of their own in it (the interleaved walk and ws_locate's bisection of the sequences
// need them).
__device__ __forceinline__ bool ws_table_holds(const AttentionArgs& a) { return a.q_mode == kQRagged; }
// Sequences per chunk of the table: 32 up to kWsOrderSeqs sequences, then the multiple of 32 that keeps the chunks
// at kWsOrderChunks.
__device__ __forceinline__ int ws_chunk_span(const AttentionArgs& a) {
  return 32 * max(1, (a.batch + kWsOrderSeqs - 1) / kWsOrderSeqs);
}
__device__ __forceinline__ bool ws_table_per_seq(const AttentionArgs& a) {
  return ws_table_holds(a) && a.batch <= kWsSeqTable;
}

// Builds the order in shared memory. Called by every thread of the CTA (at least 8 warps: each warp scans up to
// four chunks of the table), with two CTA barriers; the caller's next barrier publishes the order. BM:
// query rows per tile (locate_tile's numbering).
template <int BM>
__device__ __forceinline__ void ws_order_build(const AttentionArgs& a, int tiles_x, int per_tile, int* order,
                                               int walk = kWsHeadsFastest) {
  constexpr int kPer = 4;  // chunks a warp: 8 warps cover the table's 32 chunks
  static_assert(kWsOrderChunks <= 8 * kPer && kWsOrderChunks <= 32 && kWsOrderSeqs % 32 == 0,
                "chunks of the table: 8 warps, 32 lanes");
  static_assert(kWsSeqTable <= kWsOrderSeqs && kWsOrderChunks == 32, "the table's parts (chunk max in chunk_first)");
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  int* first_t = order + kWsOrderFirst;
  int* eff_t = order + kWsOrderEff;
  int* chunk_first = order + kWsOrderChunkFirst;
  int* chunk_eff = order + kWsOrderChunkEff;
  int* c_max = chunk_first;                  // per chunk: the max of its raw offsets (steps 1-2)
  int* c_tiles = order + kWsOrderScratch;    // its tiles
  int* c_long = c_tiles + 32;                // its longest sequence's tiles
  const int B = a.batch;
  const bool counted = ws_table_holds(a);
  const bool per_seq = ws_table_per_seq(a);
  const int span = ws_chunk_span(a);  // sequences per chunk (32 unless B > kWsOrderSeqs)
  const int nchunks = counted ? (B + span - 1) / span : 0;
  // 1. Every chunk's raw offsets[b + 1], the first 32 of each chunk all at once; the chunk's max.
  int64_t v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = warp + i * nwarps;
    v[i] = c < nchunks ? seq_end_raw(a, c * span + lane) : INT64_MIN;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = warp + i * nwarps;
    if (c >= nchunks) break;
    int64_t m = v[i];
#pragma unroll 4
    for (int s = 32; s < span; s += 32) m = imax(m, seq_end_raw(a, c * span + s + lane));
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = imax(m, __shfl_xor_sync(0xffffffff, m, d));
    // Clamped to [0, T] (int) without changing the repaired offsets: eff = min(max(carry, v), T), carry in [0, T].
    if (lane == 0) c_max[c] = static_cast<int>(iclamp(m, 0, a.total_rows));
  }
  __syncthreads();
  // 2. Each chunk's carry (eff at its first sequence) from the chunks before it; its steps of the repaired-offsets
  // scan (seq_rows_step), 32 sequences each; tiles and their sum-scan within the chunk (per_seq: one step).
  const int64_t lo = counted ? first_owned_row(a) : 0;
  int cs[kPer], tl[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = warp + i * nwarps;
    cs[i] = tl[i] = 0;
    if (c >= nchunks) break;
    int64_t carry = imax(lo, lane < c ? static_cast<int64_t>(c_max[lane]) : 0);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) carry = imax(carry, __shfl_xor_sync(0xffffffff, carry, d));
    carry = imin(carry, a.total_rows);
    if (lane == 0) chunk_eff[c] = static_cast<int>(carry);
    int total = 0, mx = 0;  // the chunk's tiles before this step, its longest sequence's
    int64_t raw = v[i];
    for (int s = 0; s < span; s += 32) {
      const int b = c * span + s + lane;
      const int64_t raw_next = s + 32 < span ? seq_end_raw(a, b + 32) : 0;  // (loaded before this step's scan)
      int64_t eff_prev, eff_next;
      int n, tiles;
      const int x = seq_tiles_step<BM>(a, c * span + s, raw, carry, &eff_prev, &eff_next, &n, &tiles);
      mx = max(mx, tiles);
      cs[i] = x;
      tl[i] = tiles;
      if (per_seq && b < B) eff_t[b] = static_cast<int>(eff_prev);
      if (per_seq && b == B - 1) eff_t[B] = static_cast<int>(eff_next);
      total += __shfl_sync(0xffffffff, x, 31);
      carry = __shfl_sync(0xffffffff, eff_next, 31);
      raw = raw_next;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffff, mx, d));
    if (lane == 31) {
      c_tiles[c] = total;
      c_long[c] = mx;
    }
  }
  __syncthreads();
  // 3. The tiles before each chunk and (at most kWsSeqTable sequences) each sequence; the header.
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = warp + i * nwarps;
    if (c >= nchunks) break;
    int before = lane < c ? c_tiles[lane] : 0;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) before += __shfl_xor_sync(0xffffffff, before, d);
    const int b = c * span + lane;  // (per_seq: span is 32)
    if (lane == 0) chunk_first[c] = before;
    if (per_seq && b < B) first_t[b] = before + cs[i] - tl[i];
    if (per_seq && b == B - 1) first_t[B] = before + cs[i];
  }
  if (warp == 0) {
    int total = 0, longest = 0;
    if (lane < nchunks) {
      total = c_tiles[lane];
      longest = c_long[lane];
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      total += __shfl_xor_sync(0xffffffff, total, d);
      longest = max(longest, __shfl_xor_sync(0xffffffff, longest, d));
    }
    if (lane == 0) {
      if (nchunks == 0) {  // B == 0 (no tiles: no item reads the table) or not counted
        first_t[0] = 0;
        eff_t[0] = static_cast<int>(lo);
      }
      if (walk == kWsShortSlowest) walk = counted && longest <= kWsShortTiles ? kWsHeadsSlowest : kWsBanded;
      const int64_t slots = static_cast<int64_t>(B) * longest;  // (tiles_x * per_tile fits an int: the host checks)
      const bool inter = counted && walk != kWsHeadsSlowest && B > 1 && per_seq && longest > 0 &&
                         slots <= 2 * static_cast<int64_t>(total) && slots * per_tile <= INT32_MAX;
      const int tiles = counted ? min(total, tiles_x) : tiles_x;  // the tiles the walk covers
      order[0] = inter ? 1 : 0;
      order[1] = B;
      order[2] = static_cast<int>((inter ? slots : tiles) * static_cast<int64_t>(per_tile));
      order[3] = walk;
      order[4] = tiles;
    }
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
  const int first = order[kWsOrderFirst + b], n = order[kWsOrderFirst + b + 1] - first;
  return WsItem{k < n ? first + n - 1 - k : -1, sub};
}
// The last i in [0, n) with first[i] <= tile, for non-decreasing first[] with first[0] <= tile.
__device__ __forceinline__ int ws_bisect(const int* first, int n, int tile) {
  int lo = 0, hi = n;  // first[lo] <= tile; i >= hi: first[i] > tile (or past the end)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (first[mid] <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}
// locate_tile of `tile` (whole warps), from the order's table for ragged calls: a bisection over the tiles before
// each sequence (at most kWsSeqTable of them), else before each chunk (the last
// chunk whose first tile is at most `tile`; chunks of no tiles share their successor's first tile) and locate_tile's
// scan from that chunk, which finds it within the chunk's span / 128 rounds of loads.
template <int BM>
__device__ __forceinline__ SeqTile ws_locate(const AttentionArgs& a, const int* order, int tile) {
  if (a.q_mode != kQRagged) return locate_tile<BM>(a, tile);
  SeqTile st;
  st.b = -1;
  if (ws_table_per_seq(a)) {
    const int* first = order + kWsOrderFirst;
    const int* eff = order + kWsOrderEff;
    const int B = a.batch;
    if (tile >= first[B]) {  // past the last tile: as locate_tile
      st.row0 = first[B];
      st.pos0 = eff[B];
      return st;
    }
    const int lo = ws_bisect(first, B, tile);  // tile < first[B]
    st.b = lo;
    st.q_base = eff[lo];
    st.n_q = eff[lo + 1] - eff[lo];
    st.row0 = (tile - first[lo]) * BM;
  } else {  // ragged calls keep the chunks in the table (ws_table_holds)
    const int* first = order + kWsOrderChunkFirst;
    const int span = ws_chunk_span(a);
    const int lo = ws_bisect(first, (a.batch + span - 1) / span, tile);  // past the last tile: the last chunk
    int tiles_before = first[lo];
    int64_t carry = order[kWsOrderChunkEff + lo];
    if (!scan_tiles<BM>(a, tile, lo * span, &carry, &tiles_before, &st)) return st;  // past the last tile
  }
  locate_keys(a, &st);
  return st;
}

// Rows owned by no sequence, zeroed by `warps` whole warps of each CTA, the caller being number `warp` of them
// (zero_unowned_rows_warp: warp w of CTA c takes every (warps x grid)-th row from row c x warps + w). Ragged, the
// owned range [eff[0], eff[B]) comes from the order's table: its entries per sequence (no global load), else its
// first chunk's row and the end that ws_locate finds past the last tile (one round of loads from the last chunk,
// where owned_rows would read all B + 1 offsets).
template <int BM, typename T>
__device__ __forceinline__ void ws_zero_unowned_rows(const AttentionArgs& a, const int* order, int row_elems,
                                                     int warp = 0, int warps = 1) {
  OwnedRows own{0, 0};  // (padded calls test their rows instead)
  if (ws_table_per_seq(a)) {
    own = OwnedRows{order[kWsOrderEff], order[kWsOrderEff + a.batch]};
  } else if (a.q_mode == kQRagged) {
    own = OwnedRows{order[kWsOrderChunkEff], ws_locate<BM>(a, order, order[4]).pos0};
  }
  zero_unowned_rows_warp<T>(a, row_elems, own, blockIdx.x * warps + warp, gridDim.x * warps);
}

}  // namespace cuda
}  // namespace msa_ops
