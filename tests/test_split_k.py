"""Split-K workspace of the native CPU handler: the partials it writes combine (SPEC.md op 6) to its output
in any order, and partitions past a sequence's keys are empty (lse = -inf)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_batch, make_paged_cache, on_cpu, rand

import msa_ops
from msa_ops import routing
from msa_ops.registry import normalize_call_attrs


def _native_cpu_or_skip():
    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip("native CPU library not available")


def _combine(ws_o, ws_lse, order):
    m = np.max(ws_lse[order], axis=0)
    num = np.zeros(ws_o.shape[1:], np.float64)
    den = np.zeros(ws_lse.shape[1:], np.float64)
    for p in order:
        w = np.where(np.isfinite(ws_lse[p]), np.exp2(ws_lse[p] - np.where(np.isfinite(m), m, 0.0)), 0.0)
        num += w[..., None] * ws_o[p]
        den += w
    return np.where(den[..., None] > 0, num / np.where(den > 0, den, 1.0)[..., None], 0.0)


@pytest.mark.parametrize("np_", [2, 7])
@pytest.mark.parametrize("scenario", ["decode", "mixed", "long"])
def test_partials_combine_in_any_order(np_, scenario):
    _native_cpu_or_skip()
    rng = np.random.default_rng(np_ * 10 + len(scenario))
    batch = make_batch(rng, scenario)
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=16, max_pages=32,
                             n_kv_heads=2, head_dim=64, dtype=np.float32)
    q = rand(rng, (batch.T, 8, 64), np.float32)
    op = msa_ops.get_op("mo.mha.ragged.paged")
    attrs, _ = normalize_call_attrs(op, {"mask_str": "causal", "num_partitions": np_})
    args = [jnp.asarray(x) for x in (q, batch.offsets, cache.kv_blocks, batch.cache_lengths, cache.lut)]
    args.append(jnp.int32(0))
    with on_cpu():
        out, ws_o, ws_lse = jax.jit(
            lambda *a: tuple(op.primitive.bind(*a, attrs=attrs, implementation="native")))(*args)
    assert ws_o.shape[0] == np_ and ws_lse.shape[0] == np_
    offs = batch.offsets
    owned = np.zeros(batch.T, bool)
    owned[offs[0]: offs[-1]] = True
    # Workspace rows of padding rows are never written (their memory is whatever XLA left there).
    out = np.asarray(out)[owned].astype(np.float64)
    ws_o = np.asarray(ws_o)[:, owned].astype(np.float64)
    ws_lse = np.asarray(ws_lse)[:, owned].astype(np.float64)
    for order in (list(range(np_)), list(reversed(range(np_))), list(rng.permutation(np_))):
        np.testing.assert_allclose(_combine(ws_o, ws_lse, order), out, rtol=2e-5, atol=2e-6)
    # partitions that start past a sequence's keys are empty (owned rows are offs[0]..offs[-1], offs[0] = 0)
    for b, (n, c) in enumerate(zip(batch.n, batch.cache)):
        keys = c + n
        for p, (lo, hi) in enumerate(routing.split_k_ranges(keys, np_)):
            rows = slice(offs[b] - offs[0], offs[b + 1] - offs[0])
            if hi <= lo:
                assert np.all(np.isneginf(ws_lse[p, rows])), (b, p)
