"""One dense prefill call on the 128-row tile (bf16, D=128 and H=16 unless --d: H = 2048 / D, B*S=16384), for a
profiler:

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:attention_ws -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SourceCounters --import-source no -f -o prof \
      python3 scripts/probe_prefill_once.py --s 8192 --mask null
(MSA_OPS_DENSE_WS=0 selects the CTA-per-tile kernel: -k regex:attention_sm90)
"""

import argparse

import jax
import jax.numpy as jnp

import msa_ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--mask", default="null")
    ap.add_argument("--d", type=int, default=128, help="head dim (H = 2048 / D)")
    ap.add_argument("--hkv", type=int, default=0, help="kv heads (default: H)")
    ap.add_argument("--total", type=int, default=16384)
    args = ap.parse_args()
    d, s = args.d, args.s
    h = 2048 // d
    hkv = args.hkv or h
    b = max(1, args.total // s)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (b * s, h, d), jnp.bfloat16)
    k = jax.random.normal(k2, (b * s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(k3, (b * s, hkv, d), jnp.bfloat16)
    offs = jnp.arange(b + 1, dtype=jnp.int32) * s
    f = jax.jit(lambda q, k, v: msa_ops.mha_ragged_no_cache(q, k, v, offs, mask_str=args.mask, implementation="native"))
    jax.block_until_ready(f(q, k, v))


if __name__ == "__main__":
    main()
