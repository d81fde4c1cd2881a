// CUDA FFI handlers of the dense mo.mha.* ops: one attention kernel (attention.cuh) for every op, route and
// mask, plus an epilogue that zeroes rows owned by no sequence and merges split-K partitions.
// No host synchronization, no allocation (split-K partials live in XLA-allocated workspace results);
// every handler is declared command-buffer (CUDA graph) compatible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>

#include "attention.cuh"
#include "attention_sm90.cuh"
#include "attention_ws_sm90.cuh"
#include "msa_ops/checks.h"
#include "msa_ops/common.h"
#include "msa_ops/ffi.h"
#include "msa_ops/ffi_signatures.h"
#include "msa_ops/mask.h"

namespace msa_ops {
namespace cuda {
namespace {

Error check_launch(const char* target) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Error::Success();
  return Error::Internal(std::string(target) + ": kernel launch failed: " + cudaGetErrorString(e));
}

// The instantiations, generated from one list: element type x head dim x query tile height.
#define MSA_OPS_ATTENTION_CONFIGS(X)  \
  X(__nv_bfloat16, 64, 8, 3)          \
  X(__nv_bfloat16, 64, 16, 3)         \
  X(__nv_bfloat16, 64, 64, 2)         \
  X(__nv_bfloat16, 64, 128, 2)        \
  X(__nv_bfloat16, 128, 8, 3)         \
  X(__nv_bfloat16, 128, 16, 3)        \
  X(__nv_bfloat16, 128, 64, 2)        \
  X(__nv_bfloat16, 128, 128, 2)       \
  X(__half, 64, 8, 3)                 \
  X(__half, 64, 16, 3)                \
  X(__half, 64, 64, 2)                \
  X(__half, 64, 128, 2)               \
  X(__half, 128, 8, 3)                \
  X(__half, 128, 16, 3)               \
  X(__half, 128, 64, 2)               \
  X(__half, 128, 128, 2)              \
  X(__nv_bfloat16, 256, 8, 3)         \
  X(__nv_bfloat16, 256, 16, 3)        \
  X(__nv_bfloat16, 256, 64, 2)        \
  X(__nv_bfloat16, 256, 128, 2)       \
  X(__half, 256, 8, 3)                \
  X(__half, 256, 16, 3)               \
  X(__half, 256, 64, 2)               \
  X(__half, 256, 128, 2)

// Ragged queries: a bound on the x tiles that sequences use. Sequence b needs ceil(n_b * group / bm) tiles for its
// n_b rows; n_b * group and bm are multiples of d = gcd(group, bm), so that is at most (n_b * group + bm - d) / bm.
// At most min(B, T) sequences have rows, and their rows sum to at most T (the repaired offsets), so the tiles are
// at most (T * group + min(B, T) * (bm - d)) / bm: exact for a decode batch (one row per sequence).
int64_t ragged_tiles(int64_t T, int64_t B, int64_t group, int64_t bm) {
  return B <= 0 ? 0 : (T * group + std::min(B, T) * (bm - std::gcd(group, bm))) / bm;
}
// The query tiles of bm packed rows of a call, as locate_tile numbers them: per sequence of S rows when padded, else
// ragged_tiles' bound.
int64_t query_tiles(const AttentionArgs& a, int64_t bm) {
  return a.q_mode == kQPadded ? static_cast<int64_t>(a.batch) * ceil_div(static_cast<int64_t>(a.seq_rows) * a.group, bm)
                              : ragged_tiles(a.total_rows, a.batch, a.group, bm);
}
// Spare x tiles of a ragged call of T query rows, for zeroing unowned rows: one, and one more per 64 rows (each spare
// CTA zeroes its kv head's heads of every n-th unowned row).
int64_t spare_tiles(int64_t T) { return 1 + T / 64; }

// Whether a ragged call on the 128-row tile asks for the pair kernel (attention_ws_pair_sm90_kernel: each consumer
// warpgroup its own 64-row items; it serves the call where its Q map can be made, i.e. the group divides 64):
// MSA_OPS_DENSE_WS_PAIR=1 always, 0 never; by default when the sequences' rows (tokens x group) average at most
// kWsPairMaxRows.
// An environment switch read at each launch: 0 or 1 where the variable starts with that digit, else -1 (the
// handler's own choice).
int env_switch(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && (env[0] == '0' || env[0] == '1') ? env[0] - '0' : -1;
}

constexpr int64_t kWsPairMaxRows = 64;
bool ws_pair_wanted(const AttentionArgs& a) {
  if (a.q_mode != kQRagged || a.batch <= 0) return false;
  if (const int sw = env_switch("MSA_OPS_DENSE_WS_PAIR"); sw >= 0) return sw == 1;
  return static_cast<int64_t>(a.total_rows) * a.group <= kWsPairMaxRows * a.batch;
}

// Whether a head-dim-64 call on the 128-row tile asks for the persistent kernel's three consumer warpgroups (192-row
// items): MSA_OPS_DENSE_WS3=1 always, 0 never; by default when the sequences' query rows (tokens x group; ragged: the
// call's rows over its sequences) average at least kWs3MinRows with no mask, kWs3MaskedMinRows with one. On an H200
// (bf16, group 1, H=32, B*S=16384; benchmarks/NOTES_mha.md v51) three warpgroups took no-mask prefill from 262-397
// to 281-453 TFLOP/s at S=512-8k, and causal from 367 to 391 at 8k, the same at 2k, but 14-17% slower at 512 and
// 1k, where the 192-row diagonal tiles waste more of their steps. Below 512 rows (not measured) a 192-row tile
// leaves more of its rows empty than a 128-row one does, so the two warpgroups keep those calls.
constexpr int64_t kWs3MinRows = 512;
constexpr int64_t kWs3MaskedMinRows = 4096;
bool ws3_wanted(const AttentionArgs& a) {
  if (const int sw = env_switch("MSA_OPS_DENSE_WS3"); sw >= 0) return sw == 1;
  const int64_t rows = a.q_mode == kQPadded ? static_cast<int64_t>(a.seq_rows) * a.group
                       : a.batch > 0        ? static_cast<int64_t>(a.total_rows) * a.group / a.batch
                                            : 0;
  return rows >= (a.mask == kMaskNull ? kWs3MinRows : kWs3MaskedMinRows);
}

template <typename T, int D, int BM, int STAGES>
Error launch_attention(cudaStream_t stream, const AttentionArgs& a, int grid_x, const char* target) {
  using Cfg = AttentionConfig<T, D, BM, STAGES>;
  const dim3 grid(grid_x, a.Hkv, a.num_partitions > 1 ? a.num_partitions : 1);
  bool launched = false;
  bool zeroed = false;  // rows owned by no sequence written by the attention kernel (a warp of the persistent
                        // kernels, unsplit; spare CTAs of attention_kernel)
  // The sm_90 kernels' 128-row tile. Head dims past 128 have no mma.sync kernel of this height: tile_height asks
  // for it only where the sm_90 wgmma kernels can serve the call (use_wgmma, sm90_kv_describable).
  constexpr bool kSm90Tile = BM == Sm90Config<T, D>::kBlockM;
  constexpr bool kWide = D > 128;
  if constexpr (kSm90Tile) {
    Sm90Kv kv;  // the TMA descriptors; without them (page size, driver) the mma.sync kernel serves the call
    if (grid_x > 0 && use_wgmma() && make_sm90_kv<T, D>(a, &kv, Sm90Config<T, D>::kBlockN)) {
      bool persistent = false;
      {
        // The warp-specialized persistent kernels where Q goes by TMA (group dividing 128), else the CTA-per-tile one.
        const int64_t items = static_cast<int64_t>(grid_x) * a.Hkv * grid.z;
        static const bool ws_regs_ok = kernel_holds_regs(attention_ws_sm90_kernel<T, D>, DenseWs<D>::kLaunchRegs);
        const int sms = device_sm_count();
        // The walk (ws_sm90.cuh): the kv heads slowest with no mask; otherwise the heads slowest for short
        // sequences and bands of the weight order for long ones (decided by the CTAs, which count the tiles);
        // MSA_OPS_DENSE_WS_WALK=0/1/2/3 picks one (heads fastest, heads slowest, bands, that choice) for measurements.
        int walk = a.mask == kMaskNull ? kWsHeadsSlowest : kWsShortSlowest;
        if (const char* w = std::getenv("MSA_OPS_DENSE_WS_WALK"); w != nullptr && w[0] >= '0' && w[0] <= '3')
          walk = w[0] - '0';
        CUtensorMap qmap;
        // A persistent launch over n items of `tiles` query tiles: one CTA per SM at most; warps' whole 16-row slices
        // leave by TMA store where the output allows it (else omap is unread).
        auto launch_ws = [&](auto kernel, int threads, int smem, const Sm90Kv& kvm, int64_t n, int tiles) {
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          CUtensorMap omap{};
          const bool tma_store = make_dense_out_map<T, D>(a, &omap);
          kernel<<<static_cast<int>(n < sms ? n : sms), threads, smem, stream>>>(a, kvm, qmap, tiles, walk, omap,
                                                                                tma_store ? 1 : 0);
        };
        // (The walk's int indices: the interleaved order has up to twice the items, and ws_walk one grid more.)
        if constexpr (!kWide) {  // (head dim 256: no pair kernel; two pairs' Q tiles and rings do not fit)
          static const bool pair_regs_ok =
              kernel_holds_regs(attention_ws_pair_sm90_kernel<T, D>, DenseWsPair<D>::kLaunchRegs);
          // Short sequences: the pair kernel's 64-row items (ws_pair_wanted), where it can serve the call.
          const int64_t pair_tiles = ws_pair_wanted(a) ? ragged_tiles(a.total_rows, a.batch, a.group, 64) : 0;
          const int64_t pair_items = pair_tiles * a.Hkv * grid.z;
          Sm90Kv kv_pair;  // the pair kernel's boxes: its 64-key tiles
          if (pair_regs_ok && pair_tiles > 0 && pair_items <= INT32_MAX / 4 &&
              make_dense_q_map<T, D>(a, &qmap, DenseWsPair<D>::kBlockM) &&
              make_sm90_kv<T, D>(a, &kv_pair, DenseWsPair<D>::kBlockN)) {
            note_launch(kLaunchSm90Pair);
            launch_ws(attention_ws_pair_sm90_kernel<T, D>, DenseWsPair<D>::kThreads, DenseWsPair<D>::kSmemAlloc,
                      kv_pair, pair_items, static_cast<int>(pair_tiles));
            persistent = true;
            zeroed = a.num_partitions <= 1;
          }
        }
        // (kv's boxes are the CTA-per-tile kernel's key tiles, which are DenseWs's: 128 keys, 64 at head dim 256.)
        static_assert(DenseWs<D>::kBlockN == Sm90Config<T, D>::kBlockN, "one K/V descriptor for both kernels");
        if constexpr (D == 64) {
          // Head dim 64: three consumer warpgroups on 192-row items (DenseWs<64, 3>; ws3_wanted), else the 128-row
          // items below.
          using C3 = DenseWs<64, 3>;
          static_assert(C3::kBlockN == Sm90Config<T, D>::kBlockN, "one K/V descriptor for both kernels");
          static const bool ws3_regs_ok = kernel_holds_regs(attention_ws_sm90_kernel<T, 64, 3>, C3::kLaunchRegs);
          if (!persistent && ws3_regs_ok && ws3_wanted(a)) {
            const int64_t tiles3 = query_tiles(a, C3::kBlockM);
            const int64_t items3 = tiles3 * a.Hkv * grid.z;
            if (tiles3 > 0 && items3 <= INT32_MAX / 4 && make_dense_q_map<T, D>(a, &qmap, C3::kBlockM)) {
              note_launch(kLaunchSm90Ws3);
              launch_ws(attention_ws_sm90_kernel<T, 64, 3>, C3::kThreads, C3::kSmemAlloc, kv, items3,
                        static_cast<int>(tiles3));
              persistent = true;
              zeroed = a.num_partitions <= 1;
            }
          }
        }
        if (!persistent && ws_regs_ok && items <= INT32_MAX / 4 && make_dense_q_map<T, D>(a, &qmap)) {
          note_launch(kLaunchSm90Ws);
          launch_ws(attention_ws_sm90_kernel<T, D>, DenseWs<D>::kThreads, DenseWs<D>::kSmemAlloc, kv, items, grid_x);
          persistent = true;
          zeroed = a.num_partitions <= 1;
        }
      }
      if (!persistent) {
        using C90 = Sm90Config<T, D>;
        auto kernel = attention_sm90_kernel<T, D>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C90::kSmemAlloc);
        note_launch(kLaunchSm90Cta);
        kernel<<<grid, C90::kThreads, C90::kSmemAlloc, stream>>>(a, kv);
      }
      if (Error e = check_launch(target); e.failure()) return e;
      launched = true;
    }
  }
  bool clustered = false;  // split-K partitions merged in the attention kernel, in clusters
  if constexpr (kWide && BM == 128) {
    if (grid_x > 0 && !launched) return invalid(target, "no kernel for a 128-row tile at this head dim here");
  } else if (grid_x > 0 && !launched) {
    auto kernel = attention_kernel<T, D, BM, STAGES>;
    // Ragged queries: x tiles past the tile bound, whose CTAs zero the rows owned by no sequence where the kernel
    // merges every partition (one, or a cluster); the combine kernel zeroes them after a split launched here.
    const int spare = a.q_mode == kQPadded ? 0 : static_cast<int>(spare_tiles(a.total_rows));
    if (static_cast<int64_t>(grid_x + spare) * (BM <= kHeadsFastestRows ? a.Hkv : 1) > INT32_MAX)
      return invalid(target, "too many query tiles x kv heads for one launch");
    const auto tiles = [&](int x) {
      return BM <= kHeadsFastestRows ? dim3(x * a.Hkv, 1, grid.z) : dim3(x, a.Hkv, grid.z);
    };
    dim3 g = tiles(grid_x + spare);
    if constexpr (Cfg::kTransposed) {
      // Power-of-two pages smaller than a key tile: the kernels with the small-page loader (attention_kernel's
      // kPagesSmall). Split in two, their partitions form a cluster and merge in the kernel. Larger pages (and
      // pages of other sizes, which the kernel of any layout serves) merge in the combine
      // kernel, whose route read 0.985-0.986x cuDNN at B=16 / 16k on an H200 against the cluster's 0.976-0.978
      // (at page 16, 0.950-0.951 against 0.959-0.960; benchmarks/NOTES_mha.md v24).
      // The small-page loader needs each thread's kPasses consecutive rows in one page: smaller pages (8 keys and
      // fewer) take the kernel of any layout too.
      const bool pow2_pages = a.kv_mode == kKvPaged && a.page_shift >= 0;
      if (pow2_pages && a.page_size < Cfg::kBlockN) {
        if (a.page_size >= Cfg::kPasses) {
          kernel = attention_kernel<T, D, BM, STAGES, false, kPagesSmall>;
          clustered = launch_cluster_merge(attention_kernel<T, D, BM, STAGES, true, kPagesSmall>,
                                           a.num_partitions, g, Cfg::kSmemBytes, stream, /*waits=*/false, a);
          if (clustered) note_launch(kLaunchMmaCluster);
        }
      } else if (pow2_pages) {
        // Power-of-two pages of a key tile or more: one page a tile, the loader of kPagesWhole.
        kernel = attention_kernel<T, D, BM, STAGES, false, kPagesWhole>;
      }
    }
    if (!clustered) {
      if (a.num_partitions > 1) g = tiles(grid_x);  // (split: no spare tiles)
      // Attribute set per launch (cheap, idempotent, no synchronization).
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      note_launch(kLaunchMma);
      kernel<<<g, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(a);
    }
    if (Error e = check_launch(target); e.failure()) return e;
    zeroed = a.q_mode != kQPadded && (a.num_partitions <= 1 || clustered);
  }
  if (a.total_rows > 0 && !zeroed) {
    if (a.num_partitions > 1 && !clustered) {
      note_launch(kLaunchCombine);
      split_k_combine_kernel<T, D><<<dim3(a.total_rows, a.H), D, 0, stream>>>(a);
    } else {
      launch_zero_unowned_rows<T>(a, a.H * D, stream);
    }
    return check_launch(target);
  }
  return Error::Success();
}

Error dispatch(cudaStream_t stream, DataType dt, int d, int bm, const AttentionArgs& a, int grid_x,
               const char* target) {
#define MSA_OPS_DISPATCH(T, D_, BM_, ST_)                                                       \
  if (dt == (std::is_same<T, __half>::value ? DataType::F16 : DataType::BF16) && d == D_ && bm == BM_) \
    return launch_attention<T, D_, BM_, ST_>(stream, a, grid_x, target);
  MSA_OPS_ATTENTION_CONFIGS(MSA_OPS_DISPATCH)
#undef MSA_OPS_DISPATCH
  return invalid(target,
                 "no CUDA kernel for dtype/head_dim " + std::to_string(d) + " (supported: bf16/f16, 64/128/256)");
}

// A ragged call of T rows and B sequences over ragged_tiles x tiles, refused where they and the spare tiles would
// not fit an int.
Error dispatch_ragged(cudaStream_t stream, DataType dt, int d, int bm, const AttentionArgs& a, int64_t T, int64_t B,
                      const char* target) {
  const int64_t tiles = ragged_tiles(T, B, a.group, bm);
  if (tiles + spare_tiles(T) > INT32_MAX) return invalid(target, "too many query tiles for one launch");
  return dispatch(stream, dt, d, bm, a, static_cast<int>(tiles), target);
}

// What the CUDA kernels take beyond the contract's checks (checks.h).
Error check_supported(const char* target, const AnyBuffer& q, int64_t d) {
  const DataType dt = q.element_type();
  if ((dt == DataType::BF16 || dt == DataType::F16) && (d == 64 || d == 128 || d == 256)) return Error::Success();
  return invalid(target, std::string("q: the CUDA kernels take bfloat16 or float16 with head_dim 64, 128 or 256, got ") +
                             dtype_name(dt) + dims_str(q));
}

// Query tile height: the routing ladder's choice, or from shapes when the op has no plan.
int tile_height(int64_t requested, int64_t max_rows_per_seq, int64_t group, int64_t d, const AttentionArgs& a) {
  // Kernels exist for 8-, 16-, 64- and 128-row tiles (decode; the ladder's 1q / 2q prefill tiles). Past head dim
  // 128 the 128-row tile is the sm_90 wgmma kernels' alone: where they cannot serve the call (another GPU, or K/V
  // that no TMA descriptor describes), 64 rows.
  const int64_t top = d <= 128 || (use_wgmma() && sm90_kv_describable(a)) ? 128 : 64;
  if (requested > 0) return requested <= 8 ? 8 : requested <= 16 ? 16 : requested <= 64 ? 64 : top;
  const int64_t rows = max_rows_per_seq * group;
  return rows <= 8 ? 8 : rows <= 16 ? 16 : rows < 128 ? 64 : top;
}

void fill_common(AttentionArgs& a, const AnyBuffer& q, int64_t H, int64_t Hkv, int64_t mask, int64_t window,
                 double scale, int64_t num_partitions, int64_t block_n) {
  a.q = q.untyped_data();
  a.H = static_cast<int>(H);
  a.Hkv = static_cast<int>(Hkv);
  a.group = static_cast<int>(H / Hkv);
  a.mask = static_cast<int>(mask);
  // Query positions and key indices are below 2^31 on every path (the paged handlers' page-table check, the array
  // sizes otherwise), so a window of INT32_MAX shows every key a larger one does (every distance fits, and every
  // position is in chunk 0): the clamp changes no row's keys. (A clamp at 2^30 did, past position 2^30.)
  a.window = static_cast<int>(iclamp(window, -1, int64_t{INT32_MAX}));
  a.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  a.rescale_slack_log2 = rescale_slack_log2();
  a.wg_tail_skip = env_switch("MSA_OPS_WG_TAIL_SKIP") != 0;
  a.num_partitions = static_cast<int>(num_partitions);  // in [1, kMaxPartitions]: check_attention_output
  a.split_block_n = static_cast<int>(split_k_block_n(block_n));
  a.sink = nullptr;
  a.ws_o = nullptr;
  a.ws_lse = nullptr;
}

// The checks both paged handlers make of the attributes and the pool, between their own operands' and the output's.
Error check_paged_call(const char* target, const AnyBuffer& q, const AnyBuffer& kv, int64_t H, int64_t D, int64_t B,
                       const AnyBuffer& cache_lengths, const AnyBuffer& lut, const AnyBuffer& layer, int64_t mask,
                       int64_t window, int64_t block_n) {
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  if (block_n < 1) return invalid(target, "block_n: expected >= 1");
  if (auto e = check_supported(target, q, D); e.failure()) return e;
  return check_paged_cache(target, q, kv, H, D, B, cache_lengths, lut, layer);
}

// Query positions reach S_max + rows - 1 (rows: T ragged, S padded): the kernels' int32 key indices must hold them.
Error check_key_positions(const char* target, const AnyBuffer& lut, const AnyBuffer& kv, int64_t rows) {
  int64_t s_max = 0;  // (an empty pool or page table may carry any width: the product must not wrap)
  if (!mul_fits(dim(lut, 1), dim(kv, 3), &s_max) || s_max >= (int64_t{1} << 31) - rows)
    return invalid(target, "kv_lookup_table: max_pages * page_size + query rows must be < 2^31, got max_pages " +
                               std::to_string(dim(lut, 1)) + ", page_size " + std::to_string(dim(kv, 3)));
  return Error::Success();
}

// The split-K workspaces, checked with the output (check_attention_output).
void set_workspace(AttentionArgs& a, AnyResult ws_o, AnyResult ws_lse) {
  if (a.num_partitions <= 1) return;
  a.ws_o = static_cast<float*>(ws_o->untyped_data());
  a.ws_lse = static_cast<float*>(ws_lse->untyped_data());
}

void fill_paged(AttentionArgs& a, const AnyBuffer& kv, const AnyBuffer& cache_lengths, const AnyBuffer& lut,
                const AnyBuffer& layer) {
  a.kv_mode = kKvPaged;
  a.kv_blocks = kv.untyped_data();
  a.num_blocks = static_cast<int>(dim(kv, 0));
  a.num_layers = static_cast<int>(dim(kv, 2));
  a.page_size = static_cast<int>(dim(kv, 3));
  a.page_shift = -1;
  for (int sh = 0; sh < 30; ++sh)
    if ((int64_t{1} << sh) == a.page_size) a.page_shift = sh;
  a.cache_lengths = static_cast<const int32_t*>(cache_lengths.untyped_data());
  a.lookup = static_cast<const int32_t*>(lut.untyped_data());
  a.max_pages = static_cast<int>(dim(lut, 1));
  a.layer_ptr = static_cast<const int32_t*>(layer.untyped_data());
}

}  // namespace

