"""msa_ops wrappers (called inside jax.jit) against the float64 oracle, on seeded random sweeps.

Every test takes the `impl` fixture: "reference" always runs; "native" skips cleanly while
msa_ops._native.available("cpu") is False. Errors are measured against the oracle run on the same quantized
inputs (conftest.BUDGETS).
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from conftest import (
    BF16,
    DTYPES,
    FP8,
    RaggedBatch,
    assert_close,
    budget_for,
    jit_call,
    make_batch,
    make_paged_cache,
    rand,
    share_pages,
    to_uint32,
)

msa_ops = pytest.importorskip("msa_ops")
import jax
import jax.numpy as jnp

SEEDS = [0, 1]
S_MAX = 512


def tokens_of(batch: RaggedBatch):
    return [c + n for c, n in zip(batch.cache, batch.n)]


def np_out(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def mha_sink(q, offs, kv, cl, lut, layer, sinks, **kw):
    """mha_ragged_paged with sink_weights passed positionally (op mo.mha.ragged.paged.sink_weights)."""
    return msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, layer, sink_weights=sinks, **kw)


def msa_no_cro(q, offs, kv, cl, lut, layer, idx, **kw):
    """msa_attention_ragged_paged with cache_row_offsets omitted (None)."""
    return msa_ops.msa_attention_ragged_paged(q, offs, None, kv, cl, lut, layer, idx, **kw)


# ==========================================================================================================
# mo.mha.ragged.paged
# ==========================================================================================================
def mha_inputs(seed, scenario, *, group, page_size, dtype, head_dim, n_kv_heads=2, num_layers=2):
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, scenario, S_MAX)
    pc = make_paged_cache(rng, tokens_of(batch), page_size=page_size, max_pages=S_MAX // page_size,
                          n_kv_heads=n_kv_heads, head_dim=head_dim, num_layers=num_layers, dtype=dtype)
    q = rand(rng, (batch.T, n_kv_heads * group, head_dim), dtype)
    layer = np.int32(rng.integers(num_layers))
    return rng, batch, pc, q, layer


# (scenario, mask, window, group, page_size, dtype, head_dim)
MHA_CONFIGS = [
    ("mixed", "null", -1, 4, 16, "bf16", 64),
    ("mixed", "causal", -1, 4, 16, "bf16", 64),
    ("mixed", "sliding_window_causal", 24, 4, 16, "bf16", 64),
    ("mixed", "sliding_window_noncausal", 24, 4, 16, "bf16", 64),
    ("mixed", "chunked_causal", 32, 4, 16, "bf16", 64),
    ("prefill", "null", -1, 1, 128, "f32", 64),
    ("prefill", "causal", -1, 1, 128, "f32", 64),
    ("prefill", "sliding_window_causal", 7, 1, 128, "f32", 64),
    ("prefill", "sliding_window_noncausal", 9, 1, 128, "f32", 64),
    ("prefill", "chunked_causal", 16, 1, 128, "f32", 64),
    ("decode", "causal", -1, 8, 128, "bf16", 128),
    ("decode", "sliding_window_causal", 64, 1, 16, "bf16", 64),
    ("decode1", "causal", -1, 4, 16, "f32", 64),
    ("spec", "causal", -1, 8, 16, "f16", 64),
    ("long", "causal", -1, 4, 16, "bf16", 128),
    ("long", "chunked_causal", 128, 1, 128, "f32", 64),
    ("long", "sliding_window_causal", 100, 8, 128, "bf16", 64),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario,mask,W,group,page_size,dt,head_dim", MHA_CONFIGS)
def test_mha_ragged_paged(impl, seed, scenario, mask, W, group, page_size, dt, head_dim):
    dtype = DTYPES[dt]
    _, batch, pc, q, layer = mha_inputs(seed, scenario, group=group, page_size=page_size, dtype=dtype,
                                        head_dim=head_dim)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=mask, local_window_size=W,
                          implementation=impl))
    assert got.dtype == dtype
    ref = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W)
    assert_close(got, ref, budget_for(dtype), what=f"mha_ragged_paged[{scenario},{mask}]")
    assert not got[batch.offsets[-1]:].astype(np.float32).any(), "padding rows must be 0"


# (scenario, mask, window, dtype)
SINK_CONFIGS = [
    ("mixed", "causal", -1, "bf16"),
    ("decode", "sliding_window_causal", 40, "f32"),
    ("prefill", "chunked_causal", 8, "bf16"),
    ("long", "null", -1, "f32"),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario,mask,W,dt", SINK_CONFIGS)
def test_mha_ragged_paged_sink_weights(impl, seed, scenario, mask, W, dt):
    dtype = DTYPES[dt]
    rng, batch, pc, q, layer = mha_inputs(seed, scenario, group=4, page_size=16, dtype=dtype, head_dim=64)
    H = q.shape[1]
    sinks = (rng.standard_normal(H) * 2).astype(np.float32)
    sinks[0] = -np.inf  # no sink on head 0
    sinks[1] = 6.0  # a sink that dominates
    sinks = sinks.astype(dtype)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    got = np_out(jit_call(mha_sink, *args, sinks, mask_str=mask, local_window_size=W,
                          implementation=impl))
    ref = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W, sink_weights=sinks)
    assert_close(got, ref, budget_for(dtype), what="mha_ragged_paged.sink_weights")
    # a -inf sink equals no sink
    neg = np.full(H, -np.inf, np.float32).astype(dtype)
    got_neg = np_out(jit_call(mha_sink, *args, neg, mask_str=mask, local_window_size=W,
                              implementation=impl))
    got_none = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=mask, local_window_size=W,
                               implementation=impl))
    assert_close(got_neg, oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W),
                 budget_for(dtype), what="sink=-inf")
    assert_close(got_neg, got_none.astype(np.float64), budget_for(dtype), what="sink=-inf vs no sink")


# ==========================================================================================================
# mo.mha.padded.paged
# ==========================================================================================================
# (S, mask, window, group, page_size, dtype)
PADDED_PAGED_CONFIGS = [
    (1, "causal", -1, 8, 16, "bf16"),
    (40, "causal", -1, 4, 128, "f32"),
    (40, "sliding_window_noncausal", 12, 1, 16, "bf16"),
    (24, "chunked_causal", 16, 4, 16, "f32"),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("S,mask,W,group,page_size,dt", PADDED_PAGED_CONFIGS)
def test_mha_padded_paged(impl, seed, S, mask, W, group, page_size, dt):
    dtype = DTYPES[dt]
    rng = np.random.default_rng(seed)
    B, Hkv, D = 4, 2, 64
    vl = rng.integers(0, S + 1, B).astype(np.int32)
    vl[0] = 0
    vl[-1] = S + 5  # clamps to S
    n_q = np.minimum(vl, S)
    cache = np.array([int(rng.integers(0, S_MAX - n + 1)) for n in n_q], np.int32)
    pc = make_paged_cache(rng, list(cache + n_q), page_size=page_size, max_pages=S_MAX // page_size,
                          n_kv_heads=Hkv, head_dim=D, dtype=dtype)
    q = rand(rng, (B, S, Hkv * group, D), dtype)
    layer = np.int32(1)
    args = (q, pc.kv_blocks, cache, pc.lut, layer, vl)
    got = np_out(jit_call(msa_ops.mha_padded_paged, *args, mask_str=mask, local_window_size=W,
                          implementation=impl))
    ref = oracle.mha_padded_paged(*args, mask_str=mask, local_window_size=W)
    assert_close(got, ref, budget_for(dtype), what="mha_padded_paged")
    for b in range(B):
        assert not got[b, n_q[b]:].astype(np.float32).any()


@pytest.mark.parametrize("uint32", [False, True])
def test_mha_padded_paged_bad_values(impl, uint32):
    """The padded paged op in f16 with an explicit scale, the masks the sweep above leaves out, and bad values:
    a negative and a too-large valid length, a negative cache length and one past S_max, a page id past the pool,
    and layer_idx out of range (all zeros)."""
    rng = np.random.default_rng(23)
    dtype = np.dtype(np.float16)
    B, S, Hkv, group, D, P, MP = 5, 6, 2, 2, 32, 16, 4
    cache = np.array([-5, 10 ** 6, 20, 9, 7], np.int32)
    vl = np.array([4, 5, 9, 3, -2], np.int32)
    pc = make_paged_cache(rng, [P * MP] * B, page_size=P, max_pages=MP, n_kv_heads=Hkv, head_dim=D, dtype=dtype)
    lut = pc.lut.copy()
    lut[3, 0] = pc.kv_blocks.shape[0]  # sequence 3's first page lies past the pool: its keys do not exist
    q = rand(rng, (B, S, Hkv * group, D), dtype)
    for mask, W in (("null", -1), ("sliding_window_causal", 5), ("causal", -1)):
        args = [q, pc.kv_blocks, cache, lut, np.int32(1), vl]
        if uint32:
            args[2], args[3], args[4], args[5] = to_uint32(cache), to_uint32(lut), np.uint32(1), to_uint32(vl)
        got = np_out(jit_call(msa_ops.mha_padded_paged, *args, mask_str=mask, local_window_size=W, scale=0.3,
                              implementation=impl))
        ref = oracle.mha_padded_paged(*args, mask_str=mask, local_window_size=W, scale=0.3)
        assert_close(got, ref, budget_for(dtype), what=f"padded paged bad values {mask}")
        assert not got[4].astype(np.float32).any(), "a negative valid length owns no row"
        assert got[2].astype(np.float32).any(), "a valid length past S still owns S rows"
    for layer in (2, -1):
        got = np_out(jit_call(msa_ops.mha_padded_paged, q, pc.kv_blocks, cache, lut, np.int32(layer), vl,
                              implementation=impl))
        assert not got.astype(np.float32).any() and np.isfinite(got.astype(np.float32)).all()


# ==========================================================================================================
# mo.mha.ragged.no_cache / mo.mha.padded.no_cache
# ==========================================================================================================
NO_CACHE_MASKS = [("null", -1), ("causal", -1), ("sliding_window_causal", 6), ("sliding_window_noncausal", 5),
                  ("chunked_causal", 8)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask,W", NO_CACHE_MASKS)
@pytest.mark.parametrize("kv_offsets", ["separate", "omitted"])
def test_mha_ragged_no_cache(impl, seed, mask, W, kv_offsets):
    rng = np.random.default_rng(seed)
    dtype = BF16 if kv_offsets == "separate" else np.dtype(np.float32)
    H, Hkv, D, T, Tk = 8, 2, 64, 72, 110
    n = [0, int(rng.integers(1, 25)), int(rng.integers(1, 25)), 1]
    if kv_offsets == "separate":
        nk = [int(rng.integers(0, 10)), n[1] + int(rng.integers(0, 30)), max(0, n[2] - 3), 1 + int(rng.integers(20))]
    else:
        nk = n
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    koffs = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q = rand(rng, (T, H, D), dtype)
    k = rand(rng, (Tk if kv_offsets == "separate" else T, Hkv, D), dtype)
    v = rand(rng, k.shape, dtype)
    if kv_offsets == "separate":
        got = jit_call(msa_ops.mha_ragged_no_cache, q, k, v, offs, koffs, mask_str=mask, local_window_size=W,
                       implementation=impl)
        ref = oracle.mha_ragged_no_cache(q, k, v, offs, koffs, mask_str=mask, local_window_size=W)
    else:
        got = jit_call(msa_ops.mha_ragged_no_cache, q, k, v, offs, mask_str=mask, local_window_size=W,
                       implementation=impl)
        ref = oracle.mha_ragged_no_cache(q, k, v, offs, mask_str=mask, local_window_size=W)
    assert_close(np_out(got), ref, budget_for(dtype), what="mha_ragged_no_cache")


@pytest.mark.parametrize("mask,W", [("causal", -1), ("sliding_window_causal", 4), ("null", -1)])
def test_no_cache_f16_uint32_scale_bad_values(impl, mask, W):
    """Both no-cache ops in f16 with uint32 offsets and lengths and an explicit scale; bad values: non-monotone
    query and key offsets past their row counts, a negative valid length and one past both S and Sk."""
    rng = np.random.default_rng(52)
    dtype = np.dtype(np.float16)
    H, Hkv, D, T, Tk = 6, 3, 32, 30, 26
    q, k, v = rand(rng, (T, H, D), dtype), rand(rng, (Tk, Hkv, D), dtype), rand(rng, (Tk, Hkv, D), dtype)
    offs = np.array([2, 9, 7, 20, 41], np.int32)  # repaired [2, 9, 9, 20, 30]
    koffs = np.array([0, 12, 5, 19, 30], np.int32)  # repaired [0, 12, 12, 19, 26]
    args = (q, k, v, to_uint32(offs), to_uint32(koffs))
    got = np_out(jit_call(msa_ops.mha_ragged_no_cache, *args, mask_str=mask, local_window_size=W, scale=0.21,
                          implementation=impl))
    ref = oracle.mha_ragged_no_cache(*args, mask_str=mask, local_window_size=W, scale=0.21)
    assert_close(got, ref, budget_for(dtype), what=f"ragged no cache f16 {mask}")
    assert not got[:2].astype(np.float32).any(), "rows before offsets[0] are padding rows"
    B, S, Sk = 3, 7, 9
    qp, kp, vp = rand(rng, (B, S, H, D), dtype), rand(rng, (B, Sk, Hkv, D), dtype), rand(rng, (B, Sk, Hkv, D), dtype)
    vl = to_uint32(np.array([-1, 12, 5], np.int32))
    got = np_out(jit_call(msa_ops.mha_padded_no_cache, qp, kp, vp, vl, mask_str=mask, local_window_size=W,
                          scale=0.21, implementation=impl))
    ref = oracle.mha_padded_no_cache(qp, kp, vp, vl, mask_str=mask, local_window_size=W, scale=0.21)
    assert_close(got, ref, budget_for(dtype), what=f"padded no cache f16 {mask}")
    assert not got[0].astype(np.float32).any(), "a negative valid length owns no row"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask,W", NO_CACHE_MASKS)
@pytest.mark.parametrize("S,Sk", [(16, 24), (20, 12)])
def test_mha_padded_no_cache(impl, seed, mask, W, S, Sk):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.float32) if S < Sk else BF16
    B, H, Hkv, D = 4, 4, 1, 64
    vl = rng.integers(0, max(S, Sk) + 3, B).astype(np.int32)
    vl[0] = 0
    q = rand(rng, (B, S, H, D), dtype)
    k = rand(rng, (B, Sk, Hkv, D), dtype)
    v = rand(rng, (B, Sk, Hkv, D), dtype)
    got = jit_call(msa_ops.mha_padded_no_cache, q, k, v, vl, mask_str=mask, local_window_size=W,
                   implementation=impl)
    ref = oracle.mha_padded_no_cache(q, k, v, vl, mask_str=mask, local_window_size=W)
    assert_close(np_out(got), ref, budget_for(dtype), what="mha_padded_no_cache")


def edge_batch(seed, page, max_pages, n_kv_heads, group, head_dim, dtype):
    """A ragged batch at the page and cache edges: (rows, cache) per sequence of 1 key, a page less one, a page, a
    page plus one, S_max keys exactly, a cache past S_max, a sequence of no rows; three padding rows at the end."""
    rng = np.random.default_rng(seed)
    s_max = page * max_pages
    seqs = [(1, 0), (1, page - 1), (2, page - 2), (1, page), (3, page - 1), (page, page), (1, s_max - 1),
            (page, s_max - page), (4, s_max + 7), (0, 5), (5, 0)]
    n = np.array([a for a, _ in seqs])
    cache = np.array([c for _, c in seqs], np.int32)
    pc = make_paged_cache(rng, [min(s_max, a + c) for a, c in seqs], page_size=page, max_pages=max_pages,
                          n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype)
    q = rand(rng, (int(n.sum()) + 3, n_kv_heads * group, head_dim), dtype)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    return rng, (q, offs, pc.kv_blocks, cache, pc.lut, np.int32(1))


@pytest.mark.parametrize("mask,W", [("null", -1), ("causal", -1), ("sliding_window_causal", 1),
                                    ("sliding_window_causal", 16), ("sliding_window_noncausal", 1),
                                    ("sliding_window_noncausal", 64), ("chunked_causal", 1), ("chunked_causal", 48),
                                    ("chunked_causal", 64)])
@pytest.mark.parametrize("page", [1, 3, 16])
def test_mha_page_and_window_edges(impl, page, mask, W):
    """Keys at page boundaries and S_max, windows of one key and of a whole page table, pages of 1 and 3 tokens."""
    _, args = edge_batch(1, page, 64 // page, 2, 3, 32, np.dtype(np.float32))
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=mask, local_window_size=W, implementation=impl))
    ref = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W)
    assert_close(got, ref, budget_for(np.float32), what=f"page {page}, {mask}, W={W}")


@pytest.mark.parametrize("num_partitions", [0, 3, 64])
@pytest.mark.parametrize("group,n_kv_heads", [(5, 3), (16, 2), (65, 1)])
def test_mha_odd_groups_and_many_partitions(impl, group, n_kv_heads, num_partitions):
    """Groups that divide no tile (5, 65) and split counts past every sequence's keys (64), with sinks."""
    rng, args = edge_batch(3, 8, 4, n_kv_heads, group, 16, BF16)
    sinks = rand(rng, (n_kv_heads * group,), BF16, 2.0)
    got = np_out(jit_call(mha_sink, *args, sinks, mask_str="causal", num_partitions=num_partitions,
                          implementation=impl))
    ref = oracle.mha_ragged_paged(*args, mask_str="causal", sink_weights=sinks)
    assert_close(got, ref, budget_for(BF16), what=f"group {group}, {num_partitions} partitions")


