// Hopper (sm_90a) dense flash-attention prefill, warp-specialized and persistent: the 128-row query tiles of
// attention_sm90_kernel (same contract, masks, softmax and epilogue), with the per-tile and per-item fixed costs
// taken off the tensor cores' path, as msa_prefill_ws_sm90.cuh does for the block-sparse kernel.
//
// One CTA per SM walks the work items (query tile x kv head x split-K partition; the kv heads slowest with no mask or
// short sequences, else heaviest first in bands: ws_sm90.cuh) with three warpgroups (four with DenseWs<64, 3>):
//   * warp 0 (the loader) issues every TMA: an item's Q (D/64 boxes of [BM/group tokens][group heads][64]) into
//     one of two Q buffers, with the item's place (ws_locate, next to the buffer: the consumers do not wait on
//     its global reads), then the item's K and V tiles into K and V rings (V one tile behind K), each tile with
//     the mask of its present keys (a page-table entry naming no page of the pool, or keys past the sequence);
//     After its walk it zeroes the output rows that no sequence owns (unsplit calls; ws_zero_unowned_rows), while
//     the consumers finish their last item, so that no launch follows the kernel;
//   * warps 1-3 exit once the whole CTA has built the walk's order (ws_order_build);
//   * warpgroups 1 and 2 (the consumers; 1-3 on the 192-row items of DenseWs<64, 3>) run attention_sm90_kernel's
//     wgmma pipeline over 64 rows each and take turns issuing each step's MMAs (named barriers 3 and 4; 3-5), so
//     that one's softmax runs under the others' MMAs;
//     then they store their rows through their part of the Q buffer (unsplit: a warp's 16 rows of the sequence by
//     one TMA store, a partial slice by the lanes) or write the partition's partials.
// Every hand-over is an mbarrier (full: TMA bytes; empty: the consumers' arrivals) per Q buffer and ring stage,
// so the next item's Q and first K/V tiles load while the consumers finish the current one, and the consumers
// never wait at a CTA-wide barrier. The producer warpgroup gives registers to the consumers (setmaxnreg).
//
// Served where group divides the tile's rows, 128 (192 with three consumer warpgroups: Q by TMA); mha.cu keeps
// attention_sm90_kernel otherwise, and always with MSA_OPS_DENSE_WS=0. Head dims 64, 128 and 256 (at 256: one Q
// buffer and 64-key K/V tiles, DenseWs). At head dim 64 mha.cu takes the three consumer warpgroups where ws3_wanted
// says so.
#pragma once

#include "ws_sm90.cuh"

