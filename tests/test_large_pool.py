"""Pools past 2^31 elements: every op that reads or writes the paged cache, through the native handler of each
platform (the CPU library here; the CUDA one under ``pytest -m gpu``), on pages that lie at the top of a pool
whose element offsets do not fit in int32 (bf16: past 4 GiB, so the byte offsets pass 2^32 too; on the GPU the
pools pass 2^32 elements). Every page that no sequence names holds NaN, so a read of the wrong page shows.

The oracle runs on a small pool that holds only the pages the sequences name, through the same page tables
renumbered: what it reads is what the big pool holds at those pages.

The CPU cases need about 2.5x a pool's size in free memory and skip, saying so, where less is free.
"""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import BF16, FP8, assert_close, budget_for, rand

import msa_ops
from msa_ops import _native

PAGE = 128
HKV, D = 4, 128
PAGE_ELEMS = 2 * PAGE * HKV * D  # one page of a one-layer [NB, 2, 1, 128, 4, 128] pool


def _free_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be had without swapping), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    p = request.param
    if p == "gpu":
        if jax.default_backend() != "gpu":
            pytest.skip("no GPU backend")
        if not _native.available("cuda"):
            pytest.fail(f"CUDA library missing on a GPU machine: {_native.missing_reason('cuda')}")
    elif not _native.available("cpu"):
        pytest.skip(f"native CPU library not available: {_native.missing_reason('cpu')}")
    return p


@pytest.fixture(autouse=True)
def _release_pools():
    """Each test's pools go before the next one's are built."""
    yield
    gc.collect()


def _min_elements(platform: str, itemsize: int) -> int:
    """Past 2^31 elements, and past 2^32 on the GPU or in fp8 (whose 2^31 elements would stay under 4 GiB of bytes)."""
    return 2**32 + 2**26 if platform == "gpu" or itemsize == 1 else 2**31 + 2**26


def _device(platform: str):
    return jax.devices(platform)[0]


def _need(platform: str, nbytes: int):
    if platform == "cpu" and _free_bytes() < 2.5 * nbytes:
        pytest.skip(f"needs about {2.5 * nbytes / 2**30:.0f} GiB free for a {nbytes / 2**30:.1f} GiB pool; "
                    f"{_free_bytes() / 2**30:.1f} GiB free")


def _big_pool(platform, small, num_blocks):
    """A [num_blocks, ...] pool of NaN with small[i] at page ids[i], on the platform's device; returns (pool, ids).
    ids: the small pool's pages placed at the top of the pool, one of them low (page 1)."""
    n = small.shape[0]
    ids = np.concatenate([[1], num_blocks - 1 - 3 * np.arange(n - 1)]).astype(np.int32)
    dt = small.dtype

    @jax.jit
    def build(vals):
        pool = jnp.full((num_blocks,) + small.shape[1:], jnp.nan, dt)
        return pool.at[jnp.asarray(ids)].set(vals)

    with jax.default_device(_device(platform)):
        pool = build(jnp.asarray(small))
    return pool, ids


def _blocks_for(platform, page_elems, itemsize):
    nb = -(-_min_elements(platform, itemsize) // page_elems)
    _need(platform, nb * page_elems * itemsize)
    return nb


def _put(platform, *xs):
    dev = _device(platform)
    return [jax.device_put(jnp.asarray(x), dev) for x in xs]


def _paged_batch(rng, lens, max_pages):
    """A small pool's page table for sequences of `lens` keys: distinct pages in random order, -1 past the keys."""
    need = [-(-n // PAGE) for n in lens]
    perm = rng.permutation(sum(need)).astype(np.int32)
    lut = np.full((len(lens), max_pages), -1, np.int32)
    at = 0
    for b, k in enumerate(need):
        lut[b, :k] = perm[at:at + k]
        at += k
    return lut, sum(need)


def _renumber(lut, ids):
    return np.where(lut >= 0, ids[np.maximum(lut, 0)], -1).astype(np.int32)


@pytest.mark.parametrize("num_partitions", [0, 3])
def test_large_pool_mha_ragged_paged(platform, num_partitions):
    rng = np.random.default_rng(11 + num_partitions)
    nb = _blocks_for(platform, PAGE_ELEMS, 2)
    H = 4 * HKV
    cache, new = [700, 300, 1000, 0], [1, 1, 37, 90]  # decode rows, a chunk after a cache, a prompt
    lut, n_pages = _paged_batch(rng, [c + n for c, n in zip(cache, new)], 9)
    small = rand(rng, (n_pages, 2, 1, PAGE, HKV, D), BF16)
    offs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]), H, D), BF16)
    cl = np.array(cache, np.int32)
    sinks = rand(rng, (H,), BF16)
    ref = oracle.mha_ragged_paged(q, offs, small, cl, lut, 0, mask_str="causal", sink_weights=sinks)
    pool, ids = _big_pool(platform, small, nb)
    args = _put(platform, q, offs) + [pool] + _put(platform, cl, _renumber(lut, ids), np.int32(0), sinks)
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a[:6], sink_weights=a[6], mask_str="causal",
                                                    num_partitions=num_partitions, implementation="native"))
    got = np.asarray(f(*args), np.float32)
    assert_close(got, ref, budget_for(BF16), what=f"{platform} pool of {nb} pages")