def poison_unseen(kv_blocks, lut, cache, n, page, value=np.nan):
    """A copy of the pool with `value` in every key and value row no row of these sequences sees: every page no
    sequence's keys lie on, the slots past each sequence's last key. Returns it and the pages in use."""
    kv = np.array(kv_blocks)
    used = {int(lut[b, j]) for b, (c, m) in enumerate(zip(cache, n)) for j in range(-(-(c + m) // page))}
    for pg in set(range(kv.shape[0])) - used:
        kv[pg] = value
    for b, (c, m) in enumerate(zip(cache, n)):
        if (c + m) % page:
            kv[lut[b, (c + m) // page], :, :, (c + m) % page:] = value
    return kv


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_unseen_non_finite_keys_never_reach_an_output(impl, value, num_partitions):
    """NaN or Inf in keys and values no row sees (pages of no sequence, slots past a sequence's keys, and the last
    new token's key for the rows before it) reaches no output, not even as 0 * NaN; the rows that see no such key
    match the oracle. (What a row that does see one outputs is left open: docs/SEMANTICS.md.)"""
    rng = np.random.default_rng(71)
    n, cache, page = [5, 1, 9], [20, 0, 37], 16
    pc = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=page, max_pages=4, n_kv_heads=2,
                          head_dim=32, dtype=np.dtype(np.float32), junk_tail=False)
    kv = poison_unseen(pc.kv_blocks, pc.lut, cache, n, page, value)
    last = cache[2] + n[2] - 1  # the third sequence's last key: only its last row sees it
    kv[pc.lut[2, last // page], :, 1, last % page] = value
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 2, 8, 32), np.dtype(np.float32))
    args = (q, offs, kv, np.array(cache, np.int32), pc.lut, np.int32(1))
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, num_partitions=num_partitions, implementation=impl))
    ref = oracle.mha_ragged_paged(*args)
    clean = np.ones(q.shape[0], bool)
    clean[offs[-1] - 1] = False
    assert np.isfinite(got[clean]).all()
    assert_close(got[clean], ref[clean], budget_for(np.float32), what="rows that see no poisoned key")
    # MSA: pages of unselected blocks, and keys past a row's position inside the blocks it selects.
    n, cache = [1, 3, 4], [300, 126, 250]
    pm = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=128, max_pages=3, n_kv_heads=1,
                          head_dim=128, dtype=FP8 if value is np.nan else BF16, junk_tail=False)
    mkv = poison_unseen(pm.kv_blocks, pm.lut, cache, n, 128, value)
    last = cache[2] + n[2] - 1
    mkv[pm.lut[2, last // 128], :, 0, last % 128] = value
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 1, 4, 128), mkv.dtype)
    idx = np.stack([np.array([0, 2, -1], np.int32)] * q.shape[0])[None]  # block 1 unselected
    args = (q, offs, mkv, np.array(cache, np.int32), pm.lut, np.int32(0), idx)
    got = np_out(jit_call(msa_no_cro, *args, num_partitions=num_partitions, implementation=impl)).astype(np.float32)
    ref = oracle.msa_attention_ragged_paged(q, offs, None, *args[2:])
    clean = np.ones(q.shape[0], bool)
    clean[offs[-1] - 1] = False
    assert np.isfinite(got[clean]).all()
    assert_close(got[clean], ref[clean], budget_for(BF16, mkv.dtype), what="MSA rows that see no poisoned key")


@pytest.mark.parametrize("dt", ["bf16", "f16", "fp8"])
def test_store_keeps_every_bit(impl, dt):
    """The store moves bits: NaN payloads, -0 and subnormals in the new rows and in the pool it leaves alone come
    out as they went in."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(72)
    bits_of = {1: np.uint8, 2: np.uint16}[dtype.itemsize]
    pc = make_paged_cache(rng, [40, 30], page_size=16, max_pages=3, n_kv_heads=2, head_dim=16, dtype=dtype)
    special = np.array([0x7F, 0xFF, 0x80, 0x01] if dtype.itemsize == 1 else [0x7FC1, 0xFFF2, 0x8000, 0x0001],
                       bits_of)
    pool = pc.kv_blocks.copy()
    pool.view(bits_of).reshape(-1)[::7] = np.resize(special, pool.size)[::7]
    k = rand(rng, (9, 2, 16), dtype)
    k.view(bits_of).reshape(-1)[::3] = np.resize(special, k.size)[::3]
    v = k[::-1].copy()
    offs, cl = np.array([0, 4, 9], np.int32), np.array([30, 14], np.int32)
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, pool, k, v, offs, cl, pc.lut, np.int32(1),
                          implementation=impl))
    want = oracle.kv_cache_store_ragged_paged(pool, k, v, offs, cl, pc.lut, 1)
    np.testing.assert_array_equal(got.view(bits_of), np.asarray(want, dtype).view(bits_of))


# ==========================================================================================================
# mo.mha.decode.get_num_partitions
# ==========================================================================================================
@pytest.mark.parametrize("n_kv_heads,sm_count", [(1, 132), (2, 132), (8, 132), (8, 148), (4, 16), (1, 1)])
def test_get_num_partitions(impl, n_kv_heads, sm_count):
    fn = jax.jit(lambda b, m: msa_ops.mha_decode_get_num_partitions(b, m, n_kv_heads=n_kv_heads,
                                                                     sm_count=sm_count, implementation=impl))
    for batch in (1, 2, 3, 8, 17, 64, 200):
        for max_len in (0, 1, 511, 512, 1023, 1024, 4096, 5000, 100000, 10 ** 6):
            got = fn(np.int32(batch), np.int32(max_len))
            assert got.dtype == jnp.int32 and got.shape == ()
            want = oracle.get_num_partitions(batch, max_len, n_kv_heads=n_kv_heads, sm_count=sm_count)
            assert int(got) == want, (batch, max_len, n_kv_heads, sm_count, int(got), want)


@pytest.mark.parametrize("uint32", [False, True])
@pytest.mark.parametrize("n_kv_heads,sm_count", [(1, 132), (8, 132), (128, 148), (3, 2 ** 33), (2 ** 40, 2 ** 50)])
def test_get_num_partitions_extreme_batches(impl, n_kv_heads, sm_count, uint32):
    """batch * n_kv_heads past int32, and past int64 (formed by no handler), and batches <= 0 (divided by 1); as uint32,
    the negative ones are values above 2^31 - 1, which read negative (SEMANTICS.md §2)."""
    fn = jax.jit(lambda b, m: msa_ops.mha_decode_get_num_partitions(b, m, n_kv_heads=n_kv_heads,
                                                                     sm_count=sm_count, implementation=impl))
    cast = to_uint32 if uint32 else np.int32
    for batch in (-(2 ** 31), -3, 0, 5, 2 ** 24 + 1, 2 ** 28, 268435455, 2 ** 31 - 1):
        for max_len in (-700, 0, 1023, 10 ** 6, 2 ** 31 - 1):
            got = int(fn(cast(np.int32(batch)), cast(np.int32(max_len))))
            want = oracle.get_num_partitions(batch, max_len, n_kv_heads=n_kv_heads, sm_count=sm_count)
            assert got == want, (batch, max_len, n_kv_heads, sm_count, got, want)


# ==========================================================================================================
# split-K: num_partitions in {0, 1, 2, 7} give the same results
# ==========================================================================================================
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", ["decode", "spec", "mixed"])
def test_num_partitions_equivalent(impl, seed, scenario):
    dtype = np.dtype(np.float32)
    rng, batch, pc, q, layer = mha_inputs(seed, scenario, group=4, page_size=16, dtype=dtype, head_dim=64)
    H = q.shape[1]
    sinks = rng.standard_normal(H).astype(np.float32)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    ref = oracle.mha_ragged_paged(*args, sink_weights=sinks)
    outs = {}
    for npart in (0, 1, 2, 7):
        outs[npart] = np_out(jit_call(mha_sink, *args, sinks, num_partitions=npart,
                                      implementation=impl))
        assert_close(outs[npart], ref, budget_for(dtype), what=f"num_partitions={npart}")
    for npart in (0, 2, 7):
        assert_close(outs[npart], outs[1].astype(np.float64), 2 * budget_for(dtype),
                     what=f"num_partitions={npart} vs 1")
    # padded paged as well
    S = 3
    vl = np.array([1, 3, 0, 2], np.int32)
    cache = rng.integers(0, S_MAX - S + 1, 4).astype(np.int32)
    pc2 = make_paged_cache(rng, list(cache + vl), page_size=16, max_pages=S_MAX // 16, n_kv_heads=2,
                           head_dim=64, dtype=dtype)
    qp = rand(rng, (4, S, 8, 64), dtype)
    args2 = (qp, pc2.kv_blocks, cache, pc2.lut, np.int32(0), vl)
    ref2 = oracle.mha_padded_paged(*args2)
    for npart in (0, 1, 2, 7):
        got = np_out(jit_call(msa_ops.mha_padded_paged, *args2, num_partitions=npart, implementation=impl))
        assert_close(got, ref2, budget_for(dtype), what=f"padded num_partitions={npart}")


# ==========================================================================================================
# mo.msa.attention.ragged.paged
# ==========================================================================================================
MSA_MP = 4  # 512 tokens of 128-token blocks


def msa_indices(rng, batch: RaggedBatch, n_kv_heads, topk, *, junk=True):
    """Random block ids: valid blocks of the row's sequence, plus -1, duplicates and out-of-range ids."""
    idx = np.full((n_kv_heads, batch.T, topk), -1, np.int32)
    offs = batch.offsets
    for b in range(batch.B):
        n_blocks = -(-(batch.cache[b] + batch.n[b]) // 128)
        for t in range(offs[b], offs[b + 1]):
            for g in range(n_kv_heads):
                row = list(rng.permutation(max(n_blocks, 1))[:topk])
                if junk:
                    choices = [-1, -1, -5, MSA_MP, MSA_MP + 9, n_blocks, 1 << 20]
                    if row:
                        choices += [row[0]]  # duplicate
                    for s in range(topk):
                        if rng.random() < 0.3:
                            row = row[:s] + [int(rng.choice(choices))] + row[s + 1:]
                row = (row + [-1] * topk)[:topk]
                idx[g, t] = rng.permutation(row)
    # padding rows: random junk (must be ignored)
    idx[:, offs[-1]:] = rng.integers(-2, MSA_MP, (n_kv_heads, batch.T - offs[-1], topk))
    return idx


# (scenario, kv dtype, n_kv_heads, group, topk, cache_row_offsets given, uint32 ints)
MSA_CONFIGS = [
    ("decode", "bf16", 1, 8, 4, True, False),
    ("decode1", "fp8", 1, 8, 4, False, False),
    ("spec", "bf16", 2, 4, 3, True, False),
    ("mixed", "bf16", 1, 8, 4, False, True),
    ("long", "fp8", 1, 4, 2, True, False),
    ("prefill", "bf16", 2, 2, 4, True, False),
]


def msa_inputs(seed, scenario, dt, n_kv_heads, group, topk, uint32=False, num_layers=2):
    rng = np.random.default_rng(seed + 100)
    dtype = DTYPES[dt]
    batch = make_batch(rng, scenario, S_MAX)
    pc = make_paged_cache(rng, tokens_of(batch), page_size=128, max_pages=MSA_MP, n_kv_heads=n_kv_heads,
                          head_dim=128, num_layers=num_layers, dtype=dtype, std=1.0)
    q = rand(rng, (batch.T, n_kv_heads * group, 128), dtype)
    idx = msa_indices(rng, batch, n_kv_heads, topk)
    cro = oracle.kv_cache_row_offsets_ragged_paged(batch.offsets, batch.cache_lengths)
    offs, cl, lut = batch.offsets, batch.cache_lengths, pc.lut
    if uint32:
        offs, cl, lut, idx, cro = (to_uint32(x) for x in (offs, cl, lut, idx, cro))
    return rng, batch, pc, q, offs, cro, cl, lut, idx, dtype


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario,dt,n_kv_heads,group,topk,with_cro,uint32", MSA_CONFIGS)
def test_msa_attention(impl, seed, scenario, dt, n_kv_heads, group, topk, with_cro, uint32):
    _rng, _batch, pc, q, offs, cro, cl, lut, idx, dtype = msa_inputs(seed, scenario, dt, n_kv_heads, group, topk,
                                                                   uint32)
    layer = np.int32(seed % 2)
    args = (q, offs, cro if with_cro else None, pc.kv_blocks, cl, lut, layer, idx)
    if with_cro:
        got = jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation=impl)
    else:
        got = jit_call(msa_no_cro, q, offs, pc.kv_blocks, cl, lut, layer, idx, implementation=impl)
    got = np_out(got)
    assert got.dtype == BF16
    ref = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, ref, budget_for(BF16, dtype), what=f"msa[{scenario},{dt}]")


