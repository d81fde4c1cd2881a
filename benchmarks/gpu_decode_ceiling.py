"""The read ceilings of the two decode goals, beside cuDNN's dense decode and ours in the same process.

The dense decode goal asks the paged decode for at least cuDNN's bandwidth, and the MSA decode goal at topk 16 for
0.85x of it; cuDNN reads contiguous K/V. A decode call of ours must at least read its page-table entries and then the
K and V rows of its kv head as SPEC's pool lays them out: rows of 256 bytes (bf16, D=128; 128 bytes fp8) strided by
Hkv rows inside each page, the pages scattered over the pool. This script times read-only kernels that read exactly
those bytes (nothing computed from them; in their checked form an XOR of every word, compared with the same rows
gathered on the host), each swept over the shapes a decode kernel could take, and keeps the fastest of each kind:
  cp.async: a CTA per (kv head, partition, sequence), 128 threads; the CTA's pool pages to shared memory first, then
    64-key tiles of K and V rows by 16-byte `cp.async` copies into a ring of STAGES tiles (as our decode kernels
    load); partitions and stages swept;
  tma: the same CTAs, one thread issuing 3D tensor-map copies (one box = a page's rows of the head, K or V) into a
    ring of shared memory; partitions and stages swept;
  contiguous: a grid-stride read of as many bytes in one buffer (what cuDNN's K/V reads look like).
Every kind is timed as the JAX calls are: ten launches in one CUDA graph (XLA runs the benchmarks' jitted steps as
graphs), 20 graph launches x 5 repeats after a warm-up (harness.bench); the fastest configurations, cuDNN and ours
once a round in rotating order (harness.bench_rounds). If the fastest reader of a point takes longer than the goal
allows, no kernel that reads this layout reaches the goal there on this GPU, as far as these readers tell.
Writes decode_ceiling.json / .md into --out. Two diagnostics instead of the comparison: --lone times ours against a
reader cut into the same 64 CTAs (at most one an SM: the rate one CTA streams at), --probe adds to the reader what a
kernel adds to a read (a barrier, the issue order of a reused ring, a dependent FMA chain per tile).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy allocates beside JAX

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_gather_ceiling import COMMON_SRC, OPTS, cupy_device  # noqa: E402  (run as a script: its folder on the path)
from gpu_l2_ceiling import RING_SRC, tensor_map  # noqa: E402
from harness import bench_rounds, graph_timer, write_results  # noqa: E402

import msa_ops  # noqa: E402

THREADS = 128
SMEM_MAX = 220 * 1024  # dynamic shared memory of the largest configuration (the SM's 227 KB, less static)
CP_STAGES = (2, 3, 4)
DENSE_POINTS = ((64, 4096), (16, 16384), (4, 65536), (1, 131072))
DENSE_HKV, MSA_B, MSA_HKV = 8, 32, 4

SRC = COMMON_SRC + RING_SRC + r"""
// The CTA's pool pages into pg[0, np): pages [part * np, (part + 1) * np) of sequence b (ids == 0: dense decode), or
// those of its selected blocks ids[b, h, part * np + s] (MSA decode). CTA = (kv head h, partition, sequence b).
__device__ __forceinline__ void stage_pages(int* pg, const int* __restrict__ lut, const int* __restrict__ ids, int np,
                                            int maxp, int topk) {
  const int h = blockIdx.x, part = blockIdx.y, b = blockIdx.z;
  for (int s = threadIdx.x; s < np; s += blockDim.x) {
    const int j = ids ? ids[((long long)b * gridDim.x + h) * topk + part * np + s] : part * np + s;
    pg[s] = lut[(long long)b * maxp + j];
  }
  __syncthreads();
}

extern __shared__ __align__(128) unsigned char smem[];  // the readers' ring (dynamic shared memory)

