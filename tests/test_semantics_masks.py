"""Statements of docs/SEMANTICS.md, each checked directly: §3 (windows up to the int64 limit, every op), §13
(get_num_partitions attribute range), wrapper attribute bounds."""

from __future__ import annotations

import jax
import numpy as np
import oracle
import pytest
from conftest import assert_close, budget_for, jit_call, make_paged_cache, rand

import msa_ops
from msa_ops.errors import OpAttributeError

F32 = np.dtype(np.float32)
WMASKS = ["sliding_window_causal", "sliding_window_noncausal", "chunked_causal"]


def np_out(x):
    return np.asarray(jax.device_get(x))


# §3 "Any W > 0 is a valid window, however large: ... a window of 2^31 - 1 or more shows what the base mask shows
# ..., and no implementation's arithmetic may wrap on the way. local_window_size must fit in int64"
# Cases: the int32 limit less a little (k + W wraps for k > 9), the limit itself, just past it, and on to int64's.
# Each op against the oracle under the window and under the base mask (so the oracle is checked too).
@pytest.mark.parametrize("W", [2 ** 31 - 10, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 5, 2 ** 40, 2 ** 62, 2 ** 63 - 2,
                               2 ** 63 - 1])
@pytest.mark.parametrize("mask", WMASKS)
def test_windows_up_to_int64_max_every_op(impl, mask, W):
    rng = np.random.default_rng(4000)
    base = "null" if mask == "sliding_window_noncausal" else "causal"
    kw = dict(mask_str=mask, local_window_size=W)

    def check(got, ref_fn, *args, what):
        assert_close(got, ref_fn(*args, **kw), budget_for(F32), what=f"{what} {mask} W={W}")
        assert_close(got, ref_fn(*args, mask_str=base), budget_for(F32), what=f"{what} {mask} W={W}, base mask")

    # ragged paged, with a sequence whose cache is at S_max - 1
    P, MP = 16, 8
    n, cache = [3, 5, 1], [P * MP - 3, 40, P * MP - 1]
    pc = make_paged_cache(rng, [min(P * MP, a + c) for a, c in zip(n, cache)], page_size=P, max_pages=MP,
                          n_kv_heads=2, head_dim=32, dtype=F32)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 1, 4, 32), F32)
    args = (q, offs, pc.kv_blocks, np.array(cache, np.int32), pc.lut, np.int32(0))
    got = np_out(jit_call(msa_ops.mha_ragged_paged, *args, implementation=impl, **kw))
    check(got, oracle.mha_ragged_paged, *args, what="paged")
    # padded paged
    qp = rand(rng, (3, 5, 4, 32), F32)
    pargs = (qp, pc.kv_blocks, np.array(cache, np.int32), pc.lut, np.int32(1), np.array([3, 5, 1], np.int32))
    got = np_out(jit_call(msa_ops.mha_padded_paged, *pargs, implementation=impl, **kw))
    check(got, oracle.mha_padded_paged, *pargs, what="padded paged")
    # ragged no cache with negative positions (fewer keys than queries)
    qn, kn = rand(rng, (20, 4, 32), F32), rand(rng, (16, 2, 32), F32)
    o, ko = np.array([0, 12, 20], np.int32), np.array([0, 5, 16], np.int32)
    got = np_out(jit_call(msa_ops.mha_ragged_no_cache, qn, kn, kn, o, ko, implementation=impl, **kw))
    check(got, oracle.mha_ragged_no_cache, qn, kn, kn, o, ko, what="ragged no cache")
    # padded no cache (S > Sk: negative positions)
    qq, kk = rand(rng, (2, 9, 4, 32), F32), rand(rng, (2, 6, 2, 32), F32)
    vl = np.array([9, 4], np.int32)
    got = np_out(jit_call(msa_ops.mha_padded_no_cache, qq, kk, kk, vl, implementation=impl, **kw))
    check(got, oracle.mha_padded_no_cache, qq, kk, kk, vl, what="padded no cache")


