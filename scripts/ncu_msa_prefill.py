"""Runs each configuration of benchmarks/gpu_msa_prefill.py twice (a warm-up, then the call to read), for a
profiler, e.g. the memory traffic of the persistent prefill kernel:
    ncu -k regex:msa_prefill_ws --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum python3 scripts/ncu_msa_prefill.py
(the kernels appear in CONFIGS order, two launches each; `--configs 57344:32` runs one; on the H200 ncu took
over 6 minutes for the four, most of it at 56k / 32)."""

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_msa_prefill as P  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="", help="comma list of cache:topk (default: all of CONFIGS)")
    a = ap.parse_args()
    want = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")] if a.configs else P.CONFIGS
    rng = np.random.default_rng(0)
    for cache, topk in P.CONFIGS:  # every config draws its page order, so each keeps the benchmark's
        f, args, flops = P.ours_case(cache, topk, rng)
        if (cache, topk) not in want:
            continue
        for _ in range(2):
            jax.block_until_ready(f(*args))
        print(f"cache {cache} topk {topk}: {flops / 1e12:.3f} TFLOP a call", flush=True)
        del f, args


if __name__ == "__main__":
    main()
