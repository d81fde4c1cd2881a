// CUDA handler of mo.msa.indexer.ragged.paged (SEMANTICS.md §8): per query row and index head, score every
// 128-token block of the row's sequence by its max visible key score, then pick top-k (forced init/local
// blocks first, ties to the lower id), ids ascending and -1 padded. Two kernels, no host synchronization:
//
// indexer_score_kernel  grid (rows, block groups of 32). Each warp scores one block at a time: the 16-byte
//   chunks of a key row are spread over L lanes, two chunks per lane for rows of 64 bytes and more (a warp
//   covers 32/L keys per step), every lane keeps its chunks of q (pre-scaled, 4 index heads per pass) in
//   registers, the four heads' chunk dot products are reduce-scattered over the L lanes by shuffles (each lane
//   ends with one head's sum), and a running max skips keys past the row's position or past the sequence. The key bytes are read once per row and 4 heads. Blocks that are not eligible (page
//   outside the pool, bad layer, no visible key, padding row) get a NaN score: real scores are never NaN (a NaN
//   dot product never raises the max, as in the CPU handler).
// indexer_topk_kernel   grid (rows, index heads). The row's scores go to shared memory; eligible ids are ranked
//   by a block-wide scan; when more than topk are eligible, the middle ones (neither forced init nor forced
//   local) are bitonic-sorted by (score desc, id asc) as 64-bit keys and the first topk-init-local are taken;
//   the chosen flags are compacted in id order.
//
// Scores live in an XLA-allocated workspace result [T, Hi, max_pages] f32 (the CUDA lowering adds it).
// Prefill rows each re-read their keys (no reuse of K across the rows of a tile yet).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "attention.cuh"
#include "msa_ops/checks.h"
#include "msa_ops/common.h"
#include "msa_ops/ffi.h"
#include "msa_ops/ffi_signatures.h"

namespace msa_ops {
namespace cuda {
namespace {

constexpr int kBlock = 128;          // tokens per block (page)
constexpr int kScoreThreads = 256;   // 8 warps
constexpr int kBlocksPerCta = 32;    // blocks one score CTA covers (4 per warp)
constexpr int kHeadsPerPass = 4;     // index heads a warp scores per pass over a block
constexpr int kTopkThreads = 512;
constexpr int kMaxPagesCuda = 8192;  // top-k sorts next_pow2(max_pages) 64-bit keys in shared memory
constexpr uint32_t kIneligibleBits = 0x7fc0deadu;

struct IxArgs {
  const void* q;  // [T, Hi, Di]
  const void* k;  // [NB, 1, L, 128, 1, Di]
  const int32_t* offsets;
  const int32_t* cache_lengths;
  const int32_t* lookup;  // [B, MP]
  const int32_t* layer_ptr;
  int T, B, Hi, Di, MP, NB, L, topk, init_blocks, local_blocks;
  float scale;
  float* scores;  // [T, Hi, MP]
  int32_t* out;   // [Hi, T, topk]
};

// 16 bytes of T -> floats.
template <typename T>
struct Chunk;
template <>
struct Chunk<float> {
  static constexpr int kElems = 4;
  static __device__ __forceinline__ void widen(const uint4& r, float* f) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
};
template <>
struct Chunk<__nv_bfloat16> {
  static constexpr int kElems = 8;
  static __device__ __forceinline__ void widen(const uint4& r, float* f) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};
template <>
struct Chunk<__half> {
  static constexpr int kElems = 8;
  static __device__ __forceinline__ void widen(const uint4& r, float* f) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};
template <>
struct Chunk<__nv_fp8_e4m3> {
  static constexpr int kElems = 16;
  static __device__ __forceinline__ void widen(const uint4& r, float* f) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2_raw hr =
            __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&hr));
        f[4 * i + 2 * h] = v.x;
        f[4 * i + 2 * h + 1] = v.y;
      }
    }
  }
};

// ------------------------------------------------------------------------------------------------ scores

