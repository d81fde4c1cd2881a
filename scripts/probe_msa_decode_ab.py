"""MSA decode, bf16 and fp8 with the ladder's partitions, against cuDNN's dense decode; one line out, for A/B
runs of kernel variants (the shapes of benchmarks/gpu_msa.py: B=32, H=32, Hkv=4; cache 32k and 128k; topk 16
and 64):
  AB_DIR="ab1 ab2" AB_CMD="python3 scripts/probe_msa_decode_ab.py" bash scripts/gpu_ab.sh
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_msa import HKV, B, D, cudnn_dense_gbs, decode_case, decode_ids, msa_call  # noqa: E402
from harness import bench_in_graph  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-partitions", type=int, default=0, help="split-K partitions (0: the ladder's choice)")
    ap.add_argument("--topk", default="16,64", help="comma list of the topk points to run")
    args = ap.parse_args()
    npart = args.num_partitions
    rng = np.random.default_rng(0)
    out = []
    for cache in (32768, 131072):
        kv16, kv8, lut, offs, cl, q16, q8 = decode_case(cache, rng)
        cud = cudnn_dense_gbs(q16, cache)
        # the newest block and topk - 1 random earlier ones per (sequence, kv head)
        for topk in [int(x) for x in args.topk.split(",")]:
            ids = decode_ids(rng, cache // 128, topk)
            t16 = bench_in_graph(msa_call(npart), (q16, kv16, ids, offs, cl, lut))
            t8 = bench_in_graph(msa_call(npart), (q8, kv8, ids, offs, cl, lut))
            g16 = 2 * B * HKV * topk * 128 * D * 2 / t16 / 1e9
            out.append(f"{cache // 1024}k/k{topk}: bf16 {t16 * 1e6:.1f}us {g16 / cud:.3f}x cuDNN({cud:.0f}) "
                       f"fp8 {t8 * 1e6:.1f}us {t16 / t8:.2f}x")
    print(f"MSA np={npart or 'ladder'} " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
