"""GPU tests (``pytest -m gpu``), run on the GPU machine by scripts/gpu_check.sh.

The CUDA handlers that exist are checked against the float64 oracle (bit-exact where the op only moves
data); the reference lowering is checked on the GPU for the attention ops whose CUDA kernels are still to
come. Skipped where no GPU backend is present.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import RaggedBatch, assert_close, budget_for, make_batch, make_paged_cache, on_cpu, rand, share_pages

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("no GPU backend", allow_module_level=True)

import msa_ops  # noqa: E402
from msa_ops import _native  # noqa: E402


def nan_past_keys(cache, cache_lens, ns, page, layer=1):
    """A copy of the pool with NaN in each sequence's last page past its keys (in `layer`): slots a kernel may load
    but must never let reach an output, not even as 0 * NaN."""
    kv_blocks = np.array(cache.kv_blocks)
    for b, (c, m) in enumerate(zip(cache_lens, ns)):
        if (c + m) % page:
            kv_blocks[cache.lut[b, (c + m) // page], :, layer, (c + m) % page:] = np.nan
    return kv_blocks


def launched(f, *args):
    """(f(*args) as float32 numpy, the kinds of kernel the call launched): msa_ops._native.launch_counts read
    before and after it. (A jitted function of one op runs its handler at every call: XLA puts graphs that small
    into no command buffer.)"""
    before = _native.launch_counts()
    assert before is not None, "the CUDA library does not count its launches (stale build?)"
    got = np.asarray(f(*args), np.float32)
    after = _native.launch_counts()
    return got, {k for k, n in after.items() if n > before[k]}


def assert_served(kinds, want):
    assert want in kinds, f"expected the {want} kernel to serve the call; launched: {sorted(kinds)}"


def run_on_poisoned_output(f, args, shape, lead, tail, served=None):
    """f(*args) once to compile it (its temporaries freed), then again after an array of the output's size filled
    with NaN was freed, so rows that nobody writes show up; the first `lead` and last `tail` rows must be 0. With
    `served`, that kind of kernel (launch_counts) must be among the second call's launches."""
    jax.block_until_ready(f(*args))
    poison = jnp.full(shape, jnp.nan, jnp.bfloat16).block_until_ready()
    del poison
    got, kinds = launched(f, *args)
    if served is not None:
        assert_served(kinds, served)
    assert np.all(got[:lead] == 0) and np.all(got[shape[0] - tail:] == 0)
    return got


def test_cuda_library_loaded():
    assert _native.available("cuda"), _native.missing_reason("cuda")
    targets = set(_native.registered_targets("cuda"))
    assert {"msa_ops_kv_cache_store", "msa_ops_kv_cache_row_offsets", "msa_ops_get_num_partitions"} <= targets


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scenario", ["prefill", "decode", "mixed", "long"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
def test_store_cuda_matches_oracle(seed, scenario, dtype):
    rng = np.random.default_rng(seed)
    batch = make_batch(rng, scenario)
    page = 16
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=page,
                             max_pages=512 // page, n_kv_heads=2, head_dim=64, dtype=dtype)
    lut = cache.lut.copy()
    if seed % 2:  # some rows land on pages outside the pool: dropped
        lut[0, : min(2, lut.shape[1])] = [cache.kv_blocks.shape[0] + 5, -3][: min(2, lut.shape[1])]
    k = rand(rng, (batch.T, 2, 64), dtype)
    v = rand(rng, (batch.T, 2, 64), dtype)
    layer = seed % 3  # 2 is out of range: nothing written
    want = oracle.kv_cache_store_ragged_paged(cache.kv_blocks, k, v, batch.offsets, batch.cache_lengths, lut, layer)
    f = jax.jit(lambda *a: msa_ops.kv_cache_store_ragged_paged(*a, implementation="native"), donate_argnums=0)
    got = f(jnp.asarray(cache.kv_blocks), jnp.asarray(k), jnp.asarray(v), jnp.asarray(batch.offsets),
            jnp.asarray(batch.cache_lengths).astype(jnp.uint32), jnp.asarray(lut), jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32))


def test_row_offsets_and_partitions_cuda():
    rng = np.random.default_rng(0)
    offs = np.concatenate([[0], np.cumsum(rng.integers(0, 9, 33))]).astype(np.int32)
    cl = rng.integers(-5, 5000, 33).astype(np.int32)
    got = msa_ops.kv_cache_row_offsets_ragged_paged(offs, cl, implementation="native")
    np.testing.assert_array_equal(np.asarray(got), oracle.kv_cache_row_offsets_ragged_paged(offs, cl))
    for b in (1, 3, 64):
        for n in (0, 511, 512, 4096, 131072):
            got = msa_ops.mha_decode_get_num_partitions(jnp.int32(b), jnp.int32(n), n_kv_heads=8, sm_count=132,
                                                        implementation="native")
            want = oracle.get_num_partitions(b, n, n_kv_heads=8, sm_count=132)
            assert int(got) == want, (b, n)
    for b in (-3, 0, 2 ** 28, 2 ** 31 - 1):  # batch x heads past int32; a batch <= 0 divides by 1
        got = msa_ops.mha_decode_get_num_partitions(jnp.int32(b), jnp.int32(10 ** 6), n_kv_heads=128,
                                                    sm_count=132, implementation="native")
        assert int(got) == oracle.get_num_partitions(b, 10 ** 6, n_kv_heads=128, sm_count=132), b


def test_cuda_no_sequence_and_no_key():
    """The CUDA handlers on shapes that leave nothing to attend (SEMANTICS.md §12): ragged offsets of one
    entry (B = 0), every one of T > 0 rows a padding row, and no-cache K/V with no key row. The outputs are written
    after a NaN-filled array of their size was freed, so rows that no kernel writes show up."""
    rng = np.random.default_rng(72)
    T, H, Hkv, D, MP = 7, 8, 2, 128, 3
    o0, c0, lut0 = np.array([0], np.int32), np.zeros((0,), np.int32), np.zeros((0, MP), np.int32)
    q = jnp.asarray(rand(rng, (T, H, D), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rand(rng, (5, 2, 2, 16, Hkv, D), np.float32), jnp.bfloat16)
    f = jax.jit(lambda q: msa_ops.mha_ragged_paged(q, o0, kv, c0, lut0, np.int32(1), implementation="native"))
    run_on_poisoned_output(f, (q,), (T, H, D), T, 0)
    k = jnp.asarray(rand(rng, (T, Hkv, D), np.float32), jnp.bfloat16)
    got = jax.jit(lambda c, k: msa_ops.kv_cache_store_ragged_paged(c, k, k, o0, c0, lut0, np.int32(0),
                                                                    implementation="native"))(kv, k)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(kv, np.float32))
    qm = jnp.asarray(rand(rng, (T, 4, 128), np.float32), jnp.bfloat16)
    kvm = jnp.asarray(rand(rng, (3, 2, 1, 128, 1, 128), np.float32), jnp.bfloat16)
    idx = rng.integers(-1, MP, (1, T, 4)).astype(np.int32)
    f = jax.jit(lambda q: msa_ops.msa_attention_ragged_paged(q, o0, None, kvm, c0, lut0, np.int32(0), idx,
                                                             implementation="native"))
    run_on_poisoned_output(f, (qm,), (T, 4, 128), T, 0)
    got = msa_ops.msa_indexer_ragged_paged(qm, o0, kvm[:, :1], c0, lut0, np.int32(0), topk=2,
                                           implementation="native")
    assert got.shape == (4, T, 2) and bool((got == -1).all())
    k0 = jnp.zeros((0, Hkv, D), jnp.bfloat16)
    offs = np.array([0, 3, T], np.int32)
    f = jax.jit(lambda q: msa_ops.mha_ragged_no_cache(q, k0, k0, offs, np.zeros((3,), np.int32),
                                                      implementation="native"))
    run_on_poisoned_output(f, (q,), (T, H, D), T, 0)
    qp = jnp.asarray(rand(rng, (2, 5, H, D), np.float32), jnp.bfloat16)
    kp0 = jnp.zeros((2, 0, Hkv, D), jnp.bfloat16)
    f = jax.jit(lambda q: msa_ops.mha_padded_no_cache(q, kp0, kp0, np.array([3, 5], np.int32),
                                                      implementation="native"))
    run_on_poisoned_output(lambda q: f(q).reshape(10, H, D), (qp,), (10, H, D), 10, 0)


@pytest.mark.parametrize("scenario", ["decode", "mixed", "long"])
@pytest.mark.parametrize("mask", ["causal", "sliding_window_causal"])
def test_reference_mha_on_gpu(scenario, mask):
    rng = np.random.default_rng(1)
    batch = make_batch(rng, scenario)
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=16, max_pages=32,
                             n_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, 8, 128), jnp.bfloat16)
    args = (q, batch.offsets, cache.kv_blocks, batch.cache_lengths, cache.lut, 1)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str=mask, local_window_size=37,
                                                      implementation="reference"))(*args)
    want = oracle.mha_ragged_paged(*args, mask_str=mask, local_window_size=37)
    assert_close(got, want, budget_for(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_reference_msa_on_gpu(dtype):
    rng = np.random.default_rng(2)
    batch = make_batch(rng, "decode")
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=128, max_pages=4,
                             n_kv_heads=2, head_dim=128, dtype=dtype)
    q = rand(rng, (batch.T, 8, 128), dtype)
    ids = rng.integers(-1, 5, (2, batch.T, 4)).astype(np.int32)
    args = (q, batch.offsets, None, cache.kv_blocks, batch.cache_lengths, cache.lut, 0, ids)
    got = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="reference"),
                  static_argnums=2)(*args)
    want = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, want, budget_for(dtype))


# ------------------------------------------------------------------------------------------ CUDA attention

MASKS = ["null", "causal", "sliding_window_causal", "sliding_window_noncausal", "chunked_causal"]
SCENARIOS = ["prefill", "decode", "decode1", "spec", "mixed", "long"]


