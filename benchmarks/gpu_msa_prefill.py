"""MSA prefill on the GPU: our CUDA kernel vs cuDNN dense causal and torch FlexAttention, same run.

bf16, B=2, S=8192 new tokens per sequence, H=16, Hkv=2, D=128, with a cache of 0 and of 57344 (56k) tokens.
Selection: each 128-token query block keeps `topk` blocks, its own (diagonal) block and topk-1 distinct earlier
ones drawn at random (all earlier ones when fewer exist); every token of the block and every kv head share it.
FlexAttention gets the same block mask (BlockMask.from_kv_blocks: the earlier blocks full, the diagonal block
causal), with GQA. TFLOP/s = 4 * D * H * (visited keys summed over tokens) / time, where a token visits the
keys of its selected blocks at or before its position. cuDNN's is dense causal at S=8192 (no cache), same
B, H, Hkv, D, the issue's peer figure. The per-token kernel (MSA_OPS_CUDA_WGMMA=0) is timed for comparison.
Ours, Flex (a child process kept alive) and cuDNN are timed once a round over --rounds rounds in rotating order;
medians are reported. Prints a markdown table and writes gpu_msa_prefill.json / .md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

B, S, H, HKV, D, BLK = 2, 8192, 16, 2, 128, 128
CONFIGS = [(0, 16), (0, 32), (57344, 16), (57344, 32)]  # (cache, topk)


def selection(cache: int, topk: int) -> np.ndarray:
    """[B, query blocks of the new tokens, topk] absolute block ids, sorted; -1 padded (same in both processes)."""
    rng = np.random.default_rng(cache * 1000 + topk)
    nqb = S // BLK
    sel = np.full((B, nqb, topk), -1, np.int64)
    for b in range(B):
        for i in range(nqb):
            qb = cache // BLK + i
            earlier = rng.permutation(qb)[: topk - 1]
            ids = np.sort(np.concatenate([earlier, [qb]]))
            sel[b, i, : len(ids)] = ids
    return sel


def visited_keys(cache: int, sel: np.ndarray) -> int:
    total = 0
    for b in range(B):
        for i in range(S // BLK):
            ids = sel[b, i][sel[b, i] >= 0]
            qb = cache // BLK + i
            total += BLK * BLK * int(np.sum(ids < qb))  # earlier blocks: every key, every token
            total += BLK * (BLK + 1) // 2  # the diagonal block, causal
    return total


def _ms(times) -> str:
    return ", ".join(f"{x * 1e3:.3f}" for x in times)


def flex_worker() -> None:
    """Serves FlexAttention timings: compiles every config, prints "ready", then answers each stdin line
    "cache topk" with one JSON line (seconds per call). It stays alive so that the parent can time Flex between
    its own timings, in the same stretch of the GPU's clocks and temperature."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    dev = "cuda"
    runs = {}
    for cache, topk in CONFIGS:
        sel = torch.as_tensor(selection(cache, topk), device=dev)
        nqb, nkb = S // BLK, (cache + S) // BLK
        diag = (cache // BLK + torch.arange(nqb, device=dev)).view(1, nqb, 1)
        full = torch.where((sel >= 0) & (sel != diag), sel, nkb)  # earlier blocks; the rest pushed past the end
        full_idx = torch.sort(full, dim=-1).values
        full_num = ((sel >= 0) & (sel != diag)).sum(-1)
        pad = torch.zeros(B, nqb, nkb - topk, dtype=torch.int64, device=dev)
        full_idx = torch.cat([full_idx.clamp(max=nkb - 1), pad], -1)
        part_idx = torch.cat([diag.expand(B, nqb, 1), torch.zeros(B, nqb, nkb - 1, dtype=torch.int64, device=dev)], -1)
        part_num = torch.ones(B, nqb, dtype=torch.int64, device=dev)

        def causal(b, h, q_idx, kv_idx, _c=cache):
            return kv_idx <= q_idx + _c

        kw = {}
        if "seq_lengths" in BlockMask.from_kv_blocks.__code__.co_varnames:
            kw["seq_lengths"] = (S, cache + S)
        bm = BlockMask.from_kv_blocks(
            part_num[:, None].int(), part_idx[:, None].int(), full_num[:, None].int(), full_idx[:, None].int(),
            BLOCK_SIZE=BLK, mask_mod=causal, **kw)
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, HKV, cache + S, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, HKV, cache + S, D, device=dev, dtype=torch.bfloat16, generator=g)

        def run(q=q, k=k, v=v, bm=bm):
            return flex(q, k, v, block_mask=bm, enable_gqa=True)

        run()  # compiles
        runs[(cache, topk)] = run
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        cache, topk = map(int, line.split())
        run = runs[(cache, topk)]
        run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                run()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 20 / 1e3)
        print(json.dumps({"cache": cache, "topk": topk, "flex_s": float(np.median(ts))}), flush=True)


