// Hopper (sm_90a) MSA prefill, warp-specialized and persistent: the block-sparse attention of
// msa_prefill_sm90.cuh (same contract, same per-tile planning and softmax), with the per-tile fixed costs taken
// off the tensor cores' path.
//
// One CTA per SM walks the work items (query tile x kv head, heaviest first) with three warpgroups:
//   * warp 0 (the loader) issues every TMA: a tile's Q (two 64-column boxes of [tokens][group heads]) into one of
//     two Q buffers, with the tile's place (ws_locate, in shared memory next to the buffer: the consumers do
//     not wait on its global reads), then its union blocks' K and V (one page each) into two-stage K and V rings;
//   * warps 1-3 (the planners) build each tile's plan: the union of its valid selected blocks and, per block, the
//     mask of the tile's tokens that selected it, one chunk of up to kChunk blocks at a time, into one of two
//     plan slots; after the walk, warp 1 zeroes the output rows that no sequence owns (ws_zero_unowned_rows), so
//     that no launch follows the kernel;
//   * warpgroups 1 and 2 (the consumers) run the wgmma pipeline over 64 rows each, as in msa_prefill_sm90.cuh,
//     then store their rows through their part of the Q buffer (whole rows, 16 bytes a lane). They take turns
//     issuing each step's MMAs (named barriers 3 and 4), so that one's softmax runs under the other's MMAs.
// Every hand-over is an mbarrier: full (TMA bytes, or the planners' arrivals) and empty (the consumers' arrivals)
// per Q buffer, ring stage and plan slot. So the next tile's planning and its Q and first K/V loads run while the
// consumers finish the current tile, and the consumers never wait at a CTA-wide barrier. The producer warpgroup
// gives registers to the consumers (setmaxnreg).
//
// Served when the group divides 128 (Q by TMA) and the pool has pages of 128; msa.cu keeps msa_prefill_sm90.cuh
// otherwise (MSA_OPS_MSA_PREFILL_WS=0 selects it always).
#pragma once

#include "msa_prefill_sm90.cuh"
#include "ws_sm90.cuh"