def _mha_cases():
    rng = np.random.default_rng(1234)
    cases = []
    for i in range(48):
        cases.append(dict(
            seed=i, scenario=SCENARIOS[i % len(SCENARIOS)], mask=MASKS[(i // 2) % len(MASKS)],
            group=[1, 4, 8, 16][i % 4], page=[16, 128, 64][i % 3], d=[128, 64][(i // 3) % 2],
            dtype=[jnp.bfloat16, jnp.float16][(i // 5) % 2], np_=[0, 1, 2, 7, 32][(i // 7) % 5],
            sink=bool(rng.integers(2)), window=int(rng.integers(1, 60)),
        ))
    return cases


@pytest.mark.parametrize("case", _mha_cases(), ids=lambda c: f"{c['seed']}-{c['scenario']}-{c['mask']}")
def test_cuda_mha_ragged_paged_matches_oracle(case):
    rng = np.random.default_rng(case["seed"])
    batch = make_batch(rng, case["scenario"])
    hkv = 2
    h = hkv * case["group"]
    d = case["d"]
    page = case["page"]
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=page,
                             max_pages=-(-512 // page), n_kv_heads=hkv, head_dim=d, dtype=case["dtype"])
    q = rand(rng, (batch.T, h, d), case["dtype"])
    sink = rand(rng, (h,), case["dtype"]) if case["sink"] else None
    kv_blocks = nan_past_keys(cache, batch.cache, batch.n, page)
    args = (q, batch.offsets, kv_blocks, batch.cache_lengths, cache.lut, 1)
    kw = dict(mask_str=case["mask"], local_window_size=case["window"])
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, sink_weights=sink, num_partitions=case["np_"],
                                                      implementation="native", **kw))(*args)
    want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
    assert_close(got, want, budget_for(case["dtype"]))


@pytest.mark.parametrize("page", [24, 48, 96])
@pytest.mark.parametrize("scenario", ["decode", "spec"])
@pytest.mark.parametrize("np_", [0, 3])
def test_cuda_mha_page_sizes_not_a_power_of_two(page, scenario, np_):
    """Pages of 24 and 48 keys (smaller than a key tile) and of 96 (larger than a tile, not a multiple of it): the
    page-table index and slot come from a division instead of a shift (in the 8-row decode tile, the loader of the
    kernel of any layout)."""
    rng = np.random.default_rng(page + np_)
    batch = make_batch(rng, scenario)
    hkv, group, d = 2, 4, 128
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=page,
                             max_pages=-(-512 // page), n_kv_heads=hkv, head_dim=d, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, hkv * group, d), jnp.bfloat16)
    args = (q, batch.offsets, nan_past_keys(cache, batch.cache, batch.n, page), batch.cache_lengths, cache.lut, 1)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal", num_partitions=np_,
                                                      implementation="native"))(*args)
    assert_close(got, oracle.mha_ragged_paged(*args, mask_str="causal"), budget_for(jnp.bfloat16))


def _tile128_cases():
    rng = np.random.default_rng(4321)
    cases = []
    for i in range(20):
        cases.append(dict(
            seed=100 + i, scenario=["big", "long", "mixed", "decode", "spec"][i % 5], mask=MASKS[i % len(MASKS)],
            group=[1, 4, 8, 16][(i // 2) % 4], page=[16, 128, 64, 256][i % 4], d=[128, 64][(i // 5) % 2],
            dtype=[jnp.bfloat16, jnp.float16][(i // 3) % 2], np_=[0, 1, 3][(i // 4) % 3],
            sink=bool(rng.integers(2)), window=int(rng.integers(1, 300)),
        ))
    return cases


def use_128_row_kernel(monkeypatch, kernel):
    """Selects the kernel that serves the 128-row tile on sm_90: the warp-specialized persistent one on 128-row
    items (wgmma_ws; MSA_OPS_DENSE_WS_PAIR=0, MSA_OPS_DENSE_WS3=0), on 192-row items with three consumer
    warpgroups at head dim 64 (wgmma_ws3; MSA_OPS_DENSE_WS3=1, other head dims on the 128-row items) or on 64-row
    items, one warpgroup each (wgmma_pair; =1, for ragged calls whose group divides 64, else the 128-row items), the
    CTA-per-tile warpgroup-MMA one (MSA_OPS_DENSE_WS=0) or mma.sync (MSA_OPS_CUDA_WGMMA=0, the kernel of every other
    GPU)."""
    monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "0" if kernel == "mma_sync" else "1")
    monkeypatch.setenv("MSA_OPS_DENSE_WS", "1" if kernel in ("wgmma_ws", "wgmma_pair", "wgmma_ws3") else "0")
    monkeypatch.setenv("MSA_OPS_DENSE_WS_PAIR", "1" if kernel == "wgmma_pair" else "0")
    monkeypatch.setenv("MSA_OPS_DENSE_WS3", "1" if kernel == "wgmma_ws3" else "0")


KERNELS_128 = ["wgmma_ws", "wgmma_pair", "wgmma", "mma_sync"]


def kind_128(kernel, group, ragged=True, page=16, d=128):
    """The launch kind (launch_counts) that serves a 128-row-tile call under use_128_row_kernel(kernel): the pair
    kernel takes ragged calls whose group divides 64, the 128-row items the rest; the 192-row items head dim 64;
    pages under 8 keys or not a power of two have no TMA boxes, so mma.sync serves them."""
    if kernel == "mma_sync" or page < 8 or page & (page - 1):
        return "mma"
    if kernel == "wgmma":
        return "sm90_cta"
    if kernel == "wgmma_ws3":
        return "sm90_ws3" if d == 64 else "sm90_ws"
    return "sm90_pair" if kernel == "wgmma_pair" and ragged and 64 % group == 0 else "sm90_ws"


@pytest.mark.parametrize("kernel", KERNELS_128)
@pytest.mark.parametrize("case", _tile128_cases(), ids=lambda c: f"{c['seed']}-{c['scenario']}-{c['mask']}")
def test_cuda_mha_128_row_tiles_match_oracle(case, kernel, monkeypatch):
    """The 128-row prefill tile (a max_prompt_length hint forces it on any batch) on the three kernels that serve
    it (use_128_row_kernel)."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(case["seed"])
    if case["scenario"] == "big":  # several query and key tiles, partial last tiles, an empty sequence
        batch = RaggedBatch([700, 0, 129, 1], [300, 0, 1000, 5], 850)
        s_max = 1200
    else:
        b0 = make_batch(rng, case["scenario"])
        batch = RaggedBatch(b0.n, b0.cache, max(b0.T, 160))  # padding rows up to 160: max_q >= 128
        s_max = 512
    hkv, d, page = 2, case["d"], case["page"]
    h = hkv * case["group"]
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=page,
                             max_pages=-(-s_max // page), n_kv_heads=hkv, head_dim=d, dtype=case["dtype"])
    q = rand(rng, (batch.T, h, d), case["dtype"])
    sink = rand(rng, (h,), case["dtype"]) if case["sink"] else None
    kv_blocks = nan_past_keys(cache, batch.cache, batch.n, page)
    args = (q, batch.offsets, kv_blocks, batch.cache_lengths, cache.lut, 1)
    kw = dict(mask_str=case["mask"], local_window_size=case["window"])
    plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=case["np_"], max_prompt_length=1024, **kw)
    assert plan.tile_m == 128
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_ragged_paged(
        *a, sink_weights=sink, num_partitions=case["np_"], implementation="native", max_prompt_length=1024, **kw)),
        *args)
    assert_served(kinds, kind_128(kernel, case["group"], page=page, d=d))
    want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
    assert_close(got, want, budget_for(case["dtype"]))


@pytest.mark.parametrize("group,n_tok", [(1, 8), (2, 4), (4, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_mha_8_row_tiles_match_oracle(group, n_tok, mask):
    """The transposed 8-row tile (decode and short speculative steps, group <= 8): every mask, sinks, split-K,
    both dtypes and head dims, pages 16 and 128. One sequence is longer than the max_prompt_length hint, so it
    spans several 8-row tiles (the hint steers routing only)."""
    i = MASKS.index(mask)
    rng = np.random.default_rng(7000 + 10 * group + n_tok + 100 * i)
    n = [int(x) for x in rng.integers(1, n_tok + 1, 6)]
    n[0], n[2] = n_tok, 3 * n_tok + 5
    cache = [int(x) for x in rng.integers(0, 480, 6)]
    cache[1] = 0
    batch = RaggedBatch(n, cache, sum(n) + 2)
    hkv, d, page = 2, [128, 64][i % 2], [16, 128][(i + group) % 2]
    dtype = [jnp.bfloat16, jnp.float16][(i + n_tok) % 2]
    h = hkv * group
    cache_ = make_paged_cache(rng, [c + m for c, m in zip(batch.cache, batch.n)], page_size=page,
                              max_pages=-(-512 // page), n_kv_heads=hkv, head_dim=d, dtype=dtype)
    q = rand(rng, (batch.T, h, d), dtype)
    sink = rand(rng, (h,), dtype) if (i + group) % 2 else None
    kv_blocks = nan_past_keys(cache_, batch.cache, batch.n, page)
    args = (q, batch.offsets, kv_blocks, batch.cache_lengths, cache_.lut, 1)
    kw = dict(mask_str=mask, local_window_size=int(rng.integers(1, 60)))
    for np_ in (0, 1, 3, 8):
        plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=np_, max_prompt_length=n_tok, **kw)
        assert plan.tile_m == 8
        got = jax.jit(lambda *a, np_=np_: msa_ops.mha_ragged_paged(
            *a, sink_weights=sink, num_partitions=np_, implementation="native", max_prompt_length=n_tok, **kw))(*args)
        want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
        assert_close(got, want, budget_for(dtype))


@pytest.mark.parametrize("group,n_tok,hint", [(4, 1, 1), (16, 1, 1), (2, 40, 32)])
@pytest.mark.parametrize("np_", [1, 3])
def test_cuda_mha_unowned_rows_are_zero(group, n_tok, hint, np_):
    """Rows before offsets[0] and past offsets[B] output 0: written by the attention kernel's spare CTAs when the
    partitions merge in the kernel (unsplit; split 8-row tiles on sm_90+, in clusters), else by the combine kernel;
    8-, 16- and 64-row tiles. The output's memory is poisoned first (an array of its size filled with NaN and
    freed), so rows that nobody writes show up."""
    rng = np.random.default_rng(11 + group + n_tok)
    hkv, d, page = 2, 128, 128
    n = [n_tok, n_tok, 3 * n_tok, n_tok]
    cache = [int(x) for x in rng.integers(0, 300, len(n))]
    lead, tail = 3, 5
    offs = np.concatenate([[lead], lead + np.cumsum(n)]).astype(np.int32)
    T = int(offs[-1]) + tail
    h = hkv * group
    pc = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=page, max_pages=4, n_kv_heads=hkv,
                          head_dim=d, dtype=jnp.bfloat16)
    q = rand(rng, (T, h, d), jnp.bfloat16)
    args = (q, offs, pc.kv_blocks, np.asarray(cache, np.int32), pc.lut, 1)
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal", num_partitions=np_,
                                                    max_prompt_length=hint, implementation="native"))
    got = run_on_poisoned_output(f, args, (T, h, d), lead, tail)
    assert_close(got, oracle.mha_ragged_paged(*args, mask_str="causal"), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("merge", ["1", "0"])
def test_cuda_split_k_cluster_merge_and_combine(merge, monkeypatch):
    """Decode split 2..8 ways with 8-row tiles (dense) or groups of at most 8 heads (MSA): the partitions of a tile
    merge inside their thread-block cluster (sm_90+), or with MSA_OPS_CLUSTER_MERGE=0 through the workspace and
    the combine kernel; dense split 40 and 48 ways merges in the combine kernel, past the 32 partials it asks for
    ahead (at 40 most partitions are empty, at 48 every one of the long sequence holds keys). Both match the
    oracle: dense with sinks, a sliding window and rows owned by no sequence
    (output poisoned first), MSA in bf16 and fp8."""
    monkeypatch.setenv("MSA_OPS_CLUSTER_MERGE", merge)
    rng = np.random.default_rng(31)
    hkv, group, d, page = 2, 4, 128, 16
    n = [1, 1, 1, 1, 1]
    cache = [700, 3, 0, 511, 64]
    lead, tail = 2, 3
    offs = np.concatenate([[lead], lead + np.cumsum(n)]).astype(np.int32)
    T, h = int(offs[-1]) + tail, hkv * group
    pc = make_paged_cache(rng, [c + m for c, m in zip(cache, n)], page_size=page, max_pages=-(-704 // page),
                          n_kv_heads=hkv, head_dim=d, dtype=jnp.bfloat16)
    q = rand(rng, (T, h, d), jnp.bfloat16)
    sink = rand(rng, (h,), jnp.bfloat16)
    args = (q, offs, nan_past_keys(pc, cache, n, page), np.asarray(cache, np.int32), pc.lut, 1)
    kw = dict(mask_str="sliding_window_causal", local_window_size=300)
    want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
    for np_ in (2, 5, 8, 40):
        plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=np_, max_prompt_length=1, **kw)
        assert plan.tile_m == 8 and plan.num_partitions == np_
        f = jax.jit(lambda *a, np_=np_: msa_ops.mha_ragged_paged(*a, sink_weights=sink, num_partitions=np_,
                                                                 max_prompt_length=1, implementation="native", **kw))
        got = run_on_poisoned_output(f, args, (T, h, d), lead, tail,
                                     served="mma_cluster" if np_ == 2 and merge == "1" else "combine")
        assert_close(got, want, budget_for(jnp.bfloat16))
    cache2 = [3040, 17]  # 3041 keys in 48 partitions of 64 (the last 33), and a short sequence
    pc2 = make_paged_cache(rng, [c + 1 for c in cache2], page_size=64, max_pages=48, n_kv_heads=hkv, head_dim=d,
                           dtype=jnp.bfloat16)
    args2 = (rand(rng, (2, h, d), jnp.bfloat16), np.arange(3, dtype=np.int32), pc2.kv_blocks,
             np.asarray(cache2, np.int32), pc2.lut, 1)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, sink_weights=sink, num_partitions=48, mask_str="causal",
                                                      implementation="native"))(*args2)
    assert_close(got, oracle.mha_ragged_paged(*args2, sink_weights=sink, mask_str="causal"), budget_for(jnp.bfloat16))
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        batch, mc, mq, ids = _msa_case(np.random.default_rng(32), "decode", 4, 16, dtype)
        margs = (mq, batch.offsets, None, mc.kv_blocks, batch.cache_lengths, mc.lut, 1, ids)
        mwant = oracle.msa_attention_ragged_paged(*margs)
        for np_ in (2, 8):
            got, kinds = launched(jax.jit(lambda *a, np_=np_: msa_ops.msa_attention_ragged_paged(
                *a, num_partitions=np_, implementation="native"), static_argnums=2), *margs)
            assert_served(kinds, "msa_decode_cluster" if np_ == 2 and merge == "1" else "combine")
            assert_close(got, mwant, budget_for(dtype))


@pytest.mark.parametrize("dtype,d,group,page", [(jnp.bfloat16, 128, 4, 128), (jnp.float16, 64, 8, 16),
                                                 (jnp.bfloat16, 128, 16, 16)])
def test_cuda_mha_decode_more_ctas_than_slots(dtype, d, group, page):
    """An unsplit decode batch of more CTAs than the GPU holds at once (300 sequences x 2 kv heads, so later CTAs
    start in slots that earlier ones leave): 8-row tiles at pages 128 and 16, the 16-row tile at group 16. Ragged
    cache lengths (0, a page boundary, one key), page-table tails of junk, NaN past each sequence's keys, three
    rows owned by no sequence (output poisoned first), a sink and a sliding window on one run."""
    rng = np.random.default_rng(41 + group + page)
    hkv, b = 2, 300
    cache = [int(x) for x in rng.integers(0, 700, b)]
    cache[:4] = [0, page - 1, page, 1]
    n = [1] * b
    batch = RaggedBatch(n, cache, b + 3)
    h = hkv * group
    pc = make_paged_cache(rng, [c + 1 for c in cache], page_size=page, max_pages=-(-701 // page), n_kv_heads=hkv,
                          head_dim=d, dtype=dtype)
    q = rand(rng, (batch.T, h, d), dtype)
    sink = rand(rng, (h,), dtype)
    args = (q, batch.offsets, nan_past_keys(pc, cache, n, page), batch.cache_lengths, pc.lut, 1)
    for kw, sk in ((dict(mask_str="causal"), None),
                   (dict(mask_str="sliding_window_causal", local_window_size=200), sink)):
        plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=1, max_prompt_length=1, **kw)
        assert plan.tile_m == (16 if group > 8 else 8) and plan.num_partitions == 1
        f = jax.jit(lambda *a, kw=kw, sk=sk: msa_ops.mha_ragged_paged(
            *a, sink_weights=sk, num_partitions=1, max_prompt_length=1, implementation="native", **kw))
        got = run_on_poisoned_output(f, args, (batch.T, h, d), 0, batch.T - b)
        assert_close(got, oracle.mha_ragged_paged(*args, sink_weights=sk, **kw), budget_for(dtype))


def check_no_cache(rng, mask, window, h, hkv, d, n, nk, ragged_dtype, padded_s, vlen, padded_dtype):
    """Both no-cache ops against the oracle: ragged (query rows n, key rows nk a sequence, padding rows after) and
    padded (S, Sk = padded_s; valid lengths vlen), native."""
    q = rand(rng, (sum(n) + 3, h, d), ragged_dtype)
    k = rand(rng, (sum(nk) + 2, hkv, d), ragged_dtype)
    v = rand(rng, (sum(nk) + 2, hkv, d), ragged_dtype)
    qo = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    ko = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_no_cache(*a, mask_str=mask, local_window_size=window,
                                                         implementation="native"))(q, k, v, qo, ko)
    want = oracle.mha_ragged_no_cache(q, k, v, qo, ko, mask_str=mask, local_window_size=window)
    assert_close(got, want, budget_for(ragged_dtype), what="ragged no cache")
    b, (s, sk) = len(vlen), padded_s
    qp = rand(rng, (b, s, h, d), padded_dtype)
    kp = rand(rng, (b, sk, hkv, d), padded_dtype)
    vp = rand(rng, (b, sk, hkv, d), padded_dtype)
    vl = np.array(vlen, np.int32)
    got = jax.jit(lambda *a: msa_ops.mha_padded_no_cache(*a, mask_str=mask, local_window_size=window,
                                                         implementation="native"))(qp, kp, vp, vl)
    want = oracle.mha_padded_no_cache(qp, kp, vp, vl, mask_str=mask, local_window_size=window)
    assert_close(got, want, budget_for(padded_dtype), what="padded no cache")


def _d256_cases():
    rng = np.random.default_rng(256)
    return [dict(seed=i, scenario=SCENARIOS[i % len(SCENARIOS)], mask=MASKS[(i // 2) % len(MASKS)],
                 group=[1, 4, 8, 2][i % 4], page=[16, 128, 64][i % 3], dtype=[jnp.bfloat16, jnp.float16][(i // 3) % 2],
                 np_=[0, 1, 3, 32][(i // 4) % 4], sink=bool(rng.integers(2)), window=int(rng.integers(1, 60)))
            for i in range(20)]


@pytest.mark.parametrize("tile", ["ladder", "128", "128_cta", "128_no_wgmma"])
@pytest.mark.parametrize("case", _d256_cases(), ids=lambda c: f"{c['seed']}-{c['scenario']}-{c['mask']}")
def test_cuda_mha_head_dim_256_matches_oracle(case, tile, monkeypatch):
    """Head dim 256, every scenario and mask, sinks, split-K, pages 16 to 128, NaN past the keys: on the ladder's
    tiles, and on 128-row tiles (a max_prompt_length hint) in the three kernels that serve them at this head dim: the
    sm_90 warp-specialized persistent kernel (one Q buffer, 64-key K and V tiles), the CTA-per-tile wgmma kernel
    (MSA_OPS_DENSE_WS=0), both with K and V in rings of their own, and, with wgmma switched off, the handler's 64-row
    mma.sync tile."""
    rng = np.random.default_rng(case["seed"])
    batch = make_batch(rng, case["scenario"])
    if tile != "ladder":  # at least 128 rows, so that the hint can plan 128-row tiles (the rest unowned: zeros)
        batch = RaggedBatch(batch.n, batch.cache, max(batch.T, 131))
    hkv, d, page = 2, 256, case["page"]
    h = hkv * case["group"]
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=page,
                             max_pages=-(-512 // page), n_kv_heads=hkv, head_dim=d, dtype=case["dtype"])
    q = rand(rng, (batch.T, h, d), case["dtype"])
    sink = rand(rng, (h,), case["dtype"]) if case["sink"] else None
    kv_blocks = nan_past_keys(cache, batch.cache, batch.n, page)
    args = (q, batch.offsets, kv_blocks, batch.cache_lengths, cache.lut, 1)
    kw = dict(mask_str=case["mask"], local_window_size=case["window"])
    if tile != "ladder":
        kw["max_prompt_length"] = 1024
    if tile == "128_no_wgmma":
        monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "0")
    if tile == "128_cta":
        monkeypatch.setenv("MSA_OPS_DENSE_WS", "0")
    plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=case["np_"], **kw)
    assert tile == "ladder" or plan.tile_m == 128
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_ragged_paged(
        *a, sink_weights=sink, num_partitions=case["np_"], implementation="native", **kw)), *args)
    if plan.tile_m != 128 or tile == "128_no_wgmma":
        assert_served(kinds, "mma")
    else:  # (the groups drawn divide 128: Q goes by TMA)
        assert_served(kinds, "sm90_cta" if tile == "128_cta" else "sm90_ws")
    kw.pop("max_prompt_length", None)
    want = oracle.mha_ragged_paged(*args, sink_weights=sink, **kw)
    assert_close(got, want, budget_for(case["dtype"]))


@pytest.mark.parametrize("mask", ["causal", "null", "sliding_window_causal"])
def test_cuda_mha_head_dim_256_other_ops(mask):
    """Head dim 256 through the padded paged op (decode split 4 ways and a 150-row prefill on 128-row tiles) and
    both no-cache ops (contiguous K/V; 128-row tiles)."""
    rng = np.random.default_rng(2560)
    hkv, d, group = 2, 256, 4
    h = hkv * group
    for s, np_ in ((1, 4), (150, 0)):
        vl = np.array([s, 0, max(1, s // 2)], np.int32)
        cl = np.array([30, 0, 300], np.int32)
        cache = make_paged_cache(rng, list(cl + vl), page_size=16, max_pages=32, n_kv_heads=hkv, head_dim=d,
                                 dtype=jnp.bfloat16)
        q = rand(rng, (3, s, h, d), jnp.bfloat16)
        args = (q, cache.kv_blocks, cl, cache.lut, 0, vl)
        got = jax.jit(lambda *a, np_=np_: msa_ops.mha_padded_paged(
            *a, mask_str=mask, local_window_size=40, num_partitions=np_, implementation="native"))(*args)
        want = oracle.mha_padded_paged(*args, mask_str=mask, local_window_size=40)
        assert_close(got, want, budget_for(jnp.bfloat16), what=f"padded paged S={s}")
    check_no_cache(rng, mask, 40, h, hkv, d, [5, 0, 140, 1], [9, 3, 140, 1], jnp.float16, (130, 130), [130, 77],
                   jnp.bfloat16)


@pytest.mark.parametrize("np_", [0, 1, 5])
@pytest.mark.parametrize("mask", ["causal", "null", "chunked_causal"])
def test_cuda_mha_padded_paged_matches_oracle(np_, mask):
    rng = np.random.default_rng(7)
    b, s, h, hkv, d, page = 3, 9, 8, 2, 128, 16
    vl = np.array([0, 9, 4], np.int32)
    cl = np.array([30, 0, 200], np.int32)
    cache = make_paged_cache(rng, list(cl + vl), page_size=page, max_pages=16, n_kv_heads=hkv, head_dim=d,
                             dtype=jnp.bfloat16)
    q = rand(rng, (b, s, h, d), jnp.bfloat16)
    args = (q, cache.kv_blocks, cl, cache.lut, 0, vl)
    got = jax.jit(lambda *a: msa_ops.mha_padded_paged(*a, mask_str=mask, local_window_size=5, num_partitions=np_,
                                                      implementation="native"))(*args)
    want = oracle.mha_padded_paged(*args, mask_str=mask, local_window_size=5)
    assert_close(got, want, budget_for(jnp.bfloat16))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("group", [1, 4])
def test_cuda_no_cache_matches_oracle(mask, group):
    hkv = 2
    check_no_cache(np.random.default_rng(11), mask, 4, hkv * group, hkv, 64, [5, 0, 70, 1], [9, 3, 70, 1],
                   jnp.bfloat16, (20, 24), [20, 0, 13], jnp.float16)


def _rising_scores_case(rng, n, cache_len, hkv, group, levels, sink, dtype=jnp.bfloat16):
    """Paged operands (page 128, one layer) whose scores, in log2 units, sit near levels[t] for every key of the
    sequence's 128-key block t: a row's max rises by less and by more than the sm_90 kernels' lazy-rescale slack
    (8) from block to block, and falls. q_i = 3 u + noise, k_j = c_t u + noise for one unit vector u."""
    d = 128
    batch = RaggedBatch(n, cache_len, sum(n) + 3)
    cache = make_paged_cache(rng, [c + m for c, m in zip(cache_len, n)], page_size=128, max_pages=len(levels),
                             n_kv_heads=hkv, head_dim=d, num_layers=1, dtype=jnp.bfloat16)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    per_level = 3.0 * d ** -0.5 * np.log2(np.e)  # log2-unit score per unit of c_t
    kv = np.asarray(cache.kv_blocks, np.float32).copy()
    for b, (c, m) in enumerate(zip(cache_len, n)):
        for pos in range(c + m):
            page = int(cache.lut[b, pos // 128])
            kv[page, 0, 0, pos % 128] = levels[pos // 128] / per_level * u + 0.3 * rng.standard_normal((hkv, d))
    q = (3.0 * u + 0.3 * rng.standard_normal((batch.T, hkv * group, d))).astype(np.float32)
    sinks = rand(rng, (hkv * group,), dtype, 4.0) if sink else None
    return batch, cache, jnp.asarray(q, dtype), jnp.asarray(kv, dtype), sinks


def _assert_rows_close(got, want, budget):
    """assert_close, and every (row, head) within 4x the budget of its own norm (a few bad rows could hide in the
    whole tensor's relative error)."""
    assert_close(got, want, budget)
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.linalg.norm(g - w, axis=-1) / np.maximum(np.linalg.norm(w, axis=-1), 1e-6)
    assert err.max() <= 4 * budget, err.max()


def _rising_dense_call(rng, n, cache_len, hkv, group, levels, sink, mask, dtype=jnp.bfloat16):
    """The dense paged call over _rising_scores_case's keys: (jitted call, its operands, the float64 oracle's
    output)."""
    batch, cache, q, kv, sinks = _rising_scores_case(rng, n, cache_len, hkv, group, levels, sink, dtype)
    args = (q, batch.offsets, kv, batch.cache_lengths, cache.lut, 0)
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(
        *a, mask_str=mask, sink_weights=sinks, implementation="native", max_prompt_length=1024))
    return f, args, oracle.mha_ragged_paged(*args, mask_str=mask, sink_weights=sinks)


def _assert_slacks(monkeypatch, f, args, want, dtype, slacks, differ):
    """f under each MSA_OPS_LAZY_RESCALE setting in `slacks` (read at each launch: one op per jitted call, so no
    command buffer): finite, and within dtype's budget of the oracle row by row. The two settings in `differ` must
    give different outputs (in rounding), or the setting did not reach the kernel."""
    got = {}
    for slack in slacks:
        monkeypatch.setenv("MSA_OPS_LAZY_RESCALE", slack)
        got[slack] = np.asarray(f(*args), np.float32)
        assert np.isfinite(got[slack]).all(), slack
        _assert_rows_close(got[slack], want, budget_for(dtype))
    assert not np.array_equal(got[differ[0]], got[differ[1]])


LEVELS = [0.0, 5.0, 3.0, 20.0, 26.0, 27.0, 50.0, 40.0, 62.0]  # the max rises by 5, 15, 6, 1, 23, 12; two falls


@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma"])
def test_cuda_sm90_lazy_rescale_rising_scores(kernel, monkeypatch):
    """The sm_90 kernels move a row's running max only when a key block raises it by more than a slack (8, or
    MSA_OPS_LAZY_RESCALE), so their exponentials run up to 2^slack: scores whose max rises block after block by
    less and by more than that, against the float64 oracle, for the dense 128-row tile (with and without sinks;
    causal and no mask) and the MSA prefill kernel on the same keys, with the slack unset (8), 0 and 3. The
    default and 0 must differ (in rounding), or the setting did not reach the kernel."""
    use_128_row_kernel(monkeypatch, kernel)
    monkeypatch.setenv("MSA_OPS_MSA_PREFILL_WS", "1" if kernel == "wgmma_ws" else "0")
    rng = np.random.default_rng(77)
    n, cache_len, hkv, group = [300, 70], [760, 40], 2, 8
    calls = [_rising_dense_call(rng, n, cache_len, hkv, group, LEVELS, sink, mask)
             for sink, mask in ((True, "causal"), (False, "null"))]
    # MSA prefill over the same kind of keys: every token selects all of its sequence's blocks, in shuffled slots
    batch, cache, q, kv, _ = _rising_scores_case(rng, n, cache_len, hkv, group, LEVELS, False)
    ids = np.stack([np.stack([rng.permutation(len(LEVELS)) for _ in range(batch.T)]) for _ in range(hkv)])
    args = (q, batch.offsets, None, kv, batch.cache_lengths, cache.lut, 0, jnp.asarray(ids, jnp.int32))
    f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"), static_argnums=2)
    calls.append((f, args, oracle.msa_attention_ragged_paged(*args)))
    for f, args, want in calls:
        _assert_slacks(monkeypatch, f, args, want, jnp.bfloat16, ("", "0", "3"), ("", "0"))


# Rises just under and just over 15, the largest slack MSA_OPS_LAZY_RESCALE takes; two falls.
LEVELS_F16 = [0.0, 14.6, 29.2, 28.0, 42.6, 58.2, 44.0, 72.8]


@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma"])
def test_cuda_sm90_lazy_rescale_f16_at_the_cap(kernel, monkeypatch):
    """f16 is why the slack stops at 15: with the running max left up to 15 below the block's scores, P reaches
    2^15 (f16 holds up to 65504) and l sums such values. Scores whose max rises block after block by just under 15
    (P near 2^15 at slack 15) and by more, and falls, on the dense 128-row tile in f16 (sinks and causal; no
    mask), with the slack at 15, 14, 0 and unset, against the float64 oracle row by row: no infinity or lost
    precision anywhere. 15 and 0 must differ, or the setting did not reach the kernel."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(78)
    n, cache_len, hkv, group = [260, 90], [700, 30], 2, 8
    for sink, mask in ((True, "causal"), (False, "null")):
        f, args, want = _rising_dense_call(rng, n, cache_len, hkv, group, LEVELS_F16, sink, mask, jnp.float16)
        _assert_slacks(monkeypatch, f, args, want, jnp.float16, ("15", "14", "0", ""), ("15", "0"))


@pytest.mark.parametrize("kernel", KERNELS_128)
@pytest.mark.parametrize("mask", ["causal", "null", "sliding_window_causal"])
@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float16, 64)])
def test_cuda_no_cache_128_row_tiles(kernel, mask, dtype, d, monkeypatch):
    """Contiguous K/V on the 128-row tile: ragged K/V whose last sequence ends before rows of NaN (a tile reads
    past it), and padded K/V with NaN in every row past a sequence's valid length. Keys past a sequence must not
    reach its output, not even as 0 * NaN."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(d + len(mask))
    hkv, group = 2, 4
    h = hkv * group
    n = [300, 0, 129, 40]
    nk = [400, 3, 129, 170]
    q = rand(rng, (sum(n) + 5, h, d), dtype)
    k = np.asarray(rand(rng, (sum(nk) + 9, hkv, d), dtype)).copy()
    v = np.asarray(rand(rng, (sum(nk) + 9, hkv, d), dtype)).copy()
    k[sum(nk):] = np.nan
    v[sum(nk):] = np.nan
    qo = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    ko = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    kw = dict(mask_str=mask, local_window_size=70)
    # (no plan for these ops: the handler takes the 128-row tile when some sequence may hold 128 / group tokens)
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_ragged_no_cache(*a, implementation="native", **kw)),
                          q, k, v, qo, ko)
    assert_served(kinds, kind_128(kernel, group, page=128, d=d))
    assert_close(got, oracle.mha_ragged_no_cache(q, k, v, qo, ko, **kw), budget_for(dtype))
    s, sk = 150, 260
    vl = np.array([150, 0, 97, 131], np.int32)
    qp = rand(rng, (4, s, h, d), dtype)
    kp = np.asarray(rand(rng, (4, sk, hkv, d), dtype)).copy()
    vp = np.asarray(rand(rng, (4, sk, hkv, d), dtype)).copy()
    for b in range(4):
        kp[b, vl[b]:] = np.nan
        vp[b, vl[b]:] = np.nan
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_padded_no_cache(*a, implementation="native", **kw)),
                          qp, kp, vp, vl)
    assert_served(kinds, kind_128(kernel, group, ragged=False, page=128, d=d))
    assert_close(got, oracle.mha_padded_no_cache(qp, kp, vp, vl, **kw), budget_for(dtype))


@pytest.mark.parametrize("kernel", KERNELS_128)
def test_cuda_unowned_rows_past_the_zeroing_grid(kernel, monkeypatch):
    """More rows owned by no sequence than the zeroing kernel has blocks (1024, striding over them), on the 128-row
    tile with the output poisoned first: ragged queries with 1100 rows before offsets[0] and 900 past offsets[B],
    and padded queries whose padding rows reach past row 1024 (valid lengths 5, 700, 0 of 700); then 140 short
    ragged sequences with 300 rows before and 200 past them. Those rows are 0 and the others match the oracle. (On
    mma.sync, ragged, the attention kernel's spare CTAs zero the rows; the persistent kernels zero them with a warp
    of their own, the others by a launch after the kernel.)"""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(77)
    hkv, group, d = 2, 4, 128
    h = hkv * group
    f = jax.jit(lambda *a: msa_ops.mha_ragged_no_cache(*a, mask_str="causal", implementation="native"))
    n140 = [int(x) for x in rng.integers(1, 20, 140)]  # past the persistent kernels' table entries per sequence
    for n, nk, lead, tail in (([200, 1, 130], [230, 5, 130], 1100, 900), (n140, n140, 300, 200)):
        qo = np.concatenate([[lead], lead + np.cumsum(n)]).astype(np.int32)
        ko = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
        T = int(qo[-1]) + tail
        q = rand(rng, (T, h, d), jnp.bfloat16)
        k = rand(rng, (int(ko[-1]), hkv, d), jnp.bfloat16)
        v = rand(rng, (int(ko[-1]), hkv, d), jnp.bfloat16)
        got = run_on_poisoned_output(f, (q, k, v, qo, ko), (T, h, d), lead, tail,
                                     served=kind_128(kernel, group, page=128))
        assert_close(got, oracle.mha_ragged_no_cache(q, k, v, qo, ko, mask_str="causal"), budget_for(jnp.bfloat16))
    s = 700
    vl = np.array([5, 700, 0], np.int32)
    qp = rand(rng, (3, s, h, d), jnp.bfloat16)
    kp = rand(rng, (3, s, hkv, d), jnp.bfloat16)
    vp = rand(rng, (3, s, hkv, d), jnp.bfloat16)
    fp = jax.jit(lambda *a: msa_ops.mha_padded_no_cache(*a, mask_str="causal", implementation="native"))
    got = run_on_poisoned_output(fp, (qp, kp, vp, vl), (3, s, h, d), 0, 1,
                                 served=kind_128(kernel, group, ragged=False, page=128))
    assert np.all(got[0, 5:] == 0)
    assert_close(got, oracle.mha_padded_no_cache(qp, kp, vp, vl, mask_str="causal"), budget_for(jnp.bfloat16))


WS_MANY_ITEMS_CASES = [
    # (query rows per sequence, cache lengths, group, page, mask, partitions)
    ([int(x) for x in np.random.default_rng(1).integers(1, 700, 40)],
     [int(x) for x in np.random.default_rng(2).integers(0, 300, 40)], 4, 128, "causal", 0),
    ([int(x) for x in np.random.default_rng(3).integers(1, 400, 40)],
     [int(x) for x in np.random.default_rng(4).integers(0, 500, 40)], 8, 16, "sliding_window_causal", 0),
    ([0, 1] + [200] * 150, [(37 * i) % 600 for i in range(152)], 2, 64, "causal", 0),
    ([int(x) for x in np.random.default_rng(5).integers(100, 600, 24)],
     [int(x) for x in np.random.default_rng(6).integers(0, 900, 24)], 16, 256, "null", 3),
    ([int(x) for x in np.random.default_rng(7).integers(40, 130, 45)],
     [int(x) for x in np.random.default_rng(8).integers(0, 400, 45)], 4, 128, "causal", 0),
]


@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma_pair"])
@pytest.mark.parametrize("case", WS_MANY_ITEMS_CASES, ids=["interleaved-p128", "window-p16", "152-sequences-p64",
                                                            "split-p256", "short-causal"])
def test_cuda_mha_ws_prefill_many_items(case, kernel, monkeypatch):
    """The persistent 128-row kernel with more work items (query tile x kv head x partition) than CTAs, so that
    each CTA walks several items through its Q buffers and K/V rings: the interleaved heaviest-first order (40
    sequences of up to 22 tiles), the heads-slowest walk that causal calls of short sequences take (45 sequences
    of 2-5 tiles), the grid order over the sequence table's chunks (152 sequences, two of them with 0 and 1 rows),
    split-K partials, NaN past every sequence's keys and junk page-table tails; bf16 and f16, head dims 128 and
    64; on the 128-row items and on the pair kernel's 64-row items (use_128_row_kernel). (Calls past the kernel's
    sequence table: test_cuda_mha_128_row_tiles_many_sequences.)"""
    use_128_row_kernel(monkeypatch, kernel)
    n, cache_len, group, page, mask, np_ = case
    rng = np.random.default_rng(len(n) + group + page)
    dtype, d = (jnp.bfloat16, 128) if page != 16 else (jnp.float16, 64)
    hkv = 4
    h = hkv * group
    batch = RaggedBatch(n, cache_len, sum(n) + 7)
    tokens = [c + m for c, m in zip(cache_len, n)]
    cache = make_paged_cache(rng, tokens, page_size=page, max_pages=-(-max(tokens) // page) + 1, n_kv_heads=hkv,
                             head_dim=d, dtype=dtype)
    q = rand(rng, (batch.T, h, d), dtype)
    kv_blocks = nan_past_keys(cache, batch.cache, batch.n, page)
    args = (q, batch.offsets, kv_blocks, batch.cache_lengths, cache.lut, 1)
    kw = dict(mask_str=mask, local_window_size=333)
    plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=np_, max_prompt_length=1024, **kw)
    assert plan.tile_m == 128
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, num_partitions=np_, implementation="native",
                                                    max_prompt_length=1024, **kw))
    got = run_on_poisoned_output(f, args, (batch.T, h, d), 0, 7, served=kind_128(kernel, group, page=page, d=d))
    assert_close(got, oracle.mha_ragged_paged(*args, **kw), budget_for(dtype))


