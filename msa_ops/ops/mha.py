"""The dense ``mo.mha.*`` ops: paged (ragged / padded) and no-cache (ragged / padded) attention."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from .. import routing
from ..errors import attribute_error
from ..reference import mha as ref
from ..reference.common import MASK_CODES, as_i32
from ..registry import OpDef, register
from .common import (
    FLOATS,
    HINT_DEFAULTS,
    MAX_PARTITIONS,
    Check,
    norm_hints,
    norm_int,
    norm_mask,
    norm_scale,
    resolved_scale,
)

F32 = jnp.float32
MASK_ATTRS: dict[str, Any] = {"mask_str": None, "local_window_size": -1, "scale": None}
MAX_NATIVE_HEAD_DIM = 256


def _norm_attention(op: str, attrs: dict[str, Any], split_k: bool) -> dict[str, Any]:
    if attrs["mask_str"] is None:
        raise attribute_error(op, "mask_str", "a mask name (e.g. 'causal'); it is required", None)
    norm_mask(op, attrs)
    attrs["scale"] = norm_scale(op, attrs["scale"])
    if split_k:
        attrs["num_partitions"] = norm_int(op, "num_partitions", attrs["num_partitions"], 0, MAX_PARTITIONS)
    norm_hints(op, attrs)
    return attrs


def _check_paged_cache(c: Check, kv: ShapedArray, q_name: str, q: ShapedArray, d: int, batch: int,
                       cache_lengths: ShapedArray, lookup: ShapedArray, layer_idx: ShapedArray,
                       kv_dtypes=FLOATS) -> tuple[int, int, int, int]:
    c.rank("kv_blocks", kv, 6, "[num_blocks, 2, num_layers, page_size, n_kv_heads, head_dim]")
    c.dim("kv_blocks", kv, 1, 2, "2 (K and V)")
    c.dtype("kv_blocks", kv, kv_dtypes)
    if kv.shape[5] != d:
        c.dim("kv_blocks", kv, 5, d, f"head_dim of '{q_name}'")
    for axis, what in ((0, "num_blocks"), (2, "num_layers"), (3, "page_size"), (4, "n_kv_heads")):
        c.nonempty("kv_blocks", kv, axis, what)
    c.per_sequence("cache_lengths", cache_lengths, batch)
    c.page_table("kv_lookup_table", lookup, batch)
    c.scalar_int("layer_idx", layer_idx)
    return kv.shape[0], kv.shape[3], kv.shape[4], lookup.shape[1]


def _ws_avals(plan: routing.Plan, rows: int, h: int, d: int) -> tuple[ShapedArray, ShapedArray]:
    npw = plan.workspace_partitions
    return ShapedArray((npw, rows, h, d), F32), ShapedArray((npw, rows, h), F32)


CUDA_HEAD_DIMS = (64, 128, 256)
CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _native_supports(*avals, attrs, platform) -> str | None:
    """Where the native handler does not cover a call, 'auto' lowers it to the reference."""
    d = avals[0].shape[-1]
    if d > MAX_NATIVE_HEAD_DIM:
        return f"head_dim {d} > {MAX_NATIVE_HEAD_DIM}"
    if platform == "cuda":
        if jnp.dtype(avals[0].dtype) not in CUDA_DTYPES:
            return f"the CUDA kernels take bf16/f16, got {jnp.dtype(avals[0].dtype)} (f32 runs the reference)"
        if d not in CUDA_HEAD_DIMS:
            return f"the CUDA kernels take head_dim {CUDA_HEAD_DIMS}, got {d}"
    return None


def _attrs_for_ffi(attrs, d: int) -> dict[str, Any]:
    return {
        "mask": np.int64(MASK_CODES[attrs.mask_str]),
        "window": np.int64(attrs.local_window_size),
        "scale": np.float64(resolved_scale(attrs, d)),
    }


# ---------------------------------------------------------------------------------------------------------
# mo.mha.ragged.paged (+ .sink_weights)

RAGGED_PAGED = ("q", "input_row_offsets", "kv_blocks", "cache_lengths", "kv_lookup_table", "layer_idx")


def _check_q(c: Check, q: ShapedArray, ndim: int, layout: str) -> None:
    """q of every dense op: its rank, a head dim of at least 1, a float dtype."""
    c.rank("q", q, ndim, layout)
    c.nonempty("q", q, ndim - 1, "head_dim")
    c.dtype("q", q, FLOATS)


def _ragged_paged_check(op: str, q, offsets, kv, cache_lengths, lookup, layer_idx, sink=None):
    c = Check(op)
    _check_q(c, q, 3, "[T, H, D]")
    t, h, d = q.shape
    b = c.offsets("input_row_offsets", offsets)
    _check_paged_cache(c, kv, "q", q, d, b, cache_lengths, lookup, layer_idx)
    c.same_dtype("kv_blocks", kv, "q", q)
    c.heads("q", h, "kv_blocks", kv.shape[4])
    if sink is not None:
        c.rank("sink_weights", sink, 1, "[H]")
        c.dim("sink_weights", sink, 0, h, "H")
        c.same_dtype("sink_weights", sink, "q", q)
    return t, h, d, b


def _ragged_paged_plan(op: str):
    def plan(q, offsets, kv, cache_lengths, lookup, layer_idx, *rest, attrs):
        t, h, d = q.shape
        return routing.plan_mha(
            op, total_rows=t, batch=offsets.shape[0] - 1, n_heads=h, n_kv_heads=kv.shape[4], head_dim=d,
            max_keys_static=lookup.shape[1] * kv.shape[3], num_partitions=attrs.num_partitions,
            max_prompt_length=attrs.max_prompt_length, max_cache_length=attrs.max_cache_length,
        )

    return plan


def _ragged_paged_abstract(op: str):
    plan_fn = _ragged_paged_plan(op)

    def abstract(*avals, attrs):
        t, h, d, _ = _ragged_paged_check(op, *avals)
        plan = plan_fn(*avals, attrs=attrs)
        return (ShapedArray(avals[0].shape, avals[0].dtype),) + _ws_avals(plan, t, h, d)

    return abstract


def _ragged_paged_reference(op: str):
    plan_fn = _ragged_paged_plan(op)

    def reference(q, offsets, kv, cache_lengths, lookup, layer_idx, sink=None, *, attrs):
        plan = plan_fn(q, offsets, kv, cache_lengths, lookup, layer_idx, attrs=attrs)
        return ref.mha_ragged_paged(
            q, offsets, kv, cache_lengths, lookup, layer_idx, sink,
            mask=attrs.mask_str, window=attrs.local_window_size, scale=resolved_scale(attrs, q.shape[2]),
            workspace_partitions=plan.workspace_partitions,
        )

    return reference


def _ragged_paged_native(op: str):
    plan_fn = _ragged_paged_plan(op)

    def native(q, offsets, kv, cache_lengths, lookup, layer_idx, sink=None, *, attrs, platform):
        plan = plan_fn(q, offsets, kv, cache_lengths, lookup, layer_idx, attrs=attrs)
        t, h, d = q.shape
        npw = plan.workspace_partitions
        outs = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((npw, t, h, d), F32),
            jax.ShapeDtypeStruct((npw, t, h), F32),
        )
        has_sink = sink is not None
        if sink is None:
            sink = q  # fills the operand slot: read only with has_sink (a zeros array cost a kernel per graph)
        call = jax.ffi.ffi_call("msa_ops_mha_ragged_paged", outs)
        return tuple(call(
            q, as_i32(offsets), kv, as_i32(cache_lengths), as_i32(lookup), as_i32(layer_idx), sink,
            **_attrs_for_ffi(attrs, d), has_sink=np.int64(has_sink),
            num_partitions=np.int64(plan.num_partitions), block_n=np.int64(routing.SPLIT_K_BLOCK_N),
            tile_m=np.int64(plan.tile_m),
        ))

    return native


def _paged_defaults() -> dict[str, Any]:
    return {**MASK_ATTRS, "num_partitions": 0, **HINT_DEFAULTS}


def _define_ragged_paged(name: str, with_sink: bool, doc: str) -> OpDef:
    return register(OpDef(
        name=name,
        operands=RAGGED_PAGED + (("sink_weights",) if with_sink else ()),
        attr_defaults=_paged_defaults(),
        normalize=lambda a, _n=name: _norm_attention(_n, a, split_k=True),
        abstract=_ragged_paged_abstract(name),
        reference=_ragged_paged_reference(name),
        native=_ragged_paged_native(name),
        ffi_target="msa_ops_mha_ragged_paged",
        plan=_ragged_paged_plan(name),
        native_supports=_native_supports,
        doc=doc,
    ))


MHA_RAGGED_PAGED = _define_ragged_paged(
    "mo.mha.ragged.paged", False, "Ragged queries attending to a paged KV cache (prefill, decode, mixed)."
)
MHA_RAGGED_PAGED_SINK = _define_ragged_paged(
    "mo.mha.ragged.paged.sink_weights", True, "mo.mha.ragged.paged with per-head attention sinks."
)


# ---------------------------------------------------------------------------------------------------------
# mo.mha.padded.paged

PADDED_PAGED = ("q", "kv_blocks", "cache_lengths", "kv_lookup_table", "layer_idx", "valid_lengths")
_PP = "mo.mha.padded.paged"


def _padded_paged_check(q, kv, cache_lengths, lookup, layer_idx, valid_lengths):
    c = Check(_PP)
    _check_q(c, q, 4, "[B, S, H, D]")
    b, _s, h, d = q.shape
    _check_paged_cache(c, kv, "q", q, d, b, cache_lengths, lookup, layer_idx)
    c.same_dtype("kv_blocks", kv, "q", q)
    c.heads("q", h, "kv_blocks", kv.shape[4])
    c.per_sequence("valid_lengths", valid_lengths, b)


def _padded_paged_plan(q, kv, cache_lengths, lookup, layer_idx, valid_lengths, *, attrs):
    b, s, h, d = q.shape
    mpl = attrs.max_prompt_length if attrs.max_prompt_length is not None else s
    return routing.plan_mha(
        _PP, total_rows=b * s, batch=b, n_heads=h, n_kv_heads=kv.shape[4], head_dim=d,
        max_keys_static=lookup.shape[1] * kv.shape[3], num_partitions=attrs.num_partitions,
        max_prompt_length=mpl, max_cache_length=attrs.max_cache_length,
    )


def _padded_paged_abstract(*avals, attrs):
    _padded_paged_check(*avals)
    b, s, h, d = avals[0].shape
    plan = _padded_paged_plan(*avals, attrs=attrs)
    return (ShapedArray(avals[0].shape, avals[0].dtype),) + _ws_avals(plan, b * s, h, d)


def _padded_paged_reference(q, kv, cache_lengths, lookup, layer_idx, valid_lengths, *, attrs):
    plan = _padded_paged_plan(q, kv, cache_lengths, lookup, layer_idx, valid_lengths, attrs=attrs)
    return ref.mha_padded_paged(
        q, kv, cache_lengths, lookup, layer_idx, valid_lengths, mask=attrs.mask_str,
        window=attrs.local_window_size, scale=resolved_scale(attrs, q.shape[3]),
        workspace_partitions=plan.workspace_partitions,
    )


def _padded_paged_native(q, kv, cache_lengths, lookup, layer_idx, valid_lengths, *, attrs, platform):
    plan = _padded_paged_plan(q, kv, cache_lengths, lookup, layer_idx, valid_lengths, attrs=attrs)
    b, s, h, d = q.shape
    npw = plan.workspace_partitions
    outs = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((npw, b * s, h, d), F32),
        jax.ShapeDtypeStruct((npw, b * s, h), F32),
    )
    call = jax.ffi.ffi_call("msa_ops_mha_padded_paged", outs)
    return tuple(call(
        q, kv, as_i32(cache_lengths), as_i32(lookup), as_i32(layer_idx), as_i32(valid_lengths),
        **_attrs_for_ffi(attrs, d), num_partitions=np.int64(plan.num_partitions),
        block_n=np.int64(routing.SPLIT_K_BLOCK_N), tile_m=np.int64(plan.tile_m),
    ))


MHA_PADDED_PAGED = register(OpDef(
    name=_PP,
    operands=PADDED_PAGED,
    attr_defaults=_paged_defaults(),
    normalize=lambda a: _norm_attention(_PP, a, split_k=True),
    abstract=_padded_paged_abstract,
    reference=_padded_paged_reference,
    native=_padded_paged_native,
    ffi_target="msa_ops_mha_padded_paged",
    plan=_padded_paged_plan,
    native_supports=_native_supports,
    doc="Padded queries [B, S, H, D] attending to a paged KV cache.",
))


# ---------------------------------------------------------------------------------------------------------
# mo.mha.ragged.no_cache / mo.mha.padded.no_cache

_RN = "mo.mha.ragged.no_cache"
_PN = "mo.mha.padded.no_cache"


def _no_cache_defaults() -> dict[str, Any]:
    return {**MASK_ATTRS, **HINT_DEFAULTS}


def _check_kv_pair(c: Check, k, v, rank: int, layout: str, q, d: int):
    c.rank("k", k, rank, layout)
    c.rank("v", v, rank, layout)
    c.same_dtype("k", k, "q", q)
    c.same_dtype("v", v, "q", q)
    if k.shape[-1] != d:
        c.dim("k", k, rank - 1, d, "head_dim of 'q'")
    if tuple(v.shape) != tuple(k.shape):
        raise c.shape_error("v", f"the shape of 'k' {tuple(k.shape)}", v)
    if k.shape[-2] < 1:
        raise c.shape_error("k", "n_kv_heads >= 1", k)


def _ragged_no_cache_abstract(q, k, v, offsets, kv_offsets, *, attrs):
    c = Check(_RN)
    _check_q(c, q, 3, "[T, H, D]")
    _check_kv_pair(c, k, v, 3, "[Tk, Hkv, D]", q, q.shape[2])
    b = c.offsets("input_row_offsets", offsets)
    c.offsets("kv_input_row_offsets", kv_offsets, b)
    c.heads("q", q.shape[1], "k", k.shape[1])
    return (ShapedArray(q.shape, q.dtype),)


def _ragged_no_cache_reference(q, k, v, offsets, kv_offsets, *, attrs):
    return ref.mha_ragged_no_cache(
        q, k, v, offsets, kv_offsets, mask=attrs.mask_str, window=attrs.local_window_size,
        scale=resolved_scale(attrs, q.shape[2]),
    )


def _ragged_no_cache_native(q, k, v, offsets, kv_offsets, *, attrs, platform):
    call = jax.ffi.ffi_call("msa_ops_mha_ragged_no_cache", (jax.ShapeDtypeStruct(q.shape, q.dtype),))
    return tuple(call(q, k, v, as_i32(offsets), as_i32(kv_offsets), **_attrs_for_ffi(attrs, q.shape[2])))


MHA_RAGGED_NO_CACHE = register(OpDef(
    name=_RN,
    operands=("q", "k", "v", "input_row_offsets", "kv_input_row_offsets"),
    operand_defaults={"kv_input_row_offsets": lambda named: named["input_row_offsets"]},
    attr_defaults=_no_cache_defaults(),
    normalize=lambda a: _norm_attention(_RN, a, split_k=False),
    abstract=_ragged_no_cache_abstract,
    reference=_ragged_no_cache_reference,
    native=_ragged_no_cache_native,
    ffi_target="msa_ops_mha_ragged_no_cache",
    native_supports=_native_supports,
    doc="Ragged attention over contiguous ragged K/V (no cache).",
))


def _padded_no_cache_abstract(q, k, v, valid_length, *, attrs):
    c = Check(_PN)
    _check_q(c, q, 4, "[B, S, H, D]")
    _check_kv_pair(c, k, v, 4, "[B, Sk, Hkv, D]", q, q.shape[3])
    c.dim("k", k, 0, q.shape[0], "B of 'q'")
    c.per_sequence("valid_length", valid_length, q.shape[0])
    c.heads("q", q.shape[2], "k", k.shape[2])
    return (ShapedArray(q.shape, q.dtype),)


def _padded_no_cache_reference(q, k, v, valid_length, *, attrs):
    return ref.mha_padded_no_cache(
        q, k, v, valid_length, mask=attrs.mask_str, window=attrs.local_window_size,
        scale=resolved_scale(attrs, q.shape[3]),
    )


def _padded_no_cache_native(q, k, v, valid_length, *, attrs, platform):
    call = jax.ffi.ffi_call("msa_ops_mha_padded_no_cache", (jax.ShapeDtypeStruct(q.shape, q.dtype),))
    return tuple(call(q, k, v, as_i32(valid_length), **_attrs_for_ffi(attrs, q.shape[3])))


MHA_PADDED_NO_CACHE = register(OpDef(
    name=_PN,
    operands=("q", "k", "v", "valid_length"),
    attr_defaults=_no_cache_defaults(),
    normalize=lambda a: _norm_attention(_PN, a, split_k=False),
    abstract=_padded_no_cache_abstract,
    reference=_padded_no_cache_reference,
    native=_padded_no_cache_native,
    ffi_target="msa_ops_mha_padded_no_cache",
    native_supports=_native_supports,
    doc="Padded attention over padded K/V (no cache).",
))


# ---------------------------------------------------------------------------------------------------------
# mo.mha.decode.get_num_partitions

_GN = "mo.mha.decode.get_num_partitions"


def _gn_normalize(a: dict[str, Any]) -> dict[str, Any]:
    for k in ("n_kv_heads", "sm_count"):
        if a[k] is None:
            raise attribute_error(_GN, k, "an int >= 1; it is required", None)
        a[k] = norm_int(_GN, k, a[k], lo=1, hi=2**63 - 1)  # the native handlers' int64 attributes
    return a


def _gn_abstract(batch, length, *, attrs):
    c = Check(_GN)
    c.scalar_int("batch", batch)
    c.scalar_int("max_cache_valid_length", length)
    return (ShapedArray((), jnp.int32),)


def _gn_reference(batch, length, *, attrs):
    return ref.get_num_partitions(batch, length, n_kv_heads=attrs.n_kv_heads, sm_count=attrs.sm_count)


def _gn_native(batch, length, *, attrs, platform):
    call = jax.ffi.ffi_call("msa_ops_get_num_partitions", (jax.ShapeDtypeStruct((), jnp.int32),))
    return tuple(call(as_i32(batch), as_i32(length), n_kv_heads=np.int64(attrs.n_kv_heads),
                      sm_count=np.int64(attrs.sm_count)))


MHA_GET_NUM_PARTITIONS = register(OpDef(
    name=_GN,
    operands=("batch", "max_cache_valid_length"),
    attr_defaults={"n_kv_heads": None, "sm_count": None},
    normalize=_gn_normalize,
    abstract=_gn_abstract,
    reference=_gn_reference,
    native=_gn_native,
    ffi_target="msa_ops_get_num_partitions",
    doc="Split-K partition count for decode (SPEC.md op 6).",
))