namespace msa_ops {
namespace cuda {

struct MsaPrefillWs {
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kPlanners = 96;  // warps 1-3
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr int kLaunchRegs = 168;  // __launch_bounds__(384, 1): what setmaxnreg redistributes
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs, "register pool");
  static constexpr int kD = 128;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kChunk = 128;  // union blocks per plan slot
  static constexpr int kMaxPages = MsaPrefillSm90::kMaxPages;  // the bound use_prefill_sm90 checks (msa.cu)
  static constexpr int kMaxWords = kMaxPages / 32;
  static constexpr int kTileBytes = kBlockN * kD * 2;
  static constexpr int kMaskWords = kBlockM / 32;
  static constexpr int kEntCache = 2048;
  // shared memory (bytes from the 1024-aligned base)
  static constexpr int kOffQ = 0;                            // 2 buffers
  static constexpr int kOffK = kOffQ + 2 * kTileBytes;       // 2 stages
  static constexpr int kOffV = kOffK + 2 * kTileBytes;       // 2 stages
  static constexpr int kOffIds = kOffV + 2 * kTileBytes;     // [2][kChunk]
  static constexpr int kOffPages = kOffIds + 2 * kChunk * 4;  // [2][kChunk]
  static constexpr int kOffMask = kOffPages + 2 * kChunk * 4;  // [2][kChunk][kMaskWords]
  static constexpr int kOffMeta = kOffMask + 2 * kChunk * kMaskWords * 4;  // [2][2]: blocks, last chunk
  static constexpr int kOffBits = kOffMeta + 16;
  static constexpr int kOffBase = kOffBits + kMaxWords * 4;
  static constexpr int kOffMisc = kOffBase + kMaxWords * 4;  // [4]
  static constexpr int kOffEntPage = kOffMisc + 16;
  static constexpr int kOffEntId = kOffEntPage + kEntCache * 4;
  static constexpr int kOffOrder = (kOffEntId + kEntCache * 2 + 15) / 16 * 16;  // ws_order_build's [kWsOrderInts]
  static constexpr int kOffQTile = (kOffOrder + kWsOrderInts * 4 + 15) / 16 * 16;  // [2] SeqTile per Q buffer
  static constexpr int kOffBar = (kOffQTile + 2 * static_cast<int>(sizeof(SeqTile)) + 7) / 8 * 8;
  // mbarriers: Q full/empty [2], K full/empty [2], V full/empty [2], plan full/empty [2]
  static constexpr int kBarQFull = 0, kBarQEmpty = 2, kBarKFull = 4, kBarKEmpty = 6, kBarVFull = 8,
                       kBarVEmpty = 10, kBarPFull = 12, kBarPEmpty = 14, kBars = 16;
  static constexpr int kSmemBytes = kOffBar + kBars * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;
  static_assert(kSmemAlloc <= 227 * 1024, "shared memory of one CTA on sm_90");
};

// a: the MSA call as a paged ragged attention (page_size 128, num_partitions 1, no sink); qmap: Q as
// [T][Hkv][group][128] in boxes of (128 / group tokens) x group heads x 64 columns; d_idx: [Hkv, T, topk].
__global__ void __launch_bounds__(384, 1)
    msa_prefill_ws_sm90_kernel(const AttentionArgs a, const __grid_constant__ Sm90Kv kvm,
                               const __grid_constant__ CUtensorMap qmap, const int32_t* __restrict__ d_idx, int topk,
                               int tiles_x) {
#if defined(MSA_OPS_SM90_WGMMA)
  using T = __nv_bfloat16;
  using C = MsaPrefillWs;
  constexpr int D = C::kD, BM = C::kBlockM, BN = C::kBlockN;
  constexpr int NS = BN / 8, ND = D / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sbase;
  const uint32_t s0 = smem_align_1024(smem_raw, &sbase);
  int* sIds = reinterpret_cast<int*>(sbase + C::kOffIds);
  int* sPages = reinterpret_cast<int*>(sbase + C::kOffPages);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(sbase + C::kOffMask);
  int* sMeta = reinterpret_cast<int*>(sbase + C::kOffMeta);
  const uint32_t sBar = s0 + C::kOffBar;
  auto bar = [&](int i) { return sBar + 8 * i; };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  int* sOrder = reinterpret_cast<int*>(sbase + C::kOffOrder);
  SeqTile* sQTile = reinterpret_cast<SeqTile*>(sbase + C::kOffQTile);
  if (tid == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(bar(C::kBarQFull + i), 1);
      mbar_init(bar(C::kBarQEmpty + i), C::kConsumerThreads);
      mbar_init(bar(C::kBarKFull + i), 1);
      mbar_init(bar(C::kBarKEmpty + i), C::kConsumerThreads);
      mbar_init(bar(C::kBarVFull + i), 1);
      mbar_init(bar(C::kBarVEmpty + i), C::kConsumerThreads);
      mbar_init(bar(C::kBarPFull + i), C::kPlanners);
      mbar_init(bar(C::kBarPEmpty + i), C::kConsumerThreads + 1);  // and the loader
    }
    mbar_init_fence();
  }
  ws_order_build<BM>(a, tiles_x, a.Hkv, sOrder);  // every thread
  __syncthreads();

  const int layer = *a.layer_ptr;
  const bool layer_ok = layer >= 0 && layer < a.num_layers;
  const int layer_c = layer_ok ? layer : 0;