@pytest.mark.parametrize("case", [c for c in _tile128_cases() if c["d"] == 64],
                         ids=lambda c: f"{c['seed']}-{c['scenario']}-{c['mask']}")
def test_cuda_mha_192_row_items_match_oracle(case, monkeypatch):
    """Head dim 64 on the persistent kernel's three consumer warpgroups (192-row items, MSA_OPS_DENSE_WS3=1): the
    128-row-tile sweep's head-dim-64 cases (ragged and padding rows, every mask, sinks, split-K, groups 1-16,
    pages 16-256, bf16 and f16)."""
    test_cuda_mha_128_row_tiles_match_oracle(case, "wgmma_ws3", monkeypatch)


@pytest.mark.parametrize("mask", ["causal", "null", "sliding_window_causal"])
def test_cuda_no_cache_192_row_items(mask, monkeypatch):
    """Contiguous ragged and padded K/V with NaN past the keys on the 192-row items (head dim 64, f16)."""
    test_cuda_no_cache_128_row_tiles("wgmma_ws3", mask, jnp.float16, 64, monkeypatch)


def ragged_paged_call(rng, n, cache_len, tail, hkv, h, d, page):
    """A ragged batch of n rows a sequence over caches of cache_len keys, with `tail` rows past offsets[B]: bf16
    queries of h heads, bf16 paged K/V (pages of `page` keys, one spare page a sequence, NaN past the keys) and a bf16
    sink per head. Returns the batch, mha_ragged_paged's operands (layer 1) and the sink."""
    batch = RaggedBatch(n, cache_len, sum(n) + tail)
    tokens = [c + m for c, m in zip(cache_len, n)]
    cache = make_paged_cache(rng, tokens, page_size=page, max_pages=-(-max(tokens) // page) + 1, n_kv_heads=hkv,
                             head_dim=d, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, h, d), jnp.bfloat16)
    sink = rand(rng, (h,), jnp.bfloat16)
    args = (q, batch.offsets, nan_past_keys(cache, batch.cache, batch.n, page), batch.cache_lengths, cache.lut, 1)
    return batch, args, sink


