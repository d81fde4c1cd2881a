"""The H200's SM clock and power while one call runs back to back, for the MSA prefill benchmark's calls.

Each phase runs one call for --seconds (ours at a config, FlexAttention at the same config, cuDNN's dense causal
S=8192), with a second of idle between phases, while `nvidia-smi` samples the clock and the power every 50 ms.
Prints, per phase, the time per call and the mean clock and power over the phase (its first 0.5 s left out).
The H200 holds a 700 W cap by lowering its clock, so calls that draw more power run at a lower clock.
    usage (repo root, GPU machine):  python scripts/probe_power.py [--seconds 3] [--configs 57344:32,0:32]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import gpu_msa_prefill as P  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--configs", default="57344:32,0:32", help="comma list of cache:topk")
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")]
    flex = P.FlexPeer()  # before JAX takes the GPU

    import jax

    log = tempfile.NamedTemporaryFile(mode="w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=log, text=True)

    def burn(fn, args):  # calls back to back for a.seconds; seconds per call
        jax.block_until_ready(fn(*args))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            for _ in range(10):
                out = fn(*args)
            jax.block_until_ready(out)
            n += 10
        return (time.perf_counter() - t0) / n

    phases = []  # (name, start, end, seconds per call, flops a call)

    def phase(name, run, flops):
        time.sleep(1.0)
        t0 = time.time()
        t = run()
        phases.append((name, t0, time.time(), t, flops))
        print(f"{name}: {t * 1e3:.3f} ms", flush=True)

    rng = np.random.default_rng(0)
    for cache, topk in configs:
        f, args, flops = P.ours_case(cache, topk, rng)
        phase(f"ours {cache}/{topk}", lambda f=f, args=args: burn(f, args), flops)
        if flex.ok:
            def flex_run(c=cache, k=topk):
                ts, t0 = [], time.perf_counter()
                while time.perf_counter() - t0 < a.seconds:
                    ts.append(flex.time(c, k))
                return float(np.mean(ts))
            phase(f"flex {cache}/{topk}", flex_run, flops)
        del f, args
    cud, cud_args, cud_flops = P.cudnn_case()
    phase("cuDNN dense causal", lambda: burn(cud, cud_args), cud_flops)
    time.sleep(0.5)
    smi.terminate()
    smi.wait()
    flex.close()

    samples = []
    with open(log.name) as fh:
        for line in fh:
            parts = [x.strip() for x in line.split(",")]
            try:
                ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((ts, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
    os.unlink(log.name)
    s = np.array(samples) if samples else np.zeros((0, 3))
    print("\n| phase | ms a call | TFLOP/s | SM clock MHz (mean, min) | power W (mean) | samples |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, t0, t1, t, flops in phases:
        sel = s[(s[:, 0] >= t0 + 0.5) & (s[:, 0] <= t1)] if len(s) else s
        clk = f"{sel[:, 1].mean():.0f}, {sel[:, 1].min():.0f}" if len(sel) else "n/a"
        pw = f"{sel[:, 2].mean():.0f}" if len(sel) else "n/a"
        print(f"| {name} | {t * 1e3:.3f} | {flops / t / 1e12:.0f} | {clk} | {pw} | {len(sel)} |", flush=True)


if __name__ == "__main__":
    main()
