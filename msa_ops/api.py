"""Pythonic wrappers: one per op, keyword names, MAX operand order."""

from __future__ import annotations

from typing import Any

import jax

from .registry import call

Array = jax.Array


def mha_ragged_paged(
    q: Array, input_row_offsets: Array, kv_blocks: Array, cache_lengths: Array, kv_lookup_table: Array,
    layer_idx: Any, *, mask_str: str = "causal", local_window_size: int = -1, scale: float | None = None,
    num_partitions: int = 0, sink_weights: Array | None = None, implementation: str = "auto", **hints: Any,
) -> Array:
    """Ragged queries over a paged KV cache (``mo.mha.ragged.paged``; with ``sink_weights``,
    ``mo.mha.ragged.paged.sink_weights``).

    Shapes: ``q[T, H, D]`` (bf16/f16/f32), ``input_row_offsets[B+1]`` (int32/uint32),
    ``kv_blocks[num_blocks, 2, num_layers, page_size, Hkv, D]`` (q's dtype), ``cache_lengths[B]``,
    ``kv_lookup_table[B, max_pages]``, ``layer_idx`` an int32 scalar (may be traced), ``sink_weights[H]``.
    Returns ``[T, H, D]`` in q's dtype.

    Sequence b owns rows ``[offsets[b], offsets[b+1])``; its new K/V are already in the cache, so it has
    ``cache_lengths[b] + n_b`` keys and row i sits at position ``cache_lengths[b] + i``. Query head h reads
    kv head ``h // (H // Hkv)``. ``mask_str``: null, causal, sliding_window_causal, sliding_window_noncausal,
    chunked_causal (the last three need ``local_window_size > 0``). ``scale`` defaults to ``1/sqrt(D)``.
    ``num_partitions``: 0 = the routing ladder picks the split-K partition count; > 0 forces it.
    Hints (``max_prompt_length``, ``max_cache_length``, ...) steer routing only.
    Padding rows (past ``offsets[B]``) and rows with no visible key output 0.
    """
    operands = [q, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx]
    name = "mo.mha.ragged.paged"
    if sink_weights is not None:
        operands.append(sink_weights)
        name = "mo.mha.ragged.paged.sink_weights"
    return call(name, *operands, mask_str=mask_str, local_window_size=local_window_size, scale=scale,
                num_partitions=num_partitions, implementation=implementation, **hints)


def mha_padded_paged(
    q: Array, kv_blocks: Array, cache_lengths: Array, kv_lookup_table: Array, layer_idx: Any,
    valid_lengths: Array, *, mask_str: str = "causal", local_window_size: int = -1, scale: float | None = None,
    num_partitions: int = 0, implementation: str = "auto", **hints: Any,
) -> Array:
    """Padded queries ``q[B, S, H, D]`` over a paged KV cache (``mo.mha.padded.paged``).

    Row ``i < valid_lengths[b]`` of sequence b is at position ``cache_lengths[b] + i`` and the sequence has
    ``cache_lengths[b] + valid_lengths[b]`` keys; other rows output 0. Otherwise as ``mha_ragged_paged``.
    """
    return call("mo.mha.padded.paged", q, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, valid_lengths,
                mask_str=mask_str, local_window_size=local_window_size, scale=scale,
                num_partitions=num_partitions, implementation=implementation, **hints)


def mha_ragged_no_cache(
    q: Array, k: Array, v: Array, input_row_offsets: Array, kv_input_row_offsets: Array | None = None, *,
    mask_str: str = "causal", local_window_size: int = -1, scale: float | None = None,
    implementation: str = "auto", **hints: Any,
) -> Array:
    """Ragged attention over contiguous ragged K/V (``mo.mha.ragged.no_cache``).

    ``q[T, H, D]``, ``k, v[Tk, Hkv, D]``; sequence b's queries are rows ``[input_row_offsets[b], ...[b+1])``
    and its keys rows ``[kv_input_row_offsets[b], ...[b+1])`` (default: ``input_row_offsets``). The last
    query of a sequence is aligned with its last key: row i is at position ``kv_len_b - n_b + i``.
    """
    return call("mo.mha.ragged.no_cache", q, k, v, input_row_offsets, kv_input_row_offsets, mask_str=mask_str,
                local_window_size=local_window_size, scale=scale, implementation=implementation, **hints)


def mha_padded_no_cache(
    q: Array, k: Array, v: Array, valid_length: Array, *, mask_str: str = "causal", local_window_size: int = -1,
    scale: float | None = None, implementation: str = "auto", **hints: Any,
) -> Array:
    """Padded attention ``q[B, S, H, D]`` over ``k, v[B, Sk, Hkv, D]`` (``mo.mha.padded.no_cache``).

    Sequence b has ``min(valid_length[b], S)`` query rows and ``min(valid_length[b], Sk)`` keys; the last
    valid query is aligned with the last valid key. Rows past the valid length output 0.
    """
    return call("mo.mha.padded.no_cache", q, k, v, valid_length, mask_str=mask_str,
                local_window_size=local_window_size, scale=scale, implementation=implementation, **hints)


