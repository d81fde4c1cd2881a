"""The dispatch ladder: which kernel, tile and split-K partition count a call uses.

Pure Python over static shapes and hints; nothing here reads device data, so the route of any call can be
inspected (``msa_ops.plan``) without running a kernel, and every implementation (reference, CPU, CUDA)
sizes its split-K workspace from the same plan. Hints only steer speed: every route is correct for every
input that the shapes admit.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Key-tile width used for split-K partition alignment (SPEC.md op 6, ``BN``).
SPLIT_K_BLOCK_N = 64
#: Multiprocessors of the GPU the ladder is tuned for (H200 / H100 SXM: 132).
DEFAULT_SM_COUNT = 132
#: Decode CTAs the ladder aims to keep resident per multiprocessor (split-K fills the machine to this).
DECODE_CTAS_PER_SM = 2
#: Rows (query tokens x query heads of one kv head) one MMA query tile holds.
Q_TILE_ROWS = 64
#: Longest query run (tokens per sequence) MSA routes as speculative decode.
MSA_SPECULATIVE_MAX_Q = 8
MAX_PARTITIONS = 32


def get_num_partitions(batch: int, max_cache_valid_length: int, *, n_kv_heads: int, sm_count: int) -> int:
    """``mo.mha.decode.get_num_partitions`` on static ints (SPEC.md op 6)."""
    work = max(1, batch * n_kv_heads)
    by_sm = min(max(sm_count // work, 1), MAX_PARTITIONS)
    by_len = max(1, max_cache_valid_length // 512)
    return min(by_sm, by_len)


def split_k_ranges(num_keys: int, num_partitions: int, block_n: int = SPLIT_K_BLOCK_N) -> list[tuple[int, int]]:
    """Key ranges ``[lo, hi)`` of each split-K partition for a sequence of ``num_keys`` keys (may be empty)."""
    np_ = max(1, num_partitions)
    per = -(-num_keys // np_) if num_keys > 0 else 0
    s = max(block_n, -(-per // block_n) * block_n)
    out = []
    for p in range(np_):
        lo = min(num_keys, p * s)
        hi = min(num_keys, (p + 1) * s)
        out.append((lo, hi))
    return out


@dataclass(frozen=True)
class Plan:
    """The route one call takes. ``num_partitions`` sizes the split-K workspace."""

    op: str
    route: str  # "decode" | "speculative" | "prefill" | "elementwise"
    kernel: str  # "1q_split_k" | "2q" | "msa_decode_split_k" | "msa_speculative" | "msa_prefill" | ...
    tile_m: int  # query-tile height in rows of (query token x query head)
    tile_n: int  # key-tile width
    num_partitions: int
    max_q: int  # query tokens per sequence the route assumes (hint or estimate)
    max_keys: int  # keys per sequence the route assumes (hint or static bound)
    group: int  # query heads per kv head
    why: str

    @property
    def workspace_partitions(self) -> int:
        return self.num_partitions if self.num_partitions > 1 else 0


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def estimate_max_q(total_rows: int, batch: int, max_prompt_length: int | None) -> int:
    """Tokens per sequence: the hint if given, else the most one sequence can hold if none is empty."""
    if max_prompt_length is not None:
        return max(1, min(int(max_prompt_length), max(total_rows, 1)))
    if batch <= 0:
        return max(1, total_rows)
    return max(1, total_rows - batch + 1)


def plan_mha(
    op: str,
    *,
    total_rows: int,
    batch: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    max_keys_static: int,
    num_partitions: int = 0,
    max_prompt_length: int | None = None,
    max_cache_length: int | None = None,
    sm_count: int = DEFAULT_SM_COUNT,
    paged: bool = True,
) -> Plan:
    """Ladder for the dense ``mo.mha.*`` ops.

    1. Query tokens per sequence ``max_q``: the ``max_prompt_length`` hint, else ``T - B + 1``.
    2. If a sequence's ``max_q x group`` rows fit one 64-row query tile, the call is decode-like: one query
       tile per CTA (all query heads of a kv head and all tokens of the sequence) and split-K over the keys
       (``1q_split_k``; tile_m 8 when the rows fit 8, which the CUDA kernel runs transposed, keys on the MMA's
       16-row side; else 16 or the rows rounded up to 16); the partition count is
       ``get_num_partitions(B, max_keys)`` with the SM count doubled (two decode CTAs resident per SM), unless
       ``num_partitions`` overrides it.
    3. Otherwise it is prefill: two 64-row query tiles per CTA (``2q``, tile_m 128) when a sequence has at
       least 128 rows, else one (tile_m 64); no split unless ``num_partitions`` asks for one. Past head dim 128
       the 128-row tile exists on sm_90 only (its wgmma kernel); elsewhere the CUDA handler runs 64-row tiles.
    """
    group = max(1, n_heads // max(1, n_kv_heads))
    max_q = estimate_max_q(total_rows, batch, max_prompt_length)
    if max_cache_length is not None:
        max_keys = max(1, min(max_keys_static, int(max_cache_length) + max_q))
    else:
        max_keys = max(1, max_keys_static)
    rows = max_q * group
    if rows <= Q_TILE_ROWS:
        tile_m = 8 if rows <= 8 else 16 if rows <= 16 else _align_up(rows, 16)
        auto = get_num_partitions(batch, max_keys, n_kv_heads=n_kv_heads, sm_count=sm_count * DECODE_CTAS_PER_SM)
        np_ = num_partitions if num_partitions > 0 else auto
        route = "decode" if max_q == 1 else "speculative"
        why = (
            f"max_q*group = {max_q}*{group} = {rows} rows fit one {Q_TILE_ROWS}-row tile; "
            f"partitions {'override' if num_partitions > 0 else 'get_num_partitions'} = {np_}"
        )
        return Plan(op, route, "1q_split_k", tile_m, SPLIT_K_BLOCK_N, np_, max_q, max_keys, group, why)
    tile_m = 128 if max_q >= 128 else 64
    kernel = "2q" if tile_m == 128 else "1q"
    np_ = num_partitions if num_partitions > 0 else 1
    why = f"max_q*group = {rows} rows > {Q_TILE_ROWS}: prefill, {kernel} tiles of {tile_m} rows"
    if head_dim > 128 and tile_m == 128:
        why += f" (head_dim {head_dim}: 64-row tiles where the GPU has no sm_90 kernel for it)"
    return Plan(op, "prefill", kernel, tile_m, 128 if head_dim <= 128 else 64, np_, max_q, max_keys, group, why)


def plan_msa(
    *,
    total_rows: int,
    batch: int,
    n_heads: int,
    n_kv_heads: int,
    topk: int,
    max_keys_static: int,
    num_partitions: int = 0,
    max_prompt_length: int | None = None,
    sm_count: int = DEFAULT_SM_COUNT,
    kv_fp8: bool = False,
) -> Plan:
    """Ladder for ``mo.msa.attention.ragged.paged``: decode (max_q 1), speculative (2..8), prefill (> 8).

    Decode splits the ``topk`` selected blocks over partitions: ``min(clamp(f * sm_count // (B*Hkv), 1, 32),
    max(1, topk // 4))`` unless ``num_partitions`` overrides it (capped at ``topk``); f = 2 for fp8 KV with
    ``topk >= 64``, else 1. (Aiming at two CTAs per SM, as dense decode does, measured slower for bf16: the
    per-CTA slot compaction is repeated per partition. fp8 decode is bound by its instructions rather than its
    loads, and a second CTA per SM hides their latency: on an H200 at B=32, Hkv=4, topk 64, two partitions took
    88-89 µs against 93-94 with one, in the same run; at topk 16 they took longer, 33.5 against 30.0 µs.)
    """
    group = max(1, n_heads // max(1, n_kv_heads))
    max_q = estimate_max_q(total_rows, batch, max_prompt_length)
    op = "mo.msa.attention.ragged.paged"
    if max_q == 1:
        factor = 2 if kv_fp8 and topk >= 64 else 1
        by_sm = factor * sm_count // max(1, batch * n_kv_heads)
        auto = min(max(1, min(by_sm, MAX_PARTITIONS)), max(1, topk // 4))
        np_ = num_partitions if num_partitions > 0 else auto
        np_ = max(1, min(np_, max(1, topk)))
        tile_m = 16 if group <= 16 else _align_up(group, 16)
        why = f"one query per sequence: split {topk} blocks over {np_} partitions"
        return Plan(op, "decode", "msa_decode_split_k", tile_m, 128, np_, 1, max_keys_static, group, why)
    if max_q <= MSA_SPECULATIVE_MAX_Q:
        why = f"{max_q} queries per sequence (<= {MSA_SPECULATIVE_MAX_Q}): per-token causal speculative route"
        tile_m = _align_up(max_q * group, 16)
        np_ = max(1, min(num_partitions, max(1, topk))) if num_partitions > 0 else 1
        return Plan(op, "speculative", "msa_speculative", tile_m, 128, np_, max_q, max_keys_static, group, why)
    why = (f"{max_q} queries per sequence: block-sparse prefill, 128-row tiles that read each selected block once "
           "per tile (CUDA sm_90, bf16, one partition; per token otherwise)")
    np_ = max(1, min(num_partitions, max(1, topk))) if num_partitions > 0 else 1
    return Plan(op, "prefill", "msa_prefill", 128, 128, np_, max_q, max_keys_static, group, why)