@pytest.mark.parametrize("num_partitions", [0, 2, 64])
def test_msa_blocks_past_the_sequence_and_no_blocks(impl, num_partitions):
    """Block ids below the page-table width whose pages exist (the table's tail names other sequences' pages) but
    lie past the sequence's keys select nothing; with one valid block among them a row sees that block only; with
    topk 0, no row sees a key. Rows before offsets[0] and after offsets[B] output 0."""
    rng = np.random.default_rng(17)
    mp, page, lead = 4, 128, 2
    n, cache = [1, 3, 1, 6], [0, 126, 255, 300]
    pc = make_paged_cache(rng, [a + c for a, c in zip(n, cache)], page_size=page, max_pages=mp, n_kv_heads=2,
                          head_dim=128, dtype=BF16, junk_tail=False)
    offs = (lead + np.concatenate([[0], np.cumsum(n)])).astype(np.int32)
    t = int(offs[-1]) + 2
    q = rand(rng, (t, 8, 128), BF16)
    cl = np.array(cache, np.int32)
    idx = np.full((2, t, 5), -1, np.int32)
    for b in range(len(n)):
        last = (cache[b] + n[b] - 1) // page  # the sequence's last block
        for r in range(offs[b], offs[b + 1]):
            past = list(range(last + 1, mp))
            idx[:, r, :len(past)] = past
            if r % 2:  # one valid block among them
                idx[:, r, 4] = int(rng.integers(0, last + 1))
    args = (q, offs, pc.kv_blocks, cl, pc.lut, np.int32(1), idx)
    got = np_out(jit_call(msa_no_cro, *args, num_partitions=num_partitions, implementation=impl))
    ref = oracle.msa_attention_ragged_paged(q, offs, None, *args[2:])
    assert_close(got, ref, budget_for(BF16), what="blocks past the sequence")
    rows_with_block = [r for r in range(offs[0], offs[-1]) if r % 2]
    assert not np.delete(got, rows_with_block, axis=0).astype(np.float32).any()
    assert got[rows_with_block].astype(np.float32).any()
    none = np_out(jit_call(msa_no_cro, *args[:-1], idx[:, :, :0], num_partitions=num_partitions,
                           implementation=impl))
    assert none.shape == q.shape and not none.astype(np.float32).any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", ["decode", "spec"])