class FlexPeer:
    """FlexAttention in a child process that stays alive (torch and JAX each keep their own GPU memory pool).
    Started before JAX takes the GPU; `time(cache, topk)` returns seconds per call, or None once it has failed."""

    def __init__(self, timeout: float = 600.0):
        import tempfile

        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, __file__, "--flex-worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.ok = self._line(timeout) == "ready"
        if not self.ok:
            self._fail("did not start")

    def _line(self, timeout: float):
        import select

        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        return self.p.stdout.readline().strip() if r else None

    def _fail(self, why: str) -> None:
        self.ok = False
        self.p.kill()
        self.err.seek(0)
        print(f"FlexAttention: {why}\n{self.err.read()[-3000:]}", flush=True)

    def time(self, cache: int, topk: int):
        if not self.ok:
            return None
        try:
            self.p.stdin.write(f"{cache} {topk}\n")
            self.p.stdin.flush()
            line = self._line(120.0)
            return float(json.loads(line)["flex_s"])
        except Exception as e:  # noqa: BLE001 - the peer is optional
            self._fail(f"failed ({e})")
            return None

    def close(self) -> None:
        if not self.ok:
            return
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a child that does not leave is killed; the results stand
            self.p.kill()


def cudnn_case():
    """cuDNN's dense causal call, the issue's peer figure: (jitted fn, (q, k, v), FLOPs)."""
    import jax
    import jax.numpy as jnp

    q = jax.random.normal(jax.random.PRNGKey(1), (B, S, H, D), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(2), (B, S, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), (B, S, HKV, D), jnp.bfloat16)
    cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    return cud, (q, k, v), 4 * B * S * S * H * D / 2


