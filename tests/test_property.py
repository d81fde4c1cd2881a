"""Property tests (hypothesis): random shapes, lengths and attributes for the paged ops, reference and native
CPU against the float64 oracle. Complements the fixed-shape seeded sweeps of test_reference.py."""

from __future__ import annotations

import jax
import numpy as np
import oracle
import pytest
from conftest import assert_close, budget_for, make_paged_cache, rand
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import msa_ops

MASKS = ["null", "causal", "sliding_window_causal", "sliding_window_noncausal", "chunked_causal"]
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _native_ok() -> bool:
    from msa_ops import _native

    return _native.available("cpu")


@st.composite
def paged_problems(draw):
    b = draw(st.integers(1, 4))
    n = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    cache = draw(st.lists(st.integers(0, 90), min_size=b, max_size=b))
    pad = draw(st.integers(0, 5))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    d = draw(st.sampled_from([16, 64, 128, 256]))
    page = draw(st.sampled_from([8, 16, 32]))
    mask = draw(st.sampled_from(MASKS))
    window = draw(st.integers(1, 50))
    sink = draw(st.booleans())
    np_ = draw(st.sampled_from([0, 1, 3]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    wide = draw(st.booleans())  # >= 160 rows and a prompt-length hint: the 128-row query tile on CUDA
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(n=n, cache=cache, pad=pad, hkv=hkv, group=group, d=d, page=page, mask=mask, window=window,
                sink=sink, np_=np_, dtype=dtype, wide=wide, seed=seed)


def check_mha_ragged_paged(p, impl, device):
    """One paged-MHA problem on `device` with `implementation=impl`, against the float64 oracle."""
    rng = np.random.default_rng(p["seed"])
    dtype = jax.numpy.dtype(p["dtype"])
    total = [c + n for c, n in zip(p["cache"], p["n"])]
    mp = max(1, -(-max(total) // p["page"]))
    cache = make_paged_cache(rng, total, page_size=p["page"], max_pages=mp, n_kv_heads=p["hkv"], head_dim=p["d"],
                             dtype=dtype)
    t = sum(p["n"]) + p["pad"]
    hints = {}
    if p["wide"]:
        t = max(t, 160)
        hints["max_prompt_length"] = 1024
    h = p["hkv"] * p["group"]
    q = rand(rng, (max(t, 1), h, p["d"]), dtype)
    offsets = np.concatenate([[0], np.cumsum(p["n"])]).astype(np.int32)
    sink = rand(rng, (h,), dtype) if p["sink"] else None
    args = (q, offsets, cache.kv_blocks, np.asarray(p["cache"], np.int32), cache.lut, 1)
    kw = dict(mask_str=p["mask"], local_window_size=p["window"])
    with jax.default_device(device):
        got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, sink_weights=sink, num_partitions=p["np_"],
                                                          implementation=impl, **kw, **hints))(*args)
    want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
    assert_close(got, want, budget_for(dtype))


@pytest.mark.parametrize("impl", ["reference", "native"])
@SETTINGS
@given(p=paged_problems())
def test_mha_ragged_paged_property(impl, p):
    if impl == "native" and not _native_ok():
        pytest.skip("native CPU library not available")
    check_mha_ragged_paged(p, impl, jax.devices("cpu")[0])


@st.composite
def msa_problems(draw):
    b = draw(st.integers(1, 3))
    n = draw(st.lists(st.integers(0, 12), min_size=b, max_size=b))
    cache = draw(st.lists(st.integers(0, 400), min_size=b, max_size=b))
    group = draw(st.sampled_from([1, 4, 16]))
    topk = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(["bfloat16", "float8_e4m3fn"]))
    np_ = draw(st.sampled_from([0, 2]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(n=n, cache=cache, group=group, topk=topk, dtype=dtype, np_=np_, seed=seed)


def check_msa_attention(p, impl, device):
    rng = np.random.default_rng(p["seed"])
    dtype = jax.numpy.dtype(p["dtype"])
    total = [c + n for c, n in zip(p["cache"], p["n"])]
    mp = max(1, -(-max(total) // 128))
    hkv = 2
    cache = make_paged_cache(rng, total, page_size=128, max_pages=mp, n_kv_heads=hkv, head_dim=128, dtype=dtype)
    t = max(1, sum(p["n"]))
    q = rand(rng, (t, hkv * p["group"], 128), dtype)
    offsets = np.concatenate([[0], np.cumsum(p["n"])]).astype(np.int32)
    ids = rng.integers(-1, mp + 2, (hkv, t, p["topk"])).astype(np.int32)
    args = (q, offsets, None, cache.kv_blocks, np.asarray(p["cache"], np.int32), cache.lut, 0, ids)
    with jax.default_device(device):
        got = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=p["np_"],
                                                                    implementation=impl),
                      static_argnums=2)(*args)
    want = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, want, budget_for(dtype))


@pytest.mark.parametrize("impl", ["reference", "native"])
@SETTINGS
@given(p=msa_problems())
def test_msa_attention_property(impl, p):
    if impl == "native" and not _native_ok():
        pytest.skip("native CPU library not available")
    check_msa_attention(p, impl, jax.devices("cpu")[0])


@st.composite
def indexer_problems(draw):
    b = draw(st.integers(1, 3))
    n = draw(st.lists(st.integers(0, 10), min_size=b, max_size=b))
    cache = draw(st.lists(st.integers(0, 1500), min_size=b, max_size=b))  # up to 12 blocks
    pad = draw(st.integers(0, 3))
    hi = draw(st.sampled_from([1, 2, 4, 5]))
    di = draw(st.sampled_from([16, 32, 64, 128]))
    topk = draw(st.integers(1, 6))
    init = draw(st.integers(0, topk))
    local = draw(st.integers(0, topk - init))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]))
    bad_page = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(n=n, cache=cache, pad=pad, hi=hi, di=di, topk=topk, init=init, local=local, dtype=dtype,
                bad_page=bad_page, seed=seed)


def check_msa_indexer(p, impl, device):
    from test_reference import assert_indexer_matches

    rng = np.random.default_rng(p["seed"])
    dtype = jax.numpy.dtype(p["dtype"])
    total = [c + n for c, n in zip(p["cache"], p["n"])]
    mp = max(1, -(-max(total) // 128))
    kb = make_paged_cache(rng, total, page_size=128, max_pages=mp, n_kv_heads=1, head_dim=p["di"], dtype=dtype,
                          kv=1, num_layers=1)
    lut = kb.lut.copy()
    if p["bad_page"]:  # a page outside the pool: that block is not eligible
        lut[0, 0] = kb.kv_blocks.shape[0] + 1
    t = sum(p["n"]) + p["pad"]
    q = rand(rng, (max(t, 1), p["hi"], p["di"]), dtype)
    offsets = np.concatenate([[0], np.cumsum(p["n"])]).astype(np.int32)
    args = (q, offsets, kb.kv_blocks, np.asarray(p["cache"], np.int32), lut, 0)
    kw = dict(topk=p["topk"], init_blocks=p["init"], local_blocks=p["local"])
    with jax.default_device(device):
        got = np.asarray(jax.jit(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, implementation=impl, **kw))(*args))
    want, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, want, scores, elig, p["topk"], p["init"], p["local"])


@pytest.mark.parametrize("impl", ["reference", "native"])
@SETTINGS
@given(p=indexer_problems())
def test_msa_indexer_property(impl, p):
    if impl == "native" and not _native_ok():
        pytest.skip("native CPU library not available")
    check_msa_indexer(p, impl, jax.devices("cpu")[0])
