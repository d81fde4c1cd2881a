"""CPU benchmark: the native C++ handlers against the jitted plain-JAX reference, same process, same inputs.

Cases (bf16, D=128, pages shuffled over the pool):
  decode   mo.mha.ragged.paged, B=8 one-token rows, H=32, Hkv=8, --cache keys each, page 128 (KV GB/s)
  prefill  mo.mha.ragged.paged, one causal prompt of --prompt rows, no cache, H=32, Hkv=8, page 128
           (GFLOP/s = 2 S^2 H D for causal, the FLOPs of the visible half)
  msa      mo.msa.attention.ragged.paged decode, B=8, H=32, Hkv=4, --cache keys each, topk 16 blocks of 128
           (GB/s over the selected blocks' K and V)
  indexer  mo.msa.indexer.ragged.paged decode, B=8, 4 index heads, index head dim 128, --cache keys each, topk 16
           (GB/s of index keys read)
Prints a table and writes cpu_bench.json into --out.
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


def paged(rng, tokens, hkv, d, page, dtype, kv=2):
    """A pool with room for the sequences' pages and 5 more (kv = 2: K and V; 1: the indexer's keys) and a page table
    that scatters each sequence's pages over it."""
    mp = -(-max(tokens) // page)
    nb = len(tokens) * mp + 5
    pool = jnp.asarray(rng.standard_normal((nb, kv, 1, page, hkv, d)), dtype)
    lut = jnp.asarray(rng.permutation(nb)[: len(tokens) * mp].reshape(len(tokens), mp), jnp.int32)
    return pool, lut


def decode_case(rng, b=8, h=32, hkv=8, d=128, cache=4096, page=128, dtype=jnp.bfloat16):
    kv, lut = paged(rng, [cache + 1] * b, hkv, d, page, dtype)
    q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    args = (q, jnp.arange(b + 1, dtype=jnp.int32), kv, jnp.full((b,), cache, jnp.int32), lut, jnp.int32(0))
    work = b * (cache + 1) * hkv * d * 2 * kv.dtype.itemsize
    return args, work, "GB/s"


def prefill_case(rng, s=1024, h=32, hkv=8, d=128, page=128, dtype=jnp.bfloat16):
    kv, lut = paged(rng, [s], hkv, d, page, dtype)
    q = jnp.asarray(rng.standard_normal((s, h, d)), dtype)
    args = (q, jnp.array([0, s], jnp.int32), kv, jnp.zeros((1,), jnp.int32), lut, jnp.int32(0))
    return args, 2 * s * s * h * d, "GFLOP/s"


def msa_case(rng, b=8, h=32, hkv=4, cache=8192, topk=16, dtype=jnp.bfloat16):
    kv, lut = paged(rng, [cache + 1] * b, hkv, 128, 128, dtype)
    q = jnp.asarray(rng.standard_normal((b, h, 128)), dtype)
    nblk = -(-(cache + 1) // 128)
    sel = np.stack([np.sort(rng.permutation(nblk)[:topk]) for _ in range(hkv * b)]).reshape(hkv, b, topk)
    args = (q, jnp.arange(b + 1, dtype=jnp.int32), None, kv, jnp.full((b,), cache, jnp.int32), lut, jnp.int32(0),
            jnp.asarray(sel, jnp.int32))
    return args, b * hkv * topk * 128 * 128 * 2 * kv.dtype.itemsize, "GB/s"


def indexer_case(rng, b=8, hi=4, d=128, cache=8192, dtype=jnp.bfloat16):
    k, lut = paged(rng, [cache + 1] * b, 1, d, 128, dtype, kv=1)
    q = jnp.asarray(rng.standard_normal((b, hi, d)), dtype)
    args = (q, jnp.arange(b + 1, dtype=jnp.int32), k, jnp.full((b,), cache, jnp.int32), lut, jnp.int32(0))
    return args, b * (cache + 1) * d * k.dtype.itemsize, "GB/s"


CASES = {
    "decode": (decode_case, lambda *x, i: msa_ops.mha_ragged_paged(*x, mask_str="causal", implementation=i)),
    "prefill": (prefill_case, lambda *x, i: msa_ops.mha_ragged_paged(*x, mask_str="causal", implementation=i)),
    "msa": (msa_case, lambda *x, i: msa_ops.msa_attention_ragged_paged(*x, implementation=i)),
    "indexer": (indexer_case, lambda *x, i: msa_ops.msa_indexer_ragged_paged(
        *x, topk=16, init_blocks=1, local_blocks=2, implementation=i)),
}


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="decode,prefill,msa,indexer", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--cache", type=int, default=None,
                    help="cached keys per sequence (decode 4096, msa and indexer 8192)")
    ap.add_argument("--prompt", type=int, default=1024, help="prefill prompt rows")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--impls", default="reference,native")
    ap.add_argument("--out", default=None, help="folder for cpu_bench.json")
    a = ap.parse_args()
    cpu = jax.devices("cpu")[0]
    impls = a.impls.split(",")
    rows, res = [], {}
    for name in a.cases.split(","):
        make, call = CASES[name]
        kw = {"s": a.prompt} if name == "prefill" else ({"cache": a.cache} if a.cache else {})
        args, work, unit = make(np.random.default_rng(0), **kw)
        args = jax.device_put(args, cpu)
        res[name] = {}
        for impl in impls:
            f = jax.jit(lambda *x, _i=impl, _c=call: _c(*x, i=_i))
            try:
                t = time_fn(f, args, repeats=a.repeats)
            except msa_ops.NativeUnavailableError as e:
                print(f"{name} {impl}: unavailable: {e}")
                continue
            res[name][impl] = t
            base = res[name].get("reference")
            rows.append(f"| {name} | {impl} | {t * 1e3:.2f} | {work / t / 1e9:.1f} {unit} | "
                        + (f"{base / t:.2f}x |" if base else "- |"))
    print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores, native tile loop: "
          f"{(msa_ops._native.info()['platforms']['cpu']['archs'] or 'none').split(';')[-1]}")
    print("| case | impl | ms / call | rate | speedup vs reference |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu_bench.json"), "w") as fh:
            json.dump({"seconds": res, "cores": os.cpu_count(), "jax": jax.__version__}, fh, indent=1)


if __name__ == "__main__":
    main()