namespace msa_ops {
namespace cuda {

// An item as the loader hands it to the consumers with its Q buffer.
struct DenseWsItem {
  SeqTile st;
  int hkv, part;
};

// W: consumer warpgroups, each taking 64 rows of the W x 64-row query tile. Three (head dim 64 only) put three
// warps on each scheduler to hide the exponentials' latency (benchmarks/NOTES_mha.md v50, v51), at 160 registers a
// consumer thread.
template <int D, int W = 2>
struct DenseWs {
  static_assert(W == 2 || (W == 3 && D == 64), "consumer warpgroups");
  static constexpr int kThreads = 128 * (W + 1);
  static constexpr int kConsumerThreads = 128 * W;
  // Head dim 256 (kWide): O takes 128 registers a consumer thread (64 x 256 f32 a warpgroup), so the consumers take
  // more; a Q tile takes 64 KB, so there is one Q buffer (the next item's Q loads once the current item's rows have
  // left through it) and K and V go in 64-key tiles, as in attention_sm90_kernel's split rings.
  static constexpr bool kWide = D > 128;
  static constexpr int kProducerRegs = W == 3 ? 32 : kWide ? 40 : 56;
  static constexpr int kConsumerRegs = W == 3 ? 160 : kWide ? 232 : 224;
  // __launch_bounds__(kThreads, 1): what setmaxnreg redistributes
  static constexpr int kLaunchRegs = W == 3 ? 128 : 168;
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * kLaunchRegs, "register pool");
  static constexpr int kBlockM = 64 * W;
  static constexpr int kBlockN = kWide ? 64 : 128;
  static constexpr int kStages = D == 64 ? 4 : 2;  // of the K ring and of the V ring
  static constexpr int kQBufs = kWide ? 1 : 2;
  static constexpr int kTileBytes = kBlockN * D * 2;  // one K or V tile
  static constexpr int kQBytes = kBlockM * D * 2;     // one Q buffer
  // shared memory (bytes from the 1024-aligned base)
  static constexpr int kOffQ = 0;                                // kQBufs buffers
  static constexpr int kOffK = kOffQ + kQBufs * kQBytes;         // kStages
  static constexpr int kOffV = kOffK + kStages * kTileBytes;     // kStages
  static constexpr int kOffMask = kOffV + kStages * kTileBytes;  // [kStages][4]: the K tile's present keys
  static constexpr int kOffOrder = kOffMask + kStages * 16;      // ws_order_build's [kWsOrderInts]
  static constexpr int kOffItem = (kOffOrder + kWsOrderInts * 4 + 15) / 16 * 16;  // [2] DenseWsItem per Q buffer
  static constexpr int kOffBar = (kOffItem + 2 * static_cast<int>(sizeof(DenseWsItem)) + 7) / 8 * 8;
  // mbarriers: Q full/empty [2], then K full, K empty, V full, V empty [kStages] each
  static constexpr int kBarQFull = 0, kBarQEmpty = 2, kBarKFull = 4, kBarKEmpty = 4 + kStages,
                       kBarVFull = 4 + 2 * kStages, kBarVEmpty = 4 + 3 * kStages, kBars = 4 + 4 * kStages;
  static constexpr int kSmemBytes = kOffBar + kBars * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory of one CTA on sm_90");
  // Within the 196 KB carve-out (with the 1 KB the driver keeps per CTA), which leaves L1 60 KB: past it the D=128
  // kernel ran 5% slower at S=512 and 2k (benchmarks/NOTES_mha.md v30).
  static_assert(D != 128 || kSmemAlloc + 1024 <= 196 * 1024, "shared memory of the D=128 kernel: L1 carve-out");
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
};

// The Q buffer of a set's item number qi (C: DenseWs or DenseWsPair, C::kQBufs buffers taken in turn), and the parity
// of that buffer's barriers for it.
template <class C>
__host__ __device__ constexpr int ws_qbuf(int qi) {
  return C::kQBufs == 1 ? 0 : qi & 1;
}
template <class C>
__host__ __device__ constexpr int ws_qphase(int qi) {
  return C::kQBufs == 1 ? qi & 1 : (qi >> 1) & 1;
}

// Host: Q of the call for the loader's TMA in boxes of `rows` rows (make_heads_q_map), or false (group not dividing
// rows, Q not 16-byte aligned, no driver encoder, MSA_OPS_DENSE_WS=0): then another kernel serves the call.
template <typename T, int D>
bool make_dense_q_map(const AttentionArgs& a, CUtensorMap* qmap, int rows = DenseWs<D>::kBlockM) {
  const char* env = std::getenv("MSA_OPS_DENSE_WS");
  if (env != nullptr && env[0] == '0') return false;
  if ((reinterpret_cast<uintptr_t>(a.q) & 15) != 0) return false;
  const CUtensorMapDataType dt =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return make_heads_q_map(a.q, dt, D, a.total_rows, a.H, a.Hkv, a.group, rows, qmap);
}

// Rows of one TMA store of the output: a consumer warp's.
constexpr int kWsStoreRows = 16;

// Host: the output of an unsplit call as the consumers' TMA store target (make_heads_q_map, boxes of kWsStoreRows
// rows), or false (split-K calls, group not dividing kWsStoreRows, the output not 16-byte aligned,
// MSA_OPS_DENSE_WS_STORE=0): then every lane stores its part of the rows.
template <typename T, int D>
bool make_dense_out_map(const AttentionArgs& a, CUtensorMap* omap) {
  if (a.num_partitions > 1) return false;
  const char* env = std::getenv("MSA_OPS_DENSE_WS_STORE");
  if (env != nullptr && env[0] == '0') return false;
  if ((reinterpret_cast<uintptr_t>(a.out) & 15) != 0) return false;
  const CUtensorMapDataType dt =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return make_heads_q_map(a.out, dt, D, a.total_rows, a.H, a.Hkv, a.group, kWsStoreRows, omap);
}

#if defined(MSA_OPS_SM90_WGMMA)
// The mbarriers of a set of Q buffers and K / V rings (C: DenseWs or DenseWsPair, whose offsets they share) at
// shared address b0: full barriers wait for one arrival (with the TMA bytes), empty ones for every consumer thread.
template <class C>
__device__ __forceinline__ void ws_init_bars(uint32_t b0) {
  auto bar = [&](int i) { return b0 + 8 * i; };
  for (int i = 0; i < C::kQBufs; ++i) {
    mbar_init(bar(C::kBarQFull + i), 1);
    mbar_init(bar(C::kBarQEmpty + i), C::kConsumerThreads);
  }
  for (int i = 0; i < C::kStages; ++i) {
    mbar_init(bar(C::kBarKFull + i), 1);
    mbar_init(bar(C::kBarKEmpty + i), C::kConsumerThreads);
    mbar_init(bar(C::kBarVFull + i), 1);
    mbar_init(bar(C::kBarVEmpty + i), C::kConsumerThreads);
  }
}

// The unsplit epilogue's stores, after wg_stage_rows has put a warp's 16 rows, normalized, into its rows of the Q
// buffer (the layout of a 16-row TMA box): one TMA store per 64 columns when all 16 rows belong to the sequence and
// tma_store is set (omap: make_dense_out_map), lane 0 waiting only until the boxes have been read; otherwise each lane
// stores its part (warp_store_staged). Either way the warp may hand the buffer back once this returns.
template <typename T, int D, int BM>
__device__ __forceinline__ void ws_store_staged(const AttentionArgs& a, const SeqTile& st, int rows_seq, int warp_row0,
                                                int hkv, int group, int lane, unsigned char* stage,
                                                const CUtensorMap* omap, int tma_store) {
  if (tma_store != 0 && st.row0 + warp_row0 + kWsStoreRows <= rows_seq) {
    fence_proxy_async();  // the staged rows, before the async proxy reads them
    __syncwarp();
    if (lane == 0) {
      const int tok = st.q_base + (st.row0 + warp_row0) / group;  // group divides kWsStoreRows (make_dense_out_map)
#pragma unroll
      for (int h = 0; h < D / 64; ++h) tma_store_4d(omap, smem_addr(stage + h * BM * 128), h * 64, 0, hkv, tok);
      bulk_commit();
      bulk_wait_read();  // (as CUTLASS's epilogues end: the grid's end waits for the writes themselves)
    }
  } else {
    __syncwarp();
    warp_store_staged<T, D>(a, st, rows_seq, warp_row0, hkv, lane, stage, BM * 128);
    fence_proxy_async();  // this thread's generic accesses to the buffer, before the loader's next TMA into it
  }
}

// One set of Q buffers and K / V rings with their mbarriers (C: DenseWs or DenseWsPair): the whole shared memory of
// attention_ws_sm90_kernel, or one pair's part of attention_ws_pair_sm90_kernel's.
struct WsSet {
  uint32_t base;     // shared address of the set (Q buffers at C::kOffQ, the K and V rings at C::kOffK, C::kOffV)
  uint32_t bars;     // the set's first mbarrier (ws_init_bars)
  uint32_t* mask;    // [C::kStages][4]: each K tile's present keys
  DenseWsItem* item;  // [2]: the item of each Q buffer
  __device__ __forceinline__ uint32_t bar(int i) const { return bars + 8 * i; }
};

// The loader warp's part of item number qi of its set: once the consumers have released its Q buffer (ws_qbuf), the
// item's place (st, read by the consumers instead of locating it again) and its Q (D/64 TMA boxes of [BM/group
// tokens][group heads][64]); then its K and V tiles (V one tile behind K) into ring positions gk, gk + 1, ..., each
// K tile with the mask of its present keys (a page-table entry naming no page of the pool, or keys past the
// sequence). Returns the number of tiles, by which the ring position advances (0 for a place past the last tile,
// st.b < 0: its buffer holds no Q). stamp: this warp records the profiling build's loader stamps.
template <typename T, int D, class C>
__device__ __forceinline__ int ws_load_item(const AttentionArgs& a, const Sm90Kv& kvm, const CUtensorMap* qmap,
                                            const WsSet& set, const SeqTile& st, int hkv, int part, int qi, int gk,
                                            int layer, bool layer_ok, int lane, bool stamp) {
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages;
  const int qb = ws_qbuf<C>(qi);
  if (lane == 0) {
    if (stamp) ws_stamp(0, qi, 1);
    mbar_wait_ws(set.bar(C::kBarQEmpty + qb), ws_qphase<C>(qi) ^ 1);
    if (stamp) ws_stamp(0, qi, 2);
    set.item[qb] = DenseWsItem{st, hkv, part};  // written before the buffer's full barrier is arrived on
    if (st.b >= 0) {
      mbar_expect_tx(set.bar(C::kBarQFull + qb), C::kQBytes);
      const int tok = st.q_base + st.row0 / a.group;  // row0 is a multiple of BM, and group divides BM
#pragma unroll
      for (int h = 0; h < D / 64; ++h)
        tma_load_4d(set.base + C::kOffQ + qb * C::kQBytes + h * BM * 128, qmap, set.bar(C::kBarQFull + qb), h * 64, 0,
                    hkv, tok);  // rows past the tensor: zeros
    } else {
      mbar_arrive(set.bar(C::kBarQFull + qb));
    }
    if (stamp) ws_stamp(0, qi, 3);
  }
  if (st.b < 0) return 0;
  const TileKeys tk = tile_keys<BM, BN>(a, st, part);
  if (stamp && lane == 0) ws_stamp(0, qi, 4);
  const bool paged = a.kv_mode == kKvPaged;
  const int rb = kvm.box_rows;  // key rows per box: one page, or a whole tile
  const int nbox = BN / rb;
  const int rb_shift = __ffs(rb) - 1;
  const int kmax = static_cast<int>(st.kmax);
  const int32_t* lut_row = paged ? a.lookup + static_cast<int64_t>(st.b) * a.max_pages : nullptr;
  auto fetch = [&](int tile) { return box_page_entry<BN>(a, paged, lut_row, tile, lane, nbox, rb, kmax, layer_ok); };
  // K (v false) or V of `tile` into ring slot gj % S, once the set's consumers have released it. With K goes the
  // tile's present-key mask (which the consumers read before they release the slot).
  auto issue = [&](int tile, int gj, bool v, int32_t entry) {
    const int stage = gj % S;
    const uint32_t full = set.bar((v ? C::kBarVFull : C::kBarKFull) + stage);
    mbar_wait_ws(set.bar((v ? C::kBarVEmpty : C::kBarKEmpty) + stage), ((gj / S) & 1) ^ 1);
    const int my_page = pool_page(a, entry);
    const int key0 = tile * BN;
    if (!v) write_present_mask<BN>(set.mask, stage, paged, lane, nbox, rb_shift, key0, kmax, my_page);
    if (lane == 0) mbar_expect_tx(full, C::kTileBytes);  // release: lane 0's mask words
    const uint32_t dst = set.base + (v ? C::kOffV : C::kOffK) + stage * C::kTileBytes;
    const CUtensorMap* map = v ? &kvm.v : &kvm.k;
    tma_load_kv_blocks<D / 64, BN>(a, paged, dst, map, full, 0, hkv, lane, nbox, rb, key0, my_page,
                                   (v ? a.num_layers : 0) + layer, st.kv_base);
  };
  const int n = tk.num_tiles;
  int32_t e_cur = n > 0 ? fetch(tk.tile_first) : -1, e_prev = -1;
  for (int j = 0; j < n; ++j) {
    const int tile = tk.tile_first + j;
    const int32_t e_next = j + 1 < n ? fetch(tile + 1) : -1;
    issue(tile, gk + j, false, e_cur);
    if (j == 0 && stamp && lane == 0) ws_stamp(0, qi, 5);
    if (j > 0) issue(tile - 1, gk + j - 1, true, e_prev);
    e_prev = e_cur;
    e_cur = e_next;
  }
  if (n > 0) issue(tk.tile_first + n - 1, gk + n - 1, true, e_prev);
  if (stamp && lane == 0) ws_stamp(0, qi, 6);
  return n;
}
#endif

// tiles_x: the host's bound on the query tiles of the call (locate_tile's numbering); the items are the tiles
// (counted by ws_order_build where it can, else tiles_x) x Hkv x partitions, walked as `walk` (WsWalk) says.
template <typename T, int D, int W = 2>
__global__ void __launch_bounds__(DenseWs<D, W>::kThreads, 1)
    attention_ws_sm90_kernel(const AttentionArgs a, const __grid_constant__ Sm90Kv kvm,
                             const __grid_constant__ CUtensorMap qmap, int tiles_x, int walk,
                             const __grid_constant__ CUtensorMap omap, int tma_store) {
#if defined(MSA_OPS_SM90_WGMMA)
  using C = DenseWs<D, W>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages;
  constexpr int NS = BN / 8, ND = D / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sbase;
  const uint32_t s0 = smem_align_1024(smem_raw, &sbase);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(sbase + C::kOffMask);
  int* sOrder = reinterpret_cast<int*>(sbase + C::kOffOrder);
  DenseWsItem* sItem = reinterpret_cast<DenseWsItem*>(sbase + C::kOffItem);
  const uint32_t sBar = s0 + C::kOffBar;
  auto bar = [&](int i) { return sBar + 8 * i; };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per_tile = a.Hkv * (a.num_partitions > 1 ? a.num_partitions : 1);
  if (tid == 0) {
    ws_init_bars<C>(sBar);
    mbar_init_fence();
  }
  ws_order_build<BM>(a, tiles_x, per_tile, sOrder, walk);  // every thread
  __syncthreads();

  if (warp < 4) {
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp != 0) return;
    // ------------------------------------------------------------------ loader (warp 0)
    const WsSet set{s0, sBar, sMask, sItem};
    bool layer_ok = true;
    const int layer = tma_kv_layer(a, &layer_ok);
    int gk = 0, qi = 0;  // tiles and items seen
    for (int r = 0;; ++r) {
      const int w = ws_walk(r);
      if (w >= sOrder[2]) break;  // the number of items
      if (lane == 0) ws_stamp(0, qi, 0);  // loader stamps: item start, placed, Q buffer free, Q issued,
      const WsItem it = ws_item(sOrder, w, per_tile);  // key range known, K 0 issued, all issued
      if (it.x_tile < 0) continue;
      const SeqTile st = ws_locate<BM>(a, sOrder, it.x_tile);
      gk += ws_load_item<T, D, C>(a, kvm, &qmap, set, st, it.sub % a.Hkv, it.sub / a.Hkv, qi++, gk, layer, layer_ok,
                                  lane, true);
    }
    if (a.num_partitions <= 1) ws_zero_unowned_rows<BM, T>(a, sOrder, a.H * D);
  } else {
    // ------------------------------------------------------------------ consumers (warpgroups 1 to W)
    setmaxnreg_inc<C::kConsumerRegs>();
    const int ctid = tid - 128;  // 0..W x 128 - 1
    const int cwg = ctid / 128;
    const int warp_row0 = cwg * 64 + (warp % 4) * 16;  // first tile row of this warp
    const float sl2 = a.scale_log2;
    // Turns at the tensor cores (msa_prefill_ws_sm90.cuh): every warpgroup issues the same steps of the same items,
    // in the order 0, 1 (, 2), 0, ...; warpgroup W - 1's first arrival lets warpgroup 0 start. Each named barrier
    // (3, 4, 5 for warpgroups 0, 1, 2) takes 256 threads: its warpgroup waiting, the one before it arriving.
    auto turn = [&] {
      if constexpr (W == 2) {
        cwg == 0 ? named_sync<3>(C::kConsumerThreads) : named_sync<4>(C::kConsumerThreads);
      } else {
        cwg == 0 ? named_sync<3>(256) : cwg == 1 ? named_sync<4>(256) : named_sync<5>(256);
      }
    };
    auto pass = [&] {
      if constexpr (W == 2) {
        cwg == 0 ? named_arrive<4>(C::kConsumerThreads) : named_arrive<3>(C::kConsumerThreads);
      } else {
        cwg == 0 ? named_arrive<4>(256) : cwg == 1 ? named_arrive<5>(256) : named_arrive<3>(256);
      }
    };
    if (cwg == W - 1) named_arrive<3>(256);
    int g = 0, qi = 0;
    float o[ND * 4];
    float s[NS * 4];
    uint32_t pf[BN / 16][4];
    float corr[2];
    for (int r = 0;; ++r) {
      const int w = ws_walk(r);
      if (w >= sOrder[2]) break;
      const WsItem it = ws_item(sOrder, w, per_tile);
      if (it.x_tile < 0) continue;
      const int qb = ws_qbuf<C>(qi);
      // consumer stamps: item start, Q landed, K 0 landed, first turn, first step done, last step done, last P.V
      // done, rows stored
      if (ctid == 0) ws_stamp(1, qi, 0);
      mbar_wait_ws(bar(C::kBarQFull + qb), ws_qphase<C>(qi));
      if (ctid == 0) ws_stamp(1, qi, 1);
      const DenseWsItem item = sItem[qb];  // the loader's ws_locate
      const SeqTile& st = item.st;
      if (st.b < 0) {  // past the last tile: the buffer holds no Q
        mbar_arrive(bar(C::kBarQEmpty + qb));
        ++qi;
        continue;
      }
      const int hkv = item.hkv, part = item.part;
      const int group = a.group;
      const TileKeys tk = tile_keys<BM, BN>(a, st, part);
      const int rows_seq = tk.rows_seq;
      const int kmax = static_cast<int>(st.kmax);
      const int tile_first = tk.tile_first, n = tk.num_tiles;
      int row_lo[2], row_hi[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int pr = st.row0 + warp_row0 + lane / 4 + i * 8;
        const RowKeys rk = row_keys(a, st, group, rows_seq, tk.k_lo, tk.k_hi, pr);
        row_lo[i] = rk.lo;
        row_hi[i] = rk.hi;
      }
      const RowKeys full = full_keys(tk);
      const int full_lo = full.lo, full_hi = full.hi;
      // The item's first nw tiles hold every key this warpgroup's rows see: a row's last visible key never falls as
      // the row moves down (every mask of visible_keys), so the warpgroup's last row of the sequence bounds them.
      // The tiles past it (on the causal diagonal, the keys of the rows below; all of them where the warpgroup's
      // rows lie past the sequence) take their turns and release their slots without MMAs. Only with 64-key tiles
      // (head dim 256), where every causal diagonal puts a whole tile past the first warpgroup's rows: there it
      // measured 1-7% faster; the three warpgroups of head dim 64 ran 15% slower with it at S=512 causal and no
      // faster at 1k-8k (benchmarks/NOTES_mha.md v52), and the 128-key tiles of two warpgroups skip nothing at a
      // cache that is a multiple of 128.
      constexpr bool kTailSkip = BN == 64;
      int nw = n;
      if (kTailSkip && a.wg_tail_skip) {
        const int wg_row0 = st.row0 + cwg * 64;
        int64_t hw = 0;
        if (wg_row0 < rows_seq) {
          const int64_t p_last = st.pos0 + (min(wg_row0 + 63, rows_seq - 1)) / group;
          hw = imin(visible_keys(a.mask, a.window, p_last, st.kmax).hi, tk.k_hi);
        }
        nw = hw > tk.k_lo ? min(n, static_cast<int>((hw + BN - 1) / BN) - tile_first) : 0;
        nw = warp_uniform(nw);
      }
#pragma unroll
      for (int i = 0; i < ND * 4; ++i) o[i] = 0.f;
      float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
      const uint32_t q_wg = s0 + C::kOffQ + qb * C::kQBytes + cwg * 64 * 128;
      auto sK = [&](int gj) { return s0 + C::kOffK + (warp_uniform(gj) % S) * C::kTileBytes; };
      auto sV = [&](int gj) { return s0 + C::kOffV + (warp_uniform(gj) % S) * C::kTileBytes; };
      uint32_t present[BN / 32];
      // K of tile j landed; its present-key mask read before the slot is released.
      auto wait_k = [&](int gj) {
        mbar_wait_ws(bar(C::kBarKFull + gj % S), (gj / S) & 1);
#pragma unroll
        for (int wd = 0; wd < BN / 32; ++wd) present[wd] = sMask[(gj % S) * 4 + wd];
      };
      auto wait_v = [&](int j, int gj) {  // V of tile j landed; its rows past the sequence's keys are zeroed
        mbar_wait_ws(bar(C::kBarVFull + gj % S), (gj / S) & 1);
        const int n_exist = kmax - (tile_first + j) * BN;
        // The same tile for both warpgroups: both take this branch. n_exist < 0: a tile wholly past the keys (a
        // window past a cache that overflows its page table puts such tiles in the key range).
        if (n_exist < BN) {
          zero_rows_sw128<BN, D, C::kConsumerThreads>(sbase + C::kOffV + (gj % S) * C::kTileBytes, max(n_exist, 0),
                                                      ctid);
          fence_proxy_async();
          named_sync<2>(C::kConsumerThreads);
        }
      };
      // Online softmax of tile j (wg_dense_softmax); the exponentials stay in s.
      auto softmax = [&](int j) {
        wg_dense_softmax<NS>(s, present, (tile_first + j) * BN, full_lo, full_hi, row_lo, row_hi, m_run, l_run, corr,
                             sl2, a.rescale_slack_log2, lane);
      };
      // K of tile j, which this warpgroup's rows do not see: waited for (its slot's phase) and released unread.
      auto unused_k = [&](int j) {
        wait_k(g + j);
        mbar_arrive(bar(C::kBarKEmpty + (g + j) % S));
      };
      if (nw > 0) {
        wait_k(g);
        if (ctid == 0) ws_stamp(1, qi, 2);
        turn();
        if (ctid == 0) ws_stamp(1, qi, 3);
        wgmma_fence();
        wg_qk<T, BM, BN, D>(s, q_wg, sK(g));
        pass();
        wgmma_wait<0>();
        fence_regs<NS * 4>(s);
        mbar_arrive(bar(C::kBarKEmpty + g % S));
        softmax(0);
        wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
        if (ctid == 0) ws_stamp(1, qi, 4);
        for (int j = 1; j < nw; ++j) {
          wait_k(g + j);
          wait_v(j - 1, g + j - 1);
          fence_regs<ND * 4>(o);
          turn();
          wgmma_fence();
          wg_qk<T, BM, BN, D>(s, q_wg, sK(g + j));
          wg_pv<T, BN, D>(o, pf, sV(g + j - 1));
          pass();
          wgmma_wait<1>();
          fence_regs<NS * 4>(s);
          mbar_arrive(bar(C::kBarKEmpty + (g + j) % S));
          softmax(j);
          wgmma_wait<0>();
          fence_regs<ND * 4>(o);
          mbar_arrive(bar(C::kBarVEmpty + (g + j - 1) % S));
          wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
        }
        if (ctid == 0) ws_stamp(1, qi, 5);
        if (kTailSkip && nw < n) unused_k(nw);  // step nw's K tile: past this warpgroup's keys
        wait_v(nw - 1, g + nw - 1);
        fence_regs<ND * 4>(o);
        turn();
        wgmma_fence();
        wg_pv<T, BN, D>(o, pf, sV(g + nw - 1));
        pass();
        wgmma_wait<0>();
        fence_regs<ND * 4>(o);
        mbar_arrive(bar(C::kBarVEmpty + (g + nw - 1) % S));
        if (ctid == 0) ws_stamp(1, qi, 6);
      }
      // Steps nw + 1 .. n (0 .. n when the warpgroup sees no key): the same waits (the V zeroing's barrier among
      // them), turns and releases as the other warpgroups' steps, without MMAs.
      for (int j = nw > 0 ? nw + 1 : 0; kTailSkip && n > 0 && j <= n; ++j) {
        if (j < n) unused_k(j);
        if (j > 0) {
          wait_v(j - 1, g + j - 1);
          mbar_arrive(bar(C::kBarVEmpty + (g + j - 1) % S));
        }
        turn();
        pass();
      }
      g += n;
      if (a.num_partitions <= 1) {
        // The rows leave through the warp's own rows of the Q buffer (its last Q K^T has completed; no other warp
        // touches them), and the buffer is handed back once this thread's stores have read it.
        unsigned char* stage = sbase + C::kOffQ + qb * C::kQBytes + warp_row0 * 128;
        wg_stage_rows<T, D>(a, st, rows_seq, warp_row0, hkv, l_run, m_run, o, lane, stage, BM * 128);
        ws_store_staged<T, D, BM>(a, st, rows_seq, warp_row0, hkv, group, lane, stage, &omap, tma_store);
      } else {
        wg_store_rows<T, D>(a, st, rows_seq, warp_row0, hkv, part, l_run, m_run, o, lane);
      }
      mbar_arrive(bar(C::kBarQEmpty + qb));
      if (ctid == 0) ws_stamp(1, qi, 7);
      ++qi;
    }
  }
#else
  __trap();  // launched only on sm_90 (see launch_attention)
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Short sequences: the consumer warpgroups take items of their own. attention_ws_sm90_kernel's two warpgroups work
// on one 128-row tile together, so a sequence of 64 rows leaves one of them computing on rows past it, and each item's
// serial chain (first K's arrival, the first step, the last P.V, the store: ~5 us on the H200 at S=64, against the
// tile's own MMAs' fraction of a microsecond) runs once per 128 rows. Here each warpgroup p is paired with loader
// warp p, and the pair walks every other item of the CTA's walk (rounds r = p, p + 2, ...) on 64-row query tiles:
// two items' chains overlap on the SM, and no MMA row is spent on rows past a sequence whose rows end within a
// 64-row half. K and V go in 64-key tiles (the host's boxes hold at most 64 key rows), so that a 64-token sequence's
// first step computes no keys past it and each pair's rings hold two stages at D=128 (four at D=64) within the
// shared memory of one 128-row CTA. Still, a pair's long item streams its keys through half the ring bytes that
// the 128-row kernel's two warpgroups share: mha.cu takes this kernel for calls whose sequences are short on
// average (or as MSA_OPS_DENSE_WS_PAIR says), the 128-row kernel for the others. The two loaders zero the rows no
// sequence owns after their walks, as the loader does there. Both kernels' loaders run ws_load_item; each kernel's
// consumers keep their own copy of the per-item code: behind a shared function, ptxas laid out this kernel's consumer
// differently and it ran 5% slower at S=64 (benchmarks/NOTES_mha.md v43).
template <int D>
struct DenseWsPair {
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 128;  // one warpgroup per pair
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr int kLaunchRegs = 168;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs, "register pool");
  static constexpr int kBlockM = 64;  // query rows of an item
  static constexpr int kBlockN = 64;  // keys of a K or V tile (the host's K/V boxes: make_sm90_kv's tile_rows)
  static constexpr int kStages = D == 64 ? 4 : 2;  // of a pair's K ring and of its V ring
  static constexpr int kQBufs = 2;                  // a pair's
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kTileBytes = kBlockN * D * 2;
  // per pair, at p * kPairBytes: Q [2], K [kStages], V [kStages]
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = 2 * kQBytes;
  static constexpr int kOffV = kOffK + kStages * kTileBytes;
  static constexpr int kPairBytes = kOffV + kStages * kTileBytes;
  static constexpr int kOffMask = 2 * kPairBytes;                 // [2][kStages][4]: the K tiles' present keys
  static constexpr int kOffOrder = kOffMask + 2 * kStages * 16;  // ws_order_build's [kWsOrderInts]
  static constexpr int kOffItem = (kOffOrder + kWsOrderInts * 4 + 15) / 16 * 16;  // [2][2] DenseWsItem
  static constexpr int kOffBar = (kOffItem + 4 * static_cast<int>(sizeof(DenseWsItem)) + 7) / 8 * 8;
  // mbarriers per pair: Q full [2], Q empty [2], then K full, K empty, V full, V empty [kStages] each
  static constexpr int kBarQFull = 0, kBarQEmpty = 2, kBarKFull = 4, kBarKEmpty = 4 + kStages,
                       kBarVFull = 4 + 2 * kStages, kBarVEmpty = 4 + 3 * kStages, kBarsPair = 4 + 4 * kStages;
  static constexpr int kSmemBytes = kOffBar + 2 * kBarsPair * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kQBytes % 1024 == 0 && kTileBytes % 1024 == 0, "swizzle atoms");
  static_assert(D != 128 || kSmemAlloc + 1024 <= 196 * 1024, "shared memory of the D=128 kernel: L1 carve-out");
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory of one CTA on sm_90");
  static_assert(D == 64 || D == 128, "head dim");
};