def test_window_must_fit_int64_every_mask_every_op():
    """"`local_window_size` must fit in int64 (the native handlers' attribute), for every mask": 2^63 and
    -2^63 - 1 rejected at trace time for every mask and every dense op; -2^63 and 2^63-1 accepted by the unwindowed
    masks."""
    sd = jax.ShapeDtypeStruct
    q = sd((8, 4, 32), np.float32)
    k = sd((8, 2, 32), np.float32)
    o = sd((3,), np.int32)
    qp = sd((2, 4, 4, 32), np.float32)
    kp = sd((2, 4, 2, 32), np.float32)
    kv = sd((6, 2, 1, 16, 2, 32), np.float32)
    cl, lut, lay, vl = sd((2,), np.int32), sd((2, 3), np.int32), sd((), np.int32), sd((2,), np.int32)
    ops = [
        lambda **kw: jax.eval_shape(lambda *a: msa_ops.mha_ragged_paged(*a, **kw), q, o, kv, cl, lut, lay),
        lambda **kw: jax.eval_shape(lambda *a: msa_ops.mha_padded_paged(*a, **kw), qp, kv, cl, lut, lay, vl),
        lambda **kw: jax.eval_shape(lambda *a: msa_ops.mha_ragged_no_cache(*a, **kw), q, k, k, o),
        lambda **kw: jax.eval_shape(lambda *a: msa_ops.mha_padded_no_cache(*a, **kw), qp, kp, kp, vl),
    ]
    for op in ops:
        for mask in ["null", "causal"] + WMASKS:
            for bad in (2 ** 63, -(2 ** 63) - 1):
                with pytest.raises(OpAttributeError, match="local_window_size"):
                    op(mask_str=mask, local_window_size=bad)
            op(mask_str=mask, local_window_size=2 ** 63 - 1)
        for mask in ("null", "causal"):
            op(mask_str=mask, local_window_size=-(2 ** 63))
        for mask in WMASKS:  # "Windowed and chunked masks require W > 0"
            for bad in (0, -1, -(2 ** 63)):
                with pytest.raises(OpAttributeError, match="local_window_size"):
                    op(mask_str=mask, local_window_size=bad)


# §13 "n_kv_heads and sm_count may be any int from 1 to 2^63 - 1 ...; past it the call is rejected at trace time"
@pytest.mark.parametrize("n_kv_heads,sm_count", [(2 ** 63 - 1, 2 ** 63 - 1), (1, 2 ** 63 - 1), (2 ** 63 - 1, 1),
                                                 (7, 2 ** 62 + 3)])
def test_get_num_partitions_int64_attrs(impl, n_kv_heads, sm_count):
    fn = jax.jit(lambda b, m: msa_ops.mha_decode_get_num_partitions(b, m, n_kv_heads=n_kv_heads, sm_count=sm_count,
                                                                     implementation=impl))
    for batch in (-(2 ** 31), -1, 0, 1, 3, 2 ** 31 - 1):
        for ml in (0, 600, 2 ** 31 - 1):
            got = int(fn(np.int32(batch), np.int32(ml)))
            assert got == oracle.get_num_partitions(batch, ml, n_kv_heads=n_kv_heads, sm_count=sm_count), (batch, ml)


def test_get_num_partitions_attr_range_rejected():
    for bad in ({"n_kv_heads": 0, "sm_count": 132}, {"n_kv_heads": -1, "sm_count": 132},
                {"n_kv_heads": 2, "sm_count": 2 ** 63}, {"n_kv_heads": 2 ** 63, "sm_count": 1}):
        with pytest.raises(OpAttributeError, match="n_kv_heads|sm_count"):
            jax.eval_shape(lambda b, m, bad=bad: msa_ops.mha_decode_get_num_partitions(b, m, **bad), np.int32(1),
                           np.int32(1))


def test_attribute_bounds():
    """"num_partitions in [0, 64] ...; the indexer's topk in [1, 4096]" (checked at trace time)."""
    sd = jax.ShapeDtypeStruct
    q = sd((4, 2, 32), np.float32)
    kb = sd((3, 1, 1, 128, 1, 32), np.float32)
    o, cl, lut, lay = sd((2,), np.int32), sd((1,), np.int32), sd((1, 2), np.int32), sd((), np.int32)
    f = lambda topk: jax.eval_shape(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, topk=topk), q, o, kb, cl, lut,
                                    lay)
    assert f(4096).shape == (2, 4, 4096)
    assert f(1).shape == (2, 4, 1)
    for bad in (0, 4097, -1):
        with pytest.raises(OpAttributeError, match="topk"):
            f(bad)
    kv = sd((3, 2, 1, 16, 1, 32), np.float32)
    g = lambda n: jax.eval_shape(lambda *a: msa_ops.mha_ragged_paged(*a, num_partitions=n), q, o, kv, cl, lut, lay)
    for ok in (0, 1, 64):
        g(ok)
    for bad in (-1, 65):
        with pytest.raises(OpAttributeError, match="num_partitions"):
            g(bad)
    qm = sd((4, 2, 128), "bfloat16")
    kvm = sd((3, 2, 1, 128, 1, 128), "bfloat16")
    ix = sd((1, 4, 3), np.int32)
    h = lambda n: jax.eval_shape(lambda *a: msa_ops.msa_attention_ragged_paged(
        a[0], a[1], None, *a[2:], num_partitions=n), qm, o, kvm, cl, lut, lay, ix)
    for ok in (0, 64):
        h(ok)
    for bad in (-1, 65):
        with pytest.raises(OpAttributeError, match="num_partitions"):
            h(bad)


@pytest.mark.parametrize("W", [2 ** 63 - 2, 2 ** 63 - 1])
def test_oracle_sliding_noncausal_no_wrap(W):
    """SEMANTICS.md §3 "no implementation's arithmetic may wrap on the way" holds for the oracle too: its int64
    `k + window > p` once wrapped for W near 2^63 and hid keys."""
    vis = oracle.visible("sliding_window_noncausal", np.array([[3]]), np.arange(4)[None, :], W)
    assert vis.all(), vis
