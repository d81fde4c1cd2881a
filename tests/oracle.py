"""Independent float64 NumPy oracle for every op of ``shared/SPEC.md``.

Written straight from SPEC.md and docs/SEMANTICS.md, with plain Python loops over sequences, rows and heads
(vectorized with NumPy over keys and head dims only). It does not import ``msa_ops`` and it is exact: there is
no split-K here (split-K is an implementation detail whose result must equal the exact softmax).

Inputs are NumPy arrays (bf16 / f16 / f32 / float8_e4m3fn float arrays; int32 / uint32 integer arrays). Floats
are upcast to float64 inside; integer operands are read as int32 (a uint32 bit pattern is reinterpreted, so
0xFFFFFFFF reads -1), as the native lowering does. Attention ops return float64 arrays (the caller compares
them with the op's output, which is in q's dtype / bf16); the indexer returns int32 ids; the KV store returns
an array of kv_blocks' dtype; row offsets return int32.
"""

from __future__ import annotations

import math

import numpy as np

MASKS = ("null", "causal", "sliding_window_causal", "sliding_window_noncausal", "chunked_causal")
SPLIT_K_BLOCK_N = 64  # kSplitKBlockN (SEMANTICS.md §6); unused by the exact oracle, kept for tests.


# ----------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------
def f64(x) -> np.ndarray:
    """Upcast a float array (any of bf16 / f16 / f32 / fp8 / f64) to float64."""
    return np.asarray(x).astype(np.float64)


def as_i32(x) -> np.ndarray:
    """Read an integer operand as int32 (uint32 bit patterns reinterpreted), returned as int64 for arithmetic."""
    x = np.asarray(x)
    if x.dtype == np.uint32:
        x = x.view(np.int32)
    elif x.dtype != np.int32:
        x = x.astype(np.int64).astype(np.int32)
    return x.astype(np.int64)


def scalar_i32(x) -> int:
    return int(as_i32(np.asarray(x).reshape(())))


def normalize_mask(mask_str: str) -> str:
    m = mask_str.removesuffix("_mask")
    if m not in MASKS:
        raise ValueError(f"unknown mask {mask_str!r}")
    return m


def repair_offsets(offsets, n_rows: int) -> np.ndarray:
    """SEMANTICS §1: eff[j] = min(n_rows, max(0, max_{i<=j} offsets[i]))."""
    o = as_i32(offsets)
    return np.minimum(n_rows, np.maximum(0, np.maximum.accumulate(o)))


def paged_sequences(input_row_offsets, n_rows: int, cache_lengths, s_max: int):
    """The sequences of a ragged batch over a paged cache that own rows: (b, r0, n, c) with rows r0 .. r0+n-1
    (repaired offsets, SEMANTICS §1) and the cache length c clamped to [0, s_max]."""
    eff = repair_offsets(input_row_offsets, n_rows)
    cl = as_i32(cache_lengths)
    for b in range(len(cl)):
        r0, r1 = int(eff[b]), int(eff[b + 1])
        if r1 > r0:
            yield b, r0, r1 - r0, int(np.clip(cl[b], 0, s_max))


def visible(mask: str, p: np.ndarray, k: np.ndarray, window: int) -> np.ndarray:
    """Mask predicate of SPEC.md (key existence is applied separately). p: [n, 1], k: [1, K] -> [n, K]."""
    mask = normalize_mask(mask)
    if mask == "null":
        return np.ones(np.broadcast_shapes(p.shape, k.shape), bool)
    if mask == "causal":
        return k <= p
    if mask in ("sliding_window_causal", "sliding_window_noncausal", "chunked_causal") and window <= 0:
        raise ValueError(f"mask {mask} needs local_window_size > 0, got {window}")
    # Positions and keys are int32, so every |p - k| and every chunk index is the same under any window past 2^33:
    # capping it keeps the int64 arithmetic below from wrapping for windows up to 2^63 - 1.
    window = min(int(window), 2**33)
    if mask == "sliding_window_causal":
        return (k <= p) & (p - k < window)
    if mask == "sliding_window_noncausal":
        return k + window > p
    # chunked_causal
    return (k <= p) & (np.floor_divide(p, window) == np.floor_divide(k, window))


