"""vmap by folding: the mapped axis of independent calls becomes more sequences of one call.

The attention and cache ops are already batched over sequences, so a vmapped call needs no loop: element ``n``'s
sequences become sequences of one larger call, its rows sit where a reshape of the mapped axis puts them, its page
table points into its own part of a mapped pool, and the outputs are reshaped back. One kernel launch serves the
whole mapped axis instead of one launch per element in a ``lax.map``. Mapped operands are reshaped, not gathered
(one mapped on another axis than the one the fold needs is moved there); an unmapped operand of per-row or
per-sequence data (q, k, v, d_indices, offsets, cache lengths, page tables) is broadcast, i.e. copied N times,
while an unmapped pool is shared.

Bad values mean the same folded as alone (docs/SEMANTICS.md): each element's offsets are clamped to its own rows,
the rows an element does not own belong to gap sequences that have no keys (padding rows: output 0, indexer -1,
not stored), and a page id outside an element's pool stays outside the folded pool. Routing sees the tokens per
sequence of one element (the ``max_prompt_length`` hint is set to that estimate); the split-K partition count may
differ, since the folded batch is larger.

Folding needs the per-call operands that do not name sequences (``layer_idx``, ``sink_weights``) unmapped, and for
the KV store the pool mapped (a shared pool written by every element would make one pool, where vmap means one
pool per element). Calls that do not fold, and operands that carry an explicit sharding, take the ``lax.map`` rule
of ``registry.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from .reference.common import as_i32
from .routing import estimate_max_q
from .sharding import explicit_spec

I32_MAX = 2**31 - 1

Bind = Callable[..., Sequence[Any]]  # bind(*operands, attrs=...) -> the primitive's outputs
Folded = tuple[list[Any], list[int]] | None


def _lead(x, d, n: int):
    """``x`` with the mapped axis first (broadcast when unmapped)."""
    if d is None:
        return jnp.broadcast_to(x, (n,) + tuple(x.shape))
    return jnp.moveaxis(x, d, 0)


def _merge(x, axis: int):
    """[N, ..., T (at axis + 1), ...] -> [..., N * T (at axis), ...]: the element axis placed before ``axis`` and
    merged with it."""
    x = jnp.moveaxis(x, 0, axis)
    s = tuple(x.shape)
    return x.reshape(s[:axis] + (s[axis] * s[axis + 1],) + s[axis + 2:])


def _split(y, axis: int, n: int):
    """[..., N * T (at axis), ...] -> [..., N, T, ...] (the element axis at ``axis``)."""
    s = tuple(y.shape)
    return y.reshape(s[:axis] + (n, s[axis] // n) + s[axis + 1:])


class _Rows:
    """The folded call's sequences: element ``n``'s rows stay where a reshape puts them (``n * t + r``), its ``B``
    sequences keep their offsets shifted by ``n * t``, and a gap sequence with no keys (its cache length 0, its
    page-table row -1) owns the rows between one element's last owned row and the next one's first: rows outside
    ``[eff_n[0], eff_n[B])``, padding rows of the element alone. The folded call has ``N * (B + 1) + 1``
    sequences: gap, element 0's, gap, ..., element N-1's, gap.

    The offsets are only clamped to ``[0, t]`` per element: the op's own running max (docs/SEMANTICS.md §1) then
    repairs each element's as it would alone, since every entry of element ``n`` is at least ``n * t`` and every
    entry before it at most that."""

    def __init__(self, offsets, t: int, n: int):
        o = jnp.clip(as_i32(offsets), 0, t)  # [N, B+1]
        self.n, self.t, self.b = n, t, o.shape[1] - 1
        shifted = o + (jnp.arange(n, dtype=jnp.int32) * t)[:, None]
        self.offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), shifted.reshape(-1),
                                        jnp.full((1,), n * t, jnp.int32)])
        self._start, self._end = o[:, 0], jnp.max(o, axis=1)

    def per_sequence(self, x, fill):
        """A per-sequence operand ([N, B, ...]) of the folded call: each gap's entry is ``fill``."""
        pad = [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2)
        body = jnp.pad(x, pad, constant_values=fill).reshape((-1,) + tuple(x.shape[2:]))
        return jnp.concatenate([jnp.full((1,) + tuple(x.shape[2:]), fill, x.dtype), body])

    def owned(self, y, axis: int, fill):
        """A folded output split back per element ([..., N, T, ...] at ``axis``), with ``fill`` on rows an element
        does not own (for ops whose gap sequences would otherwise attend: no-cache attention)."""
        g = _split(y, axis, self.n)
        r = jnp.arange(self.t, dtype=jnp.int32)[None, :]
        mask = (r >= self._start[:, None]) & (r < self._end[:, None])
        shape = [1] * g.ndim
        shape[axis], shape[axis + 1] = self.n, self.t
        return jnp.where(mask.reshape(shape), g, jnp.asarray(fill, g.dtype))


