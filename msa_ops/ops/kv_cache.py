"""KV-cache ops: ``mo.kv_cache.store.ragged.paged`` and ``mo.kv_cache.row_offsets.ragged.paged``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from ..reference import kv_cache as ref
from ..reference.common import as_i32
from ..registry import OpDef, register
from .common import FLOATS, FP8, Check

_ST = "mo.kv_cache.store.ragged.paged"
_RO = "mo.kv_cache.row_offsets.ragged.paged"
STORE_DTYPES = FLOATS + (FP8,)


def _store_abstract(kv, k, v, offsets, cache_lengths, lookup, layer_idx, *, attrs):
    c = Check(_ST)
    c.rank("kv_blocks", kv, 6, "[num_blocks, 2, num_layers, page_size, n_kv_heads, head_dim]")
    c.dim("kv_blocks", kv, 1, 2, "2 (K and V)")
    c.dtype("kv_blocks", kv, STORE_DTYPES)
    for axis, what in ((0, "num_blocks"), (2, "num_layers"), (3, "page_size"), (4, "n_kv_heads"), (5, "head_dim")):
        c.nonempty("kv_blocks", kv, axis, what)
    c.rank("k", k, 3, "[T, Hkv, D]")
    c.rank("v", v, 3, "[T, Hkv, D]")
    c.same_dtype("k", k, "kv_blocks", kv)
    c.same_dtype("v", v, "kv_blocks", kv)
    c.dim("k", k, 1, kv.shape[4], "n_kv_heads of 'kv_blocks'")
    c.dim("k", k, 2, kv.shape[5], "head_dim of 'kv_blocks'")
    for axis in range(3):
        c.dim("v", v, axis, k.shape[axis], "the same as 'k'")
    b = c.offsets("input_row_offsets", offsets)
    c.per_sequence("cache_lengths", cache_lengths, b)
    c.page_table("kv_lookup_table", lookup, b, nonempty=False)
    c.scalar_int("layer_idx", layer_idx)
    c.nonempty("kv_lookup_table", lookup, 1, "max_pages")
    return (ShapedArray(kv.shape, kv.dtype),)


def _store_native(kv, k, v, offsets, cache_lengths, lookup, layer_idx, *, attrs, platform):
    call = jax.ffi.ffi_call(
        "msa_ops_kv_cache_store", (jax.ShapeDtypeStruct(kv.shape, kv.dtype),), input_output_aliases={0: 0}
    )
    return tuple(call(kv, k, v, as_i32(offsets), as_i32(cache_lengths), as_i32(lookup), as_i32(layer_idx)))


KV_CACHE_STORE = register(OpDef(
    name=_ST,
    operands=("kv_blocks", "k", "v", "input_row_offsets", "cache_lengths", "kv_lookup_table", "layer_idx"),
    attr_defaults={},
    normalize=lambda a: a,
    abstract=_store_abstract,
    reference=lambda *a, attrs: ref.kv_cache_store_ragged_paged(*a),
    native=_store_native,
    ffi_target="msa_ops_kv_cache_store",
    doc="Write ragged new K/V rows into their pages (in place when kv_blocks is donated).",
))


def _ro_abstract(offsets, cache_lengths, *, attrs):
    c = Check(_RO)
    b = c.offsets("input_row_offsets", offsets)
    c.per_sequence("cache_lengths", cache_lengths, b)
    return (ShapedArray((b + 1,), jnp.int32),)


def _ro_native(offsets, cache_lengths, *, attrs, platform):
    call = jax.ffi.ffi_call("msa_ops_kv_cache_row_offsets", (jax.ShapeDtypeStruct(offsets.shape, jnp.int32),))
    return tuple(call(as_i32(offsets), as_i32(cache_lengths)))


KV_CACHE_ROW_OFFSETS = register(OpDef(
    name=_RO,
    operands=("input_row_offsets", "cache_lengths"),
    attr_defaults={},
    normalize=lambda a: a,
    abstract=_ro_abstract,
    reference=lambda *a, attrs: ref.kv_cache_row_offsets_ragged_paged(*a),
    native=_ro_native,
    ffi_target="msa_ops_kv_cache_row_offsets",
    doc="cache_row_offsets: exclusive cumsum of cache_length + new rows per sequence.",
))