def test_msa_num_partitions_equivalent(impl, seed, scenario):
    _rng, _batch, pc, q, offs, cro, cl, lut, idx, _dtype = msa_inputs(seed, scenario, "bf16", 1, 8, 8)
    args = (q, offs, cro, pc.kv_blocks, cl, lut, np.int32(1), idx)
    ref = oracle.msa_attention_ragged_paged(*args)
    for npart in (0, 1, 2, 7):
        got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *args, num_partitions=npart,
                              implementation=impl))
        assert_close(got, ref, budget_for(BF16), what=f"msa num_partitions={npart}")


# ==========================================================================================================
# mo.msa.indexer.ragged.paged
# ==========================================================================================================
IDX_MP = 8  # 1024 tokens


def assert_indexer_matches(got, ref, scores, eligible, topk, init_blocks, local_blocks, rtol=1e-3):
    """Exact match, except that blocks whose oracle score is within rtol of the k-th best may be swapped."""
    got = np.asarray(got)
    assert got.shape == ref.shape and got.dtype == np.int32, (got.shape, got.dtype)
    Hi, T, _ = ref.shape
    for h in range(Hi):
        for t in range(T):
            g, r = got[h, t], ref[h, t]
            if np.array_equal(g, r):
                continue
            ctx = f"head {h} row {t}: got {g.tolist()} expected {r.tolist()}"
            gv = [int(x) for x in g if x != -1]
            rv = [int(x) for x in r if x != -1]
            assert len(gv) == len(rv), ctx
            assert gv == sorted(set(gv)), f"ids must be ascending, distinct, then -1: {ctx}"
            assert (g[len(gv):] == -1).all(), ctx
            assert all(0 <= j < eligible.shape[1] and eligible[t, j] for j in gv), f"ineligible id: {ctx}"
            elig = list(np.flatnonzero(eligible[t]))
            forced = set(elig[:init_blocks]) | (set(elig[len(elig) - local_blocks:]) if local_blocks else set())
            assert forced <= set(gv), f"forced blocks {sorted(forced)} missing: {ctx}"
            s = scores[h, t]
            kth = min(s[j] for j in rv if j not in forced)
            for j in set(gv) ^ set(rv):
                assert abs(s[j] - kth) <= rtol * max(abs(kth), abs(s[j]), 1e-6), (
                    f"block {j} score {s[j]:.6g} vs k-th best {kth:.6g}: {ctx}")


# (scenario, topk, init, local, dtype, Di, uint32 ints)
INDEXER_CONFIGS = [
    ("decode", 4, 1, 1, "bf16", 64, False),
    ("mixed", 3, 0, 0, "f32", 128, False),
    ("long", 4, 1, 2, "bf16", 128, False),
    ("spec", 8, 0, 0, "f32", 64, False),  # topk >= every eligible block
    ("prefill", 2, 1, 1, "bf16", 64, False),
    ("mixed", 3, 1, 0, "bf16", 64, True),
    ("long", 3, 1, 1, "f16", 64, True),
]


def indexer_inputs(seed, scenario, dt, Di, Hi=4, num_layers=2):
    rng = np.random.default_rng(seed + 200)
    dtype = DTYPES[dt]
    batch = make_batch(rng, scenario, IDX_MP * 128)
    if scenario == "long":  # longer caches to get more blocks than topk
        batch.cache = [int(rng.integers(300, 1024 - batch.n[0] + 1)), int(rng.integers(0, 900))]
    pc = make_paged_cache(rng, tokens_of(batch), page_size=128, max_pages=IDX_MP, n_kv_heads=1, head_dim=Di,
                          num_layers=num_layers, dtype=dtype, kv=1)
    q = rand(rng, (batch.T, Hi, Di), dtype)
    return rng, batch, pc, q, dtype


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario,topk,init_blocks,local_blocks,dt,Di,uint32", INDEXER_CONFIGS)
def test_msa_indexer(impl, seed, scenario, topk, init_blocks, local_blocks, dt, Di, uint32):
    _rng, batch, pc, q, _dtype = indexer_inputs(seed, scenario, dt, Di)
    layer = np.int32(1 - seed % 2)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    if uint32:
        args = (q, *(to_uint32(x) for x in args[1:2]), pc.kv_blocks,
                *(to_uint32(x) for x in args[3:]))
    kw = {"topk": topk, "init_blocks": init_blocks, "local_blocks": local_blocks}
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *args, implementation=impl, **kw))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, ref, scores, elig, topk, init_blocks, local_blocks)
    assert (got[:, batch.offsets[-1]:] == -1).all(), "padding rows must be -1"


# ==========================================================================================================
# mo.kv_cache.store.ragged.paged / mo.kv_cache.row_offsets.ragged.paged
# ==========================================================================================================
def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario,dt,page_size", [("mixed", "bf16", 16), ("decode", "f32", 128),
                                                   ("long", "bf16", 128), ("prefill", "f16", 16)])
def test_kv_cache_store(impl, seed, scenario, dt, page_size):
    rng = np.random.default_rng(seed + 300)
    dtype = DTYPES[dt]
    batch = make_batch(rng, scenario, S_MAX)
    Hkv, D, L = 2, 64, 3
    pc = make_paged_cache(rng, tokens_of(batch), page_size=page_size, max_pages=S_MAX // page_size,
                          n_kv_heads=Hkv, head_dim=D, num_layers=L, dtype=dtype)
    k = rand(rng, (batch.T, Hkv, D), dtype)
    v = rand(rng, (batch.T, Hkv, D), dtype)
    layer = np.int32(rng.integers(L))
    args = (pc.kv_blocks, k, v, batch.offsets, batch.cache_lengths, pc.lut, layer)
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, *args, implementation=impl))
    want = oracle.kv_cache_store_ragged_paged(*args)
    assert got.dtype == dtype and got.shape == pc.kv_blocks.shape
    np.testing.assert_array_equal(bits(got), bits(want))
    # the test is meaningful: exactly the new tokens changed
    changed = np.any(bits(got) != bits(pc.kv_blocks), axis=(1, 2, 4, 5)).sum()
    assert changed == sum(batch.n)