def softmax_attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, vis: np.ndarray, scale: float,
                   sink: float | None = None) -> np.ndarray:
    """Exact attention of rows q[n, D] over keys K[N, D] / values V[N, Dv] under a visibility mask vis[n, N].

    out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j}); a row with no visible key outputs 0.
    """
    n = q.shape[0]
    out = np.zeros((n, V.shape[-1]), np.float64)
    if K.shape[0] == 0 or n == 0:
        return out
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite keys no row may see are masked just below
        s = scale * (q @ K.T)
    s = np.where(vis, s, -np.inf)
    has = vis.any(axis=1)
    if not has.any():
        return out
    s, v_rows = s[has], vis[has]
    m = s.max(axis=1, keepdims=True)
    if sink is not None and sink > -np.inf:
        m = np.maximum(m, sink)
    e = np.where(v_rows, np.exp(s - m), 0.0)
    den = e.sum(axis=1, keepdims=True)
    if sink is not None and sink > -np.inf:
        den = den + np.exp(sink - m)
    # A key a row does not see contributes nothing to it, not even 0 * NaN: rows that see a non-finite value row
    # are summed over their own keys only.
    bad = ~np.isfinite(V).all(axis=1)
    if bad.any():
        num = e @ np.where(bad[:, None], 0.0, V)
        for i in np.nonzero((v_rows & bad[None, :]).any(axis=1))[0]:
            num[i] = e[i, v_rows[i]] @ V[v_rows[i]]
    else:
        num = e @ V
    out[has] = num / den
    return out


