"""Dense MHA on the GPU: our CUDA kernels vs cuDNN (jax.nn.dot_product_attention), XLA and JAX's Pallas attention
kernels (pallas_peers.py: Mosaic GPU and Triton prefill, Triton paged and contiguous decode), same process.

Decode (BENCH.md): bf16, Hq=32, Hkv=8, D=128, paged (page 128 and 16) for ours, contiguous for the peers;
GB/s = bytes of K and V read once / time. Prefill: bf16, D=128, H=16, B*S=16384, causal and not; TFLOP/s =
4*B*S^2*H*D (half for causal) / time. Prefill of many short sequences: the same at B*S=65536 with S=32, 64 and
256 (B=2048, 1024 and 256), causal, where finding each tile's sequence among B is part of the cost. Head dims 256
and 64: prefill at S=8k, H=2048/D (and decode at 256). Prints markdown tables, writes gpu_mha.json (the run and its
rows) and gpu_mha.md into --out; --merge puts the rows of runs of different parts into one pair of files.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pallas_peers
from harness import bench, bench_in_graph, bench_rounds, graph_timer, round_ratios, write_results

import msa_ops

BF = jnp.bfloat16


def rel_err(a, b):
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


ROUNDS = 5  # --rounds: rounds of the decode comparison (ours, cuDNN)
IDENTITY_PAGES = False  # --identity-pages: pages in key order (a diagnostic of the page-scatter cost)
# Diagnostics of the page-scatter cost (scripts/probe_decode_ab.py --page-order), over the key-order layout in which
# page j of sequence b is pool page b * MP + j: "local:N" shuffles the pool pages within each run of N of them (a
# sequence's pages stay in the same N-page region, out of order); "runs:N" keeps each run of N in key order and
# shuffles where the runs lie. Empty: the benchmark's layout (IDENTITY_PAGES, else a permutation of the whole pool).
PAGE_ORDER = ""


def page_perm(nb, rng):
    """The pool page of each (sequence, page) slot in key order, as PAGE_ORDER / IDENTITY_PAGES say."""
    if not PAGE_ORDER:
        return np.arange(nb) if IDENTITY_PAGES else rng.permutation(nb)
    mode, n = PAGE_ORDER.split(":")
    n = int(n)
    runs = [np.arange(s, min(s + n, nb)) for s in range(0, nb, n)]
    if mode == "local":
        return np.concatenate([rng.permutation(r) for r in runs])
    if mode == "runs":
        return np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    raise ValueError(f"page order {PAGE_ORDER!r}: local:N or runs:N")


def paged_from_contiguous(k, v, page, rng):
    """k, v [B, L, Hkv, D] -> kv_blocks [NB, 2, 1, page, Hkv, D] with shuffled pages, lut [B, MP]."""
    b, l, hkv, d = k.shape
    mp = -(-l // page)
    nb = b * mp
    perm = jnp.asarray(page_perm(nb, rng), jnp.int32)
    pad = mp * page - l
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * mp, page, hkv, d)
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b * mp, page, hkv, d)
    kv = jnp.zeros((nb, 2, 1, page, hkv, d), k.dtype)
    kv = kv.at[perm, 0, 0].set(kp).at[perm, 1, 0].set(vp)
    lut = perm.reshape(b, mp)
    return kv, lut


def decode_case(b, l, page, rng, h=32, hkv=8, d=128):
    key = jax.random.PRNGKey(b * 1000 + l)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (b, 1, h, d), BF)
    k = jax.random.normal(k2, (b, l, hkv, d), BF)
    v = jax.random.normal(k3, (b, l, hkv, d), BF)
    kv, lut = paged_from_contiguous(k, v, page, rng)
    del k1, k2, k3
    return q, k, v, kv, lut


def step_args(q, l):
    """For decode_case's q over l keys: our call's query rows, row offsets (one token a sequence) and cache lengths
    (the new token already in the cache: l keys)."""
    b, _, h, d = q.shape
    return q.reshape(b, h, d), jnp.arange(b + 1, dtype=jnp.int32), jnp.full((b,), l - 1, jnp.int32)


def mha_call(npart=0):
    """Our dense decode call as timed. The row offsets and cache lengths enter as arguments, as in a decode step
    (closed over, XLA turned them into constants rebuilt by small kernels at each run of the timed graph); npart
    forces the split-K partitions (0: the ladder's)."""
    def f(qr, kv, lut, offs, cl):
        return msa_ops.mha_ragged_paged(qr, offs, kv, cl, lut, 0, mask_str="causal", num_partitions=npart,
                                        implementation="native")
    return f


def run_decode(rows, results, rng):
    for (b, l) in [(64, 4096), (16, 16384), (4, 65536), (1, 131072)]:
        for page in (128, 16):
            q, k, v, kv, lut = decode_case(b, l, page, rng)
            qr, offs, cl = step_args(q, l)
            ours = mha_call()
            plan_np = msa_ops.plan("mo.mha.ragged.paged", qr, offs, kv, cl, lut, 0, mask_str="causal").num_partitions
            alt_np = min(32, 2 * plan_np)
            ours_alt = mha_call(alt_np)

            def cud(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

            def xla(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, implementation="xla")
            byts = 2 * b * l * 8 * 128 * 2
            r = {"kind": "decode", "B": b, "L": l, "page": page}
            o_ours = jax.jit(ours)(qr, kv, lut, offs, cl)
            o_cud = jax.jit(cud)(q, k, v)
            r["err_vs_cudnn"] = rel_err(o_ours, o_cud.reshape(b, 32, 128))
            r["plan"] = plan_np
            r["alt_np"] = alt_np
            # Ours and cuDNN once a round, in rotating order, ROUNDS rounds (harness.bench_rounds): the ratio is the
            # median of the rounds' ratios. The second partition count and XLA are timed once, after them.
            timers = {"ours": graph_timer(ours, (qr, kv, lut, offs, cl)), "cudnn": graph_timer(cud, (q, k, v))}
            got = bench_rounds(timers, ROUNDS)
            for name in ("ours", "cudnn"):
                r[name + "_gbs"] = byts / float(np.median(got[name])) / 1e9
            r["ours_vs_cudnn"], r["ours_vs_cudnn_range"] = round_ratios(got["cudnn"], got["ours"])
            del timers
            for name, fn, args in (("ours_alt", ours_alt, (qr, kv, lut, offs, cl)), ("xla", xla, (q, k, v))):
                if name == "xla" and page != 128:
                    r[name + "_gbs"] = results.get(("decode", b, l, name))
                    continue
                try:
                    t = bench_in_graph(fn, args)
                    r[name + "_gbs"] = byts / t / 1e9
                    results[("decode", b, l, name)] = r[name + "_gbs"]
                except Exception as e:  # noqa: BLE001 - a peer may not run at a shape; report, go on
                    r[name + "_gbs"] = None
                    r[name + "_error"] = str(e)[:200]
            # Pallas: the paged kernel over these pages (split counts: our ladder's and its default 16); the
            # contiguous one once per (B, L), as XLA.
            cands = pallas_peers.decode_candidates(qr, k, v, kv, lut, l, k_splits=(plan_np, 16))
            if page != 128:
                for key in ("pallas_gqa_gbs", "pallas_gqa_setting", "pallas_gqa_err_vs_cudnn"):
                    r[key] = results.get(("decode", b, l, key))
                del cands["pallas_gqa"]
            time_pallas(r, cands, bench_in_graph, byts, 1e9, "_gbs", o_cud.reshape(b, 32, 128))
            for key in ("pallas_gqa_gbs", "pallas_gqa_setting", "pallas_gqa_err_vs_cudnn"):
                results.setdefault(("decode", b, l, key), r.get(key))
            rows.append(r)
            print(json.dumps(r), flush=True)
            del q, k, v, kv, lut, cands


def run_decode_d256(rows, rng, points=((16, 16384), (1, 131072))):
    """Decode at head dim 256 (bf16, Hq=16, Hkv=4: the K/V bytes a token of the D=128 table), pages 128 and 16,
    ours against cuDNN over contiguous K/V, in rotating rounds."""
    h, hkv, d = 16, 4, 256
    for b, l in points:
        for page in (128, 16):
            q, k, v, kv, lut = decode_case(b, l, page, rng, h=h, hkv=hkv, d=d)
            qr, offs, cl = step_args(q, l)
            ours = mha_call()

            def cud(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

            byts = 2 * b * l * hkv * d * 2
            r = {"kind": "decode_d256", "B": b, "L": l, "page": page, "H": h, "Hkv": hkv, "D": d}
            r["plan"] = msa_ops.plan("mo.mha.ragged.paged", qr, offs, kv, cl, lut, 0, mask_str="causal").num_partitions
            r["err_vs_cudnn"] = rel_err(jax.jit(ours)(qr, kv, lut, offs, cl), jax.jit(cud)(q, k, v).reshape(b, h, d))
            got = bench_rounds({"ours": graph_timer(ours, (qr, kv, lut, offs, cl)),
                                "cudnn": graph_timer(cud, (q, k, v))}, ROUNDS)
            for name in ("ours", "cudnn"):
                r[name + "_gbs"] = byts / float(np.median(got[name])) / 1e9
            r["ours_vs_cudnn"], r["ours_vs_cudnn_range"] = round_ratios(got["cudnn"], got["ours"])
            rows.append(r)
            print(json.dumps(r), flush=True)
            del q, k, v, kv, lut


def time_pallas(r, cands, seconds, work, scale, unit, ref):
    """Each Pallas peer of `cands` (pallas_peers) at its fastest setting: r[peer + unit] = work / s / scale, the
    setting, its error against `ref` (cuDNN's output), and the settings that failed. Returns {peer: (fn, args)}
    of the fastest settings."""
    chosen = {}
    for peer, cs in cands.items():
        (label, fn, args, s), errors = pallas_peers.fastest(cs, seconds)
        r[peer + unit] = None if s is None else work / s / scale
        r[peer + "_setting"] = label
        if errors:
            r[peer + "_errors"] = errors
        if fn is not None:
            r[peer + "_err_vs_cudnn"] = rel_err(jax.jit(fn)(*args).reshape(ref.shape), ref)
            chosen[peer] = (fn, args)
    return chosen


def with_switch_off(name, fn):
    """fn() with the environment switch `name` set to 0 (the handler reads it at each launch)."""
    os.environ[name] = "0"
    try:
        return fn()
    finally:
        del os.environ[name]


def run_prefill(rows, rng, kind="prefill", lens=(512, 2048, 8192), total=16384, causals=(False, True),
                alt=("MSA_OPS_CUDA_WGMMA", "ours_contig_mma_sync"), h=16, d=128, round_alt=None, pallas=True):
    """Prefill at B*S = total: ours contiguous and paged, cuDNN; for kind "prefill" also the 64-row tile and XLA.
    alt: a switch set to 0 for a second timing of the contiguous call (the handler reads it per launch), or None.
    round_alt: (switch, name) for a third contiguous timing with that switch at 0, in the rounds with cuDNN.
    pallas: the Pallas peers too (pallas_peers): Mosaic GPU at its fastest setting in the rounds, Triton once."""
    full = kind == "prefill"
    for s in lens:
        b = total // s
        key = jax.random.PRNGKey(s)
        k1, k2, k3 = jax.random.split(key, 3)
        q = jax.random.normal(k1, (b, s, h, d), BF)
        k = jax.random.normal(k2, (b, s, h, d), BF)
        v = jax.random.normal(k3, (b, s, h, d), BF)
        offs = jnp.arange(b + 1, dtype=jnp.int32) * s
        kv, lut = paged_from_contiguous(k, v, 128, rng)
        cl0 = jnp.zeros((b,), jnp.int32)
        for causal in causals:
            mask = "causal" if causal else "null"
            flops = 4 * b * s * s * h * d * (0.5 if causal else 1.0)
            ours_c = jax.jit(lambda q, k, v, m=mask, offs=offs: msa_ops.mha_ragged_no_cache(
                q.reshape(-1, h, d), k.reshape(-1, h, d), v.reshape(-1, h, d), offs, mask_str=m,
                implementation="native"))
            ours_p = jax.jit(lambda q, kv, lut, m=mask, offs=offs, cl0=cl0: msa_ops.mha_ragged_paged(
                q.reshape(-1, h, d), offs, kv, cl0, lut, 0, mask_str=m, implementation="native"))
            ours_p64 = jax.jit(lambda q, kv, lut, m=mask, offs=offs, cl0=cl0: msa_ops.mha_ragged_paged(
                q.reshape(-1, h, d), offs, kv, cl0, lut, 0, mask_str=m, implementation="native",
                max_prompt_length=127))  # hint -> the ladder's 64-row (1q) prefill tile
            cud = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                                 implementation="cudnn"))
            xla = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                                               implementation="xla"))
            r = {"kind": kind, "S": s, "B": b, "causal": causal, "H": h, "D": d}
            ref = cud(q, k, v).reshape(-1, h, d)
            r["err_contig_vs_cudnn"] = rel_err(ours_c(q, k, v), ref)
            r["err_paged_vs_cudnn"] = rel_err(ours_p(q, kv, lut), ref)
            # Ours (contiguous and paged) and cuDNN once a round in rotating order (harness.bench_rounds), medians;
            # the ratio to cuDNN is the median of the rounds' ratios. The rest timed once, after them.
            timers = {"ours_contig": lambda f=ours_c, x=(q, k, v): bench(f, x),
                      "ours_paged": lambda f=ours_p, x=(q, kv, lut): bench(f, x),
                      "cudnn": lambda f=cud, x=(q, k, v): bench(f, x)}
            if round_alt is not None:
                timers[round_alt[1]] = lambda f=ours_c, x=(q, k, v): with_switch_off(round_alt[0],
                                                                                    lambda: bench(f, x))
            if pallas:
                # Mosaic GPU takes f16 only (in jax 0.11.2 its bf16 form fails to build: a bf16 to f16 store): it
                # runs on f16 copies, and ours and cuDNN on the same copies join it in the rounds. Its fastest
                # setting (one timing each) is the one in the rounds; the Triton kernel (bf16) is timed once after.
                x16 = tuple(x.astype(jnp.float16) for x in (q, k, v))
                ref16 = cud(*x16).reshape(-1, h, d)
                chosen = time_pallas(r, {"pallas_mgpu": pallas_peers.mosaic_candidates(*x16, causal)}, bench, flops,
                                     1e12, "_tflops", ref16)
                if chosen:
                    timers["pallas_mgpu"] = lambda f=chosen["pallas_mgpu"][0], x=chosen["pallas_mgpu"][1]: bench(f, x)
                    timers["ours_contig_f16"] = lambda f=ours_c, x=x16: bench(f, x)
                    timers["cudnn_f16"] = lambda f=cud, x=x16: bench(f, x)
                    r["err_contig_f16_vs_cudnn"] = rel_err(ours_c(*x16), ref16)
            got = bench_rounds(timers, ROUNDS)
            for name, ts in got.items():
                r[name + "_tflops"] = flops / float(np.median(ts)) / 1e12
            r["ours_vs_cudnn"], r["ours_vs_cudnn_range"] = round_ratios(got["cudnn"], got["ours_contig"])
            if "pallas_mgpu" in got:
                r["ours_vs_pallas_mgpu"], r["ours_vs_pallas_mgpu_range"] = round_ratios(got["pallas_mgpu"],
                                                                                         got["ours_contig_f16"])
            if pallas:  # the Triton kernel, once
                time_pallas(r, {"pallas_triton": pallas_peers.triton_candidates(q, k, v, causal)}, bench, flops, 1e12,
                            "_tflops", ref)
            timed = [("ours_paged64", ours_p64, (q, kv, lut))] if full else []
            timed += [("xla", xla, (q, k, v))] if full else []
            for name, fn, args in timed:
                try:
                    r[name + "_tflops"] = flops / bench(fn, args) / 1e12
                except Exception as e:  # noqa: BLE001
                    r[name + "_tflops"] = None
                    r[name + "_error"] = str(e)[:200]
            if round_alt is not None:
                r[round_alt[1] + "_vs_cudnn"], r[round_alt[1] + "_vs_cudnn_range"] = round_ratios(
                    got["cudnn"], got[round_alt[1]])
            if alt is not None:
                t = with_switch_off(alt[0], lambda f=ours_c, x=(q, k, v): bench(f, x))
                r[alt[1] + "_tflops"] = flops / t / 1e12
            rows.append(r)
            print(json.dumps(r), flush=True)