  if (warp < 4) {
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp == 0) {
      // ---------------------------------------------------------------- loader
      int pc = 0, g = 0, qi = 0;  // chunks, blocks and tiles seen
      // K_{j+1} and V_j go out together (V one block behind K, as in msa_prefill_sm90.cuh); each waits for its
      // stage's previous block to be released by both consumer warpgroups.
      auto issue = [&](int slot, int j, int gj, bool v, int hkv) {
        const int stage = gj & 1;
        const uint32_t full = bar((v ? C::kBarVFull : C::kBarKFull) + stage);
        mbar_wait_ws(bar((v ? C::kBarVEmpty : C::kBarKEmpty) + stage), ((gj >> 1) & 1) ^ 1);
        mbar_expect_tx(full, C::kTileBytes);
        const uint32_t dst = s0 + (v ? C::kOffV : C::kOffK) + stage * C::kTileBytes;
        const int page = sPages[slot * C::kChunk + j];
#pragma unroll
        for (int h = 0; h < D / 64; ++h)
          tma_load_5d(dst + h * BN * 128, v ? &kvm.v : &kvm.k, full, h * 64, hkv, 0,
                      (v ? a.num_layers : 0) + layer_c, page);
      };
      for (int r = 0;; ++r) {
        const int w = ws_walk(r);
        if (w >= sOrder[2]) break;  // the number of items
        const WsItem it = ws_item(sOrder, w, a.Hkv);
        if (it.x_tile < 0) continue;
        const SeqTile st = ws_locate<BM>(a, sOrder, it.x_tile);
        // The tile goes to the consumers with its Q buffer (they skip it when it is past the last one): its
        // fields are written before the buffer's full barrier is arrived on.
        if (lane == 0) {
          const int qb = qi & 1;
          mbar_wait_ws(bar(C::kBarQEmpty + qb), ((qi >> 1) & 1) ^ 1);
          sQTile[qb] = st;
          if (st.b >= 0) {
            mbar_expect_tx(bar(C::kBarQFull + qb), C::kTileBytes);
            const int tok = st.q_base + st.row0 / a.group;
#pragma unroll
            for (int h = 0; h < D / 64; ++h)
              tma_load_4d(s0 + C::kOffQ + qb * C::kTileBytes + h * BM * 128, &qmap, bar(C::kBarQFull + qb),
                          h * 64, 0, it.sub, tok);
          } else {
            mbar_arrive(bar(C::kBarQFull + qb));
          }
        }
        ++qi;
        if (st.b < 0) continue;
        for (;;) {
          const int slot = pc & 1;
          mbar_wait_ws(bar(C::kBarPFull + slot), (pc >> 1) & 1);
          const int n = sMeta[slot * 2], last = sMeta[slot * 2 + 1];
          if (lane == 0 && n > 0) {
            issue(slot, 0, g, false, it.sub);
            if (n > 1) issue(slot, 1, g + 1, false, it.sub);
            issue(slot, 0, g, true, it.sub);
            for (int j = 1; j < n; ++j) {
              if (j + 1 < n) issue(slot, j + 1, g + j + 1, false, it.sub);
              issue(slot, j, g + j, true, it.sub);
            }
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(bar(C::kBarPEmpty + slot));
          g += n;
          ++pc;
          if (last) break;
        }
      }
    } else {
      // ---------------------------------------------------------------- planners (warps 1-3)
      const int ptid = tid - 32;
      uint32_t* sBits = reinterpret_cast<uint32_t*>(sbase + C::kOffBits);
      int* sBase = reinterpret_cast<int*>(sbase + C::kOffBase);
      int* sMisc = reinterpret_cast<int*>(sbase + C::kOffMisc);
      int* sEntPage = reinterpret_cast<int*>(sbase + C::kOffEntPage);
      int16_t* sEntId = reinterpret_cast<int16_t*>(sbase + C::kOffEntId);
      const int nwords = (a.max_pages + 31) / 32;
      constexpr int kWpt = (C::kMaxWords + C::kPlanners - 1) / C::kPlanners;  // bitmap words per planner
      int pc = 0;
      for (int r = 0;; ++r) {
        const int w = ws_walk(r);
        if (w >= sOrder[2]) break;  // the number of items
        const WsItem it = ws_item(sOrder, w, a.Hkv);
        if (it.x_tile < 0) continue;
        const SeqTile st = ws_locate<BM>(a, sOrder, it.x_tile);
        if (st.b < 0) continue;
        const int group = a.group;
        const int rows_seq = st.n_q * group;
        const int row_end = min(st.row0 + BM, rows_seq);
        const int tok0 = st.row0 / group;
        const int ntok = (row_end - 1) / group - tok0 + 1;
        const int kmax = static_cast<int>(st.kmax);
        const int32_t* lut_row = a.lookup + static_cast<int64_t>(st.b) * a.max_pages;
        const int n_ent = ntok * topk;
        const int32_t* ids_tile = d_idx + (static_cast<int64_t>(it.sub) * a.total_rows + st.q_base + tok0) * topk;
        auto entry = [&](int e) -> int {  // msa_prefill_sm90.cuh's check of entry (token e / topk, slot e % topk)
          if (!layer_ok) return -1;
          const int id = __ldg(ids_tile + e);
          const int64_t p = st.pos0 + tok0 + e / topk;
          if (id < 0 || id >= a.max_pages) return -1;
          const int64_t key0 = static_cast<int64_t>(id) * BN;
          if (key0 >= kmax || key0 > p) return -1;
          return pool_page(a, __ldg(lut_row + id)) >= 0 ? id : -1;
        };
        for (int i = ptid; i < nwords; i += C::kPlanners) sBits[i] = 0u;
        named_sync<1>(C::kPlanners);
        const bool cached = n_ent <= C::kEntCache;
        for (int e = ptid; e < n_ent; e += C::kPlanners) {
          const int id = entry(e);
          if (cached) {
            sEntId[e] = static_cast<int16_t>(id);
            if (id >= 0) sEntPage[e] = __ldg(lut_row + id);
          }
          if (id >= 0) atomicOr(&sBits[id >> 5], 1u << (id & 31));
        }
        named_sync<1>(C::kPlanners);
        int n_union;
        {  // exclusive prefix of the words' popcounts: planner i owns words [i kWpt, (i + 1) kWpt)
          int cnt[kWpt];
          int mine = 0;
#pragma unroll
          for (int k = 0; k < kWpt; ++k) {
            const int wd = ptid * kWpt + k;
            cnt[k] = wd < nwords ? __popc(sBits[wd]) : 0;
            mine += cnt[k];
          }
          int incl = mine;
#pragma unroll
          for (int d = 1; d < 32; d <<= 1) {
            const int u = __shfl_up_sync(0xffffffff, incl, d);
            if (lane >= d) incl += u;
          }
          if (lane == 31) sMisc[warp - 1] = incl;
          named_sync<1>(C::kPlanners);
          int before = 0, total = 0;
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const int v = sMisc[k];
            before += k < warp - 1 ? v : 0;
            total += v;
          }
          int run = before + incl - mine;
#pragma unroll
          for (int k = 0; k < kWpt; ++k) {
            const int wd = ptid * kWpt + k;
            if (wd < nwords) sBase[wd] = run;
            run += cnt[k];
          }
          n_union = total;
          named_sync<1>(C::kPlanners);  // sBase complete; sMisc free again
        }
        for (int c0 = 0;; c0 += C::kChunk) {  // at least one chunk, so an empty union still reaches the consumers
          const int n = max(0, min(C::kChunk, n_union - c0));
          const int slot = pc & 1;
          mbar_wait_ws(bar(C::kBarPEmpty + slot), ((pc >> 1) & 1) ^ 1);
          uint32_t* mask = sMask + slot * C::kChunk * C::kMaskWords;
          for (int i = ptid; i < n * C::kMaskWords; i += C::kPlanners) mask[i] = 0u;
          named_sync<1>(C::kPlanners);
          for (int e = ptid; e < n_ent && n > 0; e += C::kPlanners) {
            const int id = cached ? sEntId[e] : entry(e);
            if (id < 0) continue;
            const int wd = id >> 5;
            const int r = sBase[wd] + __popc(sBits[wd] & ((1u << (id & 31)) - 1u)) - c0;
            if (r < 0 || r >= n) continue;
            const int t = e / topk;
            sIds[slot * C::kChunk + r] = id;
            sPages[slot * C::kChunk + r] = cached ? sEntPage[e] : __ldg(lut_row + id);
            atomicOr(&mask[r * C::kMaskWords + t / 32], 1u << (t % 32));
          }
          const bool last = c0 + C::kChunk >= n_union;
          if (ptid == 0) {
            sMeta[slot * 2] = n;
            sMeta[slot * 2 + 1] = last ? 1 : 0;
          }
          mbar_arrive(bar(C::kBarPFull + slot));  // release: this planner's writes of the slot
          ++pc;
          if (last) break;
        }
        named_sync<1>(C::kPlanners);  // every planner is done with sBits / sBase / the entry cache of this tile
      }
      // The rows no sequence owns, zeroed while the consumers finish the last items (no launch after the kernel).
      if (warp == 1) ws_zero_unowned_rows<BM, T>(a, sOrder, a.H * D);
    }
  } else {
    // ------------------------------------------------------------------ consumers (warpgroups 1 and 2)
    setmaxnreg_inc<C::kConsumerRegs>();
    const int ctid = tid - 128;  // 0..255
    const int cwg = ctid / 128;
    const int warp_row0 = cwg * 64 + (warp % 4) * 16;
    const float sl2 = a.scale_log2;
    // The two warpgroups take turns at the tensor cores (named barriers 3 and 4, one per warpgroup): each issues a
    // step's MMAs only after the other has issued its own, so one's softmax, first Q K^T and epilogue run while
    // the other's MMAs do. Both issue the same steps in the same order (the same blocks); warpgroup 1's first
    // arrival lets warpgroup 0 start.
    auto turn = [&] { cwg == 0 ? named_sync<3>(C::kConsumerThreads) : named_sync<4>(C::kConsumerThreads); };
    auto pass = [&] { cwg == 0 ? named_arrive<4>(C::kConsumerThreads) : named_arrive<3>(C::kConsumerThreads); };
    if (cwg == 1) named_arrive<3>(C::kConsumerThreads);
    int pc = 0, g = 0, qi = 0;
    float o[ND * 4];
    float s[NS * 4];
    uint32_t pf[BN / 16][4];
    float corr[2];
    for (int r = 0;; ++r) {
      const int w = ws_walk(r);
      if (w >= sOrder[2]) break;
      const WsItem it = ws_item(sOrder, w, a.Hkv);
      if (it.x_tile < 0) continue;
      const int qb = qi & 1;
      mbar_wait_ws(bar(C::kBarQFull + qb), (qi >> 1) & 1);
      const SeqTile st = sQTile[qb];  // the loader's ws_locate
      if (st.b < 0) {  // past the last tile: the buffer holds no Q
        mbar_arrive(bar(C::kBarQEmpty + qb));
        ++qi;
        continue;
      }
      const int group = a.group;
      const int gshift = 31 - __clz(group);  // a power of two (it divides 128: make_msa_q_map)
      const int rows_seq = st.n_q * group;
      const int tok0 = st.row0 >> gshift;
      const int kmax = static_cast<int>(st.kmax);
      int tok_rel[2], row_hi[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int pr = st.row0 + warp_row0 + lane / 4 + i * 8;
        if (pr < rows_seq) {
          tok_rel[i] = (pr >> gshift) - tok0;
          row_hi[i] = static_cast<int>(imin(st.pos0 + (pr >> gshift) + 1, static_cast<int64_t>(kmax)));
        } else {
          tok_rel[i] = 0;
          row_hi[i] = 0;
        }
      }
#pragma unroll
      for (int i = 0; i < ND * 4; ++i) o[i] = 0.f;
      float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
      const uint32_t q_wg = s0 + C::kOffQ + qb * C::kTileBytes + cwg * 64 * 128;
      for (;;) {
        const int slot = pc & 1;
        mbar_wait_ws(bar(C::kBarPFull + slot), (pc >> 1) & 1);
        const int n = sMeta[slot * 2], last = sMeta[slot * 2 + 1];
        const int* ids = sIds + slot * C::kChunk;
        const uint32_t* mask = sMask + slot * C::kChunk * C::kMaskWords;
        auto sK = [&](int gj) { return s0 + C::kOffK + (gj & 1) * C::kTileBytes; };
        auto sV = [&](int gj) { return s0 + C::kOffV + (gj & 1) * C::kTileBytes; };
        auto wait_k = [&](int gj) { mbar_wait_ws(bar(C::kBarKFull + (gj & 1)), (gj >> 1) & 1); };
        auto wait_v = [&](int j, int gj) {  // V of block j landed; its rows past the sequence's keys are zeroed
          mbar_wait_ws(bar(C::kBarVFull + (gj & 1)), (gj >> 1) & 1);
          const int n_exist = kmax - ids[j] * BN;
          if (n_exist < BN) {  // the same block for both warpgroups: both take this branch
            zero_rows_sw128<BN, D, C::kConsumerThreads>(sbase + C::kOffV + (gj & 1) * C::kTileBytes, n_exist, ctid);
            fence_proxy_async();
            named_sync<2>(C::kConsumerThreads);
          }
        };
        auto softmax = [&](int j) {
          msa_block_softmax<NS>(s, mask + j * C::kMaskWords, ids[j] * BN, tok_rel, row_hi, m_run, l_run, corr, sl2,
                                a.rescale_slack_log2, lane);
        };
        if (n > 0) {
          wait_k(g);
          turn();
          wgmma_fence();
          wg_qk<T, BM, BN, D, false>(s, q_wg, sK(g));
          pass();
          wgmma_wait<0>();
          fence_regs<NS * 4>(s);
          mbar_arrive(bar(C::kBarKEmpty + (g & 1)));
          softmax(0);
          wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
          for (int j = 1; j < n; ++j) {
            wait_k(g + j);
            wait_v(j - 1, g + j - 1);
            fence_regs<ND * 4>(o);
            turn();
            wgmma_fence();
            wg_qk<T, BM, BN, D, false>(s, q_wg, sK(g + j));
            wg_pv<T, BN, D, false>(o, pf, sV(g + j - 1));
            pass();
            wgmma_wait<1>();
            fence_regs<NS * 4>(s);
            mbar_arrive(bar(C::kBarKEmpty + ((g + j) & 1)));
            softmax(j);
            wgmma_wait<0>();
            fence_regs<ND * 4>(o);
            mbar_arrive(bar(C::kBarVEmpty + ((g + j - 1) & 1)));
            wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr);
          }
          wait_v(n - 1, g + n - 1);
          fence_regs<ND * 4>(o);
          turn();
          wgmma_fence();
          wg_pv<T, BN, D, false>(o, pf, sV(g + n - 1));
          pass();
          wgmma_wait<0>();
          fence_regs<ND * 4>(o);
          mbar_arrive(bar(C::kBarVEmpty + ((g + n - 1) & 1)));
        }
        mbar_arrive(bar(C::kBarPEmpty + slot));
        g += n;
        ++pc;
        if (last) break;
      }
      // The rows leave through the warp's own rows of the Q buffer (its last Q K^T has completed; no other warp
      // touches them), and the buffer is handed back once this thread's stores have read it.
      unsigned char* stage = sbase + C::kOffQ + qb * C::kTileBytes + warp_row0 * 128;
      wg_store_rows_staged<T, D, BM>(a, st, rows_seq, warp_row0, it.sub, l_run, m_run, o, lane, stage);
      fence_proxy_async();  // this thread's generic accesses to the buffer, before the loader's next TMA into it
      mbar_arrive(bar(C::kBarQEmpty + qb));
      ++qi;
    }
  }
#else
  __trap();  // launched only on sm_90 (see msa.cu)
#endif
}

}  // namespace cuda
}  // namespace msa_ops
