"""Dense decode, ours against cuDNN in one process, one line out: for A/B runs of kernel variants.

The shapes of benchmarks/gpu_mha.py (bf16, Hq=32, Hkv=8, D=128; B=64/4k, 16/16k, 4/64k, 1/128k at page 128,
16/16k at page 16), each as ours GB/s and ours / cuDNN. Cheaper than the full benchmark, so that several builds
fit in one GPU call:
  AB_DIR="ab1 ab2" AB_CMD="python3 scripts/probe_decode_ab.py" bash scripts/gpu_ab.sh
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_mha  # noqa: E402
from gpu_mha import decode_case, mha_call, rel_err, step_args  # noqa: E402
from harness import bench_in_graph  # noqa: E402

import msa_ops  # noqa: E402

POINTS = [(64, 4096, (128,)), (16, 16384, (128, 16)), (4, 65536, (128,)), (1, 131072, (128,))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-partitions", type=int, default=0, help="split-K partitions (0: the ladder's choice)")
    ap.add_argument("--identity-pages", action="store_true",
                    help="page j of sequence b is pool page b * MP + j (a diagnostic of the page-scatter cost)")
    ap.add_argument("--page-order", default="",
                    help="local:N or runs:N, over the key-order layout (benchmarks/gpu_mha.py PAGE_ORDER)")
    ap.add_argument("--contiguous", action="store_true",
                    help="also time our kernel on cuDNN's contiguous K/V (mo.mha.padded.no_cache, one query row)")
    ap.add_argument("--batches", default="", help="comma list of the points' B to run (default: all)")
    ap.add_argument("--pages", default="", help="comma list of page sizes for every point (default: each point's)")
    ap.add_argument("--points", default="",
                    help="comma list of BxL points (e.g. 32x8192) to run instead of the benchmark's, page 128 unless "
                         "--pages says otherwise")
    args = ap.parse_args()
    keep = {int(x) for x in args.batches.split(",") if x}
    only_pages = tuple(int(x) for x in args.pages.split(",") if x)
    npart = args.num_partitions
    gpu_mha.IDENTITY_PAGES = args.identity_pages
    gpu_mha.PAGE_ORDER = args.page_order
    rng = np.random.default_rng(0)
    out = []
    points = POINTS
    if args.points:
        points = [(int(bx), int(lx), (128,)) for bx, lx in (p.split("x") for p in args.points.split(","))]
    for b, n, pages in points:
        if keep and b not in keep:
            continue
        pages = only_pages or pages
        cud = None
        for page in pages:
            q, k, v, kv, lut = decode_case(b, n, page, rng)
            qr, offs, cl = step_args(q, n)
            ours = mha_call(npart)

            def cudnn(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

            byts = 2 * b * n * 8 * 128 * 2
            if cud is None:  # cuDNN reads the contiguous K/V: once per (B, L)
                o_cud = jax.jit(cudnn)(q, k, v).reshape(b, 32, 128)
                cud = byts / bench_in_graph(cudnn, (q, k, v)) / 1e9
                if args.contiguous:
                    vl = jnp.full((b,), n, jnp.int32)

                    def ours_c(q, k, v, vl=vl):
                        return msa_ops.mha_padded_no_cache(q, k, v, vl, mask_str="causal", implementation="native")

                    err_c = rel_err(jax.jit(ours_c)(q, k, v).reshape(b, 32, 128), o_cud)
                    g_c = byts / bench_in_graph(ours_c, (q, k, v)) / 1e9
                    out.append(f"{b}/{n // 1024}k/contiguous: {g_c:.0f} {g_c / cud:.3f}x (err {err_c:.0e})")
            err = rel_err(jax.jit(ours)(qr, kv, lut, offs, cl), o_cud)
            g = byts / bench_in_graph(ours, (qr, kv, lut, offs, cl)) / 1e9
            out.append(f"{b}/{n // 1024}k/p{page}: {g:.0f} {g / cud:.3f}x (cuDNN {cud:.0f}, err {err:.0e})")
            del q, k, v, kv, lut
    pages = " identity-pages" if args.identity_pages else ""
    pages += f" page-order={args.page_order}" if args.page_order else ""
    print(f"DECODE np={npart or 'ladder'}{pages} " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
