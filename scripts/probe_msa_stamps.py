"""Where an MSA decode CTA's time goes, from the per-CTA phase stamps of a profiling build (msa.cu, g_msa_stamps:
thread 0 of each CTA (the loader warp's lane 0 for its last tile's copies), clock64 at ten points, the global timer at
the first and last, and its SM):

  cmake -S kernels -B /tmp/bms -G Ninja -DMSA_OPS_CUDA_ARCHS=90a -DCMAKE_BUILD_TYPE=Release -DMSA_OPS_MSA_STAMPS=ON
  cmake --build /tmp/bms && MSA_OPS_LIBRARY_DIR=/tmp/bms python3 scripts/probe_msa_stamps.py [--ghz 1.75]

The decode shape of benchmarks/gpu_msa.py (B=32, H=32, Hkv=4, D=128, pages shuffled over the pool), for each case
of --cases (cache:topk:dtype) at --partitions. Each case is timed as the benchmark times it (10 calls in one jitted
function, whose CTAs may start while the previous call ends: programmatic dependent launch), and the stamps read
afterwards are the last call's. Prints, over the CTAs, the median and 90th percentile of each phase in us (cycles
at --ghz), the per-tile streaming time, and the call's span from the global timer: when the CTAs started, left
their wait for the previous call, and ended. A reader of the same blocks (benchmarks/gpu_decode_ceiling.py) has
none of the phases before the first tile but the page-table read, and no epilogue: what of the call those phases
take is what the start and end of ours cost (NOTES_msa v44: about 5 us a call at topk 16 on an H100; v46: the
phases on an H100). At one partition it then ranks the CTAs' streaming times in four single calls, the sequences
permuted between them, and says whether the slow ones are the same work, CTAs or SMs from call to call
(who_is_slow; v47: without the permutation a CTA kept its work and its SM, and the two read alike).
"""

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from gpu_msa import decode_case, decode_ids, msa_call  # noqa: E402
from harness import bench_in_graph  # noqa: E402
from probe_ws_stamps import reset, stamps  # noqa: E402  (this script's folder is on the path)

POINTS = ["start", "waited", "owner found", "Q, slots, page table landed", "tile list built", "first tile landed",
          "last tile issued", "last tile done", "every warp at the epilogue", "output stored"]
FIRST, LAST = POINTS.index("first tile landed"), POINTS.index("last tile done")
# msa.cu's g_msa_stamps: kMsaStampCtas x kMsaStampCols (clocks, timer at start and end, SM)
MSA_STAMPS = ("msa_ops_msa_stamps", (4096, len(POINTS) + 3), "MSA_OPS_MSA_STAMPS")


def q(v, p):
    return float(np.percentile(v, p)) if len(v) else float("nan")


