"""vmap by folding: the mapped axis of independent calls becomes more sequences of one call.

The attention and cache ops are already batched over sequences, so a vmapped call needs no loop: element ``n``'s
sequences become sequences of one larger call, its query (and key) rows are laid one element after another, its
page table points into its own part of a batched pool, and the outputs are laid back. One kernel launch serves
the whole mapped axis instead of one launch per element in a ``lax.map``.

Each element's offsets are first repaired as every implementation repairs them (``docs/SEMANTICS.md`` §1), so
that bad offsets mean the same thing folded as alone; rows an element does not own stay padding rows (output 0,
indexer -1, not stored). A page id outside an element's pool stays outside the folded pool. Routing sees the
same tokens per sequence as one element would (the ``max_prompt_length`` hint is set to that estimate); the
partition count may differ, since the folded batch is larger.

Folding needs the per-call scalars and vectors that do not name sequences (``layer_idx``, ``sink_weights``)
unmapped; for the KV store, the pool mapped (a shared pool written by every element would make one pool, where
vmap means one pool per element). Calls that do not fold, and operands that carry an explicit sharding, take the
``lax.map`` rule of ``registry.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

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
    """Where each element's owned rows go in the folded call, and back.

    Element ``n`` owns rows ``[eff_n[0], eff_n[B])`` of its ``t`` (``eff`` the repaired offsets); they are laid
    one element after another from folded row 0, in order, and the folded rows past them are padding."""

    def __init__(self, offsets, t: int, n: int):
        eff = jnp.clip(lax.cummax(as_i32(offsets), axis=1), 0, t)  # [N, B+1]
        start, end = eff[:, 0], eff[:, -1]
        cnt = end - start
        incl = jnp.cumsum(cnt)
        base = incl - cnt
        total = incl[-1]
        self.n, self.t = n, t
        self.offsets = jnp.concatenate(
            [(base[:, None] + eff[:, :-1] - start[:, None]).reshape(-1), total[None]]).astype(jnp.int32)
        f = jnp.arange(n * t, dtype=jnp.int32)
        e = jnp.minimum(jnp.searchsorted(incl, f, side="right"), n - 1).astype(jnp.int32)
        self.src = jnp.where(f < total, e * t + f - base[e] + start[e], f)  # folded row -> (element, row)
        r = jnp.arange(t, dtype=jnp.int32)[None, :]
        self.owned = (r >= start[:, None]) & (r < end[:, None])  # [N, T]
        self.dst = jnp.where(self.owned, base[:, None] + r - start[:, None], 0).reshape(-1)  # (element, row) -> folded

    def gather(self, xb, axis: int):
        """An operand's rows ([N, ...] with its row axis at ``axis + 1``) in the folded order."""
        return jnp.take(_merge(xb, axis), self.src, axis=axis, mode="clip")

    def back(self, y, axis: int, fill) -> tuple[Any, int]:
        """A folded output's rows (at ``axis``) back to each element's; rows it does not own get ``fill``. Returns
        the array, element axis at ``axis``."""
        g = _split(jnp.take(y, self.dst, axis=axis, mode="clip"), axis, self.n)
        shape = [1] * g.ndim
        shape[axis], shape[axis + 1] = self.n, self.t
        return jnp.where(self.owned.reshape(shape), g, jnp.asarray(fill, g.dtype)), axis


def _pool(kv, d, table_b, n: int):
    """The pool and page table of the folded call: a mapped pool is laid element after element, and each
    element's page ids shifted into its part (ids outside its pool become -1, outside every part)."""
    b, mp = table_b.shape[1], table_b.shape[2]
    if d is None:
        return kv, table_b.reshape(n * b, mp)
    kvb = jnp.moveaxis(kv, d, 0)
    nb = kvb.shape[1]
    if n * nb > I32_MAX:
        return None
    ids = as_i32(table_b)
    shift = (jnp.arange(n, dtype=jnp.int32) * nb)[:, None, None]
    table = jnp.where((ids >= 0) & (ids < nb), ids + shift, -1).reshape(n * b, mp)
    return kvb.reshape((n * nb,) + tuple(kvb.shape[2:])), table


def _foldable(args, dims, shared: Sequence[int]) -> int | None:
    """The mapped size, or None where this call takes the loop: an operand that must be shared is mapped, an
    operand carries an explicit sharding, or a size the folded int32 row and page ids cannot hold."""
    if any(dims[i] is not None for i in shared):
        return None
    for a in args:
        spec = explicit_spec(a)
        if spec is not None and any(e is not None for e in spec):
            return None
    n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    return n if n >= 1 else None


def _with_prompt_hint(attrs, t: int, b: int):
    """The attrs with ``max_prompt_length`` set to what routing estimates for one element."""
    from .registry import Attrs

    items = dict(attrs.items)
    items["max_prompt_length"] = estimate_max_q(t, b, items.get("max_prompt_length"))
    return Attrs.of(items)


def _ws_back(y, n: int) -> tuple[Any, int]:
    """A split-K workspace [NPW, N * rows, ...]: scratch, split along its rows only."""
    return _split(y, 1, n), 1


# ---------------------------------------------------------------------------------------------------------
# the ragged paged family: mo.mha.ragged.paged(.sink_weights), mo.msa.attention / indexer, the KV store


