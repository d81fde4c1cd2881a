"""Reference lowering of MiniMax Sparse Attention and its indexer."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .common import as_i32, attend_row, map_rows, repair_offsets, row_owner

BLOCK = 128


def _rows(t, input_row_offsets, cache_lengths, s_max):
    eff = repair_offsets(input_row_offsets, t)
    b, i, valid = row_owner(eff, t)
    c = jnp.clip(as_i32(cache_lengths), 0, s_max)
    n_b = eff[1:] - eff[:-1]
    return b, c[b] + i, (c + n_b)[b], valid


def msa_attention_ragged_paged(
    q, input_row_offsets, cache_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, d_indices,
    *, scale, workspace_partitions,
):
    del cache_row_offsets  # accepted for MAX compatibility; derivable, so never read
    t, h, d = q.shape
    nb, _, nl, page, hkv, _ = kv_blocks.shape
    topk = d_indices.shape[2]
    ws = (
        jnp.zeros((workspace_partitions, t, h, d), jnp.float32),
        jnp.zeros((workspace_partitions, t, h), jnp.float32),
    )
    if t == 0 or topk == 0 or input_row_offsets.shape[0] == 1:  # no row, no slot or no sequence: zeros
        return (jnp.zeros((t, h, d), jnp.bfloat16),) + ws
    lookup = as_i32(kv_lookup_table)
    mp = lookup.shape[1]
    b, pos, nkeys, valid = _rows(t, input_row_offsets, cache_lengths, mp * page)
    layer = as_i32(layer_idx)
    layer_ok = (layer >= 0) & (layer < nl)
    layer_c = jnp.clip(layer, 0, nl - 1)
    ids_all = as_i32(d_indices).transpose(1, 0, 2)  # [T, Hkv, topk]
    heads = jnp.arange(hkv, dtype=jnp.int32)[:, None]
    slot = jnp.arange(topk)
    earlier = slot[None, :] < slot[:, None]  # earlier[i, j]: j comes before i
    offs = jnp.arange(BLOCK, dtype=jnp.int32)

    def one(args):
        q_row, ids, bb, p, n, ok = args
        id_ok = (ids >= 0) & (ids < mp) & (ids * BLOCK < n)
        same = ids[:, :, None] == ids[:, None, :]  # [Hkv, topk(i), topk(j)]
        dup = jnp.any(same & earlier[None] & id_ok[:, None, :], axis=-1)
        idc = jnp.clip(ids, 0, mp - 1)
        pages = lookup[bb][idc]  # [Hkv, topk]
        page_ok = (pages >= 0) & (pages < nb) & layer_ok
        pc = jnp.clip(pages, 0, nb - 1)
        kv = kv_blocks[pc, :, layer_c, :, heads, :]  # [Hkv, topk, 2, P, D]
        k = kv[:, :, 0].reshape(hkv, topk * BLOCK, d)
        v = kv[:, :, 1].reshape(hkv, topk * BLOCK, d)
        kpos = ids[:, :, None] * BLOCK + offs  # [Hkv, topk, P]
        slot_ok = (id_ok & ~dup & page_ok)[:, :, None]
        vis = slot_ok & (kpos < n) & (kpos <= p) & ok
        return attend_row(q_row, k, v, vis.reshape(hkv, topk * BLOCK), scale, None).astype(jnp.bfloat16)

    bytes_per_row = 2 * hkv * topk * BLOCK * d * 4
    out = map_rows(one, (q, ids_all, b, pos, nkeys, valid), bytes_per_row, t)
    return (out,) + ws


def msa_indexer_ragged_paged(
    q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table, layer_idx,
    *, topk, init_blocks, local_blocks, scale,
):
    t, hi, di = q.shape
    nb, _, nl, page, _, _ = k_blocks.shape
    if t == 0 or topk == 0 or input_row_offsets.shape[0] == 1:  # no row, no slot or no sequence: all -1
        return (jnp.full((hi, t, topk), -1, jnp.int32),)
    lookup = as_i32(k_lookup_table)
    mp = lookup.shape[1]
    b, pos, nkeys, valid = _rows(t, input_row_offsets, k_cache_lengths, mp * page)
    layer = as_i32(layer_idx)
    layer_ok = (layer >= 0) & (layer < nl)
    layer_c = jnp.clip(layer, 0, nl - 1)
    kidx = jnp.arange(mp * page, dtype=jnp.int32).reshape(mp, page)
    blk = jnp.arange(mp, dtype=jnp.int32)
    n_pick = topk - init_blocks - local_blocks
    prec = lax.Precision.HIGHEST

    def one(args):
        q_row, bb, p, n, ok = args
        pages = lookup[bb]
        page_ok = (pages >= 0) & (pages < nb) & layer_ok
        pc = jnp.clip(pages, 0, nb - 1)
        keys = k_blocks[pc, 0, layer_c, :, 0, :].astype(jnp.float32)  # [MP, P, Di]
        qs = q_row.astype(jnp.float32) * jnp.float32(scale)  # scaled first, as in the native handler
        s = jnp.einsum("hd,mpd->hmp", qs, keys, precision=prec)
        vis = page_ok[:, None] & (kidx < n) & (kidx <= p) & ok  # [MP, P]
        # (A NaN dot product is skipped, as the native handlers' max skips it.)
        score = jnp.max(jnp.where(vis[None] & ~jnp.isnan(s), s, -jnp.inf), axis=-1)  # [Hi, MP]
        elig = jnp.any(vis, axis=-1)  # [MP]
        e_cnt = jnp.sum(elig.astype(jnp.int32))
        rank = jnp.cumsum(elig.astype(jnp.int32)) - 1
        forced = elig & ((rank < init_blocks) | (rank >= e_cnt - local_blocks))
        # The other eligible blocks ranked by score as int32 keys in the floats' order, -0 as +0 (equal scores tie:
        # the lower id first) and every eligible block above every other, even one whose score overflowed to -inf.
        others = jnp.broadcast_to((elig & ~forced)[None], score.shape)  # [Hi, MP]
        bits = lax.bitcast_convert_type(jnp.where(score == 0, jnp.float32(0), score), jnp.int32)
        okey = jnp.where(others, jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF)), jnp.iinfo(jnp.int32).min)
        if n_pick > 0:
            k_eff = min(n_pick, mp)
            _, top_i = lax.top_k(okey, k_eff)  # ties: lower index first
            top_ok = jnp.take_along_axis(others, top_i, axis=-1)
            picked = jnp.zeros((hi, mp), bool).at[jnp.arange(hi)[:, None], top_i].max(top_ok)
        else:
            picked = jnp.zeros((hi, mp), bool)
        chosen = jnp.where(e_cnt <= topk, elig[None], forced[None] | picked)  # [Hi, MP]
        key = jnp.where(chosen, blk[None], mp + blk[None])
        srt = jnp.sort(key, axis=-1)
        ids = jnp.where(srt < mp, srt, -1)
        if mp >= topk:
            ids = ids[:, :topk]
        else:
            ids = jnp.concatenate([ids, jnp.full((hi, topk - mp), -1, jnp.int32)], axis=-1)
        return ids.astype(jnp.int32)

    out = map_rows(one, (q, b, pos, nkeys, valid), mp * page * di * 4 * (hi + 1), t)  # [T, Hi, topk]
    return (out.transpose(1, 0, 2),)
