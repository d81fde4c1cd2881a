"""MiniMax Sparse Attention: ``mo.msa.attention.ragged.paged`` and ``mo.msa.indexer.ragged.paged``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from .. import routing
from ..errors import attribute_error
from ..reference import msa as ref
from ..reference.common import as_i32
from ..registry import OpDef, check_operands, register
from .common import (
    FLOATS,
    FP8,
    HINT_DEFAULTS,
    MAX_PARTITIONS,
    Check,
    norm_hints,
    norm_int,
    norm_scale,
    resolved_scale,
)
from .mha import _check_paged_cache

F32 = jnp.float32
BLOCK = 128
HEAD_DIM = 128
MSA_DTYPES = (jnp.bfloat16, FP8)

_AT = "mo.msa.attention.ragged.paged"
_IX = "mo.msa.indexer.ragged.paged"


def _msa_normalize(a: dict[str, Any]) -> dict[str, Any]:
    a["scale"] = norm_scale(_AT, a["scale"])
    a["num_partitions"] = norm_int(_AT, "num_partitions", a["num_partitions"], 0, MAX_PARTITIONS)
    norm_hints(_AT, a)
    return a


def _msa_check(q, offsets, cache_row_offsets, kv, cache_lengths, lookup, layer_idx, d_indices):
    c = Check(_AT)
    c.rank("q", q, 3, "[T, H, 128]")
    c.dtype("q", q, MSA_DTYPES)
    t, h, d = q.shape
    if d != HEAD_DIM:
        c.dim("q", q, 2, HEAD_DIM, "head_dim (MSA requires 128)")
    b = c.offsets("input_row_offsets", offsets)
    c.offsets("cache_row_offsets", cache_row_offsets, b)
    _check_paged_cache(c, kv, "q", q, d, b, cache_lengths, lookup, layer_idx, kv_dtypes=MSA_DTYPES)
    c.same_dtype("kv_blocks", kv, "q", q)
    if kv.shape[3] != BLOCK:
        c.dim("kv_blocks", kv, 3, BLOCK, "page_size (MSA blocks are one 128-token page)")
    hkv = kv.shape[4]
    c.heads("q", h, "kv_blocks", hkv)
    c.rank("d_indices", d_indices, 3, "[n_kv_heads, T, topk]")
    c.ints("d_indices", d_indices)
    c.dim("d_indices", d_indices, 0, hkv, "n_kv_heads")
    c.dim("d_indices", d_indices, 1, t, "T")
    return t, h, d


def _msa_plan(q, offsets, cache_row_offsets, kv, cache_lengths, lookup, layer_idx, d_indices, *, attrs):
    t, h, _ = q.shape
    return routing.plan_msa(
        total_rows=t, batch=offsets.shape[0] - 1, n_heads=h, n_kv_heads=kv.shape[4],
        topk=d_indices.shape[2], max_keys_static=lookup.shape[1] * kv.shape[3],
        num_partitions=attrs.num_partitions, max_prompt_length=attrs.max_prompt_length,
        kv_fp8=np.dtype(kv.dtype).itemsize == 1,
    )


CUDA_MAX_TOPK = 256


def _msa_native_supports(*avals, attrs, platform) -> str | None:
    topk = avals[7].shape[2]
    if platform == "cuda" and topk > CUDA_MAX_TOPK:
        return f"the CUDA kernel takes topk <= {CUDA_MAX_TOPK}, got {topk}"
    return None


def _msa_abstract(*avals, attrs):
    t, h, d = _msa_check(*avals)
    plan = _msa_plan(*avals, attrs=attrs)
    npw = plan.workspace_partitions
    return (
        ShapedArray((t, h, d), jnp.bfloat16),
        ShapedArray((npw, t, h, d), F32),
        ShapedArray((npw, t, h), F32),
    )


def _msa_reference(*args, attrs):
    plan = _msa_plan(*args, attrs=attrs)
    return ref.msa_attention_ragged_paged(
        *args, scale=resolved_scale(attrs, HEAD_DIM), workspace_partitions=plan.workspace_partitions
    )


def _msa_native(q, offsets, cache_row_offsets, kv, cache_lengths, lookup, layer_idx, d_indices, *, attrs,
                platform):
    plan = _msa_plan(q, offsets, cache_row_offsets, kv, cache_lengths, lookup, layer_idx, d_indices, attrs=attrs)
    t, h, d = q.shape
    npw = plan.workspace_partitions
    outs = (
        jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((npw, t, h, d), F32),
        jax.ShapeDtypeStruct((npw, t, h), F32),
    )
    call = jax.ffi.ffi_call("msa_ops_msa_attention", outs)
    return tuple(call(
        q, as_i32(offsets), as_i32(cache_row_offsets), kv, as_i32(cache_lengths), as_i32(lookup),
        as_i32(layer_idx), as_i32(d_indices),
        scale=np.float64(resolved_scale(attrs, HEAD_DIM)), num_partitions=np.int64(plan.num_partitions),
        max_q=np.int64(plan.max_q),
    ))


def _msa_cache_row_offsets_default(named):
    """An omitted cache_row_offsets: no implementation reads its values (docs/SEMANTICS.md §7), so nothing
    computes it; input_row_offsets (same shape) fills the operand once the two operands it would be derived
    from are checked."""
    offsets, cache_lengths = named["input_row_offsets"], named["cache_lengths"]
    if offsets is not None and cache_lengths is not None:
        check_operands(_AT, {"input_row_offsets": offsets, "cache_lengths": cache_lengths})
    return offsets


MSA_ATTENTION = register(OpDef(
    name=_AT,
    operands=("q", "input_row_offsets", "cache_row_offsets", "kv_blocks", "cache_lengths", "kv_lookup_table",
              "layer_idx", "d_indices"),
    operand_defaults={"cache_row_offsets": _msa_cache_row_offsets_default},
    attr_defaults={"scale": None, "num_partitions": 0, **HINT_DEFAULTS},
    normalize=_msa_normalize,
    abstract=_msa_abstract,
    reference=_msa_reference,
    native=_msa_native,
    ffi_target="msa_ops_msa_attention",
    plan=_msa_plan,
    native_supports=_msa_native_supports,
    doc="Block-sparse top-k attention over the paged cache (MiniMax Sparse Attention).",
))


# ---------------------------------------------------------------------------------------------------------
# indexer

INDEXER_DTYPES = FLOATS + (FP8,)


def _ix_normalize(a: dict[str, Any]) -> dict[str, Any]:
    if a["topk"] is None:
        raise attribute_error(_IX, "topk", "an int >= 1; it is required", None)
    a["topk"] = norm_int(_IX, "topk", a["topk"], 1, 4096)
    a["init_blocks"] = norm_int(_IX, "init_blocks", a["init_blocks"], 0)
    a["local_blocks"] = norm_int(_IX, "local_blocks", a["local_blocks"], 0)
    if a["init_blocks"] + a["local_blocks"] > a["topk"]:
        raise attribute_error(
            _IX, "init_blocks + local_blocks", f"<= topk ({a['topk']})", a["init_blocks"] + a["local_blocks"]
        )
    a["scale"] = norm_scale(_IX, a["scale"])
    norm_hints(_IX, a)
    return a


def _ix_abstract(q, offsets, k_blocks, k_cache_lengths, k_lookup, layer_idx, *, attrs):
    c = Check(_IX)
    c.rank("q", q, 3, "[T, Hi, Di]")
    c.dtype("q", q, INDEXER_DTYPES)
    c.nonempty("q", q, 1, "Hi (index heads)")
    c.nonempty("q", q, 2, "Di (index head dim)")
    t, hi, di = q.shape
    b = c.offsets("input_row_offsets", offsets)
    c.rank("k_blocks", k_blocks, 6, "[num_blocks, 1, num_layers, 128, 1, Di]")
    c.same_dtype("k_blocks", k_blocks, "q", q)
    for axis, want, what in ((1, 1, "1 (keys only)"), (3, BLOCK, "page_size 128"), (4, 1, "1 index head"),
                             (5, di, "Di of 'q'")):
        c.dim("k_blocks", k_blocks, axis, want, what)
    for axis, what in ((0, "num_blocks"), (2, "num_layers")):
        c.nonempty("k_blocks", k_blocks, axis, what)
    c.per_sequence("k_cache_lengths", k_cache_lengths, b)
    c.page_table("k_lookup_table", k_lookup, b)
    c.scalar_int("layer_idx", layer_idx)
    return (ShapedArray((hi, t, attrs.topk), jnp.int32),)


def _ix_reference(q, offsets, k_blocks, k_cache_lengths, k_lookup, layer_idx, *, attrs):
    return ref.msa_indexer_ragged_paged(
        q, offsets, k_blocks, k_cache_lengths, k_lookup, layer_idx, topk=attrs.topk,
        init_blocks=attrs.init_blocks, local_blocks=attrs.local_blocks, scale=resolved_scale(attrs, q.shape[2]),
    )


#: Largest max_pages (blocks per sequence) the CUDA indexer sorts in shared memory.
CUDA_INDEXER_MAX_PAGES = 8192


def _ix_native_supports(q, offsets, k_blocks, k_cache_lengths, k_lookup, layer_idx, *, attrs, platform):
    if platform != "cuda":
        return None
    row_bytes = q.shape[2] * np.dtype(q.dtype).itemsize
    chunks = row_bytes // 16
    if row_bytes % 16 or chunks > 32 or chunks & (chunks - 1):
        return f"the CUDA indexer takes index key rows of 16, 32, ..., 512 bytes, got {row_bytes}"
    if k_lookup.shape[1] > CUDA_INDEXER_MAX_PAGES:
        return f"the CUDA indexer takes max_pages <= {CUDA_INDEXER_MAX_PAGES}, got {k_lookup.shape[1]}"
    return None


def _ix_native(q, offsets, k_blocks, k_cache_lengths, k_lookup, layer_idx, *, attrs, platform):
    t, hi, di = q.shape
    outs = [jax.ShapeDtypeStruct((hi, t, attrs.topk), jnp.int32)]
    if platform == "cuda":  # per-block scores between the CUDA score and top-k kernels (dropped here)
        outs.append(jax.ShapeDtypeStruct((t, hi, k_lookup.shape[1]), F32))
    call = jax.ffi.ffi_call("msa_ops_msa_indexer", tuple(outs))
    res = call(
        q, as_i32(offsets), k_blocks, as_i32(k_cache_lengths), as_i32(k_lookup), as_i32(layer_idx),
        topk=np.int64(attrs.topk), init_blocks=np.int64(attrs.init_blocks),
        local_blocks=np.int64(attrs.local_blocks), scale=np.float64(resolved_scale(attrs, di)),
    )
    return (res[0],)


MSA_INDEXER = register(OpDef(
    name=_IX,
    operands=("q", "input_row_offsets", "k_blocks", "k_cache_lengths", "k_lookup_table", "layer_idx"),
    attr_defaults={"topk": None, "init_blocks": 0, "local_blocks": 0, "scale": None, **HINT_DEFAULTS},
    normalize=_ix_normalize,
    abstract=_ix_abstract,
    reference=_ix_reference,
    native=_ix_native,
    ffi_target="msa_ops_msa_indexer",
    native_supports=_ix_native_supports,
    doc="MSA block indexer: per-block max score over causal keys, forced init/local blocks, top-k ids.",
))