@pytest.mark.parametrize("group,mask,np_", [(1, "causal", 0), (16, "null", 0), (4, "chunked_causal", 3),
                                            (8, "sliding_window_causal", 0), (2, "causal", 2), (3, "causal", 0),
                                            (12, "null", 3), (6, "sliding_window_causal", 0)])
def test_cuda_mha_192_row_items_long_sequences(group, mask, np_, monkeypatch):
    """The 192-row items over sequences of several tiles (rows of 192 / group tokens: 12 at group 16), more items
    than CTAs, tiles that end inside a sequence and past it, caches before the new rows, a sink, split-K partials,
    unowned rows (poisoned output), bf16 paged K/V (pages of 64) with NaN past the keys; then the padded paged op
    (its tiles counted per sequence of S rows; no sink) on the same kernel. Groups 3, 6 and 12 divide 192 but not
    128: the 192-row items serve them (their rows leave lane by lane, not by TMA store), where the two-warpgroup
    kernels cannot."""
    use_128_row_kernel(monkeypatch, "wgmma_ws3")
    rng = np.random.default_rng(192 + group + np_)
    hkv, d, page = 4, 64, 64
    h = hkv * group
    n = [1000, 193, 0, 191, 384, 577]
    cache_len = [0, 250, 40, 0, 700, 65]
    if group == 8:  # 21, 19 and 20 tiles of 192 rows: the sequences' tiles interleaved in bands (ws_order_build)
        n, cache_len = [500, 450, 480], [0, 100, 30]
    batch, args, sink = ragged_paged_call(rng, n, cache_len, 9, hkv, h, d, page)
    kw = dict(mask_str=mask, local_window_size=150)
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, sink_weights=sink, num_partitions=np_,
                                                    implementation="native", max_prompt_length=1024, **kw))
    got = run_on_poisoned_output(f, args, (batch.T, h, d), 0, 9, served="sm90_ws3")
    assert_close(got, oracle.mha_ragged_paged(*args, sink_weights=sink, **kw), budget_for(jnp.bfloat16))
    s = 400
    vl = np.array([400, 0, 193, 7], np.int32)
    cl = np.array([30, 0, 500, 64], np.int32)
    pc = make_paged_cache(rng, list(cl + vl), page_size=page, max_pages=16, n_kv_heads=hkv, head_dim=d,
                          dtype=jnp.bfloat16)
    qp = rand(rng, (4, s, h, d), jnp.bfloat16)
    pargs = (qp, pc.kv_blocks, cl, pc.lut, 0, vl)
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_padded_paged(
        *a, num_partitions=np_, implementation="native", **kw)), *pargs)
    assert_served(kinds, "sm90_ws3")
    assert_close(got, oracle.mha_padded_paged(*pargs, **kw), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("skip", ["1", "0"])
def test_cuda_mha_ws_warpgroup_tail_skip(skip, monkeypatch):
    """Head dim 256 on the persistent kernel (64-key tiles): its consumer warpgroups run only the key tiles their own
    rows see (MSA_OPS_WG_TAIL_SKIP=1, the default) or every tile of the item (=0). On the causal diagonal the first
    warpgroup's rows stop a tile before the item's last (and more with caches that are not a multiple of the tile),
    and a warpgroup whose rows lie past the sequence sees none. Every mask, a sink, split-K partials, unowned rows
    (poisoned output), bf16 paged K/V with NaN past the keys, against the float64 oracle."""
    kernel, d = "wgmma_ws", 256
    use_128_row_kernel(monkeypatch, kernel)
    monkeypatch.setenv("MSA_OPS_WG_TAIL_SKIP", skip)
    rng = np.random.default_rng(256 + int(skip))
    hkv, group, page = 2, 2, 64
    h = hkv * group
    n = [700, 64, 200, 130, 1, 0, 95]
    cache_len = [37, 0, 64, 500, 3, 20, 128]
    batch, args, sink = ragged_paged_call(rng, n, cache_len, 5, hkv, h, d, page)
    for mask, window, np_ in (("causal", 0, 0), ("sliding_window_causal", 150, 0), ("chunked_causal", 100, 2),
                              ("null", 0, 3), ("causal", 0, 2)):
        kw = dict(mask_str=mask, local_window_size=window)
        f = jax.jit(lambda *a, kw=kw, np_=np_: msa_ops.mha_ragged_paged(
            *a, sink_weights=sink, num_partitions=np_, implementation="native", max_prompt_length=1024, **kw))
        got = run_on_poisoned_output(f, args, (batch.T, h, d), 0, 5, served=kind_128(kernel, group, page=page, d=d))
        assert_close(got, oracle.mha_ragged_paged(*args, sink_weights=sink, **kw), budget_for(jnp.bfloat16))


def test_cuda_mha_head_dim_64_kernel_choice(monkeypatch):
    """Head dim 64 on the 128-row tile, MSA_OPS_DENSE_WS3 unset: the 192-row items serve calls whose sequences
    average at least 512 query rows (tokens x group) with no mask and 4096 with one; shorter calls keep the 128-row
    items (mha.cu's ws3_wanted). Each call also matches the oracle."""
    use_128_row_kernel(monkeypatch, "wgmma_ws")
    monkeypatch.delenv("MSA_OPS_DENSE_WS3")
    rng = np.random.default_rng(6464)
    hkv, d = 1, 64
    for n, group, mask, kind in (([300, 260], 2, "null", "sm90_ws3"), ([300, 200], 2, "null", "sm90_ws"),
                                 ([300, 260], 2, "causal", "sm90_ws"),
                                 ([1100, 948], 4, "causal", "sm90_ws3"), ([1000, 900], 4, "causal", "sm90_ws"),
                                 ([4200], 1, "sliding_window_causal", "sm90_ws3")):
        h = hkv * group
        qo = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        q = rand(rng, (int(qo[-1]), h, d), jnp.bfloat16)
        k = rand(rng, (int(qo[-1]), hkv, d), jnp.bfloat16)
        v = rand(rng, (int(qo[-1]), hkv, d), jnp.bfloat16)
        kw = dict(mask_str=mask, local_window_size=300)
        got, kinds = launched(jax.jit(lambda *a, kw=kw: msa_ops.mha_ragged_no_cache(
            *a, implementation="native", **kw)), q, k, v, qo, qo)
        assert_served(kinds, kind)
        assert_close(got, oracle.mha_ragged_no_cache(q, k, v, qo, qo, **kw), budget_for(jnp.bfloat16))


def many_sequences(rng, nseq):
    """nseq short sequences (0-39 rows, zeros among them) and two longer ones, as offsets with 5 rows before
    offsets[0], one decreasing offset (its sequence owns no rows: the running max repairs it) and 7 rows past the
    last; with cache lengths 0-99."""
    n = [int(x) for x in rng.integers(0, 40, nseq)]
    n[nseq // 3], n[nseq // 2] = 160, 100
    qo = np.concatenate([[0], np.cumsum(n)]) + 5
    qo[nseq - 40] = qo[nseq - 41] - 3
    cache_len = [int(x) for x in rng.integers(0, 100, nseq)]
    return qo.astype(np.int32), int(qo[-1]) + 7, cache_len


@pytest.mark.parametrize("kernel", KERNELS_128)
@pytest.mark.parametrize("nseq", [100, 129, 700, 1024, 1100, 5000])
def test_cuda_mha_128_row_tiles_many_sequences(kernel, nseq, monkeypatch, d=128):
    """Many short sequences and two longer ones on the 128-row tile: the persistent kernels' sequence table (its
    tiles counted; entries per sequence at 100 sequences, per chunk of 32 at 129, 700 and 1024, of 64 at 1100 and
    of 160 at 5000, whose scan from the chunk takes two rounds of loads; not the interleaved walk, since the longest
    sequence's tiles make its slots more than twice the tiles); every kernel finds each tile's sequence through the
    repaired offsets (rows before offsets[0], a decreasing offset, rows past the last) and writes 0 to the rows no
    sequence owns."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(nseq)
    hkv, group, page = 1, 8, 64
    qo, T, cache_len = many_sequences(rng, nseq)
    rows = np.diff(np.minimum(np.maximum.accumulate(qo), T))
    tokens = [c + int(m) for c, m in zip(cache_len, rows)]
    cache = make_paged_cache(rng, tokens, page_size=page, max_pages=-(-max(tokens) // page) + 1, n_kv_heads=hkv,
                             head_dim=d, num_layers=1, dtype=jnp.bfloat16)
    q = rand(rng, (T, hkv * group, d), jnp.bfloat16)
    kv_blocks = nan_past_keys(cache, cache_len, rows, page, layer=0)
    args = (q, qo, kv_blocks, np.asarray(cache_len, np.int32), cache.lut, 0)
    plan = msa_ops.plan("mo.mha.ragged.paged", *args, max_prompt_length=2048, mask_str="causal")
    assert plan.tile_m == 128
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, implementation="native", max_prompt_length=2048,
                                                    mask_str="causal"))
    got = run_on_poisoned_output(f, args, (T, hkv * group, d), 5, 7,
                                 served=kind_128(kernel, group, page=page, d=d))
    assert_close(got, oracle.mha_ragged_paged(*args, mask_str="causal"), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("kernel", KERNELS_128)
@pytest.mark.parametrize("mask,window", [("sliding_window_causal", 8), ("chunked_causal", 64), ("causal", 0)])
def test_cuda_mha_128_row_tiles_queries_past_page_table(kernel, mask, window, monkeypatch, d=128):
    """Query positions far past the page table (cache + rows > max_pages * page_size): keys past it do not exist
    (docs/SEMANTICS.md), so a window or chunk that lies past them sees none, and such rows put tiles wholly past the
    keys into their tile's key range. The kernels zero those tiles' V rows from row 0 (a negative start row wrote
    shared memory below the tile: other items' K/V and Q in the persistent kernel, and past the CTA's window)."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(len(mask) + len(kernel))
    hkv, group, page, max_pages = 2, 4, 16, 32  # S_max = 512
    s_max = page * max_pages
    n = [1000, 300, 40, 700]
    cache_len = [500, 0, 600, 100]  # 600: past S_max, read as S_max
    batch = RaggedBatch(n, cache_len, sum(n) + 3)
    tokens = [min(c + m, s_max) for c, m in zip(cache_len, n)]
    cache = make_paged_cache(rng, tokens, page_size=page, max_pages=max_pages, n_kv_heads=hkv, head_dim=d,
                             dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, hkv * group, d), jnp.bfloat16)
    args = (q, batch.offsets, cache.kv_blocks, batch.cache_lengths, cache.lut, 1)
    kw = dict(mask_str=mask, local_window_size=window)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, implementation="native", max_prompt_length=1024, **kw))(
        *args
    )
    assert_close(got, oracle.mha_ragged_paged(*args, **kw), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("nseq", [129, 700])
def test_cuda_mha_192_row_items_many_sequences(nseq, monkeypatch):
    """test_cuda_mha_128_row_tiles_many_sequences at head dim 64 on the 192-row items: the sequence table in chunks,
    rows before offsets[0] and past offsets[B] (poisoned output), a decreasing offset."""
    test_cuda_mha_128_row_tiles_many_sequences("wgmma_ws3", nseq, monkeypatch, d=64)


@pytest.mark.parametrize("mask,window", [("sliding_window_causal", 8), ("chunked_causal", 64), ("causal", 0)])
def test_cuda_mha_192_row_items_queries_past_page_table(mask, window, monkeypatch):
    """test_cuda_mha_128_row_tiles_queries_past_page_table at head dim 64 on the 192-row items (tiles wholly past the
    keys, their V rows zeroed by the three warpgroups), which must serve the call."""
    before = _native.launch_counts()
    test_cuda_mha_128_row_tiles_queries_past_page_table("wgmma_ws3", mask, window, monkeypatch, d=64)
    assert _native.launch_counts()["sm90_ws3"] > before["sm90_ws3"]


@pytest.mark.parametrize("kernel", KERNELS_128)
def test_cuda_mha_positions_near_2_31(kernel, monkeypatch):
    """A page table of pages of 128 just short of 2^31 keys and a cache length of 2^31 - 1: the query positions
    run up to S_max + T - 1. Where that is below 2^31 the call runs (every page is missing, so the output is 0),
    on 8-, 64- and 128-row tiles and with windows and chunks that lie past the keys; where it is not, the handler
    refuses the call with an error (the kernels' key indices are int32: such positions read the page table 64 MB
    before its start)."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(29)
    page = 128
    kv = rand(rng, (4, 2, 1, page, 2, 128), jnp.bfloat16)
    cl = np.array([2**31 - 1], np.int32)
    lut = jnp.full((1, (2**31 - 1 - 256) // page), -1, jnp.int32)  # S_max + 256 < 2^31
    for t, hint in ((1, {}), (200, {}), (256, {"max_prompt_length": 1024})):
        q = rand(rng, (t, 8, 128), jnp.bfloat16)
        offs = np.array([0, t], np.int32)
        for mask, w in (("sliding_window_causal", 8), ("chunked_causal", 64), ("sliding_window_noncausal", 8)):
            got = jax.jit(lambda *a, _m=mask, _w=w, _h=hint: msa_ops.mha_ragged_paged(
                *a, mask_str=_m, local_window_size=_w, implementation="native", **_h))(q, offs, kv, cl, lut, 0)
            assert np.all(np.asarray(got, np.float32) == 0), (t, mask)
    lut = jnp.full((1, 2**24 - 1), -1, jnp.int32)  # S_max = 2^31 - 128: with 256 rows, positions pass 2^31
    q = rand(rng, (256, 8, 128), jnp.bfloat16)
    with pytest.raises(Exception, match="query rows must be < 2"):
        jax.block_until_ready(jax.jit(lambda *a: msa_ops.mha_ragged_paged(
            *a, mask_str="sliding_window_causal", local_window_size=8, implementation="native",
            max_prompt_length=1024))(q, np.array([0, 256], np.int32), kv, cl, lut, 0))


@pytest.mark.parametrize("page,max_pages,t,group", [(16, 2**27 - 1, 1, 4), (64, 2**25 - 1, 22, 6),
                                                     (48, (2**31 - 64) // 48, 1, 4)])
def test_cuda_mha_page_table_fetch_past_2_31(page, max_pages, t, group):
    """Page tables whose last tile ends at 2^31 keys: pages of 16 and 64 (smaller than a 128-key tile) and 48 (no
    power of two) with max_pages * page_size just under 2^31 and the cache full to it, a sliding window keeping the
    key range to its last tiles. The loaders read the page-table entry of the tile after the one they load; where
    that tile starts at 2^31 (whether it does depends on the served kernel's key tile), its int32 key wrapped
    negative and read the table 512 MB before its row (compute-sanitizer's selection holds this test; without it the
    stray read may go unnoticed). The mma.sync kernel serves every case, the 22 query rows of page 64 (group 6) too:
    the router gives a call this short the mma.sync tiles, not a 128-row one (seen on an H100). Every page is
    missing, so the output is 0."""
    rng = np.random.default_rng(page)
    kv = rand(rng, (2, 2, 1, page, 2, 128), jnp.bfloat16)
    s_max = page * max_pages
    cl = np.array([s_max - t], np.int32)
    lut = jnp.full((1, max_pages), -1, jnp.int32)
    q = rand(rng, (t, 2 * group, 128), jnp.bfloat16)
    got, kinds = launched(jax.jit(lambda *a: msa_ops.mha_ragged_paged(
        *a, mask_str="sliding_window_causal", local_window_size=64, implementation="native")),
        q, np.array([0, t], np.int32), kv, cl, lut, 0)
    # (split by the ladder: merged in a cluster or by the combine kernel)
    assert kinds & {"mma", "mma_cluster"} and not any(k.startswith("sm90") for k in kinds), kinds
    assert np.all(got == 0)


def chunk_past_2_30_case(rng, t):
    """A chunked-causal call whose window, 2^30 + 1000, lies past 2^30, with its query rows just past one chunk
    boundary: row i of the one sequence is at W + 50 + i and sees keys [W, W + 50 + i]. Every page from 2^30 - 256 to
    the last key exists, so the 1000 keys in [2^30, W) would show if the window were cut to 2^30. Returns the call's
    arguments and the float64 result over the keys that rows see, computed here."""
    w, page, hkv, h, d = 2**30 + 1000, 128, 2, 8, 128
    c = w + 50
    mp = (c + t + page - 1) // page + 1
    first = (2**30 - 2 * page) // page
    n_pages = mp - first
    kv = rand(rng, (n_pages, 2, 1, page, hkv, d), jnp.bfloat16)
    lut = np.full((1, mp), -1, np.int32)
    lut[0, first:] = np.arange(n_pages)
    q = rand(rng, (t, h, d), jnp.bfloat16)
    keys = np.arange(w, c + t)
    kf = np.asarray(kv, np.float64)[lut[0, keys // page], 0, 0, keys % page]  # [n, Hkv, D]
    vf = np.asarray(kv, np.float64)[lut[0, keys // page], 1, 0, keys % page]
    qf = np.asarray(q, np.float64).reshape(t, hkv, h // hkv, d)
    s = np.einsum("tgjd,ngd->tgjn", qf, kf) / np.sqrt(d)
    s = np.where((keys[None, :] <= c + np.arange(t)[:, None])[:, None, None, :], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("tgjn,ngd->tgjd", pr / pr.sum(-1, keepdims=True), vf).reshape(t, h, d)
    return (q, np.array([0, t], np.int32), kv, np.array([c], np.int32), lut, 0), w, want


@pytest.mark.parametrize("kernel", KERNELS_128)
def test_cuda_mha_chunk_past_2_30(kernel, monkeypatch):
    """A window past 2^30 at query positions past 2^30 (chunk_past_2_30_case) on the decode, 64-row and 128-row
    tiles: the handler once clamped the window to 2^30, which moved the chunk's start to 2^30 and let those rows see
    1000 keys of the chunk before."""
    use_128_row_kernel(monkeypatch, kernel)
    rng = np.random.default_rng(31)
    for t, hint in ((1, {}), (200, {}), (200, {"max_prompt_length": 1024})):
        args, w, want = chunk_past_2_30_case(rng, t)
        got = jax.jit(lambda *a, _w=w, _h=hint: msa_ops.mha_ragged_paged(
            *a, mask_str="chunked_causal", local_window_size=_w, implementation="native", **_h))(*args)
        assert_close(got, want, budget_for(jnp.bfloat16), what=f"t={t} {hint}")


def test_cuda_mha_bad_values_do_not_fault():
    """Page ids past the pool, non-monotone offsets, huge cache lengths, layer out of range: masked, no fault."""
    rng = np.random.default_rng(3)
    h, hkv, d, mp = 8, 2, 128, 12
    cl = np.array([2**31 - 5, -9, 40], np.int32)
    # 12 rows: decode and 64-row tiles; 160 rows with a prompt-length hint: the 128-row tile (wgmma on sm_90).
    # Pages of 16 (eight per 128-key tile) and of 128 (one page per tile).
    for page in (16, 128):
        kv = rand(rng, (20, 2, 2, page, hkv, d), jnp.bfloat16)
        lut = rng.integers(-50, 50, (3, mp)).astype(np.int32)
        for t, offs, hint in ((12, [0, 7, 3, 40], {}), (160, [0, 150, 3, 158], {"max_prompt_length": 1024})):
            q = rand(rng, (t, h, d), jnp.bfloat16)
            offs = np.array(offs, np.int32)
            for layer, np_ in ((0, 1), (0, 4), (5, 1), (-1, 4), (1, 1)):
                args = (q, offs, kv, cl, lut, layer)
                got = jax.jit(lambda *a, _n=np_, _h=hint: msa_ops.mha_ragged_paged(
                    *a, mask_str="causal", num_partitions=_n, implementation="native", **_h))(*args)
                want = oracle.mha_ragged_paged(*args, mask_str="causal")
                assert_close(got, want, budget_for(jnp.bfloat16))


@pytest.mark.parametrize("page", [4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float16, 64)])
def test_cuda_mha_8_row_tiles_bad_pages(page, dtype, d):
    """Decode in the 8-row tile with the power-of-two page loaders (pages smaller than a key tile: each thread's
    rows in one page; a key tile or more: one page a tile) and, with pages smaller than a thread's rows (4 keys at
    head dim 128, whose threads load 8 rows a tile), the kernel of any layout: page-table entries
    past the pool or negative, a layer out of range, and NaN past each sequence's keys in its last page, split and
    not. An absent page's keys do not exist, the others match the oracle; nothing is read outside the pool (the
    sanitizer's selection)."""
    rng = np.random.default_rng(4100 + page + d)
    hkv, group, mp = 2, 4, -(-700 // page)
    cache = [int(x) for x in rng.integers(0, mp * page - 1, 5)]
    cache[0], cache[1] = 0, mp * page - 1  # no cache; a full table
    batch = RaggedBatch([1] * 5, cache, 5)
    pc = make_paged_cache(rng, [c + 1 for c in cache], page_size=page, max_pages=mp, n_kv_heads=hkv, head_dim=d,
                          dtype=dtype)
    kv = nan_past_keys(pc, batch.cache, batch.n, page)
    nb = kv.shape[0]
    lut = np.array(pc.lut)
    lut[2, rng.integers(0, mp, 2)] = [-3, nb]  # absent pages: negative, and one past the pool
    lut[3, 0] = nb + 1000
    q = rand(rng, (batch.T, hkv * group, d), dtype)
    for layer, np_ in ((1, 1), (1, 3), (0, 4), (2, 1), (-1, 3)):
        args = (q, batch.offsets, kv, batch.cache_lengths, lut, layer)
        plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=np_, mask_str="causal")
        assert plan.tile_m == 8
        got = jax.jit(lambda *a, _n=np_: msa_ops.mha_ragged_paged(
            *a, mask_str="causal", num_partitions=_n, implementation="native"))(*args)
        want = oracle.mha_ragged_paged(*args, mask_str="causal")
        assert_close(got, want, budget_for(dtype))


@pytest.mark.parametrize("case", ["spec", "window", "chunk"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cuda_mha_masked_key_nan_small_tiles(case, dtype):
    """The mma.sync tiles (speculative decode: up to five tokens of group 4 in one 64-row tile; decode in the
    8-row tile with a window or chunk that starts inside a key tile) with NaN in K and V of keys a row does not see
    but that lie in a tile the row reads: the last new token of each sequence (spec), or the key just before each
    row's window or chunk. Rows that do not see a NaN key equal the float64 oracle (docs/SEMANTICS.md §5: not even
    as 0 * NaN), split and not."""
    rng = np.random.default_rng(len(case))
    hkv, group, page, d = 2, 4, 16, 128
    if case == "spec":
        batch = RaggedBatch([2, 5, 3], [37, 300, 0], 12)
        kw = dict(mask_str="causal")
    else:
        batch = RaggedBatch([1] * 4, [100, 263, 40, 500], 4)
        kw = dict(mask_str="sliding_window_causal" if case == "window" else "chunked_causal", local_window_size=24)
    tokens = [c + m for c, m in zip(batch.cache, batch.n)]
    pc = make_paged_cache(rng, tokens, page_size=page, max_pages=-(-max(tokens) // page) + 1, n_kv_heads=hkv,
                          head_dim=d, dtype=dtype)
    kv = np.array(pc.kv_blocks)
    sees = np.zeros(batch.T, bool)  # the rows that see a NaN key
    row = 0
    for b, (c, m) in enumerate(zip(batch.cache, batch.n)):
        if case == "spec":
            key = c + m - 1  # seen by the sequence's last row only
            sees[row + m - 1] = True
        else:  # the key before the row's window or chunk (decode: one row at position c)
            key = c - 24 if case == "window" else c // 24 * 24 - 1
        if key >= 0:
            kv[pc.lut[b, key // page], :, 1, key % page] = np.nan
        row += m
    q = rand(rng, (batch.T, hkv * group, d), dtype)
    for np_ in (1, 2):
        args = (q, batch.offsets, kv, batch.cache_lengths, pc.lut, 1)
        plan = msa_ops.plan("mo.mha.ragged.paged", *args, num_partitions=np_, max_prompt_length=max(batch.n), **kw)
        assert plan.tile_m <= 32
        got, kinds = launched(jax.jit(lambda *a, _n=np_: msa_ops.mha_ragged_paged(
            *a, num_partitions=_n, max_prompt_length=max(batch.n), implementation="native", **kw)), *args)
        assert kinds & {"mma", "mma_cluster"} and not any(k.startswith("sm90") for k in kinds), kinds
        want = np.asarray(oracle.mha_ragged_paged(*args, **kw), np.float64)
        assert np.isfinite(got[~sees]).all(), (np_, np.nonzero(~np.isfinite(got).all(axis=(1, 2))))
        assert_close(got[~sees], want[~sees], budget_for(dtype))


def test_cuda_mha_equals_native_cpu():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, "mixed")
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=16, max_pages=32,
                             n_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, 8, 128), jnp.bfloat16)
    args = (q, batch.offsets, cache.kv_blocks, batch.cache_lengths, cache.lut, 0)
    f = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal", num_partitions=3, implementation="native"))
    gpu = np.asarray(f(*args), np.float32)
    with on_cpu():
        cpu = np.asarray(jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal", num_partitions=3,
                                                                     implementation="native"))(*args), np.float32)
    assert np.abs(gpu - cpu).max() < 2e-2 and np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu) < 4e-3


