"""Decode time against bytes read, ours and cuDNN in one process: a fit T = a + bytes / R per series.

R is the marginal streaming rate (what one more key costs) and a the fixed part of a call (launch, prologue,
ramp-up, the spread of the CTAs' ends, epilogue, a second kernel). Dense: B=64, 16 and 4 at three lengths each
(the ladder's partition count of the benchmark's length held fixed, so one kernel per series); MSA: topk
8..64 at one partition (2 and 4 printed, not fitted). Read with benchmarks/NOTES_mha.md v23 and NOTES_msa.md v14.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_msa  # noqa: E402
from gpu_mha import decode_case  # noqa: E402
from harness import bench_in_graph  # noqa: E402

import msa_ops  # noqa: E402


def fit(byts, ts):
    """Least squares T = a + bytes / R: (a in us, R in GB/s)."""
    slope, a = np.polyfit(np.asarray(byts, float), np.asarray(ts, float), 1)
    return a * 1e6, 1e-9 / slope


def dense(series, rng):
    for b, lens, ref_len, pages in series:
        for page in pages:
            sds, i32 = jax.ShapeDtypeStruct, jnp.int32
            npart = msa_ops.plan("mo.mha.ragged.paged", sds((b, 32, 128), jnp.bfloat16), sds((b + 1,), i32),
                                 sds((1, 2, 1, page, 8, 128), jnp.bfloat16), sds((b,), i32),
                                 sds((b, -(-ref_len // page)), i32), 0, mask_str="causal").num_partitions
            offs = jnp.arange(b + 1, dtype=jnp.int32)
            rows, byts, t_o, t_c = [], [], [], []
            for n in lens:
                q, k, v, kv, lut = decode_case(b, n, page, rng)
                cl = jnp.full((b,), n - 1, jnp.int32)

                def ours(qr, kv, lut, offs=offs, cl=cl, npart=npart):
                    return msa_ops.mha_ragged_paged(qr, offs, kv, cl, lut, 0, mask_str="causal",
                                                    num_partitions=npart, implementation="native")

                def cudnn(q, k, v):
                    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

                byts.append(2 * b * n * 8 * 128 * 2)
                t_o.append(bench_in_graph(ours, (q.reshape(b, 32, 128), kv, lut)))
                t_c.append(bench_in_graph(cudnn, (q, k, v)))
                rows.append(f"{n // 1024}k {t_o[-1] * 1e6:.1f}/{t_c[-1] * 1e6:.1f}us")
                del q, k, v, kv, lut
            (ao, ro), (ac, rc) = fit(byts, t_o), fit(byts, t_c)
            print(f"DENSE B={b} p{page} np={npart}: " + ", ".join(rows) +
                  f" | ours a={ao:.1f}us R={ro:.0f} | cuDNN a={ac:.1f}us R={rc:.0f} | R ratio {ro / rc:.3f}",
                  flush=True)


def msa(topks, cache, rng):
    kv16, kv8, lut, offs, cl, q16, q8 = gpu_msa.decode_case(cache, rng)
    for name, q, kv, eb in (("bf16", q16, kv16, 2), ("fp8", q8, kv8, 1)):
        rows, byts, ts = [], [], []
        for topk in (2, 4) + topks:
            ids = gpu_msa.decode_ids(rng, cache // 128, topk)
            t = bench_in_graph(gpu_msa.msa_call(1), (q, kv, ids, offs, cl, lut))
            rows.append(f"k{topk} {t * 1e6:.1f}us")
            if topk in topks:
                byts.append(2 * gpu_msa.B * gpu_msa.HKV * topk * 128 * gpu_msa.D * eb)
                ts.append(t)
        a, r = fit(byts, ts)
        print(f"MSA {name} cache {cache // 1024}k np=1: " + ", ".join(rows) + f" | a={a:.1f}us R={r:.0f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="dense or msa (default: both)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.only in ("", "dense"):
        dense([(64, (2048, 4096, 8192), 4096, (128,)), (16, (8192, 16384, 32768), 16384, (128, 16)),
               (4, (32768, 65536, 131072), 65536, (128,)), (1, (32768, 65536, 131072), 131072, (128,))], rng)
    if args.only in ("", "msa"):
        msa((8, 16, 32, 64), 32768, rng)


if __name__ == "__main__":
    main()