def ours_case(cache: int, topk: int, rng):
    """Our call at one config: (jitted fn, (q, kv, ids), FLOPs over the visited keys). rng draws the page order."""
    import jax
    import jax.numpy as jnp

    import msa_ops

    mp = (cache + S) // BLK
    nb = B * mp
    kv = jax.random.normal(jax.random.PRNGKey(cache + topk), (nb, 2, 1, BLK, HKV, D), jnp.bfloat16)
    lut = jnp.asarray(rng.permutation(nb).reshape(B, mp), jnp.int32)
    offs = jnp.asarray(np.arange(B + 1) * S, jnp.int32)
    cl = jnp.full((B,), cache, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(5), (B * S, H, D), jnp.bfloat16)
    sel = selection(cache, topk)  # [B, nqb, topk]
    ids = np.repeat(sel, BLK, axis=1).reshape(B * S, topk)  # each token: its query block's selection
    ids = jnp.asarray(np.broadcast_to(ids[None], (HKV, B * S, topk)), jnp.int32)
    f = jax.jit(lambda q, kv, ids, offs=offs, cl=cl, lut=lut: msa_ops.msa_attention_ragged_paged(
        q, offs, None, kv, cl, lut, 0, ids, implementation="native"))
    return f, (q, kv, ids), 4 * D * H * visited_keys(cache, sel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--flex-worker", action="store_true")
    ap.add_argument("--quick", action="store_true", help="our kernel and cuDNN only (no Flex, no per-token kernel)")
    ap.add_argument("--ab-env", default="", help="NAME=VALUE: also time ours with this variable set (read at each "
                    "launch), in pairs of alternating order in this process; prints the median ratio of the pairs")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the comparison: each times ours, Flex and cuDNN "
                    "(or, with --ab-env, one pair)")
    a = ap.parse_args()
    if a.flex_worker:
        flex_worker()
        return
    flex = None if a.quick else FlexPeer()  # before JAX takes the GPU

    import jax
    from harness import bench, bench_rounds, round_ratios, write_results

    # cuDNN dense causal, S=8192, no cache; timed again in every round.
    cud, (kq, kk, kvv), cud_flops = cudnn_case()
    t_cud = bench(cud, (kq, kk, kvv))
    print(f"cuDNN dense causal S={S}: {t_cud * 1e3:.3f} ms, {cud_flops / t_cud / 1e12:.0f} TFLOP/s (first timing)",
          flush=True)

    rows = []
    rng = np.random.default_rng(0)
    for cache, topk in CONFIGS:
        f, (q, kv, ids), flops = ours_case(cache, topk, rng)
        os.environ["MSA_OPS_CUDA_WGMMA"] = "1"
        t_first = bench(f, (q, kv, ids))
        if a.ab_env:
            # Pairs after the first timing, in alternating order (default first in even rounds, the variable first
            # in odd ones): a process's first timing of a call has read up to 8% faster than its later ones on the
            # H200 (NOTES_msa.md v25), so it is left out of the comparison and each side goes first equally often.
            name, val = a.ab_env.split("=", 1)
            ts, tv = [], []
            for r in range(a.rounds):
                for with_var in ((False, True) if r % 2 == 0 else (True, False)):
                    if with_var:
                        os.environ[name] = val
                    tt = bench(f, (q, kv, ids))
                    os.environ.pop(name, None)
                    (tv if with_var else ts).append(tt)
            ratios = [v / d for d, v in zip(ts, tv)]
            print(f"cache {cache} topk {topk}: first {t_first * 1e3:.3f} ms; default ({_ms(ts)}), {a.ab_env} "
                  f"({_ms(tv)}) ms; {a.ab_env} / default time, median of {len(ratios)} pairs "
                  f"{float(np.median(ratios)):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
            continue
        # Rounds: ours, Flex and cuDNN each timed once a round, the order rotated from round to round, so that every
        # figure comes from the same stretch of the GPU's clocks and temperature (a process's first timing of a call
        # has read 5-8% faster than its later ones: NOTES_msa.md v25). Medians over the rounds; each ratio is the
        # median of the rounds' ratios.
        timers = {"ours": lambda a_=(f, (q, kv, ids)): bench(*a_), "cudnn": lambda: bench(cud, (kq, kk, kvv))}
        if flex is not None and flex.ok:
            timers["flex"] = lambda c=cache, k=topk: flex.time(c, k)
        got = bench_rounds(timers, a.rounds)
        if "flex" in got and any(x is None for x in got["flex"]):
            del got["flex"]
        t_tok = float("nan")
        if not a.quick:
            os.environ["MSA_OPS_CUDA_WGMMA"] = "0"
            t_tok = bench(f, (q, kv, ids), iters=5, repeats=3)
            os.environ["MSA_OPS_CUDA_WGMMA"] = "1"
        to, tc = np.array(got["ours"]), np.array(got["cudnn"])
        t = float(np.median(to))
        r = {"cache": cache, "topk": topk, "rounds": a.rounds, "ours_ms": t * 1e3, "ours_first_ms": t_first * 1e3,
             "ours_ms_rounds": [x * 1e3 for x in got["ours"]], "ours_tflops": flops / t / 1e12,
             "per_token_tflops": flops / t_tok / 1e12,
             "cudnn_dense_causal_tflops": cud_flops / float(np.median(tc)) / 1e12,
             "ours_vs_cudnn": round_ratios(tc, to, flops / cud_flops)[0]}
        if "flex" in got:
            tf = np.array(got["flex"])
            vs_flex, vs_flex_range = round_ratios(tf, to)
            r.update({"flex_ms": float(np.median(tf)) * 1e3, "flex_ms_rounds": [x * 1e3 for x in got["flex"]],
                      "flex_tflops": flops / float(np.median(tf)) / 1e12, "ours_vs_flex": vs_flex,
                      "ours_vs_flex_range": vs_flex_range})
        rows.append(r)
        print(json.dumps(r), flush=True)
        del kv, timers
    if flex is not None:
        flex.close()
    if a.ab_env:
        return
    md = [f"# MSA prefill on {jax.devices()[0].device_kind} (jax {jax.__version__})", "",
          f"bf16, B={B}, S={S}, H={H}, Hkv={HKV}, D={D}; TFLOP/s over visited (selected, causal) keys; "
          f"cuDNN: dense causal at S={S}. Ours, Flex and cuDNN timed once a round, {a.rounds} rounds in rotating "
          "order in one run; times and TFLOP/s are medians over the rounds, ratios the median of the rounds' ratios "
          "(Flex: with their range)", "",
          "| cache | topk | ours ms | ours TFLOP/s | per-token kernel | Flex ms | Flex TFLOP/s | cuDNN dense causal "
          "| ours / cuDNN | ours / Flex |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fl = (f"{r['flex_ms']:.3f} | {r['flex_tflops']:.0f}",
              f"{r['ours_vs_flex']:.2f}x ({r['ours_vs_flex_range'][0]:.2f}-{r['ours_vs_flex_range'][1]:.2f})") \
            if "flex_ms" in r else ("n/a | n/a", "n/a")
        md.append(f"| {r['cache']} | {r['topk']} | {r['ours_ms']:.3f} | {r['ours_tflops']:.0f} | "
                  f"{r['per_token_tflops']:.0f} | {fl[0]} | {r['cudnn_dense_causal_tflops']:.0f} | "
                  f"{r['ours_vs_cudnn']:.2f}x | {fl[1]} |")
    write_results(a.out, "gpu_msa_prefill", rows, "\n".join(md))


if __name__ == "__main__":
    main()
