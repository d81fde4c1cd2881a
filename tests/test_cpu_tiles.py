"""The native CPU handlers' vector loops (the attention tile loop of kernels/cpu/attend.cc and the indexer's scoring
loop) against the float64 oracle, on the shapes that take each of their branches.

The loop scores a tile for all query vectors of a work item in blocks of two vectors by four keys and applies the
weights in blocks of four vectors by two vectors of columns (16 in the AVX2 loop, 8 in the portable one: the blocked
form), unless a needed V row holds a NaN or an
infinity or the head dim is not a multiple of 8 (the per-vector form). The cases: query-vector counts of every
remainder of those blocks, head dims that are multiples of 16, of 8 only and of neither, key ranges that start and
end inside a tile, absent keys inside a tile (page-table entries -1 and past the pool), rows whose visible ranges
differ within a tile (the causal diagonal, windows, chunks), split-K partitions, and a V row holding NaN that only a
later row sees; for the indexer, items of odd vector counts, head dims off the vector width, absent pages, and planted
block maxima at every key offset. `test_portable_loop` runs this file again in a child process with the portable
loops forced (`MSA_OPS_CPU_ISA=generic`), the loops every CPU without AVX2 and FMA runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import oracle
import pytest
from conftest import BF16, FP8, assert_close, budget_for, child_env, jit_call, make_paged_cache, on_cpu, rand


@pytest.fixture(autouse=True)
def _native_cpu():
    msa_ops = pytest.importorskip("msa_ops")
    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip("native CPU library not available")
    with on_cpu():
        yield msa_ops


def _np(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def with_absent_pages(pc, tokens) -> np.ndarray:
    """pc's page table with absent keys inside the sequences' ranges: the second page of each sequence longer than
    three pages named -1 (even sequences) or past the pool (odd ones)."""
    lut = np.array(pc.lut)
    for b, t in enumerate(tokens):
        if t > 3 * pc.page_size:
            lut[b, 1] = -1 if b % 2 == 0 else pc.kv_blocks.shape[0] + 5
    return lut


# (group, head dim, rows of each sequence, cache of each sequence, mask, window, dtype). A work item holds
# min(32, 64 / group) rows (at least 1) x group query vectors; the comments give its vector counts.
MHA_CASES = [
    (1, 128, [3, 1, 70], [0, 5, 61], "causal", -1, "bf16"),        # 3, 1, 32, 32, 6: every remainder of 2 and 4
    (3, 64, [7, 21, 2], [40, 0, 130], "causal", -1, "bf16"),       # 21, 63 (4k + 3), 6
    (5, 24, [13, 1], [29, 77], "null", -1, "f32"),                  # D = 24: 16 + 8 columns; 60, 5 (4k + 1)
    (2, 8, [33, 4], [0, 90], "sliding_window_causal", 37, "f16"),   # D = 8; ranges differ row by row
    (4, 128, [40, 6], [100, 3], "chunked_causal", 40, "bf16"),      # chunks start inside tiles
    (6, 128, [5, 17], [250, 66], "sliding_window_noncausal", 50, "bf16"),  # 30, 60, 42
    (4, 12, [9, 30], [44, 10], "causal", -1, "f32"),                # D = 12: the per-vector form
    (16, 128, [1, 1, 1], [300, 63, 64], "causal", -1, "bf16"),      # decode, 16 vectors; tile edges
]


@pytest.mark.parametrize("num_partitions", [0, 3])
@pytest.mark.parametrize("case", MHA_CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-{c[4]}-{c[6]}")
def test_mha_tiles_match_the_oracle(case, num_partitions, _native_cpu):
    msa_ops = _native_cpu
    group, d, n, cache, mask, window, dt = case
    dtype = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}[dt]
    rng = np.random.default_rng(sum(n) * 31 + d + group)
    hkv, page = 2, 16
    tokens = [c + m for c, m in zip(cache, n)]
    pc = make_paged_cache(rng, tokens, page_size=page, max_pages=-(-max(tokens) // page) + 1, n_kv_heads=hkv,
                          head_dim=d, dtype=dtype)
    lut = with_absent_pages(pc, tokens)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 1, group * hkv, d), dtype)
    args = (q, offs, pc.kv_blocks, np.array(cache, np.int32), lut, np.int32(1))
    kw = dict(mask_str=mask, local_window_size=window, num_partitions=num_partitions)
    got = _np(jit_call(msa_ops.mha_ragged_paged, *args, implementation="native", **kw))
    ref = oracle.mha_ragged_paged(*args, **kw)
    assert_close(got, ref, budget_for(dtype), what=f"{case}, {num_partitions} partitions")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["k", "v"])
def test_non_finite_key_seen_only_by_a_later_row(which, value, _native_cpu):
    """A K or V row holding NaN or an infinity, on the key of a sequence's last row, and NaN in every slot and page
    no row sees: the rows before it (same tile, same work item) must not see it, not even as 0 * NaN. A non-finite
    K leaves the tile on the blocked form (its score is masked); a non-finite V sends it to the per-vector form."""
    from test_reference import poison_unseen

    msa_ops = _native_cpu
    rng = np.random.default_rng(5)
    n, cache, page, d = [20], [30], 16, 128
    pc = make_paged_cache(rng, [50], page_size=page, max_pages=4, n_kv_heads=2, head_dim=d, dtype=BF16,
                          junk_tail=False)
    kv = poison_unseen(pc.kv_blocks, pc.lut, cache, n, page)
    last = cache[0] + n[0] - 1
    kv[pc.lut[0, last // page], 0 if which == "k" else 1, 0, last % page] = value
    offs = np.array([0, n[0]], np.int32)
    q = rand(rng, (n[0], 8, d), BF16)
    args = (q, offs, kv, np.array(cache, np.int32), pc.lut, np.int32(0))
    for parts in (0, 2):
        got = _np(jit_call(msa_ops.mha_ragged_paged, *args, implementation="native", mask_str="causal",
                           num_partitions=parts))
        ref = oracle.mha_ragged_paged(*args, mask_str="causal")
        assert_close(got[:-1], ref[:-1], budget_for(BF16), what=f"rows before the {which} = {value} key")


@pytest.mark.parametrize("dt", ["bf16", "fp8"])
@pytest.mark.parametrize("group", [1, 3, 16])
def test_msa_tiles_match_the_oracle(dt, group, _native_cpu):
    """MSA: each selected 128-token block is scanned as two 64-key tiles; rows of a speculative step see
    different parts of their last block."""
    msa_ops = _native_cpu
    dtype = BF16 if dt == "bf16" else FP8
    rng = np.random.default_rng(group * 7 + len(dt))
    n, cache = [1, 5, 3], [400, 190, 70]
    tokens = [c + m for c, m in zip(cache, n)]
    pc = make_paged_cache(rng, tokens, page_size=128, max_pages=4, n_kv_heads=2, head_dim=128, dtype=dtype)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    T = int(offs[-1])
    q = rand(rng, (T, 2 * group, 128), dtype)
    idx = np.stack([rng.permutation(np.array([0, 1, 2, 3, -1], np.int32))[:4] for _ in range(2 * T)])
    idx = idx.reshape(2, T, 4)
    args = (q, offs, None, pc.kv_blocks, np.array(cache, np.int32), pc.lut, np.int32(1), idx)
    got = _np(jit_call(msa_ops.msa_attention_ragged_paged, *args, implementation="native"))
    ref = oracle.msa_attention_ragged_paged(*args)
    assert_close(got, ref, budget_for(BF16, dtype), what=f"MSA {dt} group {group}")


# (index heads, index head dim, rows of each sequence, cache of each sequence, dtype)
INDEXER_CASES = [
    (4, 128, [1, 1, 1], [900, 127, 128], "bf16"),   # decode; a block boundary at the last key
    (3, 24, [13, 9], [700, 400], "f32"),            # 8-row items: 24, 15 and 3 query vectors; D = 24
    (1, 12, [20, 1], [500, 650], "f16"),            # D = 12: single-vector scores in the AVX2 loop
    (2, 64, [300], [500], "fp8"),                   # a long prompt: rows of one item cross blocks
]


@pytest.mark.parametrize("case", INDEXER_CASES, ids=lambda c: f"hi{c[0]}-d{c[1]}-{c[4]}")
def test_indexer_blocks_match_the_oracle(case, _native_cpu):
    """The indexer's scoring loop (rows of an item x index heads in blocks of two, a block's keys in fours), with a
    page of the sequence absent (-1) and one past the pool: those blocks are ineligible."""
    from test_reference import assert_indexer_matches

    msa_ops = _native_cpu
    hi, d, n, cache, dt = case
    dtype = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "fp8": FP8}[dt]
    rng = np.random.default_rng(d * 13 + hi)
    tokens = [c + m for c, m in zip(cache, n)]
    pc = make_paged_cache(rng, tokens, page_size=128, max_pages=-(-max(tokens) // 128) + 1, n_kv_heads=1,
                          head_dim=d, dtype=dtype, kv=1)
    lut = with_absent_pages(pc, tokens)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (int(offs[-1]) + 1, hi, d), dtype)
    args = (q, offs, pc.kv_blocks, np.array(cache, np.int32), lut, np.int32(1))
    kw = {"topk": 3, "init_blocks": 1, "local_blocks": 1}
    got = np.asarray(jit_call(msa_ops.msa_indexer_ragged_paged, *args, implementation="native", **kw))
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    assert_indexer_matches(got, ref, scores, elig, **kw)


@pytest.mark.parametrize("hi,d", [(1, 12), (1, 128), (3, 24)])
def test_indexer_planted_block_maxima(hi, d, _native_cpu):
    """Each block's maximum is one planted key, with block scores of distinct ranks; the four best blocks hold theirs
    at the four offsets modulo 4 (the scoring loop's key blocks), so a key scored wrongly at any offset changes the
    top 4. Index head h's query is (1 + h) times head 0's, so that every head's top 4 is planted (three heads: a
    pair of query vectors and one left over)."""
    msa_ops = _native_cpu
    rng = np.random.default_rng(d + hi)
    cache = [1000, 700]
    tokens = [c + 1 for c in cache]
    pc = make_paged_cache(rng, tokens, page_size=128, max_pages=8, n_kv_heads=1, head_dim=d,
                          dtype=np.dtype(np.float32), kv=1, std=0.5)
    kv = np.array(pc.kv_blocks)
    q0 = rand(rng, (2, 1, d), np.dtype(np.float32))
    q = np.concatenate([q0 * (1 + h) for h in range(hi)], axis=1)
    for b, t in enumerate(tokens):
        nblk = -(-t // 128)
        ranks = rng.permutation(nblk)
        for j in range(nblk):
            keys, offset = min(128, t - 128 * j), int(ranks[j]) % 4
            slot = 4 * int(rng.integers(0, (keys - offset - 1) // 4 + 1)) + offset
            assert slot < keys
            score = np.sqrt(d) * (6.0 + ranks[j])  # q0.k; the scaled score 6 + rank beats every random key
            kv[pc.lut[b, j], 0, 1, slot, 0] = q0[b, 0] * (score / float(q0[b, 0] @ q0[b, 0]))
    args = (q, np.array([0, 1, 2], np.int32), kv, np.array(cache, np.int32), pc.lut, np.int32(1))
    kw = {"topk": 4, "init_blocks": 0, "local_blocks": 0}
    got = np.asarray(jit_call(msa_ops.msa_indexer_ragged_paged, *args, implementation="native", **kw))
    ref = oracle.msa_indexer_ragged_paged(*args, **kw)
    np.testing.assert_array_equal(got, ref)


def test_concurrent_calls_match_one_at_a_time(_native_cpu):
    """The handlers share one thread pool: several native calls in one jitted graph (which XLA may run at once) and
    the same calls from several Python threads give the bits they give one at a time."""
    import threading

    import jax

    msa_ops = _native_cpu
    rng = np.random.default_rng(17)
    tokens = [700, 300, 129]
    pc = make_paged_cache(rng, tokens, page_size=128, max_pages=6, n_kv_heads=2, head_dim=128, dtype=BF16)
    cache = np.array([t - 1 for t in tokens], np.int32)
    offs = np.arange(4, dtype=np.int32)
    q = rand(rng, (3, 8, 128), BF16)
    idx = rng.integers(-1, 6, (2, 3, 4)).astype(np.int32)
    ipc = make_paged_cache(rng, tokens, page_size=128, max_pages=6, n_kv_heads=1, head_dim=64, dtype=BF16, kv=1)
    qi = rand(rng, (3, 4, 64), BF16)
    calls = [
        lambda: msa_ops.mha_ragged_paged(q, offs, pc.kv_blocks, cache, pc.lut, np.int32(0), mask_str="causal",
                                         num_partitions=3, implementation="native"),
        lambda: msa_ops.mha_ragged_paged(q, offs, pc.kv_blocks, cache, pc.lut, np.int32(1), mask_str="causal",
                                         implementation="native"),
        lambda: msa_ops.msa_attention_ragged_paged(q, offs, None, pc.kv_blocks, cache, pc.lut, np.int32(1), idx,
                                                   implementation="native"),
        lambda: msa_ops.msa_indexer_ragged_paged(qi, offs, ipc.kv_blocks, cache, ipc.lut, np.int32(0), topk=3,
                                                 implementation="native"),
    ]
    jitted = [jax.jit(c) for c in calls]
    want = [np.asarray(f()) for f in jitted]
    assert all(np.isfinite(w.astype(np.float32)).all() and np.count_nonzero(w) > w.size // 2 for w in want)
    together = jax.jit(lambda: [c() for c in calls])
    for _ in range(3):
        for w, g in zip(want, together()):
            np.testing.assert_array_equal(np.asarray(g), w)
    bad = []

    def worker(t):
        with on_cpu():
            for r in range(4):
                k = (t + r) % len(jitted)
                if not np.array_equal(np.asarray(jitted[k]()), want[k]):
                    bad.append((t, r, k))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad


def test_portable_loop():
    """This file's other tests, in a child process whose tile loop is the portable one."""
    from msa_ops import _native

    if not _native.available("cpu"):
        pytest.skip("native CPU library not available")
    if os.environ.get("MSA_OPS_CPU_ISA") == "generic":
        assert _native.info()["platforms"]["cpu"]["archs"].endswith(";generic")
        return
    env = child_env(MSA_OPS_CPU_ISA="generic")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
