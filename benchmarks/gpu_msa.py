"""MSA decode on the GPU: our CUDA kernel vs cuDNN dense decode at the same shape, same process.

B=32, H=32, Hkv=4, D=128, cache 32k and 128k, topk 16 and 64 selected 128-token blocks, bf16 and fp8 KV.
Bandwidth = bytes of the gathered K/V blocks / time; cuDNN's = dense K/V bytes / time. Each call is timed in runs of
ten calls to a jitted function and in runs of fifty over four block selections in turn (STEP_CALLS, below).
Indexer (decode): B=32, 128k context (1024 blocks), 4 index heads, Di=128, bf16, top-64 (1 init, 2 local);
bandwidth = index-key bytes it must read / time, against the same run's cuDNN dense decode bandwidth.
Prints markdown tables, writes gpu_msa.json / gpu_msa.md into --out.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from harness import bench, bench_in_graph, bench_rounds, graph_timer, round_ratios, write_results

import msa_ops

B, H, HKV, D = 32, 32, 4, 128
PARTITION_SWEEP = (0, 2, 4)  # 0: the ladder's choice
# The goal's measure: STEP_CALLS calls a jitted function, ours over four block selections in turn (`in_graph`'s
# `more`), and cuDNN's dense reference likewise STEP_CALLS a run (fewer runs: its calls take 0.7-2.7 ms). Each run
# of a jitted function leaves a gap on the device that its calls share (NOTES_msa v55: 16-32 us on H100s): ten calls
# of ~50 us read ~5% slow from it, cuDNN's dense calls 0.1-0.4%.
STEP_CALLS = 50
SELECTIONS = 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the bf16 / fp8 / cuDNN comparison")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for cache in (32768, 131072):
        mp = cache // 128
        kv16, kv8, lut, offs, cl, q16, q8 = decode_case(cache, rng)
        cud_timer, cud_step_timer, cud_bytes = cudnn_dense_pair(q16, cache, iters=2, repeats=3)
        for topk in (16, 64):
            ids = decode_ids(rng, mp, topk)
            r = {"cache": cache, "topk": topk, "rounds": a.rounds}
            plan = msa_ops.plan("mo.msa.attention.ragged.paged", q16, offs, offs, kv16, cl, lut, 0, ids)
            r["partitions"] = plan.num_partitions
            r["partitions_fp8"] = msa_ops.plan("mo.msa.attention.ragged.paged", q8, offs, offs, kv8, cl, lut, 0,
                                               ids).num_partitions
            nbytes = {"bf16": 2 * B * HKV * topk * 128 * D * 2, "fp8": 2 * B * HKV * topk * 128 * D}
            # The ladder's bf16 and fp8 calls and cuDNN's dense decode, once a round in rotating order (bench_rounds).
            # cuDNN's dense decode over as many keys as the call gathers (topk x 128 a sequence): the same bytes in
            # one call, so that its fixed cost weighs as much as ours does (a reference, not the measure).
            same_timer, same_step_timer, same_bytes = cudnn_dense_pair(q16, topk * 128)
            assert same_bytes == nbytes["bf16"]
            timers = {"cudnn": cud_timer, "bf16": graph_timer(msa_call(0), (q16, kv16, ids, offs, cl, lut)),
                      "fp8": graph_timer(msa_call(0), (q8, kv8, ids, offs, cl, lut)), "cudnn_same": same_timer}
            timers["cudnn_same_step"] = same_step_timer
            timers["cudnn_step"] = cud_step_timer
            others = [decode_ids(rng, mp, topk) for _ in range(SELECTIONS - 1)]
            for name, q, kv in (("bf16", q16, kv16), ("fp8", q8, kv8)):
                timers[name + "_step"] = graph_timer(msa_call(0), (q, kv, ids, offs, cl, lut), n=STEP_CALLS,
                                                     more=[(q, kv, o, offs, cl, lut) for o in others])
            got = {k: np.array(v) for k, v in bench_rounds(timers, a.rounds).items()}
            for name in ("bf16", "fp8", "bf16_step", "fp8_step"):
                t = float(np.median(got[name]))
                r[name + "_us"] = t * 1e6
                r[name + "_gbs"] = nbytes[name.split("_")[0]] / t / 1e9
                r[name + "_us_rounds"] = [x * 1e6 for x in got[name]]
            r["step_calls"], r["step_selections"] = STEP_CALLS, SELECTIONS
            r["cudnn_dense_gbs"] = cud_bytes / float(np.median(got["cudnn"])) / 1e9
            r["cudnn_dense_step_gbs"] = cud_bytes / float(np.median(got["cudnn_step"])) / 1e9
            r["cudnn_same_bytes_us"] = float(np.median(got["cudnn_same"])) * 1e6
            r["cudnn_same_bytes_gbs"] = same_bytes / float(np.median(got["cudnn_same"])) / 1e9
            r["bf16_vs_cudnn_same_bytes"], r["bf16_vs_cudnn_same_bytes_range"] = round_ratios(got["cudnn_same"],
                                                                                              got["bf16"])
            r["cudnn_same_bytes_step_us"] = float(np.median(got["cudnn_same_step"])) * 1e6
            r["bf16_step_vs_cudnn_same_bytes_step"] = round_ratios(got["cudnn_same_step"], got["bf16_step"])[0]
            # bf16 GB/s over cuDNN's GB/s in each round: (nbytes / t_bf16) / (cud_bytes / t_cudnn)
            r["bf16_vs_cudnn"], r["bf16_vs_cudnn_range"] = round_ratios(got["cudnn"], got["bf16"],
                                                                        nbytes["bf16"] / cud_bytes)
            r["fp8_speedup"], r["fp8_speedup_range"] = round_ratios(got["bf16"], got["fp8"])
            r["bf16_step_vs_cudnn"], r["bf16_step_vs_cudnn_range"] = round_ratios(got["cudnn_step"], got["bf16_step"],
                                                                                  nbytes["bf16"] / cud_bytes)
            r["fp8_step_speedup"], r["fp8_step_speedup_range"] = round_ratios(got["bf16_step"], got["fp8_step"])
            for name, q, kv in (("bf16", q16, kv16), ("fp8", q8, kv8)):
                for npart in PARTITION_SWEEP[1:]:
                    t = bench_in_graph(msa_call(npart), (q, kv, ids, offs, cl, lut))
                    r[f"{name}_p{npart}_us"] = t * 1e6
                    r[f"{name}_p{npart}_gbs"] = nbytes[name] / t / 1e9
                if cache == 131072 and topk == 64:  # the kv heads of a sequence select the same blocks
                    t = bench_in_graph(msa_call(0), (q, kv, jnp.broadcast_to(ids[:1], ids.shape), offs, cl, lut))
                    r[name + "_shared_ids_gbs"] = nbytes[name] / t / 1e9
            rows.append(r)
            print(json.dumps(r), flush=True)
        del kv16, kv8, cud_timer, cud_step_timer, timers, same_timer, same_step_timer
    cud_128k = next(r["cudnn_dense_gbs"] for r in rows if r["cache"] == 131072)
    ix = run_indexer(rng, cud_128k)
    md = [f"# MSA decode on {jax.devices()[0].device_kind} (jax {jax.__version__})", "",
          "B=32, H=32, Hkv=4, D=128; GB/s over the gathered K/V blocks; cuDNN: dense decode, same shape, same run; "
          "each timed as 10 calls in one jitted function (bench_in_graph); bf16, fp8 and cuDNN once a round, "
          f"{a.rounds} rounds in rotating order: times are medians, ratios the median of the rounds' ratios (range in "
          "brackets)", "",
          "| cache | topk | partitions (bf16 / fp8) | bf16 us | bf16 GB/s | fp8 us | fp8 GB/s | cuDNN dense GB/s "
          "| bf16 / cuDNN | fp8 speedup |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['topk']} | {r['partitions']} / {r['partitions_fp8']} | "
                  f"{r['bf16_us']:.1f} | {r['bf16_gbs']:.0f} | "
                  f"{r['fp8_us']:.1f} | {r['fp8_gbs']:.0f} | {r['cudnn_dense_gbs']:.0f} | {r['bf16_vs_cudnn']:.2f}x "
                  f"({r['bf16_vs_cudnn_range'][0]:.2f}-{r['bf16_vs_cudnn_range'][1]:.2f}) | {r['fp8_speedup']:.2f}x "
                  f"({r['fp8_speedup_range'][0]:.2f}-{r['fp8_speedup_range'][1]:.2f}) |")

    md += ["", f"The same calls, {STEP_CALLS} a jitted function over {SELECTIONS} block selections in turn, and "
           f"cuDNN's dense decode {STEP_CALLS} a run too (the goal's measure: a run of a jitted function costs a gap "
           "on the device that its calls share, ~5% of a 50 us call among ten and 0.1-0.4% of cuDNN's dense "
           "calls; no call re-reads the blocks of the call before it)", "",
           "| cache | topk | bf16 us | bf16 GB/s | fp8 us | fp8 GB/s | cuDNN dense GB/s | bf16 / cuDNN | fp8 speedup |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['topk']} | {r['bf16_step_us']:.1f} | {r['bf16_step_gbs']:.0f} | "
                  f"{r['fp8_step_us']:.1f} | {r['fp8_step_gbs']:.0f} | {r['cudnn_dense_step_gbs']:.0f} | "
                  f"{r['bf16_step_vs_cudnn']:.3f}x ({r['bf16_step_vs_cudnn_range'][0]:.3f}-"
                  f"{r['bf16_step_vs_cudnn_range'][1]:.3f}) | {r['fp8_step_speedup']:.3f}x "
                  f"({r['fp8_step_speedup_range'][0]:.3f}-{r['fp8_step_speedup_range'][1]:.3f}) |")

    md += ["", "cuDNN's dense decode over as many keys as the call gathers (B=32, Hkv=4, topk x 128 keys a sequence: "
           "the same bytes in one call, timed in the same rounds); a reference for the fixed cost of a call of that "
           "size, not the measure of the goal above", "",
           "| cache | topk | cuDNN same bytes us | cuDNN same bytes GB/s | bf16 us | bf16 / cuDNN same bytes "
           f"| the same, {STEP_CALLS} calls a run: cuDNN us | bf16 us | bf16 / cuDNN |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['topk']} | {r['cudnn_same_bytes_us']:.1f} | {r['cudnn_same_bytes_gbs']:.0f} | "
                  f"{r['bf16_us']:.1f} | {r['bf16_vs_cudnn_same_bytes']:.2f}x "
                  f"({r['bf16_vs_cudnn_same_bytes_range'][0]:.2f}-{r['bf16_vs_cudnn_same_bytes_range'][1]:.2f}) | "
                  f"{r['cudnn_same_bytes_step_us']:.1f} | {r['bf16_step_us']:.1f} | "
                  f"{r['bf16_step_vs_cudnn_same_bytes_step']:.2f}x |")

    def gbs(r, key):  # the shared-ids case runs at one point only
        return f"{r[key]:.0f}" if key in r else "n/a"

    md += ["", "Partition sweep (GB/s; p0 = the ladder's choice above); shared ids: every kv head of a sequence "
           "selects the same blocks (their rows share DRAM pages)", "",
           "| cache | topk | bf16 p2 | bf16 p4 | fp8 p2 | fp8 p4 | bf16 shared ids | fp8 shared ids |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['cache']} | {r['topk']} | {r['bf16_p2_gbs']:.0f} | {r['bf16_p4_gbs']:.0f} | "
                  f"{r['fp8_p2_gbs']:.0f} | {r['fp8_p4_gbs']:.0f} | {gbs(r, 'bf16_shared_ids_gbs')} | "
                  f"{gbs(r, 'fp8_shared_ids_gbs')} |")
    md += ["", "## Indexer, decode: B=32, 128k context (1024 blocks), Hi=4, Di=128, bf16, topk 64", "",
           "| ours us | ours GB/s | XLA reference us | cuDNN dense GB/s | ours / cuDNN | ids equal to the reference |",
           "| --- | --- | --- | --- | --- | --- |",
           f"| {ix['ours_us']:.1f} | {ix['ours_gbs']:.0f} | {ix['reference_us']:.1f} | {ix['cudnn_dense_gbs']:.0f} | "
           f"{ix['ours_vs_cudnn']:.2f}x | {ix['ids_equal_fraction']:.4f} |"]
    write_results(a.out, "gpu_msa", rows + [ix], "\n".join(md))


def decode_case(cache, rng):
    """A decode step's inputs: B sequences with `cache` keys each (the new token's included), pages shuffled
    across the pool; K/V and q in bf16 and the same values in e4m3."""
    mp = cache // 128
    nb = B * mp
    kv16 = jax.random.normal(jax.random.PRNGKey(cache), (nb, 2, 1, 128, HKV, D), jnp.bfloat16)
    kv8 = kv16.astype(jnp.float8_e4m3fn)
    lut = jnp.asarray(rng.permutation(nb).reshape(B, mp), jnp.int32)
    offs = jnp.arange(B + 1, dtype=jnp.int32)
    cl = jnp.full((B,), cache - 1, jnp.int32)
    q16 = jax.random.normal(jax.random.PRNGKey(1), (B, H, D), jnp.bfloat16)
    return kv16, kv8, lut, offs, cl, q16, q16.astype(jnp.float8_e4m3fn)


def cudnn_case(q16, cache):
    """cuDNN's dense decode at the same shape (contiguous K/V): (the call, its arguments, bytes of K+V a call)."""
    k = jax.random.normal(jax.random.PRNGKey(2), (B, cache, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), (B, cache, HKV, D), jnp.bfloat16)

    def cud(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    return cud, (q16.reshape(B, 1, H, D), k, v), 2 * B * cache * HKV * D * 2


def cudnn_dense(q16, cache, n=10):
    """cuDNN's dense decode at the same shape: (a graph_timer of n calls a run, bytes of K+V a call)."""
    cud, args, nbytes = cudnn_case(q16, cache)
    return graph_timer(cud, args, n=n), nbytes


def cudnn_dense_pair(q16, cache, **step_kw):
    """cuDNN's dense decode at the same shape over one set of arrays: (a graph_timer of ten calls a run, one of
    STEP_CALLS calls a run (`step_kw` to its `bench`: fewer runs for long calls), bytes of K+V a call)."""
    cud, args, nbytes = cudnn_case(q16, cache)
    return graph_timer(cud, args), graph_timer(cud, args, n=STEP_CALLS, **step_kw), nbytes


def draw_ids(rng, mp, topk, b=B, hkv=HKV):
    """Per (sequence, kv head): the newest block and topk - 1 random earlier ones, int32 [b, hkv, topk] (numpy)."""
    ids = np.stack([np.sort(rng.choice(mp - 1, topk - 1, replace=False)) for _ in range(b * hkv)])
    ids = np.concatenate([ids, np.full((b * hkv, 1), mp - 1)], 1)  # the local block
    return ids.reshape(b, hkv, topk).astype(np.int32)


def decode_ids(rng, mp, topk):
    """draw_ids in the op's layout, [Hkv, B, topk]."""
    return jnp.asarray(draw_ids(rng, mp, topk).transpose(1, 0, 2), jnp.int32)


def msa_call(npart):
    """One MSA call as timed: the row offsets, cache lengths and page table enter as arguments, as in a decode step
    (closed over, XLA turned them into constants rebuilt by small kernels at each run of the timed graph)."""
    def f(q, kv, ids, offs, cl, lut):
        return msa_ops.msa_attention_ragged_paged(q, offs, None, kv, cl, lut, 0, ids, num_partitions=npart,
                                                  implementation="native")
    return f


def run_indexer(rng, cud_gbs, cache=131072, hi=4, di=128, topk=64):
    mp = cache // 128
    nb = B * mp
    kb = jax.random.normal(jax.random.PRNGKey(7), (nb, 1, 1, 128, 1, di), jnp.bfloat16)
    lut = jnp.asarray(rng.permutation(nb).reshape(B, mp), jnp.int32)
    offs = jnp.arange(B + 1, dtype=jnp.int32)
    cl = jnp.full((B,), cache - 1, jnp.int32)  # + 1 new token: 128k keys, every block eligible
    q = jax.random.normal(jax.random.PRNGKey(8), (B, hi, di), jnp.bfloat16)
    kw = dict(topk=topk, init_blocks=1, local_blocks=2)
    def ours(q, kb):
        return msa_ops.msa_indexer_ragged_paged(q, offs, kb, cl, lut, 0, implementation="native", **kw)
    ref = jax.jit(lambda q, kb: msa_ops.msa_indexer_ragged_paged(q, offs, kb, cl, lut, 0,
                                                                 implementation="reference", **kw))
    t = bench_in_graph(ours, (q, kb))
    t_ref = bench(ref, (q, kb), iters=3, repeats=3)
    same = float(np.mean(np.all(np.asarray(jax.jit(ours)(q, kb)) == np.asarray(ref(q, kb)), axis=-1)))
    r = {"kind": "indexer", "cache": cache, "topk": topk, "ours_us": t * 1e6, "reference_us": t_ref * 1e6,
         "ours_gbs": B * cache * di * 2 / t / 1e9, "cudnn_dense_gbs": cud_gbs, "ids_equal_fraction": same}
    r["ours_vs_cudnn"] = r["ours_gbs"] / cud_gbs
    print(json.dumps(r), flush=True)
    return r


if __name__ == "__main__":
    main()
