"""MSA decode, bf16 and fp8 with the ladder's partitions, against cuDNN's dense decode; one line out, for A/B
runs of kernel variants (the shapes of benchmarks/gpu_msa.py: B=32, H=32, Hkv=4; cache 32k and 128k; topk 16
and 64):
  AB_DIR="ab1 ab2" AB_CMD="python3 scripts/probe_msa_decode_ab.py" bash scripts/gpu_ab.sh
With --step, also gpu_msa.py's second measure: fifty calls a run over four block selections in turn, against cuDNN's
dense decode timed fifty calls a run too.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_msa import (  # noqa: E402
    HKV,
    SELECTIONS,
    STEP_CALLS,
    B,
    D,
    cudnn_dense,
    cudnn_dense_pair,
    decode_case,
    decode_ids,
    msa_call,
)
from harness import bench_in_graph, graph_timer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-partitions", type=int, default=0, help="split-K partitions (0: the ladder's choice)")
    ap.add_argument("--topk", default="16,64", help="comma list of the topk points to run")
    ap.add_argument("--step", action="store_true", help="also fifty calls a run (gpu_msa.py's second measure)")
    ap.add_argument("--caches", default="32768,131072", help="comma list of the cache lengths to run")
    args = ap.parse_args()
    npart = args.num_partitions
    rng = np.random.default_rng(0)
    out = []
    for cache in [int(x) for x in args.caches.split(",")]:
        kv16, kv8, lut, offs, cl, q16, q8 = decode_case(cache, rng)
        if args.step:  # both of cuDNN's timers over one set of arrays
            cud_timer, cud_step_timer, cud_bytes = cudnn_dense_pair(q16, cache, iters=2, repeats=3)
            cud_step = cud_bytes / cud_step_timer() / 1e9
        else:
            cud_timer, cud_bytes = cudnn_dense(q16, cache)
        cud = cud_bytes / cud_timer() / 1e9
        # the newest block and topk - 1 random earlier ones per (sequence, kv head)
        for topk in [int(x) for x in args.topk.split(",")]:
            ids = decode_ids(rng, cache // 128, topk)
            t16 = bench_in_graph(msa_call(npart), (q16, kv16, ids, offs, cl, lut))
            t8 = bench_in_graph(msa_call(npart), (q8, kv8, ids, offs, cl, lut))
            g16 = 2 * B * HKV * topk * 128 * D * 2 / t16 / 1e9
            out.append(f"{cache // 1024}k/k{topk}: bf16 {t16 * 1e6:.1f}us {g16 / cud:.3f}x cuDNN({cud:.0f}) "
                       f"fp8 {t8 * 1e6:.1f}us {t16 / t8:.2f}x")
            if args.step:
                others = [decode_ids(rng, cache // 128, topk) for _ in range(SELECTIONS - 1)]
                s16, s8 = (graph_timer(msa_call(npart), (q, kv, ids, offs, cl, lut), n=STEP_CALLS,
                                       more=[(q, kv, o, offs, cl, lut) for o in others])()
                           for q, kv in ((q16, kv16), (q8, kv8)))
                gs = 2 * B * HKV * topk * 128 * D * 2 / s16 / 1e9
                out.append(f"step {cache // 1024}k/k{topk}: bf16 {s16 * 1e6:.2f}us {gs / cud_step:.3f}x "
                           f"cuDNN({cud_step:.0f}) fp8 {s8 * 1e6:.2f}us {s16 / s8:.3f}x")
    print(f"MSA np={npart or 'ladder'} " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
