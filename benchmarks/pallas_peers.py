"""JAX's own Pallas attention kernels (jax.experimental.pallas.ops.gpu) as peers, where they build and run.

- Decode: ``paged_attention`` (Triton) reads the same shuffled pages as ours, copied once into its
  [Hkv, pages, page, D] layout; ``decode_attention.gqa`` (Triton) reads contiguous K/V, as cuDNN does.
- Prefill: ``attention_mgpu.attention`` (Mosaic GPU: the Hopper kernel, TMA and wgmma, two consumer warpgroups)
  and ``attention.mha`` (Triton).

Each builder returns candidates ``(label, fn, args)``: the tile settings the kernel's own module documents or sweeps
where its defaults do not fit (paged_attention's defaults ask for more shared memory than an H200 has at page 128).
`fastest` times them and keeps the fastest one that runs, so that a peer is reported at its best; candidates
that fail to build or run leave their error, and a peer none of whose candidates runs is reported as such.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp


def _op(name):
    """One module of jax.experimental.pallas.ops.gpu, imported when a candidate is first traced, so that a module
    that does not import here (attention_mgpu needs absl-py) fails as that peer's error only."""
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def decode_candidates(q3, k, v, kv, lut, length, k_splits=(16,), interpret=False):
    """{peer: [(label, fn, args)]} for one decode batch.

    q3 [B, Hq, D]; k, v [B, L, Hkv, D] contiguous; kv [NB, 2, 1, page, Hkv, D] and lut [B, MP] ours (one layer);
    length: keys per sequence. k_splits: split counts to try (kept where they divide the page-table width)."""
    b, _, d = q3.shape
    page, mp = kv.shape[3], lut.shape[1]
    k_pages = jnp.transpose(kv[:, 0, 0], (2, 0, 1, 3))  # [Hkv, NB, page, D]
    v_pages = jnp.transpose(kv[:, 1, 0], (2, 0, 1, 3))
    lengths = jnp.full((b,), length, jnp.int32)
    q_scaled = (q3.astype(jnp.float32) / math.sqrt(d)).astype(q3.dtype)  # paged_attention takes no softmax scale
    ppcb = max(1, 128 // page)  # 128 keys a compute block
    paged = []
    for ks in sorted({s for s in k_splits if s >= 1 and mp % s == 0 and (mp // s) % min(mp // s, ppcb) == 0}):
        def fn(q3, kp, vp, lut, lengths, ks=ks):
            return _op("paged_attention").paged_attention(q3, kp, vp, lut, lengths, pages_per_compute_block=ppcb,
                                                   k_splits=ks, interpret=interpret)
        paged.append((f"k_splits={ks}, {ppcb * page} keys a block", fn, (q_scaled, k_pages, v_pages, lut, lengths)))

    def gqa(q3, k, v):
        return _op("decode_attention").gqa(q3, k, v, sm_scale=1.0 / math.sqrt(d), interpret=interpret)
    return {"pallas_paged": paged, "pallas_gqa": [("defaults", gqa, (q3, k, v))]}


def mosaic_candidates(q, k, v, causal):
    """[(label, fn, args)] of Mosaic GPU's prefill on q, k, v [B, S, H, D] (the layout cuDNN takes); f16 only in
    jax 0.11.2, whose bf16 form does not build. It has no interpreter, so it runs on a GPU alone."""
    q_scaled = (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)  # it takes no softmax scale
    cands = []
    for bkv in (128, 64):
        def mgpu(q, k, v, bkv=bkv):
            m = _op("attention_mgpu")
            cfg = m.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=causal)
            return m.attention(q, k, v, cfg)
        cands.append((f"block_q=64, block_kv={bkv}", jax.jit(mgpu), (q_scaled, k, v)))
    return cands


def triton_candidates(q, k, v, causal, interpret=False):
    """[(label, fn, args)] of the Triton prefill on q, k, v [B, S, H, D], at its default blocks."""
    d = q.shape[-1]
    return [("defaults", jax.jit(lambda q, k, v: _op("attention").mha(
        q, k, v, None, sm_scale=1.0 / math.sqrt(d), causal=causal, interpret=interpret)), (q, k, v))]


def fastest(cands, seconds):
    """(label, fn, args, s) of the fastest candidate by ``seconds(fn, args)``, and {label: error} of those that
    failed; (None, None, None, None) in the first place when none ran."""
    best, errors = (None, None, None, None), {}
    for label, fn, args in cands:
        try:
            s = seconds(fn, args)
        except Exception as e:  # noqa: BLE001 - a peer may not build or run at a shape: report it, go on
            errors[label] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        if best[3] is None or s < best[3]:
            best = (label, fn, args, s)
    return best, errors