def test_cuda_graph_decode_step_same_results():
    """A jitted decode step (store + attention) run again inside a captured CUDA graph gives the same output."""
    import os
    import subprocess
    import sys

    code = r'''
import jax, jax.numpy as jnp, numpy as np, msa_ops
rng = np.random.default_rng(0)
b, h, hkv, d, page, mp = 8, 32, 8, 128, 16, 64
kv = jnp.asarray(rng.standard_normal((b * mp, 2, 1, page, hkv, d)), jnp.bfloat16)
lut = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
cl = jnp.asarray(rng.integers(100, 1000, b), jnp.int32)
offs = jnp.arange(b + 1, dtype=jnp.int32)
q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16)
@jax.jit
def step(kv, q, k):
    kv = msa_ops.kv_cache_store_ragged_paged(kv, k, k, offs, cl, lut, 0, implementation="native")
    return kv, msa_ops.mha_ragged_paged(q, offs, kv, cl, lut, 0, implementation="native")
outs = [np.asarray(step(kv, q, k)[1], np.float32) for _ in range(3)]
print("MAXDIFF", max(float(np.abs(o - outs[0]).max()) for o in outs))
print("CHECKSUM", float(np.float64(outs[0]).sum()), float(np.abs(np.float64(outs[0])).sum()))
'''
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    base = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    graph = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert base.returncode == 0, base.stderr[-2000:]
    assert graph.returncode == 0, graph.stderr[-2000:]
    assert "MAXDIFF 0.0" in graph.stdout, graph.stdout
    pick = [ln for ln in base.stdout.splitlines() if ln.startswith("CHECKSUM")]
    assert pick and pick == [ln for ln in graph.stdout.splitlines() if ln.startswith("CHECKSUM")]