__device__ __forceinline__ unsigned cta_index() {
  return ((unsigned)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}

__device__ __forceinline__ unsigned xor16(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// 64-key tiles of the CTA's np pages (page PAGE keys, Hkv = HKV, ROWB bytes a row of one head): thread t copies
// 16-byte chunk t % CPR of rows t / CPR + k * RPP of the tile's K and V rows, STAGES tiles in flight. check: every
// thread XORs the chunks it copied, once they landed. The probe's variants (--probe; 0 for the ceiling): mode bit 0,
// a CTA barrier once a tile landed (where a kernel's warps read what others copied); bit 1, tile i + STAGES - 1
// issued only after tile i landed (one tile fewer in flight while a tile waits, as a kernel that reuses the stage
// of tile i - 1 must); work, a dependent chain of that many FMAs a thread on each landed tile (a kernel's compute).
template <int PAGE, int HKV, int ROWB, int STAGES>
__device__ __forceinline__ void cp_read(const char* __restrict__ kv, const int* __restrict__ lut,
                                        const int* __restrict__ ids, int np, int maxp, int topk, int check,
                                        int mode, int work, unsigned* __restrict__ out) {
  constexpr int CPR = ROWB / 16, RPP = 128 / CPR, KPT = 64 / RPP, TILE = 2 * 64 * ROWB;
  constexpr long long ROW = (long long)HKV * ROWB, HALF = (long long)PAGE * ROW;
  int* pg = reinterpret_cast<int*>(smem + STAGES * TILE);
  stage_pages(pg, lut, ids, np, maxp, topk);
  const int t = threadIdx.x, c = t % CPR, r0 = t / CPR;
  const int ntiles = np * PAGE / 64;
  const char* head = kv + blockIdx.x * ROWB + c * 16;
  const unsigned ring = smem_u32(smem) + (r0 * CPR + c) * 16;
  auto issue = [&](int i) {
    const unsigned dst = ring + (i % STAGES) * TILE;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      const int key = i * 64 + r0 + k * RPP;
      const char* src = head + (long long)pg[key / PAGE] * 2 * HALF + (key % PAGE) * ROW;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + k * RPP * ROWB), "l"(src) : "memory");
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 64 * ROWB + k * RPP * ROWB), "l"(src + HALF)
                   : "memory");
    }
  };
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < ntiles) issue(i);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  unsigned acc = 0;
  for (int i = 0; i < ntiles; ++i) {
    if (mode & 2) {
      asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
      if (mode & 1) __syncthreads();
      if (i + STAGES - 1 < ntiles) issue(i + STAGES - 1);
      asm volatile("cp.async.commit_group;" ::: "memory");
    } else {
      if (i + STAGES - 1 < ntiles) issue(i + STAGES - 1);
      asm volatile("cp.async.commit_group;" ::: "memory");
      asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
      if (mode & 1) __syncthreads();
    }
    if (work) {
      float x = *reinterpret_cast<const float*>(smem + (i % STAGES) * TILE + (r0 * CPR + c) * 16);
      for (int w = 0; w < work; ++w) x = fmaf(x, 1.0001f, 0.5f);
      acc ^= __float_as_uint(x);
    }
    if (check) {
      const unsigned char* st = smem + (i % STAGES) * TILE + (r0 * CPR + c) * 16;
#pragma unroll
      for (int k = 0; k < KPT; ++k)
        acc ^= xor16(*reinterpret_cast<const uint4*>(st + k * RPP * ROWB)) ^
               xor16(*reinterpret_cast<const uint4*>(st + 64 * ROWB + k * RPP * ROWB));
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  if (!check) acc = *reinterpret_cast<const unsigned*>(smem + 4 * t);
  block_xor(acc, out + cta_index());
}

#define CP_READ(PAGE, HKV, ROWB, STAGES)                                                                           \
  extern "C" __global__ void __launch_bounds__(128) cp_##PAGE##_##HKV##_##ROWB##_##STAGES(                         \
      const char* __restrict__ kv, const int* __restrict__ lut, const int* __restrict__ ids, int np, int maxp,      \
      int topk, int check, int mode, int work, unsigned* __restrict__ out) {                                       \
    cp_read<PAGE, HKV, ROWB, STAGES>(kv, lut, ids, np, maxp, topk, check, mode, work, out);                         \
  }
#define CP_STAGES(PAGE, HKV, ROWB) CP_READ(PAGE, HKV, ROWB, 2) CP_READ(PAGE, HKV, ROWB, 3) CP_READ(PAGE, HKV, ROWB, 4)
CP_STAGES(16, 8, 256)
CP_STAGES(128, 8, 256)
CP_STAGES(128, 4, 256)
CP_STAGES(128, 4, 128)