@pytest.mark.parametrize("uint32", [False, True])
def test_kv_cache_store_drops_rows(impl, uint32):
    """Rows past the page table, rows on invalid pages, padding rows, bad layers: nothing written."""
    rng = np.random.default_rng(7)
    P, MP, Hkv, D, L = 16, 4, 1, 32, 2
    dtype = BF16
    n = [5, 8, 3, 4]
    # seq 0: positions 62..66 -> only 62, 63 fit (S_max = 64); seq 1: 10..17 on two invalid pages;
    # seq 2: 30, 31 on a valid page, 32 on an invalid one; seq 3: 0..3
    cache = [62, 10, 30, 0]
    pc = make_paged_cache(rng, [64, 16, 48, 4], page_size=P, max_pages=MP, n_kv_heads=Hkv, head_dim=D,
                          num_layers=L, dtype=dtype)
    lut = pc.lut.copy()
    lut[1, 0] = -1
    lut[1, 1] = pc.kv_blocks.shape[0] + 3
    lut[2, 2] = 1 << 30
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T = int(offs[-1]) + 3  # 3 padding rows
    k = rand(rng, (T, Hkv, D), dtype)
    v = rand(rng, (T, Hkv, D), dtype)
    cl = np.array(cache, np.int32)
    for layer in (0, 1, 2, -1):
        args = [pc.kv_blocks, k, v, offs, cl, lut, np.int32(layer)]
        if uint32:
            args[3:6] = [to_uint32(x) for x in args[3:6]]
            args[6] = to_uint32(args[6])
        got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, *args, implementation=impl))
        want = oracle.kv_cache_store_ragged_paged(*args)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"layer {layer}")
    # sanity of the oracle on this case (layer 0): 2 + 0 + 2 + 4 slots written
    want = oracle.kv_cache_store_ragged_paged(pc.kv_blocks, k, v, offs, cl, lut, np.int32(0))
    assert np.any(bits(want) != bits(pc.kv_blocks), axis=(1, 2, 4, 5)).sum() == 2 + 0 + 2 + 4


def test_kv_cache_store_huge_cache_lengths(impl):
    """cache_lengths near INT32_MAX: c_b + i must not wrap around into the pool; 0xFFFFFFFF reads -1 -> 0."""
    rng = np.random.default_rng(12)
    pc = make_paged_cache(rng, [64, 64, 64], page_size=16, max_pages=4, n_kv_heads=1, head_dim=32, dtype=BF16)
    offs = np.array([0, 4, 8, 11], np.int32)
    k = rand(rng, (11, 1, 32), BF16)
    for cl in (np.array([2 ** 31 - 1, 2 ** 31 - 3, 5], np.int64).astype(np.int32),
               to_uint32(np.array([-1, 2 ** 31 - 2, 63], np.int64).astype(np.int32))):
        args = (pc.kv_blocks, k, k, offs if cl.dtype == np.int32 else to_uint32(offs), cl, pc.lut, np.int32(0))
        got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, *args, implementation=impl))
        np.testing.assert_array_equal(bits(got), bits(oracle.kv_cache_store_ragged_paged(*args)),
                                      err_msg=f"cache_lengths {cl.tolist()}")


def test_kv_cache_store_donated(impl):
    rng = np.random.default_rng(8)
    batch = make_batch(rng, "mixed", S_MAX)
    pc = make_paged_cache(rng, tokens_of(batch), page_size=16, max_pages=32, n_kv_heads=2, head_dim=64,
                          dtype=BF16)
    k = rand(rng, (batch.T, 2, 64), BF16)
    v = rand(rng, (batch.T, 2, 64), BF16)
    want = oracle.kv_cache_store_ragged_paged(pc.kv_blocks, k, v, batch.offsets, batch.cache_lengths, pc.lut, 1)
    fn = jax.jit(lambda kv, *a: msa_ops.kv_cache_store_ragged_paged(kv, *a, implementation=impl),
                 donate_argnums=0)
    kv_dev = jnp.asarray(pc.kv_blocks)
    got = np_out(fn(kv_dev, k, v, batch.offsets, batch.cache_lengths, pc.lut, np.int32(1)))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("uint32", [False, True])
def test_kv_cache_row_offsets(impl, seed, uint32):
    rng = np.random.default_rng(seed + 400)
    B = 6
    n = rng.integers(0, 20, B)
    n[0] = 0
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    cl = rng.integers(-5, 1000, B).astype(np.int32)
    if uint32:
        offs, cl = to_uint32(offs), to_uint32(cl)
    got = np_out(jit_call(msa_ops.kv_cache_row_offsets_ragged_paged, offs, cl, implementation=impl))
    want = oracle.kv_cache_row_offsets_ragged_paged(offs, cl)
    assert got.dtype == np.int32 and got.shape == (B + 1,)
    np.testing.assert_array_equal(got, want)


# ==========================================================================================================
# bad values: invalid pages, cache lengths past S_max, non-monotone / out-of-range offsets, layer out of range
# ==========================================================================================================
@pytest.mark.parametrize("uint32", [False, True])
def test_mha_bad_values(impl, uint32):
    rng = np.random.default_rng(9)
    dtype = np.dtype(np.float32)
    P, MP, Hkv, H, D = 16, 8, 2, 4, 64
    S = MP * P
    # seq 0: all its pages invalid (fully masked rows -> 0); seq 1: cache past S_max; seq 2: one bad page;
    # offsets non-monotone and past T.
    cache = np.array([20, 10 ** 6, 40, 5], np.int32)
    pc = make_paged_cache(rng, [S] * 4, page_size=P, max_pages=MP, n_kv_heads=Hkv, head_dim=D, dtype=dtype)
    lut = pc.lut.copy()
    lut[0, :] = -1
    lut[2, 1] = pc.kv_blocks.shape[0]
    T = 40
    offs = np.array([0, 6, 10, 20, 33], np.int32)
    q = rand(rng, (T, H, D), dtype)
    offs_bad = np.array([-3, 6, 4, 20, 70], np.int32)  # repaired [0, 6, 6, 20, 40]
    for o in (offs, offs_bad):
        for mask, W in (("causal", -1), ("sliding_window_noncausal", 9)):
            args = [q, o, pc.kv_blocks, cache, lut, np.int32(1)]
            if uint32:
                args[1], args[3], args[4] = to_uint32(o), to_uint32(cache), to_uint32(lut)
            got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=mask, local_window_size=W,
                                  implementation=impl))
            ref = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W)
            assert_close(got, ref, budget_for(dtype), what=f"bad values offs={o.tolist()} {mask}")
            assert not got[:6].any(), "sequence with no valid page must output 0"
    # with a sink: the rows that see no key still output 0 (the sink alone weighs no value)
    sinks = rand(rng, (H,), np.float32)
    args = [q, offs, pc.kv_blocks, cache, lut, np.int32(1)]
    got = np_out(jit_call(mha_sink, *args, sinks, implementation=impl))
    assert_close(got, oracle.mha_ragged_paged(*args, sink_weights=sinks), budget_for(dtype), what="bad values, sink")
    assert not got[:6].any(), "rows with no visible key output 0, with a sink too"
    # layer out of range -> all zeros (also for MSA and the indexer below)
    for layer in (2, -1, 1 << 20):
        got = np_out(jit_call(msa_ops.mha_ragged_paged, q, offs, pc.kv_blocks, cache, pc.lut, np.int32(layer),
                              implementation=impl))
        assert not got.any() and np.isfinite(got).all()


def test_msa_and_indexer_bad_layer(impl):
    _, batch, pc, q, offs, cro, cl, lut, idx, _ = msa_inputs(0, "mixed", "bf16", 1, 8, 4)
    for layer in (2, -1):
        got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, q, offs, cro, pc.kv_blocks, cl, lut,
                              np.int32(layer), idx, implementation=impl))
        assert not got.astype(np.float32).any()
    _, batch, pc, q, _ = indexer_inputs(0, "mixed", "bf16", 64)
    for layer in (2, -1):
        got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, q, batch.offsets, pc.kv_blocks,
                              batch.cache_lengths, pc.lut, np.int32(layer), topk=3, implementation=impl))
        assert (got == -1).all()


def test_no_sequence_and_no_key(impl):
    """Calls whose shapes leave nothing to attend (SEMANTICS.md §12): ragged offsets of one entry (B = 0), so
    that every one of T > 0 rows is a padding row, and no-cache K/V with no key row. Random operands, so a handler
    that read rows it does not own, or keys that do not exist, would show."""
    rng = np.random.default_rng(71)
    T, H, Hkv, D, P, MP = 7, 4, 2, 64, 16, 3
    o0, c0 = np.array([0], np.int32), np.zeros((0,), np.int32)
    lut0 = np.zeros((0, MP), np.int32)
    q = rand(rng, (T, H, D), np.float32)
    kv = rand(rng, (5, 2, 2, P, Hkv, D), np.float32)
    args = (q, o0, kv, c0, lut0, np.int32(1))
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, implementation=impl))
    assert_close(got, oracle.mha_ragged_paged(*args), 1e-6, what="ragged paged, B = 0")
    assert not got.any()
    k = rand(rng, (T, Hkv, D), np.float32)
    ks = rand(rng, (5, 2, 1, P, Hkv, D), np.float32)
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, ks, k, k, o0, c0, lut0, np.int32(0),
                          implementation=impl))
    np.testing.assert_array_equal(got, ks)
    # MSA and its indexer (page size 128, head dim 128)
    qm = rand(rng, (T, 4, 128), BF16)
    kvm = rand(rng, (3, 2, 1, 128, 1, 128), BF16)
    idx = rng.integers(-1, MP, (1, T, 4)).astype(np.int32)
    got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, qm, o0, None, kvm, c0, lut0, np.int32(0), idx,
                          implementation=impl))
    assert got.shape == (T, 4, 128) and not got.astype(np.float32).any()
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, qm, o0, kvm[:, :1], c0, lut0, np.int32(0), topk=2,
                          implementation=impl))
    assert got.shape == (4, T, 2) and (got == -1).all()
    # no key: ragged (Tk = 0, two sequences of rows) and padded (Sk = 0)
    k0 = np.zeros((0, Hkv, D), np.float32)
    offs = np.array([0, 3, T], np.int32)
    qp = rand(rng, (2, 5, H, D), np.float32)
    kp0 = np.zeros((2, 0, Hkv, D), np.float32)
    vl = np.array([3, 5], np.int32)
    for mask, W in (("null", -1), ("causal", -1), ("sliding_window_noncausal", 4)):
        got = np_out(jit_call(msa_ops.mha_ragged_no_cache, q, k0, k0, offs, np.zeros((3,), np.int32),
                              mask_str=mask, local_window_size=W, implementation=impl))
        ref = oracle.mha_ragged_no_cache(q, k0, k0, offs, np.zeros((3,), np.int32), mask_str=mask,
                                         local_window_size=W)
        assert_close(got, ref, 1e-6, what=f"ragged no cache, Tk = 0, {mask}")
        assert not got.any()
        got = np_out(jit_call(msa_ops.mha_padded_no_cache, qp, kp0, kp0, vl, mask_str=mask, local_window_size=W,
                              implementation=impl))
        ref = oracle.mha_padded_no_cache(qp, kp0, kp0, vl, mask_str=mask, local_window_size=W)
        assert_close(got, ref, 1e-6, what=f"padded no cache, Sk = 0, {mask}")
        assert not got.any()


