"""One bf16 and one fp8 call of the MSA decode kernel on uneven lists (tokens with 0, 2, 5 and 32 slots), checked
against the float64 oracle, and how many of its launches shared work; small enough for compute-sanitizer:
  MSA_OPS_MSA_SHARE=4 compute-sanitizer --tool racecheck python3 scripts/probe_msa_share_once.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import oracle  # noqa: E402
from conftest import RaggedBatch, assert_close, budget_for, make_paged_cache, rand  # noqa: E402

import msa_ops  # noqa: E402
from msa_ops import _native  # noqa: E402

hkv, group, b, mp, topk = 2, 8, 8, 16, 32
for dt in (jnp.bfloat16, jnp.float8_e4m3fn):
    rng = np.random.default_rng(5)
    cache = [int(x) for x in rng.integers(128 * (mp // 2), 128 * mp - 1, b)]
    batch = RaggedBatch([1] * b, cache, b)
    pc = make_paged_cache(rng, [c + 1 for c in cache], page_size=128, max_pages=mp, n_kv_heads=hkv, head_dim=128,
                          dtype=dt)
    q = rand(rng, (batch.T, hkv * group, 128), dt)
    ids = rng.integers(-1, mp, (hkv, batch.T, topk)).astype(np.int32)
    for t in range(b):
        ids[:, t, [0, 2, topk, 5][t % 4]:] = -1
    args = (q, batch.offsets, None, pc.kv_blocks, batch.cache_lengths, pc.lut, 1, ids)
    before = (_native.launch_counts() or {}).get("msa_decode_share", 0)
    got = msa_ops.msa_attention_ragged_paged(*args, implementation="native")
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(dt))
    shared = (_native.launch_counts() or {}).get("msa_decode_share", 0) - before
    print("OK", jnp.dtype(dt).name, "share launches", shared)
