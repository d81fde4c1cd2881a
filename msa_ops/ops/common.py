"""Shape/dtype checks and attribute normalization shared by the op families."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from ..errors import attribute_error, dtype_error, operand_error
from ..reference.common import MASKS

FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8 = jnp.dtype(jnp.float8_e4m3fn)
INTS = (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32))
HINTS = ("max_prompt_length", "max_cache_length", "total_context_length", "msa_scalar_args",
         "mha_decode_dispatch_metadata")
HINT_DEFAULTS: dict[str, Any] = {h: None for h in HINTS}
MAX_PARTITIONS = 64


def dtname(dts) -> str:
    return " or ".join(str(jnp.dtype(d)) for d in dts)


class Check:
    """Raises the op's errors naming operand, expectation and what came."""

    def __init__(self, op: str):
        self.op = op

    def rank(self, name: str, a: ShapedArray, r: int, layout: str) -> None:
        if len(a.shape) != r:
            raise operand_error(self.op, name, f"rank {r} {layout}", f"shape {tuple(a.shape)} (rank {len(a.shape)})")

    def dtype(self, name: str, a: ShapedArray, allowed) -> None:
        if jnp.dtype(a.dtype) not in tuple(jnp.dtype(d) for d in allowed):
            raise dtype_error(self.op, name, dtname(allowed), jnp.dtype(a.dtype))

    def ints(self, name: str, a: ShapedArray) -> None:
        self.dtype(name, a, INTS)

    def dim(self, name: str, a: ShapedArray, axis: int, want: int, what: str) -> None:
        if a.shape[axis] != want:
            raise operand_error(self.op, name, f"{what} = {want} (axis {axis})", f"shape {tuple(a.shape)}")

    def nonempty(self, name: str, a: ShapedArray, axis: int, what: str) -> None:
        if a.shape[axis] < 1:
            raise operand_error(self.op, name, f"{what} >= 1 (axis {axis})", f"shape {tuple(a.shape)}")

    def shape_error(self, name: str, expected: str, a: ShapedArray):
        return operand_error(self.op, name, expected, f"shape {tuple(a.shape)}")

    def same_dtype(self, name: str, a: ShapedArray, ref_name: str, ref: ShapedArray) -> None:
        if jnp.dtype(a.dtype) != jnp.dtype(ref.dtype):
            raise dtype_error(self.op, name, f"{jnp.dtype(ref.dtype)} (the dtype of '{ref_name}')", jnp.dtype(a.dtype))

    def scalar_int(self, name: str, a: ShapedArray) -> None:
        if len(a.shape) != 0:
            raise operand_error(self.op, name, "an int32 scalar (rank 0)", f"shape {tuple(a.shape)}")
        self.ints(name, a)

    def per_sequence(self, name: str, a: ShapedArray, batch: int) -> None:
        """An int vector with one entry per sequence, [B]."""
        self.rank(name, a, 1, "[B]")
        self.ints(name, a)
        self.dim(name, a, 0, batch, "B")

    def page_table(self, name: str, a: ShapedArray, batch: int, nonempty: bool = True) -> None:
        """An int page table [B, max_pages]; max_pages >= 1 unless `nonempty` is False (checked later)."""
        self.rank(name, a, 2, "[B, max_pages]")
        self.ints(name, a)
        self.dim(name, a, 0, batch, "B")
        if nonempty:
            self.nonempty(name, a, 1, "max_pages")

    def offsets(self, name: str, a: ShapedArray, batch: int | None = None) -> int:
        self.rank(name, a, 1, "[B+1]")
        self.ints(name, a)
        if a.shape[0] < 1:
            raise operand_error(self.op, name, "at least one entry [B+1]", f"shape {tuple(a.shape)}")
        if batch is not None and a.shape[0] != batch + 1:
            raise operand_error(self.op, name, f"[B+1] = [{batch + 1}]", f"shape {tuple(a.shape)}")
        return a.shape[0] - 1

    def heads(self, q_name: str, h: int, kv_name: str, hkv: int) -> int:
        if h < 1 or hkv < 1 or h % hkv != 0:
            raise operand_error(
                self.op, q_name,
                f"a positive number of query heads divisible by the kv heads of '{kv_name}' ({hkv})", f"H = {h}",
            )
        return h // hkv


def is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def norm_int(op: str, name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v):
        raise attribute_error(op, name, "an int", v)
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"an int in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise attribute_error(op, name, rng, v)
    return v


def norm_scale(op: str, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise attribute_error(op, "scale", "a finite float or None (1/sqrt(D))", v)
    v = float(v)
    if not math.isfinite(v):
        raise attribute_error(op, "scale", "a finite float", v)
    return v


def norm_mask(op: str, attrs: dict[str, Any]) -> None:
    m = attrs["mask_str"]
    if not isinstance(m, str):
        raise attribute_error(op, "mask_str", f"one of {MASKS}", m)
    name = m.strip().lower()
    name = name.removesuffix("_mask")
    if name not in MASKS:
        raise attribute_error(op, "mask_str", f"one of {MASKS}", m)
    attrs["mask_str"] = name
    w = attrs["local_window_size"]
    if not is_int(w):
        raise attribute_error(op, "local_window_size", "an int", w)
    w = int(w)
    if not -(2**63) <= w < 2**63:  # an i64 attribute of the native handlers
        raise attribute_error(op, "local_window_size", "an int that fits in int64", w)
    if name in ("sliding_window_causal", "sliding_window_noncausal", "chunked_causal") and w <= 0:
        raise attribute_error(op, "local_window_size", f"an int > 0 for mask_str={name!r}", w)
    attrs["local_window_size"] = w


def norm_hints(op: str, attrs: dict[str, Any]) -> None:
    for h in HINTS:
        if h in attrs and attrs[h] is not None:
            attrs[h] = norm_int(op, h, attrs[h], lo=0)


def resolved_scale(attrs, d: int) -> float:
    s = attrs.scale
    return float(1.0 / math.sqrt(d)) if s is None else float(s)
