"""Head-parallel sharding under JAX's explicit sharding mode.

Every attention op is independent across kv heads (and the query heads of their groups), and the indexer across
index heads. When a call's operands carry explicit shardings (``jax.sharding.AxisType.Explicit`` mesh axes,
visible in ``jax.typeof(x).sharding``) that shard the head axes and nothing else — the same mesh axes on every
head-axis operand, every other operand replicated — ``registry.call`` runs the op once per shard inside
``jax.shard_map`` and the output keeps the head sharding: no operand is gathered. Any other explicit layout (a
batch or token axis sharded, query heads sharded differently from kv heads, a head count the mesh axis does not
divide) is gathered to replicated operands first and gives a replicated output; Auto-mode arrays take the
ordinary path, where XLA gathers what the op needs.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

# Newer jax has reshard at the top level; older releases only in jax.sharding.
reshard = getattr(jax, "reshard", None) or jax.sharding.reshard

#: op -> ({operand: head axis}, output head axis, output rank)
HEAD_AXES: dict[str, tuple[dict[str, int], int, int]] = {
    "mo.mha.ragged.paged": ({"q": 1, "kv_blocks": 4}, 1, 3),
    "mo.mha.ragged.paged.sink_weights": ({"q": 1, "kv_blocks": 4, "sink_weights": 0}, 1, 3),
    "mo.mha.padded.paged": ({"q": 2, "kv_blocks": 4}, 2, 4),
    "mo.mha.ragged.no_cache": ({"q": 1, "k": 1, "v": 1}, 1, 3),
    "mo.mha.padded.no_cache": ({"q": 2, "k": 2, "v": 2}, 2, 4),
    "mo.msa.attention.ragged.paged": ({"q": 1, "kv_blocks": 4, "d_indices": 0}, 1, 3),
    "mo.msa.indexer.ragged.paged": ({"q": 1}, 0, 3),
    "mo.kv_cache.store.ragged.paged": ({"kv_blocks": 4, "k": 1, "v": 1}, 4, 6),
}


def explicit_spec(x: Any) -> tuple | None:
    """The explicit sharding spec of ``x``, one entry per axis, or None where it has none."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # pragma: no cover - older JAX
        return None
    try:
        sh = typeof(x).sharding
    except Exception:  # noqa: BLE001 - not a JAX value with a type
        return None
    spec = getattr(sh, "spec", None)
    if spec is None:
        return None
    return tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))


def run_head_parallel(fn, name: str, operand_names: tuple[str, ...], arrays: list[Any]):
    """``fn(*arrays)`` once per head shard when the operands' explicit shardings call for it, else None.

    A head-axis operand that arrives replicated (say, sink weights) is first resharded to its heads: a local
    slice on every device, no communication.
    """
    specs = [explicit_spec(x) for x in arrays]
    if all(spec is None or all(e is None for e in spec) for spec in specs):
        return None  # nothing explicitly sharded: the ordinary path
    parallel = head_parallel(name, operand_names, arrays, specs)
    if parallel is None:
        # Explicitly sharded, but not along the heads alone: gather every operand first (what Auto mode does
        # implicitly), so the op sees whole arrays.
        return fn(*[reshard(x, P()) for x in arrays])
    in_specs, out_spec = parallel
    ready = [x if spec == tuple(s) else reshard(x, s) for x, spec, s in zip(arrays, specs, in_specs)]
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_spec)(*ready)


def head_parallel(name: str, operand_names: tuple[str, ...], arrays: list[Any], specs: list[tuple | None]):
    """(in_specs, out_spec) when the call should run per head shard, else None. ``specs``: ``_spec`` of each
    array."""
    table = HEAD_AXES.get(name)
    if table is None:
        return None
    head_axes, out_axis, out_rank = table
    entry, mesh = None, None
    for operand, x, spec in zip(operand_names, arrays, specs):
        if spec is None:
            continue
        ax = head_axes.get(operand)
        if any(s is not None for i, s in enumerate(spec) if i != ax):
            return None  # sharded along a non-head axis: not a head-parallel layout
        if ax is None or spec[ax] is None:
            continue
        if entry is None:
            entry, mesh = spec[ax], jax.typeof(x).sharding.mesh
        elif spec[ax] != entry:
            return None
    if entry is None:
        return None
    shards = 1
    for axis in entry if isinstance(entry, tuple) else (entry,):
        shards *= dict(mesh.shape)[axis]
    for operand, x in zip(operand_names, arrays):  # every head axis splits evenly (e.g. not one kv head of MQA)
        ax = head_axes.get(operand)
        if ax is not None and x.shape[ax] % shards:
            return None
    in_specs = tuple(
        P(*[entry if i == head_axes.get(operand) else None for i in range(x.ndim)])
        for operand, x in zip(operand_names, arrays)
    )
    out_spec = P(*[entry if i == out_axis else None for i in range(out_rank)])
    return in_specs, out_spec
