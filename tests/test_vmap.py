"""vmap folded into one call (msa_ops/fold.py): each element against the float64 oracle, with bad values.

Each element of a mapped axis gets its own random data of the same shapes, and some elements get the bad values
of docs/SEMANTICS.md (offsets that are not monotone, past the rows or starting late, negative cache lengths,
page ids outside the pool, uint32 bit patterns), so that a fold that mixed elements up, or read one element's bad
value as another's good one, fails against the oracle. Every test also checks that the op was bound once outside
any loop (folded), or inside one where folding does not apply.
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from conftest import BF16, assert_close, budget_for, make_batch, make_paged_cache, rand, to_uint32

msa_ops = pytest.importorskip("msa_ops")
import jax
from test_reference import (
    IDX_MP,
    MSA_MP,
    S_MAX,
    assert_indexer_matches,
    bits,
    msa_indices,
    np_out,
    tokens_of,
)

N = 3


def op_eqns(fn, *args, name: str) -> list:
    """(equation, inside a loop) for every binding of op ``name`` in the jaxpr of ``fn(*args)``, sub-jaxprs
    included."""
    found = []

    def walk(jaxpr, in_loop):
        for e in jaxpr.eqns:
            if e.primitive.name == name:
                found.append((e, in_loop))
            loop = in_loop or e.primitive.name in ("scan", "while")
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner), loop)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return found


def binds(fn, *args, name: str) -> tuple[int, int]:
    """How often the jaxpr of ``fn(*args)`` binds op ``name`` outside any loop, and inside one."""
    loops = [in_loop for _, in_loop in op_eqns(fn, *args, name=name)]
    return loops.count(False), loops.count(True)


def folded_plan(fn, *args, name: str):
    """The plan (route, kernel, tile height, tokens per sequence) of the one call ``fn(*args)`` binds."""
    ((e, _),) = op_eqns(fn, *args, name=name)
    p = msa_ops.registry.get_op(name).plan(*(v.aval for v in e.invars), attrs=e.params["attrs"])
    return p.route, p.kernel, p.tile_m, p.max_q


def element_plan(name: str, *operands, **attrs):
    p = msa_ops.plan(name, *operands, **attrs)
    return p.route, p.kernel, p.tile_m, p.max_q


def spoil_offsets(offs: np.ndarray, t: int, kind: int) -> np.ndarray:
    """Element kinds: 0 as given; 1 not monotone and past the rows; 2 starting at row 2 (rows before padding)."""
    o = np.array(offs, np.int32)
    if kind == 1 and len(o) >= 3:
        o[1] = o[-1] + 3  # every entry after it smaller (a running max repairs them), and maybe past the rows
    if kind == 2:
        o = np.minimum(o + 2, t).astype(np.int32)
    return o


def paged_elements(scenario, *, page_size, max_pages, hkv, d, dtype, kv=2, seed=0):
    """N elements of one scenario's shapes: offsets, cache lengths, a pool each and its page table."""
    els = []
    for i in range(N):
        rng = np.random.default_rng(seed * 10 + i)
        batch = make_batch(rng, scenario, max_pages * page_size)
        pc = make_paged_cache(rng, tokens_of(batch), page_size=page_size, max_pages=max_pages, n_kv_heads=hkv,
                              head_dim=d, dtype=dtype, kv=kv)
        cl = batch.cache_lengths.copy()
        lut = pc.lut.copy()
        if i == 1:
            cl[0] = -5  # reads as 0
            lut[-1, 0] = pc.kv_blocks.shape[0] + 3  # a page past the pool: that sequence's first keys do not exist
        if i == 2:
            lut = to_uint32(lut)  # -1 as 0xFFFFFFFF
        els.append((rng, batch, spoil_offsets(batch.offsets, batch.T, i), cl, lut, pc.kv_blocks))
    return els


def stack(xs, dtype=None):
    return np.stack([np.asarray(x, dtype) if dtype is not None else np.asarray(x) for x in xs])


def tables(els):
    """The elements' offsets, cache lengths and page tables (uint32 ones as their int32 bits), stacked."""
    return (stack([e[2] for e in els], np.int32), stack([e[3] for e in els], np.int32),
            stack([np.asarray(e[4]).view(np.int32) for e in els]))