// L lanes per key row, M 16-byte chunks per lane (a key row is L*M chunks; lane `ch` holds chunks ch + m*L, so
// each load instruction of the warp reads whole rows).
template <typename T, int L, int M>
__global__ void __launch_bounds__(kScoreThreads, 2) indexer_score_kernel(const IxArgs a) {
  constexpr int E = Chunk<T>::kElems;
  constexpr int KPW = 32 / L;      // keys a warp covers per step
  constexpr int UNROLL = 8 / M;    // steps whose loads are in flight together (8 chunks per lane)
  // Rows of 4 to 16 lanes reduce-scatter the four heads' partial dots (below); others sum each head over L lanes.
  constexpr bool kScatter = L >= 4 && L <= 16 && kHeadsPerPass == 4;
  const int t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / L, ch = lane % L;  // key slot within the warp's step, chunk group within the key row
  const int j_begin = blockIdx.y * kBlocksPerCta;
  const int j_end = min(j_begin + kBlocksPerCta, a.MP);
  float* scores_row = a.scores + static_cast<int64_t>(t) * a.Hi * a.MP;

  int64_t e0 = 0, e1 = 0;
  const int b = row_owner(a.offsets, a.B, a.T, t, &e0, &e1);
  const int64_t s_max = static_cast<int64_t>(a.MP) * kBlock;
  const int layer = *a.layer_ptr;
  int64_t key_end = 0;  // keys [0, key_end) are visible to the row (before page validity)
  if (b >= 0 && layer >= 0 && layer < a.L) {
    const int64_t c = iclamp(a.cache_lengths[b], 0, s_max);
    const int64_t kmax = imin(c + (e1 - e0), s_max);
    key_end = imin(kmax, c + (t - e0) + 1);
  }
  const int nblk = static_cast<int>(ceil_div(key_end, kBlock));
  const T* kbase = static_cast<const T*>(a.k);
  const int64_t page_elems = static_cast<int64_t>(a.L) * kBlock * a.Di;
  const int64_t layer_off = static_cast<int64_t>(layer) * kBlock * a.Di;
  const T* qrow = static_cast<const T*>(a.q) + static_cast<int64_t>(t) * a.Hi * a.Di;

  for (int j = j_begin + warp; j < j_end; j += kScoreThreads / 32) {
    int page = -1;
    if (j < nblk) {
      const int32_t p = __ldg(a.lookup + static_cast<int64_t>(b) * a.MP + j);
      page = (p >= 0 && p < a.NB) ? p : -1;
    }
    if (page < 0) {  // not eligible (also padding rows and blocks past the row's position)
      for (int h = lane; h < a.Hi; h += 32)
        scores_row[static_cast<int64_t>(h) * a.MP + j] = __uint_as_float(kIneligibleBits);
      continue;
    }
    const int nk = static_cast<int>(imin(kBlock, key_end - static_cast<int64_t>(j) * kBlock));  // visible keys
    const T* kblk = kbase + static_cast<int64_t>(page) * page_elems + layer_off + ch * E;
    for (int h0 = 0; h0 < a.Hi; h0 += kHeadsPerPass) {
      float qf[kHeadsPerPass][M][E];
#pragma unroll
      for (int hh = 0; hh < kHeadsPerPass; ++hh) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (h0 + hh < a.Hi) {
            const uint4 raw =
                *reinterpret_cast<const uint4*>(qrow + static_cast<int64_t>(h0 + hh) * a.Di + (ch + m * L) * E);
            Chunk<T>::widen(raw, qf[hh][m]);
#pragma unroll
            for (int e = 0; e < E; ++e) qf[hh][m][e] *= a.scale;
          } else {
#pragma unroll
            for (int e = 0; e < E; ++e) qf[hh][m][e] = 0.f;
          }
        }
      }
      float mx[kHeadsPerPass];
#pragma unroll
      for (int hh = 0; hh < kHeadsPerPass; ++hh) mx[hh] = -INFINITY;
      // kScatter: the four heads' partial dot products are reduce-scattered over the key row's L lanes. The
      // exchange with the lane L/2 away leaves each lane two heads summed over 2 lanes, the one with the lane L/4
      // away one head (2*[ch & L/2] + [ch & L/4]) over 4 lanes, and a butterfly over the last L/4 lanes finishes
      // it: 3 + log2(L/4) shuffles per key instead of 4*log2(L). Each lane keeps the running max of its head in
      // mx[0].
      const bool hi_a = kScatter && (ch & (L / 2)) != 0, hi_b = kScatter && (ch & (L / 4)) != 0;
      for (int k0 = 0; k0 < nk; k0 += KPW * UNROLL) {
        uint4 raw[UNROLL][M];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int key = k0 + u * KPW + sub;
#pragma unroll
          for (int m = 0; m < M; ++m)
            raw[u][m] = key < nk ? __ldg(reinterpret_cast<const uint4*>(kblk + static_cast<int64_t>(key) * a.Di +
                                                                        m * L * E))
                                 : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          float dot[kHeadsPerPass];
#pragma unroll
          for (int hh = 0; hh < kHeadsPerPass; ++hh) dot[hh] = 0.f;
#pragma unroll
          for (int m = 0; m < M; ++m) {
            float kf[E];
            Chunk<T>::widen(raw[u][m], kf);
#pragma unroll
            for (int hh = 0; hh < kHeadsPerPass; ++hh)
#pragma unroll
              for (int e = 0; e < E; ++e) dot[hh] = fmaf(qf[hh][m][e], kf[e], dot[hh]);
          }
          const bool vis = k0 + u * KPW + sub < nk;
          if constexpr (kScatter) {
            const float keep0 = hi_a ? dot[2] : dot[0], keep1 = hi_a ? dot[3] : dot[1];
            const float send0 = hi_a ? dot[0] : dot[2], send1 = hi_a ? dot[1] : dot[3];
            const float r0 = keep0 + __shfl_xor_sync(0xffffffff, send0, L / 2);
            const float r1 = keep1 + __shfl_xor_sync(0xffffffff, send1, L / 2);
            float v = (hi_b ? r1 : r0) + __shfl_xor_sync(0xffffffff, hi_b ? r0 : r1, L / 4);
#pragma unroll
            for (int off = L / 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            if (vis) mx[0] = fmaxf(mx[0], v);  // fmaxf: a NaN dot never wins
          } else {
#pragma unroll
            for (int off = L / 2; off > 0; off >>= 1)
#pragma unroll
              for (int hh = 0; hh < kHeadsPerPass; ++hh) dot[hh] += __shfl_xor_sync(0xffffffff, dot[hh], off);
#pragma unroll
            for (int hh = 0; hh < kHeadsPerPass; ++hh)
              if (vis) mx[hh] = fmaxf(mx[hh], dot[hh]);  // fmaxf: a NaN dot never wins
          }
        }
      }
      if constexpr (kScatter) {
#pragma unroll
        for (int off = 16; off >= L; off >>= 1) mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffff, mx[0], off));
        const int hh = (hi_a ? 2 : 0) + (hi_b ? 1 : 0);
        if (sub == 0 && (ch & (L / 4 - 1)) == 0 && h0 + hh < a.Hi)
          scores_row[static_cast<int64_t>(h0 + hh) * a.MP + j] = mx[0];
      } else {
#pragma unroll
        for (int off = 16; off >= L; off >>= 1)
#pragma unroll
          for (int hh = 0; hh < kHeadsPerPass; ++hh)
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffff, mx[hh], off));
        if (lane == 0) {
#pragma unroll
          for (int hh = 0; hh < kHeadsPerPass; ++hh)
            if (h0 + hh < a.Hi) scores_row[static_cast<int64_t>(h0 + hh) * a.MP + j] = mx[hh];
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ top-k

// Exclusive scan of one int per thread over the block; returns the thread's prefix, *total = the sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  int x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffff, x, d);
    if (lane >= d) x += u;
  }
  __syncthreads();  // warp_sums free from any previous use
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffff, w, d);
      if (lane >= d) w += u;
    }
    if (lane < nwarps) warp_sums[lane] = w;  // inclusive
  }
  __syncthreads();
  *total = warp_sums[nwarps - 1];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
}