def _pool(kv, d, table_b, n: int):
    """The pool of the folded call and each element's page table ([N, B, MP], int32): a mapped pool is laid element
    after element, and each element's page ids shifted into its part (ids outside its pool become -1, outside
    every part); an unmapped pool is shared as it is."""
    ids = as_i32(table_b)
    if d is None:
        return kv, ids
    kvb = jnp.moveaxis(kv, d, 0)
    nb = kvb.shape[1]
    if n * nb > I32_MAX:
        return None
    shift = (jnp.arange(n, dtype=jnp.int32) * nb)[:, None, None]
    table = jnp.where((ids >= 0) & (ids < nb), ids + shift, -1)
    return kvb.reshape((n * nb,) + tuple(kvb.shape[2:])), table


def _foldable(args, dims, shared: Sequence[int]) -> int | None:
    """The mapped size, or None where this call takes the loop: an operand that must be shared is mapped, an
    operand carries an explicit sharding, or nothing is mapped past size 0. (Each fold checks its own sizes
    against int32.)"""
    if any(dims[i] is not None for i in shared):
        return None
    for a in args:
        spec = explicit_spec(a)
        if spec is not None and any(e is not None for e in spec):
            return None
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    return n if n >= 1 else None


def _with_prompt_hint(attrs, t: int, b: int, hint: int | None = None):
    """The attrs with ``max_prompt_length`` set to what routing estimates for one element of ``t`` rows and ``b``
    sequences (from ``hint``, else the call's own hint)."""
    from .registry import Attrs

    items = dict(attrs.items)
    items["max_prompt_length"] = estimate_max_q(t, b, items.get("max_prompt_length") if hint is None else hint)
    return Attrs.of(items)


# ---------------------------------------------------------------------------------------------------------
# the ragged paged family: mo.mha.ragged.paged(.sink_weights), mo.msa.attention / indexer, the KV store


def _ragged_paged(args, dims, shared: Sequence[int], rows_at: int, offs_at: int, pool_at: int, cl_at: int):
    """(mapped size, rows, pool, cache lengths, page table) of a folded ragged paged call, or None (the loop)."""
    n = _foldable(args, dims, shared)
    if n is None:
        return None
    rows_op, offs, cl, lut = (_lead(args[i], dims[i], n) for i in (rows_at, offs_at, cl_at, cl_at + 1))
    t, b = rows_op.shape[1], offs.shape[1] - 1
    if t == 0 or n * t > I32_MAX or n * (b + 1) + 1 > I32_MAX:
        return None
    pooled = _pool(args[pool_at], dims[pool_at], lut, n)
    if pooled is None or n * t + lut.shape[2] * pooled[0].shape[3] > I32_MAX:  # the CUDA handlers' int32 positions
        return None
    rows = _Rows(offs, t, n)
    return n, rows, pooled[0], rows.per_sequence(cl, 0), rows.per_sequence(pooled[1], -1)


def _attention_outs(out, ws_o, ws_lse, n: int) -> Folded:
    """An attention call's folded outputs split back: the output by its rows (axis 0), the split-K workspaces
    (scratch) along theirs (axis 1)."""
    return [_split(out, 0, n), _split(ws_o, 1, n), _split(ws_lse, 1, n)], [0, 1, 1]


