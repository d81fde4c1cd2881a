"""One decode call of mo.mha.ragged.paged for a profiler (ncu): B, L, partitions from the command line."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import msa_ops

b, l, np_ = (int(x) for x in sys.argv[1:4])
page = int(sys.argv[4]) if len(sys.argv) > 4 else 128
rng = np.random.default_rng(0)
mp = -(-l // page)
kv = jax.random.normal(jax.random.PRNGKey(0), (b * mp, 2, 1, page, 8, 128), jnp.bfloat16)
lut = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
q = jax.random.normal(jax.random.PRNGKey(1), (b, 32, 128), jnp.bfloat16)
offs = jnp.arange(b + 1, dtype=jnp.int32)
cl = jnp.full((b,), l - 1, jnp.int32)
f = jax.jit(lambda q, kv: msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 0, num_partitions=np_,
                                                   implementation="native"))
for _ in range(3):
    jax.block_until_ready(f(q, kv))
print("done")