// Float -> uint32 whose ascending order is the float's descending order; -0 as +0 (equal scores tie, and the sort's
// low word, the block id, puts the lower id first).
__device__ __forceinline__ uint32_t desc_bits(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  const uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~asc;
}

__global__ void __launch_bounds__(kTopkThreads) indexer_topk_kernel(const IxArgs a, int npow2) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);                 // [npow2]
  int* rank = reinterpret_cast<int*>(keys + npow2);                    // [MP] rank among eligible, or -1
  unsigned char* chosen = reinterpret_cast<unsigned char*>(rank + a.MP);  // [MP]
  __shared__ int warp_sums[32];
  const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
  const float* sc = a.scores + (static_cast<int64_t>(t) * a.Hi + h) * a.MP;
  int32_t* dst = a.out + (static_cast<int64_t>(h) * a.T + t) * a.topk;
  const int MP = a.MP;
  const int per = (MP + nt - 1) / nt;  // contiguous ids per thread, so scans run in id order
  const int lo = min(MP, tid * per), hi = min(MP, lo + per);

  // Rank of each eligible id (ascending id order).
  int cnt = 0;
  for (int j = lo; j < hi; ++j) cnt += isnan(sc[j]) ? 0 : 1;
  int total = 0;
  int r = block_exclusive_scan(cnt, warp_sums, &total);
  for (int j = lo; j < hi; ++j) {
    const bool el = !isnan(sc[j]);
    rank[j] = el ? r++ : -1;
    chosen[j] = 0;
  }
  const int E = total;
  const int ni = a.init_blocks, nl = a.local_blocks;
  __syncthreads();
  if (E <= a.topk) {
    for (int j = tid; j < MP; j += nt)
      if (rank[j] >= 0) chosen[j] = 1;
  } else {
    const int want = a.topk - ni - nl;
    for (int i = tid; i < npow2; i += nt) {
      uint64_t key = ~uint64_t{0};
      if (i < MP) {
        const int rk = rank[i];
        if (rk >= 0 && (rk < ni || rk >= E - nl)) chosen[i] = 1;  // forced
        else if (rk >= 0) key = (static_cast<uint64_t>(desc_bits(sc[i])) << 32) | static_cast<uint32_t>(i);
      }
      keys[i] = key;
    }
    if (want > 0) {
      __syncthreads();
      // Bitonic sort, ascending.
      for (int size = 2; size <= npow2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
          __syncthreads();
          for (int i = tid; i < npow2 / 2; i += nt) {
            const int lo_i = 2 * i - (i & (stride - 1));
            const int hi_i = lo_i + stride;
            const bool up = (lo_i & size) == 0;
            const uint64_t x = keys[lo_i], y = keys[hi_i];
            if ((x > y) == up) {
              keys[lo_i] = y;
              keys[hi_i] = x;
            }
          }
        }
      }
      __syncthreads();
      for (int i = tid; i < want; i += nt) chosen[static_cast<uint32_t>(keys[i])] = 1;
    }
  }
  __syncthreads();
  // Compact the chosen ids in ascending order, then -1.
  cnt = 0;
  for (int j = lo; j < hi; ++j) cnt += chosen[j];
  int n_chosen = 0;
  r = block_exclusive_scan(cnt, warp_sums, &n_chosen);
  for (int j = lo; j < hi; ++j)
    if (chosen[j] && r < a.topk) dst[r++] = j;
  for (int i = n_chosen + tid; i < a.topk; i += nt) dst[i] = -1;
}