def fold_mha_ragged_paged(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx[, sink_weights]
    folded = _ragged_paged(args, dims, range(5, len(args)), rows_at=0, offs_at=1, pool_at=2, cl_at=3)
    if folded is None:
        return None
    n, rows, kv, cl, lut = folded
    q = _lead(args[0], dims[0], n)
    out, ws_o, ws_lse = bind(_merge(q, 0), rows.offsets, kv, cl, lut, *args[5:],
                             attrs=_with_prompt_hint(attrs, rows.t, rows.b))
    return _attention_outs(out, ws_o, ws_lse, n)


def fold_msa_attention(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, cache_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, d_indices
    folded = _ragged_paged(args, dims, (6,), rows_at=0, offs_at=1, pool_at=3, cl_at=4)
    if folded is None:
        return None
    n, rows, kv, cl, lut = folded
    q, idx = _lead(args[0], dims[0], n), _lead(args[7], dims[7], n)
    # cache_row_offsets' values are not read (docs/SEMANTICS.md §7): the folded offsets fill its slot
    out, ws_o, ws_lse = bind(_merge(q, 0), rows.offsets, rows.offsets, kv, cl, lut, args[6], _merge(idx, 1),
                             attrs=_with_prompt_hint(attrs, rows.t, rows.b))
    return _attention_outs(out, ws_o, ws_lse, n)


def fold_msa_indexer(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table, layer_idx
    folded = _ragged_paged(args, dims, (5,), rows_at=0, offs_at=1, pool_at=2, cl_at=3)
    if folded is None:
        return None
    n, rows, kb, cl, lut = folded
    (out,) = bind(_merge(_lead(args[0], dims[0], n), 0), rows.offsets, kb, cl, lut, args[5], attrs=attrs)
    return [_split(out, 1, n)], [1]


def fold_kv_cache_store(args, dims, *, attrs, bind: Bind) -> Folded:
    # kv_blocks, k, v, input_row_offsets, cache_lengths, kv_lookup_table, layer_idx
    if dims[0] is None:  # one shared pool, one updated pool per element: the loop
        return None
    folded = _ragged_paged(args, dims, (6,), rows_at=1, offs_at=3, pool_at=0, cl_at=4)
    if folded is None:
        return None
    n, rows, kv, cl, lut = folded
    k, v = (_merge(_lead(args[i], dims[i], n), 0) for i in (1, 2))
    (pool,) = bind(kv, k, v, rows.offsets, cl, lut, args[6], attrs=attrs)
    return [_split(pool, 0, n)], [0]


# ---------------------------------------------------------------------------------------------------------
# the padded ops and ragged no-cache attention


def fold_mha_padded_paged(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[B,S,H,D], kv_blocks, cache_lengths, kv_lookup_table, layer_idx, valid_lengths
    n = _foldable(args, dims, shared=(4,))
    if n is None:
        return None
    q, cl, lut, valid = (_lead(args[i], dims[i], n) for i in (0, 2, 3, 5))
    b, s = q.shape[1], q.shape[2]
    if b == 0 or n * b * s > I32_MAX:
        return None
    pooled = _pool(args[1], dims[1], lut, n)
    if pooled is None:
        return None
    hint = attrs.max_prompt_length
    attrs = _with_prompt_hint(attrs, b * s, b, s if hint is None else hint)  # one element's estimate
    out, ws_o, ws_lse = bind(_merge(q, 0), pooled[0], cl.reshape(n * b), pooled[1].reshape(n * b, -1), args[4],
                             valid.reshape(n * b), attrs=attrs)
    return _attention_outs(out, ws_o, ws_lse, n)


def fold_mha_padded_no_cache(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[B,S,H,D], k[B,Sk,Hkv,D], v, valid_length[B]
    n = _foldable(args, dims, shared=())
    if n is None:
        return None
    q, k, v, valid = (_lead(a, d, n) for a, d in zip(args, dims))
    if q.shape[1] == 0 or n * q.shape[1] * max(q.shape[2], k.shape[2]) > I32_MAX:
        return None
    (out,) = bind(_merge(q, 0), _merge(k, 0), _merge(v, 0), valid.reshape(-1), attrs=attrs)
    return [_split(out, 0, n)], [0]


def fold_mha_ragged_no_cache(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[T,H,D], k[Tk,Hkv,D], v, input_row_offsets, kv_input_row_offsets
    n = _foldable(args, dims, shared=())
    if n is None:
        return None
    q, k, v, offs, kv_offs = (_lead(a, d, n) for a, d in zip(args, dims))
    t, tk = q.shape[1], k.shape[1]
    if t == 0 or n * max(t, tk) > I32_MAX or n * offs.shape[1] + 1 > I32_MAX:
        return None
    # the gap sequences here have keys (the key rows between two elements' own): their rows are masked after
    rows, keys = _Rows(offs, t, n), _Rows(kv_offs, tk, n)
    (out,) = bind(_merge(q, 0), _merge(k, 0), _merge(v, 0), rows.offsets, keys.offsets, attrs=attrs)
    return [rows.owned(out, 0, 0)], [0]


FOLDS: dict[str, Callable[..., Folded]] = {
    "mo.mha.ragged.paged": fold_mha_ragged_paged,
    "mo.mha.ragged.paged.sink_weights": fold_mha_ragged_paged,
    "mo.mha.padded.paged": fold_mha_padded_paged,
    "mo.mha.ragged.no_cache": fold_mha_ragged_no_cache,
    "mo.mha.padded.no_cache": fold_mha_padded_no_cache,
    "mo.msa.attention.ragged.paged": fold_msa_attention,
    "mo.msa.indexer.ragged.paged": fold_msa_indexer,
    "mo.kv_cache.store.ragged.paged": fold_kv_cache_store,
}
