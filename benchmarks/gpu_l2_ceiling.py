"""How fast the L2 cache feeds the SMs: the read ceiling of a prefill kernel whose K/V tiles come from the L2.

A 128-row query tile at head dim D reads 4 * D bytes of K and V per key and does 4 * 128 * D FLOPs with them, 128
FLOPs a byte. At the tensor cores' rate (about 7.5 TFLOP/s an SM on the H100 and H200 for dense bf16) that is about
58 GB/s an SM, 7.7 TB/s over 132 SMs, of bytes that mostly come from the L2 (the CTAs running at once share each
head's K/V). This script measures what the L2 delivers with two read-only CuPy kernels (no math beyond an XOR that
keeps the loads):
  bulk: one thread a CTA (one CTA an SM) streams 1D bulk copies (`cp.async.bulk`, the TMA's copy engine, as the
    persistent prefill kernels load their tiles) of CHUNK bytes into a ring of STAGES slots of shared memory, each
    slot refilled as soon as its last copy landed: STAGES * CHUNK bytes in flight per SM;
  lsu: 256 threads a CTA, CTAS_PER_SM CTAs an SM, eight 16-byte `ld.global.cg` loads in flight per thread.
Both read a region of the buffer over and over, each CTA from its own starting point: a region of REGION bytes read
by every CTA ("shared", the prefill pattern: one head's K/V at S=2k is 1 MB) or one region per CTA, all of them in
the L2 ("own"), and, for the DRAM reference, one 1 GB stream ("dram"). CUDA events, 3 warm-up + median of 10 runs.
Prints per-SM and total GB/s; writes l2_ceiling.json / .md into --out.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from gpu_gather_ceiling import COMMON_SRC, OPTS, cupy_device, event_timed  # (run as a script: its folder on the path)
from harness import write_results  # (run as a script: its folder on the path)

ITERS = 10

# The ring of shared-memory slots that the bulk and tensor-map readers fill (gpu_decode_ceiling.py's too).
RING_SRC = r"""
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

// A ring's `stages` mbarriers (one arrival each, with the copies' bytes), set up by thread 0 for the CTA.
__device__ __forceinline__ void ring_init(unsigned long long* bars, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// Waits for the last `stages` of n fills of the ring (fill i in slot i % stages) to land.
__device__ __forceinline__ void ring_drain(unsigned long long* bars, int stages, long long n) {
  for (long long i = n > stages ? n - stages : 0; i < n; ++i)
    bar_wait(smem_u32(&bars[i % stages]), static_cast<unsigned>((i / stages) & 1));
}
"""

SRC = COMMON_SRC + RING_SRC + r"""
// CTA c reads per_cta_v uint4s of region (c % nreg) (each region 1 << shift uint4s, a power of two), from
// c * stride_v on, wrapping around.
extern "C" __global__ void __launch_bounds__(256) l2_lsu(const uint4* __restrict__ p, int shift, int nreg,
                                                         long long per_cta_v, long long stride_v, unsigned* out) {
  const long long mask = (1ll << shift) - 1;
  const uint4* base = p + ((long long)(blockIdx.x % nreg) << shift);
  const long long start = ((long long)blockIdx.x * stride_v) & mask;
  unsigned acc = 0;
  for (long long i = threadIdx.x; i < per_cta_v; i += 8 * 256) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcg(base + ((start + i + u * 256) & mask));
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  block_xor(acc, out + blockIdx.x);
}

// One thread a CTA: nchunks bulk copies of `chunk` bytes (a power of two dividing the region) from region
// (c % nreg) (1 << shift bytes), from c * stride on, into a ring of `stages` slots, each with its own mbarrier.
extern "C" __global__ void __launch_bounds__(32) l2_bulk(const char* __restrict__ p, int shift, int nreg, int chunk,
                                                        int stages, long long nchunks, long long stride,
                                                        unsigned* out) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bars[16];
  ring_init(bars, stages);
  if (threadIdx.x == 0) {
    const long long mask = (1ll << shift) - 1;
    const char* base = p + ((long long)(blockIdx.x % nreg) << shift);
    const long long start = ((long long)blockIdx.x * stride) & mask;  // a multiple of chunk
    const unsigned r0 = smem_u32(ring);
    for (long long i = 0; i < nchunks; ++i) {
      const int s = static_cast<int>(i % stages);
      const unsigned bar = smem_u32(&bars[s]);
      if (i >= stages) bar_wait(bar, static_cast<unsigned>((i / stages - 1) & 1));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(chunk) : "memory");
      const char* src = base + ((start + i * chunk) & mask);
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(r0 + s * chunk), "l"(src), "r"(chunk), "r"(bar) : "memory");
    }
    ring_drain(bars, stages, nchunks);
  }
  __syncthreads();
  const unsigned* w = reinterpret_cast<const unsigned*>(ring);
  block_xor(w[threadIdx.x] ^ w[threadIdx.x + 32 * 7], out + blockIdx.x);
}