// tiles_x: the host's bound on the 64-row query tiles of the call; otherwise as attention_ws_sm90_kernel.
template <typename T, int D>
__global__ void __launch_bounds__(384, 1)
    attention_ws_pair_sm90_kernel(const AttentionArgs a, const __grid_constant__ Sm90Kv kvm,
                                  const __grid_constant__ CUtensorMap qmap, int tiles_x, int walk,
                                  const __grid_constant__ CUtensorMap omap, int tma_store) {
#if defined(MSA_OPS_SM90_WGMMA)
  using C = DenseWsPair<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages;
  constexpr int NS = BN / 8, ND = D / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sbase;
  const uint32_t s0 = smem_align_1024(smem_raw, &sbase);
  int* sOrder = reinterpret_cast<int*>(sbase + C::kOffOrder);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per_tile = a.Hkv * (a.num_partitions > 1 ? a.num_partitions : 1);
  if (tid == 0) {
    for (int p = 0; p < 2; ++p) ws_init_bars<C>(s0 + C::kOffBar + 8 * p * C::kBarsPair);
    mbar_init_fence();
  }
  ws_order_build<BM>(a, tiles_x, per_tile, sOrder, walk);  // every thread
  __syncthreads();

  if (warp < 4) {
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp >= 2) return;
    // ------------------------------------------------------------------ loader of pair p (warp p)
    const int p = warp;
    const WsSet set{s0 + p * C::kPairBytes, s0 + C::kOffBar + 8 * p * C::kBarsPair,
                    reinterpret_cast<uint32_t*>(sbase + C::kOffMask) + p * S * 4,
                    reinterpret_cast<DenseWsItem*>(sbase + C::kOffItem) + 2 * p};
    bool layer_ok = true;
    const int layer = tma_kv_layer(a, &layer_ok);
    int gk = 0, qi = 0;  // tiles and items of this pair
    for (int r = p;; r += 2) {
      const int w = ws_walk(r);
      if (w >= sOrder[2]) break;  // the number of items
      if (p == 0 && lane == 0) ws_stamp(0, qi, 0);
      const WsItem it = ws_item(sOrder, w, per_tile);
      if (it.x_tile < 0) continue;
      const SeqTile st = ws_locate<BM>(a, sOrder, it.x_tile);
      gk += ws_load_item<T, D, C>(a, kvm, &qmap, set, st, it.sub % a.Hkv, it.sub / a.Hkv, qi++, gk, layer, layer_ok,
                                  lane, p == 0);
    }
    if (a.num_partitions <= 1) ws_zero_unowned_rows<BM, T>(a, sOrder, a.H * D, p, 2);
  } else {
    // ------------------------------------------------------------------ consumer warpgroup of pair p
    setmaxnreg_inc<C::kConsumerRegs>();
    const int ctid = tid - 128;
    const int wtid = ctid % 128;
    // The pair index as a constant in each copy of the code (its buffers at fixed offsets: as a register-held
    // address, the consumer spilled 212 bytes at 224 registers).
    auto consume = [&](auto pair) {
      constexpr int p = decltype(pair)::value;
      const uint32_t pb = s0 + p * C::kPairBytes;
      unsigned char* pbase = sbase + p * C::kPairBytes;
      const uint32_t bars = s0 + C::kOffBar + 8 * p * C::kBarsPair;
      auto bar = [&](int i) { return bars + 8 * i; };
      const uint32_t* sMask = reinterpret_cast<const uint32_t*>(sbase + C::kOffMask) + p * S * 4;
      const DenseWsItem* sItem = reinterpret_cast<const DenseWsItem*>(sbase + C::kOffItem) + 2 * p;
      const int warp_row0 = (warp % 4) * 16;  // first item row of this warp
      const float sl2 = a.scale_log2;
      int g = 0, qi = 0;
      float o[ND * 4];
      float s[NS * 4];
      uint32_t pf[BN / 16][4];
      float corr[2];
      for (int r = p;; r += 2) {
        const int w = ws_walk(r);
        if (w >= sOrder[2]) break;
        const WsItem it = ws_item(sOrder, w, per_tile);
        if (it.x_tile < 0) continue;
        const int qb = ws_qbuf<C>(qi);
        const bool stamp = p == 0 && wtid == 0;
        if (stamp) ws_stamp(1, qi, 0);
        mbar_wait_ws(bar(C::kBarQFull + qb), ws_qphase<C>(qi));
        if (stamp) ws_stamp(1, qi, 1);
        const DenseWsItem item = sItem[qb];  // the loader's ws_locate
        const SeqTile& st = item.st;
        if (st.b < 0) {  // past the last tile: the buffer holds no Q
          mbar_arrive(bar(C::kBarQEmpty + qb));
          ++qi;
          continue;
        }
        const int hkv = item.hkv, part = item.part;
        const int group = a.group;
        const TileKeys tk = tile_keys<BM, BN>(a, st, part);
        const int rows_seq = tk.rows_seq;
        const int kmax = static_cast<int>(st.kmax);
        const int tile_first = tk.tile_first, n = tk.num_tiles;
        int row_lo[2], row_hi[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int pr = st.row0 + warp_row0 + lane / 4 + i * 8;
          const RowKeys rk = row_keys(a, st, group, rows_seq, tk.k_lo, tk.k_hi, pr);
          row_lo[i] = rk.lo;
          row_hi[i] = rk.hi;
        }
        const RowKeys full = full_keys(tk);
        const int full_lo = full.lo, full_hi = full.hi;
#pragma unroll
        for (int i = 0; i < ND * 4; ++i) o[i] = 0.f;
        float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
        const uint32_t q_wg = pb + C::kOffQ + qb * C::kQBytes;
        auto sK = [&](int gj) { return pb + C::kOffK + (warp_uniform(gj) % S) * C::kTileBytes; };
        auto sV = [&](int gj) { return pb + C::kOffV + (warp_uniform(gj) % S) * C::kTileBytes; };
        uint32_t present[BN / 32];
        auto wait_k = [&](int gj) {  // K of tile j landed; its present-key mask read before the slot is released
          mbar_wait_ws(bar(C::kBarKFull + gj % S), (gj / S) & 1);
#pragma unroll
          for (int wd = 0; wd < BN / 32; ++wd) present[wd] = sMask[(gj % S) * 4 + wd];
        };
        auto wait_v = [&](int j, int gj) {  // V of tile j landed; its rows past the sequence's keys are zeroed
          mbar_wait_ws(bar(C::kBarVFull + gj % S), (gj / S) & 1);
          const int n_exist = kmax - (tile_first + j) * BN;
          if (n_exist < BN) {  // (n_exist < 0: a tile wholly past the keys, as in attention_ws_sm90_kernel)
            zero_rows_sw128<BN, D, C::kConsumerThreads>(pbase + C::kOffV + (gj % S) * C::kTileBytes, max(n_exist, 0),
                                                        wtid);
            fence_proxy_async();
            named_sync<1 + p>(C::kConsumerThreads);
          }
        };
        auto softmax = [&](int j) {
          wg_dense_softmax<NS>(s, present, (tile_first + j) * BN, full_lo, full_hi, row_lo, row_hi, m_run, l_run, corr,
                               sl2, a.rescale_slack_log2, lane);
        };
        if (n > 0) {
          wait_k(g);
          if (stamp) ws_stamp(1, qi, 2);
          wgmma_fence();
          wg_qk<T, BM, BN, D>(s, q_wg, sK(g));
          wgmma_wait<0>();
          fence_regs<NS * 4>(s);
          if (stamp) ws_stamp(1, qi, 3);  // (no turns here: the first Q K^T done)
          mbar_arrive(bar(C::kBarKEmpty + g % S));
          softmax(0);
          wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
          if (stamp) ws_stamp(1, qi, 4);
          for (int j = 1; j < n; ++j) {
            wait_k(g + j);
            wait_v(j - 1, g + j - 1);
            fence_regs<ND * 4>(o);
            wgmma_fence();
            wg_qk<T, BM, BN, D>(s, q_wg, sK(g + j));
            wg_pv<T, BN, D>(o, pf, sV(g + j - 1));
            wgmma_wait<1>();
            fence_regs<NS * 4>(s);
            mbar_arrive(bar(C::kBarKEmpty + (g + j) % S));
            softmax(j);
            wgmma_wait<0>();
            fence_regs<ND * 4>(o);
            mbar_arrive(bar(C::kBarVEmpty + (g + j - 1) % S));
            wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
          }
          if (stamp) ws_stamp(1, qi, 5);
          wait_v(n - 1, g + n - 1);
          fence_regs<ND * 4>(o);
          wgmma_fence();
          wg_pv<T, BN, D>(o, pf, sV(g + n - 1));
          wgmma_wait<0>();
          fence_regs<ND * 4>(o);
          mbar_arrive(bar(C::kBarVEmpty + (g + n - 1) % S));
          if (stamp) ws_stamp(1, qi, 6);
        }
        g += n;
        if (a.num_partitions <= 1) {
          unsigned char* stage = pbase + C::kOffQ + qb * C::kQBytes + warp_row0 * 128;
          wg_stage_rows<T, D>(a, st, rows_seq, warp_row0, hkv, l_run, m_run, o, lane, stage, BM * 128);
          ws_store_staged<T, D, BM>(a, st, rows_seq, warp_row0, hkv, group, lane, stage, &omap, tma_store);
        } else {
          wg_store_rows<T, D>(a, st, rows_seq, warp_row0, hkv, part, l_run, m_run, o, lane);
        }
        mbar_arrive(bar(C::kBarQEmpty + qb));
        if (stamp) ws_stamp(1, qi, 7);
        ++qi;
      }
    };
    if (ctid < 128) consume(std::integral_constant<int, 0>{});
    else consume(std::integral_constant<int, 1>{});
  }
#else
  __trap();  // launched only on sm_90 (see launch_attention)
#endif
}

}  // namespace cuda
}  // namespace msa_ops