Error MhaRaggedPaged(cudaStream_t stream, AnyBuffer q, AnyBuffer offsets, AnyBuffer kv, AnyBuffer cache_lengths,
                     AnyBuffer lut, AnyBuffer layer, AnyBuffer sink, int64_t mask, int64_t window, double scale,
                     int64_t has_sink, int64_t num_partitions, int64_t block_n, int64_t tile_m, AnyResult out,
                     AnyResult ws_o, AnyResult ws_lse) {
  const char* target = "msa_ops_mha_ragged_paged";
  if (rank(q) != 3) return invalid(target, "q: expected [T, H, D], got " + dims_str(q));
  const int64_t T = dim(q, 0), H = dim(q, 1), D = dim(q, 2), B = count(cache_lengths), Hkv = dim(kv, 4);
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_paged_call(target, q, kv, H, D, B, cache_lengths, lut, layer, mask, window, block_n);
      e.failure())
    return e;
  if (auto e = check_sink(target, has_sink != 0, sink, q, H); e.failure()) return e;
  if (auto e = check_attention_output(target, q.element_type(), q, *out, *ws_o, *ws_lse, T, H, D, num_partitions);
      e.failure())
    return e;
  if (auto e = check_key_positions(target, lut, kv, T); e.failure()) return e;
  if (auto e = check_int_count(target, "B (cache_lengths)", B); e.failure()) return e;
  AttentionArgs a{};
  fill_common(a, q, H, Hkv, mask, window, scale, num_partitions, block_n);
  a.out = out->untyped_data();
  a.q_mode = kQRagged;
  a.total_rows = static_cast<int>(T);
  a.batch = static_cast<int>(B);
  a.q_offsets = static_cast<const int32_t*>(offsets.untyped_data());
  fill_paged(a, kv, cache_lengths, lut, layer);
  if (has_sink) a.sink = sink.untyped_data();
  set_workspace(a, ws_o, ws_lse);
  const int bm = tile_height(tile_m, T - B + 1, a.group, D, a);
  return dispatch_ragged(stream, q.element_type(), static_cast<int>(D), bm, a, T, B, target);
}

