"""vmap on the GPU: a folded vmap (msa_ops/fold.py, one call for the whole mapped axis) against the lax.map rule
(``MSA_OPS_VMAP_FOLD=0`` while tracing: one call per element, in a loop) and against one plain call over the same
sequences (what the fold should reach), timed in rotating rounds in one process.

Cases: dense paged decode (bf16, Hq=32, Hkv=8, D=128, page 128) and MSA decode (bf16, H=32, Hkv=4, topk 16),
each as N elements of B sequences that share one pool (each element its own q, offsets, cache lengths and page
table rows; the pool an unmapped argument, never a constant of the graph). Prints a markdown table; writes
gpu_vmap.json / .md into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from harness import bench_rounds, graph_timer, round_ratios, write_results

import msa_ops

BF = jnp.bfloat16


@contextlib.contextmanager
def fold_env(value: str):
    old = os.environ.get("MSA_OPS_VMAP_FOLD")
    os.environ["MSA_OPS_VMAP_FOLD"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["MSA_OPS_VMAP_FOLD"]
        else:
            os.environ["MSA_OPS_VMAP_FOLD"] = old


def traced_timer(op, args, fold: str):
    """graph_timer's function, compiled now with MSA_OPS_VMAP_FOLD=fold (read while the batching rule traces)."""
    with fold_env(fold):
        timer = graph_timer(op, args)
        t = timer()  # traces and compiles under the setting
    del t
    return timer


def decode_batch(n, b, length, hkv, d, page, h, seed, rng):
    """N elements of B decode sequences of ``length`` keys over one shared pool of shuffled pages: the pool, each
    element's q, offsets, cache lengths and page-table rows, and the same sequences as one plain call's q, offsets,
    cache lengths and page table."""
    mp = -(-length // page)
    nb = n * b * mp
    kv = jax.random.normal(jax.random.PRNGKey(1), (nb, 2, 1, page, hkv, d), BF)
    lut = jnp.asarray(rng.permutation(nb).reshape(n * b, mp), jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(seed), (n, b, h, d), BF)
    cl = jnp.full((n, b), length - 1, jnp.int32)
    mapped = (q, jnp.tile(jnp.arange(b + 1, dtype=jnp.int32), (n, 1)), cl, lut.reshape(n, b, -1))
    flat = (q.reshape(n * b, h, d), jnp.arange(n * b + 1, dtype=jnp.int32), cl.reshape(-1), lut)
    return kv, mapped, flat


def dense_case(n, b, length, rng, h=32, hkv=8, d=128, page=128):
    kv, (q, offs, cl, luts), (qf, offf, clf, lutf) = decode_batch(n, b, length, hkv, d, page, h, 2, rng)

    def one(q, o, kv, c, t):
        return msa_ops.mha_ragged_paged(q, o, kv, c, t, 0, mask_str="causal", implementation="native")

    mapped = (jax.vmap(one, in_axes=(0, 0, None, 0, 0)), (q, offs, kv, cl, luts))
    flat = (one, (qf, offf, kv, clf, lutf))
    return mapped, flat, n * b * length * hkv * d * 2 * 2


def msa_case(n, b, length, rng, topk=16, h=32, hkv=4):
    kv, (q, offs, cl, luts), (qf, offf, clf, lutf) = decode_batch(n, b, length, hkv, 128, 128, h, 3, rng)
    blocks = length // 128
    sel = np.stack([np.sort(rng.choice(blocks - 1, topk - 1, replace=False)) for _ in range(n * hkv * b)])
    sel = np.concatenate([sel, np.full((n * hkv * b, 1), blocks - 1)], axis=1).reshape(n, hkv, b, topk)
    idx = jnp.asarray(sel, jnp.int32)

    def one(q, o, kv, c, t, ix):
        return msa_ops.msa_attention_ragged_paged(q, o, None, kv, c, t, 0, ix, implementation="native")

    mapped = (jax.vmap(one, in_axes=(0, 0, None, 0, 0, 0)), (q, offs, kv, cl, luts, idx))
    flat = (one, (qf, offf, kv, clf, lutf, jnp.moveaxis(idx, 0, 1).reshape(hkv, n * b, topk)))
    return mapped, flat, n * b * topk * 128 * hkv * 128 * 2 * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        ("dense decode", 4, 16, 4096, dense_case),
        ("dense decode", 8, 4, 16384, dense_case),
        ("MSA decode topk 16", 4, 8, 32768, msa_case),
    ]
    rows = []
    for name, n, b, length, make in cases:
        (vf, vargs), (ff, fargs), nbytes = make(n, b, length, rng)
        want = np.asarray(ff(*fargs), np.float32).reshape(n, b, *fargs[0].shape[1:])
        for fold in ("1", "0"):
            with fold_env(fold):
                got = np.asarray(jax.jit(vf)(*vargs), np.float32)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            assert err < 1e-2, (name, fold, err)
        timers = {"fold": traced_timer(vf, vargs, "1"), "loop": traced_timer(vf, vargs, "0"),
                  "one call": traced_timer(ff, fargs, "1")}
        t = bench_rounds(timers, args.rounds)
        med = {k: float(np.median(v)) for k, v in t.items()}
        row = {"case": name, "elements": n, "batch": b, "length": length, "us": {k: v * 1e6 for k, v in med.items()},
               "GBps_fold": nbytes / med["fold"] / 1e9, "fold_over_loop": round_ratios(t["loop"], t["fold"]),
               "fold_over_one_call": round_ratios(t["one call"], t["fold"])}
        rows.append(row)
        print(row, flush=True)
    dev = jax.devices()[0].device_kind
    lines = [f"### vmap folded vs the lax.map rule on {dev} ({args.rounds} rounds, medians)", "",
             "| case | N x B, length | fold us | loop us | one call us | fold GB/s | loop / fold | one call / fold |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u = r["us"]
        lines.append(f"| {r['case']} | {r['elements']} x {r['batch']}, {r['length']} | {u['fold']:.1f} | "
                     f"{u['loop']:.1f} | {u['one call']:.1f} | {r['GBps_fold']:.0f} | "
                     f"{r['fold_over_loop'][0]:.2f}x | {r['fold_over_one_call'][0]:.3f} |")
    write_results(args.out, "gpu_vmap", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