def test_cuda_graph_msa_chain_same_results():
    """MSA decode calls that each read the previous one's output (and the first the cache a store just wrote),
    jitted: with programmatic dependent launch off, on, and on inside a captured CUDA graph, the same output every
    time. With it the MSA decode kernel may start before the kernel ahead of it ends, so a read before that
    kernel's writes are visible would show here as a difference. bf16 runs the one-partition kernel, its calls
    back to back (the output is the next q as it is); fp8 at topk 64 the two-partition cluster, with a conversion
    kernel between the calls. These three run without work sharing (MSA_OPS_MSA_SHARE=0; with it the bits may differ
    from call to call); a fourth run with it, PDL on and in a captured graph, must agree with them within the budget."""
    import os
    import subprocess
    import sys

    code = r'''
import jax, jax.numpy as jnp, numpy as np, msa_ops
rng = np.random.default_rng(0)
b, h, hkv, d, mp = 32, 32, 4, 128, 64
for dt, topk, np_ in ((jnp.bfloat16, 16, 1), (jnp.float8_e4m3fn, 64, 2)):
    kv = jnp.asarray(rng.standard_normal((b * mp, 2, 1, 128, hkv, d)) * 0.5, dt)
    lut = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
    cl = jnp.asarray(rng.integers(2000, 128 * mp - 1, b), jnp.int32)
    offs = jnp.arange(b + 1, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, h, d)), dt)
    k = jnp.asarray(rng.standard_normal((b, hkv, d)) * 4.0, dt)
    ids = np.stack([rng.permutation(topk) for _ in range(hkv * b)]).reshape(hkv, b, topk)
    ids[:, :, 0] = -1
    ids[:, :, 1] = np.asarray(cl) // 128  # the block the store writes into
    ids = jnp.asarray(ids, jnp.int32)
    @jax.jit
    def step(kv, q, k):
        kv = msa_ops.kv_cache_store_ragged_paged(kv, k, k, offs, cl, lut, 0, implementation="native")
        o = q
        for _ in range(3):  # bf16: each call's output is the next one's q, so the MSA kernels run back to back
            qi = o if dt == jnp.bfloat16 else (o.astype(jnp.float32) * 4).astype(dt)
            o = msa_ops.msa_attention_ragged_paged(qi, offs, None, kv, cl, lut, 0, ids, num_partitions=np_,
                                                   implementation="native")
        return kv, o
    outs = [np.asarray(step(kv, q, k)[1], np.float32) for _ in range(3)]
    print("MAXDIFF", max(float(np.abs(o - outs[0]).max()) for o in outs))
    print("CHECKSUM", float(np.float64(outs[0]).sum()), float(np.abs(np.float64(outs[0])).sum()))
'''
    graph_flags = " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    runs = {}
    for name, pdl, flags, share in (("base", "0", "", "0"), ("pdl", "1", "", "0"), ("pdl_graph", "1", graph_flags, "0"),
                                    ("share_pdl_graph", "1", graph_flags, "4")):
        env = dict(os.environ, MSA_OPS_PDL=pdl, MSA_OPS_MSA_SHARE=share)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + flags).strip()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert r.returncode == 0, (name, r.stderr[-2000:])
        diffs = [float(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith("MAXDIFF")]
        assert len(diffs) == 2 and (max(diffs) == 0.0 if share == "0" else max(diffs) < 0.05), (name, r.stdout)
        runs[name] = [ln for ln in r.stdout.splitlines() if ln.startswith("CHECKSUM")]
    assert len(runs["base"]) == 2 and runs["pdl"] == runs["base"] and runs["pdl_graph"] == runs["base"], runs
    for a_, b_ in zip(runs["share_pdl_graph"], runs["base"]):  # sums of 32 x 32 x 128 outputs of about 0.1-1
        np.testing.assert_allclose([float(x) for x in a_.split()[1:]], [float(x) for x in b_.split()[1:]],
                                   rtol=2e-3, atol=2.0)


# ------------------------------------------------------------------------------------------ CUDA MSA

def _msa_case(rng, scenario, group, topk, dtype, hkv=2):
    batch = make_batch(rng, scenario, s_max=640)
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=128, max_pages=5,
                             n_kv_heads=hkv, head_dim=128, dtype=dtype)
    q = rand(rng, (batch.T, hkv * group, 128), dtype)
    ids = rng.integers(-2, 7, (hkv, batch.T, topk)).astype(np.int32)  # -1/-2, ids past the sequence, > MP
    if topk > 2:
        ids[:, :, 1] = ids[:, :, 0]  # duplicates
    return batch, cache, q, ids


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("scenario,group,topk,np_", [
    ("decode", 4, 16, 0), ("decode", 8, 4, 3), ("decode1", 16, 64, 0), ("decode", 32, 8, 1),
    ("spec", 4, 8, 0), ("spec", 1, 16, 2), ("prefill", 8, 4, 0), ("long", 4, 3, 0), ("mixed", 16, 5, 4),
    ("mixed", 4, 0, 0),  # nothing selected: every row is zero
    ("decode", 2, 64, 0), ("spec", 8, 32, 5),
])
def test_cuda_msa_matches_oracle(dtype, scenario, group, topk, np_):
    rng = np.random.default_rng(hash((scenario, group, topk)) % 2**32)
    batch, cache, q, ids = _msa_case(rng, scenario, group, topk, dtype)
    args = (q, batch.offsets, None, cache.kv_blocks, batch.cache_lengths, cache.lut, 1, ids)
    got = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=np_, implementation="native"),
                  static_argnums=2)(*args)
    want = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, want, budget_for(dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("scenario,np_", [("spec", 0), ("spec", 2), ("prefill", 2), ("mixed", 3)])
def test_cuda_msa_later_tokens_nan(dtype, scenario, np_):
    """NaN in K and V of each sequence's last new token, a key that only that token's rows see: every other row
    equals the float64 oracle (docs/SEMANTICS.md §5: a key a row does not see adds nothing to it, not even as
    0 * NaN). Each token selects the block holding that key, so the key lies in a tile of every row of the
    sequence; the per-token kernel (speculative decode, and the prefill route when it splits) reads no key past its
    token's position."""
    rng = np.random.default_rng(len(scenario) + 10 * np_)
    batch, cache, q, ids = _msa_case(rng, scenario, 4, 6, dtype)
    kv = np.array(cache.kv_blocks)
    last = np.zeros(batch.T, bool)  # the rows that see a NaN key
    offs = np.minimum(np.maximum.accumulate(batch.offsets), batch.T)
    for b, (c, m) in enumerate(zip(batch.cache, batch.n)):
        if m == 0:
            continue
        key = c + m - 1
        kv[cache.lut[b, key // 128], :, 1, key % 128] = np.nan
        last[offs[b] + m - 1] = True
        ids[:, offs[b]:offs[b] + m, 0] = key // 128
    args = (q, batch.offsets, None, kv, batch.cache_lengths, cache.lut, 1, ids)
    hint = max(batch.n)  # (the route: without it, max_q reads T - B + 1, and spec would take the prefill route)
    got, kinds = launched(jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(
        *a, num_partitions=np_, max_prompt_length=hint, implementation="native"), static_argnums=2), *args)
    assert kinds & {"msa_decode", "msa_decode_cluster"} and not kinds & {"msa_prefill_cta", "msa_prefill_ws"}, kinds
    want = np.asarray(oracle.msa_attention_ragged_paged(*args), np.float64)
    assert np.isfinite(got[~last]).all(), np.nonzero(~np.isfinite(got).all(axis=(1, 2)))
    assert_close(got[~last], want[~last], budget_for(dtype))


def test_cuda_msa_loader_warp_same_bits():
    """The MSA decode kernel with its loader warp and without it (MSA_OPS_MSA_LOADER_WARP=0, read once per process:
    one process each) give the same output bit for bit, the same in three repeats of a call, and the float64
    oracle's. Decode batches (one row a sequence; one case with a padding row and the hint), 30-40 pages a sequence
    and topk up to 64 (the ring of four stages wraps several times), -1 / duplicate / out-of-range ids, bf16 and
    fp8, one, two (the cluster form, which has no loader warp) and three partitions; the loader-warp kernel serves
    a call where its grid fits the GPU's SMs (one CTA an SM), and one case has more CTAs than SMs. The loader-warp
    kernel runs without work sharing there (MSA_OPS_MSA_SHARE=0); a third process runs the same cases with it (its
    clusters of 2 or 4 tokens wherever the tokens divide), whose bits may differ from call to call: its outputs
    are checked against the oracle, and which calls it served."""
    import os
    import subprocess
    import sys

    code = r'''
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np, msa_ops, oracle
from msa_ops import _native
from conftest import RaggedBatch, assert_close, budget_for, make_paged_cache, rand
sms = jax.devices()[0].core_count
hkv = 2
for dt in (jnp.bfloat16, jnp.float8_e4m3fn):
    # (group, topk, partitions, sequences, padding rows, pages a sequence)
    for group, topk, np_, b, pad, mp in ((4, 32, 1, 8, 0, 40), (8, 40, 3, 6, 0, 40), (2, 64, 2, 8, 0, 40),
                                         (1, 24, 1, 7, 1, 36), (8, 16, 1, 80, 0, 4)):
        rng = np.random.default_rng(group * 1000 + topk + b)
        cache = [int(x) for x in rng.integers(128 * max(mp - 6, mp // 2), 128 * mp - 1, b)]
        batch = RaggedBatch([1] * b, cache, b + pad)
        pc = make_paged_cache(rng, [c + 1 for c in cache], page_size=128, max_pages=mp, n_kv_heads=hkv,
                              head_dim=128, dtype=dt)
        q = rand(rng, (batch.T, hkv * group, 128), dt)
        ids = rng.integers(-2, mp + 3, (hkv, batch.T, topk)).astype(np.int32)
        ids[:, :, 1] = ids[:, :, 0]
        args = (q, batch.offsets, None, pc.kv_blocks, batch.cache_lengths, pc.lut, 1, ids)
        kw = {"max_prompt_length": 1} if pad else {}
        f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=np_, implementation="native",
                                                                  **kw), static_argnums=2)
        before = _native.launch_counts()
        outs = [np.asarray(f(*args)) for _ in range(3)]
        after = _native.launch_counts()
        want = oracle.msa_attention_ragged_paged(*args)
        if sys.argv[2] == "strict":
            assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs), "repeats differ"
        for o in outs:
            assert_close(o, want, budget_for(dt))
        grew = [k for k in ("msa_decode_loader", "msa_decode_cluster", "msa_decode_share") if after[k] > before[k]]
        fits = batch.T * hkv * np_ <= sms
        print("CASE", jnp.dtype(dt).name, group, topk, np_, b, "+".join(grew) or "-", "fits" if fits else "over",
              hashlib.sha256(outs[0].view(np.uint16).tobytes()).hexdigest())
'''
    here = os.path.dirname(os.path.abspath(__file__))
    runs = {}
    for setting, share in (("1", "0"), ("0", "0"), ("1", "4")):
        env = dict(os.environ, MSA_OPS_MSA_LOADER_WARP=setting, MSA_OPS_CLUSTER_MERGE="1", MSA_OPS_MSA_SHARE=share)
        r = subprocess.run([sys.executable, "-c", code, here, "strict" if share == "0" else "close"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, (setting, share, r.stderr[-3000:])
        runs[setting + share] = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("CASE")]
        assert len(runs[setting + share]) == 10, r.stdout
    for sh in runs["14"]:  # sharing serves the loader-warp calls whose tokens form clusters of 2 or 4
        t = int(sh[5]) + (1 if sh[5] == "7" else 0)  # (the case of 7 sequences has a padding row)
        loader = "msa_decode_loader" in sh[6].split("+")
        assert ("msa_decode_share" in sh[6].split("+")) == (loader and t % 2 == 0), sh
    runs["1"], runs["0"] = runs.pop("10"), runs.pop("00")
    for on, off in zip(runs["1"], runs["0"]):
        assert on[:6] == off[:6], (on, off)
        clustered = "msa_decode_cluster" in on[6]
        assert clustered == ("msa_decode_cluster" in off[6]), (on, off)
        want = "msa_decode_loader" if on[7] == "fits" and not clustered else None
        assert ("msa_decode_loader" in on[6].split("+")) == (want is not None), (on, off)
        assert "msa_decode_loader" not in off[6], (on, off)
        assert on[8] == off[8], f"outputs differ with and without the loader warp: {on[1:6]}"


def test_cuda_msa_share_matches_oracle():
    """Work sharing in the MSA decode kernel (MSA_OPS_MSA_SHARE=4, read once per process: its own process; the
    loader-warp kernel in clusters of 2 or 4 tokens of a kv head, which take each other's key tiles at run time):
    the float64 oracle's output where the work is most uneven, so that members take many tiles from each other:
    tokens whose lists are empty (every id -1, or a padding row), a few blocks, or up to 64; groups 1, 4 and 8; one
    and three partitions; bf16 and fp8; a call repeated five times (which member takes which tile changes from call
    to call); and the sharing kernel served every call."""
    import subprocess
    import sys

    code = r'''
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np, msa_ops, oracle
from msa_ops import _native
from conftest import RaggedBatch, assert_close, budget_for, make_paged_cache, rand
sms = jax.devices()[0].core_count
hkv = 2
for dt in (jnp.bfloat16, jnp.float8_e4m3fn):
    for group, b, pad, np_, mp in ((8, 8, 0, 1, 40), (4, 12, 0, 3, 24), (1, 7, 1, 1, 36), (8, 16, 0, 1, 12)):
        assert (b + pad) * hkv * np_ <= sms
        rng = np.random.default_rng(group * 100 + b)
        cache = [int(x) for x in rng.integers(128 * (mp // 2), 128 * mp - 1, b)]
        batch = RaggedBatch([1] * b, cache, b + pad)
        pc = make_paged_cache(rng, [c + 1 for c in cache], page_size=128, max_pages=mp, n_kv_heads=hkv,
                              head_dim=128, dtype=dt)
        q = rand(rng, (batch.T, hkv * group, 128), dt)
        topk = 64
        ids = rng.integers(-1, mp, (hkv, batch.T, topk)).astype(np.int32)
        for t in range(batch.T):  # uneven lists: none, a few, all 64 slots
            ids[:, t, [0, 2, topk, 5][t % 4]:] = -1
        ids[:, :, 1] = ids[:, :, 0]  # a duplicate
        args = (q, batch.offsets, None, pc.kv_blocks, batch.cache_lengths, pc.lut, 1, ids)
        kw = {"max_prompt_length": 1} if pad else {}
        f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=np_, implementation="native",
                                                                  **kw), static_argnums=2)
        want = oracle.msa_attention_ragged_paged(*args)
        before = _native.launch_counts()["msa_decode_share"]
        for _ in range(5):
            assert_close(f(*args), want, budget_for(dt))
        assert _native.launch_counts()["msa_decode_share"] > before, (dt, group, b)
        print("CASE", jnp.dtype(dt).name, group, b, np_)
'''
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MSA_OPS_MSA_SHARE="4", MSA_OPS_MSA_LOADER_WARP="1")
    r = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("CASE")]) == 8, r.stdout


