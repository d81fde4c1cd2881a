"""``python -m msa_ops demo``: prefill a ragged batch into a paged cache, then decode with dense and sparse
attention in one jitted step, check against a direct float64 computation, and report."""

from __future__ import annotations

import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import api, registry

PAGE = 128
D = 128


def _say(msg: str) -> None:
    print(msg, flush=True)


def _attention_f64(q, k, v, scale):
    """q[H, D], k/v[S, Hkv, D] visible keys only -> [H, D]."""
    h = q.shape[0]
    g = h // k.shape[1]
    out = np.zeros((h, q.shape[1]))
    for hh in range(h):
        kk = k[:, hh // g]
        s = scale * kk @ q[hh]
        if s.size == 0:
            continue
        e = np.exp(s - s.max())
        out[hh] = e @ v[:, hh // g] / e.sum()
    return out


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_demo(steps: int = 8, seed: int = 0, implementation: str = "auto") -> int:
    backend = jax.default_backend()
    rng = np.random.default_rng(seed)
    prompts = [37, 300, 5, 129]
    b = len(prompts)
    h, hkv, layers, topk = 8, 2, 2, 2
    di = 64  # index head dim
    scale = 1.0 / math.sqrt(D)
    max_len = max(prompts) + steps
    mp = -(-max_len // PAGE)
    nb = b * mp + 3
    dt = jnp.bfloat16
    plat = "cuda" if backend == "gpu" else backend
    impls = {
        n: registry.resolve_implementation(registry.get_op(n), plat if plat in ("cpu", "cuda") else None,
                                           implementation)
        for n in ("mo.kv_cache.store.ragged.paged", "mo.mha.ragged.paged", "mo.msa.indexer.ragged.paged",
                  "mo.msa.attention.ragged.paged")
    }
    _say(f"msa_ops demo: jax {jax.__version__}, backend {backend} ({jax.devices()[0].device_kind})")
    for n, i in impls.items():
        _say(f"  {n:34s} -> {i}")
    _say(f"  batch {b} prompts {prompts}, H={h} Hkv={hkv} D={D} page={PAGE} layers={layers} bf16, "
         f"pool {nb} pages, MSA topk={topk} blocks, {steps} decode steps")

    # Pages of each sequence, shuffled over the pool.
    perm = rng.permutation(nb)
    lut = perm[: b * mp].reshape(b, mp).astype(np.int32)
    kv = jnp.zeros((nb, 2, layers, PAGE, hkv, D), dt)
    idx = jnp.zeros((nb, 2, layers, PAGE, 1, di), dt)

    def q16(x):
        return np.asarray(jnp.asarray(x, dt).astype(jnp.float32), np.float64)

    hist_k = [[np.zeros((0, hkv, D)) for _ in range(b)] for _ in range(layers)]
    hist_v = [[np.zeros((0, hkv, D)) for _ in range(b)] for _ in range(layers)]
    hist_ik = [[np.zeros((0, 1, di)) for _ in range(b)] for _ in range(layers)]

    def draw(n):
        return (q16(rng.standard_normal((n, h, D))), q16(rng.standard_normal((n, hkv, D))),
                q16(rng.standard_normal((n, hkv, D))), q16(rng.standard_normal((n, 1, di))),
                q16(rng.standard_normal((n, hkv, di))))

    def layer_step(kv, idx, layer, q, k, v, ik, iq, offsets, cache_lengths, lut):
        kv = api.kv_cache_store_ragged_paged(kv, k, v, offsets, cache_lengths, lut, layer,
                                             implementation=implementation)
        zeros = jnp.zeros_like(ik)
        idx = api.kv_cache_store_ragged_paged(idx, ik, zeros, offsets, cache_lengths, lut, layer,
                                              implementation=implementation)
        dense = api.mha_ragged_paged(q, offsets, kv, cache_lengths, lut, layer, mask_str="causal",
                                     implementation=implementation)
        sel = api.msa_indexer_ragged_paged(iq, offsets, idx[:, :1], cache_lengths, lut, layer, topk=topk,
                                           init_blocks=1, local_blocks=1, implementation=implementation)
        sparse = api.msa_attention_ragged_paged(q, offsets, None, kv, cache_lengths, lut, layer, sel,
                                                implementation=implementation)
        return kv, idx, dense, sel, sparse

    # The pools are donated: the stores then write into them in place instead of into a copy (SPEC.md, op 9).
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kv, idx, q, k, v, ik, iq, offsets, cache_lengths, lut):
        def body(carry, layer):
            kv, idx = carry
            kv, idx, dense, sel, sparse = layer_step(kv, idx, layer, q[layer], k[layer], v[layer], ik[layer],
                                                     iq[layer], offsets, cache_lengths, lut)
            return (kv, idx), (dense, sel, sparse)

        (kv, idx), outs = jax.lax.scan(body, (kv, idx), jnp.arange(layers, dtype=jnp.int32))
        return kv, idx, outs

    def run(n_new: list[int], cache_lengths: np.ndarray, kv, idx):
        t = sum(n_new)
        offsets = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        draws = [draw(t) for _ in range(layers)]
        q, k, v, ik, iq = (np.stack([d[i] for d in draws]) for i in range(5))
        args = [jnp.asarray(x, dt) for x in (q, k, v, ik, iq)]
        t0 = time.perf_counter()
        kv, idx, (dense, sel, sparse) = step(kv, idx, *args, jnp.asarray(offsets), jnp.asarray(cache_lengths),
                                             jnp.asarray(lut))
        jax.block_until_ready(dense)
        dt_s = time.perf_counter() - t0
        for layer in range(layers):
            for s in range(b):
                lo, hi = offsets[s], offsets[s + 1]
                hist_k[layer][s] = np.concatenate([hist_k[layer][s], k[layer, lo:hi]])
                hist_v[layer][s] = np.concatenate([hist_v[layer][s], v[layer, lo:hi]])
                hist_ik[layer][s] = np.concatenate([hist_ik[layer][s], ik[layer, lo:hi]])
        return kv, idx, (q, iq, offsets, np.asarray(dense, np.float32), np.asarray(sel),
                         np.asarray(sparse, np.float32)), dt_s

    def check(res, cache_lengths) -> tuple[float, float, float]:
        q, iq, offsets, dense, sel, sparse = res
        e_dense, e_sparse, sel_bad = [], [], 0
        for layer in range(layers):
            for s in range(b):
                for i in range(offsets[s], offsets[s + 1]):
                    p = cache_lengths[s] + i - offsets[s]
                    kk, vv = hist_k[layer][s][: p + 1], hist_v[layer][s][: p + 1]
                    e_dense.append((dense[layer, i], _attention_f64(q[layer, i], kk, vv, scale)))
                    # indexer: block max scores over keys <= p, forced first/last, rest by score
                    ikk = hist_ik[layer][s][: p + 1, 0]
                    nblk = p // PAGE + 1
                    for g in range(hkv):
                        sc = (ikk @ iq[layer, i, g]) / math.sqrt(di)
                        bs = np.array([sc[j * PAGE:(j + 1) * PAGE].max() for j in range(nblk)])
                        if nblk <= topk:
                            want = list(range(nblk))
                        else:
                            rest = [j for j in np.argsort(-bs, kind="stable") if j not in (0, nblk - 1)]
                            want = sorted([0, nblk - 1] + rest[: topk - 2])
                        got = [j for j in sel[layer, g, i] if j >= 0]
                        sel_bad += int(got != want)
                    # sparse: attention over the chosen blocks' keys <= p
                    out = np.zeros((h, D))
                    for g in range(hkv):
                        keys = sorted({kk_ for j in sel[layer, g, i] if j >= 0
                                       for kk_ in range(j * PAGE, min((j + 1) * PAGE, p + 1))})
                        gi = slice(g * (h // hkv), (g + 1) * (h // hkv))
                        ko = hist_k[layer][s][keys][:, g:g + 1]
                        vo = hist_v[layer][s][keys][:, g:g + 1]
                        out[gi] = _attention_f64(q[layer, i, gi], ko, vo, scale)
                    e_sparse.append((sparse[layer, i], out))
        ed = _rel(np.stack([a for a, _ in e_dense]), np.stack([r for _, r in e_dense]))
        es = _rel(np.stack([a for a, _ in e_sparse]), np.stack([r for _, r in e_sparse]))
        return ed, es, sel_bad

    cache_lengths = np.zeros(b, np.int32)
    _say("prefill ...")
    kv, idx, res, t_pre = run(prompts, cache_lengths, kv, idx)
    ed, es, bad = check(res, cache_lengths)
    _say(f"  prefill {sum(prompts)} tokens x {layers} layers: {t_pre * 1e3:.1f} ms (incl. compile); "
         f"dense rel.err {ed:.2e}, sparse rel.err {es:.2e}, indexer mismatches {bad}")
    cache_lengths = cache_lengths + np.array(prompts, np.int32)
    ok = ed < 2e-2 and es < 2e-2 and bad == 0
    times = []
    for st in range(steps):
        kv, idx, res, t_step = run([1] * b, cache_lengths, kv, idx)
        times.append(t_step)
        ed, es, bad = check(res, cache_lengths)
        ok = ok and ed < 2e-2 and es < 2e-2 and bad == 0
        _say(f"  decode step {st + 1}/{steps}: {t_step * 1e3:8.2f} ms  dense rel.err {ed:.2e}  "
             f"sparse rel.err {es:.2e}  indexer mismatches {bad}")
        cache_lengths = cache_lengths + 1
    steady = times[1:] if len(times) > 1 else times
    _say(f"decode step (store + dense + indexer + MSA, {layers} layers, jitted, scan over layers): "
          f"median {np.median(steady) * 1e3:.2f} ms after the first (compile) step")
    _say("result: " + ("OK - every output matches the float64 computation" if ok else "MISMATCH"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