// As l2_bulk, with 2D tensor-map boxes (the TMA's tiled copies, 128-byte swizzle, as the prefill kernels load K and
// V): rows of 256 bytes (128 bf16), a slot = 128-column tile of `tile_rows` rows = two boxes of 64 columns x
// box_rows rows each (two TMA copies), region (c % nreg) = 1 << shift rows.
extern "C" __global__ void __launch_bounds__(32) l2_tma2d(const void* tmap, int shift, int nreg, int tile_rows,
                                                         int stages, long long ntiles, long long stride_rows,
                                                         unsigned* out) {
  extern __shared__ __align__(128) unsigned char ring_raw[];
  __shared__ __align__(8) unsigned long long bars[16];
  const unsigned r0 = (smem_u32(ring_raw) + 1023u) & ~1023u;  // the swizzle's 1024-byte atoms
  const int tile_bytes = tile_rows * 256;
  ring_init(bars, stages);
  if (threadIdx.x == 0) {
    const long long mask = (1ll << shift) - 1;
    const long long base = (long long)(blockIdx.x % nreg) << shift;
    const long long start = ((long long)blockIdx.x * stride_rows) & mask;
    for (long long i = 0; i < ntiles; ++i) {
      const int s = static_cast<int>(i % stages);
      const unsigned bar = smem_u32(&bars[s]);
      if (i >= stages) bar_wait(bar, static_cast<unsigned>((i / stages - 1) & 1));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tile_bytes) : "memory");
      const int row = static_cast<int>(base + ((start + i * tile_rows) & mask));
      const unsigned dst = r0 + s * tile_bytes;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
            ::"r"(dst + h * (tile_bytes / 2)), "l"(tmap), "r"(h * 64), "r"(row), "r"(bar) : "memory");
    }
    ring_drain(bars, stages, ntiles);
  }
  __syncthreads();
  const unsigned* w = reinterpret_cast<const unsigned*>(ring_raw + (r0 - smem_u32(ring_raw)));
  block_xor(w[threadIdx.x] ^ w[threadIdx.x + 32 * 7], out + blockIdx.x);
}

"""


def tensor_map(cp, ptr, dims, strides, box, swizzle_128b=True):
    """A bf16 CUtensorMap in device memory, by the driver's cuTensorMapEncodeTiled: `dims` (innermost first, in
    elements), `strides` (bytes, of every dim past the first), `box` (elements), 128-byte swizzle or none; None where
    that is not available."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        enc = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as e:
        print(f"tensor maps: n/a ({e})")
        return None
    n = len(dims)
    tmap = (ctypes.c_uint8 * 128)()
    bf16, no_interleave, l2_promo_256b, no_oob_fill = 9, 0, 3, 0
    rc = enc(ctypes.byref(tmap), ctypes.c_int(bf16), ctypes.c_uint32(n), ctypes.c_void_p(ptr),
             (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides), (ctypes.c_uint32 * n)(*box),
             (ctypes.c_uint32 * n)(*([1] * n)), ctypes.c_int(no_interleave), ctypes.c_int(3 if swizzle_128b else 0),
             ctypes.c_int(l2_promo_256b), ctypes.c_int(no_oob_fill))
    if rc != 0:
        print(f"tensor maps: cuTensorMapEncodeTiled returned {rc}")
        return None
    return cp.asarray(np.frombuffer(bytes(tmap), dtype=np.uint8))