def fmt(x, nd=0):
    return "—" if x is None else f"{x:.{nd}f}"


def ratio(a, b):
    return "—" if a is None or b is None else f"{a / b:.2f}x"


def rel(r, key="ours_vs_cudnn"):
    """A ratio of two series timed in the rounds (ours / cuDNN unless `key` names another): the median of the rounds'
    ratios and their range; "—" where the row has none."""
    if r.get(key + "_range") is None:
        return "—"
    lo, hi = r[key + "_range"]
    return f"{r[key]:.3f}x ({lo:.3f}-{hi:.3f})"


def head_dim_prefill_table(rs):
    """Markdown lines for the prefill rows `rs` of one head dim and shape (run_prefill with the CTA-per-tile kernel
    timed in the rounds); none without rows."""
    if not rs:
        return []
    r0 = rs[0]
    md = ["", f"## Head dim {r0['D']}", "",
          f"Prefill, bf16, S={r0['S']}, B={r0['B']}, H={r0['H']} (TFLOP/s; 128-row tiles on the persistent "
          "warp-specialized kernel (at head dim 64: three consumer warpgroups on 192-row items), on the "
          "CTA-per-tile wgmma kernel with MSA_OPS_DENSE_WS=0, timed in the same "
          "rounds, and the 64-row mma.sync tile with MSA_OPS_CUDA_WGMMA=0):", "",
          "| causal | ours contiguous | ours paged | ours contiguous, CTA per tile | ours contiguous, mma.sync "
          "| cuDNN | ours/cuDNN | CTA per tile/cuDNN | paged/contig |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rs:
        md.append(f"| {r['causal']} | {fmt(r.get('ours_contig_tflops'))} | {fmt(r.get('ours_paged_tflops'))} | "
                  f"{fmt(r.get('ours_contig_cta_tflops'))} | {fmt(r.get('ours_contig_mma_sync_tflops'))} | "
                  f"{fmt(r.get('cudnn_tflops'))} | {rel(r)} | {rel(r, 'ours_contig_cta_vs_cudnn')} | "
                  f"{ratio(r.get('ours_paged_tflops'), r.get('ours_contig_tflops'))} |")
    return md


def pallas_tables(rows):
    """Markdown lines for the Pallas peers of the decode and prefill rows; none without such rows."""
    def peer(r, name, unit):
        v = r.get(name + unit)
        if v is None:
            return "fails" if r.get(name + "_errors") else "—"
        return f"{v:.0f} ({r[name + '_setting']}; err {r[name + '_err_vs_cudnn']:.0e})"

    md, errs = [], []
    dec = [r for r in rows if r["kind"] == "decode" and "pallas_paged_setting" in r]
    if dec:
        md += ["", "## JAX Pallas kernels (`jax.experimental.pallas.ops.gpu`), in the same run", "",
               "Decode as above (GB/s of K+V; the setting and the relative error against cuDNN in brackets). The "
               "paged kernel reads our shuffled pages, copied into its layout; the contiguous one reads cuDNN's K/V. "
               "Each at the fastest of the settings tried (pallas_peers.py), timed once after the rounds:", "",
               "| B | L | page | ours | Pallas paged | Pallas gqa, contiguous | ours/Pallas paged |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in dec:
            md.append(f"| {r['B']} | {r['L']} | {r['page']} | {fmt(r.get('ours_gbs'))} | "
                      f"{peer(r, 'pallas_paged', '_gbs')} | {peer(r, 'pallas_gqa', '_gbs')} | "
                      f"{ratio(r.get('ours_gbs'), r.get('pallas_paged_gbs'))} |")
    pre = [r for r in rows if r["kind"] in ("prefill", "prefill_d64", "prefill_d256") and "pallas_mgpu_setting" in r]
    if pre:
        md += ["", "Prefill as above (TFLOP/s). Mosaic GPU (the Hopper kernel: TMA, wgmma, two consumer warpgroups) "
               "builds in f16 only: it runs on f16 copies of the inputs, at its fastest setting, in the rounds with "
               "ours and cuDNN on the same f16 copies. The Triton kernel runs in bf16, timed once after the rounds:",
               "",
               "| D | S | causal | ours, bf16 | Pallas Triton, bf16 | ours, f16 | cuDNN, f16 | Pallas Mosaic GPU, f16 "
               "| ours/Mosaic GPU, f16 |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in pre:
            md.append(f"| {r['D']} | {r['S']} | {r['causal']} | {fmt(r.get('ours_contig_tflops'))} | "
                      f"{peer(r, 'pallas_triton', '_tflops')} | {fmt(r.get('ours_contig_f16_tflops'))} | "
                      f"{fmt(r.get('cudnn_f16_tflops'))} | {peer(r, 'pallas_mgpu', '_tflops')} | "
                      f"{rel(r, 'ours_vs_pallas_mgpu')} |")
    for r in dec + pre:
        for name in ("pallas_paged", "pallas_gqa", "pallas_mgpu", "pallas_triton"):
            for label, e in r.get(name + "_errors", {}).items():
                errs.append(f"- {r['kind']} {r.get('B')}/{r.get('L', r.get('S'))} {name} ({label}): {e}")
    if errs:
        md += ["", "Settings that failed to build or run:", ""] + sorted(set(errs))
    return md


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", default=None, help="comma-separated parts: decode, prefill, d256, d64 (default: all)")
    ap.add_argument("--identity-pages", action="store_true", help="page j of sequence b is pool page b * MP + j")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each comparison with cuDNN")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no runs: the tables of these runs' rows together "
                    "(gpu_mha.json files of runs with different --only parts)")
    a = ap.parse_args()
    if a.merge:
        rows, heads = [], []
        for path in a.merge:
            with open(path) as fh:
                got = json.load(fh)
            rows += got["rows"]
            heads.append(f"{got['device']}, jax {got['jax']}, {got['rounds']} rounds ({', '.join(got['parts'])})")
        write_results(a.out, "gpu_mha", {"runs": heads, "rows": rows}, render(rows, "; ".join(heads)))
        return
    parts = {"decode", "prefill", "d256", "d64"} if a.only is None else set(a.only.split(","))
    if not parts <= {"decode", "prefill", "d256", "d64"}:
        ap.error(f"--only {a.only}: parts are decode, prefill, d256, d64")
    global IDENTITY_PAGES, ROUNDS
    IDENTITY_PAGES = a.identity_pages
    ROUNDS = a.rounds
    rng = np.random.default_rng(0)
    rows, results = [], {}
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    if "decode" in parts:
        run_decode(rows, results, rng)
    if "prefill" in parts:
        run_prefill(rows, rng)
        # Many short sequences; the second timing with the persistent kernel kept on 128-row items (at S=32 and 64
        # the handler takes the pair kernel's 64-row items by default).
        run_prefill(rows, rng, "prefill_many", (32, 64, 256), 65536, (True,),
                    ("MSA_OPS_DENSE_WS_PAIR", "ours_contig_ws128"), pallas=False)
    if "d256" in parts:
        run_prefill(rows, rng, "prefill_d256", (8192,), 16384, (False, True), h=8, d=256,
                    round_alt=("MSA_OPS_DENSE_WS", "ours_contig_cta"))
        run_decode_d256(rows, rng)
    if "d64" in parts:  # BENCH.md's prefill across head dims: S=8k, H=2048/D
        run_prefill(rows, rng, "prefill_d64", (8192,), 16384, (False, True), h=32, d=64,
                    round_alt=("MSA_OPS_DENSE_WS", "ours_contig_cta"))
    run = {"device": dev.device_kind, "jax": jax.__version__, "rounds": ROUNDS, "parts": sorted(parts), "rows": rows}
    write_results(a.out, "gpu_mha", run, render(rows, f"{dev.device_kind}, jax {jax.__version__}, {ROUNDS} rounds"))


def render(rows, run):
    """The markdown tables of a run's rows; `run` names the run(s) (device, jax, rounds)."""
    md = [f"# Dense MHA ({run})", "",
          "Ours and cuDNN (prefill: ours contiguous and paged, cuDNN) timed once a round, in rotating order: figures "
          "are medians, ours/cuDNN the median of the rounds' ratios (their range in brackets). Decode calls run 10 to "
          "a jitted function.", ""]
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        md += ["## Decode, bf16, Hq=32, Hkv=8, D=128 (GB/s of K+V)", "",
               "| B | L | page | partitions | ours | ours, 2x partitions | cuDNN | XLA | ours/cuDNN "
               "| rel.err vs cuDNN |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in dec:
            md.append(f"| {r['B']} | {r['L']} | {r['page']} | {r['plan']} | {fmt(r.get('ours_gbs'))} | "
                      f"{fmt(r.get('ours_alt_gbs'))} ({r['alt_np']}) | "
                      f"{fmt(r.get('cudnn_gbs'))} | {fmt(r.get('xla_gbs'))} | "
                      f"{rel(r)} | {r['err_vs_cudnn']:.1e} |")
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        md += ["", "## Prefill, bf16, D=128, H=16, B*S=16384 (TFLOP/s)", "",
               "| S | causal | ours contiguous | ours paged | ours paged, 64-row tiles | ours contiguous, mma.sync "
               "| cuDNN | XLA | ours/cuDNN | paged/contig |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in pre:
            md.append(f"| {r['S']} | {r['causal']} | {fmt(r.get('ours_contig_tflops'))} | "
                      f"{fmt(r.get('ours_paged_tflops'))} | {fmt(r.get('ours_paged64_tflops'))} | "
                      f"{fmt(r.get('ours_contig_mma_sync_tflops'))} | {fmt(r.get('cudnn_tflops'))} | "
                      f"{fmt(r.get('xla_tflops'))} | "
                      f"{rel(r)} | {ratio(r.get('ours_paged_tflops'), r.get('ours_contig_tflops'))} |")
    many = [r for r in rows if r["kind"] == "prefill_many"]
    if many:
        md += ["", "## Prefill, many short sequences: bf16, D=128, H=16, B*S=65536, causal (TFLOP/s)", "",
               "| S | B | ours contiguous | ours paged | ours contiguous, 128-row items | cuDNN | ours/cuDNN |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in many:
            md.append(f"| {r['S']} | {r['B']} | {fmt(r.get('ours_contig_tflops'))} | "
                      f"{fmt(r.get('ours_paged_tflops'))} | {fmt(r.get('ours_contig_ws128_tflops'))} | "
                      f"{fmt(r.get('cudnn_tflops'))} | {rel(r)} |")
    for dd in (64, 256):
        md += head_dim_prefill_table([r for r in rows if r["kind"] == f"prefill_d{dd}"])
    d256 = [r for r in rows if r["kind"] == "decode_d256"]
    if d256:
        md += ["", "Decode, bf16, Hq=16, Hkv=4 (GB/s of K+V):", "",
               "| B | L | page | partitions | ours | cuDNN | ours/cuDNN | rel.err vs cuDNN |",
               "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in d256:
            md.append(f"| {r['B']} | {r['L']} | {r['page']} | {r['plan']} | {fmt(r.get('ours_gbs'))} | "
                      f"{fmt(r.get('cudnn_gbs'))} | {rel(r)} | {r['err_vs_cudnn']:.1e} |")
    md += pallas_tables(rows)
    return "\n".join(md)


if __name__ == "__main__":
    main()
