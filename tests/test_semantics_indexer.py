"""Statements of docs/SEMANTICS.md, each checked directly: §8 (indexer) -- ties, forced blocks that lose on
score, the last eligible blocks when the table's last block is not eligible, topk past the page-table width."""

from __future__ import annotations

import jax
import numpy as np
import oracle
import pytest
from conftest import BF16, jit_call, make_paged_cache, rand

import msa_ops

F32 = np.dtype(np.float32)


def np_out(x):
    return np.asarray(jax.device_get(x))


def run(impl, args, **kw):
    return np_out(jit_call(msa_ops.msa_indexer_ragged_paged, *args, implementation=impl, **kw))


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("init,local,topk", [(0, 0, 3), (1, 1, 3), (0, 1, 2), (2, 0, 4)])
def test_indexer_exact_ties_lower_id(impl, dt, init, local, topk):
    """"the remaining topk - forced slots go to the highest-scoring other eligible blocks (ties: lower id)":
    blocks 0..4 of the sequence all read ONE page, so their scores tie exactly."""
    dtype = F32 if dt == "f32" else BF16
    rng = np.random.default_rng(3000)
    Hi, Di, MP = 3, 32, 8
    pc = make_paged_cache(rng, [1024], page_size=128, max_pages=MP, n_kv_heads=1, head_dim=Di, dtype=dtype, kv=1,
                          num_layers=1)
    lut = pc.lut.copy()
    lut[0, :5] = lut[0, 0]
    n, c = 3, 128 * 5 + 10  # p = 650..652: blocks 0..5 eligible; block 5 partial (own page)
    offs = np.array([0, n], np.int32)
    q = rand(rng, (n, Hi, Di), dtype)
    args = (q, offs, pc.kv_blocks, np.array([c], np.int32), lut, np.int32(0))
    kw = dict(topk=topk, init_blocks=init, local_blocks=local)
    got = run(impl, args, **kw)
    ref, scores, elig = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    np.testing.assert_array_equal(got, ref)
    # the statement itself, per (head,row): among the tied blocks 0..4 the lowest non-forced ids win
    for h in range(Hi):
        for t in range(n):
            s = scores[h, t]
            assert len(set(s[:5])) == 1
            forced = set(range(init)) | ({5 - x for x in range(local)})
            free = topk - len(forced)
            cands = sorted([j for j in range(6) if j not in forced], key=lambda j: (-s[j], j))
            want = sorted(forced | set(cands[:free]))
            assert got[h, t].tolist() == want + [-1] * (topk - len(want)), (h, t, got[h, t], want)


@pytest.mark.parametrize("init,local", [(1, 1), (2, 1), (0, 2), (1, 0)])
def test_indexer_forced_blocks_lowest_scores(impl, init, local):
    """"the first init_blocks and the last local_blocks eligible blocks (by id) are forced" -- with the forced blocks
    given the LOWEST scores (keys anti-aligned with q), and the table's last block ineligible (page outside the
    pool), so the last eligible block is not the table's last."""
    rng = np.random.default_rng(3001 + 10 * init + local)
    Hi, Di, MP = 2, 32, 8
    kb = make_paged_cache(rng, [8 * 128], page_size=128, max_pages=MP, n_kv_heads=1, head_dim=Di, dtype=F32, kv=1,
                          num_layers=2)
    kv = kb.kv_blocks.copy()
    lut = kb.lut.copy()
    lut[0, 7] = kv.shape[0] + 4  # block 7 (holding the rows' own positions) is not eligible
    q = rand(rng, (1, Hi, Di), F32)
    q[0, 1] = q[0, 0] + 0.1 * rand(rng, (Di,), F32)  # nearly aligned heads: both score the forced blocks lowest
    qdir = q[0].sum(0)
    elig = list(range(7))
    forced = elig[:init] + elig[len(elig) - local:]
    for j in forced:
        kv[lut[0, j], 0, 1, :, 0] = (-3.0 * qdir / np.linalg.norm(qdir))[None, :] + 0.01 * rand(rng, (128, Di), F32)
    offs = np.array([0, 1], np.int32)
    cl = np.array([8 * 128 - 1], np.int32)  # p = 1023
    args = (q, offs, kv, cl, lut, np.int32(1))
    topk = init + local + 2
    kw = dict(topk=topk, init_blocks=init, local_blocks=local)
    got = run(impl, args, **kw)
    ref, scores, _ = oracle.msa_indexer_ragged_paged(*args, return_scores=True, **kw)
    np.testing.assert_array_equal(got, ref)
    for h in range(Hi):
        s = scores[h, 0]
        assert max(s[j] for j in forced) < min(s[j] for j in elig if j not in forced)  # forced lose on score
        rest = sorted([j for j in elig if j not in forced], key=lambda j: (-s[j], j))[:2]
        assert got[h, 0].tolist() == sorted(set(forced) | set(rest)), (h, got[h, 0], forced, rest)
        assert 7 not in got[h, 0]


