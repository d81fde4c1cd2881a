"""Self-checks of the float64 oracle (tests/oracle.py). They do not need msa_ops."""

from __future__ import annotations

import math

import numpy as np
import oracle
import pytest
from conftest import (
    BF16,
    FP8,
    RaggedBatch,
    make_batch,
    make_paged_cache,
    rand,
    to_uint32,
)

MASK_CASES = [
    ("null", -1),
    ("causal", -1),
    ("sliding_window_causal", 5),
    ("sliding_window_noncausal", 7),
    ("chunked_causal", 6),
]


def textbook_attention(q, k, v, mask_fn, scale):
    """Dense softmax attention of one sequence computed independently (per query row, with math.exp).

    q [n, H, D], k/v [N, Hkv, D], mask_fn(i, j) -> bool for query row i, key j."""
    n, H, _D = q.shape
    N, Hkv, _ = k.shape
    group = H // Hkv
    out = np.zeros((n, H, v.shape[-1]))
    for h in range(H):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(n):
            logits = [scale * float(np.dot(q[i, h], kh[j])) for j in range(N) if mask_fn(i, j)]
            idx = [j for j in range(N) if mask_fn(i, j)]
            if not idx:
                continue
            mx = max(logits)
            w = [math.exp(x - mx) for x in logits]
            z = sum(w)
            out[i, h] = sum(wi * vh[j] for wi, j in zip(w, idx)) / z
    return out


@pytest.mark.parametrize("group", [1, 4])
def test_causal_no_cache_equals_textbook(group):
    rng = np.random.default_rng(0)
    n, Hkv, D = 23, 2, 16
    q = rng.standard_normal((n, Hkv * group, D))
    k = rng.standard_normal((n, Hkv, D))
    v = rng.standard_normal((n, Hkv, D))
    offs = np.array([0, n], np.int32)
    got = oracle.mha_ragged_no_cache(q, k, v, offs, mask_str="causal")
    want = textbook_attention(q, k, v, lambda i, j: j <= i, 1 / math.sqrt(D))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # einsum + tril formulation, a third way
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk) / math.sqrt(D)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("hij,jhd->ihd", p, vv), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask,W", MASK_CASES)
def test_masks_against_textbook_with_offset_positions(mask, W):
    """Query rows at positions c + i over c + n keys; mask table of SPEC.md checked literally."""
    rng = np.random.default_rng(1)
    n, c, D = 9, 13, 8
    N = c + n
    q = rng.standard_normal((n, 2, D))
    k = rng.standard_normal((N, 1, D))
    v = rng.standard_normal((N, 1, D))
    table = {
        "null": lambda p, j: j < N,
        "causal": lambda p, j: j <= p,
        "sliding_window_causal": lambda p, j: j <= p and p - j < W,
        "sliding_window_noncausal": lambda p, j: j + W > p and j < N,
        "chunked_causal": lambda p, j: j <= p and p // W == j // W,
    }[mask]
    want = textbook_attention(q, k, v, lambda i, j: table(c + i, j), 1 / math.sqrt(D))
    got = oracle.mha_ragged_no_cache(q, k, v, np.array([0, n]), np.array([0, N]), mask_str=mask,
                                     local_window_size=W)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # MAX alias spelling
    got2 = oracle.mha_ragged_no_cache(q, k, v, np.array([0, n]), np.array([0, N]), mask_str=mask + "_mask",
                                      local_window_size=W)
    np.testing.assert_array_equal(got, got2)


