"""Runs each configuration of benchmarks/gpu_msa_prefill.py twice (a warm-up, then the call to read), for a
profiler, e.g. the memory traffic of the persistent prefill kernel:
    ncu -k regex:msa_prefill_ws --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum python3 scripts/ncu_msa_prefill.py
(the kernels appear in CONFIGS order, two launches each)."""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_msa_prefill as P  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    for cache, topk in P.CONFIGS:
        f, args, flops = P.ours_case(cache, topk, rng)
        for _ in range(2):
            jax.block_until_ready(f(*args))
        print(f"cache {cache} topk {topk}: {flops / 1e12:.3f} TFLOP a call", flush=True)
        del f, args


if __name__ == "__main__":
    main()