// Thread 0 copies the CTA's 2 * np boxes (box 2i: page pg[i]'s K rows of head h, 2i + 1: its V rows; `box_bytes` =
// page * row bytes) by a 3D tensor map (columns, kv heads, token rows of the pool) into a ring of `stages` slots.
// check: one slot, every thread XORs each box once it landed.
extern "C" __global__ void __launch_bounds__(128) tma_read(const void* tmap, const int* __restrict__ lut,
                                                          const int* __restrict__ ids, int np, int maxp, int topk,
                                                          int page, int box_bytes, int stages, int check,
                                                          unsigned* __restrict__ out) {
  __shared__ __align__(8) unsigned long long bars[32];
  int* pg = reinterpret_cast<int*>(smem + stages * box_bytes);
  stage_pages(pg, lut, ids, np, maxp, topk);
  ring_init(bars, stages);
  const int h = blockIdx.x, n = 2 * np;
  const unsigned r0 = smem_u32(smem);
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = check ? 0 : i % stages;
    const unsigned bar = smem_u32(&bars[s]);
    if (threadIdx.x == 0) {
      if (!check && i >= stages) bar_wait(bar, static_cast<unsigned>((i / stages - 1) & 1));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(box_bytes) : "memory");
      const int row = (pg[i >> 1] * 2 + (i & 1)) * page;
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
          ::"r"(r0 + s * box_bytes), "l"(tmap), "r"(0), "r"(h), "r"(row), "r"(bar) : "memory");
    }
    if (check) {
      bar_wait(bar, static_cast<unsigned>(i & 1));
      for (int w = threadIdx.x; w < box_bytes / 16; w += blockDim.x)
        acc ^= xor16(reinterpret_cast<const uint4*>(smem)[w]);
      __syncthreads();
    }
  }
  if (!check) {
    if (threadIdx.x == 0) ring_drain(bars, stages, n);
    __syncthreads();
    acc = reinterpret_cast<const unsigned*>(smem)[threadIdx.x];
  }
  block_xor(acc, out + cta_index());
}
"""


def cupy_graph_timer(cp, s, launch, n=10, iters=20, repeats=5):
    """A function returning seconds per launch of `launch()` on CuPy stream s, timed as harness.bench times a jitted
    step: n launches captured in one CUDA graph, `iters` graph launches per repeat, the median of `repeats`."""
    with s:
        launch()
    s.synchronize()
    mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
    s.begin_capture(*(() if mode is None else (mode,)))
    with s:
        for _ in range(n):
            launch()
    g = s.end_capture()

    def timer():
        g.launch(s)
        s.synchronize()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                g.launch(s)
            s.synchronize()
            ts.append((time.perf_counter() - t0) / iters / n)
        return float(np.median(ts))

    timer.launch = launch  # the graph's kernels read the buffers that launch's arguments hold: keep them
    return timer


class Readers:
    """The compiled kernels and the CuPy side of one process."""

    def __init__(self):
        dev = cupy_device("decode ceiling")
        if dev is None:
            raise SystemExit(0)
        self.cp, self.name, self.sms, _ = dev
        cp = self.cp
        names = ["tma_read", "dense_read", "fill"] + [
            f"cp_{p}_{h}_{r}_{s}" for p, h, r in ((16, 8, 256), (128, 8, 256), (128, 4, 256), (128, 4, 128))
            for s in CP_STAGES]
        self.k = {n: cp.RawKernel(SRC, n, options=OPTS) for n in names}
        for k in self.k.values():  # the most any configuration asks for (each launch names its own)
            k.max_dynamic_shared_size_bytes = SMEM_MAX
        self.stream = cp.cuda.Stream(non_blocking=True)

    def buffer(self, nbytes):
        """A device buffer of nbytes, filled with a pattern of its indices (so its memory is touched)."""
        cp = self.cp
        buf = cp.empty(nbytes // 8, dtype=cp.uint64)
        self.k["fill"]((self.sms * 8,), (256,), (buf, np.int64(buf.size)))
        return buf

    def graph_timer(self, launch, n=10, iters=20, repeats=5):
        """cupy_graph_timer on this reader's stream."""
        return cupy_graph_timer(self.cp, self.stream, launch, n, iters, repeats)

    def launch_fn(self, kind, cfg, pool, lut_d, ids_d, *, b, hkv, page, rowb, parts, np_, maxp, topk, out,
                  check=0, tmap=None, mode=0, work=0):
        """A function launching one reader of `kind` (cp or tma) with configuration cfg (stages); mode and work:
        the cp.async reader's probe variants (cp_read)."""
        grid = (hkv, parts, b)
        ids = ids_d if ids_d is not None else np.uint64(0)  # a null pointer: dense decode
        if kind == "cp":
            stages = cfg
            k = self.k[f"cp_{page}_{hkv}_{rowb}_{stages}"]
            smem = stages * 2 * 64 * rowb + 4 * np_
            args = (pool, lut_d, ids, np.int32(np_), np.int32(maxp), np.int32(topk), np.int32(check),
                    np.int32(mode), np.int32(work), out)
            return lambda: k(grid, (THREADS,), args, shared_mem=smem)
        stages = 1 if check else cfg
        box = page * rowb
        k = self.k["tma_read"]
        smem = stages * box + 4 * np_
        args = (tmap, lut_d, ids, np.int32(np_), np.int32(maxp), np.int32(topk), np.int32(page), np.int32(box),
                np.int32(stages), np.int32(check), out)
        return lambda: k(grid, (THREADS,), args, shared_mem=smem)