def test_msa_indexer_store_bad_values(impl):
    """MSA attention and the indexer with non-monotone offsets (one past T) and cache lengths past S_max and
    below 0 (MSA also with page-table entries outside the pool); the indexer's exact ties (two blocks on one page:
    the lower block id wins); the fp8 store with rows dropped; row offsets from non-monotone offsets, wrapping in
    int32. All against the oracle."""
    _, batch, pc, q, offs, cro, cl, lut, idx, dtype = msa_inputs(2, "mixed", "bf16", 2, 4, 6)
    T = batch.T
    offs_bad = offs.copy()
    offs_bad[1] = offs[2] + 2  # above the next entry: repaired as a running max
    offs_bad[-1] = T + 9  # past T: clamped
    cl_bad = cl.copy()
    cl_bad[0], cl_bad[1] = 10 ** 6, -4
    lut_bad = np.array(lut, np.int32)
    lut_bad[-1, 0], lut_bad[-1, 1] = -1, pc.kv_blocks.shape[0] + 5  # selected blocks whose pages do not exist
    args = (q, offs_bad, None, pc.kv_blocks, cl_bad, lut_bad, np.int32(1), idx)
    got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation=impl))
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(dtype), what="MSA bad offsets")
    _, ib, ipc, iq, _ = indexer_inputs(2, "long", "bf16", 64)
    ilut = ipc.lut.copy()
    ilut[0, 1] = ilut[0, 2]  # blocks 1 and 2 of sequence 0 read one page: their scores tie exactly
    io = ib.offsets.copy()
    io[0] = -3  # repaired to 0
    icl = np.array([ib.cache_lengths[0], 10 ** 6], np.int32)
    kw = {"topk": 3, "init_blocks": 1, "local_blocks": 0}
    iargs = (iq, io, ipc.kv_blocks, icl, ilut, np.int32(1))
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *iargs, implementation=impl, **kw))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*iargs, return_scores=True, **kw)
    np.testing.assert_array_equal(got[:, : ib.n[0]], ref[:, : ib.n[0]])  # sequence 0 (the ties): exact
    assert_indexer_matches(got, ref, scores, elig, **kw)
    rng = np.random.default_rng(41)
    P, MP, Hkv, D = 8, 3, 2, 16
    ks = make_paged_cache(rng, [P * MP] * 3, page_size=P, max_pages=MP, n_kv_heads=Hkv, head_dim=D,
                          dtype=DTYPES["fp8"])
    slut = ks.lut.copy()
    slut[0, 1] = -1  # sequence 0's keys 8-10 are dropped, 6-7 written
    slut[2, 1] = ks.kv_blocks.shape[0] + 3  # sequence 2's keys 14-15 are dropped (a page past the pool), 16-23 written
    so = np.array([0, 5, 3, 16], np.int32)  # repaired [0, 5, 5, 16]: sequence 1 owns no row, row 16 no sequence
    scl = np.array([6, 7, 14], np.int32)  # sequence 2's key 24 lies past its page table
    kn = rand(rng, (17, Hkv, D), DTYPES["fp8"])
    vn = rand(rng, (17, Hkv, D), DTYPES["fp8"])
    sargs = (ks.kv_blocks, kn, vn, so, scl, slut, np.int32(1))
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, *sargs, implementation=impl))
    np.testing.assert_array_equal(bits(got), bits(oracle.kv_cache_store_ragged_paged(*sargs)))
    ro, rcl = np.array([2, 5, 1, 7, 7], np.int32), np.array([1, 2 ** 31 - 3, 1, -6], np.int32)
    got = np_out(jit_call(msa_ops.kv_cache_row_offsets_ragged_paged, ro, rcl, implementation=impl))
    np.testing.assert_array_equal(got, oracle.kv_cache_row_offsets_ragged_paged(ro, rcl))


def test_explicit_scale_and_mask_aliases(impl):
    """A non-default `scale` and MAX's `_mask` spellings, on every attention op and the indexer."""
    _, batch, pc, q, layer = mha_inputs(6, "mixed", group=4, page_size=16, dtype=np.float32, head_dim=64)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    for mask, W in (("causal_mask", -1), ("sliding_window_causal_mask", 20), ("chunked_causal_mask", 16)):
        got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=mask, local_window_size=W, scale=0.37,
                              implementation=impl))
        ref = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=W, scale=0.37)
        assert_close(got, ref, 1e-5, what=f"scale=0.37 {mask}")
    rng = np.random.default_rng(66)
    qn, kn = rand(rng, (30, 4, 64), np.float32), rand(rng, (30, 2, 64), np.float32)
    offs = np.array([0, 12, 30], np.int32)
    got = np_out(jit_call(msa_ops.mha_ragged_no_cache, qn, kn, kn, offs, mask_str="null_mask", scale=0.05,
                          implementation=impl))
    assert_close(got, oracle.mha_ragged_no_cache(qn, kn, kn, offs, mask_str="null", scale=0.05), 1e-5,
                 what="no_cache scale")
    _, batch, pcm, qm, offs, cro, cl, lut, idx, _ = msa_inputs(3, "spec", "bf16", 1, 8, 4)
    margs = (qm, offs, cro, pcm.kv_blocks, cl, lut, np.int32(0), idx)
    got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *margs, scale=0.02, implementation=impl))
    assert_close(got, oracle.msa_attention_ragged_paged(*margs, scale=0.02), budget_for(BF16), what="msa scale")
    _, batch, pcx, qx, _ = indexer_inputs(4, "decode", "f32", 64)
    iargs = (qx, batch.offsets, pcx.kv_blocks, batch.cache_lengths, pcx.lut, np.int32(0))
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *iargs, topk=3, scale=-1.0, implementation=impl))
    ref, sc, el = oracle.msa_indexer_ragged_paged(*iargs, topk=3, scale=-1.0, return_scores=True)
    assert_indexer_matches(got, ref, sc, el, 3, 0, 0)


def test_auto_implementation():
    """implementation="auto" (the default) gives the oracle's result too."""
    _, batch, pc, q, layer = mha_inputs(7, "mixed", group=4, page_size=16, dtype=BF16, head_dim=64)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args))
    assert_close(got, oracle.mha_ragged_paged(*args), budget_for(BF16), what="auto")


def test_hints_do_not_change_results(impl):
    """Hints steer routing only: correct and even misleading hints give the oracle's result."""
    _, batch, pc, q, layer = mha_inputs(3, "mixed", group=4, page_size=16, dtype=BF16, head_dim=64)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
    ref = oracle.mha_ragged_paged(*args)
    for hints in ({"max_prompt_length": max(batch.n), "max_cache_length": max(batch.cache),
                       "total_context_length": int(sum(tokens_of(batch)))},
                  {"max_prompt_length": 1, "max_cache_length": 1},  # misleading: says "decode, tiny cache"
                  {"max_prompt_length": batch.T, "max_cache_length": 10 ** 5}):
        got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, implementation=impl, **hints))
        assert_close(got, ref, budget_for(BF16), what=f"hints {hints}")


def test_msa_hints_do_not_change_results(impl):
    """MSA's hints on a mixed batch (ones that say decode or speculative decode, and MAX's scalar-args hints) are
    accepted and give the oracle's result. The CPU handlers take no route from them, so the routes the hints pick
    are checked on CUDA (test_cuda_msa_hints_route)."""
    _, batch, pc, q, offs, cro, cl, lut, idx, dtype = msa_inputs(5, "mixed", "bf16", 2, 4, 6)
    args = (q, offs, cro, pc.kv_blocks, cl, lut, np.int32(1), idx)
    ref = oracle.msa_attention_ragged_paged(*args)
    for hints in ({"max_prompt_length": max(batch.n)}, {"max_prompt_length": 1}, {"max_prompt_length": 4},
                  {"msa_scalar_args": 1, "mha_decode_dispatch_metadata": 3}):
        got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation=impl, **hints))
        assert_close(got, ref, budget_for(dtype), what=f"MSA hints {hints}")