int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Two chunks per lane (fewer shuffles per key) for 16- and 32-bit keys of 4 chunks and more; fp8 chunks hold 16
// elements already (two would not fit the 128-register budget of two CTAs per SM).
template <typename T, int CHUNKS>
void launch_score(dim3 grid, cudaStream_t stream, const IxArgs& a) {
  constexpr int M = (sizeof(T) >= 2 && CHUNKS >= 4) ? 2 : 1;
  indexer_score_kernel<T, CHUNKS / M, M><<<grid, kScoreThreads, 0, stream>>>(a);
}

template <typename T>
Error launch(cudaStream_t stream, const IxArgs& a, const char* target) {
  if (a.T > 0 && a.Hi > 0) {
    const dim3 grid_s(a.T, static_cast<unsigned>(ceil_div(a.MP, kBlocksPerCta)));
    const int chunks = a.Di * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per key row
    switch (chunks) {
      case 1: launch_score<T, 1>(grid_s, stream, a); break;
      case 2: launch_score<T, 2>(grid_s, stream, a); break;
      case 4: launch_score<T, 4>(grid_s, stream, a); break;
      case 8: launch_score<T, 8>(grid_s, stream, a); break;
      case 16: launch_score<T, 16>(grid_s, stream, a); break;
      case 32: launch_score<T, 32>(grid_s, stream, a); break;
      default: return invalid(target, "index head dim " + std::to_string(a.Di) + " is not supported on CUDA");
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": score kernel launch failed: " + cudaGetErrorString(e));
    const int npow2 = next_pow2(a.MP);
    const size_t smem = static_cast<size_t>(npow2) * 8 + static_cast<size_t>(a.MP) * 5;
    cudaFuncSetAttribute(indexer_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    indexer_topk_kernel<<<dim3(a.T, a.Hi), kTopkThreads, smem, stream>>>(a, npow2);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return Error::Internal(std::string(target) + ": top-k kernel launch failed: " + cudaGetErrorString(e));
  }
  return Error::Success();
}

}  // namespace

