"""Statements of docs/SEMANTICS.md, each checked directly: §7 (MSA attention) and the split-K workspace statements
of the native contract."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import BF16, assert_close, budget_for, jit_call, make_paged_cache, on_cpu, rand

import msa_ops
from msa_ops.registry import normalize_call_attrs

F32 = np.dtype(np.float32)
AT = "mo.msa.attention.ragged.paged"
RP = "mo.mha.ragged.paged"


def np_out(x):
    return np.asarray(jax.device_get(x))


def _msa_problem(seed, n=(1, 1, 1), cache=(300, 200, 130), mp=3, hkv=2, group=4, topk=6):
    rng = np.random.default_rng(seed)
    pc = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=128, max_pages=mp, n_kv_heads=hkv,
                          head_dim=128, dtype=BF16)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T = int(offs[-1]) + 1
    q = rand(rng, (T, hkv * group, 128), BF16)
    idx = rng.integers(-1, mp + 1, (hkv, T, topk)).astype(np.int32)
    return rng, pc, offs, np.array(cache, np.int32), q, idx


# §7 "cache_row_offsets is accepted (shape-checked) for MAX compatibility; its values are not read"
def test_msa_cache_row_offsets_values_not_read(impl):
    rng, pc, offs, cl, q, idx = _msa_problem(2000, n=(2, 5, 1))
    good = oracle.kv_cache_row_offsets_ragged_paged(offs, cl)
    ref = oracle.msa_attention_ragged_paged(q, offs, good, pc.kv_blocks, cl, pc.lut, np.int32(1), idx)
    outs = []
    for cro in (good, rng.integers(-10 ** 6, 10 ** 6, good.shape).astype(np.int32),
                np.full(good.shape, 2 ** 31 - 1, np.int32), good[::-1].copy()):
        got = np_out(jit_call(msa_ops.msa_attention_ragged_paged, q, offs, cro, pc.kv_blocks, cl, pc.lut,
                              np.int32(1), idx, implementation=impl))
        assert_close(got, ref, budget_for(BF16), what=f"cro {cro.tolist()}")
        outs.append(got)
    none = np_out(jit_call(lambda *a, **k: msa_ops.msa_attention_ragged_paged(a[0], a[1], None, *a[2:], **k),
                           q, offs, pc.kv_blocks, cl, pc.lut, np.int32(1), idx, implementation=impl))
    for o in outs:
        np.testing.assert_array_equal(o.view(np.uint16), none.view(np.uint16))


# §7 "Given as None, it is not computed either: ... the graph holds no cumulative-sum kernel for it"
def test_msa_none_cache_row_offsets_no_cumsum(impl):
    _, pc, offs, cl, q, idx = _msa_problem(2001)
    f = lambda q, o, kv, c, lut, l, ix: msa_ops.msa_attention_ragged_paged(q, o, None, kv, c, lut, l, ix,
                                                                          implementation=impl)
    jaxpr = jax.make_jaxpr(f)(q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx)
    prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert not any("cumsum" in p for p in prims), prims
    if impl == "native":
        hlo = jax.jit(f).lower(q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx).as_text()
        assert "reduce_window" not in hlo and "cumsum" not in hlo


# §7 "a block id listed twice counts once"; "Split-K (decode) splits the topk slots ...; a duplicate id counts only
# at its first slot" -- duplicates placed in different partitions, end to end.
@pytest.mark.parametrize("num_partitions", [1, 2, 3, 4])
def test_msa_duplicates_across_partitions(impl, num_partitions):
    _, pc, offs, cl, q, _ = _msa_problem(2002, n=(1, 1, 1), cache=(300, 200, 130), topk=4)
    T = q.shape[0]
    idx = np.full((2, T, 4), -1, np.int32)
    idx[0, :3] = [0, 1, 0, 1]  # partition 0 (np=2) holds both; partition 1 only repeats
    idx[1, :3] = [2, -1, 2, 0]
    ref = oracle.msa_attention_ragged_paged(q, offs, None, pc.kv_blocks, cl, pc.lut, np.int32(0), idx)
    got = np_out(jit_call(lambda *a, **k: msa_ops.msa_attention_ragged_paged(a[0], a[1], None, *a[2:], **k),
                          q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx, num_partitions=num_partitions,
                          implementation=impl))
    assert_close(got, ref, budget_for(BF16), what=f"dups np={num_partitions}")
    # the duplicate-free selection gives the same thing
    idx2 = idx.copy()
    idx2[0, :3] = [0, 1, -1, -1]
    idx2[1, :3] = [2, -1, -1, 0]
    got2 = np_out(jit_call(lambda *a, **k: msa_ops.msa_attention_ragged_paged(a[0], a[1], None, *a[2:], **k),
                           q, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx2, num_partitions=num_partitions,
                           implementation=impl))
    assert_close(got, got2.astype(np.float64), budget_for(BF16), what="dups vs unique")


def _bind(name, args, impl, **attrs):
    op = msa_ops.get_op(name)
    norm, _ = normalize_call_attrs(op, attrs)
    arrs = [jnp.asarray(x) for x in args]
    with on_cpu():
        return [np.asarray(x) for x in jax.jit(
            lambda *a: tuple(op.primitive.bind(*a, attrs=norm, implementation=impl)))(*arrs)]


# §7 split-K slot layout, checked on the native workspace: partition p takes slots [p*c, min(topk,(p+1)*c)),
# c = ceil(topk/np); lse_p = log2(sum e^{s_j}) over that partition's (first-occurrence) keys; -inf/0 when empty.
def test_msa_split_k_slot_partials_native(impl):
    if impl != "native":
        pytest.skip("workspace partials are native-only (the reference returns zeros, checked below)")
    rng = np.random.default_rng(2003)
    pc = make_paged_cache(rng, [400], page_size=128, max_pages=4, n_kv_heads=1, head_dim=128, dtype=BF16,
                          junk_tail=False)
    q = rand(rng, (1, 2, 128), BF16)
    offs, cl = np.array([0, 1], np.int32), np.array([399], np.int32)  # p = 399, 400 keys, blocks 0..3
    nparts = 2  # topk 5, c = 3: partition 0 = slots 0..2, partition 1 = slots 3..4
    idx = np.array([[[1, 3, 1, 1, 0]]], np.int32)  # partition 1: slot 3 repeats 1 (not counted), slot 4 -> block 0
    out, ws_o, ws_lse = _bind(AT, (q, offs, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx), "native",
                              num_partitions=nparts)
    assert ws_o.shape == (2, 1, 2, 128) and ws_lse.shape == (2, 1, 2)
    K = pc.kv_blocks[:, 0, 0].astype(np.float64)  # [NB, 128, 1, 128]
    V = pc.kv_blocks[:, 1, 0].astype(np.float64)
    scale = 1 / math.sqrt(128)

    def part(blocks, h):
        kp = np.concatenate([128 * j + np.arange(128) for j in blocks])
        kp = kp[kp <= 399]  # existing keys k <= p (p = 399, 400 keys)
        ks = K[pc.lut[0, kp // 128], kp % 128, 0]
        vs = V[pc.lut[0, kp // 128], kp % 128, 0]
        s = scale * ks @ q[0, h].astype(np.float64)
        e = np.exp(s)
        return np.log2(e.sum()), (e @ vs) / e.sum()

    for h in range(2):
        for p, blocks in ((0, [1, 3]), (1, [0])):
            lse, o = part(blocks, h)
            np.testing.assert_allclose(ws_lse[p, 0, h], lse, rtol=1e-4, err_msg=f"lse p={p} h={h}")
            np.testing.assert_allclose(ws_o[p, 0, h], o, rtol=2e-2, atol=2e-3, err_msg=f"O p={p} h={h}")
    # the repeat alone in a partition: empty
    idx = np.array([[[1, 3, 0, 1, 3]]], np.int32)
    _, ws_o, ws_lse = _bind(AT, (q, offs, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx), "native",
                            num_partitions=nparts)
    assert np.isneginf(ws_lse[1]).all() and (ws_o[1] == 0).all()


# Native contract: "NPW (workspace partitions) is num_partitions when it is > 1, else 0";
# "the reference lowering computes each row whole and returns them zero-filled".
@pytest.mark.parametrize("nparts", [1, 2, 5])
def test_workspace_shapes_and_reference_zero_fill(impl, nparts):
    rng, pc, offs, cl, q, idx = _msa_problem(2004, n=(1, 2, 1))
    out, ws_o, ws_lse = _bind(AT, (q, offs, offs, pc.kv_blocks, cl, pc.lut, np.int32(0), idx), impl,
                              num_partitions=nparts)
    npw = nparts if nparts > 1 else 0
    assert ws_o.shape == (npw,) + q.shape and ws_lse.shape == (npw,) + q.shape[:2]
    if impl == "reference":
        assert not ws_o.any() and not ws_lse.any()
    pcd = make_paged_cache(rng, [50, 90], page_size=16, max_pages=8, n_kv_heads=2, head_dim=32, dtype=F32)
    qd = rand(rng, (5, 4, 32), F32)
    od = np.array([0, 2, 4], np.int32)
    out, ws_o, ws_lse = _bind(RP, (qd, od, pcd.kv_blocks, np.array([48, 86], np.int32), pcd.lut, np.int32(1)),
                              impl, mask_str="causal", num_partitions=nparts)
    assert ws_o.shape == (npw, 5, 4, 32) and ws_lse.shape == (npw, 5, 4)
    if impl == "reference":
        assert not ws_o.any() and not ws_lse.any()


# §6 with a sink: partials exclude the sink; combine O = sum 2^(lse_p-m) O_p / (sum 2^(lse_p-m) + 2^(sink*log2e-m))
@pytest.mark.parametrize("nparts", [2, 3])
def test_mha_split_k_partials_with_sink_native(impl, nparts):
    if impl != "native":
        pytest.skip("native workspace")
    rng = np.random.default_rng(2005 + nparts)
    P, MP, Hkv, group, D = 16, 16, 2, 2, 32
    n, cache = [1, 3, 1], [150, 60, 0]
    pc = make_paged_cache(rng, [a + c for a, c in zip(n, cache)], page_size=P, max_pages=MP, n_kv_heads=Hkv,
                          head_dim=D, dtype=F32)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T, H = int(offs[-1]), Hkv * group
    q = rand(rng, (T, H, D), F32)
    sinks = rand(rng, (H,), F32, 2.0)
    args = (q, offs, pc.kv_blocks, np.array(cache, np.int32), pc.lut, np.int32(1), sinks)
    op = "mo.mha.ragged.paged.sink_weights"
    out, ws_o, ws_lse = _bind(op, args, "native", mask_str="causal", num_partitions=nparts)
    scale = 1 / math.sqrt(D)
    for b in range(3):
        N = cache[b] + n[b]
        ranges = oracle.split_k_ranges(N, nparts)
        for i in range(n[b]):
            t, p = offs[b] + i, cache[b] + i
            for h in range(H):
                kpos = np.arange(N)
                Kk = pc.kv_blocks[pc.lut[b, kpos // P], 0, 1, kpos % P, h // group].astype(np.float64)
                Vv = pc.kv_blocks[pc.lut[b, kpos // P], 1, 1, kpos % P, h // group].astype(np.float64)
                s = scale * Kk @ q[t, h].astype(np.float64)
                s = np.where(kpos <= p, s, -np.inf)
                for pp, (lo, hi) in enumerate(ranges):
                    e = np.exp(s[lo:hi]) if hi > lo else np.zeros(0)
                    if e.sum() == 0:
                        assert np.isneginf(ws_lse[pp, t, h]) and not ws_o[pp, t, h].any(), (b, i, h, pp)
                        continue
                    np.testing.assert_allclose(ws_lse[pp, t, h], np.log2(e.sum()), rtol=1e-5, atol=1e-5)
                    np.testing.assert_allclose(ws_o[pp, t, h], e @ Vv[lo:hi] / e.sum(), rtol=1e-4, atol=1e-5)
                lse = ws_lse[:, t, h].astype(np.float64)
                m = lse.max()
                w = np.where(np.isfinite(lse), np.exp2(lse - m), 0.0)
                o = (w[:, None] * ws_o[:, t, h]).sum(0) / (w.sum() + 2.0 ** (sinks[h] * math.log2(math.e) - m))
                np.testing.assert_allclose(out[t, h], o, rtol=1e-4, atol=1e-5)
