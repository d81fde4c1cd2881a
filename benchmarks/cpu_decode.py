"""CPU decode benchmark: native C++ handler vs the jitted plain-JAX reference, same process, same inputs.

Decode step of mo.mha.ragged.paged: B=8 sequences, H=32 query heads, Hkv=8, D=128, 4096 cached keys,
bf16, page 128 (pages shuffled over the pool). Prints a table and writes JSON next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import msa_ops


def make_case(b=8, h=32, hkv=8, d=128, cache=4096, page=128, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    mp = -(-(cache + 1) // page)
    nb = b * mp + 5
    q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((nb, 2, 1, page, hkv, d)), dtype)
    offsets = jnp.arange(b + 1, dtype=jnp.int32)
    cache_lengths = jnp.full((b,), cache, jnp.int32)
    lut = jnp.asarray(rng.permutation(nb)[: b * mp].reshape(b, mp), jnp.int32)
    return q, offsets, kv, cache_lengths, lut, jnp.int32(0)


def time_fn(fn, args, repeats=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for cpu_decode.json")
    a = ap.parse_args()
    cpu = jax.devices("cpu")[0]
    args = jax.device_put(make_case(b=a.batch, cache=a.cache), cpu)
    res = {}
    for impl in ("reference", "native"):
        f = jax.jit(lambda *x, _i=impl: msa_ops.mha_ragged_paged(*x, mask_str="causal", implementation=_i))
        try:
            res[impl] = time_fn(f, args, repeats=a.repeats)
        except msa_ops.NativeUnavailableError as e:
            print(f"{impl}: unavailable: {e}")
    q, _, kv, _, _, _ = args
    kv_bytes = a.batch * (a.cache + 1) * kv.shape[4] * kv.shape[5] * 2 * kv.dtype.itemsize
    plan = msa_ops.plan("mo.mha.ragged.paged", *args, mask_str="causal")
    print(f"decode B={a.batch} H={q.shape[1]} Hkv={kv.shape[4]} D={q.shape[2]} cache={a.cache} bf16 on "
          f"{os.cpu_count()} CPU cores; plan: {plan.kernel}, {plan.num_partitions} partitions")
    print("| impl | ms / step | KV GB/s | speedup vs reference |")
    print("| --- | --- | --- | --- |")
    for impl, t in res.items():
        print(f"| {impl} | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.2f} | {res['reference'] / t:.2f}x |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu_decode.json"), "w") as fh:
            json.dump({"seconds": res, "kv_bytes": kv_bytes, "cores": os.cpu_count(), "jax": jax.__version__}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