def mha_decode_get_num_partitions(
    batch: Any, max_cache_valid_length: Any, *, n_kv_heads: int, sm_count: int, implementation: str = "auto"
) -> Array:
    """``min(clamp(sm_count // (batch * n_kv_heads), 1, 32), max(1, max_cache_valid_length // 512))`` as an
    int32 scalar (``mo.mha.decode.get_num_partitions``). For static ints use ``routing.get_num_partitions``."""
    return call("mo.mha.decode.get_num_partitions", batch, max_cache_valid_length, n_kv_heads=n_kv_heads,
                sm_count=sm_count, implementation=implementation)


def msa_attention_ragged_paged(
    q: Array, input_row_offsets: Array, cache_row_offsets: Array | None, kv_blocks: Array, cache_lengths: Array,
    kv_lookup_table: Array, layer_idx: Any, d_indices: Array, *, scale: float | None = None,
    num_partitions: int = 0, implementation: str = "auto", **hints: Any,
) -> Array:
    """MiniMax Sparse Attention over the paged cache (``mo.msa.attention.ragged.paged``).

    ``q[T, H, 128]`` and ``kv_blocks[num_blocks, 2, L, 128, Hkv, 128]`` both bf16 or both float8_e4m3fn;
    ``d_indices[Hkv, T, topk]`` are logical 128-token block numbers of the row's sequence (block j = tokens
    ``[128j, 128j+128)``, page ``kv_lookup_table[b, j]``), shared by the ``H // Hkv`` query heads of a kv
    head; -1, repeats and ids past the sequence are ignored. Exact softmax over the selected blocks' keys
    with ``k <= position``. Returns bf16 ``[T, H, 128]``. ``cache_row_offsets`` may be None: no implementation
    reads its values (docs/SEMANTICS.md §7), so nothing computes it; ``input_row_offsets`` (same shape) fills the
    operand, after both operands it would be derived from are checked.
    """
    return call("mo.msa.attention.ragged.paged", q, input_row_offsets, cache_row_offsets, kv_blocks,
                cache_lengths, kv_lookup_table, layer_idx, d_indices, scale=scale,
                num_partitions=num_partitions, implementation=implementation, **hints)


def msa_indexer_ragged_paged(
    q: Array, input_row_offsets: Array, k_blocks: Array, k_cache_lengths: Array, k_lookup_table: Array,
    layer_idx: Any, *, topk: int, init_blocks: int = 0, local_blocks: int = 0, scale: float | None = None,
    implementation: str = "auto", **hints: Any,
) -> Array:
    """MSA block selection (``mo.msa.indexer.ragged.paged``): int32 ``[Hi, T, topk]``.

    ``q[T, Hi, Di]``, ``k_blocks[num_blocks, 1, L, 128, 1, Di]`` (q's dtype). For a query at position p,
    block j's score is ``max_{k in block j, k <= p} scale * q.k``; blocks with no such key are ineligible.
    The first ``init_blocks`` and last ``local_blocks`` eligible blocks are always kept, the rest by score
    (ties: lower id). Ids ascending, padded with -1. ``scale`` defaults to ``1/sqrt(Di)``.
    """
    return call("mo.msa.indexer.ragged.paged", q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
                layer_idx, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks, scale=scale,
                implementation=implementation, **hints)


def kv_cache_store_ragged_paged(
    kv_blocks: Array, k: Array, v: Array, input_row_offsets: Array, cache_lengths: Array, kv_lookup_table: Array,
    layer_idx: Any, *, implementation: str = "auto",
) -> Array:
    """Write new K/V rows into the paged cache (``mo.kv_cache.store.ragged.paged``); returns the updated
    ``kv_blocks``. Row i of sequence b goes to position ``cache_lengths[b] + i``; rows past the page table or
    on an invalid page are dropped. Donate ``kv_blocks`` (``jax.jit(..., donate_argnums=...)``) to update it
    in place."""
    return call("mo.kv_cache.store.ragged.paged", kv_blocks, k, v, input_row_offsets, cache_lengths,
                kv_lookup_table, layer_idx, implementation=implementation)


def kv_cache_row_offsets_ragged_paged(
    input_row_offsets: Array, cache_lengths: Array, *, implementation: str = "auto"
) -> Array:
    """``cache_row_offsets[B+1]``: exclusive cumsum of ``cache_lengths[b] + n_b``
    (``mo.kv_cache.row_offsets.ragged.paged``)."""
    return call("mo.kv_cache.row_offsets.ragged.paged", input_row_offsets, cache_lengths,
                implementation=implementation)
