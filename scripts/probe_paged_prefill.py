"""Paged against contiguous K/V on the sm_90 prefill kernel (bf16, D=128, H=16, B*S=16k, page 128): a diagnostic
of the paged path's cost. Times the same call on contiguous K/V and on the paged pool with shuffled pages and with
pages in key order, and checks that the three outputs are bit-identical (the kernel computes the same tiles).
Variants for the paged pool: --page (box height min(page, 128)), --layers L (the data in layer L - 1 of an
L-layer pool: K and V of a page L times further apart).

  python3 scripts/probe_paged_prefill.py           # timings, one table
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:attention_sm90 -c 2 \
      --section SpeedOfLight --section WarpStateStats python3 scripts/probe_paged_prefill.py --once
(without the preallocation switch each profiled launch saves and restores most of the GPU's memory: minutes)
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from harness import bench  # noqa: E402

import msa_ops  # noqa: E402

BF = jnp.bfloat16
H, D, TOTAL = 16, 128, 16384


def paged(k, v, page, perm, layers=1):
    b, s, hkv, d = k.shape
    mp = s // page
    kv = jnp.zeros((b * mp, 2, layers, page, hkv, d), k.dtype)
    kv = kv.at[perm, 0, layers - 1].set(k.reshape(b * mp, page, hkv, d))
    kv = kv.at[perm, 1, layers - 1].set(v.reshape(b * mp, page, hkv, d))
    return kv, jnp.asarray(perm, jnp.int32).reshape(b, mp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true", help="one call per case, S=8k non-causal (for a profiler)")
    ap.add_argument("--cases", default="contiguous,paged", help="comma list (with --once)")
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--total", type=int, default=TOTAL, help="tokens in the batch (B * S)")
    ap.add_argument("--lens", default="2048,8192", help="sequence lengths S (comma list)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lens = (8192,) if args.once else tuple(int(x) for x in args.lens.split(","))
    layer = args.layers - 1
    print(f"page {args.page}, {args.layers} layer(s), B*S = {args.total}")
    masks = ("null",) if args.once else ("null", "causal")
    print("| S | mask | contiguous | paged | paged, key order | paged / contiguous |")
    print("| --- | --- | --- | --- | --- | --- |")
    for s in lens:
        b = max(1, args.total // s)
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(s), 3)
        q = jax.random.normal(k1, (b, s, H, D), BF)
        k = jax.random.normal(k2, (b, s, H, D), BF)
        v = jax.random.normal(k3, (b, s, H, D), BF)
        offs = jnp.arange(b + 1, dtype=jnp.int32) * s
        cl0 = jnp.zeros((b,), jnp.int32)
        nb = b * (s // args.page)
        kv_s, lut_s = paged(k, v, args.page, rng.permutation(nb), args.layers)
        kv_i, lut_i = paged(k, v, args.page, np.arange(nb), args.layers)
        for m in masks:
            flops = 4 * b * s * s * H * D * (0.5 if m == "causal" else 1.0)
            contig = jax.jit(lambda q, k, v, m=m, offs=offs: msa_ops.mha_ragged_no_cache(
                q.reshape(-1, H, D), k.reshape(-1, H, D), v.reshape(-1, H, D), offs, mask_str=m,
                implementation="native"))
            pg = jax.jit(lambda q, kv, lut, m=m, offs=offs, cl0=cl0: msa_ops.mha_ragged_paged(
                q.reshape(-1, H, D), offs, kv, cl0, lut, layer, mask_str=m, implementation="native"))
            ref = None if args.once else np.asarray(contig(q, k, v), np.float32)
            cases = [("contiguous", contig, (q, k, v)), ("paged", pg, (q, kv_s, lut_s)),
                     ("key order", pg, (q, kv_i, lut_i))]
            tf = {}
            for name, fn, a in cases:
                if args.once:
                    if name in args.cases.split(","):
                        jax.block_until_ready(fn(*a))
                        print(name, flush=True)
                    continue
                out = np.asarray(fn(*a), np.float32)
                if not np.array_equal(out, ref):
                    print(f"{name}: differs from contiguous by {np.abs(out - ref).max():.3g}", flush=True)
                tf[name] = flops / bench(fn, a, iters=10, repeats=3) / 1e12
            if not args.once:
                print(f"| {s} | {m} | {tf['contiguous']:.0f} | {tf['paged']:.0f} | {tf['key order']:.0f} | "
                      f"{tf['paged'] / tf['contiguous']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
