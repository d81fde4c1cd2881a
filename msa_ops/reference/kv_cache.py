"""Reference lowering of the KV-cache ops."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .common import as_i32, repair_offsets, row_owner


def kv_cache_store_ragged_paged(kv_blocks, k, v, input_row_offsets, cache_lengths, kv_lookup_table, layer_idx):
    nb, _, nl, page, _, _ = kv_blocks.shape
    t = k.shape[0]
    if t == 0 or input_row_offsets.shape[0] == 1:  # no row, or no sequence to own one: nothing is written
        return (kv_blocks,)
    lookup = as_i32(kv_lookup_table)
    mp = lookup.shape[1]
    eff = repair_offsets(input_row_offsets, t)
    b, i, valid = row_owner(eff, t)
    c = jnp.maximum(as_i32(cache_lengths), 0)
    pos = c[b] + i
    in_table = (pos >= 0) & (pos < mp * page)
    pg = lookup[b, jnp.clip(pos // page, 0, mp - 1)]
    layer = as_i32(layer_idx)
    ok = valid & in_table & (pg >= 0) & (pg < nb) & (layer >= 0) & (layer < nl)
    dst = jnp.where(ok, pg, nb)  # out of bounds -> dropped
    slot = jnp.where(ok, pos % page, 0)
    lay = jnp.clip(layer, 0, nl - 1)
    # The scatter moves the values' bits as unsigned ints of their width: XLA's float scatter on the CPU rewrites
    # bf16 NaN payloads (in the rows it writes and in the pool it copies), and the store is bit-exact.
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(kv_blocks.dtype).itemsize]
    as_bits = lambda x: lax.bitcast_convert_type(x.astype(kv_blocks.dtype), bits)  # noqa: E731
    out = as_bits(kv_blocks).at[dst, 0, lay, slot].set(as_bits(k), mode="drop")
    out = out.at[dst, 1, lay, slot].set(as_bits(v), mode="drop")
    return (lax.bitcast_convert_type(out, kv_blocks.dtype),)


def kv_cache_row_offsets_ragged_paged(input_row_offsets, cache_lengths):
    b = cache_lengths.shape[0]
    off = as_i32(input_row_offsets)
    # Sequence lengths come from the repaired offsets; the total row count is not an operand here, so the
    # repair clamps only below (running max from 0).
    eff = jnp.maximum(lax.cummax(off, axis=0), 0)
    n_b = eff[1:] - eff[:-1]
    per = jnp.maximum(as_i32(cache_lengths), 0) + n_b
    out = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])
    return (out[: b + 1],)

