"""One decode call of ours and one of cuDNN, after a warm-up, for a profiler (bf16, Hq=32, Hkv=8, D=128).

Ours reads the paged pool (shuffled pages), cuDNN the same K/V contiguous, as in benchmarks/gpu_mha.py.

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:attention_kernel -s 1 -c 1 \
      --section SourceCounters --section WarpStateStats --import-source no -f -o dec \
      python3 scripts/probe_decode_once.py --batch 64 --len 4096 --page 128
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --section SpeedOfLight \
      python3 scripts/probe_decode_once.py          # every kernel of the run: ours and cuDNN side by side
(without the preallocation switch each profiled launch saves and restores most of the GPU's memory: minutes)
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from gpu_mha import decode_case  # noqa: E402

import msa_ops  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--page", type=int, default=128)
    a = ap.parse_args()
    b, n = a.batch, a.len
    q, k, v, kv, lut = decode_case(b, n, a.page, np.random.default_rng(0))
    offs = jnp.arange(b + 1, dtype=jnp.int32)
    cl = jnp.full((b,), n - 1, jnp.int32)
    qr = q.reshape(b, 32, 128)
    ours = jax.jit(
        lambda qr, kv, lut: msa_ops.mha_ragged_paged(
            qr, offs, kv, cl, lut, 0, mask_str="causal", implementation="native"
        )
    )
    cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    for _ in range(2):  # compile, then one more call of each
        o1 = ours(qr, kv, lut).block_until_ready()
        o2 = cud(q, k, v).block_until_ready()
    err = float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.reshape(b, 32, 128).astype(jnp.float32))))
    print(f"B={b} L={n} page={a.page}: max |ours - cuDNN| = {err:.3e}")


if __name__ == "__main__":
    main()