@pytest.mark.parametrize("mask,W", MASK_CASES)
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_equals_no_cache(mask, W, page_size):
    """A paged cache holding the same K/V as contiguous arrays gives the no-cache result (p = c + i)."""
    rng = np.random.default_rng(2)
    batch = make_batch(rng, "mixed")
    Hkv, group, D = 2, 2, 16
    tokens = [c + n for c, n in zip(batch.cache, batch.n)]
    pc = make_paged_cache(rng, tokens, page_size=page_size, max_pages=512 // page_size, n_kv_heads=Hkv,
                          head_dim=D, num_layers=2)
    layer = 1
    q = rng.standard_normal((batch.T, Hkv * group, D))
    got = oracle.mha_ragged_paged(q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, layer,
                                  mask_str=mask, local_window_size=W)
    # contiguous K/V: cache tokens followed by the new tokens, per sequence
    ks, vs, koffs = [], [], [0]
    for b, tok in enumerate(tokens):
        pos = np.arange(tok)
        pages = pc.lut[b, pos // page_size]
        ks.append(pc.kv_blocks[pages, 0, layer, pos % page_size])
        vs.append(pc.kv_blocks[pages, 1, layer, pos % page_size])
        koffs.append(koffs[-1] + tok)
    want = oracle.mha_ragged_no_cache(q, np.concatenate(ks), np.concatenate(vs), batch.offsets,
                                      np.array(koffs), mask_str=mask, local_window_size=W)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # padding rows are 0
    assert not got[batch.offsets[-1]:].any()
    # padded paged layout gives the same rows
    S = max(batch.n)
    qp = np.zeros((batch.B, S, Hkv * group, D))
    for b in range(batch.B):
        qp[b, : batch.n[b]] = q[batch.offsets[b]: batch.offsets[b + 1]]
    gotp = oracle.mha_padded_paged(qp, pc.kv_blocks, batch.cache_lengths, pc.lut, layer,
                                   np.array(batch.n, np.int32), mask_str=mask, local_window_size=W)
    for b in range(batch.B):
        np.testing.assert_array_equal(gotp[b, : batch.n[b]], got[batch.offsets[b]: batch.offsets[b + 1]])
        assert not gotp[b, batch.n[b]:].any()


def test_padded_no_cache_equals_ragged():
    rng = np.random.default_rng(3)
    B, S, Sk, H, Hkv, D = 3, 10, 14, 4, 2, 8
    q = rng.standard_normal((B, S, H, D))
    k = rng.standard_normal((B, Sk, Hkv, D))
    v = rng.standard_normal((B, Sk, Hkv, D))
    vl = np.array([4, 0, 12], np.int32)  # 12 > S: n_q = 10, n_k = 12
    got = oracle.mha_padded_no_cache(q, k, v, vl, mask_str="causal")
    for b in range(B):
        nq, nk = min(vl[b], S), min(vl[b], Sk)
        want = oracle.mha_ragged_no_cache(q[b, :nq], k[b, :nk], v[b, :nk], np.array([0, nq]),
                                          np.array([0, nk]))
        np.testing.assert_array_equal(got[b, :nq], want)
        assert not got[b, nq:].any()


def test_no_cache_negative_positions_output_zero():
    """Fewer keys than queries: rows at negative positions see nothing under causal masks -> 0."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((6, 2, 8))
    k = rng.standard_normal((3, 1, 8))
    got = oracle.mha_ragged_no_cache(q, k, k, np.array([0, 6]), np.array([0, 3]), mask_str="causal")
    assert not got[:3].any() and (got[3:] != 0).all()
    got = oracle.mha_ragged_no_cache(q, k, k, np.array([0, 6]), np.array([0, 3]), mask_str="null")
    assert (got != 0).all()


def test_sink_minus_inf_equals_no_sink_and_formula():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, "mixed")
    H, Hkv, D = 4, 2, 16
    tokens = [c + n for c, n in zip(batch.cache, batch.n)]
    pc = make_paged_cache(rng, tokens, page_size=16, max_pages=32, n_kv_heads=Hkv, head_dim=D)
    q = rng.standard_normal((batch.T, H, D))
    args = (q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, 0)
    base = oracle.mha_ragged_paged(*args)
    np.testing.assert_array_equal(oracle.mha_ragged_paged(*args, sink_weights=np.full(H, -np.inf)), base)
    # sink only rescales the denominator: out_sink = out * Z / (Z + e^sink), Z = sum_j e^{s_j}
    sinks = np.array([0.5, -1.0, 3.0, 10.0])
    got = oracle.mha_ragged_paged(*args, sink_weights=sinks)
    scale = 1 / math.sqrt(D)
    for b in range(batch.B):
        c = batch.cache[b]
        for i in range(batch.n[b]):
            t, p = batch.offsets[b] + i, c + i
            pos = np.arange(p + 1)
            pages = pc.lut[b, pos // 16]
            for h in range(H):
                kh = pc.kv_blocks[pages, 0, 0, pos % 16, h // 2]
                z = np.exp(scale * kh @ q[t, h]).sum()
                np.testing.assert_allclose(got[t, h], base[t, h] * z / (z + math.exp(sinks[h])), rtol=1e-10)


@pytest.mark.parametrize("num_partitions", [1, 2, 3, 7, 32])
def test_split_k_combination_is_exact(num_partitions):
    """The split-K combine of SEMANTICS §6 (log2 space, sink entered once) reproduces the exact oracle."""
    rng = np.random.default_rng(6)
    N, D = 300, 16
    q = rng.standard_normal(D)
    K = rng.standard_normal((N, D))
    V = rng.standard_normal((N, D))
    sink = 0.7
    scale = 1 / math.sqrt(D)
    exact = oracle.softmax_attend(q[None], K, V, np.ones((1, N), bool), scale, sink)[0]
    parts = []
    for lo, hi in oracle.split_k_ranges(N, num_partitions):
        if hi <= lo:
            parts.append((-np.inf, np.zeros(D)))
            continue
        s = scale * K[lo:hi] @ q
        e = np.exp(s)
        parts.append((math.log2(e.sum()), (e @ V[lo:hi]) / e.sum()))
    m = max(lse for lse, _ in parts)
    w = np.array([2.0 ** (lse - m) if lse > -np.inf else 0.0 for lse, _ in parts])
    o = sum(wi * op for wi, (_, op) in zip(w, parts)) / (w.sum() + 2.0 ** (sink * math.log2(math.e) - m))
    np.testing.assert_allclose(o, exact, rtol=1e-12)
    covered = [k for lo, hi in oracle.split_k_ranges(N, num_partitions) for k in range(lo, hi)]
    assert covered == list(range(N))


def test_get_num_partitions_examples():
    f = oracle.get_num_partitions
    assert f(1, 100, n_kv_heads=8, sm_count=132) == 1
    assert f(1, 4096, n_kv_heads=8, sm_count=132) == 8  # min(16, 8)
    assert f(1, 100000, n_kv_heads=1, sm_count=132) == 32  # clamp to 32
    assert f(64, 100000, n_kv_heads=8, sm_count=132) == 1  # 132 // 512 = 0 -> 1
    assert f(2, 2048, n_kv_heads=8, sm_count=148) == 4  # min(9, 4)


def test_row_offsets_example():
    got = oracle.kv_cache_row_offsets_ragged_paged(np.array([0, 3, 3, 4]), np.array([5, -2, 10]))
    np.testing.assert_array_equal(got, [0, 8, 8, 19])
    assert got.dtype == np.int32


def test_repair_offsets_and_uint32():
    np.testing.assert_array_equal(oracle.repair_offsets(np.array([-3, 5, 2, 9, 40]), 20), [0, 5, 5, 9, 20])
    np.testing.assert_array_equal(oracle.as_i32(to_uint32([-1, 3])), [-1, 3])
    np.testing.assert_array_equal(oracle.as_i32(np.array([0xFFFFFFFF, 7], np.uint32)), [-1, 7])


def test_bad_values_are_masked():
    """Invalid page ids, cache lengths past S_max and layer_idx out of range only mask keys."""
    rng = np.random.default_rng(7)
    H, D, P = 2, 8, 16
    pc = make_paged_cache(rng, [40], page_size=P, max_pages=4, n_kv_heads=1, head_dim=D)
    q = rng.standard_normal((3, H, D))
    offs = np.array([0, 3])
    base = oracle.mha_ragged_paged(q, offs, pc.kv_blocks, np.array([37]), pc.lut, 0, mask_str="null")
    lut = pc.lut.copy()
    lut[0, 1] = -1  # keys 16..31 vanish
    got = oracle.mha_ragged_paged(q, offs, pc.kv_blocks, np.array([37]), lut, 0, mask_str="null")
    pos = np.array([k for k in range(40) if not 16 <= k < 32])
    pages = pc.lut[0, pos // P]
    K = pc.kv_blocks[pages, 0, 0, pos % P, 0]
    V = pc.kv_blocks[pages, 1, 0, pos % P, 0]
    want = np.stack([oracle.softmax_attend(q[:, h], K, V, np.ones((3, len(pos)), bool), 1 / math.sqrt(D))
                     for h in range(H)], 1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert not np.array_equal(got, base)
    # layer out of range -> 0
    for layer in (-1, 2, 1 << 20):
        assert not oracle.mha_ragged_paged(q, offs, pc.kv_blocks, np.array([37]), pc.lut, layer).any()
    # cache length past S_max clamps to S_max = 64: all keys of the 4 pages (64 keys) minus invalid pages
    lut_full = make_paged_cache(rng, [64], page_size=P, max_pages=4, n_kv_heads=1, head_dim=D)
    a = oracle.mha_ragged_paged(q, offs, lut_full.kv_blocks, np.array([10 ** 6]), lut_full.lut, 0)
    b = oracle.mha_ragged_paged(q, offs, lut_full.kv_blocks, np.array([64]), lut_full.lut, 0)
    np.testing.assert_array_equal(a, b)
    assert (a != 0).all()


def test_msa_all_blocks_equals_causal_mha():
    rng = np.random.default_rng(8)
    batch = RaggedBatch([5, 0, 130], [200, 17, 60], 140)
    H, Hkv, D = 4, 2, 128
    tokens = [c + n for c, n in zip(batch.cache, batch.n)]
    pc = make_paged_cache(rng, tokens, page_size=128, max_pages=4, n_kv_heads=Hkv, head_dim=D, dtype=BF16)
    q = rand(rng, (batch.T, H, D), BF16)
    topk = 6
    idx = np.full((Hkv, batch.T, topk), -1, np.int32)
    idx[:, :, :4] = np.arange(4)
    idx[:, :, 4] = 2  # duplicate
    idx[:, :, 5] = 99  # past the page table
    got = oracle.msa_attention_ragged_paged(q, batch.offsets, None, pc.kv_blocks, batch.cache_lengths, pc.lut,
                                            1, idx)
    want = oracle.mha_ragged_paged(q, batch.offsets, pc.kv_blocks, batch.cache_lengths, pc.lut, 1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # a subset of blocks: only those keys
    idx2 = np.full((Hkv, batch.T, 2), -1, np.int32)
    idx2[0, :, 0] = 0
    idx2[1, :, :] = [1, 1]
    got2 = oracle.msa_attention_ragged_paged(q, batch.offsets, None, pc.kv_blocks, batch.cache_lengths,
                                             pc.lut, 1, to_uint32(idx2))
    t = batch.offsets[2] + 100  # seq 2, p = 160
    k = np.arange(128)
    K = pc.kv_blocks[pc.lut[2, 0], 0, 1, k, 0].astype(np.float64)
    V = pc.kv_blocks[pc.lut[2, 0], 1, 1, k, 0].astype(np.float64)
    w = oracle.softmax_attend(q[t:t + 1, 0].astype(np.float64), K, V, np.ones((1, 128), bool),
                              1 / math.sqrt(D))
    np.testing.assert_allclose(got2[t, 0], w[0], rtol=1e-12)
    # seq 0 (p = 200..204): block 1 holds existing keys 128..p -> heads of kv head 1 are non-zero
    assert (got2[batch.offsets[0]: batch.offsets[1], 2:] != 0).all()
    # seq 2 rows with p = 60 + i < 128: block 1 has no key <= p -> fully masked -> exactly 0
    s2 = batch.offsets[2]
    assert not got2[s2: s2 + 68, 2:].any() and (got2[s2 + 68: s2 + 130, 2:] != 0).all()
    assert not got2[batch.offsets[-1]:].any()


def test_msa_fp8_inputs_upcast():
    rng = np.random.default_rng(9)
    pc = make_paged_cache(rng, [130], page_size=128, max_pages=2, n_kv_heads=1, head_dim=128, dtype=FP8)
    q = rand(rng, (2, 2, 128), FP8)
    idx = np.array([[[0, 1], [1, -1]]], np.int32)
    got = oracle.msa_attention_ragged_paged(q, np.array([0, 2]), None, pc.kv_blocks, np.array([128]), pc.lut,
                                            0, idx)
    assert np.isfinite(got).all() and (got != 0).all()


def test_indexer_selection_rules():
    rng = np.random.default_rng(10)
    P, Di, Hi = 128, 32, 2
    tokens = [700]
    pc = make_paged_cache(rng, tokens, page_size=P, max_pages=8, n_kv_heads=1, head_dim=Di, kv=1)
    n = 3
    q = rng.standard_normal((n + 2, Hi, Di))  # 2 padding rows
    offs = np.array([0, n])
    ids, scores, elig = oracle.msa_indexer_ragged_paged(q, offs, pc.kv_blocks, np.array([697]), pc.lut, 0,
                                                        topk=4, init_blocks=1, local_blocks=1,
                                                        return_scores=True)
    assert ids.shape == (Hi, n + 2, 4)
    assert (ids[:, n:] == -1).all()
    # positions 697..699 -> blocks 0..5 eligible (key 640 is in block 5)
    assert elig[:n, :6].all() and not elig[:n, 6:].any()
    for h in range(Hi):
        for t in range(n):
            row = list(ids[h, t])
            assert row == sorted(row) and 0 in row and 5 in row
            rest = [j for j in range(1, 5)]
            best = sorted(rest, key=lambda j: (-scores[h, t, j], j))[:2]
            assert sorted(row) == sorted([0, 5] + best)
            # brute-force score of block 2
            p = 697 + t
            k = np.arange(256, 384)
            K = pc.kv_blocks[pc.lut[0, 2], 0, 0, k % P, 0]
            np.testing.assert_allclose(scores[h, t, 2], (K @ q[t, h]).max() / math.sqrt(Di), rtol=1e-12)
            assert p >= 384
    # topk >= eligible: everything, -1 padded
    ids = oracle.msa_indexer_ragged_paged(q, offs, pc.kv_blocks, np.array([697]), pc.lut, 0, topk=8)
    assert (ids[:, :n, :6] == np.arange(6)).all() and (ids[:, :n, 6:] == -1).all()
    # a block whose only keys are after p is ineligible: position 128 sees block 1 only via key 128
    ids = oracle.msa_indexer_ragged_paged(q[:1], np.array([0, 1]), pc.kv_blocks, np.array([128]), pc.lut, 0,
                                          topk=3)
    assert (ids[:, 0] == [0, 1, -1]).all()
    with pytest.raises(ValueError):
        oracle.msa_indexer_ragged_paged(q, offs, pc.kv_blocks, np.array([697]), pc.lut, 0, topk=2,
                                        init_blocks=2, local_blocks=1)


def test_store_then_attend_equals_no_cache():
    rng = np.random.default_rng(11)
    batch = make_batch(rng, "mixed")
    Hkv, _H, D, P = 2, 4, 16, 16
    tokens = [c + n for c, n in zip(batch.cache, batch.n)]
    pc = make_paged_cache(rng, tokens, page_size=P, max_pages=32, n_kv_heads=Hkv, head_dim=D, dtype=BF16)
    k = rand(rng, (batch.T, Hkv, D), BF16)
    v = rand(rng, (batch.T, Hkv, D), BF16)
    new = oracle.kv_cache_store_ragged_paged(pc.kv_blocks, k, v, batch.offsets, batch.cache_lengths, pc.lut, 1)
    assert new.dtype == pc.kv_blocks.dtype
    np.testing.assert_array_equal(new[:, :, 0].view(np.uint16), pc.kv_blocks[:, :, 0].view(np.uint16))
    for b in range(batch.B):
        for i in range(batch.n[b]):
            pos = batch.cache[b] + i
            page = pc.lut[b, pos // P]
            np.testing.assert_array_equal(new[page, 0, 1, pos % P].view(np.uint16),
                                          k[batch.offsets[b] + i].view(np.uint16))
    # writes outside new tokens: none
    changed = np.any(new.view(np.uint16) != pc.kv_blocks.view(np.uint16), axis=(1, 2, 4, 5))  # [NB, P]
    assert changed.sum() == sum(batch.n)
    # layer out of range writes nothing
    same = oracle.kv_cache_store_ragged_paged(pc.kv_blocks, k, v, batch.offsets, batch.cache_lengths, pc.lut, 2)
    np.testing.assert_array_equal(same.view(np.uint16), pc.kv_blocks.view(np.uint16))
    # rows past the page table are dropped
    pc2 = make_paged_cache(rng, [32], page_size=P, max_pages=2, n_kv_heads=Hkv, head_dim=D, dtype=BF16)
    k2 = rand(rng, (5, Hkv, D), BF16)
    out2 = oracle.kv_cache_store_ragged_paged(pc2.kv_blocks, k2, k2, np.array([0, 5]), np.array([30]), pc2.lut,
                                              0)
    changed = np.any(out2.view(np.uint16) != pc2.kv_blocks.view(np.uint16), axis=(1, 2, 4, 5))
    assert changed.sum() == 2