def check_reader(rd, launch, out, pool_words, lut, ids, *, b, hkv, page, parts, np_):
    """The checked launch's XOR of the first and the last CTA against the same rows gathered on the host."""
    cp = rd.cp
    out.fill(0)
    with rd.stream:
        launch()
    rd.stream.synchronize()
    got = cp.asnumpy(out)
    for bb, h, part in ((0, 0, 0), (b - 1, hkv - 1, parts - 1)):
        js = np.arange(part * np_, (part + 1) * np_) if ids is None else ids[bb, h, part * np_:(part + 1) * np_]
        pages = cp.asarray(lut[bb, js])
        want = np.bitwise_xor.reduce(cp.asnumpy(pool_words[pages, :, :, h]).ravel())
        cta = (bb * parts + part) * hkv + h
        if int(got[cta]) != int(want):
            raise RuntimeError(f"reader check failed at b={bb} h={h} part={part}: {int(got[cta])} != {int(want)}")


def best_readers(rd, pool, lut, ids, *, b, hkv, page, rowb, maxp, topk, nkeys, sweep=None):
    """{kind: (config text, timer)} of the fastest cp.async and tma readers over partitions and stages, each checked
    once (XOR of every word it read) before it is timed. sweep (a dict), if given, gets {kind: {partitions: us of
    the fastest stage count}} from the sweep's (shorter) timings."""
    cp = rd.cp
    pool_words = pool.view(cp.uint32).reshape(-1, 2, page, hkv, rowb // 4)
    lut_d = cp.asarray(lut, dtype=cp.int32)
    ids_d = None if ids is None else cp.asarray(ids, dtype=cp.int32)
    rows_total = pool.nbytes // (hkv * rowb)
    tmap = tensor_map(cp, pool.data.ptr, (rowb // 2, hkv, rows_total), (rowb, hkv * rowb), (rowb // 2, 1, page),
                      swizzle_128b=False)
    npages = nkeys // page  # a (sequence, head)'s pages
    parts_all = [p for p in (1, 2, 4, 8, 16, 32, 64) if npages % p == 0 and (npages // p) * page % 64 == 0
                 and 64 <= b * hkv * p <= 16 * rd.sms]
    tma_stages = (2, 3, 4, 6) if page * rowb >= 16384 else (8, 16, 32)
    best = {}
    for kind, stage_list in (("cp", CP_STAGES), ("tma", tma_stages)):
        if kind == "tma" and tmap is None:
            continue
        cands = []
        for parts in parts_all:
            np_ = npages // parts
            out = cp.zeros(b * hkv * parts, cp.uint32)
            kw = dict(b=b, hkv=hkv, page=page, rowb=rowb, parts=parts, np_=np_, maxp=maxp, topk=topk, out=out,
                      tmap=tmap)
            check_reader(rd, rd.launch_fn(kind, stage_list[0], pool, lut_d, ids_d, check=1, **kw), out, pool_words,
                         lut, ids, b=b, hkv=hkv, page=page, parts=parts, np_=np_)
            for st in stage_list:
                smem = (st * 2 * 64 * rowb if kind == "cp" else st * page * rowb) + 4 * np_
                if smem > SMEM_MAX:
                    continue
                try:
                    t = rd.graph_timer(rd.launch_fn(kind, st, pool, lut_d, ids_d, **kw), iters=10, repeats=2)()
                except Exception as e:  # noqa: BLE001 - a configuration may not launch; say so, go on
                    print(f"{kind} parts={parts} stages={st}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                cands.append((t, parts, st, kw))
        if not cands:
            continue
        if sweep is not None:
            by_parts = sweep.setdefault(kind, {})
            for tc, pc, _, _ in cands:
                by_parts[pc] = round(min(by_parts.get(pc, 1e9), tc * 1e6), 2)
        t, parts, st, kw = min(cands, key=lambda c: c[0])
        best[kind] = (f"{parts} partitions, {st} stages", rd.graph_timer(rd.launch_fn(kind, st, pool, lut_d, ids_d,
                                                                                       **kw)))
        print(json.dumps({"kind": kind, "best": best[kind][0], "sweep_us": round(t * 1e6, 2),
                          "configs": len(cands)}), flush=True)
    return best


def contiguous_timer(rd, nbytes):
    buf = rd.buffer(nbytes)
    out = rd.cp.zeros(rd.sms * 8, rd.cp.uint32)
    k = rd.k["dense_read"]
    return rd.graph_timer(lambda: k((rd.sms * 8,), (256,), (buf, np.int64(nbytes // 16), out))), buf


def run_dense(rd, rows, rounds, pages):
    import gpu_mha

    rng = np.random.default_rng(0)
    for b, l in DENSE_POINTS:
        for page in pages:
            q, k, v, kv, lut = gpu_mha.decode_case(b, l, page, rng)
            qr, offs, cl = gpu_mha.step_args(q, l)

            def cud(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

            nbytes = 2 * b * l * DENSE_HKV * 128 * 2
            lut_np = np.asarray(lut)
            pool = rd.buffer(kv.size * 2)
            sweep = {}
            best = best_readers(rd, pool, lut_np, None, b=b, hkv=DENSE_HKV, page=page, rowb=256,
                                maxp=lut_np.shape[1], topk=0, nkeys=l, sweep=sweep)
            plan_np = msa_ops.plan("mo.mha.ragged.paged", qr, offs, kv, cl, lut, 0, mask_str="causal").num_partitions
            sweep["ours"] = {}
            for n in sorted({plan_np, *(p for p in (1, 2, 4, 8, 16, 32, 64) if p * b * DENSE_HKV <= 16 * rd.sms)}):
                sweep["ours"][n] = round(graph_timer(gpu_mha.mha_call(n), (qr, kv, lut, offs, cl))() * 1e6, 2)
            contig, cbuf = contiguous_timer(rd, nbytes)
            timers = {"cudnn": graph_timer(cud, (q, k, v)),
                      "ours": graph_timer(gpu_mha.mha_call(), (qr, kv, lut, offs, cl)),
                      "contiguous": contig, **{kind: tm for kind, (_, tm) in best.items()}}
            got = {n: float(np.median(ts)) for n, ts in bench_rounds(timers, rounds).items()}
            r = {"kind": "dense", "B": b, "L": l, "page": page, "bytes": nbytes, "rounds": rounds,
                 **{f"{n}_us": t * 1e6 for n, t in got.items()},
                 **{f"{kind}_config": c for kind, (c, _) in best.items()}, "plan_partitions": plan_np,
                 "sweep_us": sweep}
            readers = [n for n in ("cp", "tma") if n in got]
            r["reader"] = min(readers, key=lambda n: got[n])
            r["reader_us"] = got[r["reader"]] * 1e6
            r["ours_vs_cudnn"] = got["cudnn"] / got["ours"]
            r["reader_vs_cudnn"] = got["cudnn"] / got[r["reader"]]
            r["ours_vs_reader"] = got[r["reader"]] / got["ours"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del q, k, v, kv, lut, pool, cbuf, timers, best, contig
            rd.cp.get_default_memory_pool().free_all_blocks()


def run_msa(rd, rows, rounds, topks):
    import gpu_msa

    rng = np.random.default_rng(0)
    b, hkv = MSA_B, MSA_HKV
    for cache in (32768, 131072):
        mp = cache // 128
        kv16, kv8, lut, offs, cl, q16, q8 = gpu_msa.decode_case(cache, rng)
        cud_timer, cud_bytes = gpu_msa.cudnn_dense(q16, cache)
        lut_np = np.asarray(lut)
        pools = {"bf16": rd.buffer(kv16.size * 2), "fp8": rd.buffer(kv8.size)}
        for topk in topks:
            ids = gpu_msa.decode_ids(rng, mp, topk)  # [Hkv, B, topk]
            ids_np = np.ascontiguousarray(np.asarray(ids).transpose(1, 0, 2))  # [B, Hkv, topk]
            timers = {"cudnn": cud_timer}
            configs, sweep = {}, {}
            for dt, rowb, q, kv in (("bf16", 256, q16, kv16), ("fp8", 128, q8, kv8)):
                timers[dt] = graph_timer(gpu_msa.msa_call(0), (q, kv, ids, offs, cl, lut))
                sw = sweep.setdefault(dt, {})
                best = best_readers(rd, pools[dt], lut_np, ids_np, b=b, hkv=hkv, page=128, rowb=rowb, maxp=mp,
                                    topk=topk, nkeys=topk * 128, sweep=sw)
                sw["ours"] = {n: round(graph_timer(gpu_msa.msa_call(n), (q, kv, ids, offs, cl, lut))() * 1e6, 2)
                              for n in (1, 2, 4)}
                for kind, (c, tm) in best.items():
                    timers[f"{kind}_{dt}"] = tm
                    configs[f"{kind}_{dt}_config"] = c
            got = {n: float(np.median(ts)) for n, ts in bench_rounds(timers, rounds).items()}
            r = {"kind": "msa", "cache": cache, "topk": topk, "rounds": rounds, **configs, "sweep_us": sweep,
                 **{f"{n}_us": t * 1e6 for n, t in got.items()}}
            r["cudnn_gbs"] = cud_bytes / got["cudnn"] / 1e9
            for dt, rowb in (("bf16", 256), ("fp8", 128)):
                nbytes = 2 * b * hkv * topk * 128 * rowb
                readers = [n for n in (f"cp_{dt}", f"tma_{dt}") if n in got]
                rn = min(readers, key=lambda n: got[n])
                r[f"{dt}_reader"] = rn
                r[f"{dt}_reader_us"] = got[rn] * 1e6
                r[f"{dt}_gbs"] = nbytes / got[dt] / 1e9
                r[f"{dt}_reader_gbs"] = nbytes / got[rn] / 1e9
                r[f"{dt}_vs_cudnn"] = r[f"{dt}_gbs"] / r["cudnn_gbs"]
                r[f"{dt}_reader_vs_cudnn"] = r[f"{dt}_reader_gbs"] / r["cudnn_gbs"]
            r["fp8_speedup"] = got["bf16"] / got["fp8"]
            r["fp8_speedup_bound"] = got["bf16"] / got[r["fp8_reader"]]  # ours bf16 over the fastest fp8 reader
            rows.append(r)
            print(json.dumps(r), flush=True)
            del timers, best
        del kv16, kv8, pools, cud_timer
        rd.cp.get_default_memory_pool().free_all_blocks()


PROBE_VARIANTS = ((0, 0), (1, 0), (2, 0), (3, 0), (3, 128), (3, 256), (3, 512), (3, 1024))


def run_probe(rd, rows):
    """The cp.async reader at one partition (a CTA per (sequence, kv head), as our MSA topk-16 and dense 64/4k decode
    calls run), with what a decode kernel adds to a read, one thing at a time (cp_read's mode and work): the
    barrier, the issue after the wait, a dependent FMA chain per tile. MSA bf16 topk 16 at 32k, dense 64/4k page
    128; pages drawn here, blocks by gpu_msa.draw_ids."""
    import gpu_msa

    rng = np.random.default_rng(0)
    cp = rd.cp
    points = (("msa bf16 topk 16, 32k", MSA_B, MSA_HKV, 256, 16), ("dense 64/4k page 128", 64, DENSE_HKV, 32, 0))
    for label, b, hkv, mp, topk in points:
        lut = rng.permutation(b * mp).astype(np.int32).reshape(b, mp)
        ids = None
        if topk:
            ids = gpu_msa.draw_ids(rng, mp, topk, b=b, hkv=hkv)
        pool = rd.buffer(b * mp * 2 * 128 * hkv * 256)
        lut_d = cp.asarray(lut)
        ids_d = None if ids is None else cp.asarray(ids)
        out = cp.zeros(b * hkv, cp.uint32)
        kw = dict(b=b, hkv=hkv, page=128, rowb=256, parts=1, np_=topk or mp, maxp=mp, topk=topk, out=out)
        for st in (3, 4):
            for mode, work in PROBE_VARIANTS:
                t = rd.graph_timer(rd.launch_fn("cp", st, pool, lut_d, ids_d, mode=mode, work=work, **kw))()
                r = {"kind": "probe", "point": label, "stages": st, "barrier": bool(mode & 1),
                     "issue_after_wait": bool(mode & 2), "fma_per_tile": work, "us": round(t * 1e6, 2)}
                rows.append(r)
                print(json.dumps(r), flush=True)
        del pool
        cp.get_default_memory_pool().free_all_blocks()


def run_lone(rd, rows, rounds):
    """Decode calls of at most one CTA per SM (64 CTAs), ours against the cp.async reader cut into the same CTAs: the
    rate one CTA streams at when it has an SM to itself. Dense: B=4, L=64k, page 128, two partitions; MSA: B=16,
    Hkv=4, 32k cache, topk 64, one partition, bf16 and fp8."""
    import gpu_mha
    import gpu_msa

    rng = np.random.default_rng(0)
    cp = rd.cp
    cases = []
    # dense
    b, l, page, parts = 4, 65536, 128, 2
    q, k, v, kv, lut = gpu_mha.decode_case(b, l, page, rng)
    qr, offs, cl = gpu_mha.step_args(q, l)

    lut_np = np.asarray(lut)
    pool = rd.buffer(kv.size * 2)
    kw = dict(b=b, hkv=DENSE_HKV, page=page, rowb=256, parts=parts, np_=lut_np.shape[1] // parts,
              maxp=lut_np.shape[1], topk=0, out=cp.zeros(b * DENSE_HKV * parts, cp.uint32))
    cases.append(("dense 4/64k page 128, 2 partitions", b * DENSE_HKV * parts, 2 * b * l * DENSE_HKV * 128 * 2,
                  graph_timer(gpu_mha.mha_call(parts), (qr, kv, lut, offs, cl)),
                  rd.graph_timer(rd.launch_fn("cp", 3, pool, cp.asarray(lut_np), None, **kw)), (q, k, v, kv, pool)))
    # MSA
    b, hkv, mp, topk = 16, MSA_HKV, 256, 64
    kv16 = jax.random.normal(jax.random.PRNGKey(5), (b * mp, 2, 1, 128, hkv, 128), jnp.bfloat16)
    lut = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
    ids_np = gpu_msa.draw_ids(rng, mp, topk, b=b, hkv=hkv)
    ids = jnp.asarray(ids_np.transpose(1, 0, 2))
    offs = jnp.arange(b + 1, dtype=jnp.int32)
    cl = jnp.full((b,), mp * 128 - 1, jnp.int32)
    q16 = jax.random.normal(jax.random.PRNGKey(6), (b, 32, 128), jnp.bfloat16)

    for dt, rowb, q, kvx in (("bf16", 256, q16, kv16),
                             ("fp8", 128, q16.astype(jnp.float8_e4m3fn), kv16.astype(jnp.float8_e4m3fn))):
        pool = rd.buffer(kvx.size * (2 if dt == "bf16" else 1))
        kw = dict(b=b, hkv=hkv, page=128, rowb=rowb, parts=1, np_=topk, maxp=mp, topk=topk,
                  out=cp.zeros(b * hkv, cp.uint32))
        cases.append((f"MSA {dt} B=16 topk 64, 1 partition", b * hkv, 2 * b * hkv * topk * 128 * rowb,
                      graph_timer(gpu_msa.msa_call(1), (q, kvx, ids, offs, cl, lut)),
                      rd.graph_timer(rd.launch_fn("cp", 3, pool, cp.asarray(np.asarray(lut)), cp.asarray(ids_np),
                                                  **kw)), (q, kvx, pool)))
    for label, ctas, nbytes, ours_t, reader_t, _keep in cases:
        got = {n: float(np.median(ts)) for n, ts in bench_rounds({"ours": ours_t, "reader": reader_t},
                                                                  rounds).items()}
        r = {"kind": "lone", "case": label, "ctas": ctas, "bytes": nbytes, "ours_us": got["ours"] * 1e6,
             "reader_us": got["reader"] * 1e6, "ours_gbs_per_cta": nbytes / got["ours"] / ctas / 1e9,
             "reader_gbs_per_cta": nbytes / got["reader"] / ctas / 1e9}
        rows.append(r)
        print(json.dumps(r), flush=True)


def partition_rows(lead, sweep, plan=None):
    """Markdown rows of a partition sweep ({kind: {partitions: us}}, keys int or, read back from JSON, str): the
    `lead` cells, the partition count (bold where it is `plan`), then the cp.async reader's, the tma reader's and
    ours us."""
    def us(kind, p):
        got = sweep.get(kind, {})
        return got.get(p, got.get(str(p)))

    out = []
    for p in sorted({int(k) for part in sweep.values() for k in part}):
        cells = ["-" if us(k, p) is None else f"{us(k, p):.1f}" for k in ("cp", "tma", "ours")]
        out.append("| " + " | ".join(map(str, [*lead, f"**{p}**" if p == plan else p, *cells])) + " |")
    return out


def render(rows, name):
    md = [f"# Decode read ceilings on {name} (jax {jax.__version__})", "",
          "Read-only kernels that read exactly the K/V rows (and page-table entries) a decode call must read, as "
          "SPEC's pool lays them out; the fastest of each kind over partitions and ring stages (cp.async tiles, "
          "tensor-map boxes); each timed as 10 calls in one CUDA graph, once a round with cuDNN and ours in rotating "
          "order (medians). A reader slower than the goal allows means no kernel reading this layout meets the goal "
          "at that point, as far as these readers go.", ""]
    dense = [r for r in rows if r["kind"] == "dense"]
    if dense:
        md += ["## Dense decode (bf16, Hq=32, Hkv=8, D=128, pages shuffled over the pool as in gpu_mha.py); goal: "
               "ours >= 1.0x cuDNN", "",
               "| B | L | page | cuDNN us | ours us | fastest reader us (kind, shape) | contiguous read us | "
               "ours / cuDNN | reader / cuDNN | ours / reader |", "| --- | --- | --- | --- | --- | --- | --- | --- | "
               "--- | --- |"]
        for r in dense:
            md.append(f"| {r['B']} | {r['L']} | {r['page']} | {r['cudnn_us']:.1f} | {r['ours_us']:.1f} | "
                      f"{r['reader_us']:.1f} ({r['reader']}, {r[r['reader'] + '_config']}) | "
                      f"{r['contiguous_us']:.1f} | "
                      f"{r['ours_vs_cudnn']:.3f} | {r['reader_vs_cudnn']:.3f} | {r['ours_vs_reader']:.3f} |")
        md += ["", "By partitions (CTAs per (sequence, kv head)): each reader's fastest stage count, and ours with "
               "`num_partitions` forced, us, timed once each (the plan's count in bold)", "",
               "| B | L | page | partitions | cp.async | tma | ours |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in dense:
            md += partition_rows([r["B"], r["L"], r["page"]], r["sweep_us"], r["plan_partitions"])
    lone = [r for r in rows if r["kind"] == "lone"]
    if lone:
        md += ["## At most one CTA per SM (--lone): ours and the cp.async reader (3 stages) cut into the same CTAs", "",
               "| case | CTAs | ours us | reader us | ours GB/s a CTA | reader GB/s a CTA |",
               "| --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['case']} | {r['ctas']} | {r['ours_us']:.1f} | {r['reader_us']:.1f} | "
               f"{r['ours_gbs_per_cta']:.1f} | {r['reader_gbs_per_cta']:.1f} |" for r in lone]
        md.append("")
    probe = [r for r in rows if r["kind"] == "probe"]
    if probe:
        md += ["## The cp.async reader at one partition with a kernel's barrier, issue order and compute added "
               "(--probe)", "", "| point | stages | barrier | issue after the wait | FMA chain a tile | us |",
               "| --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['point']} | {r['stages']} | {'yes' if r['barrier'] else 'no'} | "
               f"{'yes' if r['issue_after_wait'] else 'no'} | {r['fma_per_tile']} | {r['us']:.1f} |" for r in probe]
    msa = [r for r in rows if r["kind"] == "msa"]
    if msa:
        md += ["", "## MSA decode (B=32, H=32, Hkv=4, D=128); goals: bf16 >= 0.85x cuDNN's dense GB/s, fp8 >= 1.7x "
               "faster than bf16", "",
               "| cache | topk | cuDNN dense GB/s | bf16 ours GB/s (x cuDNN) | bf16 reader GB/s (x cuDNN) | "
               "fp8 ours us | fp8 reader us | fp8 speedup | bf16 ours / fp8 reader |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in msa:
            md.append(f"| {r['cache']} | {r['topk']} | {r['cudnn_gbs']:.0f} | {r['bf16_gbs']:.0f} "
                      f"({r['bf16_vs_cudnn']:.3f}) | {r['bf16_reader_gbs']:.0f} ({r['bf16_reader_vs_cudnn']:.3f}, "
                      f"{r['bf16_reader']}) | {r['fp8_us']:.1f} | {r['fp8_reader_us']:.1f} ({r['fp8_reader']}) | "
                      f"{r['fp8_speedup']:.2f}x | {r['fp8_speedup_bound']:.2f}x |")
        md += ["", "The last column is the most an fp8 kernel could gain over our bf16 kernel of the same run if it "
               "ran as fast as the fastest fp8 reader.", "",
               "By partitions: each reader's fastest stage count, and ours with `num_partitions` forced, us, timed "
               "once each", "", "| cache | topk | dtype | partitions | cp.async | tma | ours |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in msa:
            for dt, sw in r["sweep_us"].items():
                md += partition_rows([r["cache"], r["topk"], dt], sw)
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("dense", "msa"), default=None)
    ap.add_argument("--pages", default="128,16", help="dense decode page sizes")
    ap.add_argument("--topks", default="16,64", help="MSA decode topk values")
    ap.add_argument("--probe", action="store_true", help="only the reader with a kernel's parts added (run_probe)")
    ap.add_argument("--lone", action="store_true", help="only calls of at most one CTA an SM (run_lone)")
    a = ap.parse_args()
    rd = Readers()
    rows = []
    if a.probe or a.lone:
        if a.lone:
            run_lone(rd, rows, a.rounds)
        if a.probe:
            run_probe(rd, rows)
        write_results(a.out, "decode_ceiling_probe" if a.probe else "decode_ceiling_lone", rows, render(rows, rd.name))
        return
    if a.only in (None, "dense"):
        run_dense(rd, rows, a.rounds, [int(p) for p in a.pages.split(",")])
    if a.only in (None, "msa"):
        run_msa(rd, rows, a.rounds, [int(t) for t in a.topks.split(",")])
    write_results(a.out, "decode_ceiling", rows, render(rows, rd.name))


if __name__ == "__main__":
    main()
