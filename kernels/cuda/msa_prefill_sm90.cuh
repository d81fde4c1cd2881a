// Hopper (sm_90a) MSA prefill: block-sparse flash attention over the paged cache that reuses each selected
// block across a query tile (SEMANTICS.md §7, prefill route).
//
// A CTA owns 128 packed (token, head) rows of one sequence and one kv head, as attention_sm90_kernel does: with
// group g it holds 128 / g tokens (up to 128) and all g query heads of each, which share the kv head's selection.
// The CTA first plans on the device:
//   * every (token, slot) id of d_indices is checked (0 <= id < max_pages, the block has a key <= the token's
//     position and < the sequence's keys, its page is inside the pool, the layer is valid);
//   * the valid ids are OR-ed into a bitmap over the sequence's blocks; its set bits, in ascending order, are the
//     union of the tile's selected blocks, each one 128-key tile (one page);
//   * for each union block, a 128-bit mask of the tile's tokens that selected it.
// It then streams the union's blocks through the wgmma pipeline of attention_sm90_kernel (S = Q K^T from
// shared memory, O += P V with P in registers, the softmax of block j overlapping P V of block j-1). A key is
// visible to a row when the row's token selected its block, key <= the token's position and key < the keys of
// the sequence. Duplicate ids merge in the bitmap. The union is processed in chunks of kChunk blocks (the
// pipeline drains between chunks), so any topk and selection pattern is served in bounded shared memory.
// K and V have separate two-stage rings that TMA fills (one thread issues a block's K or V as two 64-column boxes
// of the page, an mbarrier per stage): K of block j+1 and V of block j are loaded during iteration j, each one
// iteration ahead of its use, in 128 KB. (The dense kernel's joint three-stage ring loads V a further iteration
// ahead, but its 192 KB leave no room for the planning.) V rows past the sequence's keys are zeroed in shared
// memory once they land: whatever a page holds there (even NaN) must not reach O through a 0 * V product.
//
// No split-K (the grid is the query tiles x kv heads). bf16 only; fp8 prefill runs on the per-token kernel.
#pragma once

#include "attention_sm90.cuh"

namespace msa_ops {
namespace cuda {

struct MsaPrefillSm90 {
  static constexpr int kThreads = 256;
  static constexpr int kD = 128;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;    // one selected block = one page = one key tile
  static constexpr int kChunk = 512;     // union blocks planned per pass
  static constexpr int kMaxPages = 16384;  // bitmap bound: max_pages above it runs on the per-token kernel
  static constexpr int kMaxWords = kMaxPages / 32;
  static constexpr int kTileBytes = kBlockN * kD * 2;  // K or V of one block; also Q
  static constexpr int kMaskWords = kBlockM / 32;      // one bit per token of the tile (<= 128 tokens)
  static constexpr int kOffK = kTileBytes;
  static constexpr int kOffV = kOffK + 2 * kTileBytes;
  static constexpr int kOffIds = kOffV + 2 * kTileBytes;
  static constexpr int kOffPages = kOffIds + kChunk * 4;
  static constexpr int kOffMask = kOffPages + kChunk * 4;
  static constexpr int kOffBits = kOffMask + kChunk * kMaskWords * 4;
  static constexpr int kOffBase = kOffBits + kMaxWords * 4;
  static constexpr int kOffMisc = kOffBase + kMaxWords * 4;
  static constexpr int kEntCache = 4096;  // (token, slot) entries whose checked id and page stay in shared memory
  static constexpr int kOffEntPage = kOffMisc + 8 * 4;
  static constexpr int kOffEntId = kOffEntPage + kEntCache * 4;
  static constexpr int kOffBar = kOffEntId + kEntCache * 2;  // mbarriers: K stages 0, 1, V stages 0, 1
  static constexpr int kSmemBytes = kOffBar + 4 * 8;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // the base is rounded up to 1024 bytes
};

#if defined(MSA_OPS_SM90_WGMMA)
// The online softmax of one union block (first key key0) over a thread's two rows, shared by both MSA prefill
// kernels: a row sees the block's keys if its token selected the block (bit tok_rel of the block's token mask
// `words`), up to its bound row_hi (key <= position, key < the sequence's keys).
template <int NS>
__device__ __forceinline__ void msa_block_softmax(float* s, const uint32_t* words, int key0, const int* tok_rel,
                                                  const int* row_hi, float* m_run, float* l_run, float* corr,
                                                  float sl2, float slack, int lane) {
  bool sel[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) sel[i] = (words[tok_rel[i] / 32] >> (tok_rel[i] % 32)) & 1u;
  constexpr int BN = NS * 8;
  const bool full = sl2 > 0.f && sel[0] && sel[1] && key0 + BN <= row_hi[0] && key0 + BN <= row_hi[1];
  float m_new[2] = {m_run[0], m_run[1]};
  if (full) {
    wg_raw_max<NS>(s, m_new, sl2);
  } else {
    const int lim[2] = {sel[0] ? row_hi[0] - key0 : 0, sel[1] ? row_hi[1] - key0 : 0};
#pragma unroll
    for (int jj = 0; jj < NS; ++jj) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        const int kl = jj * 8 + (lane % 4) * 2 + (e % 2);
        s[jj * 4 + e] = kl < lim[i] ? s[jj * 4 + e] * sl2 : -INFINITY;
        m_new[i] = fmaxf(m_new[i], s[jj * 4 + e]);
      }
    }
  }
  wg_softmax_finish<NS>(s, m_new, m_run, l_run, corr, full, sl2, slack);
}
#endif

