"""Shared pieces of the reference lowering: integer reads, offset repair, masks, one-row attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

MASKS = ("null", "causal", "sliding_window_causal", "sliding_window_noncausal", "chunked_causal")
MASK_CODES = {name: i for i, name in enumerate(MASKS)}

# Bytes of gathered K/V (as f32) one chunk of query rows may hold; bounds the reference's memory.
_CHUNK_BYTES = 1 << 28


def as_i32(x: jax.Array) -> jax.Array:
    """Integers are read as int32; a uint32 above 2**31 - 1 reads negative (an invalid value)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.int32:
        return x
    if x.dtype == jnp.uint32:
        return lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def repair_offsets(offsets: jax.Array, total: int) -> jax.Array:
    """Monotone, in-range offsets: ``eff[j] = min(total, max(0, max_{i<=j} offsets[i]))``."""
    off = as_i32(offsets)
    return jnp.clip(lax.cummax(off, axis=0), 0, total)


def row_owner(eff: jax.Array, total: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each of ``total`` rows: (sequence b, index i within it, valid). Needs one sequence at least: the callers
    answer a call without one (every row a padding row) before they get here."""
    batch = eff.shape[0] - 1
    t = jnp.arange(total, dtype=jnp.int32)
    b = jnp.searchsorted(eff[1:], t, side="right").astype(jnp.int32)
    valid = (t >= eff[0]) & (b < batch)
    bc = jnp.minimum(b, batch - 1)
    i = t - eff[bc]
    return bc, i, valid


INT32_MAX = 2**31 - 1


def visible(mask: str, window: int, p: jax.Array, k: jax.Array) -> jax.Array:
    """Mask predicate of SPEC.md for query position ``p`` and key position ``k`` (broadcasting; int32, k >= 0; p < 0
    for a no-cache row with more queries before it than keys).

    Written so that no int32 sum can wrap for any window: ``k + W > p`` as ``k > max(p, 0) - W`` (a row at p < 0
    sees every key either way), and a window past int32, which every distance and chunk index fits under, as no
    limit: every key the base mask shows."""
    if mask == "null" or (mask == "sliding_window_noncausal" and window > INT32_MAX):
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(p), jnp.shape(k)), bool)
    if mask == "causal" or (mask in ("sliding_window_causal", "chunked_causal") and window > INT32_MAX):
        return k <= p
    if mask == "sliding_window_causal":
        return (k <= p) & (p - k < window)
    if mask == "sliding_window_noncausal":
        return k > jnp.maximum(p, 0) - window
    if mask == "chunked_causal":
        return (k <= p) & (jnp.floor_divide(p, window) == jnp.floor_divide(k, window))
    raise ValueError(f"unknown mask {mask!r}")


def attend_row(
    q_row: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: jax.Array,
    scale: float,
    sink: jax.Array | None,
) -> jax.Array:
    """Softmax attention of one query row (all heads).

    q_row [H, D]; k, v [Hkv, S, D]; vis [Hkv, S] (or broadcastable); sink [H] or None.
    Returns f32 [H, D]; a head with no visible key gives 0.
    """
    h, d = q_row.shape
    hkv = k.shape[0]
    g = h // hkv
    prec = lax.Precision.HIGHEST
    # The scale goes into q first, as in the native handlers: q.k may overflow f32 where scale * q.k does not.
    qg = (q_row.astype(jnp.float32) * jnp.float32(scale)).reshape(hkv, g, d)
    s = jnp.einsum("kgd,ksd->kgs", qg, k.astype(jnp.float32), precision=prec)
    vis = jnp.broadcast_to(vis, (hkv, k.shape[1]))[:, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    any_vis = jnp.any(vis, axis=-1)  # [Hkv, 1]
    m = jnp.max(s, axis=-1)  # [Hkv, G], -inf when nothing is visible
    if sink is not None:
        sk = sink.astype(jnp.float32).reshape(hkv, g)
        m = jnp.maximum(m, sk)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
    den = jnp.sum(e, axis=-1)
    if sink is not None:
        den = den + jnp.exp(sk - m)
    # A key no row of this kv head sees contributes nothing, not even 0 * NaN: its value row is zeroed first (the
    # pool's pages past a sequence, or of other sequences, may hold anything).
    v = jnp.where(vis[:, 0, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("kgs,ksd->kgd", e, v, precision=prec)
    o = o / jnp.where(den > 0, den, 1.0)[..., None]
    o = jnp.where(any_vis[..., None], o, 0.0)
    return o.reshape(h, d)


def chunk_rows(bytes_per_row: int, total: int) -> int:
    return int(max(1, min(total, _CHUNK_BYTES // max(1, bytes_per_row))))


def map_rows(fn, xs, bytes_per_row: int, total: int):
    """``lax.map`` over rows in chunks that keep the gathered K/V within the memory bound."""
    if total == 0:
        raise AssertionError("map_rows needs at least one row")
    return lax.map(fn, xs, batch_size=chunk_rows(bytes_per_row, total))