def test_cuda_msa_bad_values_and_cpu_agreement():
    rng = np.random.default_rng(9)
    batch, cache, q, ids = _msa_case(rng, "mixed", 4, 8, jnp.bfloat16)
    lut = cache.lut.copy()
    lut[0, :2] = [cache.kv_blocks.shape[0] + 3, -5]  # pages outside the pool
    offs = batch.offsets.copy()
    offs[2] = offs[1] - 1  # non-monotone
    for layer in (0, 7):
        args = (q, offs, None, cache.kv_blocks, batch.cache_lengths, lut, layer, ids)
        f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=2, implementation="native"),
                    static_argnums=2)
        got = np.asarray(f(*args), np.float32)
        assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(jnp.bfloat16))
        with on_cpu():
            cpu = np.asarray(f(*args), np.float32)
        assert np.abs(got - cpu).max() < 3e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("lut_width", [8, 7, 1030])
def test_cuda_msa_decode_page_table_widths(dtype, lut_width):
    """Decode with a sequence of no rows in the middle of the batch (the later rows' owners are not their row
    indices) and page tables of 7, 8 and 1030 entries a sequence, the entries past the pages in use junk. The
    kernel reads the page-table row of the sequence it guesses (row t's) whole at its start when it has at most
    1024 entries, by 16-byte copies when the width allows; a wrong guess or a longer row reads entries one by one
    after the owner search."""
    rng = np.random.default_rng(lut_width)
    batch = RaggedBatch([1, 1, 0, 1, 1, 1], [int(x) for x in rng.integers(1, 600, 6)], 7)
    hkv, group, topk = 2, 4, 16
    cache = make_paged_cache(rng, [c + n for c, n in zip(batch.cache, batch.n)], page_size=128, max_pages=5,
                             n_kv_heads=hkv, head_dim=128, dtype=dtype)
    nb = cache.kv_blocks.shape[0]
    lut = np.concatenate([cache.lut, rng.choice(np.array([-1, nb, 0, nb - 1]), (batch.B, lut_width - 5))], axis=1)
    lut = lut.astype(np.int32)
    q = rand(rng, (batch.T, hkv * group, 128), dtype)
    ids = rng.integers(-1, 8, (hkv, batch.T, topk)).astype(np.int32)
    args = (q, batch.offsets, None, cache.kv_blocks, batch.cache_lengths, lut, 1, ids)
    got = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"), static_argnums=2)(*args)
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(dtype))


# The prefill route's block-reusing kernel (msa_prefill_sm90.cuh; bf16 on sm_90): 128-row tiles of up to 128
# tokens, the union of their selections planned on the device in chunks of 512 blocks.
MSA_PREFILL_CASES = [  # (pattern, group, topk, n per sequence, cache per sequence, max_pages, padding rows)
    ("blocks", 8, 4, [300, 0, 140], [0, 50, 200], 4, 9),      # each 128-token query block shares a selection
    ("random", 1, 16, [200, 37], [130, 0], 4, 3),             # -1, duplicates, ids past the sequence and the table
    ("random", 3, 7, [150, 61], [257, 1000], 10, 0),          # tiles that straddle a token's heads
    ("random", 16, 64, [90], [1000], 9, 5),
    ("random", 4, 256, [40, 20], [3000, 10], 30, 2),
    ("spread", 1, 64, [130], [80000], 640, 0),                # > 512 distinct blocks in one tile: several chunks
    ("random", 64, 8, [40, 9], [100, 0], 2, 1),               # a warpgroup's 64 rows are one token's heads
    ("blocks", 128, 4, [20, 3], [300, 0], 4, 2),              # one token per tile
]


def _msa_prefill_ids(rng, pattern, batch, topk, max_pages, hkv):
    ids = np.full((hkv, batch.T, topk), -1, np.int32)
    for b, (c, n) in enumerate(zip(batch.cache, batch.n)):
        for i in range(n):
            t, pos = int(batch.offsets[b]) + i, c + i
            for h in range(hkv):
                if pattern == "blocks":  # the query block's own block and topk - 1 earlier ones
                    qb = pos // 128
                    pick = np.random.default_rng((b, h, qb)).permutation(qb)[: topk - 1]
                    row = rng.permutation(np.concatenate([[qb], pick]))
                elif pattern == "spread":
                    row = rng.integers(0, max_pages, topk)
                else:
                    row = rng.integers(-2, max_pages + 2, topk)
                    if topk > 2:
                        row[1] = row[0]
                ids[h, t, : len(row)] = row
    return ids


def _msa_prefill_call(rng, pattern, group, topk, n, cache_len, max_pages, pad, hkv=2, layers=2):
    """The operands of a prefill-route MSA call (keys past each sequence NaN; the pool's last layer) and the jitted
    native op."""
    batch = RaggedBatch(n, cache_len, sum(n) + pad)
    cache = make_paged_cache(rng, [c + m for c, m in zip(cache_len, n)], page_size=128, max_pages=max_pages,
                             n_kv_heads=hkv, head_dim=128, num_layers=layers, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, hkv * group, 128), jnp.bfloat16)
    ids = _msa_prefill_ids(rng, pattern, batch, topk, max_pages, hkv)
    kv_blocks = nan_past_keys(cache, cache_len, n, 128, layer=layers - 1)
    args = (q, batch.offsets, None, kv_blocks, batch.cache_lengths, cache.lut, layers - 1, ids)
    cro = np.concatenate([[0], np.cumsum(np.add(cache_len, n))]).astype(np.int32)
    plan = msa_ops.plan("mo.msa.attention.ragged.paged", *args[:2], cro, *args[3:])
    assert (plan.kernel, plan.tile_m) == ("msa_prefill", 128)
    f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"), static_argnums=2)
    return args, f


def test_cuda_msa_hints_route():
    """Hints steer MSA's route on CUDA and never its result (SPEC.md, Hints): one mixed batch (a decode token, a
    3-token step, a 300-token prompt; -1, duplicate and out-of-range ids) through the prefill, speculative and decode
    routes by its max_prompt_length hint, the last two of which understate the batch, each against the oracle."""
    rng = np.random.default_rng(11)
    n, cache_len = [1, 3, 300], [700, 129, 0]
    args, _ = _msa_prefill_call(rng, "random", 4, 8, n, cache_len, 12, 5)
    want = oracle.msa_attention_ragged_paged(*args)
    cro = np.concatenate([[0], np.cumsum(np.add(cache_len, n))]).astype(np.int32)
    routes = {}
    for hint, route in ((None, "prefill"), (4, "speculative"), (1, "decode")):
        kw = {} if hint is None else {"max_prompt_length": hint}
        plan = msa_ops.plan("mo.msa.attention.ragged.paged", *args[:2], cro, *args[3:], **kw)
        assert plan.route == route
        f = jax.jit(lambda *a, kw=kw: msa_ops.msa_attention_ragged_paged(*a, implementation="native", **kw),
                    static_argnums=2)
        got, kinds = launched(f, *args)
        # the per-token kernel serves both decode routes, two partitions of it as one cluster
        assert_served(kinds, "msa_prefill_ws" if route == "prefill" else
                      "msa_decode_cluster" if plan.num_partitions == 2 else "msa_decode")
        assert_close(got, want, budget_for(jnp.bfloat16), what=f"max_prompt_length={hint}")
        routes[route] = got
    assert not np.array_equal(routes["prefill"], routes["decode"])  # two kernels ran (their orders of sums differ)


@pytest.mark.parametrize("ws", ["1", "0"])  # the warp-specialized kernel (where the group divides 128), or not
@pytest.mark.parametrize("case", MSA_PREFILL_CASES, ids=lambda c: f"{c[0]}-g{c[1]}-k{c[2]}")
def test_cuda_msa_prefill_kernel(case, ws, monkeypatch):
    monkeypatch.setenv("MSA_OPS_MSA_PREFILL_WS", ws)
    pattern, group, topk, n, cache_len, max_pages, pad = case
    rng = np.random.default_rng(sum(n) + topk)
    args, f = _msa_prefill_call(rng, pattern, group, topk, n, cache_len, max_pages, pad)
    want = oracle.msa_attention_ragged_paged(*args)
    monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "1")
    tiled, kinds = launched(f, *args)
    assert_served(kinds, "msa_prefill_ws" if ws == "1" and 128 % group == 0 else "msa_prefill_cta")
    assert_close(tiled, want, budget_for(jnp.bfloat16))
    monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "0")  # the per-token kernel, on the same call
    per_token, kinds = launched(f, *args)
    assert_served(kinds, "msa_decode")
    assert_close(per_token, want, budget_for(jnp.bfloat16))
    if pattern == "blocks":  # two different kernels ran (their summation orders differ)
        assert not np.array_equal(tiled, per_token)


