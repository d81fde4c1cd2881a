"""Reference lowering of the dense ``mo.mha.*`` ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import as_i32, attend_row, map_rows, repair_offsets, row_owner, visible


def _paged_rows(
    q_rows: jax.Array,  # [R, H, D]
    b_rows: jax.Array,  # [R] sequence of each row
    pos_rows: jax.Array,  # [R] absolute query position
    nkeys_rows: jax.Array,  # [R] keys of the row's sequence
    valid_rows: jax.Array,  # [R]
    kv_blocks: jax.Array,
    lookup: jax.Array,
    layer_idx: jax.Array,
    *,
    mask: str,
    window: int,
    scale: float,
    sink: jax.Array | None,
    out_dtype,
) -> jax.Array:
    nb, _, nl, page, hkv, d = kv_blocks.shape
    mp = lookup.shape[1]
    s_max = mp * page
    layer = as_i32(layer_idx)
    layer_ok = (layer >= 0) & (layer < nl)
    layer_c = jnp.clip(layer, 0, nl - 1)
    kidx = jnp.arange(s_max, dtype=jnp.int32)

    def one(args):
        q_row, b, p, n, ok = args
        pages = lookup[b]  # [MP]
        page_ok = (pages >= 0) & (pages < nb) & layer_ok
        pc = jnp.clip(pages, 0, nb - 1)
        kv = kv_blocks[pc, :, layer_c]  # [MP, 2, P, Hkv, D]
        k = kv[:, 0].reshape(s_max, hkv, d).transpose(1, 0, 2)
        v = kv[:, 1].reshape(s_max, hkv, d).transpose(1, 0, 2)
        exists = (kidx < n) & page_ok[kidx // page]
        vis = exists & visible(mask, window, p, kidx) & ok
        return attend_row(q_row, k, v, vis[None, :], scale, sink).astype(out_dtype)

    rows = q_rows.shape[0]
    bytes_per_row = 2 * s_max * hkv * d * 4
    return map_rows(one, (q_rows, b_rows, pos_rows, nkeys_rows, valid_rows), bytes_per_row, rows)


def _workspace(np_w: int, rows: int, h: int, d: int):
    return (jnp.zeros((np_w, rows, h, d), jnp.float32), jnp.zeros((np_w, rows, h), jnp.float32))


def mha_ragged_paged(
    q, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, sink_weights=None, *,
    mask, window, scale, workspace_partitions,
):
    t, h, d = q.shape
    if t == 0 or input_row_offsets.shape[0] == 1:  # no rows, or no sequence: every row is a padding row
        return (jnp.zeros(q.shape, q.dtype),) + _workspace(workspace_partitions, t, h, d)
    lookup = as_i32(kv_lookup_table)
    s_max = lookup.shape[1] * kv_blocks.shape[3]
    eff = repair_offsets(input_row_offsets, t)
    b, i, valid = row_owner(eff, t)
    c = jnp.clip(as_i32(cache_lengths), 0, s_max)
    n_b = eff[1:] - eff[:-1]
    nkeys = (c + n_b)[b]
    pos = c[b] + i
    out = _paged_rows(
        q, b, pos, nkeys, valid, kv_blocks, lookup, layer_idx,
        mask=mask, window=window, scale=scale, sink=sink_weights, out_dtype=q.dtype,
    )
    return (out,) + _workspace(workspace_partitions, t, h, d)


def mha_padded_paged(
    q, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, valid_lengths, *,
    mask, window, scale, workspace_partitions,
):
    bsz, s, h, d = q.shape
    rows = bsz * s
    if rows == 0:
        return (jnp.zeros(q.shape, q.dtype),) + _workspace(workspace_partitions, rows, h, d)
    lookup = as_i32(kv_lookup_table)
    s_max = lookup.shape[1] * kv_blocks.shape[3]
    c = jnp.clip(as_i32(cache_lengths), 0, s_max)
    nq = jnp.clip(as_i32(valid_lengths), 0, s)
    r = jnp.arange(rows, dtype=jnp.int32)
    b, i = r // s, r % s  # row r is query i of batch entry b
    valid = i < nq[b]
    pos = c[b] + i
    nkeys = (c + nq)[b]
    out = _paged_rows(
        q.reshape(rows, h, d), b, pos, nkeys, valid, kv_blocks, lookup, layer_idx,
        mask=mask, window=window, scale=scale, sink=None, out_dtype=q.dtype,
    )
    return (out.reshape(q.shape),) + _workspace(workspace_partitions, rows, h, d)


def mha_ragged_no_cache(q, k, v, input_row_offsets, kv_input_row_offsets, *, mask, window, scale):
    t, h, _d = q.shape
    tk, _hkv, _ = k.shape
    if t == 0 or tk == 0 or input_row_offsets.shape[0] == 1:  # no row, no key or no sequence: zeros
        return (jnp.zeros(q.shape, q.dtype),)
    eff_q = repair_offsets(input_row_offsets, t)
    eff_k = repair_offsets(kv_input_row_offsets, tk)
    b, i, valid = row_owner(eff_q, t)
    n_q = (eff_q[1:] - eff_q[:-1])[b]
    k_lo = eff_k[:-1][b]
    n_k = (eff_k[1:] - eff_k[:-1])[b]
    pos = n_k - n_q + i
    kt = k.transpose(1, 0, 2)
    vt = v.transpose(1, 0, 2)
    j = jnp.arange(tk, dtype=jnp.int32)

    def one(args):
        q_row, p, lo, nk, ok = args
        kk = j - lo  # key index within the sequence
        vis = (kk >= 0) & (kk < nk) & visible(mask, window, p, kk) & ok
        return attend_row(q_row, kt, vt, vis[None, :], scale, None).astype(q.dtype)

    out = map_rows(one, (q, pos, k_lo, n_k, valid), 4 * h * tk * 2, t)
    return (out,)


def mha_padded_no_cache(q, k, v, valid_length, *, mask, window, scale):
    bsz, s, h, d = q.shape
    sk = k.shape[1]
    rows = bsz * s
    if rows == 0 or sk == 0:  # no row or no key: zeros
        return (jnp.zeros(q.shape, q.dtype),)
    vl = as_i32(valid_length)
    n_q = jnp.clip(vl, 0, s)
    n_k = jnp.clip(vl, 0, sk)
    r = jnp.arange(rows, dtype=jnp.int32)
    b, i = r // s, r % s  # row r is query i of batch entry b
    valid = i < n_q[b]
    pos = n_k[b] - n_q[b] + i
    kidx = jnp.arange(sk, dtype=jnp.int32)

    def one(args):
        q_row, bb, p, ok = args
        kb = k[bb].transpose(1, 0, 2)
        vb = v[bb].transpose(1, 0, 2)
        vis = (kidx < n_k[bb]) & visible(mask, window, p, kidx) & ok
        return attend_row(q_row, kb, vb, vis[None, :], scale, None).astype(q.dtype)

    out = map_rows(one, (q.reshape(rows, h, d), b, pos, valid), 2 * sk * k.shape[2] * k.shape[3] * 4, rows)
    return (out.reshape(q.shape),)


def get_num_partitions(batch, max_cache_valid_length, *, n_kv_heads: int, sm_count: int):
    bt = as_i32(batch)
    ln = as_i32(max_cache_valid_length)
    # clamp(sm_count // (batch * n_kv_heads), 1, 32) without forming the product, which int32 would wrap: for
    # batch >= 1 the quotient is at least k exactly where batch <= (sm_count // n_kv_heads) // k, so counting those
    # k in 1..32 gives the clamped quotient. A batch <= 0 divides by 1 (the max(1, ...) of SEMANTICS.md).
    per_head = sm_count // n_kv_heads
    bounds = jnp.array([min(per_head // k, 2**31 - 1) for k in range(1, 33)], jnp.int32)
    by_sm = jnp.where(bt >= 1, jnp.maximum(1, jnp.sum(bt <= bounds, dtype=jnp.int32)), min(sm_count, 32))
    by_len = jnp.maximum(1, ln // 512)
    return (jnp.minimum(by_sm, by_len).astype(jnp.int32),)