// a: the MSA call as a paged ragged attention (page_size 128, num_partitions 1, no sink), d_idx: [Hkv, T, topk].
__global__ void __launch_bounds__(256, 1)
    msa_prefill_sm90_kernel(const AttentionArgs a, const __grid_constant__ Sm90Kv kvm, const int32_t* __restrict__ d_idx,
                            int topk) {
#if defined(MSA_OPS_SM90_WGMMA)
  using T = __nv_bfloat16;
  using C = MsaPrefillSm90;
  constexpr int D = C::kD, BM = C::kBlockM, BN = C::kBlockN;
  constexpr int NS = BN / 8, ND = D / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sbase;
  const uint32_t sQ = smem_align_1024(smem_raw, &sbase);
  int* sIds = reinterpret_cast<int*>(sbase + C::kOffIds);
  int* sPages = reinterpret_cast<int*>(sbase + C::kOffPages);
  uint32_t* sMask = reinterpret_cast<uint32_t*>(sbase + C::kOffMask);
  uint32_t* sBits = reinterpret_cast<uint32_t*>(sbase + C::kOffBits);
  int* sBase = reinterpret_cast<int*>(sbase + C::kOffBase);
  int* sMisc = reinterpret_cast<int*>(sbase + C::kOffMisc);
  int* sEntPage = reinterpret_cast<int*>(sbase + C::kOffEntPage);
  int16_t* sEntId = reinterpret_cast<int16_t*>(sbase + C::kOffEntId);

  const SeqTile st = locate_tile<BM>(a, static_cast<int>(gridDim.x - 1 - blockIdx.x));  // heaviest first
  if (st.b < 0) return;
  const int hkv = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wg = tid / 128;
  const int warp_row0 = wg * 64 + (warp % 4) * 16;
  const int group = a.group;
  const int rows_seq = st.n_q * group;
  const int row_end = min(st.row0 + BM, rows_seq);
  const int tok0 = st.row0 / group;                 // first token of the tile (within the sequence)
  const int ntok = (row_end - 1) / group - tok0 + 1;  // <= 128
  const int kmax = static_cast<int>(st.kmax);
  const T* q = static_cast<const T*>(a.q);
  const uint32_t sBar = sQ + C::kOffBar;
  if (tid == 0) mbar_init_stages(sBar, 4);  // seen by every thread after the planning's first barrier

  // ---- Q (zero rows past the sequence), swizzled [D/64][BM][64]; asynchronous, it lands under the planning
  for (int c = tid; c < BM * (D / 8); c += C::kThreads) {
    const int r = c / (D / 8), ch = c % (D / 8);
    const int pr = st.row0 + r;
    const bool ok = pr < rows_seq;
    const int64_t qrow = st.q_base + (ok ? pr / group : 0);
    const int h = hkv * group + (ok ? pr % group : 0);
    cp_async16(sQ + sw128_offset<BM>(r, ch), q + (qrow * a.H + h) * D + ch * 8, ok);
  }
  cp_async_commit();

  // ---- plan: the union of the tile's valid selected blocks (bitmap, then ranks by popcount prefix)
  const int32_t* lut_row = a.lookup + static_cast<int64_t>(st.b) * a.max_pages;
  const int layer = *a.layer_ptr;
  const bool layer_ok = layer >= 0 && layer < a.num_layers;
  const int nwords = (a.max_pages + 31) / 32;
  const int n_ent = ntok * topk;
  const int32_t* ids_tile = d_idx + (static_cast<int64_t>(hkv) * a.total_rows + st.q_base + tok0) * topk;
  // Entry e = (token e / topk of the tile, slot e % topk): its block id if it counts, else -1.
  auto entry = [&](int e) -> int {
    if (!layer_ok) return -1;
    const int id = __ldg(ids_tile + e);
    const int64_t p = st.pos0 + tok0 + e / topk;
    if (id < 0 || id >= a.max_pages) return -1;
    const int64_t key0 = static_cast<int64_t>(id) * BN;
    if (key0 >= kmax || key0 > p) return -1;
    return pool_page(a, __ldg(lut_row + id)) >= 0 ? id : -1;
  };
  for (int w = tid; w < nwords; w += C::kThreads) sBits[w] = 0u;
  __syncthreads();
  const bool cached = n_ent <= C::kEntCache;
  for (int e = tid; e < n_ent; e += C::kThreads) {
    const int id = entry(e);
    if (cached) {
      sEntId[e] = static_cast<int16_t>(id);  // max_pages <= kMaxPages < 2^15
      if (id >= 0) sEntPage[e] = __ldg(lut_row + id);
    }
    if (id >= 0) atomicOr(&sBits[id >> 5], 1u << (id & 31));
  }
  __syncthreads();
  int n_union;  // blocks in the union
  {  // exclusive prefix of the words' popcounts (each thread two consecutive words; nwords <= 2 * 256)
    const int w0 = 2 * tid;
    const int c0 = w0 < nwords ? __popc(sBits[w0]) : 0;
    const int c1 = w0 + 1 < nwords ? __popc(sBits[w0 + 1]) : 0;
    int incl = c0 + c1;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffff, incl, d);
      if (lane >= d) incl += u;
    }
    if (lane == 31) sMisc[warp] = incl;
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < C::kThreads / 32; ++w) {
      const int v = sMisc[w];
      before += w < warp ? v : 0;
      total += v;
    }
    const int excl = before + incl - c0 - c1;
    if (w0 < nwords) sBase[w0] = excl;
    if (w0 + 1 < nwords) sBase[w0 + 1] = excl + c0;
    n_union = total;
  }

  // ---- per-thread rows: warp_row0 + lane/4 and + 8; their token (relative to tok0) and key bound
  int tok_rel[2], row_hi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int pr = st.row0 + warp_row0 + lane / 4 + i * 8;
    if (pr < rows_seq) {
      tok_rel[i] = pr / group - tok0;
      row_hi[i] = static_cast<int>(imin(st.pos0 + pr / group + 1, static_cast<int64_t>(kmax)));
    } else {
      tok_rel[i] = 0;
      row_hi[i] = 0;  // sees nothing
    }
  }

  // ---- K/V block loader: thread 0 issues a union block's K or V (two 64-column boxes of its page) by TMA. Union
  // block g (its rank in the union) uses stage g & 1 of each ring, and completes that stage's mbarrier phase g >> 1.
  const int layer_c = layer_ok ? layer : 0;
  const uint32_t sK0 = sQ + C::kOffK, sV0 = sQ + C::kOffV;
  auto issue_half = [&](int j, int g, bool v) {  // block j of the chunk, union rank g
    if (tid != 0) return;
    const uint32_t bar = sBar + 8 * ((v ? 2 : 0) + (g & 1));
    const uint32_t dst = (v ? sV0 : sK0) + (g & 1) * C::kTileBytes;
    mbar_expect_tx(bar, C::kTileBytes);
#pragma unroll
    for (int h = 0; h < D / 64; ++h)
      tma_load_5d(dst + h * BN * 128, v ? &kvm.v : &kvm.k, bar, h * 64, hkv, 0, (v ? a.num_layers : 0) + layer_c,
                  sPages[j]);
  };
  auto wait_k = [&](int g) { mbar_wait(sBar + 8 * (g & 1), (g >> 1) & 1); };
  auto wait_v = [&](int j, int g) {  // V of block j landed; its rows past the sequence's keys are zeroed
    mbar_wait(sBar + 8 * (2 + (g & 1)), (g >> 1) & 1);
    const int n_exist = kmax - sIds[j] * BN;  // > 0: the block has a key < kmax
    if (n_exist < BN) zero_rows_sw128<BN, D, C::kThreads>(sbase + C::kOffV + (g & 1) * C::kTileBytes, n_exist, tid);
  };

  float o[ND * 4];