# The warp-specialized kernel's walk over its items (query tile x kv head): with more items than CTAs it runs
# several rounds in snake order, the sequences' last tiles interleaved when at most 128 sequences of similar
# lengths (4 sequences, 244 items; 128 sequences, 768 items); else the grid order (130 sequences: the kernel's
# sequence table per chunk of 32, the last chunk of two; 700 and 1024 sequences of 0-39 rows and two of 200 and
# 150, one kv head; 1100 sequences: past the table). Each item must be computed exactly once: a tile computed
# twice or skipped shows as a wrong or a zero row.
_MANY_N = [[int(x) for x in np.random.default_rng(m).integers(0, 40, m - 2)] + [200, 150] for m in (700, 1024, 1100)]
MSA_PREFILL_ORDER_CASES = [  # (n per sequence, cache per sequence, topk, kv heads, layers)
    ([700, 300, 900, 20], [0, 300, 2000, 128], 4, 2, 2),
    ([40] * 128, [(37 * i) % 700 for i in range(128)], 2, 2, 2),
    ([40] * 130, [(37 * i) % 700 for i in range(130)], 2, 2, 2),
] + [(n, [(53 * i) % 200 for i in range(len(n))], 2, 1, 1) for n in _MANY_N]


@pytest.mark.parametrize("case", MSA_PREFILL_ORDER_CASES,
                         ids=["interleaved", "128-sequences", "130-sequences", "700-sequences", "1024-sequences",
                              "1100-sequences"])
def test_cuda_msa_prefill_item_order(case, monkeypatch):
    monkeypatch.setenv("MSA_OPS_MSA_PREFILL_WS", "1")
    monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "1")
    n, cache_len, topk, hkv, layers = case
    rng = np.random.default_rng(len(n) + topk)
    max_pages = max(-(-(c + m) // 128) for c, m in zip(cache_len, n))
    args, f = _msa_prefill_call(rng, "blocks", 8, topk, n, cache_len, max_pages, 3, hkv=hkv, layers=layers)
    got, kinds = launched(f, *args)
    assert_served(kinds, "msa_prefill_ws")
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("ws", ["1", "0"])
@pytest.mark.parametrize("n_seq", [3, 140])
def test_cuda_msa_prefill_unowned_rows_are_zero(n_seq, ws, monkeypatch):
    """A prefill-route call whose rows before offsets[0] (1100) and past offsets[B] (900) belong to no sequence,
    more of them than the GPU has SMs, the output poisoned first: those rows are 0 and the others match the
    oracle. The persistent kernel zeroes them with one warp of each CTA, taking the owned range from its sequence
    table (3 sequences) or from the offsets (140, past the table's entries per sequence); the CTA-per-tile kernel
    (MSA_OPS_MSA_PREFILL_WS=0) leaves them to the zeroing launch after it."""
    monkeypatch.setenv("MSA_OPS_MSA_PREFILL_WS", ws)
    monkeypatch.setenv("MSA_OPS_CUDA_WGMMA", "1")
    rng = np.random.default_rng(90 + n_seq)
    hkv, group, topk, lead, tail = 2, 8, 4, 1100, 900
    n = [300, 20, 140] if n_seq == 3 else [int(x) for x in rng.integers(9, 30, n_seq)]
    cache_len = [0, 130, 200] if n_seq == 3 else [int(x) for x in rng.integers(0, 300, n_seq)]
    max_pages = max(-(-(c + m) // 128) for c, m in zip(cache_len, n))
    core = RaggedBatch(n, cache_len, sum(n))
    ids_core = _msa_prefill_ids(rng, "blocks", core, topk, max_pages, hkv)
    T = lead + sum(n) + tail
    ids = rng.integers(-1, max_pages, (hkv, T, topk)).astype(np.int32)  # the unowned rows' ids: never read
    ids[:, lead:lead + sum(n)] = ids_core
    offs = (lead + core.offsets).astype(np.int32)
    cache = make_paged_cache(rng, [c + m for c, m in zip(cache_len, n)], page_size=128, max_pages=max_pages,
                             n_kv_heads=hkv, head_dim=128, num_layers=2, dtype=jnp.bfloat16)
    kv_blocks = nan_past_keys(cache, cache_len, n, 128, layer=1)
    q = rand(rng, (T, hkv * group, 128), jnp.bfloat16)
    args = (q, offs, None, kv_blocks, core.cache_lengths, cache.lut, 1, ids)
    cro = np.concatenate([[0], np.cumsum(np.add(cache_len, n))]).astype(np.int32)
    plan = msa_ops.plan("mo.msa.attention.ragged.paged", q, offs, cro, *args[3:])
    assert (plan.kernel, plan.tile_m) == ("msa_prefill", 128)
    f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"), static_argnums=2)
    got = run_on_poisoned_output(f, args, (T, hkv * group, 128), lead, tail,
                                 served="msa_prefill_ws" if ws == "1" else "msa_prefill_cta")
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(jnp.bfloat16))


def test_cuda_msa_prefill_kernel_bad_values():
    rng = np.random.default_rng(12)
    batch = RaggedBatch([150, 0, 70], [100, 0, 300], 230)
    cache = make_paged_cache(rng, [c + m for c, m in zip(batch.cache, batch.n)], page_size=128, max_pages=4,
                             n_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
    q = rand(rng, (batch.T, 8, 128), jnp.bfloat16)
    ids = _msa_prefill_ids(rng, "random", batch, 6, 4, 2)
    lut = cache.lut.copy()
    lut[0, :2] = [cache.kv_blocks.shape[0] + 3, -5]  # pages outside the pool
    offs = batch.offsets.copy()
    offs[2] = offs[1] - 1  # non-monotone
    f = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, implementation="native"), static_argnums=2)
    for layer in (0, 7, -1):
        args = (q, offs, None, cache.kv_blocks, batch.cache_lengths, lut, layer, ids)
        got = np.asarray(f(*args), np.float32)
        assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(jnp.bfloat16))
        with on_cpu():
            cpu = np.asarray(f(*args), np.float32)
        assert np.abs(got - cpu).max() < 3e-2


# ------------------------------------------------------------------------------------------ CUDA indexer

IX_GPU_CONFIGS = [  # (scenario, topk, init, local, dtype, Di)
    ("decode", 4, 1, 1, "bf16", 64), ("mixed", 3, 0, 0, "f32", 128), ("long", 4, 1, 2, "bf16", 128),
    ("spec", 8, 0, 0, "f32", 64), ("prefill", 2, 1, 1, "bf16", 64), ("mixed", 3, 1, 0, "f16", 64),
    ("long", 5, 2, 1, "fp8", 128), ("decode", 1, 0, 1, "bf16", 128), ("long", 3, 0, 0, "f16", 32),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scenario,topk,init_blocks,local_blocks,dt,di", IX_GPU_CONFIGS)
def test_cuda_indexer_matches_oracle(seed, scenario, topk, init_blocks, local_blocks, dt, di):
    from test_reference import assert_indexer_matches, indexer_inputs

    _rng, batch, pc, q, _ = indexer_inputs(seed, scenario, dt, di)
    lut = pc.lut.copy()
    if seed == 2:  # pages outside the pool: those blocks are not eligible
        lut[0, :2] = [pc.kv_blocks.shape[0] + 3, -7]
    layer = np.int32(seed % 2)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, lut, layer)
    kw = dict(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    got = np.asarray(jax.jit(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, implementation="native", **kw))(*args))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, ref, scores, elig, topk, init_blocks, local_blocks)
    assert (got[:, batch.offsets[-1]:] == -1).all()


@pytest.mark.parametrize("mp,topk,init_blocks,local_blocks", [(1024, 64, 1, 2), (300, 16, 0, 0), (8, 8, 2, 2)])
def test_cuda_indexer_long_context_and_cpu(mp, topk, init_blocks, local_blocks):
    """Many blocks (the shared-memory sort), bad layer, CUDA == native CPU."""
    from test_reference import assert_indexer_matches

    rng = np.random.default_rng(mp)
    b, hi, di = 3, 4, 128
    nb = b * mp + 2
    kb = rand(rng, (nb, 1, 2, 128, 1, di), jnp.bfloat16)
    lut = rng.permutation(nb)[: b * mp].reshape(b, mp).astype(np.int32)
    cl = np.array([mp * 128 - 1, 5, mp * 64], np.int32)
    offs = np.array([0, 1, 2, 3], np.int32)
    q = rand(rng, (5, hi, di), jnp.bfloat16)  # 2 padding rows
    kw = dict(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    for layer in (1, 2):
        args = (q, offs, kb, cl, lut, np.int32(layer))
        f = jax.jit(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, implementation="native", **kw))
        got = np.asarray(f(*args))
        ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
        assert_indexer_matches(got, ref, scores, elig, topk, init_blocks, local_blocks)
        with on_cpu():
            cpu = np.asarray(f(*args))
        assert (cpu == got).mean() > 0.99  # f32 sums in another order may swap near-tied blocks


# ------------------------------------------------------------------------------------------ property tests

def test_cuda_property_suite():
    """The hypothesis property checks of test_property.py (random shapes, masks, sinks, split-K, the 128-row tile,
    ids and pages out of range), on the GPU with implementation='auto': the CUDA kernels where they cover the
    shape (bf16/f16, D 64/128/256; MSA bf16/fp8; every indexer shape drawn), the reference lowering elsewhere."""
    from hypothesis import given
    from test_property import (
        SETTINGS,
        check_mha_ragged_paged,
        check_msa_attention,
        check_msa_indexer,
        indexer_problems,
        msa_problems,
        paged_problems,
    )

    gpu = jax.devices("gpu")[0]

    def on_gpu(check):
        def run(p):
            check(p, "auto", gpu)
        return run

    for check, problems in ((check_mha_ragged_paged, paged_problems), (check_msa_attention, msa_problems),
                            (check_msa_indexer, indexer_problems)):
        SETTINGS(given(p=problems())(on_gpu(check)))()


# ------------------------------------------------------------------------------------------ shared pages

@pytest.mark.parametrize("scenario,page,np_", [
    ("decode", 16, 0), ("decode", 128, 2), ("decode", 16, 5), ("long", 16, 0), ("mixed", 128, 0), ("spec", 64, 3),
])
def test_cuda_mha_pages_named_twice(scenario, page, np_):
    """A physical page named twice (within a sequence, and by two sequences) is read as the keys of each place:
    decode tiles (one partition, cluster merge, combine kernel) and prefill tiles."""
    from test_reference import mha_inputs, tokens_of

    _, batch, pc, q, layer = mha_inputs(9, scenario, group=4, page_size=page, dtype=jnp.bfloat16, head_dim=128)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, share_pages(pc.lut, tokens_of(batch), page), layer)
    got = jax.jit(lambda *a: msa_ops.mha_ragged_paged(*a, mask_str="causal", num_partitions=np_,
                                                      implementation="native"))(*args)
    assert_close(got, oracle.mha_ragged_paged(*args, mask_str="causal"), budget_for(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("scenario,np_", [("decode", 0), ("decode", 2), ("spec", 0), ("long", 0)])
def test_cuda_msa_pages_named_twice(dtype, scenario, np_):
    """MSA selects logical blocks: two selected blocks on one physical page are two blocks of keys, each at its own
    positions (decode, speculative and prefill routes)."""
    from test_reference import MSA_MP, msa_indices, msa_inputs, tokens_of

    dt = "bf16" if dtype == jnp.bfloat16 else "fp8"
    rng, batch, pc, q, offs, cro, cl, lut, _ids, _ = msa_inputs(9, scenario, dt, 2, 8, MSA_MP)
    ids = msa_indices(rng, batch, 2, MSA_MP, junk=False)  # every block of the sequence selected
    args = (q, offs, cro, pc.kv_blocks, cl, share_pages(lut, tokens_of(batch), 128), np.int32(1), ids)
    got = jax.jit(lambda *a: msa_ops.msa_attention_ragged_paged(*a, num_partitions=np_,
                                                                implementation="native"))(*args)
    assert_close(got, oracle.msa_attention_ragged_paged(*args), budget_for(dtype))


def test_cuda_indexer_pages_named_twice():
    from test_reference import assert_indexer_matches, indexer_inputs, tokens_of

    _rng, batch, pc, q, _ = indexer_inputs(4, "long", "bf16", 128)
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, share_pages(pc.lut, tokens_of(batch), 128),
            np.int32(0))
    kw = dict(topk=3, init_blocks=1, local_blocks=1)
    got = np.asarray(jax.jit(lambda *a: msa_ops.msa_indexer_ragged_paged(*a, implementation="native", **kw))(*args))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, ref, scores, elig, **kw)


VMAP_CASES = [
    ("test_vmap_mha_ragged_paged_folds", dict(scenario="mixed", pool_axis=3, sink=False)),
    ("test_vmap_mha_ragged_paged_folds", dict(scenario="decode", pool_axis=None, sink=True)),
    ("test_vmap_mha_ragged_paged_folds", dict(scenario="spec", pool_axis=0, sink=True)),
    ("test_vmap_mha_ragged_paged_folds", dict(scenario="prefill", pool_axis=None, sink=False)),
    ("test_vmap_mha_padded_paged_folds", {}),
    ("test_vmap_no_cache_folds", {}),
    ("test_vmap_msa_attention_folds", dict(scenario="decode", dt="bf16", pool_mapped=True)),
    ("test_vmap_msa_attention_folds", dict(scenario="spec", dt="fp8", pool_mapped=False)),
    ("test_vmap_msa_attention_folds", dict(scenario="mixed", dt="bf16", pool_mapped=False)),
    ("test_vmap_msa_indexer_folds", {}),
    ("test_vmap_kv_cache_store_folds", {}),
]


@pytest.mark.parametrize("name,kw", VMAP_CASES, ids=[f"{n[10:]}-{i}" for i, (n, _) in enumerate(VMAP_CASES)])
def test_cuda_vmap_folds(name, kw):
    """tests/test_vmap.py's cases on the CUDA handlers: a vmap folded into one call (bad offsets, cache lengths and
    page ids among the elements), each element against the float64 oracle."""
    import test_vmap

    getattr(test_vmap, name)("native", **kw)


@pytest.mark.parametrize("name", ["test_indexer_scores_past_f32_range_still_rank",
                                  "test_indexer_signed_zero_scores_tie", "test_indexer_nan_dot_never_wins"])
def test_cuda_indexer_score_edges(name):
    """test_semantics_indexer's score edges on the CUDA indexer: an eligible block scoring -inf still ranks above
    the blocks that are not eligible, scores of -0 and +0 tie (the lower id first), a NaN dot never wins."""
    import test_semantics_indexer

    getattr(test_semantics_indexer, name)("native")