def run(cache, topk, dtype, npart, ghz, rng):
    kv16, kv8, lut, offs, cl, q16, q8 = decode_case(cache, rng)
    ids = decode_ids(rng, cache // 128, topk)
    qq, kv = (q16, kv16) if dtype == "bf16" else (q8, kv8)
    args = (qq, kv, ids, offs, cl, lut)
    jax.block_until_ready(jax.jit(msa_call(npart))(*args))
    reset(MSA_STAMPS)
    dt = bench_in_graph(msa_call(npart), args)
    s = stamps(MSA_STAMPS)
    live = s[:, 0] != 0
    done = live & (s[:, len(POINTS) - 1] != 0)  # CTAs that reached the end (padding rows return early)
    cyc = ghz * 1e3  # cycles per us
    tiles = topk * (2 if dtype == "bf16" else 1) / npart  # bf16 tiles are 64 keys, fp8 128: per CTA
    print(f"\n## cache {cache // 1024}k, topk {topk}, {dtype}, {npart} partition(s): {int(live.sum())} CTAs stamped, "
          f"{int(done.sum())} to the end, on {len(set(s[live, -1]))} SMs; {dt * 1e6:.1f} us a call (timed as in "
          f"gpu_msa.py); us at {ghz} GHz")
    d = s[done]
    print("| phase (from the previous point) | median | p90 |")
    print("| --- | --- | --- |")
    for j in range(1, len(POINTS)):
        v = (d[:, j] - d[:, j - 1]) / cyc
        print(f"| {POINTS[j]} | {q(v, 50):.2f} | {q(v, 90):.2f} |")
    stream = (d[:, LAST] - d[:, FIRST]) / cyc
    print(f"streaming: {q(stream, 50) / max(tiles - 1, 1):.3f} us a tile after the first ({tiles:.0f} tiles a CTA); "
          f"before the first tile {q((d[:, FIRST] - d[:, 1]) / cyc, 50):.2f} us past the wait, after the last "
          f"{q((d[:, len(POINTS) - 1] - d[:, LAST]) / cyc, 50):.2f} us")
    g0 = d[:, len(POINTS)]  # global timer at the start, ns
    waited = g0 + (d[:, 1] - d[:, 0]) / ghz  # cycles to ns at ghz
    g1 = d[:, len(POINTS) + 1]
    base = waited.min()
    print(f"timeline (us from the first CTA past its wait): starts {q((g0 - base) / 1e3, 50):.2f} median; waits "
          f"end {q((waited - base) / 1e3, 50):.2f} median, {q((waited - base) / 1e3, 100):.2f} last; ends "
          f"{q((g1 - base) / 1e3, 50):.2f} median, {q((g1 - base) / 1e3, 90):.2f} p90, {q((g1 - base) / 1e3, 100):.2f} "
          f"last (the kernel's span past the wait)")
    if npart == 1:
        who_is_slow(args, npart, ghz)


def who_is_slow(args, npart, ghz, calls=4, seed=1):
    """Whether the CTAs that stream slowest are the same work, the same CTAs or the same SMs from call to call:
    `calls` single calls (the stamps read after each), the streaming time of each CTA (first tile landed to last
    tile done) ranked within its call; the sequences are permuted between calls (their q rows, slots and
    page-table rows together, so a sequence's blocks keep their pages and heads), which moves each piece of work
    to another CTA while a CTA tends to land on the same SM. Then the correlation of those ranks across calls by
    work (the sequence and kv head), by CTA and by SM. A high correlation by work puts the spread of the CTAs' ends
    in the blocks read; by SM (and CTA) with a low one by work, in where the CTA runs."""
    qq, kv, ids, offs, cl, lut = args
    nseq = qq.shape[0]
    f = jax.jit(msa_call(npart))
    rng = np.random.default_rng(seed)
    by_work, by_cta, by_sm = [], [], []
    for c in range(calls):
        perm = np.arange(nseq) if c == 0 else rng.permutation(nseq)  # CTA row t serves sequence perm[t]
        call_args = (qq[perm], kv, ids[:, perm, :], offs, cl[perm], lut[perm])
        reset(MSA_STAMPS)
        jax.block_until_ready(f(*call_args))
        s = stamps(MSA_STAMPS)
        done = (s[:, 0] != 0) & (s[:, len(POINTS) - 1] != 0)
        t = np.where(done, (s[:, LAST] - s[:, FIRST]) / (ghz * 1e3), np.nan)
        rank = np.full(t.shape, np.nan)
        rank[done] = np.argsort(np.argsort(t[done])) / max(int(done.sum()) - 1, 1)
        by_cta.append(rank)
        # stamp row = t + nseq * hkv (one row block, one partition): its work is sequence perm[t] of head hkv
        rows = np.nonzero(done)[0]
        work = np.full(t.shape, np.nan)
        work[perm[rows % nseq] + nseq * (rows // nseq)] = rank[rows]
        by_work.append(work)
        sm = np.full(256, np.nan)
        sm[s[done, -1].astype(int) % 256] = rank[done]  # one CTA an SM at one partition
        by_sm.append(sm)

    def mean_corr(rows):
        cs = []
        for i in range(len(rows)):
            for j in range(i + 1, len(rows)):
                ok = ~np.isnan(rows[i]) & ~np.isnan(rows[j])
                if ok.sum() > 2:
                    cs.append(float(np.corrcoef(rows[i][ok], rows[j][ok])[0, 1]))
        return (float(np.mean(cs)), float(np.min(cs)), float(np.max(cs))) if cs else (float("nan"),) * 3

    w, c_, s_ = mean_corr(by_work), mean_corr(by_cta), mean_corr(by_sm)
    print(f"who is slow ({calls} single calls, sequences permuted between them, streaming time ranked in each): "
          f"rank correlation across calls by work {w[0]:.2f} ({w[1]:.2f}..{w[2]:.2f}), by CTA {c_[0]:.2f} "
          f"({c_[1]:.2f}..{c_[2]:.2f}), by SM {s_[0]:.2f} ({s_[1]:.2f}..{s_[2]:.2f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ghz", type=float, default=1.75, help="SM clock for cycles -> us")
    ap.add_argument("--cases", default="32768:16:bf16,32768:64:bf16,32768:16:fp8",
                    help="comma list of cache:topk:dtype (dtype bf16 or fp8)")
    ap.add_argument("--partitions", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for case in args.cases.split(","):
        cache, topk, dtype = case.split(":")
        run(int(cache), int(topk), dtype, args.partitions, args.ghz, rng)


if __name__ == "__main__":
    main()