def fold_mha_ragged_paged(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx[, sink_weights]
    n = _foldable(args, dims, shared=range(5, len(args)))
    if n is None:
        return None
    q, offs, cl, lut = (_lead(args[i], dims[i], n) for i in (0, 1, 3, 4))
    t, b = q.shape[1], offs.shape[1] - 1
    if t == 0 or b == 0 or n * t > I32_MAX:
        return None
    pooled = _pool(args[2], dims[2], lut, n)
    if pooled is None:
        return None
    rows = _Rows(offs, t, n)
    out, ws_o, ws_lse = bind(rows.gather(q, 0), rows.offsets, pooled[0], cl.reshape(n * b), pooled[1],
                             *args[5:], attrs=_with_prompt_hint(attrs, t, b))
    outs = [rows.back(out, 0, 0), _ws_back(ws_o, n), _ws_back(ws_lse, n)]
    return [o for o, _ in outs], [d for _, d in outs]


def fold_msa_attention(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, cache_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, d_indices
    n = _foldable(args, dims, shared=(6,))
    if n is None:
        return None
    q, offs, cl, lut, idx = (_lead(args[i], dims[i], n) for i in (0, 1, 4, 5, 7))
    t, b = q.shape[1], offs.shape[1] - 1
    if t == 0 or b == 0 or n * t > I32_MAX:
        return None
    pooled = _pool(args[3], dims[3], lut, n)
    if pooled is None:
        return None
    rows = _Rows(offs, t, n)
    # cache_row_offsets' values are not read (docs/SEMANTICS.md §7): the folded offsets fill its slot
    out, ws_o, ws_lse = bind(rows.gather(q, 0), rows.offsets, rows.offsets, pooled[0], cl.reshape(n * b),
                             pooled[1], args[6], rows.gather(idx, 1), attrs=_with_prompt_hint(attrs, t, b))
    outs = [rows.back(out, 0, 0), _ws_back(ws_o, n), _ws_back(ws_lse, n)]
    return [o for o, _ in outs], [d for _, d in outs]


def fold_msa_indexer(args, dims, *, attrs, bind: Bind) -> Folded:
    # q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table, layer_idx
    n = _foldable(args, dims, shared=(5,))
    if n is None:
        return None
    q, offs, cl, lut = (_lead(args[i], dims[i], n) for i in (0, 1, 3, 4))
    t, b = q.shape[1], offs.shape[1] - 1
    if t == 0 or b == 0 or n * t > I32_MAX:
        return None
    pooled = _pool(args[2], dims[2], lut, n)
    if pooled is None:
        return None
    rows = _Rows(offs, t, n)
    (out,) = bind(rows.gather(q, 0), rows.offsets, pooled[0], cl.reshape(n * b), pooled[1], args[5], attrs=attrs)
    o, d = rows.back(out, 1, -1)
    return [o], [d]


def fold_kv_cache_store(args, dims, *, attrs, bind: Bind) -> Folded:
    # kv_blocks, k, v, input_row_offsets, cache_lengths, kv_lookup_table, layer_idx
    if dims[0] is None:  # one shared pool, one updated pool per element: the loop
        return None
    n = _foldable(args, dims, shared=(6,))
    if n is None:
        return None
    k, v, offs, cl, lut = (_lead(args[i], dims[i], n) for i in (1, 2, 3, 4, 5))
    t, b = k.shape[1], offs.shape[1] - 1
    if t == 0 or b == 0 or n * t > I32_MAX:
        return None
    pooled = _pool(args[0], dims[0], lut, n)
    if pooled is None:
        return None
    rows = _Rows(offs, t, n)
    (pool,) = bind(pooled[0], rows.gather(k, 0), rows.gather(v, 0), rows.offsets, cl.reshape(n * b), pooled[1],
                   args[6], attrs=attrs)
    return [pool.reshape((n, pool.shape[0] // n) + tuple(pool.shape[1:]))], [0]


# ---------------------------------------------------------------------------------------------------------
# the padded ops and ragged no-cache attention


def fold_mha_padded_paged(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[B,S,H,D], kv_blocks, cache_lengths, kv_lookup_table, layer_idx, valid_lengths
    n = _foldable(args, dims, shared=(4,))
    if n is None:
        return None
    q, cl, lut, valid = (_lead(args[i], dims[i], n) for i in (0, 2, 3, 5))
    b = q.shape[1]
    if b == 0:
        return None
    pooled = _pool(args[1], dims[1], lut, n)
    if pooled is None:
        return None
    out, ws_o, ws_lse = bind(_merge(q, 0), pooled[0], cl.reshape(n * b), pooled[1], args[4],
                             valid.reshape(n * b), attrs=attrs)
    return [_split(out, 0, n), _split(ws_o, 1, n), _split(ws_lse, 1, n)], [0, 1, 1]


def fold_mha_padded_no_cache(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[B,S,H,D], k[B,Sk,Hkv,D], v, valid_length[B]
    n = _foldable(args, dims, shared=())
    if n is None:
        return None
    q, k, v, valid = (_lead(a, d, n) for a, d in zip(args, dims))
    if q.shape[1] == 0:
        return None
    (out,) = bind(_merge(q, 0), _merge(k, 0), _merge(v, 0), valid.reshape(-1), attrs=attrs)
    return [_split(out, 0, n)], [0]


def fold_mha_ragged_no_cache(args, dims, *, attrs, bind: Bind) -> Folded:
    # q[T,H,D], k[Tk,Hkv,D], v, input_row_offsets, kv_input_row_offsets
    n = _foldable(args, dims, shared=())
    if n is None:
        return None
    q, k, v, offs, kv_offs = (_lead(a, d, n) for a, d in zip(args, dims))
    t, tk, b = q.shape[1], k.shape[1], offs.shape[1] - 1
    if t == 0 or b == 0 or n * max(t, tk) > I32_MAX:
        return None
    rows, keys = _Rows(offs, t, n), _Rows(kv_offs, tk, n)
    (out,) = bind(rows.gather(q, 0), keys.gather(k, 0), keys.gather(v, 0), rows.offsets, keys.offsets,
                  attrs=attrs)
    o, d = rows.back(out, 0, 0)
    return [o], [d]


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