def gather_paged_keys(kv_blocks, lut_row: np.ndarray, layer: int, n_keys: int, kv: int | None):
    """Keys 0..n_keys-1 of one sequence from a paged pool.

    kv_blocks: [NB, 2, L, P, Hkv, D] (kv selects 0 = K / 1 = V) or [NB, 1, L, P, 1, D] (kv = 0).
    Returns (X float64 [n_keys, Hkv, D], exists bool [n_keys]); a key exists iff its page id is in [0, NB) and
    0 <= layer < L (the caller already limited n_keys to min(num_keys, S_max)).
    """
    NB, _, L, P, Hkv, D = kv_blocks.shape
    k = np.arange(n_keys)
    X = np.zeros((n_keys, Hkv, D), np.float64)
    if n_keys == 0 or not (0 <= layer < L):
        return X, np.zeros(n_keys, bool)
    pages = lut_row[k // P]
    exists = (pages >= 0) & (pages < NB)
    if exists.any():
        X[exists] = f64(kv_blocks[pages[exists], kv, layer, (k % P)[exists]])
    return X, exists


def _layout(kv_blocks, kv_lookup_table):
    NB, _, L, P, Hkv, D = kv_blocks.shape
    lut = as_i32(kv_lookup_table)
    MP = lut.shape[1]
    return NB, L, P, Hkv, D, lut, MP * P


def _default_scale(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


# ----------------------------------------------------------------------------------------------------------
# 1-2. mo.mha.ragged.paged (+ .sink_weights)
# ----------------------------------------------------------------------------------------------------------
def mha_ragged_paged(q, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, *,
                     mask_str="causal", local_window_size=-1, scale=None, sink_weights=None, **_ignored):
    qf = f64(q)
    T, H, Dq = qf.shape
    _NB, _L, _P, _Hkv, D, lut, s_max = _layout(kv_blocks, kv_lookup_table)
    scale = _default_scale(scale, Dq)
    sinks = None if sink_weights is None else f64(sink_weights)
    layer = scalar_i32(layer_idx)
    out = np.zeros((T, H, D), np.float64)
    for b, r0, n, c in paged_sequences(input_row_offsets, T, cache_lengths, s_max):
        out[r0:r0 + n] = _paged_attend(qf[r0:r0 + n], kv_blocks, lut[b], layer, c, s_max, mask_str,
                                       local_window_size, scale, sinks)
    return out


def _paged_attend(qs, kv_blocks, lut_row, layer, c, s_max, mask_str, window, scale, sinks=None):
    """Query rows qs[n, H, Dq] of one sequence, at positions c .. c+n-1, over its paged keys -> [n, H, D]."""
    n, H, _ = qs.shape
    group = H // kv_blocks.shape[4]
    n_keys = min(c + n, s_max)
    K, exists = gather_paged_keys(kv_blocks, lut_row, layer, n_keys, 0)
    V, _ = gather_paged_keys(kv_blocks, lut_row, layer, n_keys, 1)
    p = (c + np.arange(n))[:, None]
    vis = visible(mask_str, p, np.arange(n_keys)[None, :], window) & exists[None, :]
    out = np.zeros((n, H, kv_blocks.shape[5]), np.float64)
    for h in range(H):
        g = h // group
        out[:, h] = softmax_attend(qs[:, h], K[:, g], V[:, g], vis, scale, None if sinks is None else float(sinks[h]))
    return out


# ----------------------------------------------------------------------------------------------------------
# 3. mo.mha.padded.paged
# ----------------------------------------------------------------------------------------------------------
def mha_padded_paged(q, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, valid_lengths, *,
                     mask_str="causal", local_window_size=-1, scale=None, **_ignored):
    qf = f64(q)
    B, S, H, Dq = qf.shape
    _NB, _L, _P, _Hkv, D, lut, s_max = _layout(kv_blocks, kv_lookup_table)
    scale = _default_scale(scale, Dq)
    cl = as_i32(cache_lengths)
    vl = as_i32(valid_lengths)
    layer = scalar_i32(layer_idx)
    out = np.zeros((B, S, H, D), np.float64)
    for b in range(B):
        n = int(np.clip(vl[b], 0, S))
        if n > 0:
            c = int(np.clip(cl[b], 0, s_max))
            out[b, :n] = _paged_attend(qf[b, :n], kv_blocks, lut[b], layer, c, s_max, mask_str, local_window_size,
                                       scale)
    return out


# ----------------------------------------------------------------------------------------------------------
# 4. mo.mha.ragged.no_cache
# ----------------------------------------------------------------------------------------------------------
def mha_ragged_no_cache(q, k, v, input_row_offsets, kv_input_row_offsets=None, *, mask_str="causal",
                        local_window_size=-1, scale=None, **_ignored):
    qf, kf, vf = f64(q), f64(k), f64(v)
    T, H, Dq = qf.shape
    Tk, Hkv, D = vf.shape
    group = H // Hkv
    scale = _default_scale(scale, Dq)
    eff = repair_offsets(input_row_offsets, T)
    keff = repair_offsets(input_row_offsets if kv_input_row_offsets is None else kv_input_row_offsets, Tk)
    out = np.zeros((T, H, D), np.float64)
    for b in range(len(eff) - 1):
        r0, r1 = int(eff[b]), int(eff[b + 1])
        k0, k1 = int(keff[b]), int(keff[b + 1])
        n, nk = r1 - r0, k1 - k0
        if n <= 0:
            continue
        p = (nk - n + np.arange(n))[:, None]  # may be negative
        vis = visible(mask_str, p, np.arange(nk)[None, :], local_window_size)
        for h in range(H):
            g = h // group
            out[r0:r1, h] = softmax_attend(qf[r0:r1, h], kf[k0:k1, g], vf[k0:k1, g], vis, scale)
    return out


# ----------------------------------------------------------------------------------------------------------
# 5. mo.mha.padded.no_cache
# ----------------------------------------------------------------------------------------------------------
def mha_padded_no_cache(q, k, v, valid_length, *, mask_str="causal", local_window_size=-1, scale=None,
                        **_ignored):
    qf, kf, vf = f64(q), f64(k), f64(v)
    B, S, H, Dq = qf.shape
    _, Sk, Hkv, D = vf.shape
    group = H // Hkv
    scale = _default_scale(scale, Dq)
    vl = as_i32(valid_length)
    out = np.zeros((B, S, H, D), np.float64)
    for b in range(B):
        n_q = int(np.clip(vl[b], 0, S))
        n_k = int(np.clip(vl[b], 0, Sk))
        if n_q == 0:
            continue
        p = (n_k - n_q + np.arange(n_q))[:, None]
        vis = visible(mask_str, p, np.arange(n_k)[None, :], local_window_size)
        for h in range(H):
            g = h // group
            out[b, :n_q, h] = softmax_attend(qf[b, :n_q, h], kf[b, :n_k, g], vf[b, :n_k, g], vis, scale)
    return out


# ----------------------------------------------------------------------------------------------------------
# 6. mo.mha.decode.get_num_partitions
# ----------------------------------------------------------------------------------------------------------
def get_num_partitions(batch: int, max_cache_valid_length: int, *, n_kv_heads: int, sm_count: int) -> int:
    by_sm = min(max(sm_count // max(1, batch * n_kv_heads), 1), 32)  # SEMANTICS.md: a batch <= 0 divides by 1
    by_len = max(1, max_cache_valid_length // 512)
    return min(by_sm, by_len)


def split_k_ranges(n_keys: int, num_partitions: int, block_n: int = SPLIT_K_BLOCK_N):
    """Key ranges [lo, hi) of the split-K partitions (SEMANTICS §6); used only by the oracle self-check."""
    per = -(-n_keys // num_partitions) if num_partitions > 0 else n_keys
    s = max(block_n, -(-per // block_n) * block_n)
    return [(p * s, min(n_keys, (p + 1) * s)) for p in range(num_partitions)]


# ----------------------------------------------------------------------------------------------------------
# 7. mo.msa.attention.ragged.paged
# ----------------------------------------------------------------------------------------------------------
def msa_attention_ragged_paged(q, input_row_offsets, cache_row_offsets, kv_blocks, cache_lengths,
                               kv_lookup_table, layer_idx, d_indices, *, scale=None, **_ignored):
    del cache_row_offsets  # SEMANTICS §7: accepted for MAX compatibility, values not read.
    qf = f64(q)
    T, H, Dq = qf.shape
    _NB, _L, P, Hkv, D, lut, s_max = _layout(kv_blocks, kv_lookup_table)
    MP = lut.shape[1]
    assert P == 128, "MSA needs page_size 128"
    group = H // Hkv
    scale = _default_scale(scale, Dq)
    idx = as_i32(d_indices)  # [Hkv, T, topk]
    layer = scalar_i32(layer_idx)
    out = np.zeros((T, H, D), np.float64)
    for b, r0, n, c in paged_sequences(input_row_offsets, T, cache_lengths, s_max):
        num_keys = c + n
        n_keys = min(num_keys, s_max)
        K, exists = gather_paged_keys(kv_blocks, lut[b], layer, n_keys, 0)
        V, _ = gather_paged_keys(kv_blocks, lut[b], layer, n_keys, 1)
        kpos = np.arange(n_keys)
        for i in range(n):
            t, p = r0 + i, c + i
            for g in range(Hkv):
                ids = {int(j) for j in idx[g, t] if 0 <= j < MP and 128 * j < num_keys}
                in_sel = np.zeros(n_keys, bool)
                for j in ids:
                    in_sel[128 * j: 128 * (j + 1)] = True
                vis = (in_sel & exists & (kpos <= p))[None, :]
                for h in range(g * group, (g + 1) * group):
                    out[t, h] = softmax_attend(qf[t:t + 1, h], K[:, g], V[:, g], vis, scale)[0]
    return out


# ----------------------------------------------------------------------------------------------------------
# 8. mo.msa.indexer.ragged.paged
# ----------------------------------------------------------------------------------------------------------
def select_blocks(eligible: np.ndarray, scores: np.ndarray, topk: int, init_blocks: int, local_blocks: int):
    """SEMANTICS §8 selection for one (head, row): eligible bool [nblk], scores float [nblk] -> sorted ids."""
    elig = [int(j) for j in np.flatnonzero(eligible)]
    if len(elig) <= topk:
        return elig
    forced = elig[:init_blocks] + (elig[len(elig) - local_blocks:] if local_blocks > 0 else [])
    forced_set = set(forced)
    rest = sorted((j for j in elig if j not in forced_set), key=lambda j: (-scores[j], j))
    return sorted(forced_set | set(rest[: topk - len(forced_set)]))


def msa_indexer_scores(q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table, layer_idx, *,
                       scale=None):
    """Per (index head, row, block) scores and eligibility: (scores f64 [Hi, T, MP], eligible bool [T, MP]).

    Ineligible blocks (and padding rows) have score -inf and eligible False.
    """
    qf = f64(q)
    T, Hi, Di = qf.shape
    _NB, _, _L, P, _, _ = k_blocks.shape
    lut = as_i32(k_lookup_table)
    MP = lut.shape[1]
    s_max = MP * P
    scale = _default_scale(scale, Di)
    layer = scalar_i32(layer_idx)
    scores = np.full((Hi, T, MP), -np.inf)
    eligible = np.zeros((T, MP), bool)
    for b, r0, n, c in paged_sequences(input_row_offsets, T, k_cache_lengths, s_max):
        n_keys = min(c + n, s_max)
        K, exists = gather_paged_keys(k_blocks, lut[b], layer, n_keys, 0)
        K = K[:, 0]  # [n_keys, Di]
        kpos = np.arange(n_keys)
        blk = kpos // P
        for i in range(n):
            t, p = r0 + i, c + i
            vis = exists & (kpos <= p)
            s = scale * (qf[t] @ K.T)  # [Hi, n_keys]
            for j in np.unique(blk[vis]):
                sel = vis & (blk == j)
                eligible[t, j] = True
                scores[:, t, j] = s[:, sel].max(axis=1)
    return scores, eligible


def msa_indexer_ragged_paged(q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table, layer_idx, *,
                             topk, init_blocks=0, local_blocks=0, scale=None, return_scores=False, **_ignored):
    if init_blocks + local_blocks > topk:
        raise ValueError("init_blocks + local_blocks must be <= topk")
    T, Hi, _ = np.shape(q)
    scores, eligible = msa_indexer_scores(q, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
                                          layer_idx, scale=scale)
    out = np.full((Hi, T, topk), -1, np.int32)
    for h in range(Hi):
        for t in range(T):
            if not eligible[t].any():
                continue
            ids = select_blocks(eligible[t], scores[h, t], topk, init_blocks, local_blocks)
            out[h, t, : len(ids)] = ids
    if return_scores:
        return out, scores, eligible
    return out


# ----------------------------------------------------------------------------------------------------------
# 9. mo.kv_cache.store.ragged.paged
# ----------------------------------------------------------------------------------------------------------
def kv_cache_store_ragged_paged(kv_blocks, k, v, input_row_offsets, cache_lengths, kv_lookup_table, layer_idx,
                                **_ignored):
    out = np.array(kv_blocks, copy=True)
    NB, _, L, P, _Hkv, _D = out.shape
    lut = as_i32(kv_lookup_table)
    s_max = lut.shape[1] * P
    T = np.shape(k)[0]
    eff = repair_offsets(input_row_offsets, T)
    cl = as_i32(cache_lengths)
    layer = scalar_i32(layer_idx)
    if not (0 <= layer < L):
        return out
    k = np.asarray(k).astype(out.dtype)
    v = np.asarray(v).astype(out.dtype)
    for b in range(len(cl)):
        c = max(0, int(cl[b]))
        for i in range(int(eff[b + 1] - eff[b])):
            pos = c + i
            if pos >= s_max:
                break
            page = int(lut[b, pos // P])
            if not (0 <= page < NB):
                continue
            row = int(eff[b]) + i
            out[page, 0, layer, pos % P] = k[row]
            out[page, 1, layer, pos % P] = v[row]
    return out


# ----------------------------------------------------------------------------------------------------------
# 10. mo.kv_cache.row_offsets.ragged.paged
# ----------------------------------------------------------------------------------------------------------
def kv_cache_row_offsets_ragged_paged(input_row_offsets, cache_lengths, **_ignored):
    """SEMANTICS §10 (only monotone, non-negative input offsets are well defined here: no T to clamp to)."""
    o = as_i32(input_row_offsets)
    eff = np.maximum(0, np.maximum.accumulate(o))
    cl = as_i32(cache_lengths)
    out = np.zeros(len(cl) + 1, np.int64)
    for b in range(len(cl)):
        out[b + 1] = out[b] + max(0, int(cl[b])) + int(eff[b + 1] - eff[b])
    return out.astype(np.int32)
