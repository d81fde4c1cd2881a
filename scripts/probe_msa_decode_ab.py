"""MSA decode, bf16 and fp8 with the ladder's partitions, against cuDNN's dense decode; one line out, for A/B
runs of kernel variants (the shapes of benchmarks/gpu_msa.py: B=32, H=32, Hkv=4; cache 32k and 128k; topk 16
and 64):
  AB_DIR="ab1 ab2" AB_CMD="python3 scripts/probe_msa_decode_ab.py" bash scripts/gpu_ab.sh
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_msa import HKV, B, D, H, msa_call  # noqa: E402
from harness import bench_in_graph  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    out = []
    for cache in (32768, 131072):
        mp = cache // 128
        nb = B * mp
        kv16 = jax.random.normal(jax.random.PRNGKey(cache), (nb, 2, 1, 128, HKV, D), jnp.bfloat16)
        kv8 = kv16.astype(jnp.float8_e4m3fn)
        lut = jnp.asarray(rng.permutation(nb).reshape(B, mp), jnp.int32)
        offs = jnp.arange(B + 1, dtype=jnp.int32)
        cl = jnp.full((B,), cache - 1, jnp.int32)
        q16 = jax.random.normal(jax.random.PRNGKey(1), (B, H, D), jnp.bfloat16)
        q8 = q16.astype(jnp.float8_e4m3fn)
        k = jax.random.normal(jax.random.PRNGKey(2), (B, cache, HKV, D), jnp.bfloat16)
        v = jax.random.normal(jax.random.PRNGKey(3), (B, cache, HKV, D), jnp.bfloat16)
        t_cud = bench_in_graph(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
                               (q16.reshape(B, 1, H, D), k, v))
        cud = 2 * B * cache * HKV * D * 2 / t_cud / 1e9
        del k, v
        for topk in (16, 64):  # the newest block and topk - 1 random earlier ones per (sequence, kv head)
            ids = np.stack([np.sort(rng.choice(mp - 1, topk - 1, replace=False)) for _ in range(B * HKV)])
            ids = np.concatenate([ids, np.full((B * HKV, 1), mp - 1)], 1)
            ids = jnp.asarray(ids.reshape(B, HKV, topk).transpose(1, 0, 2), jnp.int32)
            t16 = bench_in_graph(msa_call(offs, cl, lut, 0), (q16, kv16, ids))
            t8 = bench_in_graph(msa_call(offs, cl, lut, 0), (q8, kv8, ids))
            g16 = 2 * B * HKV * topk * 128 * D * 2 / t16 / 1e9
            out.append(f"{cache // 1024}k/k{topk}: bf16 {t16 * 1e6:.1f}us {g16 / cud:.3f}x cuDNN({cud:.0f}) "
                       f"fp8 {t8 * 1e6:.1f}us {t16 / t8:.2f}x")
    print("MSA " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