@pytest.mark.parametrize("topk", [5, 9])
def test_indexer_topk_past_table_and_all_eligible(impl, topk):
    """"If the number E of eligible blocks is <= topk, all are chosen ... Output ids ascending, then -1" with
    topk > MP (ids padded past the table width) and init/local set."""
    rng = np.random.default_rng(3002)
    Hi, Di, MP = 2, 16, 4
    kb = make_paged_cache(rng, [500, 130, 1], page_size=128, max_pages=MP, n_kv_heads=1, head_dim=Di, dtype=BF16,
                          kv=1, num_layers=1)
    n, cache = [2, 1, 1], [497, 129, 0]
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rand(rng, (5, Hi, Di), BF16)
    args = (q, offs, kb.kv_blocks, np.array(cache, np.int32), kb.lut, np.int32(0))
    kw = dict(topk=topk, init_blocks=1, local_blocks=2)
    got = run(impl, args, **kw)
    ref = oracle.msa_indexer_ragged_paged(*args, **kw)
    np.testing.assert_array_equal(got, ref)
    want_rows = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1], [0], []]
    for t, w in enumerate(want_rows):
        for h in range(Hi):
            assert got[h, t].tolist() == w + [-1] * (topk - len(w)), (t, h, got[h, t])


def _three_blocks(k_vals, q_val, dtype=F32):
    """One row at the end of three 128-key blocks of one page each, every key of block j equal to k_vals[j] in each of
    its 8 dims, q equal to q_val: the blocks' scores are those of 8 * q_val * k_vals[j] as f32 sums."""
    kb = np.zeros((3, 1, 1, 128, 1, 8), dtype)
    for j, v in enumerate(k_vals):
        kb[j] = v
    q = np.full((1, 1, 8), q_val, dtype)
    return (q, np.array([0, 1], np.int32), kb, np.array([3 * 128 - 1], np.int32), np.arange(3, dtype=np.int32)[None],
            np.int32(0))


def test_indexer_scores_past_f32_range_still_rank(impl):
    """An eligible block whose score overflows to -inf in f32 (finite q and K) is still an eligible block: with
    topk 2 of three blocks scoring -inf, finite and -inf, the picks are the finite one and the lower id of the two
    -inf ones, not a short list."""
    args = _three_blocks([-1e20, 1.0, -1e20], 1e20)
    assert run(impl, args, topk=2, scale=1.0).ravel().tolist() == [0, 1]


def test_indexer_signed_zero_scores_tie(impl):
    """Scores of -0 and +0 are equal, so they tie and the lower id wins: block 0 scores -0 (its products underflow
    negative), block 1 +0, block 2 a negative score; topk 1 picks block 0."""
    args = _three_blocks([-1e-30, 1e-30, -5.0], 1e-30)
    assert run(impl, args, topk=1, scale=1.0).ravel().tolist() == [0]


def test_indexer_nan_dot_never_wins(impl):
    """A NaN dot product (one key of block 0 is NaN) is skipped in the block's max, as every implementation's max
    skips it: block 0 scores its other keys' 0.8 against blocks 1 and 2's 8 and 4, so topk 2 picks blocks 1 and 2."""
    q, offs, kb, cl, lut, layer = _three_blocks([0.1, 1.0, 0.5], 1.0)
    kb[0, 0, 0, 5] = np.nan
    assert run(impl, (q, offs, kb, cl, lut, layer), topk=2, scale=1.0).ravel().tolist() == [1, 2]