# ==========================================================================================================
# layer_idx traced inside lax.scan; vmap over a leading batch axis
# ==========================================================================================================
def test_layer_idx_traced_in_scan(impl):
    L = 3
    _, batch, pc, _, _ = mha_inputs(4, "mixed", group=4, page_size=16, dtype=BF16, head_dim=64, num_layers=L)
    rng = np.random.default_rng(44)
    layers = np.array([0, 1, 2, 3, 1], np.int32)  # 3 is out of range -> zeros
    qs = rand(rng, (len(layers), batch.T, 8, 64), BF16)

    @jax.jit
    def run(qs, layers, kv, offs, cl, lut):
        def body(carry, x):
            q, layer = x
            return carry, msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, layer, implementation=impl)

        return jax.lax.scan(body, 0, (qs, layers))[1]

    got = np_out(run(qs, layers, pc.kv_blocks, batch.offsets, batch.cache_lengths, pc.lut))
    for i, layer in enumerate(layers):
        ref = oracle.mha_ragged_paged(qs[i], batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer)
        assert_close(got[i], ref, budget_for(BF16), what=f"scan step {i} layer {layer}")

    # the store inside a scan over layers, carrying the cache
    k = rand(rng, (len(layers), batch.T, 2, 64), BF16)

    @jax.jit
    def store_all(kv, ks, layers, offs, cl, lut):
        def body(kv, x):
            kk, layer = x
            return msa_ops.kv_cache_store_ragged_paged(kv, kk, kk, offs, cl, lut, layer,
                                                       implementation=impl), None

        return jax.lax.scan(body, kv, (ks, layers))[0]

    got = np_out(store_all(pc.kv_blocks, k, layers, batch.offsets, batch.cache_lengths, pc.lut))
    want = pc.kv_blocks
    for i, layer in enumerate(layers):
        want = oracle.kv_cache_store_ragged_paged(want, k[i], k[i], batch.offsets, batch.cache_lengths, pc.lut,
                                                  layer)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_msa_and_indexer_layer_idx_in_scan(impl):
    _, batch, pc, q, offs, cro, cl, lut, idx, _ = msa_inputs(1, "spec", "bf16", 1, 8, 4, num_layers=3)
    layers = np.array([2, 0, 1], np.int32)

    @jax.jit
    def run(layers, q, kv):
        return jax.lax.scan(lambda c, l: (c, msa_ops.msa_attention_ragged_paged(
            q, offs, cro, kv, cl, lut, l, idx, implementation=impl)), 0, layers)[1]

    got = np_out(run(layers, q, pc.kv_blocks))
    for i, layer in enumerate(layers):
        ref = oracle.msa_attention_ragged_paged(q, offs, cro, pc.kv_blocks, cl, lut, layer, idx)
        assert_close(got[i], ref, budget_for(BF16), what=f"msa scan layer {layer}")

    _, batch, pcx, qx, _ = indexer_inputs(1, "decode", "f32", 64, num_layers=3)

    @jax.jit
    def run_idx(layers, q, kb):
        return jax.lax.scan(lambda c, l: (c, msa_ops.msa_indexer_ragged_paged(
            q, batch.offsets, kb, batch.cache_lengths, pcx.lut, l, topk=3, init_blocks=1, local_blocks=1,
            implementation=impl)), 0, layers)[1]

    got = np_out(run_idx(layers, qx, pcx.kv_blocks))
    for i, layer in enumerate(layers):
        ref, sc, el = oracle.msa_indexer_ragged_paged(qx, batch.offsets, pcx.kv_blocks, batch.cache_lengths,
                                                      pcx.lut, layer, topk=3, init_blocks=1, local_blocks=1,
                                                      return_scores=True)
        assert_indexer_matches(got[i], ref, sc, el, 3, 1, 1)


def test_vmap_every_operand(impl):
    """vmap over every operand at once (each element its own batch, pool, page table and layer; the pool's batch
    axis in another position, out_axes 1), and over the store's pool, k and v with the pool batched or shared."""
    rng = np.random.default_rng(56)
    cases = [mha_inputs(60 + i, sc, group=2, page_size=16, dtype=np.dtype(np.float32), head_dim=32)[1:]
             for i, sc in enumerate(["mixed", "decode", "spec"])]
    t = max(b.T for b, _, _, _ in cases)
    pad = lambda x: np.concatenate([x, np.zeros((t - x.shape[0],) + x.shape[1:], x.dtype)])
    qs = np.stack([pad(q) for _, _, q, _ in cases])
    nseq = max(len(b.cache_lengths) for b, _, _, _ in cases)  # the sequences past a batch's own hold no rows
    offs = np.stack([np.pad(b.offsets, (0, nseq + 1 - len(b.offsets)), mode="edge") for b, _, _, _ in cases])
    cls = np.stack([np.pad(b.cache_lengths, (0, nseq - len(b.cache_lengths))) for b, _, _, _ in cases])
    nb = max(pc.kv_blocks.shape[0] for _, pc, _, _ in cases)
    kvs = np.stack([np.concatenate([pc.kv_blocks, rand(rng, (nb - pc.kv_blocks.shape[0],) + pc.kv_blocks.shape[1:],
                                                       np.float32)]) for _, pc, _, _ in cases], axis=3)
    luts = np.stack([np.pad(pc.lut, ((0, nseq - pc.lut.shape[0]), (0, 0)), constant_values=-1)
                     for _, pc, _, _ in cases])
    layers = np.array([1, 0, 1], np.int32)
    f = lambda q, o, kv, c, lut, layer: msa_ops.mha_ragged_paged(q, o, kv, c, lut, layer, mask_str="causal",
                                                                 num_partitions=2, implementation=impl)
    got = np_out(jax.jit(jax.vmap(f, in_axes=(0, 0, 3, 0, 0, 0), out_axes=1))(qs, offs, kvs, cls, luts, layers))
    for i in range(3):
        ref = oracle.mha_ragged_paged(qs[i], offs[i], kvs[:, :, :, i], cls[i], luts[i], layers[i])
        assert_close(got[:, i], ref, 1e-5, what=f"vmap of every operand [{i}]")
    k = rand(rng, (3, t, 2, 32), np.float32)
    store = lambda kv, k, o, c, lut, layer: msa_ops.kv_cache_store_ragged_paged(kv, k, k, o, c, lut, layer,
                                                                                implementation=impl)
    pools = np.moveaxis(kvs, 3, 0)
    got = np_out(jax.jit(jax.vmap(store))(pools, k, offs, cls, luts, layers))
    shared = np_out(jax.jit(jax.vmap(store, in_axes=(None, 0, None, None, None, None)))(
        pools[0], k, offs[0], cls[0], luts[0], layers[0]))
    for i in range(3):
        want = oracle.kv_cache_store_ragged_paged(pools[i], k[i], k[i], offs[i], cls[i], luts[i], layers[i])
        np.testing.assert_array_equal(bits(got[i]), bits(want), err_msg=f"store, pool batched [{i}]")
        want = oracle.kv_cache_store_ragged_paged(pools[0], k[i], k[i], offs[0], cls[0], luts[0], layers[0])
        np.testing.assert_array_equal(bits(shared[i]), bits(want), err_msg=f"store, pool shared [{i}]")


def test_vmap_matches_loop(impl):
    V, L = 3, 2
    _, batch, pc, _, _ = mha_inputs(5, "mixed", group=4, page_size=16, dtype=np.float32, head_dim=64,
                                    num_layers=L)
    rng = np.random.default_rng(55)
    qs = rand(rng, (V, batch.T, 8, 64), np.float32)
    layers = np.array([1, 0, 1], np.int32)
    f = lambda q, l: msa_ops.mha_ragged_paged(q, batch.offsets, pc.kv_blocks, batch.cache_lengths,
                                              pc.lut, l, implementation=impl)
    got = np_out(jax.jit(jax.vmap(f))(qs, layers))
    got_q_only = np_out(jax.jit(jax.vmap(f, in_axes=(0, None)))(qs, np.int32(1)))
    loop = jax.jit(f)
    for i in range(V):
        one = np_out(loop(qs[i], layers[i]))
        ref = oracle.mha_ragged_paged(qs[i], batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layers[i])
        assert_close(got[i], ref, 1e-5, what=f"vmap[{i}]")
        assert_close(got[i], one.astype(np.float64), 1e-6, what=f"vmap[{i}] vs loop")
        assert_close(got_q_only[i], np_out(loop(qs[i], np.int32(1))).astype(np.float64), 1e-6,
                     what=f"vmap q only [{i}]")

    # MSA attention and the indexer, vmapped over q and layer_idx
    _, batch, pcm, q, offs, cro, cl, lut, idx, _ = msa_inputs(2, "mixed", "bf16", 1, 8, 4)
    qm = np.stack([q, rand(rng, q.shape, BF16), rand(rng, q.shape, BF16)])
    fm = lambda q, l: msa_ops.msa_attention_ragged_paged(q, offs, cro, pcm.kv_blocks, cl, lut, l, idx,
                                                         implementation=impl)
    got = np_out(jax.jit(jax.vmap(fm))(qm, layers))
    for i in range(V):
        ref = oracle.msa_attention_ragged_paged(qm[i], offs, cro, pcm.kv_blocks, cl, lut, layers[i], idx)
        assert_close(got[i], ref, budget_for(BF16), what=f"msa vmap[{i}]")
        np.testing.assert_array_equal(bits(got[i]), bits(np_out(jax.jit(fm)(qm[i], layers[i]))))

    _, batch, pcx, qx, _ = indexer_inputs(3, "spec", "f32", 64)
    qxs = np.stack([qx, rand(rng, qx.shape, np.float32), rand(rng, qx.shape, np.float32)])
    fi = lambda q, l: msa_ops.msa_indexer_ragged_paged(q, batch.offsets, pcx.kv_blocks,
                                                       batch.cache_lengths, pcx.lut, l, topk=2,
                                                       implementation=impl)
    got = np_out(jax.jit(jax.vmap(fi))(qxs, layers))
    for i in range(V):
        ref, sc, el = oracle.msa_indexer_ragged_paged(qxs[i], batch.offsets, pcx.kv_blocks, batch.cache_lengths,
                                                      pcx.lut, layers[i], topk=2, return_scores=True)
        assert_indexer_matches(got[i], ref, sc, el, 2, 0, 0)


