"""Runs the MSA decode benchmark shape (B=32, H=32, Hkv=4, 128k cache, topk 64) once per configuration, for a
profiler: `ncu -k regex:msa_attention python3 scripts/ncu_msa_decode.py` (after a warm-up call each, so only
the timed kernels are the last launches of each configuration)."""

import jax
import jax.numpy as jnp
import numpy as np

import msa_ops

B, H, HKV, D, CACHE, TOPK = 32, 32, 4, 128, 131072, 64


def main():
    rng = np.random.default_rng(0)
    mp = CACHE // 128
    nb = B * mp
    kv16 = jax.random.normal(jax.random.PRNGKey(0), (nb, 2, 1, 128, HKV, D), jnp.bfloat16)
    lut = jnp.asarray(rng.permutation(nb).reshape(B, mp), jnp.int32)
    offs = jnp.arange(B + 1, dtype=jnp.int32)
    cl = jnp.full((B,), CACHE - 1, jnp.int32)
    q16 = jax.random.normal(jax.random.PRNGKey(1), (B, H, D), jnp.bfloat16)
    ids = np.stack([np.sort(rng.choice(mp - 1, TOPK - 1, replace=False)) for _ in range(B * HKV)])
    ids = np.concatenate([ids, np.full((B * HKV, 1), mp - 1)], 1)
    ids = jnp.asarray(ids.reshape(B, HKV, TOPK).transpose(1, 0, 2), jnp.int32)
    for name, q, kv, npart in (("bf16", q16, kv16, 0), ("bf16", q16, kv16, 2),
                               ("fp8", q16.astype(jnp.float8_e4m3fn), kv16.astype(jnp.float8_e4m3fn), 0)):
        f = jax.jit(lambda q, kv, ids, npart=npart: msa_ops.msa_attention_ragged_paged(
            q, offs, None, kv, cl, lut, 0, ids, num_partitions=npart, implementation="native"))
        jax.block_until_ready(f(q, kv, ids))
        jax.block_until_ready(f(q, kv, ids))
        print(name, npart, flush=True)


if __name__ == "__main__":
    main()
