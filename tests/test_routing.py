"""The routing ladder (pure Python) on its boundaries, and msa_ops.plan on real shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import msa_ops
from msa_ops import routing

SDS = jax.ShapeDtypeStruct


def gnp_formula(batch, length, n_kv_heads, sm_count):
    by_sm = min(max(sm_count // max(1, batch * n_kv_heads), 1), 32)
    return min(by_sm, max(1, length // 512))


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 16, 17, 33, 64, 132, 1000])
@pytest.mark.parametrize("length", [0, 1, 511, 512, 1023, 1024, 4096, 16383, 16384, 131072])
@pytest.mark.parametrize("hkv", [1, 8])
def test_get_num_partitions_grid(batch, length, hkv):
    assert routing.get_num_partitions(batch, length, n_kv_heads=hkv, sm_count=132) == gnp_formula(
        batch, length, hkv, 132
    )


def test_get_num_partitions_boundaries():
    # 132 // (1*1) = 132 -> clamped to 32; length bound dominates below 16k.
    assert routing.get_num_partitions(1, 512 * 32, n_kv_heads=1, sm_count=132) == 32
    assert routing.get_num_partitions(1, 512 * 32 - 1, n_kv_heads=1, sm_count=132) == 31
    assert routing.get_num_partitions(1, 511, n_kv_heads=1, sm_count=132) == 1
    # sm bound: 132 // (8*8) = 2
    assert routing.get_num_partitions(8, 1 << 20, n_kv_heads=8, sm_count=132) == 2
    assert routing.get_num_partitions(17, 1 << 20, n_kv_heads=8, sm_count=132) == 1


@pytest.mark.parametrize("n,np_", [(0, 1), (1, 1), (64, 2), (65, 2), (1000, 7), (4096, 32), (100, 7)])
def test_split_k_ranges_cover_keys_once(n, np_):
    r = routing.split_k_ranges(n, np_)
    assert len(r) == np_
    covered = [k for lo, hi in r for k in range(lo, hi)]
    assert covered == list(range(n))
    s = max(64, -(-(-(-n // np_) if n else 0) // 64) * 64)
    for p, (lo, hi) in enumerate(r):
        assert lo == min(n, p * s) and hi == min(n, (p + 1) * s)


def _plan_mha(t, b, h=32, hkv=8, d=128, mp=32, page=128, **kw):
    return routing.plan_mha("mo.mha.ragged.paged", total_rows=t, batch=b, n_heads=h, n_kv_heads=hkv,
                            head_dim=d, max_keys_static=mp * page, **kw)


def test_mha_ladder_decode_vs_prefill_boundary():
    # group 4: 16 tokens x 4 heads = 64 rows fit one tile -> split-K route; 17 tokens do not.
    p = _plan_mha(t=16 + 7, b=8)
    assert p.max_q == 16 and p.kernel == "1q_split_k" and p.route == "speculative" and p.tile_m == 64
    p = _plan_mha(t=17 + 7, b=8)
    assert p.max_q == 17 and p.route == "prefill" and p.kernel == "1q" and p.tile_m == 64
    p = _plan_mha(t=8, b=8)
    assert p.route == "decode" and p.max_q == 1 and p.tile_m == 8  # 4 rows: the transposed 8-row tile
    p = _plan_mha(t=8, b=8, h=64)  # group 8: still 8 rows
    assert p.route == "decode" and p.tile_m == 8
    p = _plan_mha(t=8, b=8, h=128)  # group 16
    assert p.route == "decode" and p.tile_m == 16
    # 2q once a sequence may hold 128 rows
    assert _plan_mha(t=127 + 7, b=8).kernel == "1q"
    assert _plan_mha(t=128 + 7, b=8).kernel == "2q" and _plan_mha(t=128 + 7, b=8).tile_m == 128
    # head dim 256: the same tiles (the handler runs 64 rows where its GPU has no 128-row kernel for it)
    p = _plan_mha(t=128 + 7, b=8, d=256)
    assert p.kernel == "2q" and p.tile_m == 128 and "head_dim 256" in p.why
    assert _plan_mha(t=8, b=8, d=256).tile_m == 8 and _plan_mha(t=8, b=8, h=128, d=256).tile_m == 16


def test_mha_ladder_hints_and_override():
    p = _plan_mha(t=512, b=8, max_prompt_length=1)
    assert p.route == "decode"
    assert p.num_partitions == routing.get_num_partitions(8, 32 * 128, n_kv_heads=8,
                                                          sm_count=132 * routing.DECODE_CTAS_PER_SM)
    p = _plan_mha(t=8, b=8, max_cache_length=100)
    assert p.max_keys == 101 and p.num_partitions == 1
    p = _plan_mha(t=8, b=8, num_partitions=7)
    assert p.num_partitions == 7 and p.workspace_partitions == 7
    assert _plan_mha(t=4096, b=1).num_partitions == 1
    assert _plan_mha(t=4096, b=1, num_partitions=3).num_partitions == 3
    one = _plan_mha(t=1, b=1, mp=1024)  # B=1, 128k keys: 2 * 132 // 8 = 33 -> 32 partitions
    assert one.route == "decode" and one.num_partitions == 32
    assert one.workspace_partitions == 32
    assert _plan_mha(t=1, b=1, mp=1).workspace_partitions == 0


@pytest.mark.parametrize("t,b,route", [(32, 32, "decode"), (33, 32, "speculative"), (39, 32, "speculative"),
                                       (40, 32, "prefill"), (8192, 1, "prefill")])
def test_msa_routes(t, b, route):
    p = routing.plan_msa(total_rows=t, batch=b, n_heads=32, n_kv_heads=4, topk=16, max_keys_static=1 << 17)
    assert p.route == route


def test_msa_decode_partitions():
    p = routing.plan_msa(total_rows=32, batch=32, n_heads=32, n_kv_heads=4, topk=64, max_keys_static=1 << 17)
    assert p.num_partitions == 1  # 132 // 128 = 1
    p = routing.plan_msa(total_rows=2, batch=2, n_heads=32, n_kv_heads=4, topk=16, max_keys_static=1 << 17)
    assert p.num_partitions == 4  # min(132 // 8, 16 // 4)
    p = routing.plan_msa(total_rows=2, batch=2, n_heads=32, n_kv_heads=4, topk=4, max_keys_static=1 << 17,
                         num_partitions=9)
    assert p.num_partitions == 4  # capped at topk
    # fp8 KV at topk >= 64: twice the CTAs per SM
    p = routing.plan_msa(total_rows=32, batch=32, n_heads=32, n_kv_heads=4, topk=64, max_keys_static=1 << 17,
                         kv_fp8=True)
    assert p.num_partitions == 2  # 2 * 132 // 128
    p = routing.plan_msa(total_rows=32, batch=32, n_heads=32, n_kv_heads=4, topk=16, max_keys_static=1 << 17,
                         kv_fp8=True)
    assert p.num_partitions == 1


def test_plan_from_shapes_matches_ladder():
    args = (SDS((64, 32, 128), jnp.bfloat16), SDS((65,), jnp.int32), SDS((100, 2, 1, 16, 8, 128), jnp.bfloat16),
            SDS((64,), jnp.int32), SDS((64, 40), jnp.int32), SDS((), jnp.int32))
    p = msa_ops.plan("mo.mha.ragged.paged", *args, mask_str="causal")
    assert p == _plan_mha(t=64, b=64, mp=40, page=16)
    assert p.route == "decode"
    p2 = msa_ops.plan("mo.mha.ragged.paged", *args, mask_str="causal", num_partitions=5)
    assert p2.num_partitions == 5
    with pytest.raises(msa_ops.OpShapeError):
        msa_ops.plan("mo.mha.ragged.paged", *args[:-1], mask_str="causal")


def test_plan_workspace_matches_abstract_result():
    args = (SDS((4, 32, 128), jnp.bfloat16), SDS((5,), jnp.int32), SDS((100, 2, 1, 16, 8, 128), jnp.bfloat16),
            SDS((4,), jnp.int32), SDS((4, 256), jnp.int32), SDS((), jnp.int32))
    op = msa_ops.get_op("mo.mha.ragged.paged")
    p = msa_ops.plan(op.name, *args, mask_str="causal")
    assert p.num_partitions > 1
    outs = jax.eval_shape(
        lambda *a: op.primitive.bind(*a, attrs=msa_ops.registry.normalize_call_attrs(op, {"mask_str": "causal"})[0],
                                     implementation="reference"), *args)
    assert outs[1].shape == (p.num_partitions, 4, 32, 128) and outs[2].shape == (p.num_partitions, 4, 32)


@pytest.mark.parametrize("d,ok", [(64, True), (128, True), (256, True), (96, False), (32, False), (512, False)])
def test_cuda_head_dims_native_or_reference(d, ok):
    """Which head dims the CUDA handlers take (else `auto` lowers to the reference and says why)."""
    from msa_ops.ops.mha import _native_supports
    q = SDS((4, 8, d), jnp.bfloat16)
    why = _native_supports(q, attrs=None, platform="cuda")
    assert (why is None) == ok, why
    if not ok:
        assert str(d) in why
