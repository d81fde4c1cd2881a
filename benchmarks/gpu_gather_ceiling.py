"""Read-bandwidth ceiling of the GPU for the memory access pattern of the MSA sparse-attention decode gather.

Decode reads, per (sequence b, kv head h), the K and V rows of the top-k selected 128-token blocks of the paged
cache kv[NB, 2, 1, 128, Hkv, 128]. Two things keep that below a streaming read: the rows of one kv head are strided
by Hkv rows inside the page (256 B bf16 / 128 B fp8 contiguous, then a gap), and the selected pages are scattered
over the cache through a lookup table. A read-only CuPy kernel (no math; XOR of all loaded words keeps the loads)
does exactly that gather, so the MSA kernel's GB/s can be reported as a fraction of a measured ceiling:
  per-head: each (b, h) has its own random ids; P partitions split the slots of a (b, h) over P CTAs;
  shared: the 4 kv heads of a sequence use the same ids, so the 4 heads' rows of a page (adjacent in memory) are
    read by 4 CTAs launched next to each other;
  dense: grid-stride streaming read of a contiguous buffer of the bf16 top-64 byte count (read-only ceiling).
B=32, Hkv=4, 128k cache (1024 pages/sequence), bf16/fp8, top-16/64. Bytes = 2*B*Hkv*topk*128*row bytes. CUDA events,
3 warm-up + median of 20 runs, back to back like harness.bench (top-16 sets, 67/134 MB, are near L2 size:
--flush-l2 reads 256 MB between timed runs, outside the events). Writes gather_ceiling.json / .md into --out.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from harness import write_results  # (run as a script: its folder on the path)

B, HKV, MAXP = 32, 4, 1024
NB = B * MAXP
THREADS, WARMUP, ITERS = 256, 3, 20
ROWB = {"bf16": 256, "fp8": 128}  # bytes of one K/V row of one kv head
OPTS = ("-std=c++17",)

# The pieces the other ceiling scripts' kernels use too: a CTA's XOR of its loaded words into *dst (any CTA of up to
# 256 threads), a grid-stride read of a contiguous buffer, and a fill of a buffer with a pattern of its indices.
COMMON_SRC = r"""
__device__ __forceinline__ void block_xor(unsigned acc, unsigned* dst) {
  __shared__ unsigned red[8];
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned r = 0;
    for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) r ^= red[w];
    *dst = r;
  }
}

