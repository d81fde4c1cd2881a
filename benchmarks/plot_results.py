"""Plot benchmark JSON (from gpu_mha.py) as PNG: throughput against sequence length, ours vs the peers.

Needs matplotlib (not a dependency of the package: install it where you plot). Usage:
    python benchmarks/plot_results.py benchmarks/results/gpu_mha.json
writes benchmarks/results/h200_mha.png
"""

from __future__ import annotations

import json
import os
import sys


def main(paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for p in paths:
        with open(p) as fh:
            got = json.load(fh)
        rows += got["rows"] if isinstance(got, dict) else got
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = [r for r in rows if r["kind"] == "decode"]
    for page, style in ((128, "-o"), (16, "--o")):
        pts = sorted((r["L"], r["ours_gbs"], r["B"]) for r in dec if r["page"] == page and r.get("ours_gbs"))
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"msa_ops, page {page}")
    for peer, style, name in (("cudnn", "-s", "cudnn"), ("xla", ":^", "xla"),
                              ("pallas_paged", "-.v", "pallas paged, page 128")):
        pts = sorted((r["L"], r[f"{peer}_gbs"]) for r in dec if r["page"] == 128 and r.get(f"{peer}_gbs"))
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("cache length L (B*L = 256k; B=1 at 128k)")
    ax1.set_ylabel("GB/s of K+V")
    ax1.set_title("Decode, bf16, Hq=32, Hkv=8, D=128")
    ax1.legend()
    pre = [r for r in rows if r["kind"] == "prefill"]
    for causal in (False, True):
        tag = "causal" if causal else "full"
        for key, style, name in (("ours_contig_tflops", "-o", "msa_ops"), ("ours_paged_tflops", "--o", "msa_ops paged"),
                                 ("cudnn_tflops", "-s", "cudnn"),
                                 ("pallas_mgpu_tflops", "-.v", "pallas mosaic gpu, f16"), ("xla_tflops", ":^", "xla")):
            pts = sorted((r["S"], r[key]) for r in pre if r["causal"] == causal and r.get(key))
            if pts:
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], style, alpha=1.0 if not causal else 0.5,
                         label=f"{name} ({tag})")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("sequence length S (B*S = 16k)")
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("Prefill, bf16, H=16, D=128")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.join(os.path.dirname(paths[0]), "h200_mha.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