# ==========================================================================================================
# trace-time rejection of bad shapes / dtypes / attributes (jax.eval_shape suffices)
# ==========================================================================================================
def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def test_bad_input_rejected_at_trace_time():
    T, H, Hkv, D, B, NB, L, P, MP = 8, 4, 2, 64, 2, 6, 2, 16, 3
    q = _sds((T, H, D), jnp.bfloat16)
    offs = _sds((B + 1,), jnp.int32)
    kv = _sds((NB, 2, L, P, Hkv, D), jnp.bfloat16)
    cl = _sds((B,), jnp.int32)
    lut = _sds((B, MP), jnp.int32)
    layer = _sds((), jnp.int32)
    ok = jax.eval_shape(lambda *a: msa_ops.mha_ragged_paged(*a, implementation="reference"),
                        q, offs, kv, cl, lut, layer)
    assert ok.shape == (T, H, D) and ok.dtype == jnp.bfloat16

    def rejects(fn, *a, op="mo.", **kw):
        with pytest.raises(Exception) as e:
            jax.eval_shape(lambda *x: fn(*x, **kw), *a)
        assert op in str(e.value), f"error should name the op {op!r}: {e.value}"

    rejects(msa_ops.mha_ragged_paged, _sds((T, H * D), jnp.bfloat16), offs, kv, cl, lut, layer,
            op="mo.mha.ragged.paged")  # wrong rank
    rejects(msa_ops.mha_ragged_paged, q, offs, _sds((NB, 2, L, P, Hkv, D), jnp.float32), cl, lut, layer,
            op="mo.mha.ragged.paged")  # dtype mismatch
    rejects(msa_ops.mha_ragged_paged, q, _sds((B + 1,), jnp.float32), kv, cl, lut, layer,
            op="mo.mha.ragged.paged")  # float offsets
    rejects(msa_ops.mha_ragged_paged, q, offs, kv, _sds((B + 1,), jnp.int32), lut, layer,
            op="mo.mha.ragged.paged")  # cache_lengths of the wrong batch
    rejects(msa_ops.mha_ragged_paged, _sds((T, 3, D), jnp.bfloat16), offs, kv, cl, lut, layer,
            op="mo.mha.ragged.paged")  # heads not divisible by kv heads
    rejects(msa_ops.mha_ragged_paged, q, offs, kv, cl, lut, _sds((1,), jnp.int32),
            op="mo.mha.ragged.paged")  # layer_idx not a scalar
    rejects(msa_ops.mha_ragged_paged, q, offs, kv, cl, lut, layer, mask_str="sliding_window_causal",
            op="mo.mha.ragged.paged")  # window needed
    rejects(msa_ops.mha_ragged_paged, q, offs, kv, cl, lut, layer, mask_str="bogus", op="mo.mha.ragged.paged")
    # MSA: page size must be 128, D 128
    kv_m = _sds((NB, 2, L, 64, 1, 128), jnp.bfloat16)
    rejects(msa_ops.msa_attention_ragged_paged, _sds((T, 8, 128), jnp.bfloat16), offs, None, kv_m, cl, lut,
            layer, _sds((1, T, 4), jnp.int32), op="mo.msa.attention.ragged.paged")
    # indexer: init + local > topk
    kb = _sds((NB, 1, L, 128, 1, 64), jnp.bfloat16)
    rejects(msa_ops.msa_indexer_ragged_paged, _sds((T, 4, 64), jnp.bfloat16), offs, kb, cl, lut, layer,
            topk=2, init_blocks=2, local_blocks=1, op="mo.msa.indexer.ragged.paged")


def test_scores_whose_raw_dot_product_overflows_f32(impl):
    """q.k past the f32 range while scale * q.k (SPEC's score) is finite: q = k = 1e20 over 4 dims, scale 1e-12, so
    key 0 scores 4e28 and key 1 (k = 1) 4e8. Every op must see key 0 win, as a float64 computation does: the
    output is v0, and the indexer picks the block whose keys score highest (8e28) over one at 4e28."""
    scale, d = 1e-12, 4
    offs, cl, lut = np.array([0, 1], np.int32), np.array([1], np.int32), np.array([[0]], np.int32)
    q = np.full((1, 1, d), 1e20, np.float32)
    kv = np.zeros((1, 2, 1, 4, 1, d), np.float32)
    kv[0, 0, 0, 0], kv[0, 0, 0, 1] = 1e20, 1.0
    kv[0, 1, 0, 0], kv[0, 1, 0, 1] = [1, 2, 3, 4], [5, 6, 7, 8]
    got = np.asarray(msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 0, scale=scale, implementation=impl))
    np.testing.assert_allclose(got[0, 0], [1, 2, 3, 4], rtol=1e-6)

    qm = np.zeros((1, 1, 128), np.float32)
    qm[0, 0, :d] = 1e20
    kvm = np.zeros((1, 2, 1, 128, 1, 128), np.float32)
    kvm[0, 0, 0, 0, 0, :d], kvm[0, 0, 0, 1, 0, :d] = 1e20, 1.0
    kvm[0, 1, 0, 0, 0, :d], kvm[0, 1, 0, 1, 0, :d] = [1, 2, 3, 4], [5, 6, 7, 8]
    got = msa_ops.msa_attention_ragged_paged(jnp.asarray(qm, jnp.bfloat16), offs, None, jnp.asarray(kvm, jnp.bfloat16),
                                             cl, lut, 0, np.zeros((1, 1, 1), np.int32), scale=scale,
                                             implementation=impl)
    np.testing.assert_allclose(np.asarray(got, np.float32)[0, 0, :d], [1, 2, 3, 4], rtol=1e-2)

    kb = np.zeros((3, 1, 1, 128, 1, d), np.float32)
    kb[0, 0, 0, :, 0], kb[1, 0, 0, :, 0], kb[2, 0, 0, :, 0] = 1e20, 2e20, 1.0
    ids = msa_ops.msa_indexer_ragged_paged(q, offs, kb, np.array([300], np.int32), np.array([[0, 1, 2]], np.int32), 0,
                                           topk=1, scale=scale, implementation=impl)
    assert np.asarray(ids).ravel().tolist() == [1]


# ==========================================================================================================
# Operands SPEC.md lets a caller omit, through msa_ops.call
# ==========================================================================================================
def no_cache_by_name(q, k, v, offs, *, how, **kw):
    extra = () if how == "left_out" else (None,)
    return msa_ops.call("mo.mha.ragged.no_cache", q, k, v, offs, *extra, **kw)


def msa_by_name(q, offs, kv, cl, lut, layer, idx, *, how, **kw):
    if how == "left_out":
        return msa_ops.call("mo.msa.attention.ragged.paged", q, offs, kv, cl, lut, layer, idx, **kw)
    return msa_ops.call("mo.msa.attention.ragged.paged", q, offs, None, kv, cl, lut, layer, idx, **kw)


@pytest.mark.parametrize("how", ["left_out", "none"])
def test_call_by_name_omits_optional_operands(impl, how):
    """SPEC.md ops 4 and 7: kv_input_row_offsets (then equal to input_row_offsets) and cache_row_offsets may be
    omitted. The call by MAX name takes them left out of the operand list or as None."""
    rng = np.random.default_rng(11)
    n = [7, 0, 20, 9]
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (40, 4, 32), BF16)
    k, v = rand(rng, (40, 2, 32), BF16), rand(rng, (40, 2, 32), BF16)
    got = np_out(jit_call(no_cache_by_name, q, k, v, offs, how=how, mask_str="causal", implementation=impl))
    ref = oracle.mha_ragged_no_cache(q, k, v, offs, offs, mask_str="causal")
    assert_close(got, ref, budget_for(BF16), what=f"no_cache by name, kv offsets {how}")

    _rng, _batch, pc, q, offs, cro, cl, lut, idx, dtype = msa_inputs(3, "spec", "bf16", 2, 4, 3)
    got = np_out(jit_call(msa_by_name, q, offs, pc.kv_blocks, cl, lut, np.int32(1), idx, how=how,
                          implementation=impl))
    ref = oracle.msa_attention_ragged_paged(q, offs, cro, pc.kv_blocks, cl, lut, 1, idx)
    assert_close(got, ref, budget_for(BF16, dtype), what=f"msa by name, cache_row_offsets {how}")


# ==========================================================================================================
# Physical pages named more than once (within a sequence and across sequences)
# ==========================================================================================================
@pytest.mark.parametrize("num_partitions", [0, 3])
@pytest.mark.parametrize("scenario,page_size", [("long", 16), ("mixed", 16), ("spec", 128)])
def test_mha_pages_named_twice(impl, scenario, page_size, num_partitions):
    """SPEC.md reads token t of sequence b from page kv_lookup_table[b, t // P]: nothing requires the pages to be
    distinct, and a page named twice is read twice, as the keys of each place."""
    _, batch, pc, q, layer = mha_inputs(5, scenario, group=4, page_size=page_size, dtype=BF16, head_dim=64)
    lut = share_pages(pc.lut, tokens_of(batch), page_size)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, lut, layer)
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str="causal", num_partitions=num_partitions,
                          implementation=impl))
    ref = oracle.mha_ragged_paged(*args, mask_str="causal")
    assert_close(got, ref, budget_for(BF16), what=f"mha, pages named twice [{scenario}]")


@pytest.mark.parametrize("scenario,dt", [("long", "bf16"), ("spec", "fp8"), ("decode", "bf16")])
def test_msa_pages_named_twice(impl, scenario, dt):
    """MSA block ids are logical: two selected blocks whose pages are one physical page are two blocks of keys
    (SPEC.md: a repeated *id* counts once), each at its own positions."""
    rng, batch, pc, q, offs, cro, cl, lut, _idx, dtype = msa_inputs(7, scenario, dt, 2, 4, MSA_MP)
    lut = share_pages(lut, tokens_of(batch), 128)
    idx = msa_indices(rng, batch, 2, MSA_MP, junk=False)  # every block of the sequence selected
    args = (q, offs, cro, pc.kv_blocks, cl, lut, np.int32(1), idx)
    got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation=impl))
    ref = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, ref, budget_for(BF16, dtype), what=f"msa, pages named twice [{scenario},{dt}]")


def test_indexer_pages_named_twice(impl):
    """The indexer scores blocks by their keys through the page table: a block whose page repeats another's
    scores as those keys do at its own positions."""
    _rng, batch, pc, q, _dtype = indexer_inputs(4, "long", "bf16", 128)
    lut = share_pages(pc.lut, tokens_of(batch), 128)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, lut, np.int32(0))
    kw = {"topk": 3, "init_blocks": 1, "local_blocks": 1}
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *args, implementation=impl, **kw))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, ref, scores, elig, **kw)
