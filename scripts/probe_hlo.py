"""What XLA runs for one benchmark graph: ours and the peers' decode calls, 10 to a jitted function as the benchmarks
time them (benchmarks/harness.in_graph). Prints, per graph, the kernels and custom calls of the compiled module
(fusions, custom-calls, copies) and how they sit in command buffers, so that any launch besides the attention
kernel itself shows. Compiles only (abstract arguments); nothing runs.

    python3 scripts/probe_hlo.py [--full]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from harness import in_graph  # noqa: E402

import msa_ops  # noqa: E402

BF = jnp.bfloat16


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def report(name, op, args, full):
    fn, fargs = in_graph(op, args, 10)
    abstract = tuple(sds(a.shape, a.dtype) for a in fargs)
    text = fn.lower(*abstract).compile().as_text()
    kinds = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"^\s*(?:ROOT )?%\S+ = .*?\s(fusion|custom-call|copy|copy-start|call|while|conditional)\(", line)
        if m:
            tgt = re.search(r'custom_call_target="([^"]+)"', line)
            kind = m.group(1) + (":" + tgt.group(1) if tgt else "")
            if "calls=" in line and m.group(1) == "call":
                kind += ":" + re.search(r"calls=(\S+?)[,}]", line).group(1).split(".")[0]
            kinds[kind] += 1
    print(f"== {name}: {dict(kinds)}", flush=True)
    if full:
        print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="print the whole compiled module too")
    a = ap.parse_args()
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    # Dense decode, B=64 L=4k page 128 (gpu_mha.py's decode case), ours and cuDNN.
    b, l, page, h, hkv, d = 64, 4096, 128, 32, 8, 128
    nb = b * l // page

    def ours(qr, kv, lut, offs, cl):  # as benchmarks/gpu_mha.py times it
        return msa_ops.mha_ragged_paged(qr, offs, kv, cl, lut, 0, mask_str="causal", implementation="native")

    report("dense decode 64/4k ours", ours, (sds((b, h, d), BF), sds((nb, 2, 1, page, hkv, d), BF),
                                             sds((b, l // page), jnp.int32), sds((b + 1,), jnp.int32),
                                             sds((b,), jnp.int32)), a.full)

    def cud(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    try:
        report("dense decode 64/4k cuDNN", cud, (sds((b, 1, h, d), BF), sds((b, l, hkv, d), BF),
                                                 sds((b, l, hkv, d), BF)), a.full)
    except Exception as e:  # noqa: BLE001 - no cuDNN on this machine
        print("== dense decode 64/4k cuDNN: not compiled:", str(e)[:100])
    # MSA decode, B=32 H=32 Hkv=4 cache 32k topk 16 (gpu_msa.py), bf16 and fp8.
    B, H, HKV, cache, topk = 32, 32, 4, 32768, 16
    mp = cache // 128

    def msa(q, kv, ids, offs, cl, lut):  # as benchmarks/gpu_msa.py times it
        return msa_ops.msa_attention_ragged_paged(q, offs, None, kv, cl, lut, 0, ids, implementation="native")

    for dt in (BF, jnp.float8_e4m3fn):
        report(f"MSA decode 32k/16 {jnp.dtype(dt).name}", msa,
               (sds((B, H, 128), dt), sds((B * mp, 2, 1, 128, HKV, 128), dt), sds((HKV, B, topk), jnp.int32),
                sds((B + 1,), jnp.int32), sds((B,), jnp.int32), sds((B, mp), jnp.int32)), a.full)


if __name__ == "__main__":
    main()