Error MhaPaddedPaged(cudaStream_t stream, AnyBuffer q, AnyBuffer kv, AnyBuffer cache_lengths, AnyBuffer lut,
                     AnyBuffer layer, AnyBuffer valid_lengths, int64_t mask, int64_t window, double scale,
                     int64_t num_partitions, int64_t block_n, int64_t tile_m, AnyResult out, AnyResult ws_o,
                     AnyResult ws_lse) {
  const char* target = "msa_ops_mha_padded_paged";
  if (rank(q) != 4) return invalid(target, "q: expected [B, S, H, D], got " + dims_str(q));
  const int64_t B = dim(q, 0), S = dim(q, 1), H = dim(q, 2), D = dim(q, 3), Hkv = dim(kv, 4);
  if (auto e = check_index(target, "valid_lengths", valid_lengths, B); e.failure()) return e;
  if (auto e = check_paged_call(target, q, kv, H, D, B, cache_lengths, lut, layer, mask, window, block_n);
      e.failure())
    return e;
  int64_t rows = 0;
  if (auto e = padded_rows(target, q, &rows); e.failure()) return e;
  if (auto e = check_attention_output(target, q.element_type(), q, *out, *ws_o, *ws_lse, rows, H, D, num_partitions);
      e.failure())
    return e;
  if (auto e = check_key_positions(target, lut, kv, S); e.failure()) return e;
  if (auto e = check_int_count(target, "B * S (q's rows)", rows); e.failure()) return e;
  AttentionArgs a{};
  fill_common(a, q, H, Hkv, mask, window, scale, num_partitions, block_n);
  a.out = out->untyped_data();
  a.q_mode = kQPadded;
  a.total_rows = static_cast<int>(rows);
  a.seq_rows = static_cast<int>(S);
  a.batch = static_cast<int>(B);
  a.valid_lengths = static_cast<const int32_t*>(valid_lengths.untyped_data());
  fill_paged(a, kv, cache_lengths, lut, layer);
  set_workspace(a, ws_o, ws_lse);
  const int bm = tile_height(tile_m, S, a.group, D, a);
  const int grid_x = static_cast<int>(query_tiles(a, bm));
  return dispatch(stream, q.element_type(), static_cast<int>(D), bm, a, grid_x, target);
}