def test_large_pool_mha_padded_paged(platform):
    rng = np.random.default_rng(5)
    nb = _blocks_for(platform, PAGE_ELEMS, 2)
    H, S = 2 * HKV, 20
    cache, valid = [260, 0, 900], [1, 20, 7]
    lut, n_pages = _paged_batch(rng, [c + n for c, n in zip(cache, valid)], 8)
    small = rand(rng, (n_pages, 2, 1, PAGE, HKV, D), BF16)
    q = rand(rng, (3, S, H, D), BF16)
    cl, vl = np.array(cache, np.int32), np.array(valid, np.int32)
    ref = oracle.mha_padded_paged(q, small, cl, lut, 0, vl, mask_str="sliding_window_causal",
                                  local_window_size=300)
    pool, ids = _big_pool(platform, small, nb)
    args = _put(platform, q) + [pool] + _put(platform, cl, _renumber(lut, ids), np.int32(0), vl)
    f = jax.jit(lambda *a: msa_ops.mha_padded_paged(*a, mask_str="sliding_window_causal", local_window_size=300,
                                                    implementation="native"))
    got = np.asarray(f(*args), np.float32)
    assert_close(got, ref, budget_for(BF16), what=f"{platform} pool of {nb} pages")


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_large_pool_msa_attention(platform, dtype, rows):
    rng = np.random.default_rng(3 if rows == "decode" else 4)
    itemsize = np.dtype(dtype).itemsize
    nb = _blocks_for(platform, PAGE_ELEMS, itemsize)
    H, topk = 4 * HKV, 4
    cache, new = ([900, 131, 600], [1, 1, 1]) if rows == "decode" else ([0, 300], [150, 40])
    lens = [c + n for c, n in zip(cache, new)]
    lut, n_pages = _paged_batch(rng, lens, 8)
    small = rand(rng, (n_pages, 2, 1, PAGE, HKV, D), dtype)
    offs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    T = int(offs[-1])
    q = rand(rng, (T, H, D), dtype)
    cl = np.array(cache, np.int32)
    idx = np.full((HKV, T, topk), -1, np.int32)
    for b, (c, n) in enumerate(zip(cache, new)):
        nblk = -(-(c + n) // PAGE)
        for t in range(offs[b], offs[b + 1]):
            for h in range(HKV):
                pick = rng.choice(nblk, size=min(topk, nblk), replace=False)
                idx[h, t, :len(pick)] = pick
    ref = oracle.msa_attention_ragged_paged(q, offs, None, small, cl, lut, 0, idx)
    pool, ids = _big_pool(platform, small, nb)
    args = _put(platform, q, offs) + [pool] + _put(platform, cl, _renumber(lut, ids), np.int32(0), idx)
    f = jax.jit(lambda q, o, kv, c, lut, layer, idx: msa_ops.msa_attention_ragged_paged(
        q, o, None, kv, c, lut, layer, idx, implementation="native"))
    got = np.asarray(f(*args), np.float32)
    assert_close(got, ref, budget_for(dtype), what=f"{platform} pool of {nb} pages")


def test_large_pool_msa_indexer(platform):
    rng = np.random.default_rng(8)
    Hi, Di, topk = 4, 128, 2
    page_elems = PAGE * Di
    nb = _blocks_for(platform, page_elems, 2)
    cache, new = [1000, 600, 260], [1, 130, 2]  # every row has more eligible blocks than it keeps
    lut, n_pages = _paged_batch(rng, [c + n for c, n in zip(cache, new)], 9)
    small = rand(rng, (n_pages, 1, 1, PAGE, 1, Di), BF16)
    offs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]), Hi, Di), BF16)
    cl = np.array(cache, np.int32)
    ref = oracle.msa_indexer_ragged_paged(q, offs, small, cl, lut, 0, topk=topk, init_blocks=1)
    pool, ids = _big_pool(platform, small, nb)
    args = _put(platform, q, offs) + [pool] + _put(platform, cl, _renumber(lut, ids), np.int32(0))
    f = jax.jit(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, topk=topk, init_blocks=1, implementation="native"))
    got = np.asarray(f(*args))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_large_pool_store(platform, dtype):
    rng = np.random.default_rng(21)
    nb = _blocks_for(platform, PAGE_ELEMS, np.dtype(dtype).itemsize)
    cache, new = [130, 0, 255], [3, 129, 2]
    lut, n_pages = _paged_batch(rng, [c + n for c, n in zip(cache, new)], 4)
    small = rand(rng, (n_pages, 2, 1, PAGE, HKV, D), dtype)
    offs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    k, v = rand(rng, (int(offs[-1]), HKV, D), dtype), rand(rng, (int(offs[-1]), HKV, D), dtype)
    cl = np.array(cache, np.int32)
    ref = oracle.kv_cache_store_ragged_paged(small, k, v, offs, cl, lut, 0)
    pool, ids = _big_pool(platform, small, nb)
    args = _put(platform, k, v, offs, cl, _renumber(lut, ids), np.int32(0))
    f = jax.jit(lambda kv, *a: msa_ops.kv_cache_store_ragged_paged(kv, *a, implementation="native"),
                donate_argnums=0)
    out = f(pool, *args)
    del pool
    got = np.asarray(jax.jit(lambda p: p[jnp.asarray(ids)])(out))
    u8 = np.uint8 if np.dtype(dtype).itemsize == 1 else np.uint16
    np.testing.assert_array_equal(got.view(u8), ref.view(u8))
    # every other page still holds the NaN it was built with (nothing written to the wrong page)
    all_nan = np.asarray(jax.jit(lambda p: jnp.isnan(p).reshape(nb, -1).all(axis=1))(out))
    others = np.ones(nb, bool)
    others[ids] = False
    assert all_nan[others].all(), np.flatnonzero(others & ~all_nan)[:10]