Error MsaIndexer(cudaStream_t stream, AnyBuffer q, AnyBuffer offsets, AnyBuffer k_blocks, AnyBuffer cache_lengths,
                 AnyBuffer lut, AnyBuffer layer, int64_t topk, int64_t init_blocks, int64_t local_blocks,
                 double scale, AnyResult out, AnyResult ws) {
  const char* target = "msa_ops_msa_indexer";
  if (auto e = check_indexer_operands(target, q, offsets, k_blocks, cache_lengths, lut, layer, topk, init_blocks,
                                      local_blocks, *out);
      e.failure())
    return e;
  const DataType dt = q.element_type();
  const int64_t T = dim(q, 0), Hi = dim(q, 1), Di = dim(q, 2), B = count(cache_lengths), MP = dim(lut, 1);
  if (auto e = check_int_count(target, "topk", topk); e.failure()) return e;  // init and local are <= topk
  if (auto e = check_int_count(target, "q's rows", T); e.failure()) return e;
  if (auto e = check_int_count(target, "B (k_cache_lengths)", B); e.failure()) return e;
  if (auto e = check_int_count(target, "num_blocks (k_blocks)", dim(k_blocks, 0)); e.failure()) return e;
  const int64_t row_bytes = Di * static_cast<int64_t>(dt == DataType::F32 ? 4 : dt == DataType::F8E4M3FN ? 1 : 2);
  if (row_bytes % 16 != 0 || row_bytes / 16 > 32 || ((row_bytes / 16) & (row_bytes / 16 - 1)) != 0)
    return invalid(target, "index key rows must be 16, 32, ..., 512 bytes on CUDA, got " + std::to_string(row_bytes));
  if (MP > kMaxPagesCuda) return invalid(target, "max_pages above " + std::to_string(kMaxPagesCuda));
  if (ws->element_type() != DataType::F32 || rank(*ws) != 3 || dim(*ws, 0) != T || dim(*ws, 1) != Hi || dim(*ws, 2) != MP)
    return invalid(target, "scores: expected float32[" + std::to_string(T) + ", " + std::to_string(Hi) + ", " +
                               std::to_string(MP) + "], got " + dims_str(*ws));
  IxArgs a{};
  a.q = q.untyped_data();
  a.k = k_blocks.untyped_data();
  a.offsets = static_cast<const int32_t*>(offsets.untyped_data());
  a.cache_lengths = static_cast<const int32_t*>(cache_lengths.untyped_data());
  a.lookup = static_cast<const int32_t*>(lut.untyped_data());
  a.layer_ptr = static_cast<const int32_t*>(layer.untyped_data());
  a.T = static_cast<int>(T);
  a.B = static_cast<int>(B);
  a.Hi = static_cast<int>(Hi);
  a.Di = static_cast<int>(Di);
  a.MP = static_cast<int>(MP);
  a.NB = static_cast<int>(dim(k_blocks, 0));
  a.L = static_cast<int>(dim(k_blocks, 2));
  a.topk = static_cast<int>(topk);
  a.init_blocks = static_cast<int>(init_blocks);
  a.local_blocks = static_cast<int>(local_blocks);
  a.scale = static_cast<float>(scale);
  a.scores = static_cast<float*>(ws->untyped_data());
  a.out = static_cast<int32_t*>(out->untyped_data());
  if (topk == 0) return Error::Success();
  switch (dt) {
    case DataType::BF16: return launch<__nv_bfloat16>(stream, a, target);
    case DataType::F16: return launch<__half>(stream, a, target);
    case DataType::F32: return launch<float>(stream, a, target);
    case DataType::F8E4M3FN: return launch<__nv_fp8_e4m3>(stream, a, target);
    default: return invalid(target, "unsupported dtype");
  }
}

}  // namespace cuda
}  // namespace msa_ops

XLA_FFI_DEFINE_HANDLER_SYMBOL(msa_ops_msa_indexer, msa_ops::cuda::MsaIndexer,
                              MSA_OPS_SIG_MSA_INDEXER(msa_ops::ffi::Ffi::Bind().Ctx<msa_ops::ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<msa_ops::AnyBuffer>() /* score workspace [T, Hi, max_pages] */,
                              {msa_ops::ffi::Traits::kCmdBufferCompatible});