Error MhaRaggedNoCache(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer offsets,
                       AnyBuffer kv_offsets, int64_t mask, int64_t window, double scale, AnyResult out) {
  const char* target = "msa_ops_mha_ragged_no_cache";
  if (rank(q) != 3) return invalid(target, "q: expected [T, H, D], got " + dims_str(q));
  const int64_t T = dim(q, 0), H = dim(q, 1), D = dim(q, 2), B = count(offsets) - 1, Hkv = dim(k, 1);
  if (B < 0) return invalid(target, "input_row_offsets: expected at least one element");
  if (auto e = check_index(target, "input_row_offsets", offsets, B + 1); e.failure()) return e;
  if (auto e = check_index(target, "kv_input_row_offsets", kv_offsets, B + 1); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  if (auto e = check_supported(target, q, D); e.failure()) return e;
  if (auto e = check_no_cache_kv(target, q, k, v, 3, 1, H, D); e.failure()) return e;
  if (auto e = check_attention_output(target, q.element_type(), q, *out, *out, *out, T, H, D, 1); e.failure()) return e;
  if (auto e = check_int_count(target, "q's rows", T); e.failure()) return e;
  if (auto e = check_int_count(target, "k's rows", dim(k, 0)); e.failure()) return e;
  AttentionArgs a{};
  fill_common(a, q, H, Hkv, mask, window, scale, 1, 64);
  a.out = out->untyped_data();
  a.q_mode = kQRagged;
  a.total_rows = static_cast<int>(T);
  a.batch = static_cast<int>(B);
  a.q_offsets = static_cast<const int32_t*>(offsets.untyped_data());
  a.kv_mode = kKvRagged;
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.kv_offsets = static_cast<const int32_t*>(kv_offsets.untyped_data());
  a.total_keys = static_cast<int>(dim(k, 0));
  const int bm = tile_height(0, T - B + 1, a.group, D, a);
  return dispatch_ragged(stream, q.element_type(), static_cast<int>(D), bm, a, T, B, target);
}

Error MhaPaddedNoCache(cudaStream_t stream, AnyBuffer q, AnyBuffer k, AnyBuffer v, AnyBuffer valid_length,
                       int64_t mask, int64_t window, double scale, AnyResult out) {
  const char* target = "msa_ops_mha_padded_no_cache";
  if (rank(q) != 4) return invalid(target, "q: expected [B, S, H, D], got " + dims_str(q));
  const int64_t B = dim(q, 0), S = dim(q, 1), H = dim(q, 2), D = dim(q, 3), Hkv = dim(k, 2);
  if (rank(k) != 4 || dim(k, 0) != B)
    return invalid(target, "k: expected [B, Sk, Hkv, D] with B = " + std::to_string(B) + ", got " + dims_str(k));
  if (auto e = check_index(target, "valid_length", valid_length, B); e.failure()) return e;
  if (auto e = check_mask(target, mask, window); e.failure()) return e;
  if (auto e = check_supported(target, q, D); e.failure()) return e;
  if (auto e = check_no_cache_kv(target, q, k, v, 4, 2, H, D); e.failure()) return e;
  int64_t rows = 0, k_rows = 0;
  if (auto e = padded_rows(target, q, &rows); e.failure()) return e;
  if (auto e = padded_rows(target, k, &k_rows); e.failure()) return e;
  if (auto e = check_attention_output(target, q.element_type(), q, *out, *out, *out, rows, H, D, 1); e.failure())
    return e;
  if (auto e = check_int_count(target, "B * S (q's rows)", rows); e.failure()) return e;
  if (auto e = check_int_count(target, "B * Sk (k's rows)", k_rows); e.failure()) return e;
  AttentionArgs a{};
  fill_common(a, q, H, Hkv, mask, window, scale, 1, 64);
  a.out = out->untyped_data();
  a.q_mode = kQPadded;
  a.total_rows = static_cast<int>(rows);
  a.seq_rows = static_cast<int>(S);
  a.batch = static_cast<int>(B);
  a.valid_lengths = static_cast<const int32_t*>(valid_length.untyped_data());
  a.kv_mode = kKvPadded;
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.total_keys = static_cast<int>(dim(k, 1));
  const int bm = tile_height(0, S, a.group, D, a);
  const int grid_x = static_cast<int>(query_tiles(a, bm));
  return dispatch(stream, q.element_type(), static_cast<int>(D), bm, a, grid_x, target);
}

}  // namespace cuda
}  // namespace msa_ops

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_ragged_paged, msa_ops::cuda::MhaRaggedPaged,
                              MSA_OPS_SIG_MHA_RAGGED_PAGED(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_padded_paged, msa_ops::cuda::MhaPaddedPaged,
                              MSA_OPS_SIG_MHA_PADDED_PAGED(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_ragged_no_cache, msa_ops::cuda::MhaRaggedNoCache,
                              MSA_OPS_SIG_MHA_RAGGED_NO_CACHE(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_mha_padded_no_cache, msa_ops::cuda::MhaPaddedNoCache,
                              MSA_OPS_SIG_MHA_PADDED_NO_CACHE(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>()),
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});

// The launches of each kernel kind so far in this process (attention.cuh's LaunchKind): writes the first n counts
// into out and returns how many kinds there are.
extern "C" __attribute__((visibility("default"))) int msa_ops_cuda_launch_counts(unsigned long long* out, int n) {
  for (int k = 0; k < n && k < msa_ops::cuda::kLaunchKinds; ++k)
    out[k] = msa_ops::cuda::g_launch_counts[k].load(std::memory_order_relaxed);
  return msa_ops::cuda::kLaunchKinds;
}
// The kinds' names, comma-separated, in LaunchKind order.
extern "C" __attribute__((visibility("default"))) const char* msa_ops_cuda_launch_names() {
  return msa_ops::cuda::kLaunchNames;
}

#if defined(MSA_OPS_WS_STAMPS)
// Profiling builds: copies the persistent prefill kernel's phase stamps (ws_sm90.cuh) into `out`
// ([2][kWsStampItems][kWsStampPoints] int64); returns the cudaError_t.
extern "C" __attribute__((visibility("default"))) int msa_ops_ws_stamps(long long* out) {
  return static_cast<int>(
      cudaMemcpyFromSymbol(out, msa_ops::cuda::g_ws_stamps, sizeof(msa_ops::cuda::g_ws_stamps)));
}
// Overwrites the stamps with `in` (zeros, to clear them); returns the cudaError_t.
extern "C" __attribute__((visibility("default"))) int msa_ops_ws_stamps_set(const long long* in) {
  return static_cast<int>(
      cudaMemcpyToSymbol(msa_ops::cuda::g_ws_stamps, in, sizeof(msa_ops::cuda::g_ws_stamps)));
}
#endif
