"""One prefill call of mo.mha.ragged.no_cache for a profiler (ncu): S, causal from the command line."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import msa_ops

s = int(sys.argv[1])
mask = sys.argv[2] if len(sys.argv) > 2 else "null"
h, d = 16, 128
b = 16384 // s
q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b * s, h, d), jnp.bfloat16) for i in range(3))
offs = jnp.arange(b + 1, dtype=jnp.int32) * s
f = jax.jit(lambda q, k, v: msa_ops.mha_ragged_no_cache(q, k, v, offs, mask_str=mask, implementation="native"))
for _ in range(3):
    jax.block_until_ready(f(q, k, v))
print("done")