def _tensor_map(cp, buf, box_rows):
    """2D: 128 bf16 columns x all rows of buf, box 64 x box_rows, 128-byte swizzle."""
    return tensor_map(cp, buf.data.ptr, (128, buf.nbytes // 256), (256,), (64, box_rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--rounds", default="1", help="ignored (accepted so that gpu_bench.sh can pass it)")
    a = ap.parse_args()
    dev = cupy_device("L2 ceiling")
    if dev is None:
        return
    cp, name, sms, props = dev
    l2 = props.get("l2CacheSize", 0)
    kern = {k: cp.RawKernel(SRC, k, options=OPTS) for k in ("l2_lsu", "l2_bulk", "l2_tma2d", "fill")}
    gib = 1 << 30
    buf = cp.empty(gib // 8, dtype=cp.uint64)
    kern["fill"]((sms * 8,), (256,), (buf, np.int64(buf.size)))
    out = cp.zeros(sms * 8, cp.uint32)
    tmaps = {rows: _tensor_map(cp, buf, rows) for rows in (128, 256)}  # box rows -> the map (None: no driver API)

    def timed(k, grid, block, args, smem=0):
        return event_timed(cp, k, grid, block, args, smem=smem, iters=ITERS)

    rows = []

    def record(kind, pattern, region, inflight, us, nbytes, grid):
        r = {"kernel": kind, "pattern": pattern, "region_bytes": region, "bytes_in_flight_per_sm": inflight,
             "us": round(us, 1), "GB/s": round(nbytes / us / 1e3, 1),
             "GB/s per SM": round(nbytes / us / 1e3 / sms, 2), "ctas": grid}
        print(json.dumps(r), flush=True)
        rows.append(r)

    # (pattern, region bytes, number of regions): shared = every CTA one region; own = a region per CTA, all in L2
    own_region = 1 << max(16, int(np.log2(max(l2, 1 << 24) // 2 // sms)))  # the regions together: <= half the L2
    patterns = [("shared", 1 << 20, 1), ("shared", 4 << 20, 1), ("own", own_region, sms), ("dram", gib, 1)]
    per_sm_bytes = 64 << 20  # read per SM (L2 patterns); the DRAM stream reads 1 GB in all
    for pattern, region, nreg in patterns:
        total = per_sm_bytes * sms if pattern != "dram" else gib
        for chunk, stages in ((16384, 4), (32768, 4), (16384, 8), (32768, 6)):
            nchunks = total // sms // chunk
            smem = chunk * stages
            k = kern["l2_bulk"]
            k.max_dynamic_shared_size_bytes = smem
            stride = nchunks * chunk if pattern == "dram" else 4099 * chunk  # DRAM: a slice a CTA
            args = (buf, np.int32(int(np.log2(region))), np.int32(nreg), np.int32(chunk), np.int32(stages),
                    np.int64(nchunks), np.int64(stride), out)
            us = timed(k, (sms,), (32,), args, smem)
            record(f"bulk {chunk // 1024} KB x {stages}", pattern, region, smem, us, nchunks * chunk * sms, sms)
        for box_rows, stages in ((128, 4), (128, 3), (256, 3)):
            if tmaps[box_rows] is None:
                continue
            tile_rows = box_rows
            tile_bytes = tile_rows * 256
            ntiles = total // sms // tile_bytes
            smem = tile_bytes * stages + 1024
            k = kern["l2_tma2d"]
            k.max_dynamic_shared_size_bytes = smem
            stride_rows = ntiles * tile_rows if pattern == "dram" else 4099 * tile_rows
            args = (tmaps[box_rows], np.int32(int(np.log2(region // 256))), np.int32(nreg), np.int32(tile_rows),
                    np.int32(stages), np.int64(ntiles), np.int64(stride_rows), out)
            us = timed(k, (sms,), (32,), args, smem)
            record(f"tma 2D, boxes 64 x {box_rows} ({box_rows // 8} KB) x 2 x {stages}", pattern, region,
                   tile_bytes * stages, us, ntiles * tile_bytes * sms, sms)
        for per_sm in (2, 4):
            grid = sms * per_sm
            per_cta_v = total // grid // 16 // 2048 * 2048
            stride_v = per_cta_v if pattern == "dram" else 4099 * 256
            args = (buf, np.int32(int(np.log2(region // 16))), np.int32(nreg), np.int64(per_cta_v),
                    np.int64(stride_v), out)
            if pattern == "own":  # one region per CTA: keep them all within the L2
                r = 1 << max(12, int(np.log2(max(l2, 1 << 24) // 2 // grid)))
                args = (buf, np.int32(int(np.log2(r // 16))), np.int32(grid), np.int64(per_cta_v),
                        np.int64(stride_v), out)
            us = timed(kern["l2_lsu"], (grid,), (256,), args)
            record(f"lsu {per_sm} CTAs/SM", pattern, region, per_sm * 256 * 8 * 16, us, per_cta_v * 16 * grid, grid)

    lines = [f"### L2 read ceiling on {name} ({sms} SMs, L2 {l2 >> 20} MB; median of {ITERS} runs)", "",
             "| kernel | pattern | region | bytes in flight / SM | GB/s | GB/s per SM |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['pattern']} | {r['region_bytes'] >> 10} KB | "
                     f"{r['bytes_in_flight_per_sm'] >> 10} KB | {r['GB/s']:.0f} | {r['GB/s per SM']:.1f} |")
    write_results(a.out, "l2_ceiling", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