@pytest.mark.parametrize("scenario,pool_axis,sink", [("mixed", 3, False), ("decode", None, True),
                                                     ("spec", 0, True), ("prefill", None, False)])
def test_vmap_mha_ragged_paged_folds(impl, scenario, pool_axis, sink):
    els = paged_elements(scenario, page_size=16, max_pages=S_MAX // 16, hkv=2, d=64, dtype=BF16, seed=1)
    t = els[0][1].T
    rng = np.random.default_rng(5)
    qs = stack([rand(rng, (t, 8, 64), BF16) for _ in els])
    offs, cls, luts = tables(els)
    pools = np.stack([e[5] for e in els], axis=pool_axis) if pool_axis is not None else els[0][5]
    sinks = (rng.standard_normal(8) * 2).astype(BF16)
    layer = np.int32(1)

    def f(q, o, kv, c, lut):
        return msa_ops.mha_ragged_paged(q, o, kv, c, lut, layer, mask_str="causal",
                                        sink_weights=sinks if sink else None, implementation=impl)

    in_axes = (0, 0, pool_axis, 0, 0)
    fn = jax.vmap(f, in_axes=in_axes, out_axes=1)
    name = "mo.mha.ragged.paged" + (".sink_weights" if sink else "")
    assert binds(fn, qs, offs, pools, cls, luts, name=name) == (1, 0)
    kv0 = pools if pool_axis is None else np.take(pools, 0, axis=pool_axis)
    assert folded_plan(fn, qs, offs, pools, cls, luts, name=name) == element_plan(
        name, qs[0], offs[0], kv0, cls[0], luts[0], layer, *([sinks] if sink else []), mask_str="causal")
    got = np_out(jax.jit(fn)(qs, offs, pools, cls, luts))
    for i in range(N):
        kv = pools if pool_axis is None else np.take(pools, i, axis=pool_axis)
        ref = oracle.mha_ragged_paged(qs[i], offs[i], kv, cls[i], luts[i], layer, mask_str="causal",
                                      sink_weights=sinks if sink else None)
        assert_close(got[:, i], ref, budget_for(BF16), what=f"vmap mha [{scenario}, element {i}]")
    # the same rows read by the loop rule
    loop = jax.vmap(f, in_axes=(0, 0, pool_axis, 0, 0), out_axes=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSA_OPS_VMAP_FOLD", "0")
        assert binds(loop, qs, offs, pools, cls, luts, name=name) == (0, 1)


def test_vmap_mha_q_only_shares_everything_else(impl):
    """Only q mapped (the offsets, page table and pool shared): every element's sequences read the same pages."""
    (_, batch, offs, cl, lut, pool), = paged_elements("long", page_size=128, max_pages=4, hkv=2, d=64,
                                                      dtype=np.float32, seed=2)[:1]
    rng = np.random.default_rng(9)
    qs = rand(rng, (4, batch.T, 4, 64), np.float32)
    fn = jax.vmap(lambda q: msa_ops.mha_ragged_paged(q, offs, pool, cl, lut, np.int32(0), mask_str="causal",
                                                     implementation=impl))
    assert binds(fn, qs, name="mo.mha.ragged.paged") == (1, 0)
    got = np_out(jax.jit(fn)(qs))
    for i in range(4):
        assert_close(got[i], oracle.mha_ragged_paged(qs[i], offs, pool, cl, lut, 0, mask_str="causal"), 1e-5,
                     what=f"q only [{i}]")


def test_vmap_what_does_not_fold_loops(impl):
    """A mapped layer_idx or sink takes the loop, and gives each element's result."""
    els = paged_elements("decode", page_size=16, max_pages=S_MAX // 16, hkv=2, d=64, dtype=np.float32, seed=3)
    rng = np.random.default_rng(4)
    t = els[0][1].T
    qs = rand(rng, (N, t, 4, 64), np.float32)
    offs = stack([e[2] for e in els], np.int32)
    layers = np.array([1, 0, 1], np.int32)
    sinks = rand(rng, (N, 4), np.float32)
    pool, cl, lut = els[0][5], els[0][3], els[0][4]
    f = lambda q, o, layer, s: msa_ops.mha_ragged_paged(q, o, pool, cl, lut, layer, mask_str="causal",
                                                        sink_weights=s, implementation=impl)
    for in_axes in ((0, 0, 0, None), (0, 0, None, 0)):
        fn = jax.vmap(f, in_axes=in_axes)
        args = (qs, offs, layers if in_axes[2] == 0 else layers[0], sinks if in_axes[3] == 0 else sinks[0])
        assert binds(fn, *args, name="mo.mha.ragged.paged.sink_weights") == (0, 1)
        got = np_out(jax.jit(fn)(*args))
        for i in range(N):
            layer = layers[i] if in_axes[2] == 0 else layers[0]
            s = sinks[i] if in_axes[3] == 0 else sinks[0]
            ref = oracle.mha_ragged_paged(qs[i], offs[i], pool, cl, lut, layer, mask_str="causal", sink_weights=s)
            assert_close(got[i], ref, 1e-5, what=f"loop {in_axes} [{i}]")


def test_vmap_mha_padded_paged_folds(impl):
    rng = np.random.default_rng(11)
    b, s, hkv, g, d, p, mp, nb = 3, 20, 2, 2, 64, 16, 8, 30
    pools = rand(rng, (N, nb, 2, 2, p, hkv, d), BF16)
    luts = rng.integers(-2, nb + 2, (N, b, mp)).astype(np.int32)
    cls = rng.integers(-3, mp * p - s + 1, (N, b)).astype(np.int32)
    valid = rng.integers(-1, s + 3, (N, b)).astype(np.int32)
    qs = rand(rng, (N, b, s, hkv * g, d), BF16)
    f = lambda q, kv, c, lut, v: msa_ops.mha_padded_paged(q, kv, c, lut, np.int32(1), v, mask_str="causal",
                                                          implementation=impl)
    fn = jax.vmap(f)
    assert binds(fn, qs, pools, cls, luts, valid, name="mo.mha.padded.paged") == (1, 0)
    got = np_out(jax.jit(fn)(qs, pools, cls, luts, valid))
    for i in range(N):
        ref = oracle.mha_padded_paged(qs[i], pools[i], cls[i], luts[i], 1, valid[i], mask_str="causal")
        assert_close(got[i], ref, budget_for(BF16), what=f"padded paged [{i}]")


def test_vmap_no_cache_folds(impl):
    rng = np.random.default_rng(12)
    t, tk, h, hkv, d = 40, 56, 4, 2, 64
    offs = stack([[0, 10, 10, 33], spoil_offsets(np.array([0, 5, 30, 38]), t, 1), [3, 3, 20, 40]], np.int32)
    kv_offs = stack([[0, 20, 21, 50], [0, 12, 40, 56], spoil_offsets(np.array([0, 9, 30, 44]), tk, 2)], np.int32)
    qs, ks, vs = rand(rng, (N, t, h, d), BF16), rand(rng, (N, tk, hkv, d), BF16), rand(rng, (N, tk, hkv, d), BF16)
    for mask in ("causal", "null"):
        f = lambda q, k, v, o, ko, m=mask: msa_ops.mha_ragged_no_cache(q, k, v, o, ko, mask_str=m,
                                                                       implementation=impl)
        fn = jax.vmap(f)
        assert binds(fn, qs, ks, vs, offs, kv_offs, name="mo.mha.ragged.no_cache") == (1, 0)
        got = np_out(jax.jit(fn)(qs, ks, vs, offs, kv_offs))
        for i in range(N):
            ref = oracle.mha_ragged_no_cache(qs[i], ks[i], vs[i], offs[i], kv_offs[i], mask_str=mask)
            assert_close(got[i], ref, budget_for(BF16), what=f"ragged no cache [{mask}, {i}]")
    valid = np.array([[3, 0, 9], [-2, 7, 12], [12, 12, 1]], np.int32)
    qp, kp = rand(rng, (N, 3, 12, h, d), BF16), rand(rng, (N, 3, 9, hkv, d), BF16)
    fpad = jax.vmap(lambda q, k, v, vl: msa_ops.mha_padded_no_cache(q, k, v, vl, mask_str="causal",
                                                                    implementation=impl), in_axes=(0, 0, None, 0))
    v_shared = kp[0]
    assert binds(fpad, qp, kp, v_shared, valid, name="mo.mha.padded.no_cache") == (1, 0)
    got = np_out(jax.jit(fpad)(qp, kp, v_shared, valid))
    for i in range(N):
        ref = oracle.mha_padded_no_cache(qp[i], kp[i], v_shared, valid[i], mask_str="causal")
        assert_close(got[i], ref, budget_for(BF16), what=f"padded no cache [{i}]")


@pytest.mark.parametrize("scenario,dt,pool_mapped", [("decode", "bf16", True), ("spec", "fp8", False),
                                                     ("mixed", "bf16", False)])
def test_vmap_msa_attention_folds(impl, scenario, dt, pool_mapped):
    from conftest import DTYPES

    dtype = DTYPES[dt]
    els = paged_elements(scenario, page_size=128, max_pages=MSA_MP, hkv=2, d=128, dtype=dtype, seed=4)
    t = els[0][1].T
    rng = np.random.default_rng(13)
    qs = stack([rand(rng, (t, 8, 128), dtype) for _ in els])
    idx = stack([msa_indices(rng, e[1], 2, 8) for e in els])
    offs, cls, luts = tables(els)
    pools = stack([e[5] for e in els]) if pool_mapped else els[0][5]
    f = lambda q, o, kv, c, lut, ix: msa_ops.msa_attention_ragged_paged(q, o, None, kv, c, lut, np.int32(1), ix,
                                                                        implementation=impl)
    fn = jax.vmap(f, in_axes=(0, 0, 0 if pool_mapped else None, 0, 0, 1), out_axes=0)
    idx_m = np.moveaxis(idx, 0, 1)  # mapped on axis 1
    assert binds(fn, qs, offs, pools, cls, luts, idx_m, name="mo.msa.attention.ragged.paged") == (1, 0)
    assert folded_plan(fn, qs, offs, pools, cls, luts, idx_m, name="mo.msa.attention.ragged.paged") == element_plan(
        "mo.msa.attention.ragged.paged", qs[0], offs[0], None, pools[0] if pool_mapped else pools, cls[0], luts[0],
        1, idx[0])
    got = np_out(jax.jit(fn)(qs, offs, pools, cls, luts, idx_m))
    for i in range(N):
        kv = pools[i] if pool_mapped else pools
        ref = oracle.msa_attention_ragged_paged(qs[i], offs[i], None, kv, cls[i], luts[i], 1, idx[i])
        assert_close(got[i], ref, budget_for(BF16, dtype), what=f"msa [{scenario}, {i}]")


def test_vmap_msa_indexer_folds(impl):
    els = paged_elements("spec", page_size=128, max_pages=IDX_MP, hkv=1, d=64, dtype=np.float32, kv=1, seed=5)
    t = els[0][1].T
    rng = np.random.default_rng(14)
    qs = rand(rng, (N, t, 4, 64), np.float32)
    offs, cls, luts = tables(els)
    pools = stack([e[5] for e in els])
    kw = dict(topk=3, init_blocks=1, local_blocks=1)
    fn = jax.vmap(lambda q, o, kb, c, lut: msa_ops.msa_indexer_ragged_paged(q, o, kb, c, lut, np.int32(0),
                                                                            implementation=impl, **kw))
    assert binds(fn, qs, offs, pools, cls, luts, name="mo.msa.indexer.ragged.paged") == (1, 0)
    got = np_out(jax.jit(fn)(qs, offs, pools, cls, luts))
    for i in range(N):
        ref, sc, el = oracle.msa_indexer_ragged_paged(qs[i], offs[i], pools[i], cls[i], luts[i], 0,
                                                      return_scores=True, **kw)
        assert_indexer_matches(got[i], ref, sc, el, **kw)


def test_vmap_kv_cache_store_folds(impl):
    els = paged_elements("mixed", page_size=16, max_pages=S_MAX // 16, hkv=2, d=64, dtype=BF16, seed=6)
    t = els[0][1].T
    rng = np.random.default_rng(15)
    ks, vs = rand(rng, (N, t, 2, 64), BF16), rand(rng, (N, t, 2, 64), BF16)
    offs, cls, luts = tables(els)
    pools = stack([e[5] for e in els])
    store = lambda kv, k, v, o, c, lut: msa_ops.kv_cache_store_ragged_paged(kv, k, v, o, c, lut, np.int32(1),
                                                                            implementation=impl)
    fn = jax.vmap(store)
    assert binds(fn, pools, ks, vs, offs, cls, luts, name="mo.kv_cache.store.ragged.paged") == (1, 0)
    got = np_out(jax.jit(fn)(pools, ks, vs, offs, cls, luts))
    for i in range(N):
        want = oracle.kv_cache_store_ragged_paged(pools[i], ks[i], vs[i], offs[i], cls[i], luts[i], 1)
        np.testing.assert_array_equal(bits(got[i]), bits(want), err_msg=f"store [{i}]")
    # a shared pool makes one updated pool per element: the loop
    shared = jax.vmap(store, in_axes=(None, 0, 0, 0, 0, 0))
    assert binds(shared, pools[0], ks, vs, offs, cls, luts, name="mo.kv_cache.store.ragged.paged") == (0, 1)


def test_vmap_no_sequences(impl):
    """B = 0 (offsets of one entry) in every element: every row is a padding row, folded too."""
    rng = np.random.default_rng(16)
    pool = rand(rng, (6, 2, 1, 16, 2, 64), np.float32)
    qs = rand(rng, (N, 5, 4, 64), np.float32)
    offs = np.zeros((N, 1), np.int32)
    cl = np.zeros((N, 0), np.int32)
    lut = np.zeros((N, 0, 3), np.int32)
    fn = jax.vmap(lambda q, o, c, t: msa_ops.mha_ragged_paged(q, o, pool, c, t, np.int32(0), mask_str="causal",
                                                              implementation=impl))
    assert binds(fn, qs, offs, cl, lut, name="mo.mha.ragged.paged") == (1, 0)
    got = np_out(jax.jit(fn)(qs, offs, cl, lut))
    assert got.shape == qs.shape and not got.any()


def test_vmap_checks_and_routes_as_one_element(impl):
    """Under vmap an element's shapes and dtypes are checked as a call alone checks them (the fold reshapes operands
    before any bind); the folded call's route is one element's with offsets mapped on another axis than the
    first, and with a max_prompt_length hint past one padded element's rows."""
    rng = np.random.default_rng(17)
    pool = rand(rng, (6, 2, 1, 16, 1, 64), np.float32)
    q = rand(rng, (N, 4, 8, 64), np.float32)
    offs = np.tile(np.arange(5, dtype=np.int32), (N, 1))  # decode: 4 sequences of one row
    cl, lut = np.full((N, 4), 20, np.int32), rng.integers(0, 6, (N, 4, 3)).astype(np.int32)
    f = lambda q, o, c, t: msa_ops.mha_ragged_paged(q, o, pool, c, t, np.int32(0), mask_str="causal",
                                                    implementation=impl)
    name = "mo.mha.ragged.paged"
    for bad in (offs.astype(np.float32), offs[:, :, None]):
        with pytest.raises((msa_ops.OpDtypeError, msa_ops.OpShapeError), match="input_row_offsets"):
            jax.jit(jax.vmap(f))(q, bad, cl, lut)
    with pytest.raises(msa_ops.OpShapeError, match="kv_lookup_table"):
        jax.jit(jax.vmap(f))(q, offs, cl, lut[:, :, 0])
    want = element_plan(name, q[0], offs[0], pool, cl[0], lut[0], np.int32(0), mask_str="causal")
    assert want[0] == "decode"
    fn = jax.vmap(f, in_axes=(0, 1, 0, 0))
    assert folded_plan(fn, q, offs.T.copy(), cl, lut, name=name) == want
    got = np_out(jax.jit(fn)(q, offs.T.copy(), cl, lut))
    for i in range(N):
        assert_close(got[i], oracle.mha_ragged_paged(q[i], offs[i], pool, cl[i], lut[i], 0, mask_str="causal"), 1e-5,
                     what=f"offsets on axis 1 [{i}]")
    qp, valid = rand(rng, (N, 2, 1, 8, 64), np.float32), np.ones((N, 2), np.int32)
    g = lambda q, c, t, v: msa_ops.mha_padded_paged(q, pool, c, t, np.int32(0), v, mask_str="causal",
                                                    max_prompt_length=4, implementation=impl)
    want = element_plan("mo.mha.padded.paged", qp[0], pool, cl[0, :2], lut[0, :2], np.int32(0), valid[0],
                        mask_str="causal", max_prompt_length=4)
    assert folded_plan(jax.vmap(g), qp, cl[:, :2], lut[:, :2], valid, name="mo.mha.padded.paged") == want