// A grid-stride read of nv uint4s: the streaming read of a contiguous buffer.
extern "C" __global__ void __launch_bounds__(256) dense_read(const uint4* __restrict__ p, long long nv, unsigned* out) {
  const long long stride = (long long)gridDim.x * 256;
  long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  unsigned acc = 0;
  for (; i + 7 * stride < nv; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < nv; i += stride) { const uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  block_xor(acc, out + blockIdx.x);
}

extern "C" __global__ void fill(unsigned long long* p, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    p[i] = ((unsigned long long)i * 0x9E3779B97F4A7C15ull) ^ ((unsigned long long)i >> 29);
}
"""

SRC = COMMON_SRC + r"""

// CTA = (kv head h, partition part, sequence b); reads K and V rows of head h of its share of the selected pages.
template <int ROWB>
__device__ __forceinline__ void gather(const uint4* __restrict__ kv, const int* __restrict__ lut,
    const int* __restrict__ ids, int topk, int nparts, int maxp, int hkv, unsigned* __restrict__ out) {
  constexpr int VPR = ROWB / 16;          // uint4 per row
  constexpr int PER_BLK = 2 * 128 * VPR;  // uint4 per (page, head): 128 K rows + 128 V rows
  __shared__ long long base[64];
  const int h = blockIdx.x, part = blockIdx.y, b = blockIdx.z, t = threadIdx.x, n = topk / nparts;
  const long long row_v = (long long)hkv * VPR, half_v = 128 * row_v;
  for (int s = t; s < n; s += 256) {
    const int id = ids[((long long)b * hkv + h) * topk + part * n + s];
    base[s] = (long long)lut[(long long)b * maxp + id] * 2 * half_v + (long long)h * VPR;
  }
  __syncthreads();
  unsigned acc = 0;
  for (int i0 = t; i0 < n * PER_BLK; i0 += 8 * 256) {  // n * PER_BLK is a multiple of 8 * 256
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * 256, s = i / PER_BLK, r = i % PER_BLK;
      const int kvh = r / (128 * VPR), row = (r / VPR) % 128, col = r % VPR;
      v[u] = __ldg(kv + base[s] + kvh * half_v + row * row_v + col);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  block_xor(acc, out + ((long long)b * gridDim.y + part) * gridDim.x + h);
}

#define GATHER(NAME, ROWB)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(const uint4* __restrict__ kv, const int* __restrict__ lut, \
      const int* __restrict__ ids, int topk, int nparts, int maxp, int hkv, unsigned* __restrict__ out) {          \
    gather<ROWB>(kv, lut, ids, topk, nparts, maxp, hkv, out);                                                      \
  }
GATHER(gather_bf16, 256)
GATHER(gather_fp8, 128)

"""


def cupy_device(label):
    """CuPy and the device's name, SM count and properties; None (saying so, with label) where CuPy is missing."""
    try:
        import cupy as cp
    except Exception as e:
        print(f"{label}: n/a (cupy unavailable: {type(e).__name__}: {e})")
        return None
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return cp, name.decode() if isinstance(name, bytes) else name, props["multiProcessorCount"], props


def event_timed(cp, k, grid, block, args, *, smem=0, warmup=WARMUP, iters=ITERS, before=None):
    """Median us of `iters` launches of k, each between two CUDA events, after `warmup` launches; before() (outside
    the events) ahead of each timed one."""
    for _ in range(warmup):
        k(grid, block, args, shared_mem=smem)
    ts = []
    for _ in range(iters):
        if before is not None:
            before()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        k(grid, block, args, shared_mem=smem)
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--flush-l2", action="store_true", help="read a 256 MB buffer between timed runs")
    a = ap.parse_args()
    dev = cupy_device("gather ceiling")
    if dev is None:
        return
    cp, name, sms, _ = dev
    pool = cp.get_default_memory_pool()
    kern = {k: cp.RawKernel(SRC, k, options=OPTS) for k in ("gather_bf16", "gather_fp8", "dense_read", "fill")}

    def new_buf(nbytes):  # filled, so the memory is touched
        buf = cp.empty(nbytes // 8, dtype=cp.uint64)
        kern["fill"]((sms * 8,), (THREADS,), (buf, np.int64(buf.size)))
        return buf

    scratch = cp.zeros(sms * 8, cp.uint32)
    flush_buf = new_buf(256 << 20) if a.flush_l2 else None

    def flush():
        kern["dense_read"]((sms * 8,), (THREADS,), (flush_buf, np.int64(flush_buf.size // 2), scratch))

    def timed(k, grid, args):
        return event_timed(cp, k, grid, (THREADS,), args, before=flush if flush_buf is not None else None)

    rows = []

    def record(pattern, dtype, topk, parts, us, nbytes):
        r = {"pattern": pattern, "dtype": dtype, "topk": topk, "partitions": parts, "us": round(us, 2),
             "GB/s": round(nbytes / us / 1e3, 1)}
        r["frac_dense"] = round(r["GB/s"] / rows[0]["GB/s"], 3) if rows else 1.0
        print(json.dumps(r), flush=True)
        rows.append(r)

    nbytes = 2 * B * HKV * 64 * 128 * ROWB["bf16"]
    buf = new_buf(nbytes)
    us = timed(kern["dense_read"], (sms * 8,), (buf, np.int64(nbytes // 16), scratch))
    record("dense", "bf16", 64, None, us, nbytes)
    del buf

    rng = np.random.default_rng(0)
    lut = rng.permutation(NB).astype(np.int32).reshape(B, MAXP)
    variants = [("per-head", k, p) for k in (16, 64) for p in (1, 2, 4, 8)] + [("shared", 64, p) for p in (1, 2, 4)]
    ids = {}
    for pattern, topk in dict.fromkeys((v[0], v[1]) for v in variants):
        n = 1 if pattern == "shared" else HKV
        sel = np.stack([np.append(np.sort(rng.choice(MAXP - 1, topk - 1, replace=False)), MAXP - 1)
                        for _ in range(B * n)]).reshape(B, n, topk)
        ids[pattern, topk] = np.ascontiguousarray(np.broadcast_to(sel, (B, HKV, topk)), dtype=np.int32)
    lut_d, ids_d = cp.asarray(lut), {k: cp.asarray(v) for k, v in ids.items()}

    for dtype, rowb in ROWB.items():
        k = kern[f"gather_{dtype}"]
        kv = new_buf(NB * 2 * 128 * HKV * rowb)
        # correctness of the address math: CTA XOR vs the same rows gathered by CuPy indexing, for two (b, h)
        out = cp.zeros(B * HKV, cp.uint32)
        k((HKV, 1, B), (THREADS,), (kv, lut_d, ids_d["per-head", 16], *map(np.int32, (16, 1, MAXP, HKV)), out))
        kv5 = kv.view(cp.uint32).reshape(NB, 2, 128, HKV, rowb // 4)
        for b, h in ((0, 0), (B - 1, HKV - 1)):
            pages = cp.asarray(lut[b, ids["per-head", 16][b, h]])
            want = np.bitwise_xor.reduce(cp.asnumpy(kv5[pages, :, :, h]).ravel())
            if int(out[b * HKV + h]) != int(want):
                raise RuntimeError(f"gather_{dtype} check failed at b={b} h={h}: {int(out[b * HKV + h])} != {want}")
        del kv5
        for pattern, topk, parts in variants:
            assert (topk // parts) * 2 * 128 * rowb // 16 % (8 * THREADS) == 0
            out = cp.zeros(B * HKV * parts, cp.uint32)
            args = (kv, lut_d, ids_d[pattern, topk], *map(np.int32, (topk, parts, MAXP, HKV)), out)
            record(pattern, dtype, topk, parts, timed(k, (HKV, parts, B), args), 2 * B * HKV * topk * 128 * rowb)
        del kv, out
        pool.free_all_blocks()

    lines = [f"### Gather read ceiling on {name} (B={B}, Hkv={HKV}, 128k cache, median of {ITERS} runs)", "",
             "| pattern | dtype | topk | partitions | us | GB/s | vs dense |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = "-" if r["partitions"] is None else r["partitions"]
        lines.append(f"| {r['pattern']} | {r['dtype']} | {r['topk']} | {parts} | {r['us']:.1f} | {r['GB/s']:.0f} "
                     f"| {r['frac_dense']:.2f} |")
    write_results(a.out, "gather_ceiling", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
