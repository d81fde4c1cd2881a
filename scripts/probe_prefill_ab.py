"""Dense prefill on the sm_90 128-row tile: the warp-specialized persistent kernel (MSA_OPS_DENSE_WS=1) against the
CTA-per-tile one (=0) and cuDNN, in one process, rounds interleaved (the switches are read at each launch);
variants ws0 / ws1 / ws2 / ws3 run the persistent kernel with MSA_OPS_DENSE_WS_WALK=0 / 1 / 2 / 3 (heads fastest, heads
slowest, bands, heads slowest for short sequences and bands for long ones: ws_sm90.cuh; ws: the kernel's own
choice); wsx: the persistent kernel with every warp storing its own rows (MSA_OPS_DENSE_WS_STORE=0, no TMA store);
wsl0 / ctal0: ws / cta rescaling O at every rise of a row's max (MSA_OPS_LAZY_RESCALE=0). ws and its variants keep
the 128-row items (MSA_OPS_DENSE_WS_PAIR=0); wsp: the pair kernel's 64-row items (=1, where it serves the call); wsd:
the handler's default choice among them and wg3; wg3: three consumer warpgroups on 192-row items (head dim 64,
MSA_OPS_DENSE_WS3=1; every variant but wsd sets it to 0); a name ending in -n (ws-n, ...): that variant with
MSA_OPS_WG_TAIL_SKIP=0 (head dim 256: every consumer warpgroup runs every key tile of an item). BENCH.md's
prefill shapes: bf16, D=128 (--d: 64, 128, 256), H = 2048 / D (Hkv = H unless --hkv), B*S=16384, contiguous and paged
(page 128) K/V, causal and not. Prints TFLOP/s and ratios; checks that both kernels agree with cuDNN.

  python3 scripts/probe_prefill_ab.py [--lens 512,2048,8192] [--rounds 2] [--d 128] [--hkv 16] [--page 128]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from harness import bench  # noqa: E402

import msa_ops  # noqa: E402

BF = jnp.bfloat16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="512,2048,8192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hkv", type=int, default=0, help="kv heads (default: H)")
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--total", type=int, default=16384)
    ap.add_argument("--variants", default="ws,cta",
                    help="comma list of ws, wsp, wsd, cta, ws0-ws3, wsx, wsl0, ctal0, wg3, and any of them with -n "
                         "(the first is compared)")
    ap.add_argument("--masks", default="null,causal")
    ap.add_argument("--d", type=int, default=128, help="head dim (H = 2048 / D unless --h)")
    ap.add_argument("--h", type=int, default=0)
    args = ap.parse_args()
    d = args.d
    h = args.h or 2048 // d
    rng = np.random.default_rng(0)
    variants = args.variants.split(",")
    # MSA_OPS_DENSE_WS, _WALK, _STORE, MSA_OPS_LAZY_RESCALE, MSA_OPS_DENSE_WS_PAIR ("": unset)
    names = ("MSA_OPS_DENSE_WS", "MSA_OPS_DENSE_WS_WALK", "MSA_OPS_DENSE_WS_STORE", "MSA_OPS_LAZY_RESCALE",
             "MSA_OPS_DENSE_WS_PAIR")
    envs = {"ws": ("1", "", "", "", "0"), "cta": ("0", "", "", "", ""), "wsx": ("1", "", "0", "", "0"),
            "wsl0": ("1", "", "", "0", "0"), "ctal0": ("0", "", "", "0", ""), "wsp": ("1", "", "", "", "1"),
            **{f"ws{i}": ("1", str(i), "", "", "0") for i in range(4)}}
    # MSA_OPS_DENSE_WS3: 0 for every variant above (two consumer warpgroups); wg3: three, on 192-row items (D=64);
    # wsd: the handler's own choice among them
    names += ("MSA_OPS_DENSE_WS3",)
    envs = {k: v + ("0",) for k, v in envs.items()}
    envs["wg3"] = ("1", "", "", "", "0", "1")
    envs["wsd"] = ("1", "", "", "", "", "")
    # A variant name ending in -n: that variant with its consumer warpgroups running every key tile of an item
    # (MSA_OPS_WG_TAIL_SKIP=0; the others skip the tiles past their rows' keys, the default)
    names += ("MSA_OPS_WG_TAIL_SKIP",)
    envs = {k: v + ("",) for k, v in envs.items()}
    envs.update({v: envs[v[:-2]][:-1] + ("0",) for v in variants if v.endswith("-n")})
    hkv = args.hkv or h
    print(f"H={h}, Hkv={hkv}, D={d}, B*S={args.total}, page {args.page}; TFLOP/s")
    v0 = variants[0]
    cols = variants + ["cuDNN"] + [f"{v0} / {v}" for v in variants[1:]] + [f"{v0} / cuDNN"]
    cols += [f"err {v}" for v in variants]
    print("| S | mask | kv | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (3 + len(cols)))
    for s in (int(x) for x in args.lens.split(",")):
        b = max(1, args.total // s)
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(s), 3)
        q = jax.random.normal(k1, (b, s, h, d), BF)
        k = jax.random.normal(k2, (b, s, hkv, d), BF)
        v = jax.random.normal(k3, (b, s, hkv, d), BF)
        page = args.page
        mp = -(-s // page)
        perm = rng.permutation(b * mp)
        kp = jnp.pad(k, ((0, 0), (0, mp * page - s), (0, 0), (0, 0))).reshape(b * mp, page, hkv, d)
        vp = jnp.pad(v, ((0, 0), (0, mp * page - s), (0, 0), (0, 0))).reshape(b * mp, page, hkv, d)
        kv = jnp.zeros((b * mp, 2, 1, page, hkv, d), BF).at[perm, 0, 0].set(kp).at[perm, 1, 0].set(vp)
        lut = jnp.asarray(perm, jnp.int32).reshape(b, mp)
        offs = jnp.arange(b + 1, dtype=jnp.int32) * s
        cl0 = jnp.zeros((b,), jnp.int32)
        for mask in args.masks.split(","):
            flops = 4 * b * s * s * h * d * (0.5 if mask == "causal" else 1.0)
            contig = jax.jit(lambda q, k, v, m=mask, offs=offs: msa_ops.mha_ragged_no_cache(
                q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), offs, mask_str=m,
                implementation="native"))
            paged = jax.jit(lambda q, kv, lut, m=mask, offs=offs, cl0=cl0: msa_ops.mha_ragged_paged(
                q.reshape(-1, h, d), offs, kv, cl0, lut, 0, mask_str=m, implementation="native"))
            cud = jax.jit(lambda q, k, v, c=(mask == "causal"): jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation="cudnn"))
            ref = np.asarray(cud(q, k, v).reshape(-1, h, d), np.float32)
            for name, fn, fargs in (("contig", contig, (q, k, v)), ("paged", paged, (q, kv, lut))):
                t = {v: [] for v in variants + ["cudnn"]}
                err = {}
                for r in range(args.rounds):
                    for kern in variants:
                        for nm, val in zip(names, envs[kern]):
                            os.environ[nm] = val
                        if r == 0:
                            got = np.asarray(fn(*fargs), np.float32)
                            err[kern] = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-30))
                        t[kern].append(bench(fn, fargs))
                    t["cudnn"].append(bench(cud, (q, k, v)))
                tf = {kk: flops / min(vv) / 1e12 for kk, vv in t.items()}
                vals = [f"{tf[v]:.0f}" for v in variants] + [f"{tf['cudnn']:.0f}"]
                vals += [f"{tf[v0] / tf[v]:.3f}" for v in variants[1:]] + [f"{tf[v0] / tf['cudnn']:.3f}"]
                vals += [f"{err[v]:.1e}" for v in variants]
                print(f"| {s} | {mask} | {name} | " + " | ".join(vals) + " |", flush=True)
        for nm in names:
            os.environ.pop(nm, None)


if __name__ == "__main__":
    main()