#pragma unroll
  for (int i = 0; i < ND * 4; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float s[NS * 4];
  uint32_t pf[BN / 16][4];
  float corr[2];
  const float sl2 = a.scale_log2;
  const uint32_t q_wg = sQ + wg * 64 * 128;

  auto tile_ready = [&]() {  // after the waits: every thread's generic stores are in, for the tensor cores
    cp_async_wait<0>();      // Q
    fence_proxy_async();
    __syncthreads();
  };
  auto issue_qk = [&](int g) { wg_qk<T, BM, BN, D, false>(s, q_wg, sK0 + (g & 1) * C::kTileBytes); };
  auto issue_pv = [&](int g) { wg_pv<T, BN, D, false>(o, pf, sV0 + (g & 1) * C::kTileBytes); };
  auto softmax = [&](int j) {  // union block j
    msa_block_softmax<NS>(s, sMask + j * C::kMaskWords, sIds[j] * BN, tok_rel, row_hi, m_run, l_run, corr, sl2,
                          a.rescale_slack_log2, lane);
  };
  auto rescale_and_pack = [&]() { wg_rescale_and_pack<T, NS, ND>(o, s, pf, corr); };

  for (int c0 = 0; c0 < n_union; c0 += C::kChunk) {
    const int n = min(C::kChunk, n_union - c0);
    // ---- this chunk's blocks (ranks [c0, c0 + n)) and their token masks
    // Every entry of a block writes the same id and page into its rank's slot.
    for (int i = tid; i < C::kChunk * C::kMaskWords; i += C::kThreads) sMask[i] = 0u;
    __syncthreads();
    for (int e = tid; e < n_ent; e += C::kThreads) {
      const int id = cached ? sEntId[e] : entry(e);
      if (id < 0) continue;
      const int w = id >> 5;
      const int r = sBase[w] + __popc(sBits[w] & ((1u << (id & 31)) - 1u)) - c0;
      if (r < 0 || r >= n) continue;
      const int t = e / topk;
      sIds[r] = id;
      sPages[r] = cached ? sEntPage[e] : __ldg(lut_row + id);
      atomicOr(&sMask[r * C::kMaskWords + t / 32], 1u << (t % 32));
    }
    __syncthreads();

    // ---- the pipeline over the chunk's n blocks: K_{j+1} and V_j load during iteration j >= 1 (issued ahead of
    // its MMAs: after them measured 9-10% slower on the H200); K_0, K_1 and V_0 load together before iteration 0,
    // so iteration 1 does not wait on loads issued just before it.
    issue_half(0, c0, false);
    if (n > 1) issue_half(1, c0 + 1, false);
    issue_half(0, c0, true);
    wait_k(c0);
    tile_ready();
    wgmma_fence();
    issue_qk(c0);
    wgmma_wait<0>();
    fence_regs<NS * 4>(s);
    softmax(0);
    rescale_and_pack();
    for (int j = 1; j < n; ++j) {
      wait_k(c0 + j);
      wait_v(j - 1, c0 + j - 1);
      tile_ready();
      if (j + 1 < n) issue_half(j + 1, c0 + j + 1, false);
      issue_half(j, c0 + j, true);
      fence_regs<ND * 4>(o);
      wgmma_fence();
      issue_qk(c0 + j);
      issue_pv(c0 + j - 1);
      wgmma_wait<1>();
      fence_regs<NS * 4>(s);
      softmax(j);
      wgmma_wait<0>();
      fence_regs<ND * 4>(o);
      rescale_and_pack();
    }
    wait_v(n - 1, c0 + n - 1);
    tile_ready();
    fence_regs<ND * 4>(o);
    wgmma_fence();
    issue_pv(c0 + n - 1);
    wgmma_wait<0>();
    fence_regs<ND * 4>(o);
    __syncthreads();  // every warpgroup is done with the chunk's blocks and masks
  }
  cp_async_wait<0>();  // Q's copy, when no block was selected

  wg_store_rows<T, D>(a, st, rows_seq, warp_row0, hkv, 0, l_run, m_run, o, lane);
#else
  __trap();  // launched only on sm_90 (see msa.cu)
#endif
}

}  // namespace cuda
}  // namespace msa_ops
